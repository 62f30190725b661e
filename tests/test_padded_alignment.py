"""The block alignment of fixed-capacity expert buffers (moeforge.distributed.padded_alignment) against a plain
reading of what it must say."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.distributed.padded_alignment import grouped_alignment, padded_alignment
from moeforge.kernels.config import GemmConfig, MoEConfig


@settings(max_examples=60, deadline=None)
@given(data=st.data(), local=st.integers(1, 5), slots=st.integers(1, 40), block_m=st.sampled_from([1, 4, 16, 32]))
def test_the_blocks_cover_each_experts_valid_slots_in_order(data: st.DataObject, local: int, slots: int,
                                                            block_m: int) -> None:
    masked = torch.tensor(data.draw(st.lists(st.integers(0, slots), min_size=local, max_size=local)), dtype=torch.int32)
    config = MoEConfig(GemmConfig(block_m, 32, 32), GemmConfig(block_m, 32, 32))
    alignment = padded_alignment(masked, slots, config)
    sentinel = local * slots
    assert alignment.num_copies == sentinel and alignment.copies_per_row == 1
    used = int(alignment.num_padded.item())
    assert used == sum(-(-int(m) // block_m) * block_m for m in masked)
    ids = alignment.sorted_ids[:used].view(-1, block_m)
    experts = alignment.block_expert[:used // block_m]
    want_blocks, want_ids = [], []
    for expert, valid in enumerate(masked.tolist()):
        for first in range(0, valid, block_m):
            want_blocks.append(expert)
            want_ids.append([expert * slots + first + j if first + j < valid else sentinel for j in range(block_m)])
    assert experts.tolist() == want_blocks
    assert ids.tolist() == want_ids
    assert alignment.sorted_ids.numel() == local * -(-slots // block_m) * block_m  # fixed: what a graph captures


@settings(max_examples=60, deadline=None)
@given(data=st.data(), local=st.integers(1, 5), rows=st.integers(1, 60), block_m=st.sampled_from([1, 4, 16]))
def test_runs_one_after_another_cut_at_the_buffer_are_aligned(data: st.DataObject, local: int, rows: int,
                                                              block_m: int) -> None:
    # compact buffers: expert l's rows from starts[l], the runs one after another, the last ones cut at `rows`
    counts = data.draw(st.lists(st.integers(0, 30), min_size=local, max_size=local))
    ends = torch.tensor(counts).cumsum(0).clamp(max=rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    valid = ends - starts
    config = MoEConfig(GemmConfig(block_m, 32, 32), GemmConfig(block_m, 32, 32))
    blocks = -(-rows // block_m) + local
    alignment = grouped_alignment(valid, starts, rows, blocks, config)
    used = int(alignment.num_padded.item())
    want_blocks, want_ids = [], []
    for expert in range(local):
        for first in range(0, int(valid[expert]), block_m):
            want_blocks.append(expert)
            want_ids.append([int(starts[expert]) + first + j if first + j < int(valid[expert]) else rows
                             for j in range(block_m)])
    assert used == len(want_blocks) * block_m <= blocks * block_m
    assert alignment.block_expert[:len(want_blocks)].tolist() == want_blocks
    assert alignment.sorted_ids[:used].view(-1, block_m).tolist() == want_ids


@settings(max_examples=25, deadline=None)
@given(data=st.data(), local=st.integers(1, 40), rows=st.integers(1, 300), block_m=st.sampled_from([4, 16, 64]),
       extra=st.integers(0, 3))
def test_the_alignment_kernel_writes_what_the_torch_ops_write(data: st.DataObject, local: int, rows: int,
                                                              block_m: int, extra: int) -> None:
    # the GPU's one launch (moeforge.kernels.run_alignment; here Triton's interpreter) against the torch ops, every
    # entry of the fixed-size outputs (the padding rows' sentinel, the unused blocks' expert 0) and the used length
    from moeforge.distributed.padded_alignment import aligned_runs
    from moeforge.kernels.run_alignment import run_alignment

    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 40), min_size=local, max_size=local)))
    ends = counts.cumsum(0).clamp(max=rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    valid = (ends - starts).to(torch.int32)
    blocks = -(-rows // block_m) + local + extra
    config = MoEConfig(GemmConfig(block_m, 32, 32), GemmConfig(block_m, 32, 32))
    want = aligned_runs(valid, starts, rows, blocks, config)
    sorted_ids, block_expert, num_padded = run_alignment(valid.to(device), starts.to(device), rows, blocks, block_m)
    assert torch.equal(sorted_ids.cpu(), want.sorted_ids)
    assert torch.equal(block_expert.cpu(), want.block_expert)
    assert torch.equal(num_padded.cpu(), want.num_padded)
