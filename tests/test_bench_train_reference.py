"""``benchmarks/bench_train.py``'s two steps compute the same thing: the ``torch._grouped_mm`` + autograd baseline
equals the layer's experts on the torch backend — forward and every gradient the benchmark asks for, with and without
expert biases — so a speed-up it reports is against the same computation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_train  # noqa: E402

import moeforge as mf  # noqa: E402


def _cpu_grouped_mm_problem() -> str | None:
    """Why this torch cannot differentiate ``torch._grouped_mm`` on the CPU in the baseline's layout (``None``: it
    can)."""
    try:
        rows = torch.randn(8, 16, requires_grad=True)
        weight = torch.randn(2, 8, 16, requires_grad=True)
        out = torch._grouped_mm(rows, weight.transpose(1, 2), offs=torch.tensor([3, 8], dtype=torch.int32))
        torch.autograd.grad(out, [rows, weight], torch.randn_like(out))
    except (AttributeError, RuntimeError, NotImplementedError) as error:
        return f"torch._grouped_mm on the CPU: {error}"
    return None


@pytest.mark.skipif(_cpu_grouped_mm_problem() is not None, reason=str(_cpu_grouped_mm_problem()))
@pytest.mark.parametrize("expert_bias", [False, True], ids=["no bias", "expert biases"])
@pytest.mark.parametrize("weights_at", [mf.RoutingWeights.IN_COMBINE, mf.RoutingWeights.ON_INPUT],
                         ids=["weights in the combine", "weights on the input"])
def test_the_grouped_mm_baseline_is_the_layers_computation(expert_bias: bool, weights_at: mf.RoutingWeights) -> None:
    # (weights on the input: bench_train's llama4 shape, Llama-4's experts)
    torch.manual_seed(0)
    experts, top_k, hidden, inter, tokens = 4, 2, 32, 16, 24
    layer = mf.MoELayer(experts, top_k, hidden, inter, backend="torch", expert_bias=expert_bias,
                        routing=mf.RoutingConfig(apply_weights=weights_at))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(tokens, hidden)
    topk = mf.stages.select_experts(torch.randn(tokens, experts), top_k, layer.routing)
    grad = torch.randn(tokens, hidden)
    want_out, want_leaves = bench_train.moeforge_forward(layer, x, topk)()
    got_out, got_leaves = bench_train.grouped_mm_forward(layer, x, topk)()
    want = torch.autograd.grad(want_out, want_leaves, grad)
    got = torch.autograd.grad(got_out, got_leaves, grad)
    assert len(got_leaves) == len(want_leaves) == 4 + 2 * expert_bias
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_shape_is_named_or_written_out() -> None:
    # (--shapes of bench_moe, tune_moe, ab_tables, check_layers and bench_train: a model without a name here too)
    import bench_moe

    assert bench_moe.shape_of("llama4") == (16, 1, 5120, 8192)
    assert bench_moe.shape_of("64x8x2048x1024") == (64, 8, 2048, 1024)
    for bad in ("llama5", "64x8x2048", "8x64x2048x1024", "64x0x2048x1024", "64x8x-1x1024"):
        with pytest.raises(SystemExit, match="ExkxHxI"):
            bench_moe.shape_of(bad)
