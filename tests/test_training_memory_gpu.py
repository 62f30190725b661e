"""A training step's peak memory on the GPU: forward + backward of the experts (``benchmarks/bench_train.py``'s
step, the benchmark's shapes at M = 1024, where the margins are thinnest) takes at most the memory of the same
computation written with ``torch._grouped_mm`` and autograd (each path's second step: what a first step allocates
once is in neither figure, whatever ran before in the process), gives bitwise the same gradients twice, and keeps
nothing allocated from one step to the next.

The weight gradient's gathered operands are what decides it: in the alignment's padded slot order they took Qwen3's
step to 1351 MiB against 1300 (``docs/notes/kernels-log.md``, "The weight gradient's operands in expert order")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_train  # noqa: E402
from bench_moe import SHAPES  # noqa: E402

import moeforge as mf  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["qwen3", "gptoss", "deepseek", "mixtral"])
def test_a_training_step_takes_at_most_the_memory_of_grouped_mm(shape: str) -> None:
    experts, top_k, hidden, inter = SHAPES[shape]
    tokens = 1024
    torch.manual_seed(0)
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    topk = mf.stages.select_experts(torch.randn(tokens, experts, device="cuda"), top_k, layer.routing)
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = bench_train.moeforge_step(layer, x, topk, grad)
    ours, ours_stable = bench_train.step_memory_and_determinism(step)
    theirs, _ = bench_train.step_memory_and_determinism(bench_train.grouped_mm_step(layer, x, topk, grad))
    assert ours_stable
    if ours > theirs:  # what was live at each peak, by the line that allocated it
        lines = [f"{shape}: {ours / 2**20:.0f} MiB against torch._grouped_mm's {theirs / 2**20:.0f} MiB"]
        for what, fn in (("moeforge", step), ("grouped_mm", bench_train.grouped_mm_step(layer, x, topk, grad))):
            peak, places = bench_train.memory_breakdown(fn)
            lines += [f"{what} traced peak {peak / 2**20:.1f} MiB"] + [
                f"  {size / 2**20:9.1f} MiB in {count} blocks  {place}" for place, size, count in places]
        pytest.fail("\n".join(lines))
    assert bench_train.leftover_after_steps(step) == 0, "each step keeps memory allocated"
