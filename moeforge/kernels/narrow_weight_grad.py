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
from moeforge.kernels.kernel_op import KernelOp
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


def narrow_problem(d_rows: torch.Tensor, rows: torch.Tensor, with_bias: bool, slot_copies: int,
                   kernel: str = "the narrow weight gradient") -> Optional[str]:
    """Why this kernel does not take a weight gradient (``None`` where it does): it sums no bias, reads the rows by
    their copies' indices from the alignment (not in slot order), and holds the narrow side, at most :data:`NARROW`
    columns, in its accumulator. ``kernel``: the name the reasons give (:func:`update_grads_problem` shares them)."""
    if with_bias:
        return f"{kernel} sums no bias"
    if slot_copies:
        return f"{kernel} reads rows by index from the alignment, not in slot order"
    if min(d_rows.shape[1], rows.shape[1]) > NARROW:
        return f"{kernel} holds a side of at most {NARROW} columns, got {d_rows.shape[1]} x {rows.shape[1]}"
    if not d_rows.dtype.is_floating_point or rows.dtype != d_rows.dtype:
        return f"{kernel} takes float operands of one dtype, got {d_rows.dtype} and {rows.dtype}"
    if d_rows.stride(1) != 1 or rows.stride(1) != 1:
        return f"{kernel} reads rows with contiguous columns"
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


@triton.jit
def _update_grads_kernel(dy_ptr, u_ptr, b_ptr, db_ptr, partial_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                         num_copies, N, R, stride_dy, stride_u, stride_be, stride_bn, stride_dbe, stride_dbn,
                         stride_pj, stride_pc, scale, ALIGNED: tl.constexpr, LOG_BLOCKS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                         PRECISION: tl.constexpr):
    # One program per (expert, BLOCK_N columns of dy): dB's tile (dy^T u over the expert's slots) and each copy's
    # partial d_low over these columns (dy . B's tile), from one read of dy's tile.
    expert = tl.program_id(0)
    tile = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_ok = offs_n < N
    r_ok = offs_r < R
    first, stop = _expert_blocks(block_expert_ptr, num_padded_ptr, expert, ALIGNED, LOG_BLOCKS)
    b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for start in range(first * ALIGNED, stop * ALIGNED, BLOCK_M):
        copies = tl.load(sorted_ids_ptr + start + tl.arange(0, BLOCK_M))
        row_ok = copies < num_copies
        rows = copies.to(tl.int64)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + offs_n[None, :], mask=row_ok[:, None] & n_ok[None, :],
                     other=0.0)
        u = tl.load(u_ptr + rows[:, None] * stride_u + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(dy), u, acc, input_precision=PRECISION)
        part = tl.dot(dy, b, input_precision=PRECISION)
        tl.store(partial_ptr + tile.to(tl.int64) * stride_pj + rows[:, None] * stride_pc + offs_r[None, :], part,
                 mask=row_ok[:, None] & r_ok[None, :])
    tl.store(db_ptr + expert.to(tl.int64) * stride_dbe + offs_n[:, None] * stride_dbn + offs_r[None, :],
             (acc * scale).to(db_ptr.dtype.element_ty), mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _partials_sum_kernel(partial_ptr, out_ptr, num_copies, R, tiles, stride_pj, stride_pc, stride_oc, scale,
                         BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    # d_low[c] = scale * the sum of its column tiles' partials, tile 0 first: one fixed order.
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_c < num_copies)[:, None] & (offs_r < R)[None, :]
    cells = offs_c.to(tl.int64)[:, None] * stride_pc + offs_r[None, :]
    total = tl.zeros((BLOCK_C, BLOCK_R), dtype=tl.float32)
    for tile in range(0, tiles):
        total += tl.load(partial_ptr + tile * stride_pj + cells, mask=mask, other=0.0)
    tl.store(out_ptr + offs_c.to(tl.int64)[:, None] * stride_oc + offs_r[None, :],
             (total * scale).to(out_ptr.dtype.element_ty), mask=mask)


def update_grads_problem(d_pre: torch.Tensor, u: torch.Tensor, b: torch.Tensor, slot_copies: int) -> Optional[str]:
    """Why :func:`update_grads` does not take a low-rank update's two gradients (``None`` where it does): what
    :func:`narrow_problem` asks of ``d_pre`` and ``u``, and ``B [E, N, r]`` of their widths (rank at most
    :data:`NARROW`), dtype and contiguous rows."""
    kernel = "the update's gradients in one pass"
    found = narrow_problem(d_pre, u, False, slot_copies, kernel)
    if found is not None:
        return found
    if b.dim() != 3 or u.shape[1] != b.shape[2] or d_pre.shape[1] != b.shape[1] or b.shape[2] > NARROW:
        return (f"{kernel} take u [C, r], B [E, N, r] of rank at most {NARROW} and d_pre [C, N]; got "
                f"{tuple(u.shape)}, {tuple(b.shape)}, {tuple(d_pre.shape)}")
    if b.dtype != d_pre.dtype:
        return f"{kernel} takes float operands of one dtype, got {d_pre.dtype} and B {b.dtype}"
    if b.stride(2) != 1:
        return f"{kernel} reads rows with contiguous columns"
    return None


def update_grads(d_pre: torch.Tensor, u: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, aligned_block_m: int, scale: float,
                 tiles: Optional[NarrowTiles] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A low-rank update's two gradients (``scale * u[c] @ B[e]^T`` added to each copy's product, ``d_pre`` that
    product's gradient) from one read of ``d_pre``: ``(d_low [C, r] = scale * d_pre[c] @ B[e]`` in ``u``'s dtype,
    ``dB [E, N, r] = scale * sum_c d_pre[c]^T u[c]`` in ``B``'s dtype). Each program (expert, ``block_wide`` columns)
    gives ``dB``'s tile and each copy's partial ``d_low`` over its columns (fp32, ``[N tiles, C, r]``); a second launch
    sums each copy's partials in column order. Deterministic: every sum in a fixed order, no atomics."""
    num_copies, n = d_pre.shape
    experts, rank = b.shape[0], b.shape[2]
    found = update_grads_problem(d_pre, u, b, 0)
    if found is not None:
        raise ValueError(found)
    d_low = torch.empty(num_copies, rank, dtype=u.dtype, device=u.device)
    db = torch.empty(experts, n, rank, dtype=b.dtype, device=b.device)
    if db.numel() == 0 or d_low.numel() == 0:
        return d_low.zero_(), db.zero_()
    tiles = tiles or default_tiles(u.device, aligned_block_m, experts * cdiv(n, NarrowTiles().block_wide))
    if aligned_block_m % tiles.block_m or tiles.block_m < 16:
        raise ValueError(f"the update gradients' step of {tiles.block_m} slots must divide the alignment's block of "
                         f"{aligned_block_m} and be at least 16 (the MMA's reduction)")
    n_tiles = cdiv(n, tiles.block_wide)
    partials = torch.empty(n_tiles, num_copies, rank, dtype=torch.float32, device=u.device)
    block_r = max(16, next_power_of_2(rank))
    log_blocks = max(1, (block_expert.numel()).bit_length())
    precision = "ieee" if u.dtype == torch.float32 else "tf32"

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(ALIGNED=aligned_block_m, LOG_BLOCKS=log_blocks, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_wide,
                     BLOCK_R=block_r, PRECISION=precision),
                dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))

    _UPDATE_GRADS.launch((aligned_block_m, log_blocks, tiles, block_r, precision, u.device), (experts, n_tiles),
                         (d_pre, u, b, db, partials, sorted_ids, block_expert, num_padded, num_copies, n, rank,
                          d_pre.stride(0), u.stride(0), b.stride(0), b.stride(1), db.stride(0), db.stride(1),
                          partials.stride(0), partials.stride(1), float(scale)), make)
    block_c = 64 if u.device.type == "cuda" else 16

    def make_sum() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_C=block_c, BLOCK_R=block_r), dict(num_warps=4)

    _PARTIALS_SUM.launch((block_c, block_r, u.device), (cdiv(num_copies, block_c),),
                         (partials, d_low, num_copies, rank, n_tiles, partials.stride(0), partials.stride(1),
                          d_low.stride(0), float(scale)), make_sum)
    return d_low, db


def update_grads_for_op(d_pre: torch.Tensor, u: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
                        block_expert: torch.Tensor, num_padded: torch.Tensor, aligned_block_m: int,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moeforge::update_grads`` op's implementation: :func:`update_grads` with its default tiles."""
    return update_grads(d_pre, u, b, sorted_ids, block_expert, num_padded, aligned_block_m, scale)


_UPDATE_GRADS = LaunchSite(_update_grads_kernel)
_PARTIALS_SUM = LaunchSite(_partials_sum_kernel)

# What the grouped GEMM's backward calls (moeforge.kernels.backward): the op where it is needed, else the function.
UPDATE_GRADS = KernelOp("moeforge::update_grads", update_grads_for_op)
