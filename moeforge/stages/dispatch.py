"""Local dispatch: group the top-k copies of every token by expert.

Two layouts: :class:`SortedDispatch` (``EXPERT_SORTED``: rows sorted by expert plus a group list)
and :class:`PaddedDispatch` (``EXPERT_PADDED``: a fixed ``[E, capacity, W]`` buffer plus
``masked_m``). Within an expert, rows keep the order of ``(token, k)``, so the result is
deterministic. Either can scale the rows by their routing weights (Llama-4 applies the weight to
the expert *input*).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Optional, Union

import attrs
import torch

from moeforge.arguments import enum_member
from moeforge.errors import InputError
from moeforge.payloads import Activations, PaddedRows, Plan, RoutedTokens, SortedRows
from moeforge.spec import (
    REFERENCE_FLOAT_DTYPES,
    Accepts,
    DType,
    ExpertIds,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    Spec,
    accumulation_dtype,
)
from moeforge.stage import Stage, StageKind
from moeforge.stages.combine import combine_rows


class Overflow(enum.Enum):
    """What a fixed-capacity dispatch does when an expert receives more rows than fit."""

    ERROR = "error"  # raise, naming the expert and its row count
    DROP = "drop"  # keep the first `capacity` rows (in token order); the plan counts the dropped copies


def overflow_choice(value: Union[Overflow, str]) -> Overflow:
    """The ``overflow`` argument of the fixed-capacity dispatchers as an :class:`Overflow`."""
    return enum_member(Overflow, "overflow", value)


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class SortedPlan(Plan):
    """The way back from :class:`SortedDispatch`'s rows: ``token_rows[t, k]`` is the row holding copy
    ``k`` of token ``t``; ``copy_weights [T, K]`` the routing weights, token-major (fp32)."""

    token_rows: torch.Tensor
    copy_weights: torch.Tensor

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        weights = self.copy_weights if weighted else None
        return combine_rows(rows, self.token_rows, None, out_dtype, scaling_factor, copy_weight=weights)

    def kept(self) -> torch.Tensor:
        return self.token_rows >= 0


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class PaddedPlan(Plan):
    """The way back from :class:`PaddedDispatch`'s rows: ``token_slots[t, k]`` is the flat slot
    ``expert * capacity + position`` of copy ``k`` of token ``t``, or -1 if it was dropped;
    ``copy_weights [T, K]`` the routing weights (fp32); ``dropped`` (a 0-d int64 tensor, so reading it
    needs no host sync) counts the copies that did not fit the capacity."""

    token_slots: torch.Tensor
    copy_weights: torch.Tensor
    dropped: torch.Tensor

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        weights = self.copy_weights if weighted else None
        return combine_rows(rows.reshape(-1, rows.shape[-1]), self.token_slots, None, out_dtype, scaling_factor,
                            copy_weight=weights)

    def kept(self) -> torch.Tensor:
        return self.token_slots >= 0


def _sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that groups the flattened ``(token, k)`` copies by expert (stable), and counts.

    Every size here follows from the input sizes (no ``bincount``, whose length depends on the
    largest id), so ``torch.compile`` traces the dispatch without a graph break."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, counts


def _rows_of(x: Activations, rows: torch.Tensor) -> Activations:
    """Select rows of token-major activations (scales follow their rows; a per-tensor scale stays)."""
    scale = x.scale
    if scale is not None and scale.dim() == x.data.dim():
        scale = scale[rows]
    return Activations(x.data[rows], scale)


def scale_rows(data: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``data [..., W]`` times ``weights [...]`` (routing weights on the input), multiplied in the accumulation
    dtype and rounded once to ``data``'s dtype — every dispatch that applies the weights on the input rounds so."""
    return (data.to(accumulation_dtype(data.dtype)) * weights.unsqueeze(-1)).to(data.dtype)


def scaled_copy_rows(data: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One row per copy in copy order, ``[T * top_k, H]``: token ``t``'s row ``data[t]`` times each of its routing
    weights ``weights [T, top_k]``, rounded as :func:`scale_rows` rounds."""
    tokens, top_k = weights.shape
    return scale_rows(data.unsqueeze(1), weights).reshape(tokens * top_k, data.shape[-1])


def weights_on_input_accepts(num_experts: int, dtypes: frozenset[DType], **fields: Any) -> Accepts:
    """What a dispatch that scales its rows by their routing weights takes: routed rows of ``dtypes`` (floats:
    scaling quantized values would need a re-quantization, so the experts quantize after the dispatch) whose
    weights are still to be applied, from a router that leaves them to the input; ``fields``: the dispatch's own."""
    return Accepts(kind=PayloadKind.ROUTED, num_experts=num_experts, dtype=dtypes,
                   routing_weights=RoutingWeights.PENDING, weights_at={RoutingWeights.ON_INPUT, None}, **fields)


def weights_on_input_hint(stage: object, field: str, have: object) -> Optional[str]:
    """The hint of a dispatch ``stage`` that scales its rows by their routing weights, for a mismatch of ``field``."""
    if field == "dtype":
        return ("routing weights applied on the input need float activations: quantize after the "
                "dispatch (QuantizeRows) instead of before it")
    if field == "weights_at":
        return (f"the router applies its weights {getattr(have, 'value', have)}, not on the input: use "
                f"{type(stage).__name__}(apply_routing_weights=False), or "
                "RoutingConfig(apply_weights=RoutingWeights.ON_INPUT) for weights on the input (Llama-4)")
    return None


class _Dispatch:
    num_experts: int
    apply_routing_weights: bool

    def _check_experts(self) -> None:
        if self.num_experts < 1:
            raise InputError(f"num_experts must be >= 1, got {self.num_experts}")

    def accepts(self) -> Accepts:
        if self.apply_routing_weights:
            return weights_on_input_accepts(self.num_experts, REFERENCE_FLOAT_DTYPES)
        return Accepts(kind=PayloadKind.ROUTED, num_experts=self.num_experts)

    def hint(self, field: str, have: object) -> Optional[str]:
        return weights_on_input_hint(self, field, have) if self.apply_routing_weights else None

    def _dispatched(self, spec: Spec, layout: Layout, group_list_type: Optional[GroupListType]) -> Spec:
        return spec.evolve(
            kind=PayloadKind.DISPATCHED,
            layout=layout,
            group_list_type=group_list_type,
            expert_ids=ExpertIds.LOCAL,
            routing_weights=RoutingWeights.ON_INPUT if self.apply_routing_weights else spec.routing_weights,
        )


@attrs.frozen(eq=False)
class SortedDispatch(_Dispatch, Stage[RoutedTokens, SortedRows]):
    """Rows sorted by expert, ``group_list`` as counts (``COUNT``) or cumulative sums (``CUMSUM``)."""

    kinds: ClassVar = (StageKind.DISPATCH,)
    num_experts: int
    group_list_type: GroupListType = GroupListType.COUNT
    apply_routing_weights: bool = False

    def __attrs_post_init__(self) -> None:
        self._check_experts()

    def summary(self) -> str:
        extra = ", weights on input" if self.apply_routing_weights else ""
        return f"SortedDispatch({self.group_list_type.name.lower()}{extra})"

    def output_spec(self, spec: Spec) -> Spec:
        return self._dispatched(spec, Layout.EXPERT_SORTED, self.group_list_type)

    def __call__(self, x: RoutedTokens) -> SortedRows:
        topk = x.topk
        tokens, k = topk.ids.shape
        order, counts = _sort_by_expert(topk.ids, self.num_experts)
        row_token = torch.div(order, k, rounding_mode="floor")
        row_weight = topk.weights.reshape(-1)[order]
        token_rows = torch.empty_like(order)
        token_rows[order] = torch.arange(order.numel(), device=order.device)
        rows = _rows_of(x.x, row_token)
        if self.apply_routing_weights:
            rows = Activations(scale_rows(rows.data, row_weight))
        group_list = counts if self.group_list_type is GroupListType.COUNT else counts.cumsum(0)
        plan = SortedPlan(token_rows=token_rows.view(tokens, k), copy_weights=topk.weights)
        adapter_ids = x.adapter_ids[row_token] if x.adapter_ids is not None else None
        return SortedRows(x=rows, group_list=group_list, group_list_type=self.group_list_type,
                          row_weights=row_weight, plan=plan, adapter_ids=adapter_ids)


@attrs.frozen(eq=False)
class PaddedDispatch(_Dispatch, Stage[RoutedTokens, PaddedRows]):
    """A ``[E, capacity, W]`` buffer per expert plus ``masked_m`` (valid rows per expert).

    ``capacity=None`` sizes the buffer to the token count, which never overflows on one rank (a token
    picks an expert at most once). A smaller capacity bounds memory; ``overflow`` says what happens
    when an expert gets more rows than that. Checking for ``Overflow.ERROR`` reads the counts (a host
    synchronisation, and a graph break under ``torch.compile``); with ``capacity=None`` there is
    nothing to check.
    """

    kinds: ClassVar = (StageKind.DISPATCH,)
    num_experts: int
    capacity: Optional[int] = None
    overflow: Overflow = attrs.field(default=Overflow.ERROR, converter=overflow_choice)
    apply_routing_weights: bool = False

    def __attrs_post_init__(self) -> None:
        self._check_experts()
        if self.capacity is not None and self.capacity < 1:
            raise InputError(f"capacity must be >= 1 (or None), got {self.capacity}")

    def summary(self) -> str:
        cap = "tokens" if self.capacity is None else str(self.capacity)
        extra = ", weights on input" if self.apply_routing_weights else ""
        return f"PaddedDispatch(capacity={cap}, overflow={self.overflow.value}{extra})"

    def output_spec(self, spec: Spec) -> Spec:
        return self._dispatched(spec, Layout.EXPERT_PADDED, None)

    def __call__(self, x: RoutedTokens) -> PaddedRows:
        topk = x.topk
        tokens, k = topk.ids.shape
        num_experts = self.num_experts
        capacity = self.capacity if self.capacity is not None else max(tokens, 1)
        order, counts = _sort_by_expert(topk.ids, num_experts)
        device = order.device
        sorted_expert = topk.ids.reshape(-1).long()[order]
        starts = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=device) - starts[sorted_expert]
        kept = position < capacity
        if self.capacity is not None and self.overflow is Overflow.ERROR and not bool(kept.all()):
            worst = int(counts.argmax())
            raise InputError(
                f"PaddedDispatch capacity overflow: expert {worst} received {int(counts[worst])} rows, "
                f"capacity is {capacity}; raise capacity or use overflow=Overflow.DROP"
            )
        # Every copy is written, a dropped one to a spare slot past the end that is cut off after: the
        # sizes stay those of the input (no boolean-mask indexing), so torch.compile can trace it.
        spare = num_experts * capacity
        slot = torch.where(kept, sorted_expert * capacity + position, spare)
        row_weight = topk.weights.reshape(-1)[order]

        source = _rows_of(x.x, torch.div(order, k, rounding_mode="floor"))
        data = source.data
        if self.apply_routing_weights:
            data = scale_rows(data, row_weight)
        width = data.shape[-1]
        buffer = torch.zeros(spare + 1, width, dtype=data.dtype, device=device)
        buffer[slot] = data
        scale = source.scale
        if scale is not None and scale.dim() == 2:
            scale_buffer = torch.ones(spare + 1, scale.shape[-1], dtype=scale.dtype, device=device)
            scale_buffer[slot] = scale
            scale = scale_buffer[:spare].view(num_experts, capacity, -1)
        slot_weight = torch.zeros(spare + 1, dtype=row_weight.dtype, device=device)
        slot_weight[slot] = row_weight
        token_slots = torch.full((tokens * k,), -1, dtype=torch.int64, device=device)
        token_slots[order] = torch.where(kept, slot, -1)
        plan = PaddedPlan(token_slots=token_slots.view(tokens, k), copy_weights=topk.weights, dropped=(~kept).sum())
        slot_adapters = None
        if x.adapter_ids is not None:  # each slot's adapter (-1 for an empty slot)
            slot_adapters = torch.full((spare + 1,), -1, dtype=x.adapter_ids.dtype, device=device)
            slot_adapters[slot] = x.adapter_ids[torch.div(order, k, rounding_mode="floor")]
            slot_adapters = slot_adapters[:spare].view(num_experts, capacity)
        return PaddedRows(
            x=Activations(buffer[:spare].view(num_experts, capacity, width), scale),
            masked_m=counts.clamp(max=capacity).to(torch.int32),
            slot_weights=slot_weight[:spare].view(num_experts, capacity),
            plan=plan, adapter_ids=slot_adapters,
        )

