"""Backward through the torch backend.

* ``torch.autograd.gradcheck`` in float64 on tiny shapes — the hidden states, the router (weight, bias)
  or given router logits, the expert weights and biases, the shared experts — for every routing,
  activation, dispatcher and placement of the routing weights: each option against a default, and random
  combinations drawn by hypothesis;
* the same gradients against those of the dense float64 reference (:mod:`moeforge.reference`, which has
  no dispatch, grouped GEMM or combine), empty and one-token batches and all tokens on one expert included;
  float32 and bf16 layers against it within their tolerance;
* float64 layers only where every stage computes float64: a quantized method, the triton backend and the
  triton stages refuse them with a clear error.

Quantized methods are inference-only: ``tests/test_inference_only.py``; expert parallelism:
``tests/test_distributed_gradients.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import moeforge as mf
from moeforge.errors import BackendUnavailableError
from moeforge.reference import layer_reference
from moeforge.stages.dispatch import Overflow, PaddedDispatch

E, K, H, I, T = 4, 2, 4, 3, 5
RW = mf.RoutingWeights

ROUTINGS = {
    "softmax": mf.RoutingConfig(),
    "softmax-unnormalised": mf.RoutingConfig(renormalize=False),
    "sigmoid-bias-groups-factor-in-combine": mf.RoutingConfig(
        scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        scaling_in_weights=False),
    "sigmoid-groups-by-max-factor-in-weights": mf.RoutingConfig(
        scoring=mf.Scoring.SIGMOID, n_group=2, topk_group=1, group_score=mf.GroupScore.MAX, group_mask_value=0.0,
        routed_scaling_factor=1.5),
    "select-then-softmax": mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE),
    "select-then-sigmoid": mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE, scoring=mf.Scoring.SIGMOID),
    "sparsemixer": mf.RoutingConfig(sparsemixer_eps=0.3),
    "router-bias-in-fp32": mf.RoutingConfig(router_bias=True, router_in_fp32=True),
}
ACT = mf.ActivationKind
ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "swiglu-interleaved": mf.ActivationConfig(ACT.SWIGLU, mf.GateUpLayout.INTERLEAVED),
    "geglu": mf.ActivationConfig(ACT.GEGLU),
    "geglu-tanh": mf.ActivationConfig(ACT.GEGLU, gelu_approximate="tanh"),
    # A small limit, so that both clamps bind on some elements (their gradient is zero there).
    "gpt-oss": mf.ActivationConfig(ACT.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED, limit=0.8),
    "silu": mf.ActivationConfig(ACT.SILU),
    "gelu": mf.ActivationConfig(ACT.GELU),
    "relu2": mf.ActivationConfig(ACT.RELU2),
    "identity": mf.ActivationConfig(ACT.IDENTITY),
}
SHARED = {
    "plain": mf.SharedExpertsConfig(3),
    "sigmoid-gate-bias": mf.SharedExpertsConfig(2, gate=mf.SharedGate.SIGMOID, bias=True),
    "geglu": mf.SharedExpertsConfig(2, activation=mf.ActivationConfig(ACT.GEGLU)),
}


def _padded_drop(placement: mf.RoutingWeights) -> PaddedDispatch:
    # Capacity 2 for 5 tokens x 2 copies over 4 experts: copies are dropped, and pass no gradient.
    return PaddedDispatch(E, capacity=2, overflow=Overflow.DROP, apply_routing_weights=placement is RW.ON_INPUT)


DISPATCHERS: dict[str, Callable[[mf.RoutingWeights], Any]] = {
    "sorted": lambda _: "sorted", "padded": lambda _: "padded", "padded-drop": _padded_drop}


def _randomised(layer: mf.MoELayer, seed: int) -> mf.MoELayer:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.7)
        for buffer in layer.buffers():  # the selection bias: big enough to change the selection
            buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=torch.float64) * 0.3)
    return layer


def make_layer(dtype: torch.dtype = torch.float64, *, seed: int = 0, num_experts: int = E, top_k: int = K,
               placement: Optional[mf.RoutingWeights] = None, **kwargs: Any) -> mf.MoELayer:
    """A tiny torch-backend layer with random values in every parameter and buffer."""
    if placement is not None:
        routing = kwargs.pop("routing", mf.RoutingConfig())
        kwargs["routing"] = mf.RoutingConfig(**{**_fields(routing), "apply_weights": placement})
    layer = mf.MoELayer(num_experts, top_k, H, I, dtype=dtype, backend="torch", environ={}, **kwargs)
    return _randomised(layer, seed)


def _fields(config: mf.RoutingConfig) -> dict[str, Any]:
    return attrs.asdict(config, recurse=False)


def _tokens(count: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def gradcheck(layer: mf.MoELayer, tokens: int = T, *, with_logits: bool = False) -> None:
    """``torch.autograd.gradcheck`` of the layer's output with respect to its inputs (the hidden states,
    and the router logits when given) and every parameter."""
    names = [name for name, _ in layer.named_parameters()]
    params = [param.detach().clone().requires_grad_() for _, param in layer.named_parameters()]
    inputs = [_tokens(tokens).to(layer.device).requires_grad_()]
    if with_logits:
        gen = torch.Generator().manual_seed(2)
        logits = torch.randn(tokens, layer.num_experts, generator=gen, dtype=torch.float64)
        inputs.append(logits.to(layer.device).requires_grad_())

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        args, values = tensors[:len(inputs)], tensors[len(inputs):]
        out: torch.Tensor = functional_call(layer, dict(zip(names, values)), args)
        return out

    assert torch.autograd.gradcheck(forward, (*inputs, *params))


# -- gradcheck, one option at a time ---------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_gradcheck_every_routing(routing: str, dispatcher: str) -> None:
    gradcheck(make_layer(routing=ROUTINGS[routing], dispatcher=dispatcher))


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gradcheck_every_activation_with_expert_biases(activation: str) -> None:
    gradcheck(make_layer(activation=ACTIVATIONS[activation], expert_bias=True))


@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
@pytest.mark.parametrize("placement", [RW.IN_COMBINE, RW.ON_INPUT, RW.IN_GEMM_EPILOGUE], ids=lambda p: p.value)
def test_gradcheck_every_placement_of_the_routing_weights(placement: mf.RoutingWeights, dispatcher: str) -> None:
    gradcheck(make_layer(placement=placement, dispatcher=DISPATCHERS[dispatcher](placement), expert_bias=True))


@pytest.mark.parametrize("shared", list(SHARED))
def test_gradcheck_shared_experts(shared: str) -> None:
    gradcheck(make_layer(shared_experts=SHARED[shared]))


@pytest.mark.parametrize("top_k", [1, E])
def test_gradcheck_given_router_logits(top_k: int) -> None:
    gradcheck(make_layer(router=False, top_k=top_k), with_logits=True)


@pytest.mark.parametrize("tokens", [0, 1])
def test_gradcheck_tiny_batches(tokens: int) -> None:
    gradcheck(make_layer(expert_bias=True, shared_experts=SHARED["plain"]), tokens)


# -- random combinations ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True)
@given(routing=st.sampled_from(list(ROUTINGS)), activation=st.sampled_from(list(ACTIVATIONS)),
       dispatcher=st.sampled_from(list(DISPATCHERS)), placement=st.sampled_from([RW.IN_COMBINE, RW.ON_INPUT,
                                                                                  RW.IN_GEMM_EPILOGUE]),
       bias=st.booleans(), shared=st.sampled_from([None, *SHARED]), top_k=st.integers(1, E),
       seed=st.integers(0, 2**16))
def test_gradcheck_drawn_combinations(routing: str, activation: str, dispatcher: str, placement: mf.RoutingWeights,
                                      bias: bool, shared: Optional[str], top_k: int, seed: int) -> None:
    config = ROUTINGS[routing]
    if config.n_group is not None:
        top_k = min(top_k, E // config.n_group * config.topk_group)
    layer = make_layer(seed=seed, routing=config, activation=ACTIVATIONS[activation], placement=placement,
                       dispatcher=DISPATCHERS[dispatcher](placement), expert_bias=bias, top_k=top_k,
                       shared_experts=SHARED[shared] if shared is not None else None)
    gradcheck(layer)


# -- against the dense reference ---------------------------------------------------------------------------


def _grads(out: torch.Tensor, wrt: list[torch.Tensor], seed: int = 3) -> list[torch.Tensor]:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), wrt, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]


def _reference_grads(layer: mf.MoELayer, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of the layer and of its dense reference for the same loss, w.r.t. the hidden states and
    every parameter."""
    x = x.detach().requires_grad_()
    wrt = [x, *layer.parameters()]
    return _grads(layer(x), wrt), _grads(layer_reference(layer, x), wrt)


def _all_on_expert(layer: mf.MoELayer, expert: int) -> None:
    """Make the router send every token to ``expert`` (and the next ones) by a large router bias."""
    assert layer.router is not None and layer.router.bias is not None
    with torch.no_grad():
        layer.router.weight.mul_(0.01)
        layer.router.bias.copy_(torch.linspace(0, -3, layer.num_experts).roll(expert).to(layer.router.bias.dtype))


@pytest.mark.parametrize("batch", ["empty", "one", "five", "all-on-expert-2"])
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("placement", [RW.IN_COMBINE, RW.ON_INPUT, RW.IN_GEMM_EPILOGUE], ids=lambda p: p.value)
def test_gradients_equal_the_dense_reference(placement: mf.RoutingWeights, dispatcher: str, batch: str) -> None:
    routing = mf.RoutingConfig(router_bias=True, scoring=mf.Scoring.SIGMOID, routed_scaling_factor=1.5,
                               scaling_in_weights=False)
    layer = make_layer(placement=placement, routing=routing, dispatcher=dispatcher, expert_bias=True,
                       shared_experts=SHARED["sigmoid-gate-bias"])
    if batch.startswith("all-on"):
        _all_on_expert(layer, 2)
    tokens = {"empty": 0, "one": 1, "five": 5, "all-on-expert-2": 6}[batch]
    got, want = _reference_grads(layer, _tokens(tokens))
    for name, g, w in zip(["hidden_states", *(n for n, _ in layer.named_parameters())], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", [RW.IN_COMBINE, RW.ON_INPUT, RW.IN_GEMM_EPILOGUE], ids=lambda p: p.value)
def test_training_dtypes_differentiate_like_the_reference(placement: mf.RoutingWeights, dtype: torch.dtype,
                                                          tolerance: float) -> None:
    layer = make_layer(dtype, placement=placement, expert_bias=True, shared_experts=SHARED["plain"],
                       num_experts=8, top_k=2)
    got, want = _reference_grads(layer, _tokens(32, dtype))
    for name, g, w in zip(["hidden_states", *(n for n, _ in layer.named_parameters())], got, want):
        assert g.dtype == dtype
        error = float((g.double() - w.double()).norm() / w.double().norm())
        assert error < tolerance, f"{name}: relative L2 error {error:.2e}"


def test_every_parameter_receives_a_gradient() -> None:
    layer = make_layer(routing=ROUTINGS["router-bias-in-fp32"], expert_bias=True,
                       shared_experts=SHARED["sigmoid-gate-bias"], placement=RW.IN_GEMM_EPILOGUE)
    layer(_tokens(T)).square().sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
def test_an_empty_batch_stays_in_the_graph(dispatcher: str) -> None:
    # Zero gradients, not a detached output: a data-parallel or expert-parallel rank without tokens runs the
    # same backward as the others.
    layer = make_layer(torch.float32, dispatcher=dispatcher, expert_bias=True, shared_experts=SHARED["plain"])
    out = layer(torch.empty(0, H, requires_grad=True))
    assert out.shape == (0, H) and out.requires_grad
    out.sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and not bool(param.grad.any()), name


def test_the_selection_bias_selects_but_takes_no_gradient() -> None:
    # DeepSeek's e_score_correction_bias only decides which experts are picked (a piecewise-constant
    # function): it is a buffer, and a bias tensor that requires grad gets none.
    bias = torch.tensor([0.5, -0.5, 0.0, 0.2], dtype=torch.float64, requires_grad=True)
    config = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True)
    topk = mf.TopK(E, K, config, selection_bias=bias)
    x = _tokens(T)
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    routed = topk(mf.MoEInput(x, logits))
    # Not the plain sum: renormalized weights sum to 1 whatever the logits (a zero gradient).
    (routed.topk.weights * torch.arange(1.0, K + 1, dtype=torch.float64)).sum().backward()
    assert bias.grad is None
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)
    assert "e_score_correction_bias" not in dict(make_layer(routing=config).named_parameters())


# -- float64 only where every stage computes it ------------------------------------------------------------


def test_a_float64_layer_computes_in_float64() -> None:
    layer = make_layer(expert_bias=True, shared_experts=SHARED["plain"])
    assert layer.pipeline.output_spec.dtype is mf.DType.FP64
    assert "dispatch fp64" in layer.describe() and "logits in fp64" in layer.describe()
    x = _tokens(T)
    # float64 end to end: the error against the float64 reference is float64 rounding, not float32's.
    assert float((layer(x) - layer_reference(layer, x)).detach().abs().max()) < 1e-12


def test_a_layer_follows_double_and_back() -> None:
    layer = make_layer(torch.float32)
    x = _tokens(T, torch.float32)
    want = layer(x)
    layer.double()
    assert layer.dtype == torch.float64 and layer.w13_weight.dtype == torch.float64
    assert layer.dispatch_decision.dtype is mf.DispatchDtype.FP64
    torch.testing.assert_close(layer(x.double()), want.double(), rtol=1e-5, atol=1e-5)
    layer.float()
    assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("method", [mf.Fp8W8A8Method, mf.Int8W8A8Method, mf.W4A16Method, mf.Mxfp4Method,
                                    mf.Nvfp4Method, mf.W4A4NpuMethod])
def test_a_quantized_method_refuses_float64(method: Callable[[], mf.QuantMethod]) -> None:
    quant = method()
    with pytest.raises(mf.InputError, match=rf"float64.*{type(quant).__name__}.*unquantized method"):
        mf.MoELayer(4, 2, 128, 128, quant=quant, dtype=torch.float64, environ={})


def test_a_quantized_layer_refuses_double_before_converting_anything() -> None:
    layer = mf.MoELayer(4, 2, 128, 128, quant=mf.Int8W8A8Method(), dtype=torch.float32, environ={})
    with pytest.raises(mf.InputError, match="float64.*Int8W8A8Method"):
        layer.double()
    assert layer.dtype == torch.float32 and layer.pipeline.output_spec.dtype is mf.DType.FP32
    assert layer.router is not None and layer.router.weight.dtype == torch.float32


def test_the_triton_backend_refuses_float64() -> None:
    with pytest.raises(BackendUnavailableError, match="float64.*backend='torch'"):
        mf.MoELayer(E, K, H, I, dtype=torch.float64, backend="triton", environ={})


def test_on_cuda_a_float64_layer_is_served_by_the_torch_roles() -> None:
    # The selector is a pure function of the configuration: what it picks on a CUDA device can be asked
    # on any machine (no kernel is built here).
    from moeforge.roles.base import LayerConfig
    from moeforge.selector import select

    from moeforge.dispatch_dtype import DispatchDecision, DispatchRule

    decision = DispatchDecision(mf.DispatchDtype.FP64, DispatchRule.LIBRARY_DEFAULT)
    config = LayerConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, routing=mf.RoutingConfig(),
                         activation=mf.ActivationConfig(), quant=mf.UnquantizedMethod(), dtype=torch.float64,
                         device=torch.device("cuda"), dispatch=decision)
    selection = select(config)
    assert selection.backend is mf.Backend.TORCH and selection.router.__name__ == "TorchRouter"
    assert any("not float64" in reason for name, reason in selection.skipped if name == "TritonUnquantizedExperts")


def test_the_triton_stages_refuse_float64_rows() -> None:
    pytest.importorskip("triton")
    from moeforge.stages.triton import TritonTopK

    spec = mf.input_spec(H, torch.float64, E)
    with pytest.raises(mf.ContractError, match="dtype") as info:
        mf.Pipeline([TritonTopK(E, K), mf.SortedDispatch(E)], spec)
    assert "TopK (torch)" in info.value.hint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_float64_layer_on_a_gpu_runs_and_differentiates_on_the_torch_stages() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float64, device="cuda", environ={}, expert_bias=True)
    assert layer.backend is mf.Backend.TORCH and "not float64" in layer.describe()
    x = _tokens(T).cuda()
    torch.testing.assert_close(layer(x), layer_reference(layer, x), rtol=1e-10, atol=1e-12)
    gradcheck(_randomised(layer, 0))
