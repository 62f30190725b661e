"""A training step's memory on the GPU: forward + backward of the experts (``benchmarks/bench_train.py``'s step, the
benchmark's shapes at M = 1024, where the margins are thinnest).

* Its steady-state peak (a second step's) stays within a budget: the two weight gradients plus 2.3 times the bytes
  of one row of the gate/up and of the down projection per copy (the step holds its pre-activation gradient, the
  gathered operands of the weight gradient and the row gradients at once). The weight gradient's operands in the
  alignment's padded slot order (before 2026-11-28) took Qwen3's step to 3.6 times: this would have caught it.
* It gives bitwise the same gradients twice and keeps nothing allocated from one step to the next, nor in reference
  cycles that only Python's cycle collector frees (counted after a collection: before, the blocks of earlier tests'
  cycles moved the count by gigabytes either way).
* Against ``torch._grouped_mm`` + autograd's step (the issue's promise: at most its peak), a known gap: its first call
  in a process peaks higher than its later ones, and moeforge's steady state is above torch's at these shapes
  (docs/notes/kernels-log.md, "A training step's memory: first and later steps"). Marked as expected to fail until
  the step needs less; it prints what was live at both peaks.
"""

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

SHAPE_NAMES = ["qwen3", "gptoss", "deepseek", "mixtral"]
TOKENS = 1024
ROW_BUDGET = 2.3  # a step's bytes beyond the weight gradients, in per-copy rows of the two projections


def _cell(shape: str) -> tuple[mf.MoELayer, torch.Tensor, mf.payloads.TopKOutput, torch.Tensor]:
    experts, top_k, hidden, inter = SHAPES[shape]
    torch.manual_seed(0)
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
    topk = mf.stages.select_experts(torch.randn(TOKENS, experts, device="cuda"), top_k, layer.routing)
    grad = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
    return layer, x, topk, grad


def _breakdown(label: str, fn: object) -> list[str]:
    peak, places = bench_train.memory_breakdown(fn)  # type: ignore[arg-type]
    return [f"{label} traced peak {peak / 2**20:.1f} MiB"] + [
        f"  {size / 2**20:9.1f} MiB in {count} blocks  {place}" for place, size, count in places]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", SHAPE_NAMES)
def test_a_training_step_stays_within_its_memory_budget_and_repeats_itself(shape: str) -> None:
    layer, x, topk, grad = _cell(shape)
    experts, top_k, hidden, inter = SHAPES[shape]
    step = bench_train.moeforge_step(layer, x, topk, grad)
    later, stable = bench_train.step_memory_and_determinism(step)
    assert stable, "two steps gave different gradients"
    weight_grads = (layer.w13_weight.numel() + layer.w2_weight.numel()) * 2
    rows = TOKENS * top_k * (hidden + 2 * inter) * 2
    budget = weight_grads + ROW_BUDGET * rows
    if later > budget:
        pytest.fail("\n".join([f"{shape}: {later / 2**20:.0f} MiB, over the budget of {budget / 2**20:.0f} MiB "
                               f"({weight_grads / 2**20:.0f} MiB of weight gradients + {ROW_BUDGET} x "
                               f"{rows / 2**20:.0f} MiB of rows)"] + _breakdown("moeforge", step)))
    assert bench_train.leftover_after_steps(step) == 0, "each step keeps memory allocated"
    assert bench_train.storages_in_cycles(step) == [], "a step leaves tensors in reference cycles"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.xfail(reason="steady state above torch._grouped_mm + autograd's at these cells (issue 39, kernels log)",
                   strict=False)
@pytest.mark.parametrize("shape", SHAPE_NAMES)
def test_a_training_step_takes_at_most_the_memory_of_grouped_mm(shape: str) -> None:
    layer, x, topk, grad = _cell(shape)
    step = bench_train.moeforge_step(layer, x, topk, grad)
    theirs_step = bench_train.grouped_mm_step(layer, x, topk, grad)
    ours, _ = bench_train.step_memory_and_determinism(step)
    theirs, _ = bench_train.step_memory_and_determinism(theirs_step)
    if ours > theirs:  # what was live at each peak, by the line that allocated it
        pytest.fail("\n".join([f"{shape}: {ours / 2**20:.0f} MiB against torch._grouped_mm's {theirs / 2**20:.0f} MiB"]
                              + _breakdown("moeforge", step) + _breakdown("grouped_mm", theirs_step)))
