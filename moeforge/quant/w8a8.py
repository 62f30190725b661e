"""What the FP8 and INT8 W8A8 methods share: weight quantization, the quantized grouped GEMM stage,
the expert stages, ``apply_without_routing_weights`` and checkpoint loading.

Weights are ``[E, N, K]`` (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) in FP8-e4m3 or INT8 with fp32 scales,
either one per output channel (``[E, N]``) or one per 128 x 128 block (``[E, ceil(N/128),
ceil(K/128)]``, DeepSeek-V3's ``weight_scale_inv``, a multiplier despite its name). The dequantized
weight is ``q[n, k] * scale[n]`` or ``q[n, k] * scale[n // 128, k // 128]``. Activations are
quantized per row (one fp32 scale per token) or per 128-element group, and the product accumulates
in fp32. The Triton kernels (:mod:`moeforge.kernels.moe_gemm`, through
:mod:`moeforge.stages.triton_quant`) read these same layouts.

The torch reference dequantizes one expert's weight at a time (never the whole ``[E, N, K]`` tensor:
at DeepSeek-V3's sizes that would be tens of GB in fp32) and multiplies in fp32.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping
from typing import Any, ClassVar, Optional, Protocol, TypeVar, Union, cast

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import CheckpointError, ContractError, InputError
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, ExpertRows, RoutedTokens
from moeforge.expert_checkpoint import Projection
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionWeights
from moeforge.quant.decoded_gemm import BLOCK, decoded_experts, dequantize_weight
from moeforge.quant.base import QuantMethod, expert_shapes, register_expert_biases
from moeforge.roles.base import TorchExperts, TritonExperts
from moeforge.spec import Accepts, DType, ScaleLayout, Spec
from moeforge.stage import Stage, StageKind
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.gemm import (DecodedExperts, GemmRole, expert_gemm_accepts, expert_gemm_output_spec,
                                  expert_rows_gemm, grouped_gemm_padded, grouped_gemm_sorted)
from moeforge.stages.quantize import PerTokenQuantizer, Quantizer, QuantizeRows, QuantizeTokens
from moeforge.tensor_ref import TensorSource, resolve

class QuantizableLayer(Protocol):
    """What :func:`quantize_layer` reads of a layer (:class:`~moeforge.MoELayer` has it: the quant methods sit
    below the layer)."""

    quant: QuantMethod
    activation: ActivationConfig
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype

    def process_weights_after_loading(self) -> None: ...


Layer = TypeVar("Layer", bound=torch.nn.Module)  # a QuantizableLayer

W13, W2 = "w13_weight", "w2_weight"
S13, S2 = "w13_weight_scale", "w2_weight_scale"
B13, B2 = "w13_bias", "w2_bias"
_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


# -- weights ----------------------------------------------------------------------------------------

def quantize_weight_per_channel(weight: torch.Tensor, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` (float) -> ``(q [..., N, K], scale [..., N])``: symmetric, one fp32 scale
    per output channel (row), FP8-e4m3 or INT8 (round to nearest)."""
    quantized = PerTokenQuantizer(dtype)(weight)  # one scale per row of the last dimension
    assert quantized.scale is not None
    return quantized.data, quantized.scale.squeeze(-1)


def quantize_weight_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` (float) -> ``(q [..., N, K] fp8-e4m3, scale [..., ceil(N/128),
    ceil(K/128)])``: one fp32 scale per 128 x 128 block (partial blocks at the edges)."""
    *lead, rows, cols = weight.shape
    nb, kb = _blocks(rows), _blocks(cols)
    # Zero padding to whole blocks changes no block's amax.
    padded = torch.nn.functional.pad(weight.float(), (0, kb * BLOCK - cols, 0, nb * BLOCK - rows))
    tiles = padded.reshape(*lead, nb, BLOCK, kb, BLOCK).transpose(-3, -2).reshape(*lead, nb, kb, BLOCK * BLOCK)
    quantized = PerTokenQuantizer(DType.FP8_E4M3)(tiles)
    assert quantized.scale is not None
    data = quantized.data.reshape(*lead, nb, kb, BLOCK, BLOCK).transpose(-3, -2).reshape(padded.shape)
    return data[..., :rows, :cols].contiguous(), quantized.scale.reshape(*lead, nb, kb)


def scale_shape(rows: int, cols: int, block: bool) -> tuple[int, ...]:
    """The scale shape of one ``[rows, cols]`` weight matrix."""
    return (_blocks(rows), _blocks(cols)) if block else (rows,)


# -- the grouped GEMM -------------------------------------------------------------------------------

def dequantized_experts(weight: torch.Tensor, weight_scale: torch.Tensor) -> DecodedExperts:
    """The experts of a quantized ``weight [E, N, K]`` for the reference GEMMs, dequantized one at a
    time."""
    return decoded_experts("scaled", (weight, weight_scale))


def w8a8_gemm_sorted(
    x: Activations,
    counts: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    row_scale: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y[r] = deq(x)[r] @ deq(weight[e(r)]).T (+ bias) (* row_scale[r])`` in fp32 for rows grouped by
    expert according to ``counts`` (``[E]``), cast to ``out_dtype``."""
    return grouped_gemm_sorted(x, counts, dequantized_experts(weight, weight_scale), bias, row_scale, out_dtype)


def w8a8_gemm_padded(
    x: Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    slot_scale: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y[e, c] = deq(x)[e, c] @ deq(weight[e]).T (+ bias[e]) (* slot_scale[e, c])`` for ``x [E, C, K]``
    (every slot, as the unquantized padded GEMM does; the combine reads only the valid ones)."""
    return grouped_gemm_padded(x, dequantized_experts(weight, weight_scale), bias, slot_scale, out_dtype)


@attrs.frozen(eq=False)
class W8A8GroupedGemm(Stage[ExpertRows, ExpertRows]):
    """A grouped GEMM on quantized rows with quantized weights (torch reference), on either
    expert-grouped layout.

    It consumes rows in exactly one format — ``act_dtype`` with ``act_scales`` — so e.g. per-token FP8
    rows into a per-group method are a ``ContractError`` at build time. ``weight [E, N, K]`` is FP8 or
    INT8 with ``weight_scale [E, N]`` (per channel) or ``[E, ceil(N/128), ceil(K/128)]`` (per block);
    the result is computed in fp32 and cast to ``out_dtype``; biases ``[E, N]`` and the routing
    weights (epilogue, after the bias) are optional.
    """

    kinds: ClassVar = (StageKind.GEMM,)
    role: GemmRole
    weight: TensorSource
    weight_scale: TensorSource
    act_dtype: DType
    act_scales: ScaleLayout
    out_dtype: DType
    bias: Optional[TensorSource] = None
    apply_routing_weights: bool = False

    def __attrs_post_init__(self) -> None:
        weight, scale = resolve(self.weight), resolve(self.weight_scale)
        if weight.dim() != 3 or weight.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"W8A8GroupedGemm weight must be [E, N, K] fp8_e4m3 or int8, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        experts, rows, cols = weight.shape
        allowed = [(experts, *scale_shape(rows, cols, block)) for block in (False, True)]
        if tuple(scale.shape) not in allowed:
            raise ValueError(f"W8A8GroupedGemm weight_scale must be {allowed[0]} (per channel) or "
                             f"{allowed[1]} (per 128x128 block), got {tuple(scale.shape)}")
        if self.act_dtype not in (DType.FP8_E4M3, DType.INT8):
            raise ValueError(f"W8A8GroupedGemm consumes fp8_e4m3 or int8 rows, not {self.act_dtype.value}")
        if self.act_scales not in (ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128):
            raise ValueError(f"W8A8GroupedGemm takes per-token or per-128-group scales, not {self.act_scales.value}")
        if self.out_dtype.is_quantized:
            raise ValueError(f"W8A8GroupedGemm outputs a float dtype, not {self.out_dtype.value}")
        if self.bias is not None and tuple(resolve(self.bias).shape) != (experts, rows):
            raise ValueError(f"W8A8GroupedGemm bias must be [E, N] = {(experts, rows)}, got "
                             f"{tuple(resolve(self.bias).shape)}")

    @property
    def num_experts(self) -> int:
        return int(resolve(self.weight).shape[0])

    @property
    def in_features(self) -> int:
        return int(resolve(self.weight).shape[2])

    @property
    def out_features(self) -> int:
        return int(resolve(self.weight).shape[1])

    def summary(self) -> str:
        weight, scale = resolve(self.weight), resolve(self.weight_scale)
        per = "block128" if scale.dim() == 3 else "channel"
        extra = ", bias" if self.bias is not None else ""
        if self.apply_routing_weights:
            extra += ", weights in epilogue"
        wdtype = DType.from_torch(weight.dtype).value
        return (f"W8A8GroupedGemm({self.role.value}, {self.in_features}->{self.out_features}, "
                f"w={wdtype}/{per}, a={self.act_dtype.value}/{self.act_scales.value}{extra})")

    def accepts(self) -> Accepts:
        return expert_gemm_accepts(self.role, dtypes=self.act_dtype, scales=self.act_scales,
                                   in_features=self.in_features, num_experts=self.num_experts,
                                   apply_routing_weights=self.apply_routing_weights)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return (f"this GEMM reads {self.act_dtype.value} rows with {self.act_scales.value} scales: quantize "
                    "with the quant method's own quantizer (its quantize_stage / QuantizeRows)")
        return None

    def output_spec(self, spec: Spec) -> Spec:
        return expert_gemm_output_spec(spec, self.role, out_features=self.out_features,
                                       apply_routing_weights=self.apply_routing_weights, out_dtype=self.out_dtype)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        experts = dequantized_experts(resolve(self.weight), resolve(self.weight_scale))
        bias = resolve(self.bias) if self.bias is not None else None
        return expert_rows_gemm(x, experts, bias, self.apply_routing_weights, self.out_dtype.torch_dtype, self.name)


# -- the methods' shared body -----------------------------------------------------------------------

class W8A8Method(QuantMethod):
    """Base of :class:`~moeforge.quant.fp8.Fp8W8A8Method` and :class:`~moeforge.quant.int8.Int8W8A8Method`.

    Parameters: ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` in ``weight_dtype``, their fp32
    scales ``w13_weight_scale`` / ``w2_weight_scale`` (per channel or per block), optional float biases
    ``w13_bias [E, 2I]`` / ``w2_bias [E, H]``. The experts accept float rows (quantized after the
    dispatch by the method's own ``QuantizeRows``) or rows already in the method's activation format.
    """

    expert_parameters: ClassVar[tuple[str, ...]] = (W13, W2, S13, S2, B13, B2)
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_weight", scale="{}_weight_scale")
    # 128-row blocks spill the gate/up kernel's registers (two accumulators, per-K-step scales).
    max_block_m: ClassVar[Optional[int]] = 64
    weight_dtype: ClassVar[DType]

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`TorchW8A8Experts`: the method's reference computation."""
        return TorchW8A8Experts

    @property
    @abc.abstractmethod
    def block_weights(self) -> bool:
        """Whether the weight scales are per 128 x 128 block (else per output channel)."""

    @property
    @abc.abstractmethod
    def activation_quantizer(self) -> Quantizer:
        """The quantizer of the activations (before the dispatch, after it, and between the GEMMs)."""

    @property
    def dispatch_dtype(self) -> DispatchDtype:
        """The quantized dispatch dtype the experts consume directly."""
        return DispatchDtype.from_dtype(self.activation_quantizer.dtype)

    # -- weights ----------------------------------------------------------------------------------

    def check_sizes(self, hidden_size: int, intermediate_size: int, gated: bool) -> None:
        """Raise :class:`InputError` for sizes this configuration cannot quantize."""
        if self.activation_quantizer.scale_layout is ScaleLayout.PER_GROUP_128:
            for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
                if size % BLOCK:
                    raise InputError(f"{self.name}: per-128-group activation scales need {name} divisible by "
                                     f"{BLOCK}, got {size}; use activation_scales='token'")
        if self.block_weights and gated and intermediate_size % BLOCK:
            raise InputError(f"{self.name}: 128x128 weight blocks with a gated activation need intermediate_size "
                             f"divisible by {BLOCK} (gate and up rows must not share a block), got "
                             f"{intermediate_size}; use weight_scales='channel'")

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float ``[..., N, K]`` weight in this method's format: ``(q, scale)``."""
        if self.block_weights:
            return quantize_weight_blockwise(weight)
        return quantize_weight_per_channel(weight, self.weight_dtype)

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
        self.check_sizes(hidden_size, intermediate_size, gated)
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        for name, shape, scale_name in zip((W13, W2), shapes.values(), (S13, S2)):
            # Quantized N(0, 1/fan_in) weights: a usable layer before loading, like the unquantized one.
            # One expert at a time, so the float copies stay one expert's size.
            data = torch.empty(shape, dtype=self.weight_dtype.torch_dtype, device=device)
            scale = torch.empty(num_experts, *scale_shape(shape[1], shape[2], self.block_weights), device=device)
            for expert in range(num_experts):
                weight = torch.empty(shape[1:], dtype=torch.float32, device=device).normal_(std=shape[-1] ** -0.5)
                data[expert], scale[expert] = self.quantize(weight)
            layer.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))
            layer.register_parameter(scale_name, torch.nn.Parameter(scale, requires_grad=False))
        register_expert_biases(layer, shapes, bias, dtype, device)

    def quantize_weights(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill ``layer``'s quantized weights and scales from float weights ``w13 [E, 2I, H]`` (the
        layer's gate/up layout) and ``w2 [E, H, I]`` — e.g. those of an unquantized layer. Biases are
        float parameters: copy them yourself."""
        for name, weight in ((W13, w13), (W2, w2)):
            target = getattr(layer, name)
            if tuple(weight.shape) != tuple(target.shape):
                raise InputError(f"{name} must be {tuple(target.shape)} to fit the layer, got {tuple(weight.shape)}")
            if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
                raise InputError(f"{name} must be a float (unquantized) tensor, got {weight.dtype}")
        with torch.no_grad():
            for name, scale_name, weight in ((W13, S13, w13), (W2, S2, w2)):
                for expert in range(weight.shape[0]):  # one expert's float copies at a time
                    data, scale = self.quantize(weight[expert].detach())
                    getattr(layer, name)[expert].copy_(data)
                    getattr(layer, scale_name)[expert].copy_(scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the loaded tensors' shapes and dtypes (nothing to repack: the torch reference and the
        kernels read this layout)."""
        w13, w2 = getattr(layer, W13), getattr(layer, W2)
        experts = w13.shape[0]
        for name, scale_name, weight in ((W13, S13, w13), (W2, S2, w2)):
            if weight.dtype != self.weight_dtype.torch_dtype:
                raise InputError(f"{self.name}: {name} must be {self.weight_dtype.torch_dtype}, got {weight.dtype}")
            scale = getattr(layer, scale_name)
            want = (experts, *scale_shape(weight.shape[1], weight.shape[2], self.block_weights))
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                raise InputError(f"{self.name}: {scale_name} must be fp32 {want}, got {scale.dtype} "
                                 f"{tuple(scale.shape)}")
            if not bool(torch.isfinite(scale).all()):
                raise InputError(f"{self.name}: {scale_name} holds non-finite values")
        if w2.shape[:2] != (experts, w13.shape[2]) or w13.shape[1] not in (w2.shape[2], 2 * w2.shape[2]):
            raise InputError(f"{self.name}: {W13} {tuple(w13.shape)} and {W2} {tuple(w2.shape)} disagree")

    # -- stages -----------------------------------------------------------------------------------

    def _not_accepted(self, dispatch: DispatchDtype) -> ContractError:
        return ContractError(
            producer=f"dispatch {dispatch.value}", consumer=f"experts ({self.name})", field="dtype",
            have=dispatch.activation_dtype, want=self.accepts,
            hint=f"dispatch {self.dispatch_dtype.value} or a float dtype into {self.name}")

    def quantize_stage(
        self, dispatch: DispatchDtype, compute: DType
    ) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        """The method's own activation quantizer when the dispatch is quantized; for a float dispatch
        only a cast where the dtypes differ (the experts quantize after the dispatch)."""
        if not dispatch.is_quantized:
            return super().quantize_stage(dispatch, compute)
        if dispatch is not self.dispatch_dtype:
            raise self._not_accepted(dispatch)
        return QuantizeTokens(self.activation_quantizer)

    # -- checkpoints ------------------------------------------------------------------------------

    def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                        projection: Projection) -> dict[str, torch.Tensor]:
        """``{key}.weight`` in the method's weight dtype with its scale: ``weight_scale_inv``
        (DeepSeek-V3, 128x128 blocks) or ``weight_scale`` (per channel ``[N, 1]`` / ``[N]``, or per
        tensor, spread over the method's layout)."""
        if projection.interleaved and self.block_weights:
            raise CheckpointError(f"{self.name}: 128x128 weight blocks cannot hold interleaved gate/up rows (a block "
                                  "would mix gate and up scales); use weight_scales='channel'")
        weight, scale = _read_quantized(self, tensors, projection.key,
                                        (projection.out_features, projection.in_features))
        return {"weight": weight, "weight_scale": scale}


# -- its experts --------------------------------------------------------------------------------------



class TorchW8A8Experts(TorchExperts):
    """The torch reference: quantize float rows after the dispatch (unless they came quantized), the
    W8A8 GEMM, the activation quantized for the second GEMM, the W8A8 GEMM."""

    method: ClassVar[type[Any]] = W8A8Method

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        quantizer = method.activation_quantizer

        def gemm(role: GemmRole, projection: ProjectionWeights, epilogue: bool = False) -> W8A8GroupedGemm:
            return W8A8GroupedGemm(role, projection.weight, _scale(projection), quantizer.dtype,
                                   quantizer.scale_layout, weights.dtype, projection.bias, epilogue)

        stages: list[Stage[Any, Any]] = []
        if dispatch is None or not dispatch.is_quantized:
            stages.append(QuantizeRows(quantizer))  # float rows on the wire: quantize after the dispatch
        stages += [
            gemm(GemmRole.GATE_UP, weights.gate_up),
            ActivateQuantize(activation, quantizer),
            gemm(GemmRole.DOWN, weights.down, routing_weights_in_epilogue),
        ]
        return stages


class TritonW8A8Experts(TritonExperts):
    """The fused kernels: GEMM 1 with the activation and the FP8/INT8 quantization of its output in the
    epilogue (a second kernel for per-token scales), GEMM 2 with the routing weights."""

    method: ClassVar[type[Any]] = W8A8Method

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        from moeforge.stages.triton_quant import FusedQuantGroupedGemm, QuantizeAligned

        configs = cls.launch_table(configs)
        quantizer = method.activation_quantizer
        up, down = weights.gate_up, weights.down
        stages: list[Stage[Any, Any]] = []
        if dispatch is None or not dispatch.is_quantized:
            stages.append(QuantizeAligned(quantizer))  # quantizes the T token rows, not the T * k copies
        stages += [
            FusedQuantGroupedGemm(GemmRole.GATE_UP, method.weight_format, up.weight, _scale(up), configs,
                                  bias=up.bias, activation=activation, out_dtype=weights.dtype,
                                  output_quantizer=quantizer),
            FusedQuantGroupedGemm(GemmRole.DOWN, method.weight_format, down.weight, _scale(down), configs,
                                  bias=down.bias, apply_routing_weights=routing_weights_in_epilogue,
                                  out_dtype=weights.dtype),
        ]
        return stages


def _scale(projection: ProjectionWeights) -> TensorSource:
    if projection.scale is None:
        raise InputError("W8A8 expert weights need their scales (the record names none)")
    return projection.scale


def quantize_layer(layer: Layer, method: W8A8Method) -> Layer:
    """A copy of the unquantized ``layer`` whose experts use ``method``, quantized from its float weights
    (router, selection bias, shared experts and expert biases copied as they are); ``layer`` is left
    unchanged. The copy keeps the layer's settings and replaced stages, and rebuilds its pipeline (the
    dispatch dtype is decided again, now for ``method``)."""
    source = cast(QuantizableLayer, layer)
    w13, w2 = getattr(layer, W13, None), getattr(layer, W2, None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or not w13.is_floating_point() \
            or w13.dtype == torch.float8_e4m3fn:
        raise InputError(f"quantize_layer needs a layer with float expert weights; this one uses {source.quant.name}")
    quantized = copy.deepcopy(layer)
    biases = {name: getattr(layer, name, None) for name in (B13, B2)}
    for name in (W13, W2, B13, B2):
        if hasattr(quantized, name):
            delattr(quantized, name)
    cast(QuantizableLayer, quantized).quant = method
    gated = source.activation.gated
    method.create_weights(quantized, num_experts=source.num_experts, hidden_size=source.hidden_size,
                          intermediate_size=source.intermediate_size, gated=gated,
                          bias=biases[B13] is not None, dtype=source.dtype, device=w13.device)
    method.quantize_weights(quantized, w13, w2)
    with torch.no_grad():
        for name, bias in biases.items():
            if bias is not None:
                getattr(quantized, name).copy_(bias)
    cast(QuantizableLayer, quantized).process_weights_after_loading()
    return quantized


# -- checkpoint loading -----------------------------------------------------------------------------

def _scale_in_layout(method: W8A8Method, scale: torch.Tensor, key: str, shape: tuple[int, int]) -> torch.Tensor:
    """A checkpoint scale of one ``shape`` weight in the method's layout: per-tensor scales (``[]``,
    ``[1]``) are spread exactly over channels or blocks; per-channel ``[N]`` / ``[N, 1]`` and per-block
    ``[ceil(N/128), ceil(K/128)]`` scales must match the method's ``weight_scales``."""
    rows, cols = shape
    want = scale_shape(rows, cols, method.block_weights)
    found = tuple(scale.shape)
    if not scale.is_floating_point():
        raise CheckpointError(f"tensor '{key}' is {scale.dtype}: weight scales are float")
    if found in ((), (1,), (1, 1)):
        return scale.float().reshape(()).expand(want).clone()
    if method.block_weights and found == want:
        return scale.float()
    if not method.block_weights and found in ((rows,), (rows, 1)):
        return scale.float().reshape(rows)
    hint = ""
    if found == scale_shape(rows, cols, True):
        hint = ": these are 128x128 block scales (DeepSeek-V3), use weight_scales='block'"
    elif found in ((rows,), (rows, 1)):
        hint = ": these are per-channel scales, use weight_scales='channel'"
    raise CheckpointError(f"tensor '{key}' has shape {found}, expected {want} for {method.name}{hint}")


def _read_quantized(method: W8A8Method, tensors: Mapping[str, torch.Tensor], base: str,
                    shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight ``{base}.weight`` and its scale (``weight_scale_inv`` or ``weight_scale``), checked."""
    key = f"{base}.weight"
    if key not in tensors:
        raise CheckpointError(f"missing tensor '{key}'")
    weight = tensors[key]
    want_dtype = method.weight_dtype.torch_dtype
    if weight.dtype != want_dtype:
        raise CheckpointError(f"tensor '{key}' is {weight.dtype}; {method.name} reads {want_dtype} weights with "
                              "their scales (load a float checkpoint into an unquantized layer, then quantize it "
                              "with moeforge.quant.w8a8.quantize_layer)")
    if tuple(weight.shape) != shape:
        raise CheckpointError(f"tensor '{key}' has shape {tuple(weight.shape)}, expected {shape}")
    suffixes = ("weight_scale_inv", "weight_scale") if method.block_weights else ("weight_scale", "weight_scale_inv")
    present = [f"{base}.{suffix}" for suffix in suffixes if f"{base}.{suffix}" in tensors]
    if not present:
        raise CheckpointError(f"missing tensor '{base}.{suffixes[0]}' (the scale of '{key}'; "
                              f"'{base}.{suffixes[1]}' is read too)")
    if len(present) > 1:
        raise CheckpointError(f"both '{present[0]}' and '{present[1]}' are in the checkpoint: which scales '{key}'?")
    return weight, _scale_in_layout(method, tensors[present[0]], present[0], shape)
