"""W4A4 the NPU way: BF16 rows after the dispatch, quantized to int4 *inside* the expert computation.

NPU-style grouped-matmul backends (Ascend's ``npu_grouped_matmul`` family) take BF16 activations,
quantize them per token inside the kernel, run an integer GEMM and dequantize in the epilogue. Such a
method cannot consume a quantized wire format, so it *requires* BF16 dispatch (rule 3 of
:func:`~moeforge.resolve_dispatch_dtype`; ``accepts = {BF16}``: an explicit FP8 dispatch is a
``ContractError``), and it proves the two interfaces NPU and fused-EP backends call:

* :meth:`W4A4NpuMethod.apply_without_routing_weights` does the whole expert computation on
  expert-grouped rows; its :meth:`~W4A4NpuMethod.expert_stages` is one fused stage
  (:class:`W4A4Experts`, kinds GEMM + ACTIVATION + GEMM) that calls it on the dispatched rows;
* ``offers_fused_ep = True``: :meth:`~W4A4NpuMethod.fused_ep_stage` builds :class:`W4A4FusedEp`, one
  stage spanning dispatch -> combine (what ``MoELayer(..., dispatcher="fused_ep")`` uses): it sorts
  the rows by expert, calls ``apply_without_routing_weights`` and combines (fixed-order fp32 sum).

Numerics (a torch emulation of the integer kernel, exact where the kernel is exact):

* weights: int4 per output channel, symmetric, ``qmax = 7`` (codes -7..7), ``scale = amax(row) / 7``,
  round half to even; packed two per byte as 4-bit two's complement, element ``2j`` in the low nibble:
  ``w13_weight`` uint8 ``[E, N13, H // 2]`` + ``w13_weight_scale`` fp32 ``[E, N13]``, ``w2_weight``
  uint8 ``[E, H, I // 2]`` + ``w2_weight_scale`` fp32 ``[E, H]`` (``H`` and ``I`` even); optional float
  biases ``w13_bias [E, N13]``, ``w2_bias [E, H]``.
* activations: int4 per token (per row), symmetric, ``qmax = 7``, dynamic (``scale = amax / 7``);
  the input rows before the first GEMM and the activation's output before the second.
* GEMM: the integer products are summed exactly (in fp32, exact while ``49 * K < 2**24``, i.e.
  ``K < 342,000``), then ``* x_scale[row] * w_scale[expert, n] (+ bias)`` in fp32. The intermediates
  stay fp32; the result is cast to ``output_dtype``. A row holding NaN/inf gets a NaN scale and comes
  out NaN.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import CheckpointError, InputError
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, ExpertRows, MoEOutput, PaddedRows, RoutedTokens, SortedRows
from moeforge.quant.base import QuantMethod, expert_shapes, register_expert_biases
from moeforge.quant.expert_grouped import check_expert_groups
from moeforge.quant.nvfp4 import optional_tensor
from moeforge.roles.base import TorchExperts
from moeforge.spec import (
    Accepts,
    DType,
    ExpertIds,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
)
from moeforge.stage import Stage, StageKind
from moeforge.stages.activation import ActivationConfig, apply_activation
from moeforge.stages.combine import combine_accepts, combine_hint, combine_output_spec
from moeforge.stages.dispatch import SortedDispatch
from moeforge.stages.gemm import grouped_gemm_padded, grouped_gemm_sorted
from moeforge.expert_weights import ExpertNames, ExpertWeights
from moeforge.tensor_ref import LayerRef

INT4_MAX = 7.0
_TINY = 1e-12  # keeps the scale of an all-zero row finite
W13, W13_SCALE, W2, W2_SCALE = "w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"
B13, B2 = "w13_bias", "w2_bias"


# -- int4 -----------------------------------------------------------------------------------------------


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 of ``x [..., K]``, one fp32 scale per row: codes int8 in [-7, 7] (round half to
    even) and ``scale [..., 1] = amax / 7``."""
    values = x.float()
    if values.shape[-1] == 0:
        raise InputError("int4 quantization needs a non-empty last dimension")
    scale = values.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / INT4_MAX
    codes = torch.round(values / scale).clamp(-INT4_MAX, INT4_MAX)
    # NaN codes (a non-finite row) become 0; the row's NaN/inf scale keeps it non-finite.
    codes = torch.nan_to_num(codes, nan=0.0).to(torch.int8)
    return codes, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] ``[..., K]`` -> uint8 ``[..., K // 2]``: 4-bit two's complement, element
    ``2j`` in the low nibble."""
    if codes.dtype != torch.int8 or codes.dim() == 0 or codes.shape[-1] % 2:
        raise InputError(f"pack_int4 needs int8 codes with an even last dimension, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    nibbles = (codes.to(torch.int16) & 0x0F).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K // 2]`` -> int8 codes ``[..., K]`` (the inverse of :func:`pack_int4`)."""
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise InputError(f"unpack_int4 needs uint8 data, got {packed.dtype} {tuple(packed.shape)}")
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).to(torch.int16)
    codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _int4_gemm(
    x: torch.Tensor,
    counts: Optional[torch.Tensor],
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """fp32 ``(q(x) . q_w) * x_scale * w_scale (+ bias)`` on sorted (``counts``) or padded rows."""
    codes, x_scale = quantize_int4(x)
    wq = unpack_int4(weight).float()
    if counts is None:  # padded [E, C, K]
        acc = grouped_gemm_padded(Activations(codes.float()), wq, None, None, torch.float32)
        w_scale = weight_scale.float().unsqueeze(1)
        row_bias = bias.float().unsqueeze(1) if bias is not None else None
    else:
        acc = grouped_gemm_sorted(Activations(codes.float()), counts, wq, None, None, torch.float32)
        row_expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                             output_size=x.shape[0])
        w_scale = weight_scale.float()[row_expert]
        row_bias = bias.float()[row_expert] if bias is not None else None
    out = acc * x_scale * w_scale
    return out + row_bias if row_bias is not None else out


# -- stages -----------------------------------------------------------------------------------------------


def _hidden_size(layer: torch.nn.Module) -> tuple[int, int]:
    weight = getattr(layer, W13)
    return int(weight.shape[0]), 2 * int(weight.shape[2])


@attrs.frozen(eq=False)
class W4A4Experts(Stage[ExpertRows, ExpertRows]):
    """The whole expert computation on dispatched BF16 rows, one fused stage: it calls
    ``method.apply_without_routing_weights`` (which quantizes inside), then applies the routing
    weights in the epilogue when asked."""

    kinds: ClassVar = (StageKind.GEMM, StageKind.ACTIVATION, StageKind.GEMM)
    method: W4A4NpuMethod
    layer: LayerRef = attrs.field(converter=LayerRef)  # weak: see LayerRef
    apply_routing_weights: bool = False

    def summary(self) -> str:
        extra = ", weights in epilogue" if self.apply_routing_weights else ""
        return f"W4A4Experts(apply_without_routing_weights, int4 per-token x int4 per-channel{extra})"

    def accepts(self) -> Accepts:
        experts, hidden = _hidden_size(self.layer.get())
        return Accepts(
            kind=PayloadKind.DISPATCHED,
            layout={Layout.EXPERT_SORTED, Layout.EXPERT_PADDED},
            dtype=self.method.accepts,
            scale_layout=ScaleLayout.NONE,
            width=hidden,
            expert_ids=ExpertIds.LOCAL,
            num_experts=experts,
            routing_weights=RoutingWeights.PENDING if self.apply_routing_weights else None,
            weights_at={RoutingWeights.IN_GEMM_EPILOGUE, None} if self.apply_routing_weights else None,
        )

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "this NPU-style method quantizes inside its kernel: dispatch bf16"
        return None

    def output_spec(self, spec: Spec) -> Spec:
        return spec.evolve(
            kind=PayloadKind.EXPERT_OUTPUT,
            routing_weights=RoutingWeights.IN_GEMM_EPILOGUE if self.apply_routing_weights
            else spec.routing_weights,
        )

    def __call__(self, x: ExpertRows) -> ExpertRows:
        data = x.x.data
        if isinstance(x, SortedRows):
            group_list, group_list_type = x.group_list, x.group_list_type
            weight = x.row_weights
        elif isinstance(x, PaddedRows):
            group_list, group_list_type = x.masked_m, GroupListType.COUNT
            weight = x.slot_weights
        else:
            raise TypeError(f"W4A4Experts cannot consume {type(x).__name__}")
        out = self.method.apply_without_routing_weights(self.layer.get(), data, None, group_list_type, group_list,
                                                        data.dtype)
        if self.apply_routing_weights:
            out = (out.float() * weight.unsqueeze(-1)).to(data.dtype)
        return x.with_x(Activations(out))


@attrs.frozen(eq=False)
class W4A4FusedEp(Stage[RoutedTokens, MoEOutput]):
    """Dispatch -> experts -> combine in one stage (a fused-EP kernel's span): sort the routed copies
    by expert, ``apply_without_routing_weights``, then the fixed-order fp32 combine. It applies the
    routing weights (when ``apply_routing_weights``) and the routed scaling factor (when not
    ``None``) in its combine."""

    kinds: ClassVar = (StageKind.DISPATCH, StageKind.GEMM, StageKind.ACTIVATION, StageKind.GEMM,
                       StageKind.COMBINE)
    method: W4A4NpuMethod
    layer: LayerRef = attrs.field(converter=LayerRef)  # weak: see LayerRef
    apply_routing_weights: bool
    routed_scaling_factor: Optional[float]
    out_dtype: DType

    @property
    def num_experts(self) -> int:
        return _hidden_size(self.layer.get())[0]

    def summary(self) -> str:
        parts = ["sorted", "int4 per-token x int4 per-channel",
                 "weighted" if self.apply_routing_weights else "unweighted", "fp32 fixed order"]
        if self.routed_scaling_factor is not None:
            parts.append(f"x{self.routed_scaling_factor:g}")
        return f"W4A4FusedEp({', '.join(parts)})"

    def accepts(self) -> Accepts:
        experts, hidden = _hidden_size(self.layer.get())
        return Accepts(
            kind=PayloadKind.ROUTED,
            layout=Layout.TOKEN_MAJOR,
            dtype=self.method.accepts,
            scale_layout=ScaleLayout.NONE,
            width=hidden,
            num_experts=experts,
            **combine_accepts(self.apply_routing_weights, self.routed_scaling_factor),
        )

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "this NPU-style method quantizes inside its kernel: dispatch bf16"
        if field in ("routing_weights", "weights_at"):
            return ("the fused stage applies the routing weights in its combine only: route with "
                    "apply_weights=RoutingWeights.IN_COMBINE, or use dispatcher='sorted' / 'padded'")
        return combine_hint(self.name, field, have)

    def output_spec(self, spec: Spec) -> Spec:
        return combine_output_spec(spec, self.apply_routing_weights, self.routed_scaling_factor, self.out_dtype)

    def __call__(self, x: RoutedTokens) -> MoEOutput:
        rows = SortedDispatch(self.num_experts)(x)
        data = rows.x.data
        out = self.method.apply_without_routing_weights(self.layer.get(), data, None, GroupListType.COUNT,
                                                        rows.group_list, data.dtype)
        return MoEOutput(rows.plan.combine(out, self.apply_routing_weights, self.routed_scaling_factor,
                                           self.out_dtype.torch_dtype))


# -- the method -----------------------------------------------------------------------------------------


class W4A4NpuMethod(QuantMethod):
    """int4 weights (per channel) x int4 activations (per token, quantized inside), BF16 dispatch
    required. See the module docstring."""

    accepts: ClassVar[frozenset[DType]] = frozenset({DType.BF16})
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE})
    expert_parameters: ClassVar[tuple[str, ...]] = (W13, W13_SCALE, W2, W2_SCALE, B13, B2)
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_weight", scale="{}_weight_scale")
    offers_fused_ep: ClassVar[bool] = True

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`W4A4NpuExperts`: the method's reference computation."""
        return W4A4NpuExperts

    def __repr__(self) -> str:
        return "W4A4NpuMethod()"

    def required_dispatch_dtype(self) -> Optional[DispatchDtype]:
        # The kernel quantizes internally: it needs BF16 rows after the dispatch, whatever else decides.
        return DispatchDtype.BF16

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
            if size % 2:
                raise InputError(f"W4A4NpuMethod packs two int4 values per byte: {name} must be even, got {size}")
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        for prefix, (experts, rows, width) in shapes.items():
            for name, tensor in (
                (f"{prefix}_weight", torch.zeros(experts, rows, width // 2, dtype=torch.uint8, device=device)),
                (f"{prefix}_weight_scale", torch.ones(experts, rows, dtype=torch.float32, device=device)),
            ):
                layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        register_expert_biases(layer, shapes, bias, dtype, device)
        # Usable before loading: random N(0, 1/fan_in) weights, quantized. One expert at a time: the float
        # weights of a DeepSeek-V3-size layer would take 45 GB in fp32.
        for prefix, (experts, rows, width) in shapes.items():
            for expert in range(experts):
                weight = torch.empty((rows, width), device=device).normal_(std=width ** -0.5)
                self._quantize_expert(layer, prefix, expert, weight)

    def quantize_weights(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill ``layer``'s int4 weights from float ``w13 [E, N13, H]`` and ``w2 [E, H, I]`` (one
        symmetric scale per output channel), one expert at a time."""
        for prefix, weight in (("w13", w13), ("w2", w2)):
            target = getattr(layer, f"{prefix}_weight", None)
            if not isinstance(target, torch.Tensor):
                raise InputError(f"the layer has no {prefix}_weight: call create_weights first")
            want = tuple(target.shape[:2]) + (2 * target.shape[2],)
            if (not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point
                    or tuple(weight.shape) != want):
                have = (tuple(weight.shape), weight.dtype) if isinstance(weight, torch.Tensor) else weight
                raise InputError(f"{prefix} must be a float tensor of shape {list(want)}, got {have}")
            for expert in range(target.shape[0]):
                self._quantize_expert(layer, prefix, expert, weight[expert])

    @staticmethod
    def _quantize_expert(layer: torch.nn.Module, prefix: str, expert: int, weight: torch.Tensor) -> None:
        """Quantize one expert's float ``weight [N, K]`` into ``{prefix}_weight`` / ``{prefix}_weight_scale``."""
        codes, scale = quantize_int4(weight)
        with torch.no_grad():
            getattr(layer, f"{prefix}_weight")[expert].copy_(pack_int4(codes))
            getattr(layer, f"{prefix}_weight_scale")[expert].copy_(scale.squeeze(-1))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the loaded tensors; the layout is already the one the emulation reads."""
        for weight_name, scale_name in ((W13, W13_SCALE), (W2, W2_SCALE)):
            weight, scale = getattr(layer, weight_name, None), getattr(layer, scale_name, None)
            if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 3:
                have = (tuple(weight.shape), weight.dtype) if isinstance(weight, torch.Tensor) else weight
                raise CheckpointError(f"{weight_name} must be uint8 [E, N, K // 2] (packed int4), got {have}")
            want = tuple(weight.shape[:2])
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
                have = (tuple(scale.shape), scale.dtype) if isinstance(scale, torch.Tensor) else scale
                raise CheckpointError(f"{scale_name} must be float32 {list(want)}, got {have}")

    # -- stages ---------------------------------------------------------------------------------------------

    def fused_ep_stage(
        self,
        layer: torch.nn.Module,
        *,
        activation: ActivationConfig,
        apply_routing_weights: bool,
        routed_scaling_factor: Optional[float],
        out_dtype: DType,
        dispatch: DispatchDtype,
    ) -> Stage[RoutedTokens, MoEOutput]:
        return W4A4FusedEp(self, layer, apply_routing_weights, routed_scaling_factor, out_dtype)

    def prepare_fused_ep_weights(self, layer: torch.nn.Module) -> None:
        """Nothing to do: the emulated fused stage reads the same packed int4 layout as the unfused
        one. (A real NPU kernel would re-lay the weights out here — e.g. into its tiled format — and
        must do so idempotently: the layer calls this on every pipeline rebuild.)"""

    def apply_without_routing_weights(
        self,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        hidden_states_scale: Optional[torch.Tensor],
        group_list_type: Union[GroupListType, int],
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """BF16 rows ``[R, H]`` (grouped by ``group_list``) or ``[E, C, H]`` (padded): per-token int4
        quantization, int4 GEMM, activation (the layer's ``activation``), per-token int4
        quantization, int4 GEMM; ``output_dtype`` result. ``hidden_states_scale`` must be ``None``."""
        if hidden_states_scale is not None:
            raise InputError("hidden_states_scale must be None: W4A4NpuMethod quantizes bf16 activations itself")
        if hidden_states.dtype != torch.bfloat16:
            raise InputError(f"hidden_states must be bf16 (W4A4NpuMethod requires bf16 after dispatch), got "
                             f"{hidden_states.dtype}")
        num_experts, hidden_size = _hidden_size(layer)
        counts = check_expert_groups(hidden_states, group_list_type, group_list, num_experts, hidden_size)
        config: ActivationConfig = getattr(layer, "activation")
        hidden = _int4_gemm(hidden_states, counts, getattr(layer, W13), getattr(layer, W13_SCALE),
                            optional_tensor(layer, B13))
        activated = apply_activation(hidden, config)
        out = _int4_gemm(activated, counts, getattr(layer, W2), getattr(layer, W2_SCALE),
                         optional_tensor(layer, B2))
        return self.without_backward(out.to(output_dtype), hidden_states)


# -- its experts --------------------------------------------------------------------------------------


class W4A4NpuExperts(TorchExperts):
    """One fused stage calling :meth:`W4A4NpuMethod.apply_without_routing_weights` (an NPU kernel's entry
    point, emulated in torch; it reads the layer's ``activation``)."""

    method: ClassVar[type[Any]] = W4A4NpuMethod

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        return [W4A4Experts(method, weights.layer(), apply_routing_weights=routing_weights_in_epilogue)]
