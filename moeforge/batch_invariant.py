"""Batch invariance (``MoELayer(..., batch_invariant=True)``): each token's output is bitwise the same
whatever else is in the batch and however many tokens it holds.

What makes a result depend on the batch is a reduction whose order depends on it: a launch
configuration picked by token count (its ``BLOCK_K`` and even the tensor-core instruction, which
follows the tile shape), a split of K, a library GEMM that picks its algorithm by shape (cuBLAS for the
router and the shared experts). In this mode:

* every GEMM uses one launch configuration (:data:`INVARIANT_CONFIG`) for every token count: the
  dispatch aligns every batch with the same ``block_m`` and the K-loop of
  :mod:`moeforge.kernels.moe_gemm` runs in the same order with the same steps (it never splits K);
* the router and the shared experts' projections run through the same kernel as a one-expert grouped
  GEMM (:func:`linear`) instead of ``torch.nn.functional.linear``;
* routing, activation quantization (per token or per group: never per tensor, whose scale would read the
  whole batch) and the combine (each token sums its ``top_k`` copies in a fixed order) are per token
  already.

It needs the triton backend (a CUDA device); the price is the tuned tables' speed at the token counts
where they pick other tiles (``benchmarks/bench_moe.py --batch-invariant`` measures it).
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig

# One tile for every token count: 64 rows (a whole warpgroup MMA on Hopper), 128 columns, 64 K per step.
INVARIANT_GEMM = GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4)
INVARIANT_CONFIG = MoEConfig(INVARIANT_GEMM, INVARIANT_GEMM)


def invariant_table(num_experts: int, top_k: int, max_block_m: Optional[int] = None) -> ConfigTable:
    """A launch table that answers :data:`INVARIANT_CONFIG` for every token count (``max_block_m``: the
    quant method's cap, applied alike to every count)."""
    return ConfigTable(num_experts, top_k, tokens=(1,), configs=(INVARIANT_CONFIG,), max_block_m=max_block_m,
                       fixed=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x [T, K]``, ``weight [N, K]`` of ``x``'s dtype) as a one-expert grouped
    GEMM with :data:`INVARIANT_GEMM`: row ``t`` of the result does not depend on the other rows."""
    from moeforge.stages.triton import kernel_ops

    kernel_ops()
    ops = torch.ops.moeforge
    rows = x.shape[0]
    ids = torch.zeros(rows, 1, dtype=torch.int32, device=x.device)
    sorted_ids, block_expert, num_padded = ops.align_block_size(ids, 1, INVARIANT_GEMM.block_m)
    out, _ = ops.moe_gemm(x.contiguous(), None, weight[None], None, None, None,
                          bias[None] if bias is not None else None, None, sorted_ids, block_expert, num_padded,
                          rows, 1, 0, 1.0, 0, False, False, 1.0, 0.0, INVARIANT_GEMM.as_list(), x.dtype, False)
    result: torch.Tensor = out
    return result
