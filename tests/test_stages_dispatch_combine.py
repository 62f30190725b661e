"""Dispatch (expert-sorted and expert-padded) and combine, alone and as a round trip."""

from __future__ import annotations

from typing import Optional, Union

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.stages import dequantize
from moeforge.stages.dispatch import SortedPlan

FP8 = mf.DType.FP8_E4M3
H = 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, uniformly at random."""
    gen = _gen(seed)
    rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64)
    return ids.to(torch.int32)


def _routed(
    tokens: int,
    experts: int,
    top_k: int,
    *,
    seed: int = 0,
    hidden: int = H,
    dtype: torch.dtype = torch.float32,
    ids: Optional[torch.Tensor] = None,
) -> mf.RoutedTokens:
    gen = _gen(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    if ids is None:
        ids = _random_ids(tokens, experts, top_k, seed + 1)
    return mf.RoutedTokens(mf.Activations(x), mf.TopKOutput(weights.float(), ids.to(torch.int32)))


def _routed_spec(experts: int, top_k: int, hidden: int = H, dtype: torch.dtype = torch.float32,
                 quantizer: Optional[mf.stages.Quantizer] = None,
                 routing: mf.RoutingConfig = mf.RoutingConfig()) -> mf.Spec:
    stages: list[mf.Stage] = [mf.TopK(experts, top_k, routing)]
    if quantizer is not None:
        stages.append(mf.QuantizeTokens(quantizer))
    return mf.Pipeline(stages, mf.input_spec(hidden, dtype, experts)).output_spec


def _dispatched_spec(dispatch: mf.Stage, experts: int, top_k: int, **kwargs: object) -> mf.Spec:
    spec = _routed_spec(experts, top_k, **kwargs)  # type: ignore[arg-type]
    assert not dispatch.check(spec)
    return dispatch.output_spec(spec)


def _copies_of(ids: torch.Tensor, expert: int) -> list[tuple[int, int]]:
    """The (token, k) copies routed to ``expert``, in (token, k) order."""
    return [(t, k) for t in range(ids.shape[0]) for k in range(ids.shape[1]) if int(ids[t, k]) == expert]


def _scaling_experts(experts: int, hidden: int = H) -> tuple[mf.GroupedGemm, mf.GroupedGemm]:
    """Two GEMMs that together multiply expert ``e``'s rows by ``e + 1`` (exactly, in fp32)."""
    eye = torch.eye(hidden).expand(experts, hidden, hidden)
    factor = torch.arange(1, experts + 1, dtype=torch.float32).view(experts, 1, 1)
    return (mf.GroupedGemm(mf.GemmRole.GATE_UP, (eye * factor).contiguous()),
            mf.GroupedGemm(mf.GemmRole.DOWN, eye.contiguous()))


ON_INPUT = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)

# The experts here are linear maps: the identity activation between their two GEMMs says so.
IDENTITY = mf.Activate(mf.ActivationConfig(mf.ActivationKind.IDENTITY))


def _identity_experts(experts: int, hidden: int = H) -> tuple[mf.GroupedGemm, mf.GroupedGemm]:
    eye = torch.eye(hidden).expand(experts, hidden, hidden).contiguous()
    return mf.GroupedGemm(mf.GemmRole.GATE_UP, eye), mf.GroupedGemm(mf.GemmRole.DOWN, eye)


# -- sorted dispatch -------------------------------------------------------------------------------


@pytest.mark.parametrize("group_list_type", [mf.GroupListType.COUNT, mf.GroupListType.CUMSUM])
def test_sorted_dispatch_groups_rows_by_expert_in_token_order(group_list_type: mf.GroupListType) -> None:
    tokens, experts, top_k = 24, 6, 2
    routed = _routed(tokens, experts, top_k, seed=1)
    dispatch = mf.SortedDispatch(experts, group_list_type)
    out = dispatch(routed)
    out.check(_dispatched_spec(dispatch, experts, top_k))
    ids, x = routed.topk.ids, routed.x.data
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    assert out.group_list.dtype == torch.int64
    expected_list = counts if group_list_type is mf.GroupListType.COUNT else counts.cumsum(0)
    assert torch.equal(out.group_list, expected_list)
    assert torch.equal(out.counts(), counts)
    assert out.num_experts == experts and out.group_list_type is group_list_type
    row = 0
    for expert in range(experts):
        for token, k in _copies_of(ids, expert):
            assert float(out.row_weights[row]) == float(routed.topk.weights[token, k])
            assert int(out.plan.token_rows[token, k]) == row
            assert torch.equal(out.x.data[row], x[token])
            row += 1
    assert row == tokens * top_k == out.x.data.shape[0]
    assert out.plan.token_rows.shape == (tokens, top_k)
    assert torch.equal(out.plan.copy_weights, routed.topk.weights)  # token-major: nothing to permute back
    assert out.x.scale is None


def test_sorted_dispatch_spec() -> None:
    spec = _dispatched_spec(mf.SortedDispatch(8, mf.GroupListType.CUMSUM), 8, 2)
    assert spec.kind is mf.PayloadKind.DISPATCHED
    assert spec.layout is mf.Layout.EXPERT_SORTED
    assert spec.group_list_type is mf.GroupListType.CUMSUM
    assert spec.expert_ids is mf.ExpertIds.LOCAL
    assert spec.routing_weights is mf.RoutingWeights.PENDING
    assert spec.width == H and spec.num_experts == 8 and spec.top_k == 2


def test_sorted_plan_is_a_permutation() -> None:
    routed = _routed(30, 8, 3, seed=2)
    out = mf.SortedDispatch(8)(routed)
    rows = out.plan.token_rows.reshape(-1)
    assert torch.equal(rows.sort().values, torch.arange(90))
    assert torch.equal(out.x.data[out.plan.token_rows], routed.x.data.unsqueeze(1).expand(30, 3, H))


def test_payload_check_catches_a_wrong_group_list() -> None:
    dispatch = mf.SortedDispatch(4)
    spec = _dispatched_spec(dispatch, 4, 2)
    out = dispatch(_routed(8, 4, 2))
    bad = mf.SortedRows(out.x, out.group_list + 1, out.group_list_type, out.row_weights, plan=out.plan)
    with pytest.raises(mf.errors.PayloadError, match="rows covered"):
        bad.check(spec)
    cumsum = mf.SortedRows(out.x, out.group_list.cumsum(0), mf.GroupListType.CUMSUM, out.row_weights,
                           plan=out.plan)
    with pytest.raises(mf.errors.PayloadError, match="group_list_type"):
        cumsum.check(spec)


# -- padded dispatch -------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [None, 40])
def test_padded_dispatch_layout(capacity: Optional[int]) -> None:
    tokens, experts, top_k = 20, 5, 2
    routed = _routed(tokens, experts, top_k, seed=3)
    dispatch = mf.PaddedDispatch(experts, capacity)
    out = dispatch(routed)
    spec = _dispatched_spec(dispatch, experts, top_k)
    assert spec.layout is mf.Layout.EXPERT_PADDED and spec.group_list_type is None
    assert spec.expert_ids is mf.ExpertIds.LOCAL
    out.check(spec)
    cap = capacity if capacity is not None else tokens
    assert out.x.data.shape == (experts, cap, H) and out.capacity == cap
    ids, x = routed.topk.ids, routed.x.data
    assert out.masked_m.tolist() == torch.bincount(ids.reshape(-1).long(), minlength=experts).tolist()
    assert int(out.plan.dropped) == 0 and out.plan.token_slots.shape == (tokens, top_k)
    for expert in range(experts):
        copies = _copies_of(ids, expert)
        for position, (token, k) in enumerate(copies):
            assert torch.equal(out.x.data[expert, position], x[token])
            assert float(out.slot_weights[expert, position]) == float(routed.topk.weights[token, k])
            assert int(out.plan.token_slots[token, k]) == expert * cap + position
        # Slots past masked_m are empty: zero rows, zero weights.
        assert bool((out.x.data[expert, len(copies):] == 0).all())
        assert bool((out.slot_weights[expert, len(copies):] == 0).all())


def test_capacity_overflow_error_names_the_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [3, 2], [1, 3], [3, 0]], dtype=torch.int32)  # expert 3: 5 rows
    routed = _routed(5, 4, 2, ids=ids)
    with pytest.raises(mf.InputError, match=r"expert 3 received 5 rows.*capacity is 2"):
        mf.PaddedDispatch(4, capacity=2)(routed)
    with pytest.raises(mf.InputError, match="Overflow.DROP"):
        mf.PaddedDispatch(4, capacity=2, overflow=mf.Overflow.ERROR)(routed)
    mf.PaddedDispatch(4, capacity=5)(routed)  # exactly full is fine


def test_capacity_overflow_drop_keeps_the_first_rows_and_combine_skips_the_rest() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [2, 3], [1, 3], [3, 0], [0, 2]], dtype=torch.int32)
    routed = _routed(6, 4, 2, ids=ids, seed=4)
    capacity = 2
    out = mf.PaddedDispatch(4, capacity=capacity, overflow=mf.Overflow.DROP)(routed)
    out.check(_dispatched_spec(mf.PaddedDispatch(4, capacity=capacity, overflow=mf.Overflow.DROP), 4, 2))
    counts = torch.bincount(ids.reshape(-1).long(), minlength=4)  # [3, 2, 2, 5]
    assert int(out.plan.dropped) == int((counts - capacity).clamp(min=0).sum()) == 4
    assert out.plan.dropped.dim() == 0
    assert out.masked_m.tolist() == counts.clamp(max=capacity).tolist()
    kept: set[tuple[int, int]] = set()
    for expert in range(4):
        copies = _copies_of(ids, expert)
        kept |= set(copies[:capacity])
        for position, (token, k) in enumerate(copies[:capacity]):
            assert int(out.plan.token_slots[token, k]) == expert * capacity + position
            assert torch.equal(out.x.data[expert, position], routed.x.data[token])
        for token, k in copies[capacity:]:
            assert int(out.plan.token_slots[token, k]) == -1
    # Identity experts: each token gets back x * (sum of its kept weights).
    combined = mf.Combine()(out).hidden_states
    w = routed.topk.weights
    kept_weight = torch.tensor([[w[t, k] if (t, k) in kept else 0.0 for k in range(2)] for t in range(6)])
    torch.testing.assert_close(combined, routed.x.data * kept_weight.sum(-1, keepdim=True))


def test_dropped_copies_contribute_nothing_even_next_to_non_finite_rows() -> None:
    """A dropped copy must add exactly nothing: not 0 * (some other token's row), which is NaN when
    that row overflowed to inf."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 3]], dtype=torch.int32)
    routed = _routed(3, 4, 2, ids=ids, seed=22)
    out = mf.PaddedDispatch(4, capacity=1, overflow=mf.Overflow.DROP)(routed)
    assert int(out.plan.dropped) == 2  # tokens 1 and 2 lose their expert-0 copy
    data = out.x.data.clone()
    data[0, 0] = float("inf")  # token 0's own expert-0 output overflowed
    combined = mf.Combine()(out.with_x(mf.Activations(data))).hidden_states
    assert bool(torch.isinf(combined[0]).all())
    w = routed.topk.weights
    torch.testing.assert_close(combined[1:], routed.x.data[1:] * w[1:, 1:])


def test_combine_of_copies_that_are_all_on_other_ranks() -> None:
    """``token_rows`` is -1 for copies held elsewhere; a rank may hold no rows at all."""
    plan = SortedPlan(token_rows=torch.full((3, 2), -1, dtype=torch.int64), copy_weights=torch.rand(3, 2))
    rows = mf.SortedRows(mf.Activations(torch.empty(0, H)), torch.zeros(4, dtype=torch.int64),
                         mf.GroupListType.COUNT, torch.empty(0), plan=plan)
    for combine in (mf.Combine(), mf.Combine(apply_routing_weights=False, routed_scaling_factor=2.0)):
        out = combine(rows).hidden_states
        assert out.shape == (3, H) and bool((out == 0).all())
    # Some copies here, some elsewhere: only the local ones are summed.
    routed = _routed(5, 4, 2, seed=23)
    local = mf.SortedDispatch(4)(routed)
    remote = local.plan.token_rows.clone()
    remote[:, 1] = -1
    partial = attrs_evolve(local, plan=attrs_evolve(local.plan, token_rows=remote))
    torch.testing.assert_close(mf.Combine()(partial).hidden_states, routed.x.data * routed.topk.weights[:, :1])


def attrs_evolve(instance: object, **changes: object) -> object:
    import dataclasses

    return dataclasses.replace(instance, **changes)  # type: ignore[type-var]


def test_padded_capacity_must_be_positive() -> None:
    with pytest.raises(mf.InputError, match="capacity"):
        mf.PaddedDispatch(4, capacity=0)
    for dispatch_type in (mf.SortedDispatch, mf.PaddedDispatch):
        with pytest.raises(mf.InputError, match="num_experts"):
            dispatch_type(0)


# -- round trips -----------------------------------------------------------------------------------


def _dispatcher(layout: str, experts: int, group_list_type: mf.GroupListType) -> mf.Stage:
    if layout == "sorted":
        return mf.SortedDispatch(experts, group_list_type)
    return mf.PaddedDispatch(experts)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 40),
    experts=st.integers(1, 16),
    data=st.data(),
    layout=st.sampled_from(["sorted", "padded"]),
    group_list_type=st.sampled_from(list(mf.GroupListType)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_dispatch_combine_round_trip(
    tokens: int, experts: int, data: st.DataObject, layout: str, group_list_type: mf.GroupListType,
    dtype: torch.dtype, seed: int,
) -> None:
    """Identity experts and weights summing to one: the combine gives back the input."""
    top_k = data.draw(st.integers(1, experts), label="top_k")
    dispatch = _dispatcher(layout, experts, group_list_type)
    gate_up, down = _identity_experts(experts)
    pipeline = mf.Pipeline([mf.TopK(experts, top_k), dispatch, gate_up, IDENTITY, down, mf.Combine()],
                           mf.input_spec(H, dtype, experts), debug=True)
    gen = _gen(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert out.shape == (tokens, H) and out.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out, x, **tol)
    # The same through the stages called directly (no GEMM): combine reads the plan, not the data.
    routed = mf.TopK(experts, top_k)(mf.MoEInput(x, logits))
    direct = mf.Combine()(dispatch(routed)).hidden_states
    torch.testing.assert_close(direct, x, **tol)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 32),
    experts=st.integers(1, 12),
    data=st.data(),
    layout=st.sampled_from(["sorted", "padded"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_each_copy_reaches_its_expert_and_comes_back(
    tokens: int, experts: int, data: st.DataObject, layout: str, weighted: bool, seed: int
) -> None:
    """Expert ``e`` multiplies by ``e + 1``: out[t] = x[t] * sum_k w[t, k] * (ids[t, k] + 1)."""
    top_k = data.draw(st.integers(1, experts), label="top_k")
    routed = _routed(tokens, experts, top_k, seed=seed)
    dispatch = _dispatcher(layout, experts, mf.GroupListType.COUNT)
    gate_up, down = _scaling_experts(experts)
    out = mf.Combine(apply_routing_weights=weighted)(down(gate_up(dispatch(routed)))).hidden_states
    factor = routed.topk.ids.float() + 1
    if weighted:
        factor = factor * routed.topk.weights
    torch.testing.assert_close(out, routed.x.data * factor.sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_sorted_and_padded_combine_agree_bit_for_bit() -> None:
    routed = _routed(33, 7, 3, seed=5)
    gate_up, down = _scaling_experts(7)
    sorted_out = mf.Combine()(down(gate_up(mf.SortedDispatch(7)(routed)))).hidden_states
    padded_out = mf.Combine()(down(gate_up(mf.PaddedDispatch(7)(routed)))).hidden_states
    assert torch.equal(sorted_out, padded_out)


@pytest.mark.parametrize("layout", ["sorted", "padded"])
def test_combine_is_deterministic(layout: str) -> None:
    routed = _routed(64, 8, 4, seed=6, hidden=64)
    dispatched = _dispatcher(layout, 8, mf.GroupListType.COUNT)(routed)
    gen = _gen(7)
    noisy = dispatched.with_x(mf.Activations(torch.randn(dispatched.x.data.shape, generator=gen) * 100))
    combine = mf.Combine(out_dtype=mf.DType.BF16)
    first = combine(noisy).hidden_states
    for _ in range(5):
        assert torch.equal(combine(noisy).hidden_states, first)
    # And dispatching again gives the same rows in the same places.
    again = _dispatcher(layout, 8, mf.GroupListType.COUNT)(routed)
    assert torch.equal(again.x.data, dispatched.x.data)


def test_combine_sums_in_fp32_in_k_order() -> None:
    """out[t] = sum_k rows * w in fp32, k ascending, then cast: check against that exact recipe."""
    routed = _routed(16, 4, 3, seed=8, dtype=torch.bfloat16)
    dispatched = mf.SortedDispatch(4)(routed)
    out = mf.Combine()(dispatched).hidden_states
    assert out.dtype == torch.bfloat16
    expected = torch.zeros(16, H)
    for k in range(3):
        expected += routed.x.data.float() * routed.topk.weights[:, k:k + 1]
    assert torch.equal(out, expected.bfloat16())


def test_combine_output_spec_and_dtype() -> None:
    experts, top_k = 4, 2
    gate_up, down = _identity_experts(experts)
    pipeline = mf.Pipeline(
        [mf.TopK(experts, top_k), mf.SortedDispatch(experts), gate_up, IDENTITY, down, mf.Combine(out_dtype=mf.DType.FP32)],
        mf.input_spec(H, torch.bfloat16, experts), debug=True)
    spec = pipeline.output_spec
    assert spec.kind is mf.PayloadKind.OUTPUT and spec.layout is mf.Layout.TOKEN_MAJOR
    assert spec.dtype is mf.DType.FP32 and spec.group_list_type is None
    assert spec.routing_weights is mf.RoutingWeights.IN_COMBINE
    gen = _gen(9)
    out = pipeline(mf.MoEInput(torch.randn(5, H, generator=gen).bfloat16(), torch.randn(5, experts, generator=gen)))
    assert out.hidden_states.dtype == torch.float32
    out.check(spec)


def test_combine_rejects_other_payloads() -> None:
    routed = _routed(4, 4, 2)
    with pytest.raises(TypeError, match="Combine"):
        mf.Combine()(routed)  # type: ignore[arg-type]


# -- routed scaling factor in the combine ----------------------------------------------------------


def test_combine_applies_a_pending_scaling_factor() -> None:
    experts = 8
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5, scaling_in_weights=False)
    folded = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5)
    gate_up, down = _identity_experts(experts)
    spec = mf.input_spec(H, torch.float32, experts)
    pending = mf.Pipeline([mf.TopK(experts, 2, routing), mf.SortedDispatch(experts), gate_up, IDENTITY, down,
                           mf.Combine(routed_scaling_factor=2.5)], spec)
    assert pending.output_spec.scaling_factor is mf.ScalingFactor.APPLIED
    in_weights = mf.Pipeline([mf.TopK(experts, 2, folded), mf.SortedDispatch(experts), gate_up, IDENTITY, down,
                              mf.Combine()], spec)
    assert in_weights.output_spec.scaling_factor is mf.ScalingFactor.IN_WEIGHTS
    gen = _gen(10)
    inputs = mf.MoEInput(torch.randn(12, H, generator=gen), torch.randn(12, experts, generator=gen))
    a, b = pending(inputs).hidden_states, in_weights(inputs).hidden_states
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, inputs.hidden_states * 2.5)
    # Applying it twice, or not at all, fails at build time.
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(experts, 2, folded), mf.SortedDispatch(experts), gate_up, IDENTITY, down,
                     mf.Combine(routed_scaling_factor=2.5)], spec)
    assert error.value.field == "scaling_factor" and "Combine" in error.value.consumer
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(experts, 2, routing), mf.SortedDispatch(experts), gate_up, IDENTITY, down, mf.Combine()],
                    spec)
    assert error.value.field == "scaling_factor" and error.value.consumer == "pipeline output"


# -- routing weights on the input ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sorted", "padded"])
def test_apply_routing_weights_on_input(layout: str) -> None:
    experts, top_k = 6, 2
    dispatch: Union[mf.SortedDispatch, mf.PaddedDispatch]
    if layout == "sorted":
        dispatch = mf.SortedDispatch(experts, apply_routing_weights=True)
    else:
        dispatch = mf.PaddedDispatch(experts, apply_routing_weights=True)
    spec = _dispatched_spec(dispatch, experts, top_k, routing=ON_INPUT)
    assert spec.routing_weights is mf.RoutingWeights.ON_INPUT
    routed = _routed(14, experts, top_k, seed=11)
    out = dispatch(routed)
    out.check(spec)
    ids, w, x = routed.topk.ids, routed.topk.weights, routed.x.data
    for expert in range(experts):
        for position, (token, k) in enumerate(_copies_of(ids, expert)):
            if isinstance(out, mf.SortedRows):
                row = out.x.data[int(out.plan.token_rows[token, k])]
            else:
                row = out.x.data[expert, position]
            torch.testing.assert_close(row, x[token] * w[token, k])
    # Combined without weights: each token gets back sum_k w * x = x.
    combined = mf.Combine(apply_routing_weights=False)(out).hidden_states
    torch.testing.assert_close(combined, x)


def test_routing_weights_on_input_and_in_combine_is_a_contract_error() -> None:
    experts = 4
    gate_up, down = _identity_experts(experts)
    stages = [mf.TopK(experts, 2, ON_INPUT), mf.SortedDispatch(experts, apply_routing_weights=True), gate_up,
              IDENTITY, down]
    spec = mf.input_spec(H, torch.float32, experts)
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline(stages + [mf.Combine()], spec)
    assert error.value.field == "routing_weights"
    assert "apply_routing_weights=False" in error.value.hint
    pipeline = mf.Pipeline(stages + [mf.Combine(apply_routing_weights=False)], spec)
    assert pipeline.output_spec.routing_weights is mf.RoutingWeights.ON_INPUT
    # And never applied at all is caught too.
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(experts, 2), mf.SortedDispatch(experts), gate_up, IDENTITY, down,
                     mf.Combine(apply_routing_weights=False)], spec)
    assert error.value.field == "routing_weights"


def test_routing_weights_on_quantized_input_is_a_contract_error() -> None:
    for dispatch in (mf.SortedDispatch(4, apply_routing_weights=True),
                     mf.PaddedDispatch(4, apply_routing_weights=True)):
        with pytest.raises(mf.ContractError) as error:
            mf.Pipeline([mf.TopK(4, 2), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)), dispatch],
                        mf.input_spec(128, torch.bfloat16, 4))
        assert error.value.field == "dtype"
        assert "QuantizeRows" in error.value.hint


def test_dispatch_num_experts_must_match_the_topk() -> None:
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(8, 2), mf.SortedDispatch(4)], mf.input_spec(H, torch.float32, 8))
    assert error.value.field == "num_experts"
    with pytest.raises(mf.ContractError) as error:  # dispatch without a top-k
        mf.Pipeline([mf.SortedDispatch(8)], mf.input_spec(H, torch.float32, 8))
    assert error.value.field == "kind"


# -- edge cases ------------------------------------------------------------------------------------

LAYOUTS = ["sorted-count", "sorted-cumsum", "padded"]


def _make(layout: str, experts: int, **kwargs: object) -> mf.Stage:
    if layout == "padded":
        return mf.PaddedDispatch(experts, **kwargs)  # type: ignore[arg-type]
    kind = mf.GroupListType.COUNT if layout == "sorted-count" else mf.GroupListType.CUMSUM
    return mf.SortedDispatch(experts, kind, **kwargs)  # type: ignore[arg-type]


def _check_round_trip(layout: str, routed: mf.RoutedTokens, experts: int) -> mf.ExpertRows:
    dispatch = _make(layout, experts)
    top_k = routed.topk.ids.shape[1]
    out = dispatch(routed)
    out.check(_dispatched_spec(dispatch, experts, top_k))
    gate_up, down = _scaling_experts(experts)
    combined = mf.Combine()(down(gate_up(out))).hidden_states
    factor = ((routed.topk.ids.float() + 1) * routed.topk.weights).sum(-1, keepdim=True)
    torch.testing.assert_close(combined, routed.x.data * factor)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_batch(layout: str) -> None:
    routed = _routed(0, 4, 2)
    out = _check_round_trip(layout, routed, 4)
    if isinstance(out, mf.SortedRows):
        assert out.x.data.shape == (0, H)
        assert out.counts().tolist() == [0, 0, 0, 0]
        assert out.plan.token_rows.shape == (0, 2)
    else:
        assert isinstance(out, mf.PaddedRows)
        assert out.masked_m.tolist() == [0, 0, 0, 0] and int(out.plan.dropped) == 0
        assert out.plan.token_slots.shape == (0, 2)
    # A whole layer on an empty batch.
    layer = mf.MoELayer(4, 2, H, 16, dispatcher="padded" if layout == "padded" else "sorted",
                        dtype=torch.float32, debug=True)
    assert layer(torch.empty(0, H)).shape == (0, H)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_token(layout: str) -> None:
    out = _check_round_trip(layout, _routed(1, 8, 3, seed=12), 8)
    if isinstance(out, mf.PaddedRows):
        assert out.capacity == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_with_no_tokens(layout: str) -> None:
    ids = torch.tensor([[1, 5], [5, 1], [1, 6], [6, 5]], dtype=torch.int32)  # experts 0, 2, 3, 4, 7 idle
    out = _check_round_trip(layout, _routed(4, 8, 2, ids=ids, seed=13), 8)
    counts = out.counts() if isinstance(out, mf.SortedRows) else out.masked_m  # type: ignore[attr-defined]
    assert counts.tolist() == [0, 3, 0, 0, 0, 3, 2, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_token_on_one_expert(layout: str) -> None:
    ids = torch.full((9, 1), 3, dtype=torch.int32)
    out = _check_round_trip(layout, _routed(9, 5, 1, ids=ids, seed=14), 5)
    if isinstance(out, mf.PaddedRows):
        assert out.masked_m.tolist() == [0, 0, 0, 9, 0]
    else:
        assert isinstance(out, mf.SortedRows)
        assert out.counts().tolist() == [0, 0, 0, 9, 0]
        assert out.plan.token_rows.view(-1).tolist() == list(range(9))
    # With k = 2, every token on the same pair.
    pair = torch.tensor([[4, 1]] * 7, dtype=torch.int32)
    _check_round_trip(layout, _routed(7, 5, 2, ids=pair, seed=15), 5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_top_k_equal_to_num_experts(layout: str) -> None:
    routed = _routed(10, 4, 4, seed=16)
    out = _check_round_trip(layout, routed, 4)
    counts = out.counts() if isinstance(out, mf.SortedRows) else out.masked_m  # type: ignore[attr-defined]
    assert counts.tolist() == [10, 10, 10, 10]


def test_one_expert() -> None:
    for layout in LAYOUTS:
        _check_round_trip(layout, _routed(6, 1, 1, seed=17), 1)


# -- quantized activations through the dispatch ----------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("quantizer", [mf.PerTokenQuantizer(FP8), mf.PerTokenQuantizer(mf.DType.INT8),
                                       mf.PerGroupQuantizer()], ids=["fp8-token", "int8-token", "fp8-group"])
def test_quantized_activations_keep_their_scales(layout: str, quantizer: mf.stages.Quantizer) -> None:
    experts, top_k, hidden = 6, 2, 256
    routed = _routed(11, experts, top_k, seed=18, hidden=hidden, dtype=torch.bfloat16)
    quantized = mf.QuantizeTokens(quantizer)(routed)
    dispatch = _make(layout, experts)
    spec = dispatch.output_spec(_routed_spec(experts, top_k, hidden, torch.bfloat16, quantizer))
    assert spec.dtype is quantizer.dtype and spec.scale_layout is quantizer.scale_layout
    out = dispatch(quantized)
    out.check(spec)
    assert out.x.data.dtype == quantizer.dtype.torch_dtype and out.x.scale is not None
    token_values = dequantize(quantized.x)
    ids = routed.topk.ids
    for expert in range(experts):
        for position, (token, k) in enumerate(_copies_of(ids, expert)):
            if isinstance(out, mf.SortedRows):
                index: tuple[int, ...] = (int(out.plan.token_rows[token, k]),)
            else:
                index = (expert, position)
            # Bit-identical payload and scale: the dispatch moves bytes, it does not requantize.
            assert torch.equal(out.x.data[index].view(torch.uint8), quantized.x.data[token].view(torch.uint8))
            assert torch.equal(out.x.scale[index], quantized.x.scale[token])  # type: ignore[index]
            assert torch.equal(dequantize(mf.Activations(out.x.data[index], out.x.scale[index])),
                               token_values[token])
    if isinstance(out, mf.PaddedRows):  # empty slots get a harmless scale
        for expert in range(experts):
            assert bool(torch.isfinite(out.x.scale[expert, int(out.masked_m[expert]):]).all())


def test_per_tensor_scale_passes_through_the_dispatch() -> None:
    routed = _routed(8, 4, 2, seed=19)
    data = (routed.x.data * 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.25])
    quantized = routed.with_x(mf.Activations(data, scale))
    for layout in LAYOUTS:
        out = _make(layout, 4)(quantized)
        assert out.x.scale is scale


@pytest.mark.parametrize("layout", ["sorted", "padded"])
def test_fp8_dispatch_through_a_layer_pipeline(layout: str) -> None:
    """Quantize -> dispatch -> GEMM (fp8 in, bf16 out) -> ... as a user would assemble it."""
    experts, top_k, hidden, inter = 4, 2, 128, 64
    gen = _gen(20)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    dispatch = mf.SortedDispatch(experts) if layout == "sorted" else mf.PaddedDispatch(experts)
    spec = mf.input_spec(hidden, torch.bfloat16, experts)
    tail = [mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, out_dtype=mf.DType.BF16), mf.Activate(),
            mf.GroupedGemm(mf.GemmRole.DOWN, w2), mf.Combine()]
    fp8 = mf.Pipeline([mf.TopK(experts, top_k), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)), dispatch] + tail,
                      spec, debug=True)
    bf16 = mf.Pipeline([mf.TopK(experts, top_k), dispatch] + [
        mf.GroupedGemm(mf.GemmRole.GATE_UP, w13), mf.Activate(), mf.GroupedGemm(mf.GemmRole.DOWN, w2),
        mf.Combine()], spec)
    inputs = mf.MoEInput(torch.randn(16, hidden, generator=gen).bfloat16(), torch.randn(16, experts, generator=gen))
    a, b = fp8(inputs).hidden_states.float(), bf16(inputs).hidden_states.float()
    assert float((a - b).norm() / b.norm()) < 0.08


def test_layer_with_padded_dispatcher_matches_sorted() -> None:
    layer = mf.MoELayer(8, 2, H, 16, dtype=torch.float32)
    gen = _gen(21)
    x = torch.randn(20, H, generator=gen)
    sorted_out = layer(x)
    layer.replace_stage("SortedDispatch", mf.PaddedDispatch(8, capacity=20))
    assert isinstance(layer.pipeline.stages[1], mf.PaddedDispatch)
    torch.testing.assert_close(layer(x), sorted_out, rtol=1e-5, atol=1e-6)
