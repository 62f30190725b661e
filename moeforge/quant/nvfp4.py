"""NVFP4 experts: e2m1 weights in 16-element blocks with e4m3 block scales and a per-expert fp32
global scale (see :mod:`moeforge.quant.fp4`), and optionally NVFP4 activations on the wire.

**On CUDA** the triton experts (:class:`TritonNvfp4Experts`) run the one grouped-GEMM kernel
(:mod:`moeforge.kernels.moe_gemm`): e2m1 codes times e4m3 block scales are exact in bf16/fp16, so the
weights (and NVFP4 rows) are dequantized in registers without rounding, meet in a 16-bit ``tl.dot``,
and the global scales multiply the finished accumulator. **Elsewhere** the torch reference
dequantizes the weights (and NVFP4 activations) to fp32 and multiplies in fp32 (accumulation in fp32,
the result cast to the layer's dtype), at the cost of materialising fp32 weights on every call: the
kernel's oracle, not a fast path.

Weights (``E`` experts, ``H`` hidden, ``I`` intermediate, ``N13 = 2I`` gated or ``I``; ``H % 16 == 0``
and ``I % 16 == 0``):

* ``w13_weight`` uint8 ``[E, N13, H // 2]``, ``w13_weight_scale`` float8_e4m3fn ``[E, N13, H // 16]``,
  ``w13_weight_global_scale`` fp32 ``[E]``; the same for ``w2`` (``[E, H, I // 2]``, ``[E, H, I // 16]``,
  ``[E]``). ``w[e, n, k] = e2m1 * scale[e, n, k // 16] * global_scale[e]`` (ModelOpt's ``weight``,
  ``weight_scale`` and ``weight_scale_2`` in the decode convention, one global scale per expert and
  GEMM). Optional float biases ``w13_bias [E, N13]``, ``w2_bias [E, H]``.

Activations after dispatch: float (bf16/fp16/fp32), or NVFP4 (``DType.NVFP4``,
``ScaleLayout.NVFP4_BLOCK16``) when the method is built with ``input_global_scale``:

* ``Nvfp4Method(input_global_scale=g)`` is a quant config carrying a static input global scale, so it
  *requires* NVFP4 dispatch (rule 3 of :func:`~moeforge.resolve_dispatch_dtype`); its
  :meth:`~Nvfp4Method.quantize_stage` quantizes the tokens to NVFP4 with ``g`` before the dispatch
  (:class:`Nvfp4Quantizer`). ``g`` is in the decode convention (``value = e2m1 * block_scale * g``,
  typically calibrated ``amax / (6 * 448)``, ModelOpt's ``input_scale``; vLLM/FlashInfer pass its
  reciprocal to their kernels).
* **Where the global scale travels**: not in the payload. ``Activations`` carries ``data`` (uint8
  ``[..., H // 2]``) and ``scale`` (e4m3 ``[..., H // 16]``) like every other format; ``g`` is a static
  per-tensor constant of the method, handed to both the quantizer before the dispatch and the GEMM
  after it when the pipeline is built, so the two cannot disagree and the wire carries no extra tensor
  (an all-to-all sends data and block scales only). :meth:`~Nvfp4Method.apply_without_routing_weights`
  reads it from the method too.
* Without ``input_global_scale`` the method takes float activations as they are (W4A16-style
  emulation: only the weights are FP4); an explicit ``dispatch_dtype="nvfp4"`` is then a
  ``ContractError`` (no scale to quantize with) — a dynamic global scale would have to travel with the
  payload, which it cannot.
* The second GEMM's input (the activation output) stays in the layer's dtype: there is no static
  scale for it in this config.

``Nvfp4Method(shuffled=True)`` holds the packed weights in the triton GEMMs' pre-shuffled layout, as
``Mxfp4Method(shuffled=True)`` does (:mod:`moeforge.quant.stored_layout`, :mod:`moeforge.kernels.shuffle`;
interleaved gate/up rows paired, their block scales' rows too; the global scales do not move). It needs ``H`` and
``I`` divisible by 32. The initial weights, ``quantize_weights`` and ``load_state_dict`` store that layout and
``state_dict()`` gives the plain one; tensors written straight into the parameters must be shuffled first
(``StoredLayout.stored``). Its tuned tables are its own (``table_key`` ``"nvfp4-shuffled"``, or
``"nvfp4-nvfp4rows-shuffled"``).

The GEMM stage (:class:`EmulatedGroupedGemm`) is shared with :mod:`moeforge.quant.mxfp4`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional, Union

import attrs
import torch
from typing_extensions import Protocol

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import CheckpointError, ContractError, InputError
from moeforge.kernels.config import ConfigTable
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionWeights
from moeforge.kernels.formats import WeightFormat
from moeforge.payloads import Activations, ExpertRows, RoutedTokens
from moeforge.quant.base import (
    FOUR_BIT_BLOCKS,
    QuantMethod,
    expert_shapes,
    register_expert_biases,
)
from moeforge.quant.fp4 import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    fp4_storage,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from moeforge.quant import stored_layout as layouts
from moeforge.roles.base import FloatRows, TorchExperts, TritonExperts
from moeforge.spec import FLOAT_DTYPES, Accepts, DType, ScaleLayout, Spec
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages.activation import Activate, ActivationConfig
from moeforge.stages.gemm import GemmRole, expert_gemm_accepts, expert_gemm_output_spec, expert_rows_gemm
from moeforge.stages.quantize import QuantizeTokens, Quantizer
from moeforge.tensor_ref import TensorSource, resolve

W13, W13_SCALE, W13_GLOBAL = "w13_weight", "w13_weight_scale", "w13_weight_global_scale"
W2, W2_SCALE, W2_GLOBAL = "w2_weight", "w2_weight_scale", "w2_weight_global_scale"
B13, B2 = "w13_bias", "w2_bias"
NVFP4_NAMES = layouts.PackedNames("{}_weight", "{}_weight_scale")
SHUFFLED_MULTIPLE = 32  # H and I of a shuffled layer: whole 16-byte blocks along K (kernels/shuffle.py)


# -- shared by the emulated FP4 methods -------------------------------------------------------------------


class DequantizableWeight(Protocol):
    """A quantized ``[E, N, K]`` expert weight, read at call time, that dequantizes to fp32."""

    @property
    def format(self) -> str: ...

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def dequantize(self) -> torch.Tensor: ...


@attrs.frozen(eq=False)
class EmulatedGroupedGemm(Stage[ExpertRows, ExpertRows]):
    """A grouped GEMM with quantized weights, emulated: the weights (and NVFP4 rows) are dequantized to
    fp32 at call time and multiplied in fp32 (the math an FP4 kernel does, without FP4 hardware).

    Consumes float rows; NVFP4 rows too when ``input_global_scale`` (their static global scale) is
    set, which then needs an explicit ``out_dtype``. ``out_dtype=None`` keeps the input's float dtype.
    """

    kinds: ClassVar = (StageKind.GEMM,)
    role: GemmRole
    weight: DequantizableWeight
    bias: Optional[TensorSource] = None
    input_global_scale: Optional[float] = None
    apply_routing_weights: bool = False
    out_dtype: Optional[DType] = None

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def summary(self) -> str:
        extra = ", nvfp4 rows" if self.input_global_scale is not None else ""
        extra += ", bias" if self.bias is not None else ""
        extra += ", weights in epilogue" if self.apply_routing_weights else ""
        return (f"EmulatedGroupedGemm({self.role.value}, {self.in_features}->{self.out_features}, "
                f"{self.weight.format} weights -> fp32{extra})")

    def _dtypes(self) -> tuple[frozenset[DType], frozenset[ScaleLayout]]:
        if self.input_global_scale is None:
            return FLOAT_DTYPES, frozenset({ScaleLayout.NONE})
        return FLOAT_DTYPES | {DType.NVFP4}, frozenset({ScaleLayout.NONE, ScaleLayout.NVFP4_BLOCK16})

    def accepts(self) -> Accepts:
        dtypes, scales = self._dtypes()
        accepts = expert_gemm_accepts(self.role, dtypes=dtypes, scales=scales, in_features=self.in_features,
                                      num_experts=self.num_experts, apply_routing_weights=self.apply_routing_weights)
        # NVFP4 rows are dequantized with input_global_scale: only rows quantized with it (float rows: None).
        return attrs.evolve(accepts, global_scale={None, self.input_global_scale})

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout") and self.input_global_scale is None:
            return "these GEMMs take float rows: dispatch a float dtype (NVFP4 rows need input_global_scale)"
        if field == "global_scale":
            return (f"the NVFP4 rows were quantized with global scale {have} but this GEMM dequantizes with "
                    f"{self.input_global_scale}: use one value for the quantizer and the GEMM")
        return None

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if (spec.dtype is DType.NVFP4) != (spec.scale_layout is ScaleLayout.NVFP4_BLOCK16) and not found:
            found.append(Mismatch("scale_layout", spec.scale_layout, "nvfp4_block16 with nvfp4 rows, none with "
                                  "float rows", "NVFP4 rows carry 16-element e4m3 block scales"))
        if self.out_dtype is None and spec.dtype not in FLOAT_DTYPES and not found:
            found.append(Mismatch("dtype", spec.dtype, FLOAT_DTYPES,
                                  "a GEMM consuming quantized rows needs an explicit out_dtype"))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        return expert_gemm_output_spec(spec, self.role, out_features=self.out_features,
                                       apply_routing_weights=self.apply_routing_weights, out_dtype=self.out_dtype)

    def _values(self, x: Activations) -> torch.Tensor:
        if x.data.dtype == torch.uint8:  # NVFP4 rows (accepted only with a global scale)
            assert x.scale is not None and self.input_global_scale is not None
            return dequantize_nvfp4(x.data, x.scale, self.input_global_scale)
        return x.data

    def __call__(self, x: ExpertRows) -> ExpertRows:
        values = Activations(self._values(x.x))
        out_dtype = self.out_dtype.torch_dtype if self.out_dtype is not None else x.x.data.dtype
        bias = resolve(self.bias) if self.bias is not None else None
        rows = x.with_x(values)
        return expert_rows_gemm(rows, self.weight.dequantize(), bias, self.apply_routing_weights, out_dtype, self.name)


# -- NVFP4 --------------------------------------------------------------------------------------------------


def _positive_scale(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a positive finite float, got {value!r}")
    scale = float(value)
    if not (scale > 0 and math.isfinite(scale)):
        raise InputError(f"{name} must be a positive finite float, got {value!r}")
    return scale


@attrs.frozen
class Nvfp4Quantizer(Quantizer):
    """NVFP4 activations with a static global scale: ``data`` uint8 ``[..., W // 2]``, ``scale``
    e4m3 ``[..., W // 16]``; the global scale stays with the quantizer (and the GEMM that reads the
    rows), not in the payload."""

    global_scale: float
    dtype: DType = attrs.field(default=DType.NVFP4, init=False)
    scale_layout: ScaleLayout = attrs.field(default=ScaleLayout.NVFP4_BLOCK16, init=False)
    row_local: ClassVar[bool] = True  # (the global scale is static)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "global_scale", _positive_scale(self.global_scale, "global_scale"))

    def check_width(self, width: int) -> Optional[str]:
        if width % NVFP4_BLOCK:
            return f"NVFP4 quantization needs a width divisible by {NVFP4_BLOCK}, got {width}"
        return None

    def summary(self) -> str:
        return f"nvfp4/{self.scale_layout.value}, global {self.global_scale:g}"

    def __call__(self, x: torch.Tensor) -> Activations:
        q = quantize_nvfp4(x, self.global_scale)
        return Activations(q.data, q.scale)


@attrs.frozen(eq=False)
class Nvfp4WeightRef:
    """An NVFP4 projection of an :class:`~moeforge.expert_weights.ExpertWeights` record (packed weight, block
    scales, global scales, as its holder keeps them: read at call time, the layout undone by :meth:`tensors`)."""

    projection: ProjectionWeights
    format: str = "nvfp4"

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed weight, its block scales (in the plain layout) and its global scales."""
        weight, scale = self.projection.plain()
        if scale is None or self.projection.global_scale is None:
            raise InputError("NVFP4 expert weights need their block scales and global scales")
        return weight, scale, resolve(self.projection.global_scale)

    @property
    def shape(self) -> tuple[int, int, int]:
        data = self.tensors()[0]
        return int(data.shape[0]), int(data.shape[1]), 2 * int(data.shape[2])

    def dequantize(self) -> torch.Tensor:
        data, scale, global_scale = self.tensors()
        return dequantize_nvfp4(data, scale, global_scale)


class Nvfp4Method(QuantMethod):
    """NVFP4 expert weights (see the module docstring for the layout); float activations, or NVFP4
    activations quantized before the dispatch with the static ``input_global_scale``. Triton experts on
    CUDA (:class:`TritonNvfp4Experts`), the emulated torch reference elsewhere. ``shuffled``: the layers hold
    the packed weights in the triton GEMMs' pre-shuffled layout (module docstring)."""

    row_gradients: ClassVar[bool] = True  # its torch GEMMs decode the weights: rows differentiate (adapters)
    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES | {DType.NVFP4}
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE, ScaleLayout.NVFP4_BLOCK16})
    dequant_blocks: ClassVar[tuple[tuple[float, int], ...]] = FOUR_BIT_BLOCKS
    expert_parameters: ClassVar[tuple[str, ...]] = (W13, W13_SCALE, W13_GLOBAL, W2, W2_SCALE, W2_GLOBAL, B13, B2)
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_weight", scale="{}_weight_scale",
                                                         global_scale="{}_weight_global_scale")
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.NVFP4

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`EmulatedNvfp4Experts`: the method's reference computation."""
        return EmulatedNvfp4Experts

    def __init__(self, input_global_scale: Optional[float] = None, *, shuffled: bool = False) -> None:
        self.input_global_scale = (None if input_global_scale is None
                                   else _positive_scale(input_global_scale, "input_global_scale"))
        if not isinstance(shuffled, bool):
            raise InputError(f"shuffled must be a bool, got {shuffled!r}")
        self.shuffled = shuffled

    def __repr__(self) -> str:
        extra = ", shuffled=True" if self.shuffled else ""
        return f"Nvfp4Method(input_global_scale={self.input_global_scale!r}{extra})"

    @property
    def table_key(self) -> str:
        key = "nvfp4" if self.input_global_scale is None else "nvfp4-nvfp4rows"
        return key + "-shuffled" if self.shuffled else key

    def required_dispatch_dtype(self) -> Optional[DispatchDtype]:
        # A quant config carrying a static input global scale means NVFP4 on the wire (rule 3).
        return DispatchDtype.NVFP4 if self.input_global_scale is not None else None

    # -- weights ------------------------------------------------------------------------------------------

    def create_weights(
        self,
        layer: torch.nn.Module,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gated: bool,
        bias: bool,
        dtype: torch.dtype,
        device: Union[torch.device, str, None],
    ) -> None:
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size % NVFP4_BLOCK:
                raise InputError(f"Nvfp4Method needs {name} divisible by {NVFP4_BLOCK} (its block size), "
                                 f"got {size}")
            if self.shuffled and size % SHUFFLED_MULTIPLE:
                raise InputError(f"Nvfp4Method(shuffled=True) needs {name} divisible by {SHUFFLED_MULTIPLE} (whole "
                                 f"shuffled blocks), got {size}: use Nvfp4Method() for this layer")
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        layouts.record_layout(layer, NVFP4_NAMES, shuffled=self.shuffled, gated=gated)
        for prefix, shape in shapes.items():
            data_shape, scale_shape = fp4_storage(shape, NVFP4_BLOCK)
            for suffix, tensor in (
                ("weight", torch.zeros(data_shape, dtype=torch.uint8, device=device)),
                ("weight_scale", torch.zeros(scale_shape, dtype=torch.float8_e4m3fn, device=device)),
                ("weight_global_scale", torch.ones(num_experts, dtype=torch.float32, device=device)),
            ):
                layer.register_parameter(f"{prefix}_{suffix}", torch.nn.Parameter(tensor, requires_grad=False))
        register_expert_biases(layer, shapes, bias, dtype, device)
        # Usable before loading: random N(0, 1/fan_in) weights, quantized. One expert at a time: the float
        # weights of a DeepSeek-V3-size layer would take 45 GB in fp32, and the quantizer's temporaries more.
        for prefix, (experts, rows, width) in shapes.items():
            for expert in range(experts):
                weight = torch.empty((rows, width), device=device).normal_(std=width ** -0.5)
                self._quantize_expert(layer, prefix, expert, weight)

    def quantize_weights(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill ``layer``'s NVFP4 weights from float ``w13 [E, N13, H]`` and ``w2 [E, H, I]`` (one
        global scale per expert and GEMM: its ``amax / (6 * 448)``), one expert at a time."""
        for prefix, weight in (("w13", w13), ("w2", w2)):
            target = getattr(layer, f"{prefix}_weight", None)
            if not isinstance(target, torch.Tensor):
                raise InputError(f"the layer has no {prefix}_weight: call create_weights first")
            want = tuple(target.shape[:2]) + (2 * target.shape[2],)
            if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != want:
                have = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
                raise InputError(f"{prefix} must be a float tensor of shape {list(want)}, got {have}")
            for expert in range(int(target.shape[0])):
                self._quantize_expert(layer, prefix, expert, weight[expert])

    @staticmethod
    def _quantize_expert(layer: torch.nn.Module, prefix: str, expert: int, weight: torch.Tensor) -> None:
        """Quantize one expert's float ``weight [N, K]`` (its own global scale) into ``layer``'s tensors."""
        q = quantize_nvfp4(weight, nvfp4_global_scale(weight))
        layouts.store_expert(layer, NVFP4_NAMES, prefix, expert, q.data, q.scale)
        with torch.no_grad():
            getattr(layer, f"{prefix}_weight_global_scale")[expert].copy_(q.global_scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the loaded tensors (the stored layout is the one the emulated GEMMs read)."""
        w13, w2 = getattr(layer, W13, None), getattr(layer, W2, None)
        if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3:
            raise CheckpointError(f"{W13} and {W2} must be uint8 [E, N, K // 2] tensors")
        experts, gate_up, hidden = int(w13.shape[0]), int(w13.shape[1]), 2 * int(w13.shape[2])
        inter = 2 * int(w2.shape[-1]) if w2.dim() == 3 else -1
        expected = {
            W13: ((experts, gate_up, hidden // 2), torch.uint8),
            W13_SCALE: ((experts, gate_up, hidden // NVFP4_BLOCK), torch.float8_e4m3fn),
            W13_GLOBAL: ((experts,), torch.float32),
            W2: ((experts, hidden, inter // 2), torch.uint8),
            W2_SCALE: ((experts, hidden, inter // NVFP4_BLOCK), torch.float8_e4m3fn),
            W2_GLOBAL: ((experts,), torch.float32),
        }
        for name, (shape, dtype) in expected.items():
            tensor = getattr(layer, name, None)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                have = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else tensor
                raise CheckpointError(f"{name} must be {dtype} of shape {list(shape)}, got {have}")
        for name in (W13_GLOBAL, W2_GLOBAL):
            scale = getattr(layer, name)
            if not bool(((scale > 0) & torch.isfinite(scale)).all()):
                raise CheckpointError(f"{name} must be positive and finite, got {scale.tolist()}")

    # -- stages ---------------------------------------------------------------------------------------------

    def _require_scale(self) -> float:
        if self.input_global_scale is None:
            raise ContractError(
                producer="dispatch nvfp4",
                consumer=f"experts ({self.name})",
                field="input_global_scale",
                have="no global scale (the method was built without input_global_scale)",
                want="a static NVFP4 activation global scale",
                hint="build Nvfp4Method(input_global_scale=...) (the calibrated amax / (6 * 448), "
                "ModelOpt's input_scale), or dispatch a float dtype",
            )
        return self.input_global_scale

    def quantize_stage(
        self, dispatch: DispatchDtype, compute: DType
    ) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        if dispatch is DispatchDtype.NVFP4:
            return QuantizeTokens(Nvfp4Quantizer(self._require_scale()))
        return super().quantize_stage(dispatch, compute)

def optional_tensor(layer: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    value = getattr(layer, name, None)
    return value if isinstance(value, torch.Tensor) else None


# -- its experts --------------------------------------------------------------------------------------


class EmulatedNvfp4Experts(TorchExperts):
    """NVFP4 weights (and NVFP4 rows, with the method's static global scale) dequantized to fp32 in
    torch: the math of an FP4 kernel, without FP4 hardware."""

    method: ClassVar[type[Any]] = Nvfp4Method

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        nvfp4_rows = dispatch is DispatchDtype.NVFP4
        if nvfp4_rows:
            method._require_scale()
        return [
            EmulatedGroupedGemm(GemmRole.GATE_UP, Nvfp4WeightRef(weights.gate_up), weights.gate_up.bias,
                                input_global_scale=method.input_global_scale,
                                out_dtype=weights.dtype if nvfp4_rows else None),
            Activate(activation),
            EmulatedGroupedGemm(GemmRole.DOWN, Nvfp4WeightRef(weights.down), weights.down.bias,
                                apply_routing_weights=routing_weights_in_epilogue),
        ]


class TritonNvfp4Experts(TritonExperts):
    """The one grouped-GEMM kernel on NVFP4 weights (and NVFP4 rows with the method's static global
    scale): dequantized in registers, the global scales in the epilogue with the bias, activation and
    routing weights."""

    method: ClassVar[type[Any]] = Nvfp4Method
    float_rows: ClassVar[FloatRows] = FloatRows.LAYER_DTYPE  # float rows in the compute dtype (out_dtype)

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        from moeforge.stages.triton_quant import FusedQuantGroupedGemm

        configs = cls.launch_table(configs)
        nvfp4_rows = dispatch is DispatchDtype.NVFP4
        layouts.check_gate_up_rows(weights.gate_up.layout, activation, "NVFP4")
        return [
            FusedQuantGroupedGemm.of(GemmRole.GATE_UP, WeightFormat.NVFP4, weights.gate_up, configs,
                                     input_global_scale=method._require_scale() if nvfp4_rows else None,
                                     activation=activation, out_dtype=weights.dtype),
            FusedQuantGroupedGemm.of(GemmRole.DOWN, WeightFormat.NVFP4, weights.down, configs,
                                     apply_routing_weights=routing_weights_in_epilogue, out_dtype=weights.dtype),
        ]
