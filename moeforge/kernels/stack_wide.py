# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Each copy's ``x Aᵀ`` by every adapter of a stack at once, on the base GEMM's alignment: the serving stack's first
low-rank product where the copies are many.

A stack of ``S`` adapters of rank ``r`` over ``E`` experts (``A [S, E | 1, r, K]``) gives copy ``c`` of expert ``e``
the row ``u[c] [S · r]``: in the ``r`` columns of its own adapter ``s = ids[c]``, ``x[c // rows_per_a] @ A[s, e]ᵀ``
weighed by the id (the adapters' ``scale``, 0 for no adapter, ``-1``, NaN for an id outside ``[-1, S)``, whose row
then takes adapter 0's columns: :func:`moeforge.kernels.stack_pairs.copy_adapters`); zero in every other adapter's.
The base GEMM then adds ``u[c] @ B_wide[e]ᵀ`` (``B [S, E, N, r]`` read as ``[E, N, S · r]``) as more K-steps of its
own, several adapters a step, on every tile, without looking at the ids
(:func:`moeforge.kernels.moe_gemm.moe_gemm` with ``update_rows [C, S · r]``).

Computing every adapter's product for each copy costs ``S`` times the flops of its own adapter's, but on the tensor
cores, on the alignment the base GEMM already has, as one launch: where the copies are many, a tile's rows choose
most of the stack anyway, and the alternatives (the copies aligned again by (adapter, expert) pair, or a K-step per
chosen adapter inside the base GEMM) cost more than the flops (docs/notes/kernels-log.md, "Every adapter's columns
at once"). Each program takes one block of the alignment's rows (one expert's) and a range of the ``S · r``
columns, and runs the whole K-loop: the same inputs give the same bits on every run.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, next_power_of_2
from moeforge.kernels.stack_pairs import copy_adapters

_BLOCK_K = 64  # elements of K a step
_MAX_BLOCK_M = 128  # rows a program takes (at most the alignment's block, inside one of them)
_MAX_BLOCK_N = 128  # columns a program takes (Qwen3's and Mixtral's 8 adapters of rank 16: all of them)
_NUM_WARPS = 4
_NUM_STAGES = 3


@triton.jit
def _wide_kernel(x_ptr, a_ptr, ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, out_ptr, num_copies, K,
                 rows_per_a, rank, stack, scale, stride_xm, stride_xk, stride_as, stride_ae, stride_ar, stride_ak,
                 stride_om, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    first = tl.program_id(0) * BLOCK_M
    if first < tl.load(num_padded_ptr):  # (blocks past the aligned rows hold nothing)
        slots = first + tl.arange(0, BLOCK_M)
        copies = tl.load(sorted_ids_ptr + slots)
        row_ok = copies < num_copies
        expert = tl.load(block_expert_ptr + first // ALIGNED).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < stack * rank
        adapter = cols // rank
        # [BLOCK_K, BLOCK_N] pointers of the columns' A rows (adapter, expert, row of the rank), [BLOCK_M, BLOCK_K]
        # of the copies' input rows
        a_cols = (a_ptr + adapter.to(tl.int64)[None, :] * stride_as + expert * stride_ae
                  + (cols % rank).to(tl.int64)[None, :] * stride_ar)
        x_rows = x_ptr + (copies // rows_per_a).to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_ok = kk < K
            x = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_cols + kk[:, None] * stride_ak, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        chosen, used = copy_adapters(ids_ptr, copies, row_ok, stack, scale)
        u = tl.where(adapter[None, :] == chosen[:, None], acc * used[:, None], 0.0)
        tl.store(out_ptr + copies.to(tl.int64)[:, None] * stride_om + cols[None, :], u.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def stack_wide(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, sorted_ids: torch.Tensor,
               block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int, num_copies: int, rows_per_a: int,
               scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``u [C, S · r]`` in ``out_dtype`` for a stack's ``C = num_copies`` copies (see the module docstring).
    ``rows [R, K]``: copy ``c`` reads row ``c // rows_per_a``; ``a [S, E | 1, r, K]`` (``E`` 1: one ``A`` an adapter
    for every expert); both float, of one dtype, any strides. ``ids [C]``: each copy's adapter (any integer dtype).
    ``sorted_ids``, ``block_expert``, ``num_padded``: the copies aligned by expert in blocks of ``block_m``
    (:func:`moeforge.kernels.align.align_block_size`), as the base GEMM reads them."""
    ids = ids.reshape(-1)
    stack, experts, rank, k_dim = a.shape
    if rows.dim() != 2 or rows.shape[1] != k_dim or rows.dtype != a.dtype or not rows.dtype.is_floating_point:
        raise ValueError(f"stack_wide takes float rows [R, K] and a [S, E, r, K] of one K and dtype; got "
                         f"{rows.dtype} {tuple(rows.shape)} and {a.dtype} {tuple(a.shape)}")
    if ids.numel() != num_copies or rows_per_a < 1 or rows.shape[0] * rows_per_a < num_copies:
        raise ValueError(f"stack_wide: {num_copies} copies of {rows.shape[0]} rows ({rows_per_a} a row) need an id "
                         f"each, got {ids.numel()}")
    if block_m < 16 or block_m & (block_m - 1) or block_expert.numel() != cdiv(sorted_ids.numel(), block_m):
        raise ValueError(f"stack_wide reads an alignment in blocks of a power of two of at least 16 rows, with an "
                         f"expert per block; got block_m={block_m}, {sorted_ids.numel()} sorted ids and "
                         f"{block_expert.numel()} block experts")
    width = stack * rank
    out = torch.empty(num_copies, width, dtype=out_dtype, device=rows.device)
    if num_copies == 0 or width == 0:
        return out
    block_m_prog = min(block_m, _MAX_BLOCK_M)
    block_n = min(_MAX_BLOCK_N, max(16, next_power_of_2(width)))
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"

    def wide_launch() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(ALIGNED=block_m, BLOCK_M=block_m_prog, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, PRECISION=precision),
                dict(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES))

    _WIDE.launch(("wide", block_m, block_m_prog, block_n, precision),
                 (cdiv(sorted_ids.numel(), block_m_prog), cdiv(width, block_n)),
                 (rows, a, ids, sorted_ids, block_expert, num_padded, out, num_copies, k_dim, rows_per_a, rank, stack,
                  float(scale), rows.stride(0), rows.stride(1), a.stride(0), a.stride(1) if experts > 1 else 0,
                  a.stride(2), a.stride(3), out.stride(0)), wide_launch)
    return out


_WIDE = LaunchSite(_wide_kernel)
