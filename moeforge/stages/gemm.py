"""Grouped GEMM over expert-grouped rows (torch reference).

Weights are ``[E, N, K]`` (one ``N x K`` matrix per local expert, like ``nn.Linear``), optional biases
``[E, N]``. The reference dequantizes FP8/INT8 inputs, computes in fp32 (fp64 for float64 rows) and
casts the result, and can multiply each output row by its routing weight in the epilogue (after the bias,
as GPT-OSS does). Autograd differentiates it with respect to the rows, the weights, the biases and the
routing weights (the grouped matmul's formula is registered in :mod:`moeforge.stages.grouped_mm`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, ClassVar, Optional, Union

import attrs
import torch

from moeforge.payloads import Activations, ExpertRows, PaddedRows, SortedRows
from moeforge.spec import (
    REFERENCE_FLOAT_DTYPES,
    Accepts,
    DType,
    ExpertIds,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
    accumulation_dtype,
)
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages.grouped_mm import grouped_mm
from moeforge.stages.quantize import dequantize
from moeforge.tensor_ref import TensorSource, resolve

REFERENCE_DTYPES = REFERENCE_FLOAT_DTYPES | {DType.FP8_E4M3, DType.INT8}
REFERENCE_SCALES = frozenset(
    {ScaleLayout.NONE, ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128, ScaleLayout.PER_TENSOR}
)


REFERENCE_LAYOUTS = frozenset({Layout.EXPERT_SORTED, Layout.EXPERT_PADDED})


class GemmRole(enum.Enum):
    GATE_UP = "gate_up"  # dispatched rows (width H) -> expert hidden (width 2I, or I if not gated)
    DOWN = "down"  # expert hidden (width I) -> expert output (width H)


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class DecodedExperts:
    """Expert weights made one expert at a time: ``expert(e)`` is expert ``e``'s fp32 ``[N, K]``
    weight (a quantized method dequantizes it on demand, so at most one expert's fp32 copy lives at
    a time and experts without rows are never dequantized); ``sorted_mm(x, counts)`` is the product of
    rows grouped by expert (fp32 ``[R, N]``), one op that ``torch.compile`` traces (see
    :mod:`moeforge.quant.decoded_gemm`)."""

    num_experts: int
    out_features: int
    expert: Callable[[int], torch.Tensor]
    sorted_mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


WeightsArg = Union[torch.Tensor, DecodedExperts]


def grouped_gemm_sorted(
    x: Activations,
    counts: torch.Tensor,
    weight: WeightsArg,
    bias: Optional[torch.Tensor] = None,
    row_scale: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y[r] = x[r] @ weight[e(r)].T (+ bias[e(r)]) (* row_scale[r])`` with rows grouped by expert
    ``e`` according to ``counts`` (int64 ``[E]``); ``weight`` is ``[E, N, K]`` or :class:`DecodedExperts`
    (either way one custom op that ``torch.compile`` traces, see :mod:`moeforge.stages.grouped_mm`)."""
    values = dequantize(x, accumulation_dtype(x.data.dtype))
    out = grouped_mm(values, weight, counts) if isinstance(weight, torch.Tensor) else weight.sorted_mm(values, counts)
    if bias is not None:
        # Each row's bias by its expert: the expert ids of the rows, from the counts (sizes known).
        row_expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                             output_size=values.shape[0])
        out = out + bias.to(out.dtype)[row_expert]
    if row_scale is not None:
        out *= row_scale.unsqueeze(-1)
    return out.to(out_dtype)


def grouped_gemm_padded(
    x: Activations,
    weight: WeightsArg,
    bias: Optional[torch.Tensor] = None,
    slot_scale: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y[e, c] = x[e, c] @ weight[e].T (+ bias[e]) (* slot_scale[e, c])`` for ``x [E, C, K]``
    (every slot; the combine reads only the valid ones); ``weight`` is ``[E, N, K]`` (one batched
    matmul) or :class:`DecodedExperts` (one expert at a time)."""
    values = dequantize(x, accumulation_dtype(x.data.dtype))
    if isinstance(weight, torch.Tensor):
        out = torch.bmm(values, weight.to(values.dtype).transpose(1, 2))
    else:
        out = torch.empty(*values.shape[:2], weight.out_features, dtype=values.dtype, device=values.device)
        for expert in range(weight.num_experts):
            out[expert] = values[expert] @ weight.expert(expert).t()
    if bias is not None:
        out += bias.to(out.dtype).unsqueeze(1)
    if slot_scale is not None:
        out *= slot_scale.unsqueeze(-1)
    return out.to(out_dtype)


def expert_gemm_accepts(role: GemmRole, *, dtypes: Union[DType, frozenset[DType]],
                        scales: Union[ScaleLayout, frozenset[ScaleLayout]], in_features: int, num_experts: int,
                        apply_routing_weights: bool,
                        layouts: Union[Layout, frozenset[Layout]] = REFERENCE_LAYOUTS,
                        alignment: Optional[tuple[object, ...]] = None, slot_order: bool = False) -> Accepts:
    """What a grouped GEMM stage of the experts accepts: its role's payload in ``layouts`` (the
    torch reference's: either expert-grouped layout; the triton GEMMs': block-aligned), in its
    formats, ``in_features`` wide, local ids, pending weights if its epilogue applies them. Only the
    down GEMM's epilogue may apply them, where the router declares ``IN_GEMM_EPILOGUE``: the gate/up
    GEMM's output goes through the activation, so weights applied there would be a different function
    from every placement a router declares (no spec is accepted). ``alignment``: the block-aligned GEMMs'
    (:meth:`~moeforge.kernels.config.ConfigTable.alignment`), which the rows must have been aligned by;
    ``slot_order``: the GEMM reads the used rows alone, so rows in slot order too (``Spec.slot_order``)."""
    weights_at: Optional[frozenset[Optional[RoutingWeights]]] = None
    if apply_routing_weights:
        # None: a router that declares no placement (a user-written routing stage) leaves it to the stages.
        weights_at = frozenset({RoutingWeights.IN_GEMM_EPILOGUE, None}) if role is GemmRole.DOWN else frozenset()
    return Accepts(
        kind=PayloadKind.DISPATCHED if role is GemmRole.GATE_UP else PayloadKind.EXPERT_HIDDEN,
        layout=layouts,
        dtype=dtypes,
        scale_layout=scales,
        width=in_features,
        expert_ids=ExpertIds.LOCAL,
        num_experts=num_experts,
        routing_weights=RoutingWeights.PENDING if apply_routing_weights else None,
        weights_at=weights_at,
        alignment=frozenset({alignment}) if alignment is not None else None,
        slot_order={False, True} if slot_order else False,
    )


def expert_gemm_output_spec(spec: Spec, role: GemmRole, *, out_features: int, apply_routing_weights: bool,
                            out_dtype: Optional[DType]) -> Spec:
    """What a grouped GEMM stage of the experts produces from ``spec`` (``out_dtype=None``: the
    input's dtype; unscaled)."""
    return spec.evolve(
        kind=PayloadKind.EXPERT_HIDDEN if role is GemmRole.GATE_UP else PayloadKind.EXPERT_OUTPUT,
        dtype=out_dtype or spec.dtype,
        scale_layout=ScaleLayout.NONE,
        global_scale=None,
        width=out_features,
        routing_weights=RoutingWeights.IN_GEMM_EPILOGUE if apply_routing_weights else spec.routing_weights,
    )


def expert_rows_gemm(
    x: ExpertRows,
    weight: WeightsArg,
    bias: Optional[torch.Tensor],
    apply_routing_weights: bool,
    out_dtype: torch.dtype,
    stage: str,
) -> ExpertRows:
    """One grouped GEMM on either expert-grouped layout (the routing weights of the plan applied
    after the bias when asked): the body of every torch-reference GEMM stage."""
    if isinstance(x, SortedRows):
        scale = x.row_weights if apply_routing_weights else None
        y = grouped_gemm_sorted(x.x, x.counts(), weight, bias, scale, out_dtype)
    elif isinstance(x, PaddedRows):
        scale = x.slot_weights if apply_routing_weights else None
        y = grouped_gemm_padded(x.x, weight, bias, scale, out_dtype)
    else:
        raise TypeError(f"{stage} cannot consume {type(x).__name__}")
    return x.with_x(Activations(y))


@attrs.frozen(eq=False)
class GroupedGemm(Stage[ExpertRows, ExpertRows]):
    """One grouped GEMM of the experts (``role`` says which), on either expert-grouped layout.

    ``accepts_dtypes`` / ``accepts_scales`` narrow what the stage consumes: a quant method builds its
    GEMMs with its own capabilities, so e.g. the unquantized method's GEMM rejects FP8 rows at build
    time. ``out_dtype=None`` keeps the input's float dtype (required for quantized inputs).
    """

    kinds: ClassVar = (StageKind.GEMM,)
    role: GemmRole
    weight: TensorSource
    bias: Optional[TensorSource] = None
    accepts_dtypes: frozenset[DType] = REFERENCE_DTYPES
    accepts_scales: frozenset[ScaleLayout] = REFERENCE_SCALES
    apply_routing_weights: bool = False
    out_dtype: Optional[DType] = None

    def __attrs_post_init__(self) -> None:
        shape = tuple(resolve(self.weight).shape)
        if len(shape) != 3:
            raise ValueError(f"GroupedGemm weight must be [E, N, K], got shape {shape}")
        if self.bias is not None:
            bias_shape = tuple(resolve(self.bias).shape)
            if bias_shape != shape[:2]:
                raise ValueError(f"GroupedGemm bias must be [E, N] = {shape[:2]}, got {bias_shape}")

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
        extra = ", bias" if self.bias is not None else ""
        if self.apply_routing_weights:
            extra += ", weights in epilogue"
        return f"GroupedGemm({self.role.value}, {self.in_features}->{self.out_features}{extra})"

    def accepts(self) -> Accepts:
        return expert_gemm_accepts(self.role, dtypes=self.accepts_dtypes, scales=self.accepts_scales,
                                   in_features=self.in_features, num_experts=self.num_experts,
                                   apply_routing_weights=self.apply_routing_weights)

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if self.out_dtype is None and spec.dtype not in REFERENCE_FLOAT_DTYPES:
            found.append(Mismatch("dtype", spec.dtype, REFERENCE_FLOAT_DTYPES,
                                  "a GEMM consuming quantized rows needs an explicit out_dtype"))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        return expert_gemm_output_spec(spec, self.role, out_features=self.out_features,
                                       apply_routing_weights=self.apply_routing_weights, out_dtype=self.out_dtype)

    def _out_dtype(self, x: Activations) -> torch.dtype:
        return self.out_dtype.torch_dtype if self.out_dtype is not None else x.data.dtype

    def __call__(self, x: ExpertRows) -> ExpertRows:
        bias = resolve(self.bias) if self.bias is not None else None
        return expert_rows_gemm(x, resolve(self.weight), bias, self.apply_routing_weights, self._out_dtype(x.x),
                                self.name)
