"""The partial grids of tests/grids.py: every case listed, every value of every axis kept on the CPU."""

from __future__ import annotations

import itertools

from grids import GPU_ONLY, grid


def test_a_grid_lists_every_case_and_keeps_every_value_of_every_axis() -> None:
    for axes in (([1, 2], ["a", "b", "c"]), ([1, 2, 3, 4], ["x", "y", "z"]), ([True, False], [0], ["p", "q"])):
        params = grid(*axes)
        assert [p.values for p in params] == list(itertools.product(*axes))
        kept = [p.values for p in params if GPU_ONLY not in p.marks]
        assert len(kept) == max(len(axis) for axis in axes)
        for position, axis in enumerate(axes):
            assert {values[position] for values in kept} == set(axis)
    assert [p.id for p in grid([1, 2], ["a"], ids=[["one", "two"], None])] == ["one-a", "two-a"]
