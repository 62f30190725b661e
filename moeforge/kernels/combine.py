"""Combine on the device: ``out[t] = scale * sum_k rows[r(t, k)] * w[t, k]``, k in fixed order.

Rows are in copy order (``r(t, k) = t * top_k + k``), as the block-aligned grouped GEMM writes them,
or anywhere an index says (``r(t, k) = index[t, k]``, -1 for a copy that contributes nothing), as
the expert-parallel combines receive them. Each program owns one token and a slice of the hidden
dimension and sums its ``top_k`` copies in fp32 in order: deterministic, no atomics, one pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels import pdl


@triton.jit
def _combine_kernel(
    rows_ptr, weights_ptr, index_ptr, out_ptr,
    H, scale,
    stride_row, stride_out,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_the_kernel_before(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if HAS_INDEX:
            source = tl.load(index_ptr + token * TOP_K + k).to(tl.int64)
            # An absent copy (-1) loads nothing: its zeros add nothing, whatever row 0 holds.
            row = tl.load(rows_ptr + tl.maximum(source, 0) * stride_row + offs, mask=mask & (source >= 0),
                          other=0.0)
        else:
            row = tl.load(rows_ptr + (token * TOP_K + k) * stride_row + offs, mask=mask, other=0.0)
        if HAS_WEIGHTS:
            acc += row.to(tl.float32) * tl.load(weights_ptr + token * TOP_K + k)
        else:
            acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def combine_copies(
    rows: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum ``rows [T * top_k, H]`` into ``out [T, H]`` (weights ``[T, top_k]`` fp32, optional); with
    ``index [T, top_k]`` (int64, -1 = absent), copy ``k`` of token ``t`` is ``rows[index[t, k]]``."""
    tokens, hidden = out.shape
    if tokens == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden), 1024)
    grid = (tokens, triton.cdiv(hidden, block_h))
    dependent = pdl.pdl_applies(out.device)
    _combine_kernel[grid](
        rows, weights if weights is not None else rows, index if index is not None else rows, out,
        hidden, scale, rows.stride(0), out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, HAS_INDEX=index is not None, BLOCK_H=block_h,
        PDL=pdl.flag(dependent),
        num_warps=4 if block_h >= 512 else 2, **pdl.launch_options(dependent),
    )
    return out
