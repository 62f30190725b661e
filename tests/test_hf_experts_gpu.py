"""``experts_implementation="moeforge"`` on a CUDA device: the triton experts (the selector's choice under
``backend="auto"``) give the eager experts' logits and greedy tokens. Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from moeforge import hf_experts  # noqa: E402
from test_hf_experts import build, experts_modules, greedy, logits, rel_err, tokens  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def function() -> hf_experts.ExpertsFunction:
    return hf_experts.register()


def _on_gpu(name: str, dtype: torch.dtype) -> Any:
    return build(name).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("name", FAMILIES)
def test_triton_experts_match_eager_in_fp32(name: str, function: hf_experts.ExpertsFunction) -> None:
    model = _on_gpu(name, torch.float32)
    ids = tokens().cuda()
    want, margin = greedy(model, ids, 6)
    want_logits = logits(model, ids)
    assert margin > 1e-4, f"test data: a near tie at some step (gap {margin:.2e})"
    model.set_experts_implementation("moeforge")
    got_logits = logits(model, ids)
    assert rel_err(got_logits, want_logits) <= 1e-5
    got, _ = greedy(model, ids, 6)
    assert torch.equal(got, want)
    for module in experts_modules(model):
        pipelines = function.pipelines_for(module)
        assert len(pipelines) == 1
        text = pipelines[0].describe()
        assert "backend triton" in text and "FusedGroupedGemm" in text and "AlignDispatch" in text


@pytest.mark.parametrize("name", FAMILIES)
def test_triton_experts_in_bf16_are_as_accurate_as_eager(name: str, function: hf_experts.ExpertsFunction) -> None:
    exact = logits(_on_gpu(name, torch.float32), tokens().cuda())
    model = _on_gpu(name, torch.bfloat16)
    ids = tokens().cuda()
    eager = logits(model, ids)
    for implementation in ("moeforge", "eager", "moeforge"):  # back and forth on one model
        model.set_experts_implementation(implementation)
        got = logits(model, ids)
        assert rel_err(got, exact) <= 1.25 * rel_err(eager, exact)
        assert rel_err(got, eager) <= (0 if implementation == "eager" else 2e-2)
