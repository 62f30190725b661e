"""The Triton routing kernel against the torch ``TopK`` stage over every small routing configuration.

A configuration is ``(num_experts, n_group, topk_group, top_k, group_score, scoring, order, renormalize,
selection bias, group_mask_value, scaling factor)``. Without a GPU the kernel runs in Triton's
interpreter (``tests/conftest.py``) at 10-30 ms a launch: the full product up to 8 experts (4,000+
launches) would take minutes. So:

* every *shape* up to 6 experts (every grouping, every ``top_k``) runs with every group score × scoring
  (grouped) or scoring × order (not grouped); the other options (renormalize, selection bias, mask value,
  scaling) take turns so that each of those 8 choices meets every combination of them;
* every combination of all the options runs on the shapes that reach the kernel's distinct paths (one
  expert, groups of one expert, padding columns and groups, ``topk_group == n_group``,
  ``top_k == num_experts``, every expert of the kept groups picked);
* hypothesis draws from the whole product up to 16 experts, with token counts that take several programs
  and logits with experts along the slow dimension.

A launch routes 16 tokens (one program): a row of zeros and a row of pairs of equal logits, where the
lower index must win every tie, then random rows. Two fp32 implementations may order two values a few
ulps apart differently, so a token whose routing turns on such a near-tie (found in fp64) is not
compared; exact ties are. Ids are compared exactly (the kernel promises the reference's order), weights
within fp32 tolerance; every token must get distinct ids in range, near-tie or not.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.kernels import topk  # noqa: E402
from moeforge.stages.triton import TritonTopK  # noqa: E402
from moeforge.stages.topk import topk_lowest_index  # noqa: E402
from moeforge.testing import default_settings  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EXPERTS = (1, 2, 3, 4, 6)  # every shape of these sizes; larger ones in PATH_SHAPES and the drawn cases
TOKENS = 16
TIE = 1e-5  # fp64 gap under which fp32 implementations may disagree on an order

Grouping = tuple[Optional[int], Optional[int]]
Shape = tuple[int, int, Grouping]  # (num_experts, top_k, (n_group, topk_group))
Primary = tuple[mf.GroupScore, mf.Scoring, mf.ScoreOrder]
Secondary = tuple[bool, bool, float, tuple[float, bool]]

# (routed_scaling_factor, scaling_in_weights)
SCALINGS = ((1.0, True), (2.5, True), (2.5, False))


def _groupings(num_experts: int) -> list[Grouping]:
    """No grouping, then every (n_group, topk_group) the sizes allow."""
    divisors = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
    return [(None, None)] + [(n_group, topk_group) for n_group in divisors for topk_group in range(1, n_group + 1)]


def _top_ks(num_experts: int, grouping: Grouping) -> range:
    n_group, topk_group = grouping
    if n_group is None or topk_group is None:
        return range(1, num_experts + 1)
    return range(1, min(num_experts, topk_group * (num_experts // n_group)) + 1)


def _shapes(num_experts: int) -> list[Shape]:
    return [(num_experts, k, grouping) for grouping in _groupings(num_experts) for k in _top_ks(num_experts, grouping)]


def _primaries(grouping: Grouping) -> list[Primary]:
    """Group score × scoring when grouped (grouped top-k scores first), scoring × order when not."""
    if grouping[0] is None:
        return [(mf.GroupScore.SUM_TOP2, scoring, order) for scoring in mf.Scoring for order in mf.ScoreOrder]
    return [(group_score, scoring, mf.ScoreOrder.SCORE_THEN_SELECT)
            for group_score in mf.GroupScore for scoring in mf.Scoring]


def _config(grouping: Grouping, group_score: mf.GroupScore, scoring: mf.Scoring, order: mf.ScoreOrder,
            renormalize: bool, bias: bool, fill: float, scaling: tuple[float, bool]) -> mf.RoutingConfig:
    return mf.RoutingConfig(scoring=scoring, order=order, renormalize=renormalize, selection_bias=bias,
                            n_group=grouping[0], topk_group=grouping[1], group_score=group_score,
                            group_mask_value=fill, routed_scaling_factor=scaling[0], scaling_in_weights=scaling[1])


# -- inputs and comparison ----------------------------------------------------------------------------


def _inputs(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (zeros and equal pairs first) and a mostly negative selection bias, so that a dropped group's
    0.0 fill can beat a kept expert."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    if tokens > 2:
        logits[0] = 0.0
        logits[1] = (torch.arange(experts) // 2).float().flip(0) * 0.7 - 1.0
    bias = torch.randn(experts, generator=gen) * 0.5 - 0.3
    return logits.to(DEVICE), bias.to(DEVICE)


def _settled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An exact tie (both sides take the lower index) or a gap no fp32 rounding closes."""
    return (a == b) | ((a - b).abs() > TIE)


def _decided(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, config: mf.RoutingConfig) -> torch.Tensor:
    """Per token, whether each comparison the routing makes is settled, computed in fp64: the kept groups
    against the best dropped one, and the chosen experts in order against each other and the next one."""
    x = logits.double()
    shift = bias.double() if bias is not None else x.new_zeros(x.shape[1])
    if config.order is mf.ScoreOrder.SELECT_THEN_SCORE:
        choice = x + shift
    else:
        choice = (x.softmax(-1) if config.scoring is mf.Scoring.SOFTMAX else x.sigmoid()) + shift
    ok = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if config.n_group is not None and config.topk_group is not None and config.topk_group < config.n_group:
        grouped = choice.reshape(x.shape[0], config.n_group, x.shape[1] // config.n_group)
        if config.group_score is mf.GroupScore.SUM_TOP2:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1)
        else:
            group_scores = grouped.max(-1).values
        ordered = group_scores.sort(-1, descending=True).values
        ok &= _settled(ordered[:, config.topk_group - 1], ordered[:, config.topk_group])
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, topk_lowest_index(group_scores, config.topk_group), True)
        choice = grouped.masked_fill(~kept[..., None], config.group_mask_value).reshape(x.shape)
    ordered = choice.sort(-1, descending=True).values[:, :top_k + 1]
    for i in range(ordered.shape[1] - 1):
        ok &= _settled(ordered[:, i], ordered[:, i + 1])
    return ok


def _reference(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
               config: mf.RoutingConfig) -> mf.TopKOutput:
    stage = mf.TopK(logits.shape[1], top_k, config, bias)
    return stage(mf.MoEInput(logits.new_zeros(logits.shape[0], 1), logits)).topk


def _assert_matches(got: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, bias: Optional[torch.Tensor],
                    top_k: int, config: mf.RoutingConfig, min_decided: int = 0) -> None:
    weights, ids = got
    what = f"E={logits.shape[1]} k={top_k} {config}"
    # Every token, near-tie or not: distinct ids in range (a repeated pick would send a token twice to one
    # expert, an id past E would index past the expert weights).
    if ids.numel():
        assert int(ids.min()) >= 0 and int(ids.max()) < logits.shape[1], what
    assert all(len(set(row)) == top_k for row in ids.tolist()), what
    decided = _decided(logits, bias if config.selection_bias else None, top_k, config)
    assert int(decided.sum()) >= min_decided, what
    ref = _reference(logits, bias if config.selection_bias else None, top_k, config)
    assert torch.equal(ids[decided], ref.ids[decided]), what
    torch.testing.assert_close(weights[decided], ref.weights[decided], atol=1e-6, rtol=1e-5, msg=what)


class _Launches:
    """Kernel results by launch arguments: configs whose flags coincide (e.g. a softmax over the chosen k
    with or without renormalize) share one launch, and each is still checked against its own reference."""

    def __init__(self, logits: torch.Tensor, bias: torch.Tensor) -> None:
        self.logits, self.bias = logits, bias
        self.results: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}

    def check(self, top_k: int, config: mf.RoutingConfig) -> None:
        flags = topk.routing_flags(config)
        key = (top_k, config.selection_bias, tuple(sorted(flags.items())))
        if key not in self.results:
            bias = self.bias if config.selection_bias else None
            self.results[key] = topk.route(self.logits, bias, top_k, **flags)
        _assert_matches(self.results[key], self.logits, self.bias, top_k, config, min_decided=TOKENS * 3 // 4)


# -- every shape --------------------------------------------------------------------------------------


def _secondaries(grouping: Grouping) -> list[Secondary]:
    """(renormalize, selection bias, group_mask_value, scaling); the mask value only matters with groups."""
    fills = (float("-inf"), 0.0) if grouping[0] is not None else (float("-inf"),)
    return list(itertools.product((True, False), (True, False), fills, SCALINGS))


def _schedule() -> list[tuple[Shape, Primary, Secondary]]:
    """Every shape with each of its 4 primaries. The j-th shape of its kind (grouped or not, counted over
    all sizes) gives its p-th primary the (j + 7p)-th secondary, cyclically: the 4 primaries of a shape
    get different ones, and each primary meets all secondaries of its kind (12 or 24) over as many shapes
    of that kind (16 and 83 here)."""
    schedule = []
    seen = {False: 0, True: 0}
    for num_experts in EXPERTS:
        for shape in _shapes(num_experts):
            grouping = shape[2]
            grouped = grouping[0] is not None
            j = seen[grouped]
            seen[grouped] += 1
            secondaries = _secondaries(grouping)
            for p, primary in enumerate(_primaries(grouping)):
                schedule.append((shape, primary, secondaries[(j + 7 * p) % len(secondaries)]))
    return schedule


SCHEDULE = _schedule()


def test_the_schedule_pairs_every_primary_with_every_secondary() -> None:
    met: dict[tuple[Grouping, Primary], set[Secondary]] = {}
    for (_, _, grouping), primary, secondary in SCHEDULE:
        kind = (None, None) if grouping[0] is None else (1, 1)
        met.setdefault((kind, primary), set()).add(secondary)
    assert len(met) == 8
    assert all(secondaries == set(_secondaries(kind)) for (kind, _), secondaries in met.items())


@pytest.mark.parametrize("num_experts", EXPERTS)
def test_every_shape_group_score_scoring_and_order(num_experts: int) -> None:
    launches = _Launches(*_inputs(TOKENS, num_experts, seed=num_experts))
    for (experts, k, grouping), (group_score, scoring, order), secondary in SCHEDULE:
        if experts == num_experts:
            launches.check(k, _config(grouping, group_score, scoring, order, *secondary))


# -- every option on the shapes that reach the kernel's distinct paths ---------------------------------

PATH_SHAPES: dict[str, Shape] = {
    "one expert": (1, 1, (None, None)),
    "padding columns": (6, 2, (None, None)),
    "k = E, no padding": (8, 8, (None, None)),
    "groups of one expert": (4, 2, (4, 2)),  # the case of issue 10
    "groups of two, padding groups": (6, 3, (3, 2)),
    "one group of four kept, k = its experts": (8, 4, (2, 1)),
    "topk_group = n_group": (8, 3, (4, 4)),
}


@pytest.mark.parametrize("name", sorted(PATH_SHAPES))
def test_every_option_combination(name: str) -> None:
    num_experts, k, grouping = PATH_SHAPES[name]
    launches = _Launches(*_inputs(TOKENS, num_experts, seed=100 + num_experts))
    for primary in _primaries(grouping):
        for secondary in _secondaries(grouping):
            launches.check(k, _config(grouping, *primary, *secondary))


# -- the whole product, drawn --------------------------------------------------------------------------


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, int, mf.RoutingConfig]:
    num_experts = draw(st.sampled_from((1, 2, 3, 4, 5, 6, 7, 8, 12, 16)))
    grouping = draw(st.sampled_from(_groupings(num_experts)))
    k = draw(st.sampled_from(list(_top_ks(num_experts, grouping))))
    group_score, scoring, order = draw(st.sampled_from(_primaries(grouping)))
    config = _config(grouping, group_score, scoring, order, draw(st.booleans()), draw(st.booleans()),
                     draw(st.sampled_from([float("-inf"), 0.0, -0.25])), draw(st.sampled_from(SCALINGS)))
    return num_experts, k, config


@default_settings(max_examples=30)
@given(case=_cases(), tokens=st.sampled_from([0, 1, 3, 17, 40]), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_drawn_configurations(case: tuple[int, int, mf.RoutingConfig], tokens: int, strided: bool,
                              seed: int) -> None:
    num_experts, k, config = case
    logits, bias = _inputs(tokens, num_experts, seed)
    if strided:  # experts along the slow dimension: the kernel must read both strides
        logits = logits.t().contiguous().t()
    bias_arg = bias if config.selection_bias else None
    got = topk.route(logits, bias_arg, k, **topk.routing_flags(config))
    _assert_matches(got, logits, bias, k, config)


# -- the reported case and other edges -----------------------------------------------------------------


def test_groups_of_one_expert_are_scored_by_that_expert() -> None:
    """Issue 10: 4 experts in 4 groups under SUM_TOP2 sent every token to [0, 0]; a group of one expert
    has no second best, and the reference scores it by its only expert."""
    config = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, n_group=4, topk_group=2,
                              group_score=mf.GroupScore.SUM_TOP2)
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x = mf.MoEInput(torch.zeros(16, 1, device=DEVICE), logits)
    got, want = TritonTopK(4, 2, config)(x).topk, mf.TopK(4, 2, config)(x).topk
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)
    # ...and the torch stage's choice is the two best experts: each group holds one.
    assert torch.equal(want.ids.long(), logits.topk(2).indices)


@pytest.mark.parametrize("order", list(mf.ScoreOrder))
def test_all_experts_masked_picks_distinct_experts(order: mf.ScoreOrder) -> None:
    """Every logit -inf (sigmoid, so the weights stay finite): every value ties at -inf, and the picks must
    still be k distinct experts, the lowest first, as in the reference."""
    config = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, order=order, renormalize=False)
    logits = torch.full((3, 6), float("-inf"), device=DEVICE)
    weights, ids = topk.route(logits, None, 4, **topk.routing_flags(config))
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    ref = mf.stages.select_experts(logits, 4, config)
    assert torch.equal(ids, ref.ids)
    torch.testing.assert_close(weights, ref.weights)


@pytest.mark.parametrize("group_score", list(mf.GroupScore))
@pytest.mark.parametrize("n_group", [2, 4, 8])
def test_experts_masked_by_the_selection_bias(group_score: mf.GroupScore, n_group: int) -> None:
    """A -inf selection bias on 5 of 8 experts: whole groups score -inf, and so do the experts past the
    kept ones; groups and experts are still picked once each, by the reference's rule."""
    bias = torch.tensor([0.0, -math.inf, -math.inf, 0.1, -math.inf, -math.inf, -math.inf, 0.2], device=DEVICE)
    logits, _ = _inputs(TOKENS, 8, seed=7)
    for topk_group in range(1, n_group + 1):
        config = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=n_group,
                                  topk_group=topk_group, group_score=group_score)
        k = min(8, topk_group * (8 // n_group))
        got = topk.route(logits, bias, k, **topk.routing_flags(config))
        _assert_matches(got, logits, bias, k, config, min_decided=TOKENS * 3 // 4)


def test_nan_logits_still_give_distinct_ids_in_range() -> None:
    """NaN logits give NaN weights (the layer's checks catch them before), but never an id that would
    index past the experts or route a token twice to one expert."""
    logits, bias = _inputs(TOKENS, 8, seed=3)
    logits[::2, 3] = float("nan")
    logits[1] = float("nan")
    configs = [
        mf.RoutingConfig(),
        mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE),
        mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4, topk_group=2),
        mf.RoutingConfig(selection_bias=True, n_group=4, topk_group=2, group_score=mf.GroupScore.MAX,
                         group_mask_value=0.0),
    ]
    for config in configs:
        _, ids = topk.route(logits, bias if config.selection_bias else None, 4,
                            **topk.routing_flags(config))
        assert 0 <= int(ids.min()) and int(ids.max()) < 8
        assert all(len(set(row)) == 4 for row in ids.tolist()), config
