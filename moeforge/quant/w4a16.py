"""W4A16: int4 expert weights (groups of 32, 64 or 128 inputs, optional zero points), 16-bit activations.

The weights are in moeforge's int4 layout (:mod:`moeforge.quant.int4_packing`):

* ``w13_qweight`` uint8 ``[E, 2I, H // 2]`` and ``w2_qweight`` uint8 ``[E, H, I // 2]`` (two inputs per
  byte, even input in the low nibble);
* ``w13_scales [E, 2I, H // G]`` and ``w2_scales [E, H, I // G]`` in the layer's dtype;
* with ``zero_points=True``: ``w13_qzeros`` / ``w2_qzeros`` uint8 0..15 with the shapes of the scales;
  without (symmetric): no zero tensors, the zero point is 8;
* optional ``w13_bias [E, 2I]`` and ``w2_bias [E, H]`` in the layer's dtype (GPT-OSS style biases).

``w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``. Activations are not quantized: the method
accepts float rows (bf16/fp16/fp32) after the dispatch and has no preferred dispatch dtype, so a layer
dispatches in its own dtype. The torch backend's GEMM (:class:`W4A16GroupedGemm`) dequantizes one
expert at a time to fp32 and multiplies in fp32; the triton backend's fused GEMM
(:class:`~moeforge.stages.triton_quant.FusedQuantGroupedGemm` with ``WeightFormat.INT4``, kernel
:func:`moeforge.kernels.moe_gemm.moe_gemm`, ``WeightFormat.INT4``) unpacks and dequantizes the int4 weights in
registers.

Weights come from a checkpoint (:meth:`W4A16Method.load_checkpoint_experts`: GPTQ v1/v2 or AWQ, per
expert) or from float weights (:meth:`W4A16Method.quantize_weights`, round-to-nearest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Optional, Union

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import CheckpointError, InputError
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, ExpertRows
from moeforge.expert_checkpoint import Projection
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionWeights
from moeforge.kernels.formats import WeightFormat
from moeforge.quant.base import FOUR_BIT_BLOCKS, QuantMethod, expert_shapes, register_expert_biases
from moeforge.quant.decoded_gemm import decoded_experts
from moeforge.quant.int4_packing import (
    SYMMETRIC_ZERO,
    CheckpointFormat,
    Int4Weight,
    awq_to_int4,
    dequantize_int4,
    gptq_to_int4,
    pack_int4,
)
from moeforge.roles.base import FloatRows, TorchExperts, TritonExperts
from moeforge.spec import FLOAT_DTYPES, Accepts, DType, ScaleLayout, Spec
from moeforge.stage import Stage, StageKind
from moeforge.stages.activation import Activate, ActivationConfig
from moeforge.stages.gemm import (DecodedExperts, GemmRole, expert_gemm_accepts, expert_gemm_output_spec,
                                  expert_rows_gemm, grouped_gemm_padded, grouped_gemm_sorted)
from moeforge.tensor_ref import TensorSource, resolve

GROUP_SIZES = (32, 64, 128)
W13_Q, W13_S, W13_Z = "w13_qweight", "w13_scales", "w13_qzeros"
W2_Q, W2_S, W2_Z = "w2_qweight", "w2_scales", "w2_qzeros"
B13, B2 = "w13_bias", "w2_bias"
_PARAMS = {"w13": (W13_Q, W13_S, W13_Z), "w2": (W2_Q, W2_S, W2_Z)}
# (q - z) for uniform q in 0..15 and z = 8 has standard deviation sqrt(21.5): random weights scaled by
# fan_in ** -0.5 / this have about the spread of the unquantized method's initial weights.
_RANDOM_INT4_STD = 21.5**0.5


# -- quantization (float -> int4) ----------------------------------------------------------------------


def quantize_int4(weight: torch.Tensor, group_size: int, *, zero_points: bool = True,
                  scale_dtype: Optional[torch.dtype] = None) -> Int4Weight:
    """Round-to-nearest int4 quantization of ``weight [..., N, K]`` in groups of ``group_size`` inputs.

    With zero points, each group maps ``[min(w, 0), max(w, 0)]`` onto 0..15 (the range holds 0, so
    the zero point is an exact integer and a constant or all-zero group is exact); symmetric,
    ``scale = absmax / 7`` and the zero point is 8. Scales are rounded to ``scale_dtype`` (default:
    the weight's dtype) *before* the integers are chosen, so the stored pair is consistent.
    """
    if weight.dim() < 2 or not weight.dtype.is_floating_point:
        raise InputError(f"quantize_int4 needs float weights [..., N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    k = weight.shape[-1]
    if group_size < 1 or k % group_size or group_size % 2:
        raise InputError(f"the weights' {k} inputs are not divisible into groups of {group_size}")
    if weight.numel() and not bool(torch.isfinite(weight).all()):
        raise InputError("quantize_int4 got non-finite weights (NaN or inf)")
    w = weight.float().reshape(*weight.shape[:-1], k // group_size, group_size)
    low = w.amin(dim=-1).clamp(max=0)
    scale = (w.amax(dim=-1).clamp(min=0) - low) / 15 if zero_points else w.abs().amax(dim=-1) / 7
    stored = scale.to(scale_dtype or weight.dtype)
    used = stored.float()
    # A zero scale (an all-zero group, or one that underflows the scale dtype) quantizes to the zero
    # point: any finite divisor gives that, 1 avoids 0 / 0.
    divisor = torch.where(used > 0, used, torch.ones_like(used))
    zero = (-low / divisor).round().clamp(0, 15) if zero_points else torch.full_like(used, SYMMETRIC_ZERO)
    q = ((w / divisor.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return Int4Weight(pack_int4(q.reshape(weight.shape)), stored,
                      zero.to(torch.uint8) if zero_points else None)


# -- the grouped GEMM (torch reference) ------------------------------------------------------------------


def int4_experts(weight: Int4Weight) -> DecodedExperts:
    """The experts of ``weight`` for the reference GEMMs, dequantized one at a time (experts without
    rows never are)."""
    tensors = (weight.qweight, weight.scales) + ((weight.qzeros,) if weight.qzeros is not None else ())
    return decoded_experts("int4", tensors)


def int4_gemm_sorted(x: torch.Tensor, counts: torch.Tensor, weight: Int4Weight,
                     bias: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y[r] = x[r] @ dequant(weight[e(r)]).T (+ bias[e(r)]) (* row_scale[r])`` in fp32 for rows
    ``x [R, K]`` grouped by expert ``e`` as ``counts`` says."""
    return grouped_gemm_sorted(Activations(x), counts, int4_experts(weight), bias, row_scale, out_dtype)


def int4_gemm_padded(x: torch.Tensor, weight: Int4Weight, bias: Optional[torch.Tensor] = None,
                     slot_scale: Optional[torch.Tensor] = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y[e, c] = x[e, c] @ dequant(weight[e]).T (+ bias[e]) (* slot_scale[e, c])`` for ``x [E, C, K]``
    (every slot, valid or not, as the unquantized reference does)."""
    return grouped_gemm_padded(Activations(x), int4_experts(weight), bias, slot_scale, out_dtype)


@attrs.frozen(eq=False)
class W4A16GroupedGemm(Stage[ExpertRows, ExpertRows]):
    """One grouped GEMM with int4 weights ``[E, N, K]`` (moeforge's layout) on float rows, either
    expert-grouped layout; the output keeps the rows' dtype. Routing weights can be applied in the
    epilogue (after the bias)."""

    kinds: ClassVar = (StageKind.GEMM,)
    role: GemmRole
    qweight: TensorSource
    scales: TensorSource
    qzeros: Optional[TensorSource] = None
    bias: Optional[TensorSource] = None
    apply_routing_weights: bool = False
    accepts_dtypes: frozenset[DType] = FLOAT_DTYPES

    def __attrs_post_init__(self) -> None:
        weight = self.weight()
        if weight.qweight.dim() != 3:
            raise InputError(f"W4A16GroupedGemm weights must be [E, N, K // 2], got {tuple(weight.qweight.shape)}")
        if self.bias is not None:
            shape = tuple(resolve(self.bias).shape)
            if shape != tuple(weight.qweight.shape[:2]):
                raise InputError(f"W4A16GroupedGemm bias must be [E, N] = {tuple(weight.qweight.shape[:2])}, "
                                 f"got {shape}")

    def weight(self) -> Int4Weight:
        zeros = resolve(self.qzeros) if self.qzeros is not None else None
        return Int4Weight(resolve(self.qweight), resolve(self.scales), zeros)

    @property
    def num_experts(self) -> int:
        return int(resolve(self.qweight).shape[0])

    def summary(self) -> str:
        weight = self.weight()
        extra = ", zero points" if weight.qzeros is not None else ", symmetric"
        if self.bias is not None:
            extra += ", bias"
        if self.apply_routing_weights:
            extra += ", weights in epilogue"
        return (f"W4A16GroupedGemm({self.role.value}, {weight.in_features}->{weight.out_features}, "
                f"int4 g{weight.group_size}{extra})")

    def accepts(self) -> Accepts:
        return expert_gemm_accepts(self.role, dtypes=self.accepts_dtypes, scales=ScaleLayout.NONE,
                                   in_features=self.weight().in_features, num_experts=self.num_experts,
                                   apply_routing_weights=self.apply_routing_weights)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "W4A16 takes 16-bit (or fp32) activations: dispatch in the layer's float dtype"
        return None

    def output_spec(self, spec: Spec) -> Spec:
        return expert_gemm_output_spec(spec, self.role, out_features=self.weight().out_features,
                                       apply_routing_weights=self.apply_routing_weights, out_dtype=None)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        bias = resolve(self.bias) if self.bias is not None else None
        return expert_rows_gemm(x, int4_experts(self.weight()), bias, self.apply_routing_weights, x.x.data.dtype,
                                self.name)


# -- the quant method -------------------------------------------------------------------------------------


class W4A16Method(QuantMethod):
    """Int4 expert weights with 16-bit activations (GPTQ / AWQ style).

    Args:
        group_size: inputs per scale (and zero point): 32, 64 or 128. ``hidden_size`` and
            ``intermediate_size`` must be multiples of it.
        zero_points: asymmetric weights with a 4-bit zero point per group (GPTQ ``sym=False``, AWQ);
            ``False``: symmetric, zero point 8 (GPTQ ``sym=True``).
        checkpoint_format: how :meth:`load_checkpoint_experts` reads a checkpoint: ``"gptq"`` (v1,
            stored zero = zero - 1: what AutoGPTQ writes and most hubs serve), ``"gptq_v2"`` (zeros as
            they are) or ``"awq"`` (AutoAWQ GEMM). Explicit because v1 and v2 cannot be told apart
            from the tensors (GPTQ and AWQ can, by the qweight shape: a mismatch says which it looks
            like).
    """

    row_gradients: ClassVar[bool] = True  # its torch GEMMs decode the weights: rows differentiate (adapters)
    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE})
    dequant_blocks: ClassVar[tuple[tuple[float, int], ...]] = FOUR_BIT_BLOCKS
    prefers: ClassVar[Optional[DispatchDtype]] = None  # no activation quantization: the layer's dtype
    expert_parameters: ClassVar[tuple[str, ...]] = (W13_Q, W13_S, W13_Z, W2_Q, W2_S, W2_Z, B13, B2)
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_qweight", scale="{}_scales", zero_point="{}_qzeros")
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.INT4
    compute_dtype_parameters: ClassVar[tuple[str, ...]] = (W13_S, W2_S, B13, B2)  # scales in the compute dtype

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`TorchW4A16Experts`: the method's reference computation."""
        return TorchW4A16Experts

    def __init__(self, group_size: int = 128, zero_points: bool = True,
                 checkpoint_format: Union[CheckpointFormat, str] = CheckpointFormat.GPTQ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
            raise InputError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        if not isinstance(zero_points, bool):
            raise InputError(f"zero_points must be True or False, got {zero_points!r}")
        self.group_size = group_size
        self.zero_points = zero_points
        self.checkpoint_format = CheckpointFormat.parse(checkpoint_format)

    def __repr__(self) -> str:
        return (f"W4A16Method(group_size={self.group_size}, zero_points={self.zero_points}, "
                f"checkpoint_format={self.checkpoint_format.value!r})")

    @property
    def table_key(self) -> str:
        return f"w4a16-g{self.group_size}" + ("-zeros" if self.zero_points else "")

    # -- weights ------------------------------------------------------------------------------------

    def _check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if value % 2:
                raise InputError(f"{name}={value} is odd: int4 weights pack two inputs per byte")
            if value % self.group_size:
                raise InputError(f"{name}={value} is not divisible by group_size={self.group_size}: choose a "
                                 f"group size in {GROUP_SIZES} that divides it")

    def compute_dtype(self, holder: torch.nn.Module) -> DType:
        """The dtype of the gate/up scales: the float dtype the int4 GEMMs compute and produce."""
        scales = getattr(holder, W13_S, None)
        if isinstance(scales, torch.Tensor) and scales.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return DType.from_torch(scales.dtype)
        return super().compute_dtype(holder)

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
        self._check_sizes(hidden_size, intermediate_size)
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        for prefix, (_, n, k) in shapes.items():
            q_name, s_name, z_name = _PARAMS[prefix]
            groups = (num_experts, n, k // self.group_size)
            # Random valid weights with the unquantized method's spread: a usable layer before loading.
            # Any byte is two valid int4 values: random bytes are random packed weights.
            packed = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, device=device)
            spread = torch.empty(groups, dtype=torch.float32, device=device).uniform_(0.5, 1.5)
            scales = spread * (k**-0.5 / _RANDOM_INT4_STD)
            zeros = torch.randint(6, 11, groups, dtype=torch.uint8, device=device) if self.zero_points else None
            _register(layer, q_name, packed)
            _register(layer, s_name, scales.to(dtype))
            _register(layer, z_name, zeros)
        register_expert_biases(layer, shapes, bias, dtype, device)

    def quantize_weights(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill ``layer``'s int4 weights from float ``w13 [E, 2I, H]`` (``[E, I, H]`` when not gated,
        rows in the layer's gate/up layout) and ``w2 [E, H, I]`` by round-to-nearest
        (:func:`quantize_int4`), e.g. to convert an unquantized layer::

            layer = MoELayer(..., quant=W4A16Method(group_size=64))
            layer.quant.quantize_weights(layer, float_layer.w13_weight, float_layer.w2_weight)

        Biases, the router and shared experts are not touched (copy them as they are)."""
        for prefix, weight in (("w13", w13), ("w2", w2)):
            q_name, s_name, z_name = _PARAMS[prefix]
            target = Int4Weight(getattr(layer, q_name), getattr(layer, s_name), getattr(layer, z_name, None))
            want = (*target.qweight.shape[:-1], target.in_features)
            if tuple(weight.shape) != want:
                raise InputError(f"{prefix} must be {want} to match the layer's {q_name}, got {tuple(weight.shape)}")
            quantized = quantize_int4(weight, self.group_size, zero_points=self.zero_points,
                                      scale_dtype=target.scales.dtype)
            with torch.no_grad():
                target.qweight.copy_(quantized.qweight)
                target.scales.copy_(quantized.scales)
                if target.qzeros is not None and quantized.qzeros is not None:
                    target.qzeros.copy_(quantized.qzeros)
        self.process_weights_after_loading(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the (loaded or hand-filled) tensors: shapes agree with each other and the group size,
        dtypes, zero points within 0..15, finite scales. The layout needs no repacking."""
        dims = _dims(layer)
        for prefix, (n, k) in (("w13", (dims.n13, dims.hidden)), ("w2", (dims.hidden, dims.inter))):
            q_name, s_name, z_name = _PARAMS[prefix]
            scales = getattr(layer, s_name)
            zeros: Optional[torch.Tensor] = getattr(layer, z_name, None)
            groups = (dims.experts, n, k // self.group_size)
            if not scales.dtype.is_floating_point or tuple(scales.shape) != groups:
                raise InputError(f"{s_name} must be float {groups} (group_size={self.group_size}), got "
                                 f"{scales.dtype} {tuple(scales.shape)}")
            if not bool(torch.isfinite(scales).all()):
                raise InputError(f"{s_name} holds non-finite values")
            if self.zero_points != (zeros is not None):
                raise InputError(f"{z_name} is {'missing' if zeros is None else 'set'} but the method has "
                                 f"zero_points={self.zero_points}")
            if zeros is not None:
                if zeros.dtype != torch.uint8 or tuple(zeros.shape) != groups:
                    raise InputError(f"{z_name} must be uint8 {groups}, got {zeros.dtype} {tuple(zeros.shape)}")
                if zeros.numel() and int(zeros.max()) > 15:
                    raise InputError(f"{z_name} holds {int(zeros.max())}: zero points are 4-bit (0..15)")

    # -- checkpoints ------------------------------------------------------------------------------

    def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                        projection: Projection) -> dict[str, torch.Tensor]:
        """One GPTQ or AWQ linear layer (``checkpoint_format``): ``{key}.qweight``, ``scales``,
        ``qzeros`` (optional when ``zero_points=False``; then every zero must be 8) and GPTQ's optional
        ``g_idx`` (trivial order only), in the layer's int4 layout."""
        return self._read(tensors, f"{projection.key}.", projection.out_features, projection.in_features,
                          getattr(layer, W13_S).dtype)

    def _read(self, tensors: Mapping[str, torch.Tensor], where: str, n: int, k: int,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One linear layer ``[n, k]`` named ``where + ...`` -> ``{"qweight", "scales"[, "qzeros"]}``."""
        fmt = self.checkpoint_format

        def get(name: str, required: bool = True) -> Optional[torch.Tensor]:
            key = where + name
            if key in tensors:
                return tensors[key]
            if required:
                raise CheckpointError(f"missing tensor '{key}' ({self!r} reads qweight, scales"
                                      f"{', qzeros' if self.zero_points else ''} per projection)")
            return None

        qweight, scales = get("qweight"), get("scales")
        qzeros = get("qzeros", required=self.zero_points)
        assert qweight is not None and scales is not None
        if fmt is CheckpointFormat.AWQ:
            weight = awq_to_int4(qweight, qzeros, scales, out_features=n, in_features=k,
                                 group_size=self.group_size, dtype=dtype, where=where)
        else:
            weight = gptq_to_int4(qweight, qzeros, scales, get("g_idx", required=False), out_features=n,
                                  in_features=k, group_size=self.group_size,
                                  v1_zeros=fmt is CheckpointFormat.GPTQ, dtype=dtype, where=where)
        out = {"qweight": weight.qweight, "scales": weight.scales}
        if weight.qzeros is not None:
            if self.zero_points:
                out["qzeros"] = weight.qzeros
            elif bool((weight.qzeros != SYMMETRIC_ZERO).any()):
                raise CheckpointError(f"tensor '{where}qzeros' holds zero points other than {SYMMETRIC_ZERO}: "
                                      "the checkpoint is asymmetric; build W4A16Method(zero_points=True)")
        return out

# -- helpers ---------------------------------------------------------------------------------------------


def _register(layer: torch.nn.Module, name: str, value: Optional[torch.Tensor], trainable: bool = False) -> None:
    # Integer tensors cannot require grad; scales are frozen too (nothing here trains int4 weights).
    layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=trainable) if value is not None
                             else None)


def _weight(layer: torch.nn.Module, prefix: str) -> Int4Weight:
    q_name, s_name, z_name = _PARAMS[prefix]
    return Int4Weight(getattr(layer, q_name), getattr(layer, s_name), getattr(layer, z_name, None))


@attrs.frozen
class _Dims:
    experts: int
    n13: int  # gate/up rows: 2I (gated) or I
    hidden: int
    inter: int


def _dims(layer: torch.nn.Module) -> _Dims:
    """The sizes, read from the layer's own tensors (a method object may serve several layers)."""
    q13, q2 = getattr(layer, W13_Q), getattr(layer, W2_Q)
    for name, q in ((W13_Q, q13), (W2_Q, q2)):
        if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 3:
            raise InputError(f"{name} must be a uint8 [E, N, K // 2] tensor (two int4 per byte), got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    dims = _Dims(int(q13.shape[0]), int(q13.shape[1]), 2 * int(q13.shape[2]), 2 * int(q2.shape[2]))
    want = (dims.experts, dims.hidden, dims.inter // 2)
    if tuple(q2.shape) != want:
        raise InputError(f"{W2_Q} must be {want} to match {W13_Q} {tuple(q13.shape)}, got {tuple(q2.shape)}")
    return dims


# -- its experts --------------------------------------------------------------------------------------



class TritonW4A16Experts(TritonExperts):
    """The fused int4 kernels: int4 unpacked and dequantized inside the GEMMs, the activation in the
    gate/up GEMM's epilogue."""

    method: ClassVar[type[Any]] = W4A16Method
    float_rows: ClassVar[FloatRows] = FloatRows.LAYER_DTYPE  # the GEMMs read rows in the layer's dtype

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        from moeforge.stages.triton_quant import FusedQuantGroupedGemm

        configs = cls.launch_table(configs)
        return [
            FusedQuantGroupedGemm.of(GemmRole.GATE_UP, WeightFormat.INT4, weights.gate_up, configs,
                                     activation=activation, out_dtype=weights.dtype),
            FusedQuantGroupedGemm.of(GemmRole.DOWN, WeightFormat.INT4, weights.down, configs,
                                     apply_routing_weights=routing_weights_in_epilogue, out_dtype=weights.dtype),
        ]


class TorchW4A16Experts(TorchExperts):
    """The torch reference: int4 weights dequantized one expert at a time, in fp32."""

    method: ClassVar[type[Any]] = W4A16Method

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        def gemm(role: GemmRole, projection: ProjectionWeights, epilogue: bool) -> W4A16GroupedGemm:
            if projection.scale is None:
                raise InputError("W4A16 expert weights need their scales (the record names none)")
            return W4A16GroupedGemm(role, projection.weight, projection.scale, projection.zero_point,
                                    projection.bias, apply_routing_weights=epilogue, accepts_dtypes=method.accepts)

        return [gemm(GemmRole.GATE_UP, weights.gate_up, False), Activate(activation),
                gemm(GemmRole.DOWN, weights.down, routing_weights_in_epilogue)]
