"""``benchmarks/bench_train.py``'s memory tools: the blocks live at a step's peak memory by where they were allocated
(``--memory-breakdown``), read from the allocator's recorded history (a made-up trace here; the GPU run reads the real
one); the tensors a step leaves in reference cycles."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_train  # noqa: E402

MOEFORGE = "/site/moeforge/kernels/backward.py"


def _alloc(addr: int, size: int, *frames: tuple[str, int, str]) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": f, "line": line, "name": name} for f, line, name in frames]}


def _free(addr: int, size: int) -> dict[str, Any]:
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def test_the_blocks_live_at_the_peak_by_the_line_that_allocated_them() -> None:
    torch_frame = ("/site/torch/autograd/__init__.py", 300, "backward")
    events = [
        _alloc(1, 100, torch_frame, (MOEFORGE, 86, "moe_gemm_backward"), ("/b/bench_train.py", 60, "run")),
        _alloc(2, 50, ("/b/bench_train.py", 61, "run")),
        _free(1, 100),  # (the peak so far: 150)
        _alloc(3, 80, torch_frame, (MOEFORGE, 93, "moe_gemm_backward")),
        _alloc(4, 40, (MOEFORGE, 93, "moe_gemm_backward")),
        _alloc(5, 10, torch_frame),  # the peak: 50 + 80 + 40 + 10 = 180
        _free(4, 40),
        _free(3, 80),
        _alloc(6, 20),  # no Python frame
        {"action": "free_completed", "addr": 4, "size": 40, "frames": []},  # (not a change of the allocated bytes)
        _free(99, 1000),  # a block allocated before the trace: not counted
    ]
    peak, places = bench_train.live_at_peak(events)
    assert peak == 180
    assert places == [("backward.py:93 moe_gemm_backward", 120, 2), ("bench_train.py:61 run", 50, 1),
                      ("__init__.py:300 backward", 10, 1)]
    assert bench_train.live_at_peak(events, top=1)[1] == places[:1]
    assert bench_train.live_at_peak([_alloc(1, 5)]) == (5, [("(no Python frame)", 5, 1)])
    assert bench_train.live_at_peak([]) == (0, [])


def test_tensors_a_step_leaves_in_reference_cycles_are_found() -> None:
    # what the GPU memory test asks of a training step: nothing held until Python's cycle collector runs
    kept: list[object] = []

    def sound() -> torch.Tensor:
        return torch.ones(4) * 2

    def cyclic() -> torch.Tensor:
        node: dict[str, object] = {"rows": torch.empty(100)}
        node["self"] = node
        return sound()

    def reachable() -> torch.Tensor:
        kept.append(torch.empty(100))  # (a leak, but not a cycle's: leftover_after_steps counts those)
        return sound()

    assert bench_train.storages_in_cycles(sound) == []
    assert bench_train.storages_in_cycles(cyclic) == [400]
    assert bench_train.storages_in_cycles(reachable) == []
    assert gc.isenabled()
