# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The weight gradient of a grouped GEMM whose ``dW [E, N, K]`` is narrow on one side (an adapter's ``A [E, r, K]`` or
``B [E, N, r]``): ``dW[e] = sum_c d_rows[c]^T rows[c // rows_per_x]`` over expert ``e``'s copies, its rows read by
their copies' indices straight from the alignment, in one launch.

Such a gradient does few MMAs for the rows it reads — ``r`` columns against the wide side's — so its cost is reading
the wide operand once. One program per (expert, tile of the wide side) holds the whole narrow side in its
accumulator (``r`` padded to a power of two of at least 16) and walks the expert's blocks of the alignment in steps
of ``BLOCK_M`` slots, loading each step's rows by index (padding slots, ``>= num_copies``, load zeros): no gather
into expert order, no tile of the wide kernels' 64-wide minimum on the narrow side, and no launch to find where
each expert's rows lie — the program finds its expert's blocks by a binary search over the block table, which the
alignment writes in ascending expert order (:mod:`moeforge.kernels.align`).

Deterministic: each output tile is one program summing its expert's slots in ascending order, in steps that start
at its first block (no atomics, no split reduction). An expert without blocks gets a zero gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, multiprocessors, next_power_of_2

NARROW = 64  # the widest narrow side this kernel takes (its accumulator holds all of it)


@attrs.frozen
class NarrowTiles:
    """The launch: ``block_wide`` columns of the wide side a program, ``block_m`` slots a step (dividing the
    alignment's block), ``num_warps``, ``num_stages``."""

    block_wide: int = 128
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2


FEW_PROGRAMS = 2  # programs per multiprocessor below which each step takes 128 slots (default_tiles)


@triton.jit
def _expert_blocks(block_expert_ptr, num_padded_ptr, expert, ALIGNED: tl.constexpr, LOG_BLOCKS: tl.constexpr):
    """Expert ``expert``'s blocks of the alignment, ``[first, stop)``: how many used blocks belong to the experts
    before it, and before the next one — a binary search over the block table, which ascends by expert over the used
    blocks (``LOG_BLOCKS``: at least the bit length of the table's size)."""
    used_blocks = tl.load(num_padded_ptr) // ALIGNED
    targets = expert + tl.arange(0, 2)
    before = tl.zeros((2,), dtype=tl.int32)
    for level in tl.static_range(0, LOG_BLOCKS + 1):
        candidate = before + (1 << (LOG_BLOCKS - level))
        owner = tl.load(block_expert_ptr + candidate - 1, mask=candidate <= used_blocks, other=2147483647)
        before = tl.where(owner < targets, candidate, before)
    first = tl.sum(tl.where(targets == expert, before, 0), axis=0)
    stop = tl.sum(tl.where(targets == expert, 0, before), axis=0)
    return first, stop


@triton.jit
def _narrow_weight_grad_kernel(dy_ptr, x_ptr, dw_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_copies,
                               rows_per_x, N, K, stride_dy, stride_x, stride_dwe, stride_dwn, stride_dwk, scale,
                               ALIGNED: tl.constexpr, LOG_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    expert = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_n = (tl.program_id(1) // k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tl.program_id(1) % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    first, stop = _expert_blocks(block_expert_ptr, num_padded_ptr, expert, ALIGNED, LOG_BLOCKS)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(first * ALIGNED, stop * ALIGNED, BLOCK_M):
        copies = tl.load(sorted_ids_ptr + start + tl.arange(0, BLOCK_M))
        row_ok = copies < num_copies
        dy = tl.load(dy_ptr + copies.to(tl.int64)[:, None] * stride_dy + offs_n[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        x = tl.load(x_ptr + (copies // rows_per_x).to(tl.int64)[:, None] * stride_x + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    tl.store(dw_ptr + expert.to(tl.int64) * stride_dwe + offs_n[:, None] * stride_dwn + offs_k[None, :] * stride_dwk,
             (acc * scale).to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def narrow_problem(d_rows: torch.Tensor, rows: torch.Tensor, with_bias: bool, slot_copies: int) -> Optional[str]:
    """Why this kernel does not take a weight gradient (``None`` where it does): it sums no bias, reads the rows by
    their copies' indices from the alignment (not in slot order), and holds the narrow side, at most :data:`NARROW`
    columns, in its accumulator."""
    if with_bias:
        return "the narrow weight gradient sums no bias"
    if slot_copies:
        return "the narrow weight gradient reads rows by index from the alignment, not in slot order"
    if min(d_rows.shape[1], rows.shape[1]) > NARROW:
        return (f"the narrow weight gradient holds a side of at most {NARROW} columns, got {d_rows.shape[1]} x "
                f"{rows.shape[1]}")
    if not d_rows.dtype.is_floating_point or rows.dtype != d_rows.dtype:
        return f"the narrow weight gradient takes float operands of one dtype, got {d_rows.dtype} and {rows.dtype}"
    if d_rows.stride(1) != 1 or rows.stride(1) != 1:
        return "the narrow weight gradient reads rows with contiguous columns"
    return None


def default_tiles(device: torch.device, aligned_block_m: int, programs: int) -> NarrowTiles:
    """The launch of ``programs`` programs on a GPU: 128 columns of the wide side, 4 warps, 2 stages, steps of 64
    slots — of 128 where the programs are fewer than :data:`FEW_PROGRAMS` a multiprocessor (each then keeps more rows
    in flight; Mixtral's ``A`` of the gate/up and ``B`` of the down: 8 experts x 32 tiles); the step at most the
    alignment's block (``docs/notes/kernels-log.md``, "The narrow weight gradient", has the sweep). Small tiles under
    the CPU interpreter."""
    if device.type != "cuda":
        return NarrowTiles(32, min(16, aligned_block_m), 4, 2)
    step = 128 if programs < FEW_PROGRAMS * multiprocessors(device) else 64
    return NarrowTiles(block_m=min(step, aligned_block_m))


def narrow_weight_grad(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_x: int, sorted_ids: torch.Tensor,
                       block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, aligned_block_m: int,
                       dtype: torch.dtype, tiles: Optional[NarrowTiles] = None, scale: float = 1.0) -> torch.Tensor:
    """``dW [E, N, K]`` in ``dtype`` (summed in fp32, times ``scale`` before the cast: an adapter's ``alpha / r``): for
    each expert the sum over its copies ``c`` of ``d_rows[c]^T rows[c // rows_per_x]`` (``d_rows [copies, N]``,
    ``rows [R, K]``, :func:`narrow_problem` says which it takes), each expert's copies in slot order of the alignment
    (``sorted_ids``, ``block_expert``, ``num_padded`` from :func:`moeforge.kernels.align.align_block_size` with
    ``aligned_block_m``)."""
    num_copies, n = d_rows.shape
    k = rows.shape[1]
    narrow_n = n <= k
    wide_tiles = cdiv(k if narrow_n else n, (tiles or NarrowTiles()).block_wide)
    tiles = tiles or default_tiles(rows.device, aligned_block_m, num_experts * wide_tiles)
    if aligned_block_m % tiles.block_m or tiles.block_m < 16:
        raise ValueError(f"the narrow weight gradient's step of {tiles.block_m} slots must divide the alignment's "
                         f"block of {aligned_block_m} and be at least 16 (the MMA's reduction)")
    dw = torch.empty(num_experts, n, k, dtype=dtype, device=rows.device)
    if dw.numel() == 0:
        return dw
    block_n = max(16, next_power_of_2(n)) if narrow_n else tiles.block_wide
    block_k = tiles.block_wide if narrow_n else max(16, next_power_of_2(k))
    log_blocks = max(1, (block_expert.numel()).bit_length())
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(ALIGNED=aligned_block_m, LOG_BLOCKS=log_blocks, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, PRECISION=precision),
                dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))

    _NARROW.launch((aligned_block_m, log_blocks, tiles, block_n, block_k, precision, rows.device),
                   (num_experts, cdiv(n, block_n) * cdiv(k, block_k)),
                   (d_rows, rows, dw, sorted_ids, block_expert, num_padded, num_copies, rows_per_x, n, k,
                    d_rows.stride(0), rows.stride(0), dw.stride(0), dw.stride(1), dw.stride(2), float(scale)), make)
    return dw


_NARROW = LaunchSite(_narrow_weight_grad_kernel)
