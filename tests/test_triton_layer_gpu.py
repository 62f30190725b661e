"""The triton backend inside ``MoELayer`` on a CUDA device: parity with the torch backend and the
dense reference, CUDA-graph capture, ``torch.compile``. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import moeforge as mf
from moeforge.reference import layer_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _layer(dtype: torch.dtype = torch.bfloat16, experts: int = 16, top_k: int = 4, **kwargs: object) -> mf.MoELayer:
    """Sizes that are not multiples of 16 (H=200, I=136), so masked loads are exercised."""
    torch.manual_seed(0)
    kwargs.setdefault("environ", {})
    return mf.MoELayer(experts, top_k, 200, 136, dtype=dtype, device="cuda", **kwargs)  # type: ignore[arg-type]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def test_auto_backend_is_triton_on_cuda() -> None:
    layer = _layer()
    assert layer.backend is mf.Backend.TRITON
    assert "AlignDispatch" in layer.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [0, 1, 7, 333])
def test_triton_layer_matches_reference_and_torch_backend(dtype: torch.dtype, tokens: int) -> None:
    layer = _layer(dtype, shared_experts=mf.SharedExpertsConfig(64, gate=mf.SharedGate.SIGMOID))
    torch_layer = _layer(dtype, backend="torch", shared_experts=mf.SharedExpertsConfig(64, gate=mf.SharedGate.SIGMOID))
    torch_layer.load_state_dict(layer.state_dict())
    x = torch.randn(tokens, 200, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = layer(x)
        assert out.shape == x.shape
        if tokens:
            ref = layer_reference(layer, x)
            assert _rel(out, ref) < TOL[dtype]
            assert _rel(out, torch_layer(x).double()) < TOL[dtype] * 2


@pytest.mark.parametrize("preset", ["deepseek", "gpt-oss", "pending-scale"])
def test_triton_layer_family_routing(preset: str) -> None:
    if preset == "deepseek":
        kwargs = dict(routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4,
                                               topk_group=2, routed_scaling_factor=2.5, router_in_fp32=True))
    elif preset == "gpt-oss":
        kwargs = dict(routing=mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE, router_bias=True,
                                               apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE),
                      activation=mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU,
                                                     gate_up=mf.GateUpLayout.INTERLEAVED),
                      expert_bias=True)
    else:
        kwargs = dict(routing=mf.RoutingConfig(routed_scaling_factor=1.5, scaling_in_weights=False))
    layer = _layer(**kwargs)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "bias" in name:
                param.normal_()
        if hasattr(layer, "e_score_correction_bias"):
            layer.e_score_correction_bias.normal_(std=0.1)
        x = torch.randn(65, 200, device="cuda", dtype=torch.bfloat16)
        out = layer(x)
        assert _rel(out, layer_reference(layer, x)) < TOL[torch.bfloat16]


def test_every_token_on_one_expert_and_idle_experts() -> None:
    layer = _layer(experts=16, top_k=1, router=False)
    x = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
    logits = torch.full((300, 16), -4.0, device="cuda")
    logits[:, 11] = 4.0
    with torch.no_grad():
        assert _rel(layer(x, logits), layer_reference(layer, x, logits)) < TOL[torch.bfloat16]


def test_cuda_graph_replay_equals_eager() -> None:
    layer = _layer()
    x = torch.randn(48, 200, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer(x))
        assert not torch.equal(out, eager)


def test_torch_compile_of_the_layer() -> None:
    layer = _layer()
    x = torch.randn(32, 200, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)  # the README promises one graph
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_deterministic_across_calls() -> None:
    layer = _layer()
    x = torch.randn(1000, 200, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        first = layer(x)
        for _ in range(3):
            assert torch.equal(layer(x), first)


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
def test_a_torch_layout_dispatcher_runs_torch_experts_and_is_a_clear_error_on_the_triton_backend(
        dispatcher: str) -> None:
    # backend="auto": the fastest experts that read these rows, the torch ones; describe() says why
    # the triton experts were skipped.
    layer = _layer(dispatcher=dispatcher)
    assert layer.backend is mf.Backend.TORCH
    assert "skipped TritonUnquantizedExperts: no dispatcher delivers its rows" in layer.describe()
    with pytest.raises(mf.InputError, match="dispatcher='auto'"):
        _layer(dispatcher=dispatcher, backend="triton")


def test_weights_on_the_input_run_and_train_on_the_triton_path() -> None:
    # Llama-4's placement: the block-aligned dispatch scales each copy's row (rows in copy order; a training step's
    # rows in slot order at 4096 tokens), the combine sums unweighted; every gradient as the torch layer's.
    routing = mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE, scoring=mf.Scoring.SIGMOID,
                               renormalize=False, apply_weights=mf.RoutingWeights.ON_INPUT)
    for top_k, tokens in ((1, 9), (2, 4096)):
        layer = _layer(top_k=top_k, routing=routing)
        assert layer.backend is mf.Backend.TRITON and "weights on input" in layer.describe()
        torch_layer = _layer(top_k=top_k, routing=routing, backend="torch")
        torch_layer.load_state_dict(layer.state_dict())
        x = torch.randn(tokens, 200, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert _rel(layer(x), layer_reference(layer, x)) < TOL[torch.bfloat16]
        grad = torch.randn_like(x)
        for name, got, want in zip(["x", *dict(layer.named_parameters())], _grads(layer, x, grad),
                                   _grads(torch_layer, x, grad)):
            assert _rel(got, want.double()) < 2 * TOL[torch.bfloat16], name


def _grads(layer: mf.MoELayer, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    rows = x.clone().requires_grad_()
    return list(torch.autograd.grad(layer(rows), [rows, *layer.parameters()], grad))
