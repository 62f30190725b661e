# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Each copy's ``x Aᵀ`` by its own adapter of a stack, copy by copy, over ranges of K: the serving stack's first
low-rank product where the copies are few.

A stack of ``S`` adapters over ``E`` experts gives copy ``c`` (of expert ``e``, adapter ``s``) the product
``x[c // rows_per_a] @ A[s, e]ᵀ`` (``A [S, E | 1, r, K]``; an id of no adapter, ``-1``, or outside ``[-1, S)`` reads
adapter 0, whose product its consumer weighs by 0 or NaN: :func:`moeforge.kernels.stack_pairs.copy_adapters`). With
many copies the product is a grouped GEMM on the copies aligned again by (adapter, expert) pair
(:mod:`moeforge.adapters`); with few, that alignment (a launch over ``S · E`` keys) and a GEMM whose tiles are mostly
padding cost more than the product: here each program takes a few copies and one range of the K-loop, gathers each
copy's ``A`` rows by its expert and adapter and reduces over K on the CUDA cores (``r`` columns do not fill a tensor
core's tile). The ranges' fp32 sums ``[P, C, r]`` are the output: over a short K-loop their consumer, the base
GEMM's stack update (:func:`moeforge.kernels.moe_gemm.moe_gemm` with ``update_rows`` of ``P`` parts), adds them in a
fixed order and weighs them as it loads them, so no launch of its own finishes them; over a long one (many ranges,
which each of the GEMM's column tiles would sum) :func:`reduce_parts` does, by a launch. Either way the same inputs
give the same bits on every run. Every copy is computed (none is dropped); where it lies in the alignment does not
matter.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, multiprocessors, next_power_of_2
from moeforge.kernels.stack_pairs import copy_adapters

_BLOCK_C = 4  # copies a program takes
_BLOCK_K = 128  # elements of K a step
_REDUCE_ELEMENTS = 4096  # partial sums a reducing program loads (ranges x copies x rank)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ids_ptr, experts_ptr, out_ptr, num_copies, K, rows_per_a, rank, stack, k_per_split,
                   stride_xm, stride_xk, stride_as, stride_ae, stride_ar, stride_ak, stride_os, stride_om,
                   RANK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    copies = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = copies < num_copies
    chosen, _ = copy_adapters(ids_ptr, copies, c_ok, stack, 1.0)
    expert = tl.load(experts_ptr + copies, mask=c_ok, other=0).to(tl.int64)
    j = tl.arange(0, RANK)
    j_ok = j < rank
    # [copies, r, K-step] pointers of each copy's A rows, [copies, 1, K-step] of its input row
    a_rows = (a_ptr + chosen.to(tl.int64)[:, None, None] * stride_as + expert[:, None, None] * stride_ae
              + j[None, :, None] * stride_ar)
    x_row = x_ptr + (copies // rows_per_a).to(tl.int64)[:, None, None] * stride_xm
    rows_ok = c_ok[:, None, None] & j_ok[None, :, None]
    k_first = tl.program_id(1) * k_per_split
    k_last = tl.minimum(k_first + k_per_split, K)
    acc = tl.zeros((BLOCK_C, RANK), dtype=tl.float32)
    for k0 in range(k_first, k_last, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = (kk < k_last)[None, None, :]
        kk64 = kk.to(tl.int64)[None, None, :]  # (a view's K stride may be large)
        x = tl.load(x_row + kk64 * stride_xk, mask=c_ok[:, None, None] & k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + kk64 * stride_ak, mask=rows_ok & k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(x * a, axis=2)
    out = out_ptr + tl.program_id(1) * stride_os + copies.to(tl.int64)[:, None] * stride_om + j[None, :]
    tl.store(out, acc, mask=c_ok[:, None] & j_ok[None, :])


@triton.jit
def _reduce_kernel(p_ptr, ids_ptr, out_ptr, chosen_ptr, num_copies, rank, stack, splits, scale, stride_ps, stride_pm,
                   stride_om, RANK: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # each program loads its copies' partial sums of every range at once and adds them in one fixed tree (a loop over
    # the ranges would wait on each load in turn, a hundred of them over a long K)
    copies = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c_ok = copies < num_copies
    chosen, used = copy_adapters(ids_ptr, copies, c_ok, stack, scale)
    j = tl.arange(0, RANK)
    ok = c_ok[:, None] & (j < rank)[None, :]
    split = tl.arange(0, SPLITS)
    parts = p_ptr + split[:, None, None] * stride_ps + (copies.to(tl.int64)[:, None] * stride_pm + j[None, :])[None]
    acc = tl.sum(tl.load(parts, mask=(split < splits)[:, None, None] & ok[None], other=0.0), axis=0)
    tl.store(out_ptr + copies.to(tl.int64)[:, None] * stride_om + j[None, :],
             (acc * used[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(chosen_ptr + copies, chosen, mask=c_ok)


def shrink_splits(copies: int, k_dim: int, device: torch.device) -> int:
    """The ranges of K the copies' products are split into: enough programs for about two per multiprocessor (a
    program's K-steps are latency-bound gathers), at least one ``_BLOCK_K`` step a range; one off CUDA."""
    if device.type != "cuda" or copies == 0:
        return 1
    return max(1, min(cdiv(k_dim, _BLOCK_K), cdiv(2 * multiprocessors(device), cdiv(copies, _BLOCK_C))))


def shrink_ranges(copies: int, k_dim: int, device: torch.device, splits: Optional[int] = None) -> tuple[int, int]:
    """``(ranges, K-elements a range)`` of :func:`stack_shrink`'s output for ``splits`` wanted ranges (by default
    :func:`shrink_splits`): whole K-steps a range, the last range possibly shorter, none empty."""
    wanted = shrink_splits(copies, k_dim, device) if splits is None else splits
    k_per_split = cdiv(cdiv(max(k_dim, 1), _BLOCK_K), max(1, wanted)) * _BLOCK_K
    return cdiv(max(k_dim, 1), k_per_split), k_per_split


def stack_shrink(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, copy_experts: torch.Tensor, rows_per_a: int,
                 splits: Optional[int] = None) -> torch.Tensor:
    """``parts [P, C, r]`` (fp32) for a stack's copies (see the module docstring): part ``p`` holds each copy's
    product over the ``p``-th range of K by its own adapter (unweighted; their sum is the product). ``rows [R, K]``:
    copy ``c`` reads row ``c // rows_per_a``; ``a [S, E | 1, r, K]`` (one ``A`` an adapter for every expert: ``E``
    1); both of any strides. ``ids [C]``: each copy's adapter; ``copy_experts [C]``: each copy's local expert (any
    integer dtype). ``splits``: ranges of K wanted (by default :func:`shrink_splits`; :func:`shrink_ranges` gives
    ``P``)."""
    ids, copy_experts = ids.reshape(-1), copy_experts.reshape(-1)
    copies = ids.numel()
    stack, experts, rank, k_dim = a.shape
    if rows.dim() != 2 or rows.shape[1] != k_dim:
        raise ValueError(f"stack_shrink takes rows [R, K] and a [S, E, r, K] of one K; got {tuple(rows.shape)} and "
                         f"{tuple(a.shape)}")
    if copy_experts.numel() != copies or rows_per_a < 1 or rows.shape[0] * rows_per_a < copies:
        raise ValueError(f"stack_shrink: {copies} copies of {rows.shape[0]} rows ({rows_per_a} a row) need an expert "
                         f"each, got {copy_experts.numel()}")
    ranges, k_per_split = shrink_ranges(copies, k_dim, rows.device, splits)
    parts = torch.empty(ranges, copies, rank, dtype=torch.float32, device=rows.device)
    if copies == 0:
        return parts
    power = max(16, next_power_of_2(rank))

    def shrink_launch() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(RANK=power, BLOCK_C=_BLOCK_C, BLOCK_K=_BLOCK_K), dict(num_warps=4)

    _SHRINK.launch(("shrink", power), (cdiv(copies, _BLOCK_C), ranges),
                   (rows, a, ids, copy_experts, parts, copies, k_dim, rows_per_a, rank, stack, k_per_split,
                    rows.stride(0), rows.stride(1), a.stride(0), a.stride(1) if experts > 1 else 0, a.stride(2),
                    a.stride(3), parts.stride(0), parts.stride(1)), shrink_launch)
    return parts


def reduce_parts(parts: torch.Tensor, ids: torch.Tensor, stack: int, scale: float, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, chosen)`` of :func:`stack_shrink`'s ``parts [P, C, r]`` summed in one fixed order by a launch of their
    own (where the base GEMM's tiles would each sum many of them: a long K-loop, :mod:`moeforge.adapters`): ``low [C,
    r]`` in ``out_dtype``, each copy's product weighed by its id (``scale`` for an adapter of the stack, 0 for none,
    ``-1``, NaN outside ``[-1, S)``), and ``chosen [C]`` int32, each copy's adapter clamped into the stack (0 for none
    and outside), as a stack's update in one part takes them."""
    ranges, copies, rank = parts.shape
    ids = ids.reshape(-1)
    if ids.numel() != copies or parts.dtype != torch.float32 or parts.stride(2) != 1:
        raise ValueError(f"reduce_parts takes fp32 parts [P, C, r] with contiguous rows and C ids, got "
                         f"{parts.dtype} {tuple(parts.shape)} and {ids.numel()} ids")
    low = torch.empty(copies, rank, dtype=out_dtype, device=parts.device)
    chosen = torch.empty(copies, dtype=torch.int32, device=parts.device)
    if copies == 0:
        return low, chosen
    power, splits_power = max(16, next_power_of_2(rank)), next_power_of_2(ranges)
    block = max(1, _REDUCE_ELEMENTS // (splits_power * power))

    def reduce_launch() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(RANK=power, SPLITS=splits_power, BLOCK=block), dict(num_warps=4)

    _REDUCE.launch(("reduce", power, splits_power), (cdiv(copies, block),),
                   (parts, ids, low, chosen, copies, rank, stack, ranges, float(scale), parts.stride(0),
                    parts.stride(1), low.stride(0)), reduce_launch)
    return low, chosen


_SHRINK = LaunchSite(_shrink_kernel)
_REDUCE = LaunchSite(_reduce_kernel)
