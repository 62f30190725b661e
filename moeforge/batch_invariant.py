"""Batch invariance (``MoELayer(..., batch_invariant=True)``): each token's output is bitwise the same
whatever else is in the batch and however many tokens it holds.

What makes a result depend on the batch is a reduction whose order depends on it: a launch
configuration picked by token count (its ``BLOCK_K`` and even the tensor-core instruction, which
follows the tile shape), a split of K, a library GEMM that picks its algorithm by shape (cuBLAS for the
router and the shared experts). In this mode:

* every GEMM reduces each output element in the same order for every token count. The K-loop of
  :mod:`moeforge.kernels.moe_gemm` is never split here (every entry has ``split_k=1``; the launcher's rule
  would otherwise split long K-loops of small batches), so the order is fixed by the K-step (``block_k``) and
  by the tensor-core instruction. The launch table (:func:`invariant_table`) therefore picks tiles by
  token count only within one family: ``block_k = 64`` and at least 64 rows per block (Hopper's
  warpgroup MMA; 16- and 32-row blocks take ``mma.sync``). Within it ``block_m``, ``block_n``, the warps
  and the pipeline depth change which elements a program computes, not how: on an H100 every tile of
  the family gives bitwise the same rows in bf16, W4A16, MXFP4 and NVFP4, while ``mma.sync`` tiles
  differ from them in 0.01–0.1 % of the W4A16 / NVFP4 elements (``tests/test_batch_invariant.py``).
  The family is used on Hopper (compute capability 9.x), where it was checked; other GPUs take one
  configuration, :data:`INVARIANT_CONFIG`. Quantized GEMMs keep their format's tiles for the table's
  ``block_m`` (W8A8: always 64 rows, so one tile: its block-scaled result depends on ``block_n``); fp32
  layers, and a ``max_block_m`` below 64, take one configuration (:data:`INVARIANT_CONFIG`) for every count;
* the router and the shared experts' projections run through the same kernel as a one-expert grouped
  GEMM (:func:`linear`) instead of ``torch.nn.functional.linear``;
* routing, activation quantization (per token or per group: never per tensor, whose scale would read the
  whole batch) and the combine (each token sums its ``top_k`` copies in a fixed order) are per token
  already.

It needs the triton backend (a CUDA device); the price is the tuned tables' speed at the token counts
where they pick tiles outside the family (small batches: 16-row blocks, deeper K-steps), measured by
``benchmarks/bench_moe.py --batch-invariant``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from moeforge.kernels.config import TOKEN_BUCKETS, ConfigTable, GemmConfig, MoEConfig, fit_shared_memory
from moeforge.kernels.grouped_gemm_call import GemmEpilogue, GemmRoute, GemmRows, GemmWeight, grouped_gemm

# The family's K-step and smallest block (a whole warpgroup MMA on Hopper).
INVARIANT_BLOCK_K = 64
INVARIANT_MIN_BLOCK_M = 64
INVARIANT_MAX_BLOCK_M = 128  # the largest block checked on a GPU (the tuned tables use no larger)
# The one configuration where the family cannot follow the tuned table (fp32 rows, a cap below 64 rows),
# and the router's and shared experts' GEMMs (:func:`linear`).
INVARIANT_GEMM = GemmConfig(64, 128, INVARIANT_BLOCK_K, group_m=8, num_warps=4, num_stages=4, split_k=1)
INVARIANT_CONFIG = MoEConfig(INVARIANT_GEMM, INVARIANT_GEMM)


def family_checked_on(device: torch.device) -> bool:
    """Whether the tile family was checked on ``device``'s tensor cores (Hopper's warpgroup MMA,
    compute capability 9.x); elsewhere :func:`invariant_table` gets no tuned table: one configuration."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def in_family(config: GemmConfig) -> bool:
    """Whether ``config`` reduces like every other member of the batch-invariant family."""
    return (config.block_k == INVARIANT_BLOCK_K and config.split_k == 1 and not config.swap and not config.half_tail
            and not config.decode_chunk and not config.warp_specialized
            and INVARIANT_MIN_BLOCK_M <= config.block_m <= INVARIANT_MAX_BLOCK_M
            and config.num_warps % 4 == 0)


def family_member(config: GemmConfig, element_bytes: int, b_tiles: int) -> GemmConfig:
    """``config`` moved into the family: 64 to 128 rows, 64-wide K-steps, its columns, warps and
    pipeline kept (the pipeline shortened to fit shared memory, so that the launcher's fitting never
    halves the K-step; ``b_tiles``: weight tiles per K-step, 2 for a fused gate/up GEMM);
    :data:`INVARIANT_GEMM` where even two stages do not fit."""
    block_m = min(max(config.block_m, INVARIANT_MIN_BLOCK_M), INVARIANT_MAX_BLOCK_M)
    member = attrs.evolve(config, block_m=block_m, block_k=INVARIANT_BLOCK_K,
                          num_warps=max(4 * (config.num_warps // 4), 4), split_k=1, swap=False,
                          half_tail=False, decode_chunk=0, warp_specialized=False)
    fitted = fit_shared_memory(member, element_bytes, b_tiles)
    return fitted if fitted.block_k == INVARIANT_BLOCK_K else INVARIANT_GEMM


def invariant_table(num_experts: int, top_k: int, max_block_m: Optional[int] = None,
                    tuned: Optional[ConfigTable] = None, element_bytes: int = 2) -> ConfigTable:
    """The batch-invariant launch table: for each token bucket, ``tuned``'s configuration (a device's
    table for the shape, or the fallback rules when it has none) moved into the family
    (:func:`family_member`). Without ``tuned`` (a GPU other than Hopper), with ``element_bytes`` other
    than 2 (fp32 rows: FMA products, not probed for tile independence) or with a ``max_block_m`` below
    the family's 64 rows, one configuration, :data:`INVARIANT_CONFIG`, for every count."""
    if element_bytes != 2 or (max_block_m is not None and max_block_m < INVARIANT_MIN_BLOCK_M) or tuned is None:
        return ConfigTable(num_experts, top_k, tokens=(1,), configs=(INVARIANT_CONFIG,), max_block_m=max_block_m,
                           batch_invariant=True)
    tokens = tuned.tokens or TOKEN_BUCKETS
    configs = []
    for count in tokens:
        entry = tuned.lookup(count)
        # 64- and 128-row members may pair (one divides the other: MoEConfig)
        configs.append(MoEConfig(family_member(entry.gate_up, element_bytes, 2),
                                 family_member(entry.down, element_bytes, 1)))
    return ConfigTable(num_experts, top_k, tokens=tuple(tokens), configs=tuple(configs), max_block_m=max_block_m,
                       batch_invariant=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x [T, K]``, ``weight [N, K]`` of ``x``'s dtype) as a one-expert grouped
    GEMM with :data:`INVARIANT_GEMM`: row ``t`` of the result does not depend on the other rows."""
    from moeforge.stages.triton import kernel_ops

    rows = x.shape[0]
    ids = torch.zeros(rows, 1, dtype=torch.int32, device=x.device)
    sorted_ids, block_expert, num_padded = kernel_ops().align_block_size(ids, 1, INVARIANT_GEMM.block_m,
                                                                            torch.is_grad_enabled())
    out, _ = grouped_gemm(GemmRows(x.contiguous()), GemmWeight(weight[None]),
                          GemmRoute(sorted_ids, block_expert, num_padded, rows),
                          GemmEpilogue(x.dtype, bias=bias[None] if bias is not None else None), INVARIANT_GEMM)
    return out
