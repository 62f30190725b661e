"""The block alignment of rows an exchange left grouped by expert: what the triton expert GEMMs read.

The fixed-capacity dispatchers (:class:`~moeforge.distributed.LowLatencyDispatch`,
:class:`~moeforge.distributed.SymmetricDispatch`) leave each local expert's rows in one run of its buffer: in
fixed-capacity buffers (``[L, S, H]``, expert ``l``'s first ``masked_m[l]`` slots valid) or compact ones (``[R, H]``,
the experts' runs one after another). Flattened, each row is one copy, and the triton GEMMs read them through a
:class:`~moeforge.payloads.BlockAlignment` whose blocks cover only the valid rows: expert ``l``'s ``ceil(count[l] /
block_m)`` blocks, the experts' blocks one after another, the rows past a run the sentinel. Computed on the device from
the counts (no host sync, sizes fixed by the buffer: a CUDA graph captures it), ascending within each expert (the order
the weight gradient reads); blocks past the used ones are never read (the GEMMs stop at ``num_padded``).
"""

from __future__ import annotations

import torch

from moeforge.kernels.config import MoEConfig
from moeforge.payloads import Activations, AlignedRows, BlockAlignment, PaddedRows


def grouped_alignment(counts: torch.Tensor, starts: torch.Tensor, rows: int, blocks: int,
                      config: MoEConfig) -> BlockAlignment:
    """The alignment of ``L`` runs of rows, run ``l`` ``counts[l]`` rows from row ``starts[l]`` of ``rows`` rows, by
    ``config.block_m``, in ``blocks`` blocks (at least the blocks the runs can need). On a GPU one kernel
    (:mod:`moeforge.kernels.run_alignment`), elsewhere :func:`aligned_runs` (the same values)."""
    if counts.is_cuda:
        try:
            from moeforge.kernels.run_alignment import run_alignment
        except ImportError:  # no triton: torch ops
            return aligned_runs(counts, starts, rows, blocks, config)
        sorted_ids, block_expert, num_padded = run_alignment(counts, starts, rows, blocks, config.block_m)
        return BlockAlignment(sorted_ids=sorted_ids, block_expert=block_expert, num_padded=num_padded, config=config,
                              copies_per_row=1, num_tokens=rows)
    return aligned_runs(counts, starts, rows, blocks, config)


def aligned_runs(counts: torch.Tensor, starts: torch.Tensor, rows: int, blocks: int,
                 config: MoEConfig) -> BlockAlignment:
    """:func:`grouped_alignment` by torch ops (any device)."""
    local, block_m, device = counts.shape[0], config.block_m, counts.device
    valid = counts.to(torch.int64)
    used = (valid + block_m - 1) // block_m  # [L] blocks each run needs
    ends = used.cumsum(0)
    block = torch.arange(blocks, device=device)
    expert = torch.searchsorted(ends, block, right=True)  # [blocks]: each block's run, L past the used ones
    live = expert < local
    owner = expert.clamp(max=local - 1)
    index = block - (ends - used)[owner]  # the block's place in its run
    within = index.unsqueeze(1) * block_m + torch.arange(block_m, device=device).unsqueeze(0)  # [blocks, block_m]
    real = live.unsqueeze(1) & (within < valid[owner].unsqueeze(1))
    sorted_ids = torch.where(real, starts.to(torch.int64)[owner].unsqueeze(1) + within, rows).to(torch.int32)
    return BlockAlignment(sorted_ids=sorted_ids.reshape(-1), block_expert=torch.where(live, expert, 0).to(torch.int32),
                          num_padded=(ends[-1:] * block_m).to(torch.int32), config=config, copies_per_row=1,
                          num_tokens=rows)


def padded_alignment(masked_m: torch.Tensor, slots: int, config: MoEConfig) -> BlockAlignment:
    """The alignment of ``L`` experts' ``slots`` rows each (``[L * slots]`` flattened), ``masked_m [L]`` of them
    valid."""
    local = masked_m.shape[0]
    starts = torch.arange(local, device=masked_m.device) * slots
    return grouped_alignment(masked_m, starts, local * slots, local * -(-slots // config.block_m), config)


def aligned_padded_rows(padded: PaddedRows, config: MoEConfig) -> AlignedRows:
    """``padded`` (``[L, S, H]``, ``masked_m`` valid rows per expert) flattened to one copy per slot (``[L * S, H]``)
    for the triton GEMMs, its valid rows aligned by ``config``; its plan, weights and adapter ids carried over."""
    local, slots = padded.masked_m.shape[0], padded.x.data.shape[1]
    alignment = padded_alignment(padded.masked_m, slots, config)
    scale = padded.x.scale
    if scale is not None:
        scale = scale.reshape(local * slots, *scale.shape[2:])
    adapter_ids = padded.adapter_ids.reshape(-1) if padded.adapter_ids is not None else None
    copy_experts = None
    if adapter_ids is not None:
        experts = torch.arange(local, dtype=torch.int32, device=padded.masked_m.device)
        copy_experts = experts.repeat_interleave(slots)
    return AlignedRows(Activations(padded.x.data.reshape(local * slots, -1), scale), alignment, copy_major=False,
                       copy_weights=padded.slot_weights.reshape(-1), plan=padded.plan, adapter_ids=adapter_ids,
                       copy_experts=copy_experts)
