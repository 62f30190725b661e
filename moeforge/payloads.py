"""Payloads: the run-time records that carry tensors across stage boundaries.

Every payload is a frozen ``attrs`` record with named fields. ``payload.check(spec)`` verifies that
the tensors agree with a :class:`~moeforge.spec.Spec` (shapes, dtypes, metadata); pipelines call it
after every stage in debug mode, and :mod:`moeforge.testing` calls it to catch a stage that lies about
its spec.
"""

from __future__ import annotations

from typing import Optional, Union

import attrs
import torch
from typing_extensions import Self

from moeforge.errors import PayloadError
from moeforge.spec import DType, GroupListType, Layout, PayloadKind, ScaleLayout, Spec

GROUP_SIZE = 128  # elements per scale in ScaleLayout.PER_GROUP_128


def _fail(what: str, have: object, want: object) -> PayloadError:
    return PayloadError(f"{what}: have {have}, spec says {want}")


def _expect(condition: bool, what: str, have: object, want: object) -> None:
    if not condition:
        raise _fail(what, have, want)


@attrs.frozen
class Activations:
    """An activation tensor and its scales (``None`` when unquantized).

    ``data`` is ``[..., W]``. Scale shapes by layout: per token ``[..., 1]``, per 128-group
    ``[..., W // 128]``, per tensor ``[1]`` (all fp32).
    """

    data: torch.Tensor
    scale: Optional[torch.Tensor] = None

    def check(self, spec: Spec, where: str) -> None:
        data = self.data
        _expect(data.dtype == spec.dtype.torch_dtype, f"{where}.data dtype", data.dtype, spec.dtype.value)
        width = spec.width // 2 if spec.dtype is DType.NVFP4 else spec.width
        _expect(data.shape[-1] == width, f"{where}.data width", data.shape[-1], width)
        layout = spec.scale_layout
        if layout is ScaleLayout.NONE:
            _expect(self.scale is None, f"{where}.scale", "a tensor", "no scale")
            return
        scale = self.scale
        if scale is None:
            raise _fail(f"{where}.scale", None, layout.value)
        lead = tuple(data.shape[:-1])
        expected: tuple[int, ...]
        if layout is ScaleLayout.PER_TOKEN:
            expected = lead + (1,)
        elif layout is ScaleLayout.PER_GROUP_128:
            expected = lead + (spec.width // GROUP_SIZE,)
        elif layout is ScaleLayout.PER_TENSOR:
            expected = (1,)
        else:
            expected = lead + (spec.width // 16,)
        _expect(tuple(scale.shape) == expected, f"{where}.scale shape", tuple(scale.shape), expected)
        if layout is not ScaleLayout.NVFP4_BLOCK16:
            _expect(scale.dtype == torch.float32, f"{where}.scale dtype", scale.dtype, "float32")


@attrs.frozen
class MoEInput:
    """The pipeline input: token-major hidden states ``[T, H]`` and router logits ``[T, E]``."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor

    def check(self, spec: Spec) -> None:
        _expect(spec.kind is PayloadKind.TOKENS, "payload kind", "MoEInput", spec.kind.value)
        Activations(self.hidden_states).check(spec, "hidden_states")
        tokens = self.hidden_states.shape[0]
        want = (tokens, spec.num_experts)
        _expect(tuple(self.router_logits.shape) == want, "router_logits shape",
                tuple(self.router_logits.shape), want)


@attrs.frozen
class TopKOutput:
    """Routing decision: fp32 ``weights [T, K]`` and int32 global ``ids [T, K]``."""

    weights: torch.Tensor
    ids: torch.Tensor

    def check(self, num_tokens: int, spec: Spec) -> None:
        want = (num_tokens, spec.top_k)
        _expect(tuple(self.weights.shape) == want, "topk.weights shape", tuple(self.weights.shape), want)
        _expect(tuple(self.ids.shape) == want, "topk.ids shape", tuple(self.ids.shape), want)
        _expect(self.weights.dtype == torch.float32, "topk.weights dtype", self.weights.dtype, "float32")
        _expect(self.ids.dtype == torch.int32, "topk.ids dtype", self.ids.dtype, "int32")
        if self.ids.numel() and spec.num_experts is not None:
            low, high = int(self.ids.min()), int(self.ids.max())
            _expect(low >= 0 and high < spec.num_experts, "topk.ids range", (low, high),
                    f"[0, {spec.num_experts})")
            ordered = torch.sort(self.ids, dim=-1).values
            repeated = bool((ordered[:, 1:] == ordered[:, :-1]).any())
            _expect(not repeated, "topk.ids", "a token routed to the same expert twice", "distinct experts")


@attrs.frozen
class RoutedTokens:
    """Token-major activations (possibly quantized) with their routing decision."""

    x: Activations
    topk: TopKOutput

    def with_x(self, x: Activations) -> Self:
        return attrs.evolve(self, x=x)

    def check(self, spec: Spec) -> None:
        _expect(spec.kind is PayloadKind.ROUTED, "payload kind", "RoutedTokens", spec.kind.value)
        _expect(spec.layout is Layout.TOKEN_MAJOR, "layout", "RoutedTokens", spec.layout.value)
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        self.x.check(spec, "x")
        self.topk.check(self.x.data.shape[0], spec)


@attrs.frozen
class SortedPlan:
    """How expert-sorted rows map back to tokens; produced by dispatch, used by combine.

    ``row_token[r]`` is the source token of row ``r``; ``row_weight[r]`` its routing weight (fp32);
    ``token_rows[t, k]`` the row holding copy ``k`` of token ``t``, or -1 if it is not on this rank.
    """

    row_token: torch.Tensor
    row_weight: torch.Tensor
    token_rows: torch.Tensor
    num_tokens: int


@attrs.frozen
class PaddedPlan:
    """How padded slots map back to tokens. ``token_slots[t, k]`` is the flat slot
    ``expert * capacity + position`` of copy ``k`` of token ``t``, or -1 if it was dropped or is not on
    this rank; ``slot_weight [E, C]`` holds each slot's routing weight (0 for empty slots);
    ``dropped`` (a 0-d int64 tensor, so reading it needs no host sync) counts the copies that did not
    fit the capacity."""

    slot_weight: torch.Tensor
    token_slots: torch.Tensor
    num_tokens: int
    dropped: torch.Tensor


@attrs.frozen
class ExpertRows:
    """Base of the expert-grouped payloads (dispatched rows, expert hidden states, expert outputs)."""

    x: Activations

    def with_x(self, x: Activations) -> Self:
        return attrs.evolve(self, x=x)


@attrs.frozen
class SortedRows(ExpertRows):
    """``x.data [R, W]``: rows grouped by local expert; ``group_list [E]`` (int64) holds counts or
    cumulative sums, as ``group_list_type`` says."""

    group_list: torch.Tensor
    group_list_type: GroupListType
    plan: SortedPlan

    @property
    def num_experts(self) -> int:
        return int(self.group_list.shape[0])

    def counts(self) -> torch.Tensor:
        """Rows per expert as counts, whatever the group list convention."""
        if self.group_list_type is GroupListType.COUNT:
            return self.group_list
        return torch.diff(self.group_list, prepend=self.group_list.new_zeros(1))

    def check(self, spec: Spec) -> None:
        _expect(spec.layout is Layout.EXPERT_SORTED, "layout", "SortedRows", spec.layout.value)
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        self.x.check(spec, "x")
        _expect(self.group_list_type is spec.group_list_type, "group_list_type", self.group_list_type,
                spec.group_list_type)
        _expect(self.group_list.dtype == torch.int64, "group_list dtype", self.group_list.dtype, "int64")
        _expect(self.num_experts == spec.num_experts, "group_list length", self.num_experts,
                spec.num_experts)
        counts = self.counts()
        total = int(counts.sum()) if counts.numel() else 0
        _expect(bool((counts >= 0).all()), "group_list counts", counts.tolist(), "non-negative")
        rows = self.x.data.shape[0]
        _expect(total == rows, "rows covered by group_list", total, rows)
        _expect(self.plan.row_token.shape == (rows,), "plan.row_token shape",
                tuple(self.plan.row_token.shape), (rows,))
        _expect(self.plan.row_weight.shape == (rows,), "plan.row_weight shape",
                tuple(self.plan.row_weight.shape), (rows,))


@attrs.frozen
class PaddedRows(ExpertRows):
    """``x.data [E, C, W]``: each local expert's rows in a fixed-capacity buffer; only the first
    ``masked_m[e]`` rows of expert ``e`` are valid."""

    masked_m: torch.Tensor
    plan: PaddedPlan

    @property
    def num_experts(self) -> int:
        return int(self.masked_m.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.x.data.shape[1])

    def check(self, spec: Spec) -> None:
        _expect(spec.layout is Layout.EXPERT_PADDED, "layout", "PaddedRows", spec.layout.value)
        _expect(self.x.data.dim() == 3, "x.data rank", self.x.data.dim(), 3)
        self.x.check(spec, "x")
        _expect(self.num_experts == spec.num_experts, "masked_m length", self.num_experts,
                spec.num_experts)
        _expect(self.x.data.shape[0] == self.num_experts, "x.data experts", self.x.data.shape[0],
                self.num_experts)
        if self.masked_m.numel():
            _expect(int(self.masked_m.max()) <= self.capacity, "masked_m", int(self.masked_m.max()),
                    f"<= capacity {self.capacity}")
        want = (self.num_experts, self.capacity)
        _expect(tuple(self.plan.slot_weight.shape) == want, "plan.slot_weight shape",
                tuple(self.plan.slot_weight.shape), want)


@attrs.frozen
class AlignedPlan:
    """The ``BLOCK_ALIGNED`` routing plan (Triton fused-MoE style), all on the device.

    ``sorted_ids`` lists copy indices ``t * top_k + k`` grouped by expert, each expert's run padded
    with the sentinel ``num_tokens * top_k`` to a multiple of ``block_m``; ``block_expert[b]`` is the
    local expert of block ``b``; ``num_padded`` (1 element, int32) is the used length of
    ``sorted_ids``; ``weights [T * top_k]`` are the routing weights in copy order (fp32).
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    weights: torch.Tensor
    block_m: int
    top_k: int
    num_tokens: int

    @property
    def num_copies(self) -> int:
        return self.num_tokens * self.top_k


@attrs.frozen
class AlignedRows(ExpertRows):
    """Expert-grouped rows described by an :class:`AlignedPlan`, never physically sorted.

    When ``copy_major`` is false, ``x.data`` is still token-major ``[T, W]`` and copy ``c`` reads row
    ``c // top_k`` (the first GEMM gathers by index); when true, ``x.data`` is ``[T * top_k, W]`` with
    one row per copy, in copy order (what the GEMMs write).
    """

    plan: AlignedPlan
    copy_major: bool

    def check(self, spec: Spec) -> None:
        _expect(spec.layout is Layout.BLOCK_ALIGNED, "layout", "AlignedRows", spec.layout.value)
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        self.x.check(spec, "x")
        rows = self.plan.num_copies if self.copy_major else self.plan.num_tokens
        _expect(self.x.data.shape[0] == rows, "x.data rows", self.x.data.shape[0], rows)
        _expect(self.plan.top_k == spec.top_k, "plan.top_k", self.plan.top_k, spec.top_k)
        used = int(self.plan.num_padded.item())
        _expect(used % self.plan.block_m == 0 and used <= self.plan.sorted_ids.numel(), "plan.num_padded",
                used, f"a multiple of block_m={self.plan.block_m} <= {self.plan.sorted_ids.numel()}")
        if used and spec.num_experts is not None:
            experts = self.plan.block_expert[: used // self.plan.block_m]
            _expect(bool(((experts >= 0) & (experts < spec.num_experts)).all()), "plan.block_expert",
                    "out of range", f"[0, {spec.num_experts})")


@attrs.frozen
class MoEOutput:
    """The combined output, token-major ``[T, H]``."""

    hidden_states: torch.Tensor

    def check(self, spec: Spec) -> None:
        _expect(spec.kind is PayloadKind.OUTPUT, "payload kind", "MoEOutput", spec.kind.value)
        _expect(self.hidden_states.dim() == 2, "hidden_states rank", self.hidden_states.dim(), 2)
        Activations(self.hidden_states).check(spec, "hidden_states")


Payload = Union[MoEInput, RoutedTokens, SortedRows, PaddedRows, AlignedRows, MoEOutput]


def check_payload(payload: object, spec: Spec) -> None:
    """Raise :class:`PayloadError` unless ``payload`` matches ``spec``."""
    if not isinstance(payload, (MoEInput, RoutedTokens, SortedRows, PaddedRows, AlignedRows, MoEOutput)):
        raise PayloadError(f"{type(payload).__name__} is not a pipeline payload")
    payload.check(spec)
