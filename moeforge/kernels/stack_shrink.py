# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Each copy's ``x Aᵀ`` by its own adapter of a stack, copy by copy: the serving stack's first low-rank product where
the copies are few.

A stack of ``S`` adapters over ``E`` experts gives copy ``c`` (of expert ``e``, adapter ``s``) the product
``used[c] · x[c // rows_per_a] @ A[s, e]ᵀ`` (``A [S, E | 1, r, K]``; ``used``: the adapters' ``scale``, 0 for a copy of
no adapter, id ``-1``, NaN for an id outside ``[-1, S)``, as :mod:`moeforge.kernels.stack_pairs` gives it). With many
copies the product is a grouped GEMM on the copies aligned again by (adapter, expert) pair
(:mod:`moeforge.adapters`); with few, that alignment (a launch over ``S · E`` keys) and a GEMM whose tiles are mostly
padding cost more than the product: here each program takes a few copies and one range of the K-loop, gathers each
copy's ``A`` rows by its expert and adapter and reduces over K on the CUDA cores (``r`` columns do not fill a tensor
core's tile). Its ranges' fp32 partial sums are added in a fixed order by a second launch (one launch where a single
range covers K): the same inputs give the same bits on every run. Every copy is computed (none is dropped); where it
lies in the alignment does not matter.
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
def _shrink_kernel(x_ptr, a_ptr, ids_ptr, experts_ptr, out_ptr, chosen_ptr, num_copies, K, rows_per_a, rank, stack,
                   k_per_split, scale, stride_xm, stride_xk, stride_as, stride_ae, stride_ar, stride_ak, stride_os,
                   stride_om,
                   RANK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    copies = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = copies < num_copies
    chosen, used = copy_adapters(ids_ptr, copies, c_ok, stack, scale)
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
    if SPLIT:  # this range's partial sums; the reducing launch weighs them
        tl.store(out, acc, mask=c_ok[:, None] & j_ok[None, :])
    else:
        tl.store(out, (acc * used[:, None]).to(out_ptr.dtype.element_ty), mask=c_ok[:, None] & j_ok[None, :])
        tl.store(chosen_ptr + copies, chosen, mask=c_ok)


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


def stack_shrink(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, copy_experts: torch.Tensor, rows_per_a: int,
                 scale: float, out_dtype: torch.dtype, splits: Optional[int] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, chosen)`` for a stack's copies (see the module docstring): ``low [C, r]`` in ``out_dtype``, each
    copy's product by its own adapter, weighed as ``used``; ``chosen [C]`` int32, each copy's adapter in the stack.
    ``rows [R, K]``: copy ``c`` reads row ``c // rows_per_a``; ``a [S, E | 1, r, K]`` (one ``A`` an adapter for
    every expert: ``E`` 1); both of any strides. ``ids [C]``: each copy's adapter (``-1``: none); ``copy_experts
    [C]``: each copy's local expert (any integer dtype). ``splits``: ranges of K (by default :func:`shrink_splits`)."""
    ids, copy_experts = ids.reshape(-1), copy_experts.reshape(-1)
    copies = ids.numel()
    stack, experts, rank, k_dim = a.shape
    if rows.dim() != 2 or rows.shape[1] != k_dim:
        raise ValueError(f"stack_shrink takes rows [R, K] and a [S, E, r, K] of one K; got {tuple(rows.shape)} and "
                         f"{tuple(a.shape)}")
    if copy_experts.numel() != copies or rows_per_a < 1 or rows.shape[0] * rows_per_a < copies:
        raise ValueError(f"stack_shrink: {copies} copies of {rows.shape[0]} rows ({rows_per_a} a row) need an expert "
                         f"each, got {copy_experts.numel()}")
    low = torch.empty(copies, rank, dtype=out_dtype, device=rows.device)
    chosen = torch.empty(copies, dtype=torch.int32, device=rows.device)
    if copies == 0:
        return low, chosen
    wanted = shrink_splits(copies, k_dim, rows.device) if splits is None else splits
    k_per_split = cdiv(cdiv(k_dim, _BLOCK_K), max(1, wanted)) * _BLOCK_K
    ranges = cdiv(k_dim, k_per_split)
    partials = (torch.empty(ranges, copies, rank, dtype=torch.float32, device=rows.device) if ranges > 1 else low)
    power = max(16, next_power_of_2(rank))
    split = ranges > 1

    def shrink_launch() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(RANK=power, BLOCK_C=_BLOCK_C, BLOCK_K=_BLOCK_K, SPLIT=split), dict(num_warps=4)

    _SHRINK.launch(("shrink", power, split), (cdiv(copies, _BLOCK_C), ranges),
                   (rows, a, ids, copy_experts, partials, chosen, copies, k_dim, rows_per_a, rank, stack, k_per_split,
                    float(scale), rows.stride(0), rows.stride(1), a.stride(0), a.stride(1) if experts > 1 else 0,
                    a.stride(2), a.stride(3), partials.stride(0) if split else 0, partials.stride(-2)), shrink_launch)
    if split:
        splits_power = next_power_of_2(ranges)
        block = max(1, _REDUCE_ELEMENTS // (splits_power * power))

        def reduce_launch() -> tuple[dict[str, Any], dict[str, Any]]:
            return dict(RANK=power, SPLITS=splits_power, BLOCK=block), dict(num_warps=4)

        _REDUCE.launch(("reduce", power, splits_power), (cdiv(copies, block),),
                       (partials, ids, low, chosen, copies, rank, stack, ranges, float(scale), partials.stride(0),
                        partials.stride(1), low.stride(0)), reduce_launch)
    return low, chosen


_SHRINK = LaunchSite(_shrink_kernel)
_REDUCE = LaunchSite(_reduce_kernel)
