"""Routing (top-k) stages: the routing math of each model family against a plain per-token loop.

The oracle here (:func:`reference_route`) is written independently of the library: one token at a
time, in float64, with Python's ``math`` and ``sorted``. Where the order of the chosen experts is not
part of the contract (DeepSeek-style grouped routing, or any routing whose weights are summed in the
combine), ids are compared as sets and weights by expert id.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.stages import select_experts
from moeforge.stages.topk import GroupScore, RoutingConfig, ScoreOrder, Scoring

SOFTMAX, SIGMOID = Scoring.SOFTMAX, Scoring.SIGMOID
SCORE_FIRST, SELECT_FIRST = ScoreOrder.SCORE_THEN_SELECT, ScoreOrder.SELECT_THEN_SCORE


# -- the oracle ------------------------------------------------------------------------------------


def _top(values: list[float], k: int, allowed: Optional[set[int]] = None) -> tuple[list[int], float]:
    """The ``k`` best indices (ties: lower index first) among ``allowed``, and the decision margin
    (gap between the last kept and the first rejected value; ``inf`` when nothing is rejected)."""
    candidates = [i for i in range(len(values)) if allowed is None or i in allowed]
    ranked = sorted(candidates, key=lambda i: (-values[i], i))
    margin = values[ranked[k - 1]] - values[ranked[k]] if k < len(ranked) else math.inf
    return ranked[:k], margin


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def reference_route(
    logits: list[float], top_k: int, config: RoutingConfig, bias: Optional[list[float]] = None
) -> tuple[list[int], list[float], float]:
    """One token's routing: ``(ids, weights, margin)``; ``margin`` is the smallest gap at any
    selection boundary, so callers can skip tokens whose choice is a near-tie in float32."""
    num_experts = len(logits)
    bias = bias or [0.0] * num_experts
    margin = math.inf
    if config.order is SELECT_FIRST:
        ids, margin = _top([l + b for l, b in zip(logits, bias)], top_k)
        chosen = [logits[i] for i in ids]
        if config.scoring is SOFTMAX:
            weights = _softmax(chosen)
        else:
            weights = [_sigmoid(v) for v in chosen]
            if config.renormalize:
                weights = [w / sum(weights) for w in weights]
    else:
        scores = _softmax(logits) if config.scoring is SOFTMAX else [_sigmoid(v) for v in logits]
        choice = [s + b for s, b in zip(scores, bias)]
        allowed: Optional[set[int]] = None
        if config.n_group is not None:
            assert config.topk_group is not None
            size = num_experts // config.n_group
            group_scores = []
            for group in range(config.n_group):
                members = sorted((choice[group * size + j] for j in range(size)), reverse=True)
                if config.group_score is GroupScore.SUM_TOP2:
                    group_scores.append(sum(members[:2]))
                else:
                    group_scores.append(members[0])
            groups, margin = _top(group_scores, config.topk_group)
            allowed = {group * size + j for group in groups for j in range(size)}
        ids, expert_margin = _top(choice, top_k, allowed)
        margin = min(margin, expert_margin)
        weights = [scores[i] for i in ids]
        if config.renormalize:
            weights = [w / sum(weights) for w in weights]
    if config.scaling_in_weights:
        weights = [w * config.routed_scaling_factor for w in weights]
    return ids, weights, margin


def assert_matches_reference(
    logits: torch.Tensor,
    top_k: int,
    config: RoutingConfig,
    bias: Optional[torch.Tensor] = None,
    *,
    min_margin: float = 1e-5,
) -> int:
    """Compare :func:`select_experts` with the oracle token by token (ids as sets, weights by id).
    Returns how many tokens were compared (near-ties in float32 are skipped)."""
    out = select_experts(logits, top_k, config, bias)
    assert out.ids.dtype == torch.int32 and out.weights.dtype == torch.float32
    assert tuple(out.ids.shape) == tuple(out.weights.shape) == (logits.shape[0], top_k)
    bias_list = bias.double().tolist() if bias is not None else None
    compared = 0
    for token, row in enumerate(logits.double().tolist()):
        ids, weights, margin = reference_route(row, top_k, config, bias_list)
        got_ids = out.ids[token].tolist()
        assert len(set(got_ids)) == top_k, f"token {token}: repeated expert in {got_ids}"
        if margin < min_margin:
            continue
        compared += 1
        assert set(got_ids) == set(ids), f"token {token}: ids {got_ids}, expected {ids}"
        got = dict(zip(got_ids, out.weights[token].double().tolist()))
        for expert, weight in zip(ids, weights):
            assert got[expert] == pytest.approx(weight, rel=2e-6, abs=1e-7), (token, expert)
    return compared


def _logits(tokens: int, experts: int, seed: int = 0, scale: float = 2.0,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=gen) * scale).to(dtype)


def _bias(experts: int, seed: int = 1, scale: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, generator=gen) * scale


# -- the families ----------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_then_topk(renormalize: bool) -> None:
    """Mixtral / Qwen-MoE (renormalize) and OLMoE / Qwen with norm_topk_prob=False (no renorm)."""
    config = RoutingConfig(scoring=SOFTMAX, order=SCORE_FIRST, renormalize=renormalize)
    logits = _logits(48, 8, seed=3)
    assert assert_matches_reference(logits, 2, config) > 40
    weights = select_experts(logits, 2, config).weights
    sums = weights.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert bool((sums < 1).all())
        # The weights are the full-softmax probabilities of the chosen experts.
        probs = logits.softmax(-1)
        ids = select_experts(logits, 2, config).ids.long()
        torch.testing.assert_close(weights, probs.gather(-1, ids))


def test_softmax_then_topk_orders_by_score() -> None:
    config = RoutingConfig()
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = select_experts(logits, 3, config)
    assert set(out.ids[0].tolist()) == {1, 3, 4}
    probs = logits.softmax(-1)[0]
    expected = {e: float(probs[e] / probs[[1, 3, 4]].sum()) for e in (1, 3, 4)}
    for expert, weight in zip(out.ids[0].tolist(), out.weights[0].tolist()):
        assert weight == pytest.approx(expected[expert], rel=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_then_softmax_over_k(renormalize: bool) -> None:
    """GPT-OSS / Granite: top-k of the logits, softmax over the k chosen (renormalisation is moot)."""
    config = RoutingConfig(scoring=SOFTMAX, order=SELECT_FIRST, renormalize=renormalize)
    logits = _logits(40, 16, seed=4)
    assert assert_matches_reference(logits, 4, config) > 35
    out = select_experts(logits, 4, config)
    chosen = logits.gather(-1, out.ids.long())
    torch.testing.assert_close(out.weights, chosen.softmax(-1))
    # It differs from softmax-then-top-k without renormalisation: weights sum to 1 here.
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(40))


def test_topk_then_softmax_hand_example() -> None:
    config = RoutingConfig(order=SELECT_FIRST)
    out = select_experts(torch.tensor([[1.0, 4.0, 2.0, 0.0]]), 2, config)
    assert set(out.ids[0].tolist()) == {1, 2}
    weight = dict(zip(out.ids[0].tolist(), out.weights[0].tolist()))
    assert weight[1] == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(2)), rel=1e-6)
    assert weight[2] == pytest.approx(math.exp(2) / (math.exp(4) + math.exp(2)), rel=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_then_topk(renormalize: bool) -> None:
    """DeepSeek-V3 style scoring (without groups): sigmoid of every logit, then top-k."""
    config = RoutingConfig(scoring=SIGMOID, order=SCORE_FIRST, renormalize=renormalize)
    logits = _logits(40, 12, seed=5)
    assert assert_matches_reference(logits, 3, config) > 35
    out = select_experts(logits, 3, config)
    if not renormalize:
        torch.testing.assert_close(out.weights, logits.gather(-1, out.ids.long()).sigmoid())


def test_llama4_select_then_sigmoid_without_renormalisation() -> None:
    """Llama-4: top-k on the logits, weight = sigmoid(chosen logit), no renormalisation."""
    config = RoutingConfig(scoring=SIGMOID, order=SELECT_FIRST, renormalize=False,
                           apply_weights=mf.RoutingWeights.ON_INPUT)
    logits = _logits(32, 16, seed=6)
    assert assert_matches_reference(logits, 1, config) > 30
    out = select_experts(logits, 1, config)
    torch.testing.assert_close(out.ids.long(), logits.argmax(-1, keepdim=True))
    torch.testing.assert_close(out.weights, logits.max(-1, keepdim=True).values.sigmoid())
    # Not renormalised: a top-1 weight is not 1.
    assert bool((out.weights < 1).all())


def test_select_then_sigmoid_with_renormalisation() -> None:
    config = RoutingConfig(scoring=SIGMOID, order=SELECT_FIRST, renormalize=True)
    logits = _logits(24, 8, seed=7)
    assert assert_matches_reference(logits, 2, config) > 20
    torch.testing.assert_close(select_experts(logits, 2, config).weights.sum(-1), torch.ones(24))


# -- selection bias --------------------------------------------------------------------------------


@pytest.mark.parametrize("scoring", [SOFTMAX, SIGMOID])
@pytest.mark.parametrize("order", [SCORE_FIRST, SELECT_FIRST])
def test_selection_bias_matches_reference(scoring: Scoring, order: ScoreOrder) -> None:
    config = RoutingConfig(scoring=scoring, order=order, renormalize=True, selection_bias=True)
    logits = _logits(40, 8, seed=8)
    assert assert_matches_reference(logits, 2, config, _bias(8, scale=0.5)) > 30


@pytest.mark.parametrize("renormalize", [True, False])
def test_selection_bias_changes_the_choice_not_the_weights(renormalize: bool) -> None:
    """DeepSeek's e_score_correction_bias: it decides *which* experts, the weights come from the
    unbiased scores."""
    config = RoutingConfig(scoring=SIGMOID, renormalize=renormalize, selection_bias=True)
    logits = _logits(16, 8, seed=9)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 always wins the selection, whatever its score
    out = select_experts(logits, 2, config, bias)
    assert bool((out.ids == 5).any(-1).all())
    unbiased = logits.sigmoid().gather(-1, out.ids.long())
    expected = unbiased / unbiased.sum(-1, keepdim=True) if renormalize else unbiased
    torch.testing.assert_close(out.weights, expected)
    # No weight is anywhere near the biased score (sigmoid + 10).
    assert bool((out.weights <= 1).all())


def test_selection_bias_in_the_topk_stage_is_read_at_call_time() -> None:
    """A layer's bias buffer is referenced, not copied: updating it changes the next routing."""
    routing = RoutingConfig(scoring=SIGMOID, selection_bias=True, n_group=4, topk_group=2)
    layer = mf.MoELayer(8, 2, 16, 8, routing=routing, dtype=torch.float32)
    topk = layer.pipeline.stages[0]
    assert isinstance(topk, mf.TopK)
    assert "selection bias" in topk.summary()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    logits = _logits(6, 8, seed=10)
    routed = topk(mf.MoEInput(x, logits))
    assert_matches_reference(logits, 2, routing, torch.zeros(8))
    with torch.no_grad():
        layer.e_score_correction_bias[7] = 5.0
    rerouted = topk(mf.MoEInput(x, logits))
    assert bool((rerouted.topk.ids == 7).any(-1).all())
    assert not torch.equal(routed.topk.ids, rerouted.topk.ids)


def test_selection_bias_config_without_tensor_is_an_input_error() -> None:
    with pytest.raises(mf.InputError, match="selection_bias"):
        mf.TopK(8, 2, RoutingConfig(selection_bias=True))


# -- grouped top-k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group_score", [GroupScore.SUM_TOP2, GroupScore.MAX])
@pytest.mark.parametrize("scoring", [SIGMOID, SOFTMAX])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_matches_reference(group_score: GroupScore, scoring: Scoring, with_bias: bool) -> None:
    config = RoutingConfig(scoring=scoring, n_group=4, topk_group=2, group_score=group_score,
                           selection_bias=with_bias)
    logits = _logits(64, 16, seed=11)
    bias = _bias(16, scale=0.2) if with_bias else None
    assert assert_matches_reference(logits, 4, config, bias) > 55
    # Every chosen expert lies in one of at most topk_group groups.
    ids = select_experts(logits, 4, config, bias).ids
    groups_used = (ids // 4).sort(-1).values
    assert bool(((groups_used[:, 1:] != groups_used[:, :-1]).sum(-1) + 1 <= 2).all())


def test_deepseek_v3_style_routing() -> None:
    """Scaled-down DeepSeek-V3: sigmoid, bias, 8 groups / 4 kept by sum of top-2, k=8, x2.5."""
    config = RoutingConfig(scoring=SIGMOID, renormalize=True, selection_bias=True, n_group=8,
                           topk_group=4, group_score=GroupScore.SUM_TOP2, routed_scaling_factor=2.5)
    logits = _logits(48, 32, seed=12)
    bias = _bias(32, scale=0.1)
    assert assert_matches_reference(logits, 8, config, bias) > 40
    weights = select_experts(logits, 8, config, bias).weights
    torch.testing.assert_close(weights.sum(-1), torch.full((48,), 2.5))


def test_group_score_sum_top2_and_max_choose_differently() -> None:
    """Groups of two: A has the single best expert but a poor partner; B and C are strong pairs."""
    logits = torch.tensor([[4.0, -4.0, 2.0, 2.0, 1.5, 1.5, -3.0, -3.0]])  # groups A B C D
    def ids(group_score: GroupScore) -> set[int]:
        config = RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=2, group_score=group_score)
        assert_matches_reference(logits, 2, config, min_margin=0.0)
        return set(select_experts(logits, 2, config).ids[0].tolist())

    # SUM_TOP2: A = 1.0, B = 1.76, C = 1.64 -> groups B, C -> experts 2, 3.
    assert ids(GroupScore.SUM_TOP2) == {2, 3}
    # MAX: A = 0.98, B = 0.88 -> groups A, B -> expert 0, then the tie 2/3 goes to 2.
    assert ids(GroupScore.MAX) == {0, 2}


def test_grouped_topk_never_picks_outside_kept_groups_even_with_low_scores() -> None:
    """A masked expert must lose to a kept one even when every kept choice score is negative."""
    config = RoutingConfig(scoring=SIGMOID, n_group=2, topk_group=1, selection_bias=True,
                           group_score=GroupScore.MAX)
    logits = torch.zeros(1, 4)
    bias = torch.tensor([-5.0, -5.0, -6.0, -9.0])  # group 0 wins with -4.5 against -5.5
    out = select_experts(logits, 2, config, bias)
    assert set(out.ids[0].tolist()) == {0, 1}


@settings(max_examples=25, deadline=None)
@given(
    n_group=st.sampled_from([1, 2, 4, 8]),
    group_size=st.integers(1, 4),
    data=st.data(),
    scoring=st.sampled_from([SIGMOID, SOFTMAX]),
    group_score=st.sampled_from(list(GroupScore)),
    renormalize=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_topk_property(
    n_group: int, group_size: int, data: st.DataObject, scoring: Scoring, group_score: GroupScore,
    renormalize: bool, with_bias: bool, seed: int,
) -> None:
    num_experts = n_group * group_size
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    top_k = data.draw(st.integers(1, topk_group * group_size), label="top_k")
    tokens = data.draw(st.integers(0, 24), label="tokens")
    config = RoutingConfig(scoring=scoring, renormalize=renormalize, n_group=n_group,
                           topk_group=topk_group, group_score=group_score, selection_bias=with_bias)
    bias = _bias(num_experts, seed=seed + 1) if with_bias else None
    assert_matches_reference(_logits(tokens, num_experts, seed=seed), top_k, config, bias)


@settings(max_examples=25, deadline=None)
@given(
    num_experts=st.integers(1, 16),
    data=st.data(),
    scoring=st.sampled_from([SIGMOID, SOFTMAX]),
    order=st.sampled_from([SCORE_FIRST, SELECT_FIRST]),
    renormalize=st.booleans(),
    with_bias=st.booleans(),
    scaling=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 2**16),
)
def test_ungrouped_topk_property(
    num_experts: int, data: st.DataObject, scoring: Scoring, order: ScoreOrder, renormalize: bool,
    with_bias: bool, scaling: float, seed: int,
) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    tokens = data.draw(st.integers(0, 32), label="tokens")
    config = RoutingConfig(scoring=scoring, order=order, renormalize=renormalize,
                           selection_bias=with_bias, routed_scaling_factor=scaling)
    bias = _bias(num_experts, seed=seed + 1) if with_bias else None
    assert_matches_reference(_logits(tokens, num_experts, seed=seed), top_k, config, bias)


# -- routed scaling factor -------------------------------------------------------------------------


def _routed_spec(stage: mf.Stage, experts: int, hidden: int = 16,
                 dtype: torch.dtype = torch.bfloat16) -> mf.Spec:
    return mf.Pipeline([stage], mf.input_spec(hidden, dtype, experts)).output_spec


@pytest.mark.parametrize("in_weights", [True, False])
def test_routed_scaling_factor_folded_or_pending(in_weights: bool) -> None:
    config = RoutingConfig(scoring=SIGMOID, routed_scaling_factor=2.5, scaling_in_weights=in_weights)
    logits = _logits(20, 8, seed=13)
    out = select_experts(logits, 2, config)
    plain = select_experts(logits, 2, attrs_evolve(config, routed_scaling_factor=1.0))
    assert torch.equal(out.ids, plain.ids)
    if in_weights:
        torch.testing.assert_close(out.weights, plain.weights * 2.5)
        torch.testing.assert_close(out.weights.sum(-1), torch.full((20,), 2.5))
    else:
        assert torch.equal(out.weights, plain.weights)
    spec = _routed_spec(mf.TopK(8, 2, config), 8)
    want = mf.ScalingFactor.IN_WEIGHTS if in_weights else mf.ScalingFactor.PENDING
    assert spec.scaling_factor is want


def test_no_scaling_factor_gives_scaling_spec_none() -> None:
    assert _routed_spec(mf.TopK(8, 2), 8).scaling_factor is mf.ScalingFactor.NONE
    # A factor of exactly 1 is no factor, wherever it was said to be applied.
    config = RoutingConfig(routed_scaling_factor=1.0, scaling_in_weights=False)
    assert _routed_spec(mf.TopK(8, 2, config), 8).scaling_factor is mf.ScalingFactor.NONE


def test_pending_scaling_factor_must_be_applied_by_the_combine() -> None:
    config = RoutingConfig(routed_scaling_factor=2.5, scaling_in_weights=False)
    with pytest.raises(mf.ContractError) as error:
        mf.MoELayer(8, 2, 16, 8, routing=config, dtype=torch.float32).pipeline.replace(
            -1, mf.Combine())
    assert error.value.field == "scaling_factor"
    layer = mf.MoELayer(8, 2, 16, 8, routing=config, dtype=torch.float32)
    assert layer.pipeline.output_spec.scaling_factor is mf.ScalingFactor.APPLIED


def attrs_evolve(config: RoutingConfig, **changes: object) -> RoutingConfig:
    import attrs

    return attrs.evolve(config, **changes)


# -- precision, ties, sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "config",
    [
        RoutingConfig(),
        RoutingConfig(renormalize=False),
        RoutingConfig(order=SELECT_FIRST),
        RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ],
    ids=["softmax", "softmax-norenorm", "select-then-softmax", "grouped-sigmoid"],
)
def test_routing_runs_in_fp32_for_half_logits(dtype: torch.dtype, config: RoutingConfig) -> None:
    logits = _logits(32, 16, seed=14, scale=3.0).to(dtype)
    out = select_experts(logits, 4, config)
    as_fp32 = select_experts(logits.float(), 4, config)
    assert out.weights.dtype == torch.float32 and out.ids.dtype == torch.int32
    assert torch.equal(out.ids, as_fp32.ids)
    assert torch.equal(out.weights, as_fp32.weights)


def test_half_logits_weights_are_not_rounded_to_half() -> None:
    """The softmax is taken in fp32: its weights are not representable in bf16 in general."""
    logits = _logits(32, 16, seed=15).bfloat16()
    weights = select_experts(logits, 4, RoutingConfig()).weights
    assert not torch.equal(weights, weights.bfloat16().float())


def test_topk_stage_output_is_fp32_for_bf16_input() -> None:
    stage = mf.TopK(8, 2)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    routed = stage(mf.MoEInput(x, _logits(5, 8, seed=16).bfloat16()))
    assert routed.topk.weights.dtype == torch.float32
    assert routed.topk.ids.dtype == torch.int32
    assert routed.x.data is x and routed.x.scale is None


@pytest.mark.parametrize(
    "config",
    [
        RoutingConfig(),
        RoutingConfig(renormalize=False),
        RoutingConfig(scoring=SIGMOID),
        RoutingConfig(order=SELECT_FIRST),
        RoutingConfig(scoring=SIGMOID, order=SELECT_FIRST, renormalize=False),
        RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=2),
        RoutingConfig(n_group=4, topk_group=3, group_score=GroupScore.MAX),
    ],
)
@pytest.mark.parametrize("top_k", [1, 3, 4])
def test_all_equal_logits_pick_the_lowest_expert_ids(config: RoutingConfig, top_k: int) -> None:
    logits = torch.full((3, 8), 0.25)
    out = select_experts(logits, top_k, config)
    for row in out.ids.tolist():
        assert sorted(row) == list(range(top_k))
    if config.renormalize or config.order is SELECT_FIRST and config.scoring is SOFTMAX:
        torch.testing.assert_close(out.weights, torch.full((3, top_k), 1 / top_k))


def test_partial_tie_goes_to_the_lower_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    for config in (RoutingConfig(), RoutingConfig(scoring=SIGMOID), RoutingConfig(order=SELECT_FIRST)):
        out = select_experts(logits, 2, config)
        assert set(out.ids[0].tolist()) == {1, 2}
        assert set(out.ids[1].tolist()) == {0, 1}


def test_tied_groups_go_to_the_lower_group_index() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0]])  # groups: (0,1) (2,2) (2,2) (0,1)
    config = RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=1)
    assert set(select_experts(logits, 2, config).ids[0].tolist()) == {2, 3}
    config = RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=1, group_score=GroupScore.MAX)
    assert set(select_experts(logits, 2, config).ids[0].tolist()) == {2, 3}


@pytest.mark.parametrize(
    "config",
    [RoutingConfig(), RoutingConfig(renormalize=False), RoutingConfig(scoring=SIGMOID, renormalize=False),
     RoutingConfig(order=SELECT_FIRST), RoutingConfig(scoring=SIGMOID, n_group=2, topk_group=2)],
)
def test_top_k_equal_to_num_experts_selects_everyone(config: RoutingConfig) -> None:
    logits = _logits(10, 6, seed=17)
    out = select_experts(logits, 6, config)
    for row in out.ids.tolist():
        assert sorted(row) == list(range(6))
    assert_matches_reference(logits, 6, config)
    if config.scoring is SOFTMAX and (config.renormalize or config.order is SELECT_FIRST):
        # Softmax over everyone, renormalised or not, is the full softmax.
        full = logits.softmax(-1).gather(-1, out.ids.long())
        torch.testing.assert_close(out.weights, full)


@pytest.mark.parametrize("config", [RoutingConfig(), RoutingConfig(order=SELECT_FIRST),
                                    RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=2)])
def test_one_token(config: RoutingConfig) -> None:
    logits = _logits(1, 8, seed=18)
    assert assert_matches_reference(logits, 3, config) == 1


@pytest.mark.parametrize("config", [RoutingConfig(), RoutingConfig(order=SELECT_FIRST),
                                    RoutingConfig(scoring=SIGMOID, selection_bias=True, n_group=4,
                                                  topk_group=2, routed_scaling_factor=2.5)])
def test_zero_tokens(config: RoutingConfig) -> None:
    bias = torch.zeros(8) if config.selection_bias else None
    out = select_experts(torch.empty(0, 8), 3, config, bias)
    assert out.ids.shape == (0, 3) and out.ids.dtype == torch.int32
    assert out.weights.shape == (0, 3) and out.weights.dtype == torch.float32
    stage = mf.TopK(8, 3, config, bias)
    routed = stage(mf.MoEInput(torch.empty(0, 16), torch.empty(0, 8)))
    routed.check(_routed_spec(stage, 8, dtype=torch.float32))


def test_non_contiguous_logits() -> None:
    logits = _logits(16, 12, seed=19)
    transposed = logits.t().contiguous().t()
    assert not transposed.is_contiguous()
    for config in (RoutingConfig(), RoutingConfig(scoring=SIGMOID, n_group=4, topk_group=2),
                   RoutingConfig(order=SELECT_FIRST)):
        a, b = select_experts(logits, 3, config), select_experts(transposed, 3, config)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


# -- invalid configurations ------------------------------------------------------------------------


def test_top_k_larger_than_num_experts() -> None:
    with pytest.raises(mf.InputError, match="top_k"):
        mf.TopK(4, 5)
    with pytest.raises(mf.InputError, match="top_k"):
        mf.CustomTopK(4, 5, lambda h, l, k: (l, l))
    with pytest.raises(mf.InputError, match="top_k"):
        select_experts(_logits(3, 4), 5, RoutingConfig())
    with pytest.raises(mf.InputError, match="top_k"):
        mf.MoELayer(4, 5, 16, 8)


def test_top_k_zero_and_no_experts() -> None:
    with pytest.raises(mf.InputError, match="top_k"):
        mf.TopK(4, 0)
    with pytest.raises(mf.InputError, match="num_experts"):
        mf.TopK(0, 1)


def test_n_group_must_divide_num_experts() -> None:
    config = RoutingConfig(n_group=3, topk_group=1)
    with pytest.raises(mf.InputError, match="n_group"):
        mf.TopK(8, 2, config)
    with pytest.raises(mf.InputError, match="n_group"):
        select_experts(_logits(3, 8), 2, config)


def test_topk_group_larger_than_n_group() -> None:
    config = RoutingConfig(n_group=2, topk_group=3)
    with pytest.raises(mf.InputError, match="topk_group"):
        mf.TopK(8, 2, config)
    with pytest.raises(mf.InputError, match="topk_group"):
        select_experts(_logits(3, 8), 2, config)


def test_top_k_larger_than_the_kept_groups() -> None:
    config = RoutingConfig(n_group=4, topk_group=1)  # one group of 2 experts
    with pytest.raises(mf.InputError, match="top_k"):
        mf.TopK(8, 3, config)
    with pytest.raises(mf.InputError, match="top_k"):
        select_experts(_logits(3, 8), 3, config)


@pytest.mark.parametrize("kwargs", [{"n_group": 4}, {"topk_group": 2}])
def test_n_group_and_topk_group_go_together(kwargs: dict[str, int]) -> None:
    with pytest.raises(mf.InputError, match="together"):
        RoutingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_group": 0, "topk_group": 1},
        {"n_group": 2, "topk_group": 0},
        {"n_group": 2, "topk_group": 1, "order": SELECT_FIRST},
        {"apply_weights": mf.RoutingWeights.PENDING},
    ],
)
def test_other_invalid_routing_configs(kwargs: dict[str, object]) -> None:
    with pytest.raises(mf.InputError):
        RoutingConfig(**kwargs)  # type: ignore[arg-type]


def test_input_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        mf.TopK(4, 5)


# -- the stages' contracts -------------------------------------------------------------------------


def test_topk_stage_spec_and_payload() -> None:
    stage = mf.TopK(8, 2, RoutingConfig(scoring=SIGMOID, routed_scaling_factor=2.5))
    pipeline = mf.Pipeline([stage], mf.input_spec(32, torch.bfloat16, 8), debug=True)
    spec = pipeline.output_spec
    assert spec.kind is mf.PayloadKind.ROUTED
    assert spec.layout is mf.Layout.TOKEN_MAJOR
    assert spec.dtype is mf.DType.BF16 and spec.width == 32
    assert spec.top_k == 2 and spec.num_experts == 8
    assert spec.routing_weights is mf.RoutingWeights.PENDING
    assert spec.scaling_factor is mf.ScalingFactor.IN_WEIGHTS
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    routed = pipeline(mf.MoEInput(x, _logits(7, 8, seed=20)))
    routed.check(spec)
    assert "k=2" in stage.summary() and "x2.5" in stage.summary()


def test_topk_stage_rejects_a_different_number_of_experts() -> None:
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(8, 2)], mf.input_spec(16, torch.float32, 16))
    assert error.value.field == "num_experts"
    assert "TopK" in error.value.consumer


def test_custom_topk_runs_the_user_function() -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def route(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((hidden, logits, k))
        values, ids = logits.double().topk(k, dim=-1)  # fp64 weights, int64 ids: converted
        return values.softmax(-1), ids

    stage = mf.CustomTopK(8, 2, route, label="mine", scaling_factor=mf.ScalingFactor.IN_WEIGHTS)
    pipeline = mf.Pipeline([stage], mf.input_spec(16, torch.float32, 8), debug=True)
    assert pipeline.output_spec.scaling_factor is mf.ScalingFactor.IN_WEIGHTS
    assert pipeline.output_spec.top_k == 2
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    logits = _logits(5, 8, seed=21)
    routed = pipeline(mf.MoEInput(x, logits))
    assert seen[0][0] is x and seen[0][1] is logits and seen[0][2] == 2
    assert routed.topk.weights.dtype == torch.float32 and routed.topk.ids.dtype == torch.int32
    expected = select_experts(logits, 2, RoutingConfig(order=SELECT_FIRST))
    assert torch.equal(routed.topk.ids, expected.ids)
    torch.testing.assert_close(routed.topk.weights, expected.weights)
    assert stage.summary() == "CustomTopK(mine, k=2)"


def test_custom_topk_with_bad_output_is_a_clear_error() -> None:
    """A user routing function that returns the wrong k or out-of-range ids is caught at the stage,
    with or without debug mode (an id >= E would otherwise index the expert weights out of range)."""
    def wrong_k(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = logits.topk(k + 1, dim=-1)
        return values, ids

    def out_of_range(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = logits.topk(k, dim=-1)
        return values, ids + 8

    x, logits = torch.randn(4, 16), _logits(4, 8)
    for fn, message in ((wrong_k, "shape"), (out_of_range, "ids")):
        for debug in (False, True):
            pipeline = mf.Pipeline([mf.CustomTopK(8, 2, fn)], mf.input_spec(16, torch.float32, 8),
                                   debug=debug)
            with pytest.raises(mf.InputError, match=message):
                pipeline(mf.MoEInput(x, logits))
