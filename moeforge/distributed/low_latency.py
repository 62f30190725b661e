"""The low-latency expert-parallel dispatcher: fixed-capacity buffers, no host synchronisation.

Every rank sends every other rank a buffer of the same, build-time size: ``capacity`` rows for each
of the receiver's local experts. Shapes never depend on the routing, so the dispatch and combine are
two equal-split ``all_to_all_single`` calls with no host sync (a flag byte in each row marks the used
slots: no counts are exchanged), and can be captured in a CUDA graph. The price is bytes: the full buffers travel however few tokens there are —
the right trade for decoding, where latency, not bandwidth, is the limit.

``capacity`` is per (source rank, expert): how many copies one rank may send one expert. Its default,
``max_tokens``, can never overflow (a token picks an expert at most once). A smaller capacity saves
bytes; copies beyond it are handled by ``overflow``: ``Overflow.DROP`` leaves them out and counts them
in ``dropped`` (a device tensor: reading it is the caller's choice of sync), ``Overflow.ERROR`` agrees
on the overflow across ranks (one small all-reduce and a host sync, so every rank raises together
instead of leaving the others waiting in the next collective) and raises ``InputError``. With the
default capacity no overflow is possible, so no check runs and nothing syncs whatever the policy.

On the receiving rank, rows are compacted per expert — source rank 0's rows first, then rank 1's —
into ``[L, world * capacity, H]`` with ``masked_m[l]`` valid rows (``EXPERT_PADDED``).

Backward (a call that records gradients of float rows): the gradients go back in the same fixed-capacity
buffers, each exchange's backward being the other's; a dropped copy gets none. Such a call zeroes the
unused slots of the expert buffers (otherwise whatever bytes they held would reach the weight gradients
as ``0 * NaN``); inference leaves them as they are.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import attrs
import torch
import torch.distributed as dist

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.distributed.exchange import (
    ExchangeDispatch,
    combine_on_source,
    count_per_expert,
    delivered,
    exchange_bytes,
    exchange_rows,
    scaled_rows,
)
from moeforge.distributed.group import ExpertParallel
from moeforge.distributed.wire import RowFormat, Traffic
from moeforge.errors import InputError
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, ExpertRows, PaddedRows, Plan, RoutedTokens, used_slots
from moeforge.spec import (
    Exchange,
    ExpertIds,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
)
from moeforge.stage import Stage, StageKind
from moeforge.stages.dispatch import Overflow, overflow_choice
from moeforge.no_backward import records_grad


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class LowLatencyPlan(Plan):
    """The way back from :class:`LowLatencyDispatch`'s rows: send the expert outputs back in the
    fixed-capacity buffers and sum each token's copies on its own rank; dropped copies add nothing.

    ``token_slots [T, K]`` is the send-buffer slot (``global expert * capacity + position``) of each
    copy, -1 if dropped; ``copy_weights [T, K]`` the routing weights; ``home [W * L * C]``, in the order
    of the send buffer the combine returns (rank, local expert, slot), the row of the expert buffer
    ``[L * W * C]`` that each received slot went to (any row for an empty slot: nobody reads it back);
    ``dropped`` (0-d) the copies this rank could not send."""

    ep: ExpertParallel
    token_slots: torch.Tensor
    copy_weights: torch.Tensor
    home: torch.Tensor
    dropped: torch.Tensor
    traffic: Traffic

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        # rows [L, W * C, H]: one gather puts every slot back where its source rank sent it from; the
        # rows of empty slots are placeholders that the source never reads (its dropped copies index -1).
        back = rows.reshape(-1, rows.shape[-1]).index_select(0, self.home)
        returned = exchange_rows(back, self.ep.group)
        weights = self.copy_weights if weighted else None
        return combine_on_source(returned, self.token_slots, weights, out_dtype, scaling_factor)

    def kept(self) -> torch.Tensor:
        return self.token_slots >= 0


@dataclasses.dataclass(frozen=True, eq=False)
class _DispatchBack:
    """The backward of :class:`LowLatencyDispatch`'s exchange: the gradients of the expert buffers' rows and
    weights go back, in the same fixed-capacity buffers, to the slots they were sent from (``gather``: the
    receive-buffer row of each expert-buffer row; ``slot``: each copy's send slot, ``spare`` if dropped)."""

    ep: ExpertParallel
    gather: torch.Tensor
    slot: torch.Tensor
    spare: int

    def __call__(self, grad_rows: torch.Tensor, grad_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = grad_rows.shape[-1]
        rows = grad_rows.new_empty(self.spare, width).index_copy_(0, self.gather, grad_rows.reshape(-1, width))
        weights = grad_weights.new_empty(self.spare).index_copy_(0, self.gather, grad_weights.reshape(-1))
        wire = RowFormat(width, rows.dtype)
        packet = wire.pack(rows, None, weights)
        home = torch.empty_like(packet)
        exchange_bytes(packet, home, self.ep.group)
        sent, _, sent_weights = wire.unpack(home)
        # A dropped copy's slot is the spare row past the end: its gradient is zero.
        sent = torch.cat([sent, sent.new_zeros(1, width)])
        sent_weights = torch.cat([sent_weights, sent_weights.new_zeros(1)])
        return sent.index_select(0, self.slot), sent_weights.index_select(0, self.slot)


@attrs.frozen(eq=False)
class LowLatencyDispatch(ExchangeDispatch, Stage[RoutedTokens, ExpertRows]):
    """Fixed-capacity exchange (see the module docstring). ``max_tokens``: the most tokens a rank
    passes per call (a larger batch is an ``InputError``); ``capacity``: rows per (source rank,
    expert), default ``max_tokens``; ``configs`` (the triton expert GEMMs' launch table): the rows leave
    ``BLOCK_ALIGNED`` for the triton GEMMs (each slot one copy, the valid ones aligned on the device,
    :func:`~moeforge.distributed.padded_alignment.aligned_padded_rows`) instead of ``EXPERT_PADDED``; a layer given
    this dispatcher with the triton backend sets it itself."""

    kinds: ClassVar = (StageKind.DISPATCH,)
    ep: ExpertParallel
    max_tokens: int
    capacity: Optional[int] = None
    overflow: Overflow = attrs.field(default=Overflow.ERROR, converter=overflow_choice)
    apply_routing_weights: bool = False
    configs: Optional[ConfigTable] = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            raise InputError(f"capacity must be a positive int (or None), got {self.capacity!r}")

    @property
    def slots(self) -> int:
        """Rows per (source rank, expert)."""
        return self.capacity if self.capacity is not None else self.max_tokens

    def buffer_bytes(self, dispatch: DispatchDtype, hidden: int, scale_layout: ScaleLayout) -> int:
        """Bytes of the send (= receive) buffer of one dispatch: ``num_experts * capacity`` rows of
        the wire format of ``dispatch`` (sized from :attr:`DispatchDtype.params_bytes`)."""
        return self.ep.num_experts * self.slots * RowFormat.for_dispatch(dispatch, hidden, scale_layout).row_bytes

    def summary(self) -> str:
        extra = ", weights on input" if self.apply_routing_weights else ""
        layout = "block-aligned, " if self.configs is not None else ""
        return (f"LowLatencyDispatch({layout}rank {self.ep.rank}/{self.ep.world_size}, max_tokens={self.max_tokens}, "
                f"capacity={self.slots}, overflow={self.overflow.value}{extra})")

    @property
    def checks_overflow(self) -> bool:
        """Whether a call reads on the host if any rank overflows, to raise: ``overflow=ERROR`` with a capacity below
        ``max_tokens`` (at ``max_tokens`` no overflow is possible: a token picks an expert at most once)."""
        return self.overflow is Overflow.ERROR and self.slots < self.max_tokens

    def replay_refusal(self, device: torch.device) -> Optional[str]:
        if self.checks_overflow:
            return (f"{type(self).__name__}(capacity={self.slots} < max_tokens={self.max_tokens}, overflow=error) reads "
                    "on the host whether a rank overflows, to raise (overflow=Overflow.DROP or the default capacity "
                    "replay)")
        return None

    def output_spec(self, spec: Spec) -> Spec:
        padded = spec.evolve(
            kind=PayloadKind.DISPATCHED, layout=Layout.EXPERT_PADDED, group_list_type=None,
            expert_ids=ExpertIds.LOCAL, num_experts=self.ep.local_experts, exchange=Exchange.LOW_LATENCY,
            routing_weights=RoutingWeights.ON_INPUT if self.apply_routing_weights else spec.routing_weights)
        return self.aligned_spec(padded)

    def __call__(self, x: RoutedTokens) -> ExpertRows:
        padded = self.padded(x)
        if self.configs is None:
            return padded
        from moeforge.distributed.padded_alignment import aligned_padded_rows

        tokens, top_k = x.topk.ids.shape  # (the tile chosen for this rank's own copies: what a rank gets on average)
        return aligned_padded_rows(padded, self.configs.lookup(max(tokens * top_k, 1)))

    def padded(self, x: RoutedTokens) -> PaddedRows:
        """The exchange itself: ``EXPERT_PADDED`` rows, whatever ``configs``."""
        ep, group, cap = self.ep, self.ep.group, self.slots
        world, local, experts = ep.world_size, ep.local_experts, ep.num_experts
        tokens, top_k = x.topk.ids.shape
        if tokens > self.max_tokens:
            raise InputError(f"LowLatencyDispatch got {tokens} tokens; its buffers hold max_tokens={self.max_tokens} "
                             "per rank: split the batch or build the dispatcher with a larger max_tokens")
        device = x.topk.ids.device
        flat = x.topk.ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices
        counts = count_per_expert(flat, experts)
        sorted_expert = flat[order]
        position = torch.arange(order.numel(), device=device) - (counts.cumsum(0) - counts)[sorted_expert]
        kept = position < cap
        dropped = (~kept).sum()
        if self.checks_overflow:
            self._raise_on_overflow(dropped, counts)

        weight = x.topk.weights.reshape(-1)[order]
        rows = scaled_rows(x.x, torch.div(order, top_k, rounding_mode="floor"), weight, self.apply_routing_weights)
        wire = RowFormat.of(rows)
        trash = experts * cap  # one extra row takes every dropped copy: no boolean indexing, no sync
        slot = torch.where(kept, sorted_expert * cap + position, trash)
        send = torch.empty(trash + 1, wire.row_bytes, dtype=torch.uint8, device=device)
        send[:, wire.flag_offset] = 0  # unused slots are told apart by their flag; their bytes need no clearing
        send.index_copy_(0, slot, wire.pack(rows.data, rows.scale, weight))
        received = torch.empty(trash, wire.row_bytes, dtype=torch.uint8, device=device)
        exchange_bytes(send[:trash], received, group)

        # Each (source rank, expert) block holds its rows first: gather every expert's rows into
        # [L, W * C], valid ones first in (source rank, position) order, straight from the receive
        # buffer ([W, L, C] rows); a stable sort of "invalid" finds them without a host sync.
        valid = wire.flags(received).view(world, local, cap).permute(1, 0, 2).reshape(local, world * cap)
        order_in_expert = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
        source_rank = torch.div(order_in_expert, cap, rounding_mode="floor")
        expert = torch.arange(local, device=device).unsqueeze(1)
        gather = (source_rank * local + expert) * cap + order_in_expert % cap
        data, scale, row_weight = wire.unpack(received, gather)
        adapter_ids = None
        if x.adapter_ids is not None:  # each copy's adapter in a buffer of the same slots (-1: an unused slot)
            sent_ids = torch.full((trash + 1,), -1, dtype=torch.int32, device=device)
            sent_ids.index_copy_(0, slot, x.adapter_ids.to(torch.int32).index_select(
                0, torch.div(order, top_k, rounding_mode="floor")))
            received_ids = torch.empty(trash, dtype=torch.int32, device=device)
            exchange_bytes(sent_ids[:trash], received_ids, group)
            adapter_ids = received_ids.index_select(0, gather.reshape(-1)).view(local, world * cap)
        masked_m = valid.sum(1).to(torch.int32)
        # Where each received slot went (for the way home): its rank among its expert's valid rows.
        position_in_expert = valid.long().cumsum(1) - 1
        home = (expert * (world * cap) + position_in_expert).clamp(min=0)
        # The empty slots' bytes were never written (their rows hold what the buffer held): the layout gives them a
        # routing weight of 0, and their rows are any bits (what no stage may read).
        used = used_slots(masked_m, world * cap, device)  # [L, W * C]
        row_weight = row_weight.masked_fill(~used, 0)

        if scale is None and records_grad(rows.data, weight):
            data = data.masked_fill(~used.unsqueeze(-1), 0)
            back = _DispatchBack(ep, gather.reshape(-1), slot, trash)
            data, row_weight = delivered((data, row_weight), (rows.data, weight), back)

        token_slots = torch.full((tokens * top_k,), -1, dtype=torch.int64, device=device)
        token_slots[order] = torch.where(kept, sorted_expert * cap + position, -1)
        traffic = Traffic(sent=trash * wire.row_bytes, received=trash * wire.row_bytes)
        plan = LowLatencyPlan(ep, token_slots.view(tokens, top_k), x.topk.weights,
                              home.view(local, world, cap).permute(1, 0, 2).reshape(-1), dropped, traffic)
        return PaddedRows(Activations(data, scale), masked_m, row_weight, plan=plan, adapter_ids=adapter_ids)

    def _raise_on_overflow(self, dropped: torch.Tensor, counts: torch.Tensor) -> None:
        # Every rank must raise together: a rank that raised alone would leave the others waiting in
        # the exchange below. One tiny all-reduce settles it (and syncs: use DROP in CUDA graphs).
        worst = torch.stack([dropped, counts.max() if counts.numel() else dropped]).to(torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.ep.group)
        total, most = worst.tolist()
        if total:
            raise InputError(
                f"LowLatencyDispatch capacity overflow: a rank sends up to {most} copies to one expert, capacity is "
                f"{self.slots} per (rank, expert); raise capacity or use overflow=Overflow.DROP (dropped copies "
                "are then counted in the plan's 'dropped')")
