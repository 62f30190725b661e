# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The dispatched rows in slot order: the token rows gathered once into expert order, one row per copy.

A block-aligned plan (:mod:`moeforge.kernels.align`) gives each copy ``c = t * top_k + j`` a slot, each expert's
copies one run of whole blocks. The inference path never moves a row: the first GEMM reads ``x[c // top_k]`` by
index and every GEMM writes one row per copy in copy order. A training step does better with the rows gathered into
the slots' order: every GEMM then reads and writes row ``row_of_slot[s]`` for slot ``s`` (its route's
``sorted_ids``), the weight gradients read their operands where they are — each expert's rows one contiguous run —
instead of gathering two copies into expert order in the backward, and the combine reads copy ``c``'s row at
``slot_of[c]``.

The rows are the slots without the alignment's padding: expert ``e``'s run starts at ``runs[1, e]``
(:func:`~moeforge.kernels.weight_grad.expert_runs`; row 3 is the same, the runs not rounded up) and holds its copies
in slot order, one row each, the runs one after another; a padding slot has no row (``row_of_slot`` is the number of
rows, which the GEMMs read as padding: they neither load nor store it). So the saved rows number the copies, as in
copy order. The weight gradient sums each run in whole steps: the Gluon kernel zeroes the rows past a run in its last
step itself, the Triton kernel takes the narrower operand gathered with each run rounded up to whole steps
(:func:`moeforge.kernels.weight_grad.expert_weight_grad`), so no row here is padding. The copies' routing weights come in the rows' order too, for a GEMM epilogue that multiplies by them.

The backward (:func:`gather_slots_backward`) sums each token's ``top_k`` rows in a fixed order with the combine
kernel (:func:`moeforge.kernels.combine.combine_copies` by index, fp32 sums): the same bits from run to run. A first
GEMM that reads exactly the gathered rows makes that sum in its own backward instead, before its weight gradient
(:class:`moeforge.payloads.GatheredRows`), and this backward then receives no rows' gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels import combine, weight_grad
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _gather_slots_kernel(x_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, runs_ptr, num_padded_ptr, xs_ptr,
                         slot_weights_ptr, slot_of_ptr, row_of_slot_ptr, num_slots, num_copies, num_experts,
                         top_k, width, stride_x, stride_xs, ALIGNED_M: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    # One program per BLOCK_R slots x BLOCK_W columns. A slot holding a copy has that copy's row in expert order
    # (weight_grad.run_row with runs not rounded up, as the weight gradient's gather places them) and takes its token's
    # row. The programs of the first column block write each copy's row, each slot's row (num_copies: none) and the
    # rows' weights.
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    used = slots < tl.load(num_padded_ptr)
    copies = tl.load(sorted_ids_ptr + slots, mask=used, other=num_copies)
    rows, real = weight_grad.run_row(slots, used, block_expert_ptr, runs_ptr, num_experts, ALIGNED_M, 1)
    sources = (copies // top_k).to(tl.int64)
    cols_ok = (cols < width)[None, :]
    values = tl.load(x_ptr + sources[:, None] * stride_x + cols[None, :], mask=real[:, None] & cols_ok, other=0.0)
    tl.store(xs_ptr + rows.to(tl.int64)[:, None] * stride_xs + cols[None, :], values, mask=real[:, None] & cols_ok)
    if tl.program_id(1) == 0:
        tl.store(row_of_slot_ptr + slots, tl.where(real, rows, num_copies), mask=slots < num_slots)
        tl.store(slot_of_ptr + copies, rows, mask=real)
        if HAS_WEIGHTS:
            tl.store(slot_weights_ptr + rows, tl.load(weights_ptr + copies, mask=real, other=0.0), mask=real)


_GATHER_SLOTS = LaunchSite(_gather_slots_kernel)


def gather_slots(x: torch.Tensor, weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xs [C, H], row_weights [C] fp32, slot_of [C] int32, row_of_slot [S] int32, runs [4, E + 1] int32)`` for
    token rows ``x [T, H]`` and the plan (aligned with ``block_m`` over ``num_experts``) ``sorted_ids [S]`` /
    ``num_padded`` of their ``C = T * top_k`` copies: expert ``e``'s rows from ``runs[1, e]``, its copies in slot
    order (``xs[slot_of[c]] = x[c // top_k]``); ``row_weights[slot_of[c]] = weights[c]`` (empty without
    ``weights``, the copies' fp32 routing weights in copy order); ``row_of_slot[s]``, slot ``s``'s row (``C`` for a
    padding slot), the route of the GEMMs on ``xs``; ``runs``: :func:`~moeforge.kernels.weight_grad.expert_runs`
    with one-row steps (row 1 each expert's first row, row 2 its copies, row 3 = row 1)."""
    if x.dim() != 2:
        raise ValueError(f"gather_slots takes token rows [T, H], got shape {tuple(x.shape)}")
    tokens, width = x.shape
    num_copies = tokens * top_k
    if weights is not None and (weights.dtype != torch.float32 or weights.numel() != num_copies):
        raise ValueError(f"the routing weights must be fp32, one per copy ({num_copies}), got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    slots = sorted_ids.numel()
    xs = x.new_empty(num_copies, width)
    row_weights = x.new_empty(num_copies if weights is not None else 0, dtype=torch.float32)
    slot_of = x.new_empty(num_copies, dtype=torch.int32)
    row_of_slot = x.new_empty(slots, dtype=torch.int32)
    if slots == 0 or num_copies == 0:
        return (xs, row_weights, slot_of, row_of_slot.fill_(num_copies),
                x.new_zeros(4, num_experts + 1, dtype=torch.int32))
    runs = weight_grad.expert_runs(block_expert, sorted_ids, num_padded, block_m, num_experts, num_copies, 1)
    block_w = min(next_power_of_2(max(width, 1)), 256)
    block_r = max(1, min(32, 4096 // block_w))
    grid = (cdiv(slots, block_r), max(1, cdiv(width, block_w)))
    has_weights = weights is not None

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(ALIGNED_M=block_m, HAS_WEIGHTS=has_weights, BLOCK_R=block_r, BLOCK_W=block_w), \
            dict(num_warps=4)

    _GATHER_SLOTS.launch((block_m, has_weights, block_r, block_w, x.device), grid, (
        x, weights if weights is not None else row_weights, sorted_ids, block_expert, runs, num_padded, xs,
        row_weights, slot_of, row_of_slot, slots, num_copies, num_experts, top_k, width, x.stride(0),
        xs.stride(0)), make)
    return xs, row_weights, slot_of, row_of_slot, runs


def gather_slots_backward(d_xs: torch.Tensor, d_slot_weights: Optional[torch.Tensor], slot_of: torch.Tensor,
                          top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of :func:`gather_slots`: ``d_x[t] = sum_j d_xs[slot_of[t * top_k + j]]`` in ``dtype`` (summed in
    fp32, ``j = 0 .. top_k - 1`` in order), and the routing weights' ``d_slot_weights[slot_of[c]]`` in copy order
    (``None`` without ``d_slot_weights``)."""
    tokens = slot_of.numel() // top_k if top_k else 0
    d_x = combine.COMBINE(d_xs, None, top_k, 1.0, dtype, slot_of.view(tokens, top_k))
    d_weights = d_slot_weights.index_select(0, slot_of) if d_slot_weights is not None else None
    return d_x, d_weights
