"""Payloads: the run-time records that carry tensors across stage boundaries.

Every payload is a frozen record with named fields (a frozen ``dataclass``, not ``attrs``:
``torch.compile`` traces the forward, and Dynamo (torch 2.13) cannot trace the descriptor lookup
``object.__setattr__.__get__`` that a frozen ``attrs`` ``__init__`` starts with; a frozen dataclass
assigns with plain ``object.__setattr__`` calls, which it can. Specs, configs and stages, built once
before the forward, stay ``attrs``).

``payload.check(spec)`` verifies that the tensors agree with a :class:`~moeforge.spec.Spec`. Its
metadata checks (types, ranks, shapes, dtypes, devices) read no tensor values and cost no device
work: a pipeline runs them on its input on every call. ``values=True`` adds the checks that read
values (id ranges, distinct experts, group-list sums, non-finite routing weights), which need a host
synchronisation: pipelines run those in debug mode only, after every stage, and
:mod:`moeforge.testing` runs them to catch a stage that lies about its spec.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Union

import torch
from typing_extensions import Self

from moeforge.errors import PayloadError
from moeforge.kernels.config import MoEConfig
from moeforge.kernels.grouped_gemm_call import GemmRoute
from moeforge.spec import DType, Exchange, GroupListType, Layout, PayloadKind, ScaleLayout, Spec

GROUP_SIZE = 128  # elements per scale in ScaleLayout.PER_GROUP_128


def _fail(what: str, have: object, want: object) -> PayloadError:
    return PayloadError(f"{what}: have {have}, spec says {want}")


def _expect(condition: bool, what: str, have: object, want: object) -> None:
    if not condition:
        raise _fail(what, have, want)


def _tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise PayloadError(f"{what}: have {type(value).__name__}, expected a torch.Tensor")
    return value


def _finite(tensor: torch.Tensor, what: str) -> None:
    """Reads values (a host synchronisation): only for ``values=True`` checks."""
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise PayloadError(f"{what}: {bad} non-finite values (NaN or inf)")


def _check_data(value: object, spec: Spec, what: str) -> torch.Tensor:
    """An activation tensor's dtype and width (``[..., W]``; NVFP4 packs two values per byte)."""
    data = _tensor(value, what)
    _expect(data.dtype == spec.dtype.torch_dtype, f"{what} dtype", data.dtype, spec.dtype.value)
    width = spec.width // 2 if spec.dtype is DType.NVFP4 else spec.width
    _expect(data.dim() >= 1 and data.shape[-1] == width, f"{what} width",
            data.shape[-1] if data.dim() else "a 0-d tensor", width)
    return data


@dataclasses.dataclass(frozen=True, eq=False)
class Activations:
    """An activation tensor and its scales (``None`` when unquantized).

    ``data`` is ``[..., W]``. Scale shapes by layout: per token ``[..., 1]``, per 128-group
    ``[..., W // 128]``, per tensor ``[1]`` (all fp32).
    """

    data: torch.Tensor
    scale: Optional[torch.Tensor] = None

    def check(self, spec: Spec, where: str) -> None:
        """Metadata only (dtype, width, scale shape and dtype, device): reads no values."""
        data = _check_data(self.data, spec, f"{where}.data")
        layout = spec.scale_layout
        if layout is ScaleLayout.NONE:
            _expect(self.scale is None, f"{where}.scale", "a tensor", "no scale")
            return
        if self.scale is None:
            raise _fail(f"{where}.scale", None, layout.value)
        scale = _tensor(self.scale, f"{where}.scale")
        _expect(scale.device == data.device, f"{where}.scale device", scale.device, data.device)
        expected = scale_shape(layout, tuple(data.shape[:-1]), spec.width)
        _expect(tuple(scale.shape) == expected, f"{where}.scale shape", tuple(scale.shape), expected)
        _expect(scale.dtype == scale_dtype(layout), f"{where}.scale dtype", scale.dtype, scale_dtype(layout))


def scale_shape(layout: ScaleLayout, lead: tuple[int, ...], width: int) -> tuple[int, ...]:
    """The shape of the scales of activations ``[*lead, width]`` (``width`` unpacked) in ``layout``."""
    if layout is ScaleLayout.PER_TOKEN:
        return lead + (1,)
    if layout is ScaleLayout.PER_GROUP_128:
        return lead + (width // GROUP_SIZE,)
    if layout is ScaleLayout.PER_TENSOR:
        return (1,)
    if layout is ScaleLayout.NVFP4_BLOCK16:
        return lead + (width // 16,)
    raise ValueError(f"{layout.value} activations carry no scales")


def scale_dtype(layout: ScaleLayout) -> torch.dtype:
    """The dtype of the scales in ``layout``: e4m3 for NVFP4's 16-element blocks, fp32 otherwise."""
    return torch.float8_e4m3fn if layout is ScaleLayout.NVFP4_BLOCK16 else torch.float32


@dataclasses.dataclass(frozen=True, eq=False)
class MoEInput:
    """The pipeline input: token-major hidden states ``[T, H]`` and router logits ``[T, E]``; with a stack of
    expert adapters (:class:`~moeforge.adapters.ExpertAdapter` with ``count``), ``adapter_ids [T]`` (int32 or int64:
    each token's adapter, ``-1`` for none)."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor
    adapter_ids: Optional[torch.Tensor] = None

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.kind is PayloadKind.TOKENS, "payload kind", "MoEInput", spec.kind.value)
        hidden = _tensor(self.hidden_states, "hidden_states")
        _expect(hidden.dim() == 2, "hidden_states shape", tuple(hidden.shape), f"[tokens, {spec.width}]")
        _check_data(hidden, spec, "hidden_states")
        logits = _tensor(self.router_logits, "router_logits")
        want = (hidden.shape[0], spec.num_experts)
        _expect(tuple(logits.shape) == want, "router_logits shape", tuple(logits.shape),
                f"{want} (tokens x experts)")
        _expect(logits.is_floating_point(), "router_logits dtype", logits.dtype, "a float dtype")
        _expect(logits.device == hidden.device, "router_logits device", logits.device,
                f"{hidden.device} (the hidden states' device)")
        if self.adapter_ids is not None:
            _check_adapter_ids(self.adapter_ids, hidden.shape[0], hidden.device)
        if values:
            _finite(hidden, "hidden_states")
            _finite(logits, "router_logits")


def _check_adapter_ids(ids: torch.Tensor, tokens: int, device: torch.device) -> None:
    ids = _tensor(ids, "adapter_ids")
    _expect(tuple(ids.shape) == (tokens,), "adapter_ids shape", tuple(ids.shape), f"({tokens},): one per token")
    _expect(ids.dtype in (torch.int32, torch.int64), "adapter_ids dtype", ids.dtype, "int32 or int64")
    _expect(ids.device == device, "adapter_ids device", ids.device, f"{device} (the hidden states' device)")


@dataclasses.dataclass(frozen=True, eq=False)
class TopKOutput:
    """Routing decision: fp32 ``weights [T, K]`` (fp64 in a float64 layer, which routes in fp64) and int32
    global ``ids [T, K]``, each token's ``K`` ids distinct experts (the built-in routers by construction;
    ``CustomTopK`` checks it on every call; the value checks of debug mode check it after any routing
    stage)."""

    weights: torch.Tensor
    ids: torch.Tensor

    def check(self, num_tokens: int, spec: Spec, values: bool = True) -> None:
        want = (num_tokens, spec.top_k)
        weights, ids = _tensor(self.weights, "topk.weights"), _tensor(self.ids, "topk.ids")
        _expect(tuple(weights.shape) == want, "topk.weights shape", tuple(weights.shape), want)
        _expect(tuple(ids.shape) == want, "topk.ids shape", tuple(ids.shape), want)
        _expect(weights.dtype in (torch.float32, torch.float64), "topk.weights dtype", weights.dtype,
                "float32 (float64 in a float64 layer)")
        _expect(ids.dtype == torch.int32, "topk.ids dtype", ids.dtype, "int32")
        _expect(ids.device == weights.device, "topk.ids device", ids.device, weights.device)
        if not values:
            return
        _finite(weights, "topk.weights")
        if self.ids.numel() and spec.num_experts is not None:
            low, high = int(self.ids.min()), int(self.ids.max())
            _expect(low >= 0 and high < spec.num_experts, "topk.ids range", (low, high),
                    f"[0, {spec.num_experts})")
            ordered = torch.sort(self.ids, dim=-1).values
            repeated = bool((ordered[:, 1:] == ordered[:, :-1]).any())
            _expect(not repeated, "topk.ids", "a token routed to the same expert twice", "distinct experts")


@dataclasses.dataclass(frozen=True, eq=False)
class RoutedTokens:
    """Token-major activations (possibly quantized) with their routing decision, and each token's adapter
    (``adapter_ids [T]``, ``-1`` for none) where a stack of expert adapters is in use."""

    x: Activations
    topk: TopKOutput
    adapter_ids: Optional[torch.Tensor] = None

    def with_x(self, x: Activations) -> Self:
        return dataclasses.replace(self, x=x)

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.kind is PayloadKind.ROUTED, "payload kind", "RoutedTokens", spec.kind.value)
        _expect(spec.layout is Layout.TOKEN_MAJOR, "layout", "RoutedTokens", spec.layout.value)
        self.x.check(spec, "x")
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        self.topk.check(self.x.data.shape[0], spec, values)
        _expect(self.topk.ids.device == self.x.data.device, "topk.ids device", self.topk.ids.device,
                self.x.data.device)
        if self.adapter_ids is not None:
            _check_adapter_ids(self.adapter_ids, self.x.data.shape[0], self.x.data.device)


class Plan(abc.ABC):
    """How a dispatcher's expert-grouped rows go back to their tokens.

    Only the combine reads it, through :meth:`combine`: what a plan holds (row maps, capacities, the
    exchange with other expert-parallel ranks) is its dispatcher's business, so the stages between
    the dispatch and the combine never depend on which dispatcher ran. The dispatchers define their
    plans beside themselves (:mod:`moeforge.stages.dispatch`, :mod:`moeforge.stages.triton`,
    :mod:`moeforge.distributed`)."""

    @abc.abstractmethod
    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        """The token-major output ``[T, H]``: each token's copies among ``rows`` (the expert outputs, in
        the layout of the payload that carried this plan) summed in fp32 in the fixed order
        ``k = 0 .. top_k - 1``, times their routing weights when ``weighted``, times
        ``scaling_factor`` when given, in ``out_dtype``."""

    @abc.abstractmethod
    def kept(self) -> torch.Tensor:
        """``[T, top_k]`` bool: the copies :meth:`combine` sums (false for a copy a capacity dropped)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertRows:
    """Base of the expert-grouped payloads (dispatched rows, expert hidden states, expert outputs).

    Every layout carries its rows' routing weights in its own order (what a GEMM epilogue multiplies
    by) and the :class:`Plan` of the way back (keyword-only, so each layout's own fields come first); where a stack
    of expert adapters is in use, each row's adapter in the same order (``adapter_ids``: ``[R]`` for sorted rows,
    ``[E, C]`` for padded ones, ``[copies]`` in copy order for block-aligned ones; ``-1`` for none or an empty
    slot), which the dispatch computes as it places the rows."""

    x: Activations
    plan: Plan = dataclasses.field(kw_only=True)
    adapter_ids: Optional[torch.Tensor] = dataclasses.field(default=None, kw_only=True)

    def with_x(self, x: Activations) -> Self:
        return dataclasses.replace(self, x=x)


@dataclasses.dataclass(frozen=True, eq=False)
class SortedRows(ExpertRows):
    """``x.data [R, W]``: rows grouped by local expert; ``group_list [E]`` (int64) holds counts or
    cumulative sums, as ``group_list_type`` says; ``row_weights [R]`` (fp32) is each row's routing
    weight."""

    group_list: torch.Tensor
    group_list_type: GroupListType
    row_weights: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.group_list.shape[0])

    def counts(self) -> torch.Tensor:
        """Rows per expert as counts, whatever the group list convention."""
        if self.group_list_type is GroupListType.COUNT:
            return self.group_list
        return torch.diff(self.group_list, prepend=self.group_list.new_zeros(1))

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.layout is Layout.EXPERT_SORTED, "layout", "SortedRows", spec.layout.value)
        self.x.check(spec, "x")
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        _expect(self.group_list_type is spec.group_list_type, "group_list_type", self.group_list_type,
                spec.group_list_type)
        _expect(self.group_list.dtype == torch.int64, "group_list dtype", self.group_list.dtype, "int64")
        _expect(self.num_experts == spec.num_experts, "group_list length", self.num_experts,
                spec.num_experts)
        rows = self.x.data.shape[0]
        _expect(tuple(self.row_weights.shape) == (rows,), "row_weights shape", tuple(self.row_weights.shape),
                (rows,))
        if not values:
            return
        counts = self.counts()
        total = int(counts.sum()) if counts.numel() else 0
        _expect(bool((counts >= 0).all()), "group_list counts", counts.tolist(), "non-negative")
        _expect(total == rows, "rows covered by group_list", total, rows)


def used_slots(masked_m: torch.Tensor, capacity: int, device: torch.device) -> torch.Tensor:
    """``[E, capacity]`` bool: slot ``c`` of expert ``e`` is used where ``c < masked_m[e]``."""
    return torch.arange(capacity, device=device) < masked_m.to(device).unsqueeze(1)


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedRows(ExpertRows):
    """``x.data [E, C, W]``: each local expert's rows in a fixed-capacity buffer; only the first
    ``masked_m[e]`` rows of expert ``e`` are valid, the others hold any bits (the expert-parallel exchanges never
    write them: an earlier batch's rows, NaN included); ``slot_weights [E, C]`` (fp32) is each slot's
    routing weight (0 for empty slots)."""

    masked_m: torch.Tensor
    slot_weights: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.masked_m.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.x.data.shape[1])

    def used_slots(self) -> torch.Tensor:
        """``[E, C]`` bool: the valid slots (the first ``masked_m[e]`` of each expert ``e``)."""
        return used_slots(self.masked_m, self.capacity, self.x.data.device)

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.layout is Layout.EXPERT_PADDED, "layout", "PaddedRows", spec.layout.value)
        self.x.check(spec, "x")
        _expect(self.x.data.dim() == 3, "x.data rank", self.x.data.dim(), 3)
        _expect(self.num_experts == spec.num_experts, "masked_m length", self.num_experts,
                spec.num_experts)
        _expect(self.x.data.shape[0] == self.num_experts, "x.data experts", self.x.data.shape[0],
                self.num_experts)
        want = (self.num_experts, self.capacity)
        _expect(tuple(self.slot_weights.shape) == want, "slot_weights shape", tuple(self.slot_weights.shape),
                want)
        if values and self.masked_m.numel():
            _expect(int(self.masked_m.max()) <= self.capacity, "masked_m", int(self.masked_m.max()),
                    f"<= capacity {self.capacity}")


@dataclasses.dataclass(frozen=True, eq=False)
class BlockAlignment:
    """Where the copies of ``BLOCK_ALIGNED`` rows are (Triton fused-MoE style), all on the device:
    what the triton GEMMs read.

    ``sorted_ids`` lists copy indices ``c = t * copies_per_row + k`` grouped by expert, each expert's run
    padded with the sentinel ``num_copies`` to a multiple of ``block_m``; ``block_expert[b]`` is the
    local expert of block ``b``; ``num_padded`` (1 element, int32) is the used length of ``sorted_ids``.
    ``config`` is the GEMMs' launch configuration for this batch, chosen once by the dispatch (it
    decided ``block_m``); the GEMMs take it from here. ``copies_per_row``: the copies each row of the
    dispatched ``x.data`` stands for — the router's ``top_k`` for local tokens, 1 for rows an
    expert-parallel exchange delivered (each received row is one copy; the spec still says the
    router's ``k``).

    ``slot_copies`` > 0: the rows are in slot order (:mod:`moeforge.kernels.slot_rows`, a training step's layout):
    ``x.data`` holds each expert's copies in slot order, one row each, ``sorted_ids`` is each slot's row
    (``num_tokens`` the rows, ``copies_per_row`` 1; a padding slot holds ``num_tokens``) and ``slot_copies`` is the
    number of the router's copies (the rows), ``slot_runs`` where each expert's rows lie
    (:func:`moeforge.kernels.weight_grad.expert_runs`: rows 1 and 2); the plan
    (:class:`moeforge.stages.triton.AlignedPlan`) knows each copy's row.
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    config: MoEConfig
    copies_per_row: int
    num_tokens: int
    slot_copies: int = 0
    slot_runs: Optional[torch.Tensor] = None

    @property
    def block_m(self) -> int:
        return self.config.block_m

    @property
    def num_copies(self) -> int:
        return self.num_tokens * self.copies_per_row

    def route(self) -> GemmRoute:
        """The plan as the grouped GEMMs take it."""
        return GemmRoute(self.sorted_ids, self.block_expert, self.num_padded, self.num_copies,
                         aligned_block_m=self.block_m, slot_copies=self.slot_copies, slot_runs=self.slot_runs)


@dataclasses.dataclass(frozen=True, eq=False)
class StackAlignment:
    """The copies of :class:`AlignedRows` aligned again by (adapter, expert) pair for a stack of ``stack`` adapters:
    pair ``adapter * E + expert`` (:func:`moeforge.kernels.align.align_block_size` with ``stack * E`` groups);
    ``chosen`` (int32) each copy's adapter (0 for none) and ``used`` (fp32) the weight of its low-rank product (the
    adapters' scale, 0 for none, NaN for an id outside the stack), in the rows' layout."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    stack: int
    chosen: torch.Tensor
    used: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredRows:
    """Where a training step's slot-order rows came from (:mod:`moeforge.kernels.slot_rows`): ``rows`` — the
    dispatch's gather, the tensor itself — hold ``rows[index[t, j]] = tokens[t]`` (``index`` int32 ``[T, k]``). A
    first GEMM reading exactly these rows sums their gradient into ``tokens``' in its own backward, before its weight
    gradient (:class:`~moeforge.kernels.grouped_gemm_call.GemmRows` ``gathered_from``); rows a stage replaced are
    differentiated as they are."""

    rows: torch.Tensor
    tokens: torch.Tensor
    index: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class AlignedRows(ExpertRows):
    """Expert-grouped rows described by a :class:`BlockAlignment`, never physically sorted.

    When ``copy_major`` is false, ``x.data`` is still row-major as dispatched ``[T, W]`` and copy ``c``
    reads row ``c // copies_per_row`` (the first GEMM gathers by index); when true, ``x.data`` is
    ``[num_copies, W]`` with one row per copy, in copy order (what the GEMMs write). ``copy_weights
    [num_copies]`` (fp32) are the copies' routing weights in copy order. With a stack of expert adapters
    (``adapter_ids``): ``copy_experts [num_copies]`` (int32), each copy's local expert in copy order, where the
    dispatch knows it (else derived from the alignment), and ``stack_alignment``, the copies aligned by (adapter,
    expert) pair, which the first adapted GEMM makes and the second reuses. ``gathered``: where rows in slot order
    came from (:class:`GatheredRows`), until a GEMM has read them.
    """

    alignment: BlockAlignment
    copy_major: bool
    copy_weights: torch.Tensor
    copy_experts: Optional[torch.Tensor] = dataclasses.field(default=None, kw_only=True)
    stack_alignment: Optional[StackAlignment] = dataclasses.field(default=None, kw_only=True)
    gathered: Optional[GatheredRows] = dataclasses.field(default=None, kw_only=True)

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.layout is Layout.BLOCK_ALIGNED, "layout", "AlignedRows", spec.layout.value)
        self.x.check(spec, "x")
        _expect(self.x.data.dim() == 2, "x.data rank", self.x.data.dim(), 2)
        alignment = self.alignment
        rows = alignment.num_copies if self.copy_major else alignment.num_tokens
        _expect(self.x.data.shape[0] == rows, "x.data rows", self.x.data.shape[0], rows)
        # Local tokens: each row stands for the router's k copies; rows an exchange delivered or slots, one each.
        per_row = 1 if spec.exchange is not Exchange.NONE or alignment.slot_copies else spec.top_k
        _expect(alignment.copies_per_row == per_row, "alignment.copies_per_row", alignment.copies_per_row,
                f"{per_row} ({'top_k' if per_row != 1 else 'slots' if alignment.slot_copies else 'exchanged rows'})")
        _expect(tuple(self.copy_weights.shape) == (alignment.num_copies,), "copy_weights shape",
                tuple(self.copy_weights.shape), (alignment.num_copies,))
        if not values:
            return
        used = int(alignment.num_padded.item())
        _expect(used % alignment.block_m == 0 and used <= alignment.sorted_ids.numel(), "alignment.num_padded",
                used, f"a multiple of block_m={alignment.block_m} <= {alignment.sorted_ids.numel()}")
        if used and spec.num_experts is not None:
            experts = alignment.block_expert[: used // alignment.block_m]
            _expect(bool(((experts >= 0) & (experts < spec.num_experts)).all()), "alignment.block_expert",
                    "out of range", f"[0, {spec.num_experts})")


@dataclasses.dataclass(frozen=True, eq=False)
class MoEOutput:
    """The combined output, token-major ``[T, H]``."""

    hidden_states: torch.Tensor

    def check(self, spec: Spec, values: bool = True) -> None:
        _expect(spec.kind is PayloadKind.OUTPUT, "payload kind", "MoEOutput", spec.kind.value)
        _check_data(self.hidden_states, spec, "hidden_states")
        _expect(self.hidden_states.dim() == 2, "hidden_states rank", self.hidden_states.dim(), 2)


Payload = Union[MoEInput, RoutedTokens, SortedRows, PaddedRows, AlignedRows, MoEOutput]


def check_payload(payload: object, spec: Spec, *, values: bool = True) -> None:
    """Raise :class:`PayloadError` unless ``payload`` matches ``spec`` (``values=False``: the metadata
    checks only, which read no tensor values)."""
    if not isinstance(payload, (MoEInput, RoutedTokens, SortedRows, PaddedRows, AlignedRows, MoEOutput)):
        raise PayloadError(f"{type(payload).__name__} is not a pipeline payload")
    payload.check(spec, values)
