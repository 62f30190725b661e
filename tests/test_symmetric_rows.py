"""The symmetric exchange's one-program kernels (moeforge.kernels.symmetric_rows) against a plain torch reading of
what they must compute: Triton's interpreter on the CPU, the compiled kernel on a GPU."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.kernels.symmetric_rows import place


@settings(max_examples=40, deadline=None)
@given(data=st.data(), world=st.integers(1, 4), local=st.integers(1, 6), rows=st.integers(1, 80))
def test_compact_placement_matches_the_counts_table(data: st.DataObject, world: int, local: int, rows: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = world * local
    table = torch.tensor(data.draw(st.lists(st.integers(0, 12), min_size=world * experts,
                                            max_size=world * experts)), dtype=torch.int32).view(world, experts)
    rank = data.draw(st.integers(0, world - 1))
    offsets, valid, starts, dropped, most = place(table.to(device), rank=rank, local=local, rows=rows)

    totals = table.sum(0)  # rows each expert receives
    owned = totals.view(world, local)
    before = table[:rank].sum(0)
    want_offsets = (owned.cumsum(1) - owned).reshape(experts) + before
    assert offsets.cpu().tolist() == want_offsets.tolist()
    mine = table[rank]
    # this rank's copies of expert e take the owner's slots offsets[e] .. offsets[e] + mine[e] - 1: those >= rows drop
    assert int(dropped) == int((want_offsets + mine - rows).clamp(min=0).minimum(mine).sum())
    assert int(most) == int(owned.sum(1).max())
    ends = owned[rank].cumsum(0).clamp(max=rows)
    first = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert starts.cpu().tolist() == first.tolist() and starts.dtype == torch.int64
    assert valid.cpu().tolist() == (ends - first).tolist() and valid.dtype == torch.int32
