"""The block alignment of fixed-capacity expert buffers: padded rows read by the triton expert GEMMs.

A fixed-capacity dispatcher (:class:`~moeforge.distributed.SymmetricDispatch`) delivers ``[L, S, H]`` buffers whose
first ``masked_m[l]`` rows of expert ``l`` are valid. Flattened to ``[L * S, H]``, each slot is one copy, and the
triton GEMMs read them through a :class:`~moeforge.payloads.BlockAlignment` whose blocks cover only the valid rows:
expert ``l``'s ``ceil(masked_m[l] / block_m)`` blocks, the experts' blocks one after another, the slots past the
valid rows the sentinel. Computed on the device from ``masked_m`` (no host sync, fixed shapes: a CUDA graph
captures it), in ascending slot order within each expert (the order the weight gradient reads).
"""

from __future__ import annotations

import torch

from moeforge.kernels.config import MoEConfig
from moeforge.payloads import BlockAlignment


def padded_alignment(masked_m: torch.Tensor, slots: int, config: MoEConfig) -> BlockAlignment:
    """The alignment of ``L`` experts' ``slots`` rows each, ``masked_m [L]`` of them valid, by ``config.block_m``."""
    local, block_m, device = masked_m.shape[0], config.block_m, masked_m.device
    per_expert = -(-slots // block_m)  # the most blocks an expert's slots can need
    total = local * per_expert
    sentinel = local * slots
    valid = masked_m.to(torch.int64)
    used = (valid + block_m - 1) // block_m  # [L] blocks each expert needs
    first = used.cumsum(0) - used  # [L] its first block among all
    block = torch.arange(per_expert, device=device)
    live = block.unsqueeze(0) < used.unsqueeze(1)  # [L, B]
    # block_expert, one spare entry past the end taking every unused (expert, block)
    block_dest = torch.where(live, first.unsqueeze(1) + block.unsqueeze(0), total).reshape(-1)
    block_expert = torch.zeros(total + 1, dtype=torch.int32, device=device)
    experts = torch.arange(local, dtype=torch.int32, device=device).repeat_interleave(per_expert)
    block_expert.index_put_((block_dest,), experts)
    # sorted_ids: each expert's slots (the sentinel past its valid rows) at its blocks' places
    within = torch.arange(per_expert * block_m, device=device)  # [B * block_m]
    slot_of = torch.arange(local, device=device).unsqueeze(1) * slots + within.unsqueeze(0)
    ids = torch.where(within.unsqueeze(0) < valid.unsqueeze(1), slot_of, sentinel).to(torch.int32)
    row_dest = torch.where((within // block_m).unsqueeze(0) < used.unsqueeze(1),
                           first.unsqueeze(1) * block_m + within.unsqueeze(0), total * block_m).reshape(-1)
    sorted_ids = torch.full((total * block_m + 1,), sentinel, dtype=torch.int32, device=device)
    sorted_ids.index_put_((row_dest,), ids.reshape(-1))
    num_padded = (used.sum() * block_m).to(torch.int32).reshape(1)
    return BlockAlignment(sorted_ids=sorted_ids[:total * block_m], block_expert=block_expert[:total],
                          num_padded=num_padded, config=config, copies_per_row=1, num_tokens=sentinel)
