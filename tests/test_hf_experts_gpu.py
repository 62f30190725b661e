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
def test_training_through_the_triton_experts_gives_the_eager_gradients(name: str,
                                                                       function: hf_experts.ExpertsFunction) -> None:
    """A fine-tuning step with ``experts_implementation="moeforge"`` runs the triton training path (the activation
    kept, the weight gradient on sorted rows, the combine's backward kernel): in fp32 every parameter gets the eager
    experts' gradient."""
    model = _on_gpu(name, torch.float32).train()
    ids = tokens().cuda()
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for implementation in ("eager", "moeforge"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["moeforge"].keys() == grads["eager"].keys()
    experts = [n for n in grads["eager"] if ".experts." in n]
    assert experts and all(bool(grads["moeforge"][n].abs().sum() > 0) for n in experts)
    for n, want in grads["eager"].items():
        assert rel_err(grads["moeforge"][n], want) <= 1e-4, n
    for module in experts_modules(model):
        assert "FusedGroupedGemm" in function.pipelines_for(module)[0].describe()


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


def test_fp8_experts_on_the_triton_kernels_match_the_torch_stages(function: hf_experts.ExpertsFunction) -> None:
    """The same FP8Experts module on the CPU (moeforge's torch W8A8 stages) and on the GPU (its triton FP8
    kernels, the activations quantized per 128-group before the dispatch)."""
    from test_hf_experts import _fp8_experts

    module, _ = _fp8_experts()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(37, 256, generator=gen).to(torch.bfloat16)
    ids = torch.rand(37, 4, generator=gen).argsort(-1)[:, :2]
    weights = torch.rand(37, 2, generator=gen).to(torch.bfloat16)
    want = module(hidden, ids, weights)
    module.cuda()
    got = module(hidden.cuda(), ids.cuda(), weights.cuda())
    # The two paths quantize the activated rows from differently rounded values (the kernel from bf16 rows):
    # the few values at an e4m3 rounding boundary land a step apart (one step is 6 %).
    assert rel_err(got.cpu(), want) < 3e-2
    (pipeline,) = function.pipelines_for(module)[-1:]
    assert "experts TritonW8A8Experts" in pipeline.describe()
