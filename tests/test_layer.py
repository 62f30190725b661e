"""MoELayer against the float64 dense oracle (``moeforge.reference.layer_reference``), edge cases,
rebuilding, and bad input (every error names the argument)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Optional

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.payloads import ExpertRows
from moeforge.reference import dense_moe, layer_reference
from moeforge.spec import FLOAT_DTYPES

E, K, H, I = 8, 2, 32, 16
T = 24
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16]
DISPATCHERS = ["sorted", "padded"]
RW = mf.RoutingWeights


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def make_layer(num_experts: int = E, top_k: int = K, hidden: int = H, inter: int = I, *,
               seed: int = 0, **kwargs: Any) -> mf.MoELayer:
    """A layer with random non-zero values in every parameter and buffer (biases included)."""
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("environ", {})
    layer = mf.MoELayer(num_experts, top_k, hidden, inter, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        fan_in = param.shape[-1] if param.dim() > 1 else hidden
        param.copy_(torch.randn(param.shape, generator=gen) * fan_in**-0.5)
    if hasattr(layer, "e_score_correction_bias"):
        layer.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.1)
    return layer


def inputs(layer: mf.MoELayer, *shape: int, seed: int = 1) -> torch.Tensor:
    shape = shape or (T,)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, layer.hidden_size, generator=gen).to(layer.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def assert_matches_reference(layer: mf.MoELayer, x: torch.Tensor,
                             logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = layer(x) if logits is None else layer(x, logits)
    assert out.shape == x.shape and out.dtype == layer.dtype
    assert bool(torch.isfinite(out).all())
    ref = layer_reference(layer, x, logits)
    if x.numel():
        assert float(ref.norm()) > 0
        error = rel_err(out, ref)
        assert error < TOLERANCE[layer.dtype], f"relative error {error:.2e}"
    return out


# -- against the reference --------------------------------------------------------------------------

ACTIVATIONS = [
    mf.ActivationConfig(mf.ActivationKind.SWIGLU),
    mf.ActivationConfig(mf.ActivationKind.SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    mf.ActivationConfig(mf.ActivationKind.GEGLU),
    mf.ActivationConfig(mf.ActivationKind.GEGLU, gelu_approximate="tanh"),
    mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, alpha=1.0, limit=0.5),  # the clamp bites
    mf.ActivationConfig(mf.ActivationKind.CLAMPED_SWIGLU, limit=0.5),  # DeepSeek-V4's, HY-V4's
    mf.ActivationConfig(mf.ActivationKind.SOFTCAPPED_SWIGLU, gate_softcap=0.5, up_softcap=0.75),  # Inkling2's, biting
    mf.ActivationConfig(mf.ActivationKind.SILU),
    mf.ActivationConfig(mf.ActivationKind.GELU),
    mf.ActivationConfig(mf.ActivationKind.RELU2),
]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.summary().replace(" ", ""))
def test_activations_match_reference(dtype: torch.dtype, dispatcher: str,
                                     activation: mf.ActivationConfig) -> None:
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, activation=activation)
    assert_matches_reference(layer, inputs(layer))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("apply_weights", [RW.IN_COMBINE, RW.ON_INPUT, RW.IN_GEMM_EPILOGUE])
def test_expert_biases_and_where_routing_weights_are_applied(
    dtype: torch.dtype, dispatcher: str, apply_weights: mf.RoutingWeights
) -> None:
    routing = mf.RoutingConfig(apply_weights=apply_weights)
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, routing=routing, expert_bias=True,
                       activation=mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU,
                                                      gate_up=mf.GateUpLayout.INTERLEAVED))
    assert layer.w13_bias is not None and float(layer.w13_bias.abs().sum()) > 0
    assert_matches_reference(layer, inputs(layer))
    assert layer.pipeline.output_spec.routing_weights is apply_weights


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("apply_weights", [RW.ON_INPUT, RW.IN_GEMM_EPILOGUE])
def test_where_the_weights_are_applied_is_visible_and_changes_the_result(
    dispatcher: str, apply_weights: mf.RoutingWeights
) -> None:
    layer = make_layer(dispatcher=dispatcher, routing=mf.RoutingConfig(apply_weights=apply_weights),
                       expert_bias=True)
    combine = make_layer(dispatcher=dispatcher, expert_bias=True)
    x = inputs(layer)
    text = layer.describe()
    assert ("weights on input" if apply_weights is RW.ON_INPUT else "weights in epilogue") in text
    assert "Combine(unweighted" in text and "Combine(weighted" in combine.describe()
    out, baseline = layer(x), combine(x)
    if apply_weights is RW.ON_INPUT:  # a nonlinear expert: scaling the input is not scaling the output
        assert rel_err(out, baseline) > 1e-3
    else:  # the epilogue scales the same rows the combine would: identical up to rounding
        assert rel_err(out, baseline) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", [None, mf.SharedGate.NONE, mf.SharedGate.SIGMOID])
@pytest.mark.parametrize("bias", [False, True])
def test_shared_experts(dtype: torch.dtype, gate: Optional[mf.SharedGate], bias: bool) -> None:
    shared = None if gate is None else mf.SharedExpertsConfig(intermediate_size=24, gate=gate, bias=bias)
    layer = make_layer(dtype=dtype, shared_experts=shared)
    out = assert_matches_reference(layer, inputs(layer))
    if shared is None:
        assert layer.shared_experts is None
    else:
        assert layer.shared_experts is not None
        assert (layer.shared_experts.gate is not None) == (gate is mf.SharedGate.SIGMOID)
        routed_only = layer.pipeline(mf.MoEInput(inputs(layer), layer.router_logits(inputs(layer))))
        assert rel_err(out, routed_only.hidden_states) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", [mf.Scoring.SOFTMAX, mf.Scoring.SIGMOID])
@pytest.mark.parametrize("folded", [True, False])
def test_routed_scaling_factor_folded_or_pending(dtype: torch.dtype, scoring: mf.Scoring,
                                                 folded: bool) -> None:
    routing = mf.RoutingConfig(scoring=scoring, routed_scaling_factor=2.5, scaling_in_weights=folded)
    layer = make_layer(dtype=dtype, routing=routing)
    out = assert_matches_reference(layer, inputs(layer))
    combine = layer.pipeline.stages[-1]
    assert isinstance(combine, mf.Combine)
    assert combine.routed_scaling_factor == (None if folded else 2.5)
    assert ("x2.5" in combine.summary()) != folded
    unscaled = make_layer(dtype=dtype, routing=mf.RoutingConfig(scoring=scoring))
    tolerance = TOLERANCE[dtype]
    assert rel_err(out, 2.5 * unscaled(inputs(layer)).double()) < max(tolerance, 1e-6) * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("group_score", [mf.GroupScore.SUM_TOP2, mf.GroupScore.MAX])
@pytest.mark.parametrize("folded", [True, False])
def test_deepseek_like_layer(dtype: torch.dtype, dispatcher: str, group_score: mf.GroupScore,
                             folded: bool) -> None:
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, renormalize=True, selection_bias=True,
                               n_group=4, topk_group=2, group_score=group_score, routed_scaling_factor=2.5,
                               scaling_in_weights=folded, router_in_fp32=True)
    layer = make_layer(16, 4, 64, 16, dtype=dtype, dispatcher=dispatcher, routing=routing,
                       shared_experts=mf.SharedExpertsConfig(intermediate_size=32))
    x = inputs(layer, 32)
    assert_matches_reference(layer, x)
    assert "selection bias" in layer.describe() and "groups 2/4" in layer.describe()
    # the selection bias changes which experts are chosen (it is used, not ignored)
    routed = layer.pipeline.stages[0](mf.MoEInput(x, layer.router_logits(x)))
    layer.e_score_correction_bias.zero_()
    unbiased = layer.pipeline.stages[0](mf.MoEInput(x, layer.router_logits(x)))
    assert not torch.equal(routed.topk.ids, unbiased.topk.ids)
    # only experts of the two chosen groups of 4 are selected
    groups = routed.topk.ids.long() // 4
    assert all(len(set(row)) <= 2 for row in groups.tolist())


@pytest.mark.parametrize("router_in_fp32", [False, True])
def test_router_in_fp32(router_in_fp32: bool) -> None:
    layer = make_layer(dtype=torch.bfloat16, routing=mf.RoutingConfig(router_in_fp32=router_in_fp32,
                                                                       router_bias=True))
    x = inputs(layer)
    logits = layer.router_logits(x)
    assert logits.dtype == (torch.float32 if router_in_fp32 else torch.bfloat16)
    assert layer.router is not None and layer.router.bias is not None
    expected = F.linear(x.float(), layer.router.weight.float(), layer.router.bias.float())
    if router_in_fp32:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert_matches_reference(layer, x)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_router_false_needs_explicit_router_logits(dispatcher: str) -> None:
    layer = make_layer(router=False, dispatcher=dispatcher)
    assert layer.router is None
    x = inputs(layer)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(5))
    assert_matches_reference(layer, x, logits)
    with pytest.raises(mf.InputError, match="router_logits"):
        layer(x)


def test_explicit_router_logits_override_the_router() -> None:
    layer = make_layer()
    x = inputs(layer)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(6))
    out = assert_matches_reference(layer, x, logits)
    assert rel_err(out, layer(x)) > 1e-3
    # bf16 / fp16 logits are accepted too
    assert_matches_reference(layer, x, logits.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_batch_seq_hidden_input(dtype: torch.dtype, dispatcher: str) -> None:
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, shared_experts=mf.SharedExpertsConfig(16))
    x = inputs(layer, 3, 5)
    assert x.shape == (3, 5, H)
    out = assert_matches_reference(layer, x)
    flat = layer(x.reshape(15, H))
    torch.testing.assert_close(out.reshape(15, H), flat, rtol=0, atol=0)
    logits = torch.randn(3, 5, E, generator=torch.Generator().manual_seed(7))
    out3 = assert_matches_reference(layer, x, logits.to(dtype))
    torch.testing.assert_close(out3.reshape(15, H), layer(x.reshape(15, H), logits.reshape(15, E).to(dtype)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dispatcher", DISPATCHERS + ["cumsum"])
def test_debug_mode_gives_the_same_result(dispatcher: str) -> None:
    choice: Any = mf.SortedDispatch(E, group_list_type=mf.GroupListType.CUMSUM) if dispatcher == "cumsum" \
        else dispatcher
    layer = make_layer(dispatcher=choice)
    debug = make_layer(dispatcher=choice, debug=True)
    assert debug.pipeline.debug and not layer.pipeline.debug
    x = inputs(layer)
    torch.testing.assert_close(debug(x), layer(x), rtol=0, atol=0)
    assert_matches_reference(debug, x)


# -- edge cases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)], ids=["T=0", "B=2,S=0", "B=0,S=3"])
def test_empty_batch(dtype: torch.dtype, dispatcher: str, shape: tuple[int, ...]) -> None:
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, debug=True,
                       shared_experts=mf.SharedExpertsConfig(16, gate=mf.SharedGate.SIGMOID))
    x = inputs(layer, *shape)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert layer(x, torch.empty(*shape, E, dtype=dtype)).shape == x.shape
    assert_matches_reference(layer, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_one_token(dtype: torch.dtype, dispatcher: str) -> None:
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, debug=True)
    assert_matches_reference(layer, inputs(layer, 1))
    assert_matches_reference(layer, inputs(layer, 1, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_experts_with_no_tokens(dtype: torch.dtype, dispatcher: str) -> None:
    layer = make_layer(dtype=dtype, dispatcher=dispatcher, debug=True, expert_bias=True)
    x = inputs(layer)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(8))
    logits[:, [0, 5, 7]] = -30.0  # experts 0, 5 and 7 are never chosen
    routed = layer.pipeline.stages[0](mf.MoEInput(x, logits.to(dtype)))
    counts = torch.bincount(routed.topk.ids.reshape(-1).long(), minlength=E)
    assert counts[[0, 5, 7]].tolist() == [0, 0, 0] and int(counts.sum()) == T * K
    assert_matches_reference(layer, x, logits.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_on_the_same_experts(dtype: torch.dtype, dispatcher: str, top_k: int) -> None:
    layer = make_layer(top_k=top_k, dtype=dtype, dispatcher=dispatcher, debug=True)
    x = inputs(layer)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(9))
    logits[:, 3] = 20.0
    logits[:, 6] = 10.0
    routed = layer.pipeline.stages[0](mf.MoEInput(x, logits.to(dtype)))
    assert set(routed.topk.ids.reshape(-1).tolist()) == ({3} if top_k == 1 else {3, 6})
    out = assert_matches_reference(layer, x, logits.to(dtype))
    if top_k == 1:  # one expert with weight 1: exactly that expert's MLP
        expert = F.silu(x.double() @ layer.w13_weight[3, :I].double().t()) * (
            x.double() @ layer.w13_weight[3, I:].double().t())
        expected = expert @ layer.w2_weight[3].double().t()
        assert rel_err(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("num_experts", [1, 4])
def test_top_k_equals_num_experts(dtype: torch.dtype, dispatcher: str, num_experts: int) -> None:
    layer = make_layer(num_experts, num_experts, dtype=dtype, dispatcher=dispatcher, debug=True)
    x = inputs(layer)
    out = assert_matches_reference(layer, x)
    # every expert sees every token: the router only sets the weights
    routed = layer.pipeline.stages[0](mf.MoEInput(x, layer.router_logits(x)))
    assert sorted(routed.topk.ids[0].tolist()) == list(range(num_experts))
    assert out.shape == x.shape


def test_tied_router_logits_are_deterministic() -> None:
    layer = make_layer(dispatcher="padded", debug=True)
    x = inputs(layer)
    logits = torch.zeros(T, E)  # every expert ties: the lowest indices win
    routed = layer.pipeline.stages[0](mf.MoEInput(x, logits))
    assert routed.topk.ids.tolist() == [[0, 1]] * T
    out = assert_matches_reference(layer, x, logits)
    torch.testing.assert_close(layer(x, logits), out, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(
    num_experts=st.integers(1, 8),
    data=st.data(),
    hidden=st.sampled_from([8, 16, 40]),
    inter=st.sampled_from([4, 8, 12]),
    tokens=st.integers(0, 12),
    dispatcher=st.sampled_from(DISPATCHERS),
    kind=st.sampled_from(list(mf.ActivationKind)),
    apply_weights=st.sampled_from([RW.IN_COMBINE, RW.ON_INPUT, RW.IN_GEMM_EPILOGUE]),
    bias=st.booleans(),
    scoring=st.sampled_from(list(mf.Scoring)),
    order=st.sampled_from(list(mf.ScoreOrder)),
    seed=st.integers(0, 2**16),
)
def test_random_layers_match_reference(
    num_experts: int, data: st.DataObject, hidden: int, inter: int, tokens: int, dispatcher: str,
    kind: mf.ActivationKind, apply_weights: mf.RoutingWeights, bias: bool, scoring: mf.Scoring,
    order: mf.ScoreOrder, seed: int,
) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    routing = mf.RoutingConfig(scoring=scoring, order=order, apply_weights=apply_weights)
    layer = make_layer(num_experts, top_k, hidden, inter, seed=seed, dispatcher=dispatcher,
                       routing=routing, activation=mf.ActivationConfig(kind), expert_bias=bias)
    with torch.no_grad():
        assert_matches_reference(layer, inputs(layer, tokens, seed=seed + 1))


# -- describe, replace_stage, rebuild ----------------------------------------------------------------


def test_describe_contains_the_dispatch_decision() -> None:
    layer = make_layer(dtype=torch.bfloat16)
    text = layer.describe()
    assert layer.dispatch_decision.explain() in text
    assert "dispatch bf16 (rule 6: library default)" in text
    assert "backend torch" in text
    for stage in layer.pipeline.stages:
        assert stage.summary() in text
    explicit = make_layer(dtype=torch.float32, dispatch_dtype="fp16")
    assert "dispatch fp16 (rule 1: explicit setting)" in explicit.describe()
    assert "QuantizeTokens(fp16)" in explicit.describe()
    assert "rule 1" in repr(explicit)


@attrs.frozen(eq=False)
class ClampedSwiGLU(mf.Stage[ExpertRows, ExpertRows]):
    """A user activation: SwiGLU with the gate clamped (a variant the library does not ship)."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)
    limit: float = 1e9

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        gate, up = x.x.data.float().chunk(2, dim=-1)
        out = F.silu(gate.clamp(max=self.limit)) * up
        return x.with_x(mf.Activations(out.to(x.x.data.dtype)))


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_replace_stage_on_a_layer(dispatcher: str) -> None:
    layer = make_layer(dispatcher=dispatcher)
    x = inputs(layer)
    before = layer(x)
    old_pipeline = layer.pipeline

    layer.replace_stage("Activate", ClampedSwiGLU())  # same math: same result
    assert layer.pipeline is not old_pipeline and "ClampedSwiGLU" in layer.describe()
    torch.testing.assert_close(layer(x), before, rtol=1e-6, atol=1e-6)

    geglu = mf.ActivationConfig(mf.ActivationKind.GEGLU)
    layer.replace_stage(-3, mf.Activate(geglu))
    routed = dense_moe(x, layer.router_logits(x), top_k=K, w13=layer.w13_weight, w2=layer.w2_weight,
                       routing=layer.routing, activation=geglu)
    assert rel_err(layer(x), routed) < 1e-5

    current = layer.pipeline
    with pytest.raises(mf.ContractError) as info:
        layer.replace_stage("Combine", mf.Combine(apply_routing_weights=False))
    assert info.value.consumer == "stage 5 (Combine)"
    with pytest.raises(mf.ContractError):
        layer.replace_stage("Activate", mf.Activate(mf.ActivationConfig(mf.ActivationKind.SILU)))
    assert layer.pipeline is current  # a failed replacement leaves the layer as it was


def test_process_weights_after_loading_rebuilds() -> None:
    layer = make_layer(expert_bias=True)
    source = make_layer(expert_bias=True, seed=42)
    x = inputs(layer)
    before = layer(x)
    pipeline, decision = layer.pipeline, layer.dispatch_decision
    layer.load_state_dict(source.state_dict())
    layer.process_weights_after_loading()
    assert layer.pipeline is not pipeline
    assert layer.dispatch_decision == decision
    assert layer.describe() == make_layer(expert_bias=True).describe()
    out = assert_matches_reference(layer, x)
    torch.testing.assert_close(out, source(x), rtol=0, atol=0)
    assert rel_err(out, before) > 1e-2


class RepackingMethod(mf.UnquantizedMethod):
    """Replaces its parameters after loading (as a kernel-layout repack would) with equal values."""

    calls = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        type(self).calls += 1
        for name in ("w13_weight", "w2_weight"):
            old = getattr(layer, name)
            setattr(layer, name, torch.nn.Parameter(old.detach().clone().contiguous(), requires_grad=False))


def test_process_weights_after_loading_sees_replaced_parameters() -> None:
    layer = make_layer(quant=RepackingMethod())
    x = inputs(layer)
    before = layer(x)
    old = layer.w13_weight
    layer.process_weights_after_loading()
    assert RepackingMethod.calls == 1
    assert layer.w13_weight is not old
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
    layer.w13_weight.mul_(2.0)  # the pipeline reads the new parameter, not the replaced one
    assert rel_err(layer(x), before) > 1e-2
    assert_matches_reference(layer, x)


def test_rebuild_picks_up_a_changed_dispatch_setting() -> None:
    layer = make_layer()
    layer.dispatch_dtype_setting = "bf16"
    layer.process_weights_after_loading()
    assert layer.dispatch_decision.dtype is mf.DispatchDtype.BF16
    assert any(isinstance(s, mf.QuantizeTokens) for s in layer.pipeline.stages)
    x = inputs(layer)
    assert rel_err(layer(x), layer_reference(layer, x)) < 2e-2


# -- CustomTopK --------------------------------------------------------------------------------------


def _softmax_topk(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().softmax(-1).topk(k, dim=-1)
    return values / values.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_custom_topk_in_a_layer(dispatcher: str) -> None:
    layer = make_layer(dispatcher=dispatcher)
    x = inputs(layer)
    expected = layer(x)
    layer.replace_stage("TopK", mf.CustomTopK(E, K, _softmax_topk, label="softmax"))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def _bad_ids(offset: int) -> Any:
    def fn(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = _softmax_topk(hidden, logits, k)
        return weights, ids + offset
    return fn


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("offset", [E, -E, 100])
def test_custom_topk_with_out_of_range_ids_raises(dispatcher: str, debug: bool, offset: int) -> None:
    layer = make_layer(dispatcher=dispatcher, debug=debug)
    layer.replace_stage(0, mf.CustomTopK(E, K, _bad_ids(offset), label="broken"))
    with pytest.raises(mf.InputError, match="ids") as info:
        layer(inputs(layer))
    message = str(info.value)
    assert "CustomTopK(broken" in message and f"[0, num_experts={E})" in message


@pytest.mark.parametrize("fn, match", [
    (lambda h, l, k: (l.topk(k + 1).values, l.topk(k + 1).indices), "shape"),
    (lambda h, l, k: (l.topk(k).values, l.topk(k).indices[:-1]), r"ids of shape"),
    (lambda h, l, k: (l.topk(k).values, l.topk(k).indices.float()), "ids of dtype"),
    (lambda h, l, k: (l.topk(k).values, l.topk(k).indices.bool()), "ids of dtype"),
    (lambda h, l, k: (l.topk(k).indices, l.topk(k).indices), "weights of dtype"),
    (lambda h, l, k: (l.topk(k).values.tolist(), l.topk(k).indices), "tensors"),
], ids=["k+1", "missing-token", "float-ids", "bool-ids", "int-weights", "list"])
def test_custom_topk_with_a_malformed_output_raises(fn: Any, match: str) -> None:
    layer = make_layer()
    layer.replace_stage(0, mf.CustomTopK(E, K, fn))
    with pytest.raises(mf.InputError, match=match):
        layer(inputs(layer))


def test_custom_topk_on_an_empty_batch() -> None:
    layer = make_layer()
    layer.replace_stage(0, mf.CustomTopK(E, K, _softmax_topk))
    assert layer(inputs(layer, 0)).shape == (0, H)


# -- bad input ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer32() -> mf.MoELayer:
    with torch.no_grad():
        return make_layer(debug=True)


@pytest.mark.parametrize("shape", [(H,), (2, 3, 4, H), (T, H + 1), (T, H // 2), (2, 3, H - 1), ()],
                         ids=["1d", "4d", "wide", "narrow", "3d-narrow", "scalar"])
def test_hidden_states_of_the_wrong_shape(layer32: mf.MoELayer, shape: tuple[int, ...]) -> None:
    with pytest.raises(mf.InputError, match="hidden_states"):
        layer32(torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_hidden_states_of_the_wrong_dtype(layer32: mf.MoELayer, dtype: torch.dtype) -> None:
    with pytest.raises(mf.InputError, match="hidden_states") as info:
        layer32(torch.randn(T, H).to(dtype))
    assert str(dtype) in str(info.value)


def test_hidden_states_on_the_wrong_device(layer32: mf.MoELayer) -> None:
    with pytest.raises(mf.InputError, match="hidden_states.*device"):
        layer32(torch.randn(T, H, device="meta"))


@pytest.mark.parametrize("value", [[[0.0] * H] * 2, None, 3.0, "x"], ids=["list", "none", "float", "str"])
def test_hidden_states_that_are_not_tensors(layer32: mf.MoELayer, value: Any) -> None:
    with pytest.raises(mf.InputError, match="hidden_states.*torch.Tensor"):
        layer32(value)


@pytest.mark.parametrize("shape", [(T, E + 1), (T + 1, E), (T - 1, E), (T * E,), (T, E, 1), (E,)],
                         ids=["experts+1", "tokens+1", "tokens-1", "flat", "trailing-1", "1d"])
def test_router_logits_of_the_wrong_shape(layer32: mf.MoELayer, shape: tuple[int, ...]) -> None:
    with pytest.raises(mf.InputError, match="router_logits"):
        layer32(torch.randn(T, H), torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_router_logits_of_the_wrong_dtype(layer32: mf.MoELayer, dtype: torch.dtype) -> None:
    with pytest.raises(mf.InputError, match="router_logits"):
        layer32(torch.randn(T, H), torch.randn(T, E).to(dtype))


def test_float64_router_logits_route_like_fp32(layer32: mf.MoELayer) -> None:
    x, logits = torch.randn(T, H), torch.randn(T, E)
    torch.testing.assert_close(layer32(x, logits.double()), layer32(x, logits))


def test_router_logits_on_the_wrong_device(layer32: mf.MoELayer) -> None:
    with pytest.raises(mf.InputError, match="router_logits.*device"):
        layer32(torch.randn(T, H), torch.randn(T, E, device="meta"))


@pytest.mark.parametrize("value", [[[0.0] * E] * T, 1.0, "logits"], ids=["list", "float", "str"])
def test_router_logits_that_are_not_tensors(layer32: mf.MoELayer, value: Any) -> None:
    with pytest.raises(mf.InputError, match="router_logits.*torch.Tensor"):
        layer32(torch.randn(T, H), value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_router_logits_in_debug_mode(layer32: mf.MoELayer, bad: float) -> None:
    logits = torch.randn(T, E)
    logits[3, 2] = bad
    with pytest.raises(mf.InputError, match="router_logits.*non-finite"):
        layer32(torch.randn(T, H), logits)


@pytest.mark.parametrize("with_logits", [False, True])
def test_non_finite_hidden_states_are_named_in_debug_mode(layer32: mf.MoELayer, with_logits: bool) -> None:
    # Before the router turns them into NaN logits: the message names the argument that was bad.
    x = torch.randn(T, H)
    x[0, 0] = float("nan")
    with pytest.raises(mf.InputError, match="hidden_states contain 1 non-finite"):
        layer32(x, torch.randn(T, E) if with_logits else None)


def test_non_finite_router_logits_are_not_read_outside_debug_mode() -> None:
    layer = make_layer()
    logits = torch.randn(T, E)
    logits[3, 2] = float("inf")  # the check reads values (a host sync): only in debug mode
    layer(inputs(layer), logits)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=-2), "num_experts"),
    (dict(num_experts=4.0), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=E + 1), "top_k"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(intermediate_size=-1), "intermediate_size"),
    (dict(intermediate_size="16"), "intermediate_size"),
    (dict(dtype=torch.float64, quant=mf.Int8W8A8Method()), "dtype"),  # float64: the unquantized method only
    (dict(dtype=torch.int8), "dtype"),
    (dict(dispatcher="nonsense"), "dispatcher"),
])
def test_bad_layer_arguments(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, environ={})
    args.update(kwargs)
    with pytest.raises(mf.InputError, match=name):
        mf.MoELayer(**args)


def test_top_k_greater_than_num_experts_names_both() -> None:
    with pytest.raises(mf.InputError, match=r"top_k=5.*num_experts=4"):
        mf.MoELayer(4, 5, H, I, environ={})


@pytest.mark.parametrize("backend", ["triton", mf.Backend.TRITON])
def test_triton_backend_on_cpu_is_unavailable(backend: Any) -> None:
    with pytest.raises(mf.errors.BackendUnavailableError, match="triton"):
        mf.MoELayer(E, K, H, I, backend=backend, environ={}, device="cpu")


@pytest.mark.parametrize("backend", ["nonsense", "cuda", ""])
def test_unknown_backend(backend: str) -> None:
    with pytest.raises(mf.errors.BackendUnavailableError, match="unknown backend"):
        mf.MoELayer(E, K, H, I, backend=backend, environ={})


@pytest.mark.parametrize("backend", ["auto", "torch", mf.Backend.TORCH])
def test_torch_backend_on_cpu(backend: Any) -> None:
    layer = mf.MoELayer(E, K, H, I, backend=backend, environ={})
    assert layer.backend is mf.Backend.TORCH
    assert "backend torch" in layer.describe()


def test_errors_are_value_and_runtime_errors() -> None:
    assert issubclass(mf.InputError, ValueError)
    assert issubclass(mf.errors.BackendUnavailableError, RuntimeError)
    assert issubclass(mf.ContractError, mf.MoEForgeError)


def test_replaced_stages_survive_a_rebuild() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={})
    geglu = mf.Activate(mf.ActivationConfig(mf.ActivationKind.GEGLU))
    layer.replace_stage("Activate", geglu)
    layer.process_weights_after_loading()
    assert layer.pipeline.stages[3] is geglu
    with pytest.raises(TypeError, match="custom stages"):
        layer_reference(layer, torch.randn(2, H))
