# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Rows written straight into other GPUs' memory: the kernels of the symmetric-memory expert-parallel exchange.

Every rank of the group holds the same regions at the same offsets of a symmetric allocation (each rank's memory,
mapped into every other rank's address space over NVLink, :mod:`moeforge.distributed.symmetric`); a rank reaches
peer ``r``'s copy of a region at its own copy's address plus ``deltas[r]`` elements. Every region these kernels touch
holds 4-byte elements (rows and scales are copied as 32-bit words; routing weights fp32; counts, origins and adapter
ids int32), so one ``deltas`` array (int64, in words) serves them all.

* :func:`put_counts`: this rank's copies per global expert into row ``rank`` of every peer's ``[W, E]`` table;
* :func:`put_rows`: each copy's row (and scales, routing weight, origin and adapter id) into the expert buffer of the
  rank owning its expert, at the slot the exchanged counts give it — source ranks in rank order, each rank's copies
  of one expert in copy order (the order of :class:`~moeforge.distributed.LowLatencyDispatch`);
* :func:`return_rows`: each valid expert-buffer row back to the slot of the copy it came from, on its source rank.

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
def _put_counts_kernel(counts_ptr, table_ptr, deltas_ptr, rank, E, BLOCK_E: tl.constexpr):
    peer = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    delta = tl.load(deltas_ptr + peer)
    tl.store(table_ptr + delta + rank * E + offs, tl.load(counts_ptr + offs, mask=ok), mask=ok)


@triton.jit
def _put_rows_kernel(rows_ptr, scales_ptr, weights_ptr, experts_ptr, positions_ptr, starts_ptr, adapters_ptr,
                     recv_rows_ptr, recv_scales_ptr, recv_weights_ptr, recv_origins_ptr, recv_adapters_ptr, deltas_ptr,
                     local, slots, capacity, origin_base,
                     D: tl.constexpr, S: tl.constexpr, TOP_K: tl.constexpr, ROWS_PER_COPY: tl.constexpr,
                     HAS_ADAPTERS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    copy = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + copy)
    if position < capacity:
        expert = tl.load(experts_ptr + copy).to(tl.int64)
        owner = expert // local
        slot = (expert % local) * slots + tl.load(starts_ptr + expert) + position
        delta = tl.load(deltas_ptr + owner)
        token = copy // TOP_K
        source = copy if ROWS_PER_COPY else token
        for first in range(0, D, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < D
            words = tl.load(rows_ptr + source * D + offs, mask=ok)
            tl.store(recv_rows_ptr + delta + slot * D + offs, words, mask=ok)
        if S > 0:
            offs_s = tl.arange(0, BLOCK_S)
            ok_s = offs_s < S
            tl.store(recv_scales_ptr + delta + slot * S + offs_s, tl.load(scales_ptr + source * S + offs_s, mask=ok_s),
                     mask=ok_s)
        tl.store(recv_weights_ptr + delta + slot, tl.load(weights_ptr + copy))
        tl.store(recv_origins_ptr + delta + slot, (origin_base + copy).to(tl.int32))
        if HAS_ADAPTERS:
            tl.store(recv_adapters_ptr + delta + slot, tl.load(adapters_ptr + token))


@triton.jit
def _return_rows_kernel(out_ptr, masked_ptr, origins_ptr, ret_ptr, deltas_ptr, slots, copies_per_rank, stride_out,
                        D: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    valid = tl.load(masked_ptr + expert)
    for j in range(tl.program_id(1), valid, PROGRAMS):
        row = expert * slots + j
        origin = tl.load(origins_ptr + row).to(tl.int64)
        source = origin // copies_per_rank
        copy = origin % copies_per_rank
        delta = tl.load(deltas_ptr + source)
        for first in range(0, D, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < D
            tl.store(ret_ptr + delta + copy * D + offs, tl.load(out_ptr + row * stride_out + offs, mask=ok), mask=ok)


def words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous rows) viewed as ``[rows, width]`` 32-bit words (its last dimension's bytes must be a
    multiple of 4)."""
    return tensor.reshape(-1, tensor.shape[-1]).view(torch.int32)


def put_counts(counts: torch.Tensor, table: torch.Tensor, deltas: torch.Tensor, rank: int) -> None:
    """``counts [E]`` (int32) into row ``rank`` of the ``[W, E]`` int32 ``table`` of every rank (``deltas [W]``)."""
    experts = counts.numel()

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_E=next_power_of_2(experts)), dict(num_warps=4)

    _PUT_COUNTS.launch(("counts", experts), (deltas.numel(),), (counts, table, deltas, rank, experts), make)


def put_rows(rows: torch.Tensor, scales: Optional[torch.Tensor], weights: torch.Tensor, experts: torch.Tensor,
             positions: torch.Tensor, starts: torch.Tensor, adapters: Optional[torch.Tensor],
             recv_rows: torch.Tensor, recv_scales: Optional[torch.Tensor], recv_weights: torch.Tensor,
             recv_origins: torch.Tensor, recv_adapters: Optional[torch.Tensor], deltas: torch.Tensor, *,
             top_k: int, local: int, slots: int, capacity: int, origin_base: int) -> None:
    """Each copy ``c`` (``experts [T * top_k]`` int32 global experts, ``positions`` int32 among this rank's copies of
    its expert, sent where below ``capacity``) into the buffers of the rank owning its expert: row ``rows[c]``
    (``[T * top_k, D]`` words, one row per copy) or ``rows[c // top_k]`` (``[T, D]``, one per token) with its
    ``scales`` (words), ``weights[c]`` (fp32), origin ``origin_base + c`` and the token's adapter id, at slot
    ``(expert % local) * slots + starts[expert] + position`` of ``recv_* [local * slots, ...]``."""
    copies = experts.numel()
    if copies == 0:
        return
    width = rows.shape[1]
    scale_width = scales.shape[1] if scales is not None else 0
    per_copy = rows.shape[0] == copies and top_k > 1

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(D=width, S=scale_width, TOP_K=top_k, ROWS_PER_COPY=per_copy, HAS_ADAPTERS=adapters is not None,
                     BLOCK=min(next_power_of_2(width), _WORDS), BLOCK_S=max(next_power_of_2(scale_width), 1)),
                dict(num_warps=4))

    _PUT_ROWS.launch(
        ("rows", width, scale_width, top_k, per_copy, adapters is not None), (copies,),
        (rows, scales if scales is not None else rows, weights, experts, positions, starts,
         adapters if adapters is not None else experts, recv_rows, recv_scales if recv_scales is not None else recv_rows,
         recv_weights, recv_origins, recv_adapters if recv_adapters is not None else recv_origins, deltas,
         local, slots, capacity, origin_base), make)


def return_rows(out: torch.Tensor, masked: torch.Tensor, origins: torch.Tensor, ret: torch.Tensor,
                deltas: torch.Tensor, *, slots: int, copies_per_rank: int) -> None:
    """The first ``masked[l]`` rows of each expert ``l`` of ``out [L * slots, D]`` (words) to ``ret [copies, D]`` of
    their source rank, at their copy: ``origins`` (int32, ``[L * slots]``) holds ``source * copies_per_rank + copy``."""
    local = masked.numel()
    if local == 0:
        return
    width = out.shape[1]
    programs = min(slots, 16)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(D=width, BLOCK=min(next_power_of_2(width), _WORDS), PROGRAMS=programs), dict(num_warps=4)

    _RETURN_ROWS.launch(("return", width, programs), (local, programs),
                        (out, masked, origins, ret, deltas, slots, copies_per_rank, out.stride(0)), make)


_PUT_COUNTS = LaunchSite(_put_counts_kernel)
_PUT_ROWS = LaunchSite(_put_rows_kernel)
_RETURN_ROWS = LaunchSite(_return_rows_kernel)
