# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The block alignment of expert runs in one launch: what the triton GEMMs read of rows an exchange left grouped.

An expert-parallel exchange leaves each local expert's rows in one run of its receive buffer (run ``l``: ``counts[l]``
rows from row ``starts[l]``). The GEMMs read them through a :class:`~moeforge.payloads.BlockAlignment`: expert ``l``'s
``ceil(counts[l] / block_m)`` blocks, the experts' blocks one after another, each block's rows ascending, the rows
past a run the sentinel ``rows``, the blocks past the used ones expert 0 (never read: the GEMMs stop at
``num_padded``). :func:`moeforge.distributed.padded_alignment.aligned_runs` is the same computed by torch ops
(about twenty launches, each with its host-side cost in an eager step); here each program takes
:data:`BLOCKS` blocks, finds their runs from the runs' block counts (a scan over at most a few hundred experts, in
registers) and writes their rows and experts. No host sync, sizes fixed by the buffer: a CUDA graph captures it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _run_alignment_kernel(counts_ptr, starts_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, local, rows,
                          blocks, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, BLOCKS: tl.constexpr):
    offs_l = tl.arange(0, BLOCK_L)
    in_range = offs_l < local
    count = tl.load(counts_ptr + offs_l, mask=in_range, other=0).to(tl.int32)
    start = tl.load(starts_ptr + offs_l, mask=in_range, other=0).to(tl.int64)
    used = (count + BLOCK_M - 1) // BLOCK_M  # blocks each run needs
    ends = tl.cumsum(used, axis=0)  # (runs past ``local`` need none: their ends are the total)
    first_block = ends - used
    block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    # Each block's run: how many runs end at or before it (what torch.searchsorted(ends, block, right=True) gives).
    expert = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)
    live = expert < local
    hit = (offs_l[None, :] == expert[:, None]).to(tl.int32)  # [BLOCKS, BLOCK_L]: a block's run, none past them
    run_first_block = tl.sum(hit * first_block[None, :], axis=1)
    run_count = tl.sum(hit * count[None, :], axis=1)
    run_start = tl.sum(hit.to(tl.int64) * start[None, :], axis=1)
    within = (block - run_first_block)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BLOCKS, BLOCK_M]
    real = live[:, None] & (within < run_count[:, None])
    ids = tl.where(real, run_start[:, None] + within, rows).to(tl.int32)
    in_grid = block < blocks
    tl.store(sorted_ids_ptr + block.to(tl.int64)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], ids,
             mask=in_grid[:, None])
    tl.store(block_expert_ptr + block, tl.where(live, expert, 0), mask=in_grid)
    if tl.program_id(0) == 0:
        tl.store(num_padded_ptr, (tl.sum(used, axis=0) * BLOCK_M).to(tl.int32))


def run_alignment(counts: torch.Tensor, starts: torch.Tensor, rows: int, blocks: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [blocks * block_m], block_expert [blocks], num_padded [1])`` (int32) of ``L`` runs of rows, run
    ``l`` ``counts[l]`` rows from row ``starts[l]`` of ``rows`` rows, in ``blocks`` blocks of ``block_m`` (at least
    the blocks the runs need: ``sum(ceil(counts / block_m))``)."""
    local, device = counts.shape[0], counts.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if local == 0 or blocks == 0:
        return sorted_ids, block_expert, num_padded.zero_()
    block_l = max(next_power_of_2(local), 2)
    per_program = max(min(BLOCKS, 8192 // block_l), 1)  # the [blocks, runs] comparison stays a few thousand lanes

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_M=block_m, BLOCK_L=block_l, BLOCKS=per_program), dict(num_warps=4)

    _RUN_ALIGNMENT.launch(("runs", block_m, block_l, per_program), (cdiv(blocks, per_program),),
                          (counts, starts, sorted_ids, block_expert, num_padded, local, rows, blocks), make)
    return sorted_ids, block_expert, num_padded


BLOCKS = 64  # blocks per program (fewer where there are many runs)

_RUN_ALIGNMENT = LaunchSite(_run_alignment_kernel)
