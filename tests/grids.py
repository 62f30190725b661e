"""Parameter grids that a GPU runs whole and the CPU suite in part.

Some kernel tests cross several axes (weight format x schedule, dtype x tile pair, ...). Under Triton's interpreter
each case costs seconds, and the CPU suite must stay under its time budget, so on the CPU only a covering part of
such a grid runs: every value of every axis in at least one case (the axes walked together, the shorter ones
cycling). On a GPU every case runs (the GPU suite's shards).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import pytest
import torch

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="the CPU suite runs a covering part of this grid (interpreter time); a GPU all")


def grid(*axes: Sequence[Any], ids: Optional[Sequence[Optional[Sequence[str]]]] = None) -> list[Any]:
    """Every combination of ``axes`` (one value from each, in order) as a ``pytest.param``, those outside the
    covering part marked :data:`GPU_ONLY`. ``ids``: per axis, the values' ids (``None``: ``str`` of the value)."""
    names = [list(axis_ids) if axis_ids is not None else [str(value) for value in axis]
             for axis, axis_ids in zip(axes, ids or [None] * len(axes))]
    longest = max(len(axis) for axis in axes)
    covering = {tuple(step % len(axis) for axis in axes) for step in range(longest)}
    params = []
    for index in itertools.product(*(range(len(axis)) for axis in axes)):
        values = tuple(axis[i] for axis, i in zip(axes, index))
        case_id = "-".join(axis_names[i] for axis_names, i in zip(names, index))
        params.append(pytest.param(*values, id=case_id, marks=() if index in covering else GPU_ONLY))
    return params
