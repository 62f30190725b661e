"""The normal expert-parallel dispatcher: a variable-length all-to-all of expert-grouped rows.

Dispatch, on every rank:

1. sort this rank's token copies by global expert (stable: ties keep token order), which groups them
   by destination rank and, within a rank, by local expert;
2. exchange the per-expert counts (a small all-to-all), then read the split sizes on the host — the
   one synchronisation of this dispatcher (the low-latency one has none);
3. pack each copy's row, scales and routing weight into one byte row (:mod:`~moeforge.distributed.wire`)
   and ``all_to_all_single`` them with those splits;
4. regroup the received rows by local expert (stable: source rank, then the source's order), so that
   the experts get ``EXPERT_SORTED`` rows with a ``group_list`` — or, built with the triton
   ``configs``, ``BLOCK_ALIGNED`` rows (each received row one copy of its local expert, the
   alignment plan computed on the device) for the triton expert GEMMs.

The rows' :class:`AllToAllPlan` (which the ordinary :class:`~moeforge.Combine` follows) sends the
expert outputs back with the reversed splits and sums each token's copies on its own rank in fp32,
``k = 0 .. top_k - 1`` in order, by gathering: deterministic.

Backward (a call that records gradients of float rows): each exchange's backward is the other's — the
gradients of the expert outputs travel to the experts' ranks the way the rows came, those of the
dispatched rows and their routing weights go home the way the outputs went, where each token's copies
are summed in the same fixed order (:func:`~moeforge.distributed.exchange.delivered`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import attrs
import torch

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
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, AlignedRows, BlockAlignment, ExpertRows, Plan, RoutedTokens, SortedRows
from moeforge.spec import (
    Exchange,
    ExpertIds,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    Spec,
)
from moeforge.stage import Stage, StageKind
from moeforge.stages.combine import combine_rows
from moeforge.no_backward import records_grad

_COUNT_BYTES = 8  # int64 per expert in the count exchange


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class AllToAllPlan(Plan):
    """The way back from :class:`AllToAllDispatch`'s rows: send the expert outputs home with the
    reversed splits and sum each token's copies on its own rank.

    ``send_splits[r]`` / ``recv_splits[r]``: rows this rank sent to / received from rank ``r``;
    ``token_rows [T, K]``: the send-buffer row of copy ``k`` of token ``t`` (every copy is sent);
    ``copy_weights [T, K]``: the routing weights (fp32); ``return_order [R]``: for each receive-buffer
    row, its expert-sorted row (the inverse of the regrouping); ``traffic``: the dispatch's bytes.
    """

    ep: ExpertParallel
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    token_rows: torch.Tensor
    copy_weights: torch.Tensor
    return_order: torch.Tensor
    traffic: Traffic

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        # rows: expert-sorted order (block-aligned rows: one copy per row, in row order)
        back = rows.index_select(0, self.return_order)  # receive-buffer order (a gather, not a scatter)
        returned = exchange_rows(back, self.ep.group, list(self.recv_splits), list(self.send_splits))
        weights = self.copy_weights if weighted else None
        return combine_on_source(returned, self.token_rows, weights, out_dtype, scaling_factor)

    def kept(self) -> torch.Tensor:
        return self.token_rows >= 0

    def combine_traffic(self, row_bytes: int) -> Traffic:
        """The combine's bytes for expert outputs of ``row_bytes`` bytes per row: the dispatch's rows,
        reversed."""
        return Traffic(sent=sum(self.recv_splits) * row_bytes, received=sum(self.send_splits) * row_bytes)


@attrs.frozen(eq=False)
class AllToAllDispatch(ExchangeDispatch, Stage[RoutedTokens, ExpertRows]):
    """Send every token copy to the rank that owns its expert (see the module docstring).

    ``apply_routing_weights`` scales the rows by their routing weights before sending (Llama-4).
    ``configs`` (the triton launch table of the expert GEMMs) makes the output ``BLOCK_ALIGNED``
    (:class:`~moeforge.payloads.AlignedRows`, each received row one copy: ``copies_per_row = 1`` in its
    alignment; the spec keeps the router's ``top_k``) instead of
    ``EXPERT_SORTED``.
    """

    kinds: ClassVar = (StageKind.DISPATCH,)
    ep: ExpertParallel
    group_list_type: GroupListType = GroupListType.COUNT
    apply_routing_weights: bool = False
    configs: Optional[ConfigTable] = None

    def __attrs_post_init__(self) -> None:
        if self.configs is not None:
            from moeforge.stages.triton import kernel_ops

            kernel_ops()

    def summary(self) -> str:
        extra = ", weights on input" if self.apply_routing_weights else ""
        layout = "block-aligned" if self.configs is not None else self.group_list_type.name.lower()
        return (f"AllToAllDispatch({layout}, rank {self.ep.rank}/{self.ep.world_size}, "
                f"{self.ep.local_experts} local experts{extra})")

    def replay_refusal(self, device: torch.device) -> Optional[str]:
        return "AllToAllDispatch reads its split sizes on the host (SymmetricDispatch and LowLatencyDispatch do not)"

    def output_spec(self, spec: Spec) -> Spec:
        common = dict(kind=PayloadKind.DISPATCHED, expert_ids=ExpertIds.LOCAL, num_experts=self.ep.local_experts,
                      exchange=Exchange.ALL_TO_ALL,
                      routing_weights=RoutingWeights.ON_INPUT if self.apply_routing_weights else spec.routing_weights)
        if self.configs is not None:
            return spec.evolve(layout=Layout.BLOCK_ALIGNED, group_list_type=None,
                               alignment=self.configs.alignment(), **common)
        return spec.evolve(layout=Layout.EXPERT_SORTED, group_list_type=self.group_list_type, **common)

    def __call__(self, x: RoutedTokens) -> ExpertRows:
        ep, group = self.ep, self.ep.group
        world, local = ep.world_size, ep.local_experts
        tokens, top_k = x.topk.ids.shape
        flat = x.topk.ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices
        counts = count_per_expert(flat, ep.num_experts)
        recv_counts = torch.empty_like(counts)
        exchange_bytes(counts, recv_counts, group)  # recv_counts[r * L + l]: rows rank r sends my expert l
        splits = torch.stack([counts.view(world, local).sum(1), recv_counts.view(world, local).sum(1)]).tolist()
        send_splits, recv_splits = splits  # the host sync: split sizes must be known to the collective

        weight = x.topk.weights.reshape(-1)[order]
        token_of_copy = torch.div(order, top_k, rounding_mode="floor")
        wire = RowFormat.of(x.x)
        source = x.x.data  # what the rows are made of (for the backward)
        if self.apply_routing_weights:  # every copy has its own data
            rows = scaled_rows(x.x, token_of_copy, weight, True)
            source = rows.data
            packet = wire.pack(rows.data, rows.scale, weight)
        else:
            # Pack each token once, then gather the copies' rows in one pass and write their weights
            # (top_k times fewer bytes packed than packing every copy).
            packet = wire.pack(x.x.data, x.x.scale, None).index_select(0, token_of_copy)
            wire.set_weights(packet, weight)
        received = packet.new_empty(sum(recv_splits), wire.row_bytes)
        exchange_bytes(packet, received, group, recv_splits, send_splits)

        # Received rows come per source rank, each grouped by my local experts; group them by expert.
        row_expert = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(world), recv_counts,
                                             output_size=received.shape[0])
        regroup = torch.sort(row_expert, stable=True).indices
        data, scale, row_weight = wire.unpack(received, regroup)
        adapter_ids = None
        if x.adapter_ids is not None:  # each copy's adapter travels beside its row (a stack of expert adapters)
            sent_ids = x.adapter_ids.to(torch.int32).index_select(0, token_of_copy).view(-1, 1)  # rows: split sizes
            received_ids = sent_ids.new_empty(received.shape[0], 1)
            exchange_bytes(sent_ids, received_ids, group, recv_splits, send_splits)
            adapter_ids = received_ids.view(-1).index_select(0, regroup)
        expert_counts = recv_counts.view(world, local).sum(0)
        traffic = Traffic(sent=packet.numel() + counts.numel() * _COUNT_BYTES,
                          received=received.numel() + recv_counts.numel() * _COUNT_BYTES)
        token_rows, return_order = _inverse(order).view(tokens, top_k), _inverse(regroup)
        if scale is None and records_grad(source, weight):
            back = _DispatchBack(ep, send_splits, recv_splits, return_order,
                                 None if self.apply_routing_weights else token_rows)
            data, row_weight = delivered((data, row_weight), (source, weight), back)
        plan = AllToAllPlan(ep, tuple(send_splits), tuple(recv_splits), token_rows, x.topk.weights, return_order,
                            traffic)
        if self.configs is not None:
            row_expert = torch.repeat_interleave(torch.arange(local, device=flat.device, dtype=torch.int32),
                                                 expert_counts, output_size=row_weight.shape[0])
            return AlignedRows(Activations(data, scale), self._alignment(row_expert), copy_major=False,
                               copy_weights=row_weight, plan=plan, adapter_ids=adapter_ids,
                               copy_experts=row_expert if adapter_ids is not None else None)
        group_list = expert_counts if self.group_list_type is GroupListType.COUNT else expert_counts.cumsum(0)
        return SortedRows(Activations(data, scale), group_list, self.group_list_type, row_weight, plan=plan,
                          adapter_ids=adapter_ids)

    def _alignment(self, row_expert: torch.Tensor) -> BlockAlignment:
        """The block alignment of expert-sorted rows (``row_expert [rows]``, int32: each row's local expert): each
        row one copy (``copies_per_row = 1``), aligned on the device like local tokens."""
        assert self.configs is not None
        rows = row_expert.shape[0]
        config = self.configs.lookup(rows)
        from moeforge.kernels import ops  # (imports Triton: the triton path only)

        sorted_ids, block_expert, num_padded = ops.align_block_size(
            row_expert.view(rows, 1), self.ep.local_experts, config.block_m, torch.is_grad_enabled())
        return BlockAlignment(sorted_ids=sorted_ids, block_expert=block_expert, num_padded=num_padded,
                              config=config, copies_per_row=1, num_tokens=rows)


@dataclasses.dataclass(frozen=True, eq=False)
class _DispatchBack:
    """The backward of :class:`AllToAllDispatch`'s exchange: the gradients of the received rows and of their
    routing weights go back to the ranks and copies they came from (the combine's route), where a token's
    copies are summed ``k = 0 .. top_k - 1`` in order (``token_rows``; ``None``: the rows sent were the
    copies themselves, scaled on the input)."""

    ep: ExpertParallel
    send_splits: list[int]
    recv_splits: list[int]
    return_order: torch.Tensor
    token_rows: Optional[torch.Tensor]

    def __call__(self, grad_rows: torch.Tensor, grad_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = grad_rows.index_select(0, self.return_order)  # back to the receive buffer's order
        wire = RowFormat(rows.shape[-1], rows.dtype)
        packet = wire.pack(rows, None, grad_weights.index_select(0, self.return_order))
        home = packet.new_empty(sum(self.send_splits), wire.row_bytes)
        exchange_bytes(packet, home, self.ep.group, self.send_splits, self.recv_splits)
        copies, _, weights = wire.unpack(home)
        if self.token_rows is None:
            return copies, weights
        return combine_rows(copies, self.token_rows, None, copies.dtype), weights


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse
