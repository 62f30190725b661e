# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The dispatched rows in slot order: the token rows gathered once into the alignment's slots.

A block-aligned plan (:mod:`moeforge.kernels.align`) gives each copy ``c = t * top_k + j`` a slot, each expert's
copies one run of whole blocks. The inference path never moves a row: the first GEMM reads ``x[c // top_k]`` by
index and every GEMM writes one row per copy in copy order. A training step does better with the rows in slot order
(``xs[s] = x[sorted_ids[s] // top_k]``): every GEMM then reads and writes row ``s`` for slot ``s`` (its route's
``sorted_ids`` is each slot's own position), the weight gradients read their operands where they are — each expert's
rows one contiguous run — instead of gathering two copies into expert order in the backward, and the combine reads
copy ``c``'s row at its slot (``slot_of[c]``).

:func:`gather_slots` writes ``xs`` with a zero row in every padding slot of the used blocks, so that each padding
row of every GEMM's product, and of every gradient the backward computes from them, is the product of a zero row
(the bias where there is one; its gradient zero): the weight gradients may then sum an expert's whole blocks. Slots
past the used blocks are not written and nothing reads them. The copies' routing weights come in slot order too (zero
in the padding), for a GEMM epilogue that multiplies by them, ``slot_of [C]``: each copy's slot, and where each
expert's rows lie (:func:`moeforge.kernels.weight_grad.expert_runs` with ``slot_first``: its first slot and its
copies), which the weight gradients sum to the copies rounded up to their step and no further.

The backward (:func:`gather_slots_backward`) sums each token's ``top_k`` slot rows in a fixed order with the combine
kernel (:func:`moeforge.kernels.combine.combine_copies` by index, fp32 sums): the same bits from run to run.
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
def _gather_slots_kernel(x_ptr, weights_ptr, sorted_ids_ptr, num_padded_ptr, xs_ptr, slot_weights_ptr, slot_of_ptr,
                         positions_ptr, num_slots, num_copies, top_k, width, stride_x, stride_xs,
                         HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    # One program per BLOCK_R slots x BLOCK_W columns. A used slot holding a copy takes its token's row; a used
    # padding slot a zero row; the programs of the first column block write each copy's slot, the slots' weights
    # and each slot's own position.
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    used = slots < tl.load(num_padded_ptr)
    copies = tl.load(sorted_ids_ptr + slots, mask=used, other=num_copies)
    real = copies < num_copies
    rows = (copies // top_k).to(tl.int64)
    cols_ok = (cols < width)[None, :]
    values = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=real[:, None] & cols_ok, other=0.0)
    tl.store(xs_ptr + slots.to(tl.int64)[:, None] * stride_xs + cols[None, :], values, mask=used[:, None] & cols_ok)
    if tl.program_id(1) == 0:
        tl.store(positions_ptr + slots, slots, mask=slots < num_slots)
        tl.store(slot_of_ptr + copies, slots, mask=real)
        if HAS_WEIGHTS:
            tl.store(slot_weights_ptr + slots, tl.load(weights_ptr + copies, mask=real, other=0.0), mask=used)


_GATHER_SLOTS = LaunchSite(_gather_slots_kernel)


def gather_slots(x: torch.Tensor, weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xs [S, H], slot_weights [S] fp32, slot_of [T * top_k] int32, positions [S] int32, runs [4, E + 1] int32)``
    for token rows ``x [T, H]`` and the plan (aligned with ``block_m`` over ``num_experts``)
    ``sorted_ids [S]`` / ``num_padded`` of their ``T * top_k`` copies: ``xs[s] = x[sorted_ids[s] // top_k]`` for a
    used slot holding a copy, a zero row for a used padding slot, unwritten past the used slots;
    ``slot_weights[s] = weights[sorted_ids[s]]`` likewise (zero in the padding; empty without ``weights``, the
    copies' fp32 routing weights in copy order); ``slot_of[c]``, the slot of copy ``c``; ``positions[s] = s``, the
    route of the GEMMs on ``xs``; ``runs``: each expert's first row in slot order (row 1) and its copies (row 2), the
    other rows as :func:`~moeforge.kernels.weight_grad.expert_runs` writes them."""
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
    xs = x.new_empty(slots, width)
    slot_weights = x.new_empty(slots if weights is not None else 0, dtype=torch.float32)
    slot_of = x.new_empty(num_copies, dtype=torch.int32)
    positions = x.new_empty(slots, dtype=torch.int32)
    if slots == 0:
        return xs, slot_weights, slot_of, positions, x.new_zeros(4, num_experts + 1, dtype=torch.int32)
    runs = weight_grad.expert_runs(block_expert, sorted_ids, num_padded, block_m, num_experts, num_copies, block_m,
                                   slot_first=True)
    block_w = min(next_power_of_2(max(width, 1)), 256)
    block_r = max(1, min(32, 4096 // block_w))
    grid = (cdiv(slots, block_r), max(1, cdiv(width, block_w)))
    has_weights = weights is not None

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(HAS_WEIGHTS=has_weights, BLOCK_R=block_r, BLOCK_W=block_w), dict(num_warps=4)

    _GATHER_SLOTS.launch((has_weights, block_r, block_w, x.device), grid, (
        x, weights if weights is not None else slot_weights, sorted_ids, num_padded, xs, slot_weights, slot_of,
        positions, slots, num_copies, top_k, width, x.stride(0), xs.stride(0)), make)
    return xs, slot_weights, slot_of, positions, runs


def gather_slots_backward(d_xs: torch.Tensor, d_slot_weights: Optional[torch.Tensor], slot_of: torch.Tensor,
                          top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of :func:`gather_slots`: ``d_x[t] = sum_j d_xs[slot_of[t * top_k + j]]`` in ``dtype`` (summed in
    fp32, ``j = 0 .. top_k - 1`` in order), and the routing weights' ``d_slot_weights[slot_of[c]]`` in copy order
    (``None`` without ``d_slot_weights``)."""
    tokens = slot_of.numel() // top_k if top_k else 0
    d_x = combine.COMBINE(d_xs, None, top_k, 1.0, dtype, slot_of.view(tokens, top_k))
    d_weights = d_slot_weights.index_select(0, slot_of) if d_slot_weights is not None else None
    return d_x, d_weights
