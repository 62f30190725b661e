# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Rows written straight into other GPUs' memory: the kernels of the symmetric-memory expert-parallel exchange.

Every rank of the group holds the same regions at the same offsets of a symmetric allocation (each rank's memory,
mapped into every other rank's address space over NVLink, :mod:`moeforge.distributed.symmetric`); a rank reaches
peer ``r``'s copy of a region at its own copy's address plus ``deltas[r]`` elements. Every region these kernels touch
holds 4-byte elements (rows and scales are copied as 32-bit words; routing weights fp32; counts, origins and adapter
ids int32), so one ``deltas`` array (int64, in words) serves them all.

* :func:`route`: each copy's position among this rank's copies of its expert, and this rank's copies per global
  expert into row ``rank`` of every peer's ``[W, E]`` table;
* :func:`place` (compact buffers): where each expert's rows from this rank start at its owner, this rank's own runs,
  what falls past the buffers;
* :func:`put_rows`: each copy's row (and scales, routing weight, origin and adapter id) into the expert buffer of the
  rank owning its expert, at the slot the exchanged counts give it — source ranks in rank order, each rank's copies
  of one expert in copy order (the order of :class:`~moeforge.distributed.LowLatencyDispatch`);
* :func:`fan_out`: where :func:`put_rows` sent each token's row once per owning rank, each expert-buffer row
  copied from its token's row on the owner;
* :func:`receive`: after the rows arrived, each local expert's valid rows and its slots' routing weights and adapter
  ids (0 and -1 past them);
* :func:`return_rows`: each valid expert-buffer row back to the slot of the copy it came from, on its source rank;
* :func:`sum_on_owner` and :func:`sum_partials`: instead, each owner sums a token's copies it holds into one fp32
  partial at the source, and the source adds its tokens' partials in rank order.

A rank must not read what its peers wrote before they all signal (the caller's barrier after each kernel). Under
Triton's interpreter (CPU) the "peers" are other tensors of the same process at the same distances: the tests check
the addressing there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import next_power_of_2

_WORDS = 1024  # words copied per step of a row


@triton.jit
def _route_kernel(experts_ptr, positions_ptr, copies_ptr, table_ptr, deltas_ptr, dropped_ptr, counts_ptr, num_copies,
                  rank, world, E, capacity, COUNT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    # One program. COUNT: the copies in order, BLOCK at a time (running[e] counts the copies of expert e seen so
    # far); else the counts were computed (counts_ptr) and are only published.
    offs_e = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK)
    if COUNT:
        running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    else:
        running = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    for first in range(0, num_copies if COUNT else 0, BLOCK):
        offs = first + lanes
        ok = offs < num_copies
        expert = tl.load(experts_ptr + offs, mask=ok, other=-1)
        earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None])
        hit = (expert[:, None] == offs_e[None, :]).to(tl.int32)  # [BLOCK, BLOCK_E]
        position = tl.sum(hit * running[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(positions_ptr + offs, position, mask=ok)
        tl.store(copies_ptr + offs, tl.where(position < capacity, offs, -1).to(tl.int64), mask=ok)
        running += tl.sum(hit, axis=0)
    if COUNT:
        tl.store(dropped_ptr, tl.sum(tl.maximum(running - capacity, 0), axis=0).to(tl.int64))
    for peer in range(world):  # this rank's counts into row `rank` of every rank's table
        delta = tl.load(deltas_ptr + peer)
        tl.store(table_ptr + delta + rank * E + offs_e, running, mask=offs_e < E)


@triton.jit
def _place_kernel(table_ptr, offsets_ptr, valid_ptr, starts_ptr, dropped_ptr, most_ptr, rank, world, local, rows,
                  BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr):
    # One program; the table seen as [world (source), world (owner), local]: expert o * local + l.
    owner = tl.arange(0, BLOCK_W)[:, None]
    expert = tl.arange(0, BLOCK_L)[None, :]
    inside = (owner < world) & (expert < local)
    index = owner * local + expert
    experts = world * local
    totals = tl.zeros((BLOCK_W, BLOCK_L), dtype=tl.int32)  # rows each owner's expert receives from every rank
    before = tl.zeros((BLOCK_W, BLOCK_L), dtype=tl.int32)  # ... from the ranks before this one
    for source in range(0, world):
        sent = tl.load(table_ptr + source * experts + index, mask=inside, other=0)
        totals += sent
        before += tl.where(source < rank, sent, 0)
    mine = tl.load(table_ptr + rank * experts + index, mask=inside, other=0)
    offsets = tl.cumsum(totals, axis=1) - totals + before  # the owner's earlier experts, then the earlier ranks
    tl.store(offsets_ptr + index, offsets, mask=inside)
    tl.store(dropped_ptr, tl.sum(tl.sum(tl.minimum(tl.maximum(offsets + mine - rows, 0), mine), axis=1),
                                 axis=0).to(tl.int64))
    tl.store(most_ptr, tl.max(tl.sum(totals, axis=1), axis=0).to(tl.int64))
    # This rank's experts' runs in its buffer, one after another, cut at ``rows``.
    owned = tl.sum(tl.where(owner == rank, totals, 0), axis=0)  # [BLOCK_L]
    ends = tl.cumsum(owned, axis=0)
    first = tl.minimum(ends - owned, rows)
    mask = tl.arange(0, BLOCK_L) < local
    tl.store(valid_ptr + tl.arange(0, BLOCK_L), tl.minimum(ends, rows) - first, mask=mask)
    tl.store(starts_ptr + tl.arange(0, BLOCK_L), first.to(tl.int64), mask=mask)


@triton.jit
def _put_rows_kernel(rows_ptr, scales_ptr, weights_ptr, experts_ptr, positions_ptr, table_ptr, offsets_ptr,
                     adapters_ptr, kept_ptr, recv_rows_ptr, recv_scales_ptr, recv_weights_ptr, recv_origins_ptr,
                     recv_adapters_ptr, recv_tokens_ptr, recv_token_scales_ptr, slot_map_ptr,
                     deltas_ptr, rank, world, E, local, slots, capacity, limit, origin_base, max_tokens,
                     D: tl.constexpr, S: tl.constexpr, TOP_K: tl.constexpr, ROWS_PER_COPY: tl.constexpr,
                     HAS_ADAPTERS: tl.constexpr, COMPACT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_S: tl.constexpr, TOKENS_ONCE: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MAP: tl.constexpr):
    copy = tl.program_id(0).to(tl.int64)
    if TOKENS_ONCE:  # the token's row goes to each owner once, from the first of its copies that owner's experts take
        sender = copy // TOP_K
        to_rank = (tl.load(experts_ptr + copy) // local).to(tl.int64)
        lanes = tl.arange(0, BLOCK_K)
        before_copy = lanes < copy % TOP_K
        others = tl.load(experts_ptr + sender * TOP_K + lanes, mask=before_copy, other=-1)
        if tl.sum(((others // local == to_rank) & before_copy).to(tl.int32), axis=0) == 0:
            to_delta = tl.load(deltas_ptr + to_rank)
            if ALIGNED:
                to_delta = tl.multiple_of(to_delta, 4)
            token_row = rank * max_tokens + sender  # the owner's token rows: [source rank, max_tokens]
            for step in range(0, D, BLOCK):
                cols = step + tl.arange(0, BLOCK)
                tl.store(recv_tokens_ptr + to_delta + token_row * D + cols,
                         tl.load(rows_ptr + sender * D + cols, mask=cols < D), mask=cols < D)
            if S > 0:
                cols_s = tl.arange(0, BLOCK_S)
                tl.store(recv_token_scales_ptr + to_delta + token_row * S + cols_s,
                         tl.load(scales_ptr + sender * S + cols_s, mask=cols_s < S), mask=cols_s < S)
    position = tl.load(positions_ptr + copy)
    kept_slot = copy * 0 - 1  # (HAS_MAP: the slot this copy takes at its owner, -1 where it drops)
    if position < capacity:
        expert = tl.load(experts_ptr + copy).to(tl.int64)
        owner = expert // local
        if COMPACT:  # the owner's rows one expert after another: this rank's first slot of the expert, given
            slot = tl.load(offsets_ptr + expert).to(tl.int64) + position
        else:  # [local, slots] buffers: this expert's rows from ranks before this one, each up to the capacity
            start = position * 0
            for earlier in range(0, rank):
                start += tl.minimum(tl.load(table_ptr + earlier * E + expert), capacity)
            slot = (expert % local) * slots + start + position
        if COMPACT:  # each copy's slot in the return buffer: its index, -1 past the owner's buffer (dropped)
            tl.store(kept_ptr + copy, tl.where(slot < limit, copy, -1))
        kept_slot = tl.where(slot < limit, slot, -1)
        if slot < limit:
            delta = tl.load(deltas_ptr + owner)
            if ALIGNED:  # every peer 16 bytes apart: the rows go out 4 words per store
                delta = tl.multiple_of(delta, 4)
            token = copy // TOP_K
            source = copy if ROWS_PER_COPY else token
            for first in range(0, 0 if TOKENS_ONCE else D, BLOCK):  # (TOKENS_ONCE: the owner copies the token's row)
                offs = first + tl.arange(0, BLOCK)
                ok = offs < D
                words = tl.load(rows_ptr + source * D + offs, mask=ok)
                tl.store(recv_rows_ptr + delta + slot * D + offs, words, mask=ok)
            if S > 0 and not TOKENS_ONCE:
                offs_s = tl.arange(0, BLOCK_S)
                ok_s = offs_s < S
                tl.store(recv_scales_ptr + delta + slot * S + offs_s,
                         tl.load(scales_ptr + source * S + offs_s, mask=ok_s), mask=ok_s)
            tl.store(recv_weights_ptr + delta + slot, tl.load(weights_ptr + copy))
            tl.store(recv_origins_ptr + delta + slot, (origin_base + copy).to(tl.int32))
            if HAS_ADAPTERS:
                tl.store(recv_adapters_ptr + delta + slot, tl.load(adapters_ptr + token))
    if HAS_MAP:  # every rank's slot map: this copy's slot on its owner, -1 on the other ranks and where it drops
        map_owner = tl.load(experts_ptr + copy) // local
        for peer in range(0, world):
            tl.store(slot_map_ptr + tl.load(deltas_ptr + peer) + origin_base + copy,
                     tl.where(peer == map_owner, kept_slot, -1).to(tl.int32))


@triton.jit
def _expert_rows(masked_ptr, starts_ptr, slots, HAS_STARTS: tl.constexpr):
    """``(first row, valid rows)`` of the local expert of program axis 0 in the expert buffers: ``masked[l]`` rows
    from ``starts[l]`` (compact rows) or from ``l * slots`` (``[local, slots]`` buffers)."""
    expert = tl.program_id(0).to(tl.int64)
    valid = tl.load(masked_ptr + expert)
    if HAS_STARTS:
        first_row = tl.load(starts_ptr + expert).to(tl.int64)
    else:
        first_row = expert * slots
    return first_row, valid


@triton.jit
def _return_rows_kernel(out_ptr, masked_ptr, starts_ptr, origins_ptr, ret_ptr, deltas_ptr, slots, copies_per_rank,
                        stride_out, D: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                        HAS_STARTS: tl.constexpr, ALIGNED: tl.constexpr):
    first_row, valid = _expert_rows(masked_ptr, starts_ptr, slots, HAS_STARTS)
    for j in range(tl.program_id(1), valid, PROGRAMS):
        row = first_row + j
        origin = tl.load(origins_ptr + row).to(tl.int64)
        source = origin // copies_per_rank
        copy = origin % copies_per_rank
        delta = tl.load(deltas_ptr + source)
        if ALIGNED:
            delta = tl.multiple_of(delta, 4)
        for first in range(0, D, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < D
            tl.store(ret_ptr + delta + copy * D + offs, tl.load(out_ptr + row * stride_out + offs, mask=ok), mask=ok)


@triton.jit
def _fan_out_kernel(tokens_ptr, token_scales_ptr, rows_ptr, scales_ptr, masked_ptr, starts_ptr, origins_ptr, slots,
                    D: tl.constexpr, S: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_S: tl.constexpr, PROGRAMS: tl.constexpr, HAS_STARTS: tl.constexpr):
    # Local: each valid buffer row gets the row of the token its copy came from (origin // TOP_K: source rank and
    # token, the token rows' index), the rows and scales put_rows would have written there.
    first_row, valid = _expert_rows(masked_ptr, starts_ptr, slots, HAS_STARTS)
    for j in range(tl.program_id(1), valid, PROGRAMS):
        row = first_row + j
        token_row = tl.load(origins_ptr + row).to(tl.int64) // TOP_K
        for first in range(0, D, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < D
            tl.store(rows_ptr + row * D + offs, tl.load(tokens_ptr + token_row * D + offs, mask=ok), mask=ok)
        if S > 0:
            offs_s = tl.arange(0, BLOCK_S)
            ok_s = offs_s < S
            tl.store(scales_ptr + row * S + offs_s, tl.load(token_scales_ptr + token_row * S + offs_s, mask=ok_s),
                     mask=ok_s)


@triton.jit
def _sum_on_owner_kernel(rows_ptr, weights_ptr, map_ptr, masked_ptr, starts_ptr, origins_ptr, ret_ptr, deltas_ptr,
                         slots, stride_rows, copies_per_rank, max_tokens, rank, H, TOP_K: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                         HAS_STARTS: tl.constexpr, WEIGHTED: tl.constexpr, ALIGNED: tl.constexpr,
                         PER_WORD: tl.constexpr):
    # Per valid row: the program of a token's first copy on this rank sums all of them (k order, fp32, each times
    # its slot's routing weight if WEIGHTED) into the token's partial at the source, row [rank, token] of its
    # [W * max_tokens, H] region (of ret_ptr's dtype: PER_WORD elements to a 4-byte word of the deltas).
    first_row, valid = _expert_rows(masked_ptr, starts_ptr, slots, HAS_STARTS)
    lanes = tl.arange(0, BLOCK_K)
    for j in range(tl.program_id(1), valid, PROGRAMS):
        origin = tl.load(origins_ptr + first_row + j).to(tl.int64)
        source = origin // copies_per_rank
        base = origin - origin % TOP_K  # the token's first copy's origin: its k entries of the slot map
        entries = tl.load(map_ptr + base + lanes, mask=lanes < TOP_K, other=-1)
        if tl.sum(((entries >= 0) & (lanes < origin % TOP_K)).to(tl.int32), axis=0) == 0:
            delta = tl.load(deltas_ptr + source)
            if ALIGNED:
                delta = tl.multiple_of(delta, 4)
            delta = delta * PER_WORD
            token = origin % copies_per_rank // TOP_K
            out = ret_ptr + delta + (rank * max_tokens + token) * H
            for first in range(0, H, BLOCK):
                cols = first + tl.arange(0, BLOCK)
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for k in tl.static_range(TOP_K):
                    slot = tl.load(map_ptr + base + k).to(tl.int64)
                    if slot >= 0:
                        row = tl.load(rows_ptr + slot * stride_rows + cols, mask=cols < H).to(tl.float32)
                        if WEIGHTED:
                            row = row * tl.load(weights_ptr + slot)
                        acc += row
                tl.store(out + cols, acc.to(ret_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _sum_partials_kernel(partials_ptr, experts_ptr, kept_ptr, out_ptr, H, local, max_tokens, world, scaling,
                         TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    # Per (token, column block): the partials of the ranks owning a kept copy of the token, in rank order.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, BLOCK_K)
    copies = token * TOP_K + lanes
    owners = tl.load(experts_ptr + copies, mask=lanes < TOP_K, other=0) // local
    kept = tl.load(kept_ptr + copies, mask=lanes < TOP_K, other=-1) >= 0
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for owner in range(0, world):
        if tl.sum((kept & (owners == owner)).to(tl.int32), axis=0) > 0:
            acc += tl.load(partials_ptr + (owner * max_tokens + token) * H + cols, mask=cols < H).to(tl.float32)
    tl.store(out_ptr + token * H + cols, (acc * scaling).to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _receive_kernel(table_ptr, weights_ptr, adapters_ptr, masked_ptr, slot_weights_ptr, slot_adapters_ptr, world, E,
                    first_expert, slots, capacity, HAS_ADAPTERS: tl.constexpr, BLOCK: tl.constexpr):
    # One program per local expert: its valid rows (each source rank's count up to the capacity, summed), and its
    # slots' routing weights (0) and adapter ids (-1) past them.
    expert = tl.program_id(0)
    valid = 0
    for source in range(0, world):
        valid += tl.minimum(tl.load(table_ptr + source * E + first_expert + expert), capacity)
    tl.store(masked_ptr + expert, valid)
    for first in range(0, slots, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        ok = offs < slots
        row = expert.to(tl.int64) * slots + offs
        tl.store(slot_weights_ptr + row, tl.where(offs < valid, tl.load(weights_ptr + row, mask=ok, other=0.0), 0.0),
                 mask=ok)
        if HAS_ADAPTERS:
            ids = tl.load(adapters_ptr + row, mask=ok, other=-1)
            tl.store(slot_adapters_ptr + row, tl.where(offs < valid, ids, -1), mask=ok)


def words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous rows) viewed as ``[rows, width]`` 32-bit words (its last dimension's bytes must be a
    multiple of 4)."""
    return tensor.reshape(-1, tensor.shape[-1]).view(torch.int32)


def route(experts: torch.Tensor, table: torch.Tensor, deltas: torch.Tensor, rank: int, capacity: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each copy's position among this rank's copies of its expert (``experts [copies]`` int32, copy order), its
    slot in the return buffer (its index, -1 where the position reaches ``capacity``: dropped) and the number
    dropped (0-d int64); this rank's copies per expert written into row ``rank`` of every rank's ``[W, E]`` int32
    ``table`` (``deltas [W]``). One program (decode-sized batches: :data:`ROUTE_MAX_COPIES`)."""
    copies = experts.numel()
    positions = torch.empty(copies, dtype=torch.int32, device=experts.device)
    kept = torch.empty(copies, dtype=torch.int64, device=experts.device)
    dropped = torch.empty((), dtype=torch.int64, device=experts.device)

    _route(experts, positions, kept, table, deltas, dropped, experts, copies, rank, capacity, True)
    return positions, kept, dropped


def publish_counts(counts: torch.Tensor, table: torch.Tensor, deltas: torch.Tensor, rank: int) -> None:
    """``counts [E]`` (int32, computed elsewhere) into row ``rank`` of every rank's ``[W, E]`` int32 ``table``."""
    _route(counts, counts, counts, table, deltas, counts, counts, 0, rank, 0, False)


def _route(experts: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor, table: torch.Tensor,
           deltas: torch.Tensor, dropped: torch.Tensor, counts: torch.Tensor, copies: int, rank: int, capacity: int,
           count: bool) -> None:
    experts_total = table.numel() // deltas.numel()

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(COUNT=count, BLOCK=32, BLOCK_E=next_power_of_2(experts_total)), dict(num_warps=4)

    _ROUTE.launch(("route", experts_total, count), (1,), (experts, positions, kept, table, deltas, dropped, counts,
                                                          copies, rank, deltas.numel(), experts_total, capacity), make)


# The most copies (tokens x top-k) :func:`route` takes: it walks them in one program, which beyond a decode batch
# costs more than the sort and scans it replaces.
ROUTE_MAX_COPIES = 4096


def put_rows(rows: torch.Tensor, scales: Optional[torch.Tensor], weights: torch.Tensor, experts: torch.Tensor,
             positions: torch.Tensor, table: torch.Tensor, adapters: Optional[torch.Tensor],
             recv_rows: torch.Tensor, recv_scales: Optional[torch.Tensor], recv_weights: torch.Tensor,
             recv_origins: torch.Tensor, recv_adapters: Optional[torch.Tensor], deltas: torch.Tensor, *,
             rank: int, top_k: int, local: int, slots: int, capacity: int, origin_base: int,
             offsets: Optional[torch.Tensor] = None, limit: Optional[int] = None, kept: Optional[torch.Tensor] = None,
             aligned: bool = False, recv_tokens: Optional[torch.Tensor] = None,
             recv_token_scales: Optional[torch.Tensor] = None, max_tokens: int = 0,
             slot_map: Optional[torch.Tensor] = None) -> None:
    """Each copy ``c`` (``experts [T * top_k]`` int32 global experts, ``positions`` int32 among this rank's copies of
    its expert, sent where below ``capacity``) into the buffers of the rank owning its expert: row ``rows[c]``
    (``[T * top_k, D]`` words, one row per copy) or ``rows[c // top_k]`` (``[T, D]``, one per token) with its
    ``scales`` (words), ``weights[c]`` (fp32), origin ``origin_base + c`` and the token's adapter id, at slot
    ``(expert % local) * slots + start + position`` of ``recv_* [local * slots, ...]``, where ``start`` is the sum of
    the counts ranks ``0 .. rank - 1`` wrote for the expert in this rank's ``[W, E]`` ``table``, each up to the
    capacity. Compact buffers (``offsets [E]`` int32 given): at slot ``offsets[expert] + position`` of ``recv_*
    [limit, ...]``, and only below ``limit``; then ``kept [T * top_k]`` (int64) gets each copy's index, or -1 where
    its slot is past ``limit`` (dropped). ``aligned``: every entry of ``deltas`` is a multiple of 4 (16 bytes), so
    rows whose width is a multiple of 4 words are stored 16 bytes at a time (the compiler cannot prove that of a
    distance it reads at run time).

    ``recv_tokens`` (``[W * max_tokens, D]`` words; rows one per token): each token's row crosses to each rank owning
    one of its copies' experts once, into row ``rank * max_tokens + token`` of that rank's ``recv_tokens`` (its
    scales into ``recv_token_scales``), whether or not the copies are kept, and the expert buffers get no rows —
    :func:`fan_out` fills them on the owner from its token rows; the rest (routing weight, origin, adapter id)
    as above. With top-k copies spread over fewer ranks than ``top_k``, fewer rows cross NVLink.

    ``slot_map`` (int32, ``[W * max_tokens * top_k]`` on every rank): entry ``origin_base + c`` of every rank's map
    gets copy ``c``'s slot on the rank owning its expert, -1 on the others and everywhere where the copy drops — what
    :func:`sum_on_owner` reads to find a token's copies among an owner's rows."""
    copies = experts.numel()
    if copies == 0:
        return
    width = rows.shape[1]
    scale_width = scales.shape[1] if scales is not None else 0
    per_copy = rows.shape[0] == copies and top_k > 1
    compact = offsets is not None
    once = recv_tokens is not None
    if compact and kept is None:
        raise ValueError("put_rows: compact buffers (offsets) write which copies they kept: give kept")
    if once and (per_copy or (scales is not None and recv_token_scales is None)):
        raise ValueError("put_rows: token rows (recv_tokens) take one row per token, and their scales' region "
                         "where the rows have scales")

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(D=width, S=scale_width, TOP_K=top_k, ROWS_PER_COPY=per_copy, HAS_ADAPTERS=adapters is not None,
                     COMPACT=compact, ALIGNED=aligned, BLOCK=min(next_power_of_2(width), _WORDS),
                     BLOCK_S=max(next_power_of_2(scale_width), 1), TOKENS_ONCE=once,
                     BLOCK_K=max(next_power_of_2(top_k), 2), HAS_MAP=slot_map is not None),
                dict(num_warps=4))

    _PUT_ROWS.launch(
        ("rows", width, scale_width, top_k, per_copy, adapters is not None, compact, aligned, once,
         slot_map is not None), (copies,),
        (rows, scales if scales is not None else rows, weights, experts, positions, table,
         offsets if offsets is not None else table, adapters if adapters is not None else experts,
         kept if kept is not None else positions, recv_rows,
         recv_scales if recv_scales is not None else recv_rows, recv_weights, recv_origins,
         recv_adapters if recv_adapters is not None else recv_origins,
         recv_tokens if recv_tokens is not None else recv_rows,
         recv_token_scales if recv_token_scales is not None else recv_rows,
         slot_map if slot_map is not None else recv_origins, deltas, rank, deltas.numel(), table.shape[-1], local,
         slots, capacity, limit if limit is not None else local * slots, origin_base, max_tokens), make)


def fan_out(tokens: torch.Tensor, token_scales: Optional[torch.Tensor], rows: torch.Tensor,
            scales: Optional[torch.Tensor], masked: torch.Tensor, origins: torch.Tensor, *, slots: int, top_k: int,
            starts: Optional[torch.Tensor] = None) -> None:
    """After :func:`put_rows` sent token rows (``tokens [W * max_tokens, D]`` words, ``token_scales [.., S]``): the
    first ``masked[l]`` rows of each local expert ``l`` of ``rows [L * slots, D]`` (compact rows: from row
    ``starts[l]`` of ``rows [max_rows, D]``) each get the row of the token their copy came from (``origins``, one per
    buffer row: ``source * max_tokens * top_k + copy``), and ``scales`` its scales — the bits :func:`put_rows` writes
    there when it sends one row per copy. Local: the token rows and the buffers are this rank's."""
    local = masked.numel()
    if local == 0:
        return
    if (scales is None) != (token_scales is None):
        raise ValueError("fan_out: scales and token_scales go together")
    width = rows.shape[1]
    scale_width = scales.shape[1] if scales is not None else 0
    programs = max(min(slots, max(16, 8192 // local)), 1)  # about 8192 programs over the experts' rows

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(D=width, S=scale_width, TOP_K=top_k, BLOCK=min(next_power_of_2(width), _WORDS),
                     BLOCK_S=max(next_power_of_2(scale_width), 1), PROGRAMS=programs, HAS_STARTS=starts is not None),
                dict(num_warps=4))

    _FAN_OUT.launch(("fan_out", width, scale_width, top_k, programs, starts is not None), (local, programs),
                    (tokens, token_scales if token_scales is not None else tokens, rows,
                     scales if scales is not None else rows, masked, starts if starts is not None else masked,
                     origins, slots), make)


def sum_on_owner(rows: torch.Tensor, weights: Optional[torch.Tensor], slot_map: torch.Tensor, masked: torch.Tensor,
                 origins: torch.Tensor, partials: torch.Tensor, deltas: torch.Tensor, *, slots: int, top_k: int,
                 max_tokens: int, rank: int, starts: Optional[torch.Tensor] = None, aligned: bool = False) -> None:
    """On each owner, after the experts: for each token with copies among the first ``masked[l]`` rows of each
    local expert ``l`` of ``rows [L * slots, H]`` (compact rows: from row ``starts[l]`` of ``rows [max_rows, H]``),
    the sum of those copies' rows in ``k`` order, in fp32 — each times its slot's routing weight where ``weights``
    (fp32, one per row) is given — written, rounded to ``partials``' dtype (fp32, bf16 or fp16), to row ``rank *
    max_tokens + token`` of the source rank's ``partials`` (``[W * max_tokens, H]`` on every rank, reached at
    ``deltas`` 4-byte words away). ``origins`` (one per row) name each row's source and copy; ``slot_map`` is what
    :func:`put_rows` wrote (a copy's slot here, or -1). ``aligned`` as :func:`put_rows`'s."""
    local = masked.numel()
    if local == 0:
        return
    hidden = rows.shape[1]
    per_word = 4 // partials.element_size()
    if partials.element_size() not in (2, 4) or hidden % per_word:
        raise ValueError(f"sum_on_owner: partials of {partials.dtype} rows of {hidden} do not fill whole words")
    programs = max(min(slots, max(16, 8192 // local)), 1)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(TOP_K=top_k, BLOCK_K=max(next_power_of_2(top_k), 2), BLOCK=min(next_power_of_2(hidden), 1024),
                     PROGRAMS=programs, HAS_STARTS=starts is not None, WEIGHTED=weights is not None,
                     ALIGNED=aligned, PER_WORD=per_word), dict(num_warps=4))

    _SUM_ON_OWNER.launch(("sum", top_k, hidden, programs, starts is not None, weights is not None, aligned, per_word),
                         (local, programs),
                         (rows, weights if weights is not None else partials, slot_map, masked,
                          starts if starts is not None else masked, origins, partials, deltas, slots, rows.stride(0),
                          max_tokens * top_k, max_tokens, rank, hidden), make)


def sum_partials(partials: torch.Tensor, experts: torch.Tensor, kept: torch.Tensor, out: torch.Tensor, *, local: int,
                 max_tokens: int, world: int, scaling: float) -> torch.Tensor:
    """On each source, after :func:`sum_on_owner` everywhere: ``out[t] = scaling * sum over the ranks r owning a
    kept copy of token t, in rank order, of partials[r * max_tokens + t]`` (in fp32; ``experts [T, top_k]`` global
    experts, ``kept [T, top_k]`` -1 where a copy dropped; ``out [T, H]`` in its dtype). Returns ``out``."""
    tokens, top_k = experts.shape
    hidden = out.shape[1]
    if tokens == 0 or hidden == 0:
        return out
    block = min(next_power_of_2(hidden), 1024)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(TOP_K=top_k, BLOCK_K=max(next_power_of_2(top_k), 2), BLOCK=block), dict(num_warps=4)

    _SUM_PARTIALS.launch(("partials", top_k, block), (tokens, -(-hidden // block)),
                         (partials, experts, kept, out, hidden, local, max_tokens, world, float(scaling)), make)
    return out


def place(table: torch.Tensor, *, rank: int, local: int, rows: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact buffers of ``rows`` rows per rank, from the exchanged ``[W, E]`` int32 ``table`` (row ``r``: rank
    ``r``'s copies per expert; expert ``o * local + l`` is local expert ``l`` of rank ``o``), in one program:

    * ``offsets [E]`` (int32): where this rank's copies of each expert start in the owner's buffer — the rows of the
      owner's earlier experts from every rank, then this expert's rows from the ranks before this one;
    * ``valid [local]`` (int32) and ``starts [local]`` (int64): this rank's experts' runs in its own buffer, one after
      another, cut at ``rows``;
    * ``dropped`` (0-d int64): this rank's copies whose slot falls past its owner's ``rows``;
    * ``most`` (0-d int64): the most rows any rank is sent (what an overflow check compares with ``rows``)."""
    world, experts = table.shape
    device = table.device
    offsets = torch.empty(experts, dtype=torch.int32, device=device)
    valid = torch.empty(local, dtype=torch.int32, device=device)
    starts = torch.empty(local, dtype=torch.int64, device=device)
    dropped = torch.empty((), dtype=torch.int64, device=device)
    most = torch.empty((), dtype=torch.int64, device=device)
    block_w, block_l = max(next_power_of_2(world), 2), max(next_power_of_2(local), 2)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_W=block_w, BLOCK_L=block_l), dict(num_warps=4)

    _PLACE.launch(("place", block_w, block_l), (1,), (table, offsets, valid, starts, dropped, most, rank, world,
                                                      local, rows), make)
    return offsets, valid, starts, dropped, most


def receive(table: torch.Tensor, weights: torch.Tensor, adapters: Optional[torch.Tensor], *, rank: int, local: int,
            slots: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """After the rows arrived: each local expert's valid rows ``masked_m [local]`` (int32, from this rank's ``[W, E]``
    ``table``, each source's count up to ``capacity``), the slots' routing weights ``[local, slots]`` with 0 past the
    valid rows and the adapter ids with -1 there (copies; ``weights``/``adapters`` are the received regions)."""
    world, experts = table.shape
    masked = torch.empty(local, dtype=torch.int32, device=table.device)
    slot_weights = torch.empty(local, slots, dtype=torch.float32, device=table.device)
    slot_adapters = torch.empty(local, slots, dtype=torch.int32, device=table.device) if adapters is not None else None
    if local == 0:
        return masked, slot_weights, slot_adapters
    block = min(next_power_of_2(slots), 1024)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(HAS_ADAPTERS=adapters is not None, BLOCK=block), dict(num_warps=4)

    _RECEIVE.launch(("receive", adapters is not None, block), (local,),
                    (table, weights, adapters if adapters is not None else table, masked, slot_weights,
                     slot_adapters if slot_adapters is not None else masked, world, experts, rank * local, slots,
                     capacity), make)
    return masked, slot_weights, slot_adapters


def return_rows(out: torch.Tensor, masked: torch.Tensor, origins: torch.Tensor, ret: torch.Tensor,
                deltas: torch.Tensor, *, slots: int, copies_per_rank: int, starts: Optional[torch.Tensor] = None,
                aligned: bool = False) -> None:
    """The first ``masked[l]`` rows of each expert ``l`` of ``out [L * slots, D]`` (words; compact rows: from row
    ``starts[l]`` of ``out [rows, D]``) to ``ret [copies, D]`` of their source rank, at their copy: ``origins``
    (int32, one per row of ``out``) holds ``source * copies_per_rank + copy``; ``aligned`` as :func:`put_rows`'s."""
    local = masked.numel()
    if local == 0:
        return
    width = out.shape[1]
    programs = max(min(slots, max(16, 8192 // local)), 1)  # about 8192 programs over the experts' rows

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(D=width, BLOCK=min(next_power_of_2(width), _WORDS), PROGRAMS=programs,
                     HAS_STARTS=starts is not None, ALIGNED=aligned), dict(num_warps=4))

    _RETURN_ROWS.launch(("return", width, programs, starts is not None, aligned), (local, programs),
                        (out, masked, starts if starts is not None else masked, origins, ret, deltas, slots,
                         copies_per_rank, out.stride(0)), make)


_ROUTE = LaunchSite(_route_kernel)
_PLACE = LaunchSite(_place_kernel)
_PUT_ROWS = LaunchSite(_put_rows_kernel)
_RETURN_ROWS = LaunchSite(_return_rows_kernel)
_RECEIVE = LaunchSite(_receive_kernel)
_FAN_OUT = LaunchSite(_fan_out_kernel)
_SUM_ON_OWNER = LaunchSite(_sum_on_owner_kernel)
_SUM_PARTIALS = LaunchSite(_sum_partials_kernel)
