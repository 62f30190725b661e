"""moeforge.testing applied to the library itself: every built-in stage honours its declared contract,
the round-trip / equivariance / reference properties hold over random layer configurations, and the
contract checker catches a stage that lies about its output."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.spec import FLOAT_DTYPES
from moeforge.stages import Quantizer
from moeforge.testing import (
    LayerConfig,
    assert_stage_honours_contract,
    assert_stage_ignores_unused_slots,
    check_dispatch_combine_identity,
    check_matches_dense_reference,
    check_token_permutation_equivariance,
    layer_configs,
    payload_for,
    routed_tokens,
    token_counts,
)

E, K, H, I = 4, 2, 16, 4  # experts, top-k, hidden, intermediate
G = 128  # a width the per-128-group quantizer accepts
FP32, BF16 = mf.DType.FP32, mf.DType.BF16
SORTED, PADDED = mf.Layout.EXPERT_SORTED, mf.Layout.EXPERT_PADDED
COUNT, CUMSUM = mf.GroupListType.COUNT, mf.GroupListType.CUMSUM
PENDING = mf.RoutingWeights.PENDING

_gen = torch.Generator().manual_seed(0)
W13 = torch.randn(E, 2 * I, H, generator=_gen)
W13_PLAIN = torch.randn(E, I, H, generator=_gen)
W13_WIDE = torch.randn(E, 2 * I, G, generator=_gen)
W2 = torch.randn(E, H, I, generator=_gen)
B13 = torch.randn(E, 2 * I, generator=_gen)
B2 = torch.randn(E, H, generator=_gen)


def tokens(width: int = H, dtype: torch.dtype = torch.float32, num_experts: int = E) -> mf.Spec:
    return mf.input_spec(width, dtype, num_experts)


def routed(width: int = H, dtype: mf.DType = FP32, scale: mf.ScaleLayout = mf.ScaleLayout.NONE,
           scaling: mf.ScalingFactor = mf.ScalingFactor.NONE) -> mf.Spec:
    return mf.Spec(mf.PayloadKind.ROUTED, mf.Layout.TOKEN_MAJOR, dtype, width, scale_layout=scale,
                   scaling_factor=scaling, num_experts=E, top_k=K)


def rows(kind: mf.PayloadKind, layout: mf.Layout, width: int = H, dtype: mf.DType = FP32,
         scale: mf.ScaleLayout = mf.ScaleLayout.NONE, group_list: mf.GroupListType = COUNT,
         weights: mf.RoutingWeights = PENDING,
         scaling: mf.ScalingFactor = mf.ScalingFactor.NONE) -> mf.Spec:
    return mf.Spec(kind, layout, dtype, width, scale_layout=scale,
                   group_list_type=group_list if layout is SORTED else None, routing_weights=weights,
                   scaling_factor=scaling, expert_ids=mf.ExpertIds.LOCAL, num_experts=E, top_k=K)


DISPATCHED, HIDDEN, OUTPUT = (mf.PayloadKind.DISPATCHED, mf.PayloadKind.EXPERT_HIDDEN,
                              mf.PayloadKind.EXPERT_OUTPUT)
LAYOUTS = [(SORTED, COUNT), (SORTED, CUMSUM), (PADDED, COUNT)]
QUANTIZERS: list[tuple[Quantizer, int]] = [
    (mf.Cast(BF16), H), (mf.Cast(mf.DType.FP16), H), (mf.PerTokenQuantizer(mf.DType.FP8_E4M3), H),
    (mf.PerTokenQuantizer(mf.DType.INT8), H), (mf.PerGroupQuantizer(), G),
]


def _softmax_topk(x: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().softmax(-1).topk(k, dim=-1)
    return values, ids


def _cases() -> list[Any]:
    cases: list[Any] = []

    def add(name: str, make: Callable[[], mf.Stage[Any, Any]], spec: mf.Spec) -> None:
        cases.append(pytest.param(make, spec, id=name))

    # top-k
    add("topk-default", lambda: mf.TopK(E, K), tokens())
    add("topk-bf16-input", lambda: mf.TopK(E, K), tokens(dtype=torch.bfloat16))
    add("topk-k1", lambda: mf.TopK(E, 1), tokens())
    add("topk-kE", lambda: mf.TopK(E, E), tokens())
    add("topk-sigmoid-select-then-score", lambda: mf.TopK(E, K, mf.RoutingConfig(
        scoring=mf.Scoring.SIGMOID, order=mf.ScoreOrder.SELECT_THEN_SCORE)), tokens())
    add("topk-grouped-bias", lambda: mf.TopK(8, 3, mf.RoutingConfig(
        scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5), selection_bias=torch.randn(8, generator=_gen)),
        tokens(num_experts=8))
    add("topk-scaling-pending", lambda: mf.TopK(E, K, mf.RoutingConfig(
        routed_scaling_factor=2.5, scaling_in_weights=False)), tokens())
    add("custom-topk", lambda: mf.CustomTopK(E, K, _softmax_topk), tokens())
    # quantize, before and after the dispatch
    for quantizer, width in QUANTIZERS:
        label = quantizer.summary().replace("/", "-")
        add(f"quantize-tokens-{label}", functools.partial(mf.QuantizeTokens, quantizer), routed(width))
        for kind in (DISPATCHED, HIDDEN):
            for layout, group_list in LAYOUTS:
                add(f"quantize-rows-{label}-{kind.value}-{layout.value}-{group_list.name}",
                    functools.partial(mf.QuantizeRows, quantizer), rows(kind, layout, width, group_list=group_list))
    # dispatch
    for group_list in (COUNT, CUMSUM):
        name = group_list.name.lower()
        add(f"sorted-dispatch-{name}", functools.partial(mf.SortedDispatch, E, group_list), routed())
        add(f"sorted-dispatch-{name}-weights-on-input",
            functools.partial(mf.SortedDispatch, E, group_list, apply_routing_weights=True), routed())
        add(f"sorted-dispatch-{name}-fp8", functools.partial(mf.SortedDispatch, E, group_list),
            routed(H, mf.DType.FP8_E4M3, mf.ScaleLayout.PER_TOKEN))
        add(f"sorted-dispatch-{name}-fp8-group", functools.partial(mf.SortedDispatch, E, group_list),
            routed(G, mf.DType.FP8_E4M3, mf.ScaleLayout.PER_GROUP_128))
    add("padded-dispatch", lambda: mf.PaddedDispatch(E), routed())
    add("padded-dispatch-drop", lambda: mf.PaddedDispatch(E, 2, mf.Overflow.DROP), routed())
    add("padded-dispatch-weights-on-input",
        lambda: mf.PaddedDispatch(E, apply_routing_weights=True), routed())
    add("padded-dispatch-int8", lambda: mf.PaddedDispatch(E), routed(dtype=mf.DType.INT8,
                                                                      scale=mf.ScaleLayout.PER_TOKEN))
    add("padded-dispatch-fp8-group", lambda: mf.PaddedDispatch(E),
        routed(G, mf.DType.FP8_E4M3, mf.ScaleLayout.PER_GROUP_128))
    add("padded-dispatch-bf16", lambda: mf.PaddedDispatch(E), routed(dtype=BF16))
    # grouped GEMMs, both roles, both layouts
    for layout, group_list in LAYOUTS:
        suffix = f"{layout.value}-{group_list.name.lower()}"
        add(f"gemm-gate-up-{suffix}", lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13),
            rows(DISPATCHED, layout, group_list=group_list))
        add(f"gemm-gate-up-bias-bf16-out-{suffix}",
            lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13, B13, out_dtype=BF16),
            rows(DISPATCHED, layout, group_list=group_list))
        add(f"gemm-gate-up-fp8-{suffix}",
            lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13, out_dtype=FP32),
            rows(DISPATCHED, layout, dtype=mf.DType.FP8_E4M3, scale=mf.ScaleLayout.PER_TOKEN,
                 group_list=group_list))
        add(f"gemm-gate-up-int8-per-tensor-{suffix}",
            lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13, out_dtype=BF16),
            rows(DISPATCHED, layout, dtype=mf.DType.INT8, scale=mf.ScaleLayout.PER_TENSOR,
                 group_list=group_list))
        add(f"gemm-gate-up-fp8-group-{suffix}",
            lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13_WIDE, out_dtype=FP32),
            rows(DISPATCHED, layout, G, mf.DType.FP8_E4M3, mf.ScaleLayout.PER_GROUP_128, group_list))
        add(f"gemm-gate-up-weights-on-input-{suffix}", lambda: mf.GroupedGemm(mf.GemmRole.GATE_UP, W13),
            rows(DISPATCHED, layout, group_list=group_list, weights=mf.RoutingWeights.ON_INPUT))
        add(f"gemm-down-{suffix}", lambda: mf.GroupedGemm(mf.GemmRole.DOWN, W2, B2),
            rows(HIDDEN, layout, I, group_list=group_list))
        add(f"gemm-down-epilogue-{suffix}",
            lambda: mf.GroupedGemm(mf.GemmRole.DOWN, W2, apply_routing_weights=True),
            rows(HIDDEN, layout, I, group_list=group_list))
        add(f"gemm-down-int8-{suffix}", lambda: mf.GroupedGemm(mf.GemmRole.DOWN, W2, out_dtype=FP32),
            rows(HIDDEN, layout, I, mf.DType.INT8, mf.ScaleLayout.PER_TOKEN, group_list))
    # activations, every kind, both layouts
    for act in mf.ActivationKind:
        for gate_up in (mf.GateUpLayout.CONCATENATED, mf.GateUpLayout.INTERLEAVED):
            config = mf.ActivationConfig(act, gate_up)
            for layout, group_list in LAYOUTS:
                add(f"activate-{act.value}-{gate_up.value}-{layout.value}-{group_list.name.lower()}",
                    functools.partial(mf.Activate, config), rows(HIDDEN, layout, 2 * I, group_list=group_list))
            if not act.gated:
                break  # the gate/up layout means nothing to a plain activation
    add("activate-bf16-in-fp32-out", lambda: mf.Activate(out_dtype=FP32), rows(HIDDEN, PADDED, 2 * I, BF16))
    add("activate-odd-width-plain", lambda: mf.Activate(mf.ActivationConfig(mf.ActivationKind.RELU2)),
        rows(HIDDEN, SORTED, 3))
    # combine, weighted and not, both layouts
    for layout, group_list in LAYOUTS:
        suffix = f"{layout.value}-{group_list.name.lower()}"
        add(f"combine-weighted-{suffix}", lambda: mf.Combine(), rows(OUTPUT, layout, group_list=group_list))
        add(f"combine-weighted-scaled-bf16-out-{suffix}",
            lambda: mf.Combine(routed_scaling_factor=2.5, out_dtype=BF16),
            rows(OUTPUT, layout, group_list=group_list, scaling=mf.ScalingFactor.PENDING))
        for applied in (mf.RoutingWeights.ON_INPUT, mf.RoutingWeights.IN_GEMM_EPILOGUE):
            add(f"combine-unweighted-{applied.value}-{suffix}",
                lambda: mf.Combine(apply_routing_weights=False),
                rows(OUTPUT, layout, group_list=group_list, weights=applied))
    add("combine-bf16", lambda: mf.Combine(), rows(OUTPUT, SORTED, dtype=BF16))
    return cases


@pytest.mark.parametrize(("make", "spec"), _cases())
def test_builtin_stage_honours_its_contract(make: Callable[[], mf.Stage[Any, Any]], spec: mf.Spec) -> None:
    assert_stage_honours_contract(make(), spec, max_examples=10)


def _padded_cases() -> list[Any]:
    cases = [case for case in _cases() if case.values[1].layout is PADDED]
    for dtype in (mf.DType.FP8_E4M3, mf.DType.INT8):  # one scale for the whole tensor, after the exchange and after
        for kind in (DISPATCHED, HIDDEN):              # the activation
            cases.append(pytest.param(functools.partial(mf.QuantizeRows, mf.PerTensorQuantizer(dtype)),
                                      rows(kind, PADDED), id=f"quantize-rows-per-tensor-{dtype.value}-{kind.value}"))
        cases.append(pytest.param(functools.partial(mf.stages.ActivateQuantize, mf.ActivationConfig(),
                                                    mf.PerTensorQuantizer(dtype)),
                                  rows(HIDDEN, PADDED, 2 * I), id=f"activate-quantize-per-tensor-{dtype.value}"))
    return cases


@pytest.mark.parametrize(("make", "spec"), _padded_cases())
def test_builtin_stage_ignores_the_unused_slots_of_padded_rows(make: Callable[[], mf.Stage[Any, Any]],
                                                                spec: mf.Spec) -> None:
    # (the low-latency and symmetric dispatchers leave those slots unwritten: an earlier batch's bits, NaN included)
    assert_stage_ignores_unused_slots(make(), spec, max_examples=5)


# -- the checker itself ---------------------------------------------------------------------------------


class _SameSpecActivation(mf.Stage[mf.ExpertRows, mf.ExpertRows]):
    """An activation stage that declares it keeps its input's spec (the two below break that in their own ways)."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec


class LyingActivation(_SameSpecActivation):
    """Declares that it keeps the dtype, but returns bf16 rows."""

    def __call__(self, x: mf.ExpertRows) -> mf.ExpertRows:
        return x.with_x(mf.Activations(torch.relu(x.x.data).to(torch.bfloat16)))


class SlotSummingScale(_SameSpecActivation):
    """Divides every row by the largest magnitude over all slots: used and unused alike."""

    def __call__(self, x: mf.ExpertRows) -> mf.ExpertRows:
        return x.with_x(mf.Activations(x.x.data / x.x.data.abs().amax().clamp(min=1.0)))


def test_the_checker_catches_a_stage_that_reads_the_unused_slots() -> None:
    with pytest.raises(AssertionError, match="SlotSummingScale reads the unused slots of padded rows"):
        assert_stage_ignores_unused_slots(SlotSummingScale(), rows(HIDDEN, PADDED), max_examples=10)
    with pytest.raises(ValueError, match="padded layout"):
        assert_stage_ignores_unused_slots(SlotSummingScale(), rows(HIDDEN, SORTED))


class TokenDroppingTopK(mf.Stage[mf.MoEInput, mf.RoutedTokens]):
    """Routes only the first token: a correct-looking payload for the wrong number of tokens."""

    kinds: ClassVar = (mf.StageKind.TOPK,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.TOKENS)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(kind=mf.PayloadKind.ROUTED, top_k=1)

    def __call__(self, x: mf.MoEInput) -> mf.RoutedTokens:
        first = x.hidden_states[:1]
        topk = mf.TopKOutput(torch.ones(first.shape[0], 1), torch.zeros(first.shape[0], 1, dtype=torch.int32))
        return mf.RoutedTokens(mf.Activations(first), topk)


class DuplicatingTopK(mf.Stage[mf.MoEInput, mf.RoutedTokens]):
    """Routes every token to its best expert twice (k=2): ids in range, but not distinct."""

    kinds: ClassVar = (mf.StageKind.TOPK,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.TOKENS)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(kind=mf.PayloadKind.ROUTED, top_k=2)

    def __call__(self, x: mf.MoEInput) -> mf.RoutedTokens:
        best = x.router_logits.argmax(-1, keepdim=True).to(torch.int32)
        weights = torch.full((x.hidden_states.shape[0], 2), 0.5)
        return mf.RoutedTokens(mf.Activations(x.hidden_states), mf.TopKOutput(weights, best.expand(-1, 2)))


def _duplicate_ids(x: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    best = logits.argmax(-1, keepdim=True)
    return torch.full((x.shape[0], k), 0.5), best.expand(-1, k)  # the best expert, twice


def test_checker_catches_duplicate_expert_ids() -> None:
    with pytest.raises(AssertionError, match="DuplicatingTopK broke its declared output spec.*same expert twice"):
        assert_stage_honours_contract(DuplicatingTopK(), tokens(), max_examples=20)


def test_custom_topk_rejects_duplicate_expert_ids_on_every_call() -> None:
    # User routing code is checked on every call (not only in debug mode): a repeated id would be summed
    # twice by the sorted dispatcher and overflow the padded one's capacity.
    stage = mf.CustomTopK(E, 2, _duplicate_ids)
    x = torch.randn(3, H)
    with pytest.raises(mf.InputError, match="same expert more than once"):
        stage(mf.MoEInput(x, torch.randn(3, E)))


def test_checker_catches_a_stage_that_lies_about_its_dtype() -> None:
    with pytest.raises(AssertionError, match=r"LyingActivation broke its declared output spec.*data dtype"):
        assert_stage_honours_contract(LyingActivation(), rows(HIDDEN, SORTED), max_examples=5)


def test_checker_catches_a_stage_that_drops_tokens() -> None:
    with pytest.raises(AssertionError, match="TokenDroppingTopK changed the number of tokens"):
        assert_stage_honours_contract(TokenDroppingTopK(), tokens(), max_examples=20)


def test_checker_reports_a_spec_the_stage_rejects() -> None:
    with pytest.raises(AssertionError, match=r"(?s)GroupedGemm does not accept.*field 'width': have 8, stage accepts \{16\}"):
        assert_stage_honours_contract(mf.GroupedGemm(mf.GemmRole.GATE_UP, W13), rows(DISPATCHED, SORTED, 8))


def test_importing_moeforge_does_not_import_hypothesis() -> None:
    code = "import sys, moeforge; assert 'hypothesis' not in sys.modules and 'moeforge.testing' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("spec", [
    tokens(), routed(), routed(G, mf.DType.FP8_E4M3, mf.ScaleLayout.PER_GROUP_128),
    rows(DISPATCHED, SORTED, dtype=mf.DType.INT8, scale=mf.ScaleLayout.PER_TENSOR),
    rows(HIDDEN, PADDED, weights=mf.RoutingWeights.ON_INPUT), rows(OUTPUT, SORTED, group_list=CUMSUM),
    mf.Spec(mf.PayloadKind.OUTPUT, mf.Layout.TOKEN_MAJOR, BF16, H),
], ids=lambda spec: spec.short())
def test_payload_for_matches_its_spec(spec: mf.Spec) -> None:
    @settings(max_examples=20, deadline=None)
    @given(payload_for(spec))
    def matches(payload: Any) -> None:
        mf.payloads.check_payload(payload, spec)

    matches()


def test_strategies_reach_the_edge_cases() -> None:
    payloads = routed_tokens(routed())
    assert find(payloads, lambda p: p.x.data.shape[0] == 0)
    assert find(payloads, lambda p: p.x.data.shape[0] == 1)

    def all_on_one_expert(p: mf.RoutedTokens) -> bool:
        first = p.topk.ids[:, 0]
        return first.numel() >= 3 and bool((first == first[0]).all())

    def idle_experts(p: mf.RoutedTokens) -> bool:
        return p.topk.ids.numel() >= 3 * K and len(set(p.topk.ids.flatten().tolist())) < E

    assert find(payloads, all_on_one_expert)
    assert find(payloads, idle_experts)


# -- properties over random layer configurations ---------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    spec=st.sampled_from([routed(), routed(dtype=BF16)]),
    dispatch=st.sampled_from([
        mf.SortedDispatch(E), mf.SortedDispatch(E, CUMSUM), mf.SortedDispatch(E, apply_routing_weights=True),
        mf.PaddedDispatch(E), mf.PaddedDispatch(E, 1, mf.Overflow.DROP),
        mf.PaddedDispatch(E, apply_routing_weights=True),
    ]),
    data=st.data(),
)
def test_dispatch_then_combine_is_the_identity(spec: mf.Spec, dispatch: mf.Stage[Any, Any],
                                               data: st.DataObject) -> None:
    tolerance = 1e-2 if spec.dtype is BF16 else 1e-5
    check_dispatch_combine_identity(dispatch, data.draw(routed_tokens(spec)), E, rtol=tolerance,
                                    atol=tolerance)


@settings(max_examples=20, deadline=None)
@given(config=layer_configs(), num_tokens=token_counts(), data=st.data())
def test_layer_is_token_permutation_equivariant(config: LayerConfig, num_tokens: int,
                                                data: st.DataObject) -> None:
    layer = config.build()
    x, logits = config.inputs(num_tokens, seed=1)
    perm = torch.tensor(data.draw(st.permutations(range(num_tokens))), dtype=torch.long)
    check_token_permutation_equivariance(layer, x, logits, perm)
    check_token_permutation_equivariance(layer.pipeline, x, logits, perm)


@settings(max_examples=20, deadline=None)
@given(config=layer_configs(), num_tokens=token_counts())
def test_layer_matches_dense_reference(config: LayerConfig, num_tokens: int) -> None:
    layer = config.build()
    x, logits = config.inputs(num_tokens, seed=2)
    check_matches_dense_reference(layer, x, rtol=1e-4, logits=logits)
    check_matches_dense_reference(layer, x, rtol=1e-4)  # the layer's own router


def test_debug_mode_rejects_non_finite_routing_weights() -> None:
    def nan_weights(x: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = logits.softmax(-1).topk(k)
        return weights.masked_fill(torch.ones_like(weights, dtype=torch.bool), float("nan")), ids

    stages = [mf.CustomTopK(E, K, nan_weights), mf.SortedDispatch(E), mf.GroupedGemm(mf.GemmRole.GATE_UP, W13),
              mf.Activate(), mf.GroupedGemm(mf.GemmRole.DOWN, W2), mf.Combine()]
    x = mf.MoEInput(torch.randn(3, H), torch.randn(3, E))
    mf.Pipeline(stages, tokens())(x)  # outside debug mode nothing reads the values
    with pytest.raises(mf.errors.PayloadError, match=r"stage 0 \(CustomTopK\).*topk.weights: 6 non-finite"):
        mf.Pipeline(stages, tokens(), debug=True)(x)


# -- float64: what a user checks with torch.autograd.gradcheck ----------------------------------------


def test_float64_routed_payloads_carry_float64_routing_weights() -> None:
    # As a float64 layer's top-k gives them: a float64 stage tested on these sees what it will run on.
    payload = find(routed_tokens(routed(dtype=mf.DType.FP64)), lambda p: p.x.data.shape[0] >= 1)
    assert payload.x.data.dtype == torch.float64 and payload.topk.weights.dtype == torch.float64


@pytest.mark.parametrize("dispatch", [mf.SortedDispatch(E), mf.PaddedDispatch(E, apply_routing_weights=True)],
                         ids=lambda stage: stage.summary())
def test_dispatch_then_combine_is_the_identity_in_float64(dispatch: mf.Stage[Any, Any]) -> None:
    payload = find(routed_tokens(routed(dtype=mf.DType.FP64)), lambda p: p.x.data.shape[0] >= 3)
    check_dispatch_combine_identity(dispatch, payload, E, rtol=1e-12, atol=1e-12)
