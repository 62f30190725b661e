"""Pipelines: a valid composition builds and runs; every kind of mismatch is a ContractError at build
time that names both stages, the field, what each side has, and a hint."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import pytest
import torch
import torch.nn.functional as F

import moeforge as mf
from moeforge.payloads import ExpertRows
from moeforge.pipeline import PIPELINE_OUTPUT
from moeforge.reference import dense_moe
from moeforge.spec import FLOAT_DTYPES

E, K, H, I = 4, 2, 32, 16
T = 6


@attrs.frozen
class Weights:
    w13: torch.Tensor
    w2: torch.Tensor


def _weights(num_experts: int = E, hidden: int = H, inter: int = I, seed: int = 0) -> Weights:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return Weights(w13, w2)


def _inputs(tokens: int = T, hidden: int = H, num_experts: int = E, seed: int = 1) -> mf.MoEInput:
    gen = torch.Generator().manual_seed(seed)
    return mf.MoEInput(torch.randn(tokens, hidden, generator=gen),
                       torch.randn(tokens, num_experts, generator=gen))


def _spec(hidden: int = H, num_experts: int = E) -> mf.Spec:
    return mf.input_spec(hidden, torch.float32, num_experts)


def _gemm(role: mf.GemmRole, weight: torch.Tensor, **kwargs: Any) -> mf.GroupedGemm:
    """A GEMM with the unquantized method's capabilities (float rows, no scales)."""
    return mf.GroupedGemm(role, weight, accepts_dtypes=mf.UnquantizedMethod.accepts,
                          accepts_scales=mf.UnquantizedMethod.accepts_scales, **kwargs)


def _stages(w: Optional[Weights] = None, **overrides: Any) -> list[mf.Stage[Any, Any]]:
    """The standard stages: topk, dispatch, gemm, activation, gemm, combine (overridable by name)."""
    w = w or _weights()
    stages: dict[str, mf.Stage[Any, Any]] = {
        "topk": mf.TopK(E, K),
        "dispatch": mf.SortedDispatch(E),
        "gate_up": _gemm(mf.GemmRole.GATE_UP, w.w13),
        "act": mf.Activate(),
        "down": _gemm(mf.GemmRole.DOWN, w.w2),
        "combine": mf.Combine(),
    }
    stages.update(overrides)
    return list(stages.values())


def _dense(x: mf.MoEInput, w: Weights, routing: mf.RoutingConfig = mf.RoutingConfig(),
           activation: mf.ActivationConfig = mf.ActivationConfig()) -> torch.Tensor:
    return dense_moe(x.hidden_states, x.router_logits, top_k=K, w13=w.w13, w2=w.w2, routing=routing,
                     activation=activation)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _check_error(error: mf.ContractError, *, producer: str, consumer: str, field: str) -> None:
    assert error.producer == producer
    assert error.consumer == consumer
    assert error.field == field
    assert error.have is not None
    assert error.want is not None
    assert isinstance(error.hint, str) and error.hint
    message = str(error)
    assert producer in message and consumer in message
    assert f"'{field}'" in message
    assert error.hint in message


# -- a valid pipeline ------------------------------------------------------------------------------


@pytest.mark.parametrize("dispatch", [mf.SortedDispatch(E),
                                      mf.SortedDispatch(E, group_list_type=mf.GroupListType.CUMSUM),
                                      mf.PaddedDispatch(E)], ids=["count", "cumsum", "padded"])
def test_valid_pipeline_builds_and_matches_dense_reference(dispatch: mf.Stage[Any, Any]) -> None:
    w = _weights()
    pipeline = mf.Pipeline(_stages(w, dispatch=dispatch), _spec())
    assert len(pipeline.specs) == 6
    assert pipeline.output_spec.kind is mf.PayloadKind.OUTPUT
    assert pipeline.output_spec.layout is mf.Layout.TOKEN_MAJOR
    assert pipeline.output_spec.routing_weights is mf.RoutingWeights.IN_COMBINE
    x = _inputs()
    out = pipeline(x)
    assert isinstance(out, mf.MoEOutput)
    assert out.hidden_states.shape == (T, H)
    assert _rel(out.hidden_states, _dense(x, w)) < 1e-5
    # debug mode runs the same stages and checks every payload
    debug = mf.Pipeline(pipeline.stages, _spec(), debug=True)
    torch.testing.assert_close(debug(x).hidden_states, out.hidden_states, rtol=0, atol=0)


def test_quantized_dispatch_into_gemms_that_accept_it_builds() -> None:
    w = _weights()
    stages = _stages(w)
    stages.insert(1, mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.FP8_E4M3)))
    stages[3] = mf.GroupedGemm(mf.GemmRole.GATE_UP, w.w13, out_dtype=mf.DType.FP32)
    pipeline = mf.Pipeline(stages, _spec())
    assert pipeline.specs[1].dtype is mf.DType.FP8_E4M3
    assert pipeline.specs[2].scale_layout is mf.ScaleLayout.PER_TOKEN
    x = _inputs()
    assert _rel(pipeline(x).hidden_states, _dense(x, w)) < 5e-2


def test_empty_pipeline_and_non_stage_are_rejected() -> None:
    with pytest.raises(ValueError):
        mf.Pipeline([], _spec())
    with pytest.raises(TypeError, match=r"stages\[1\]"):
        mf.Pipeline([mf.TopK(E, K), "dispatch"], _spec())  # type: ignore[list-item]


# -- mismatches ------------------------------------------------------------------------------------


def test_combine_before_dispatch_is_out_of_order() -> None:
    stages = _stages()
    stages = [stages[0], stages[5], stages[1], stages[2], stages[3], stages[4]]
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 0 (TopK)", consumer="stage 1 (Combine)", field="kind")
    assert info.value.have is mf.PayloadKind.ROUTED
    assert mf.PayloadKind.EXPERT_OUTPUT in info.value.want
    assert "out of order" in info.value.hint


def test_gemm_directly_after_topk_is_a_kind_mismatch() -> None:
    stages = _stages()
    del stages[1]
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 0 (TopK)", consumer="stage 1 (GroupedGemm)", field="kind")


@attrs.frozen(eq=False)
class TokenMajorDispatch(mf.Stage[mf.RoutedTokens, mf.RoutedTokens]):
    """A (bogus) dispatcher that claims to dispatch but leaves the rows token-major."""

    kinds: ClassVar = (mf.StageKind.DISPATCH,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.ROUTED)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(kind=mf.PayloadKind.DISPATCHED, expert_ids=mf.ExpertIds.LOCAL)

    def __call__(self, x: mf.RoutedTokens) -> mf.RoutedTokens:
        return x


def test_gemm_on_token_major_rows_is_a_layout_mismatch() -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(dispatch=TokenMajorDispatch()), _spec())
    _check_error(info.value, producer="stage 1 (TokenMajorDispatch)", consumer="stage 2 (GroupedGemm)",
                 field="layout")
    assert info.value.have is mf.Layout.TOKEN_MAJOR
    assert info.value.want == {mf.Layout.EXPERT_SORTED, mf.Layout.EXPERT_PADDED}


@pytest.mark.parametrize("quantizer", [mf.PerTokenQuantizer(mf.DType.FP8_E4M3),
                                       mf.PerTokenQuantizer(mf.DType.INT8), mf.PerGroupQuantizer()],
                         ids=["fp8-per-token", "int8-per-token", "fp8-per-group"])
def test_quantized_rows_into_unquantized_gemm_is_a_dtype_mismatch(quantizer: Any) -> None:
    hidden = 128  # the per-group quantizer needs a multiple of 128
    w = _weights(hidden=hidden)
    stages = _stages(w)
    stages.insert(1, mf.QuantizeTokens(quantizer))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec(hidden=hidden))
    _check_error(info.value, producer="stage 2 (SortedDispatch)", consumer="stage 3 (GroupedGemm)",
                 field="dtype")
    assert info.value.have is quantizer.dtype
    assert info.value.want == mf.UnquantizedMethod.accepts
    assert "quantize" in info.value.hint


def test_quant_method_stages_reject_fp8_rows() -> None:
    """The same mismatch with the GEMMs contributed by the unquantized method itself."""
    holder = torch.nn.Module()
    method = mf.UnquantizedMethod()
    method.create_weights(holder, num_experts=E, hidden_size=H, intermediate_size=I, gated=True,
                          bias=False, dtype=torch.float32, device="cpu")
    experts = method.expert_stages(holder, activation=mf.ActivationConfig(),
                                   routing_weights_in_epilogue=False)
    stages = [mf.TopK(E, K), mf.QuantizeTokens(mf.PerTokenQuantizer()), mf.SortedDispatch(E),
              *experts, mf.Combine()]
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    assert info.value.field == "dtype" and info.value.consumer == "stage 3 (GroupedGemm)"
    # without the quantizer the same stages build
    mf.Pipeline([stages[0], *stages[2:]], _spec())


def test_hidden_size_mismatch_between_dispatch_and_gemm_weight() -> None:
    w = _weights(hidden=2 * H)
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(w), _spec(hidden=H))
    _check_error(info.value, producer="stage 1 (SortedDispatch)", consumer="stage 2 (GroupedGemm)",
                 field="width")
    assert info.value.have == H
    assert info.value.want == {2 * H}
    assert "hidden_size" in info.value.hint


def test_intermediate_size_mismatch_between_activation_and_down_gemm() -> None:
    w = _weights()
    down = _gemm(mf.GemmRole.DOWN, torch.randn(E, H, 2 * I))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(w, down=down), _spec())
    _check_error(info.value, producer="stage 3 (Activate)", consumer="stage 4 (GroupedGemm)",
                 field="width")
    assert info.value.have == I


def test_gated_activation_needs_even_width() -> None:
    w = Weights(torch.randn(E, 2 * I + 1, H), torch.randn(E, H, I))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(w), _spec())
    _check_error(info.value, producer="stage 2 (GroupedGemm)", consumer="stage 3 (Activate)",
                 field="width")


def test_wrong_number_of_experts_between_dispatch_and_gemm() -> None:
    w = _weights(num_experts=E + 2)
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(w), _spec())
    _check_error(info.value, producer="stage 1 (SortedDispatch)", consumer="stage 2 (GroupedGemm)",
                 field="num_experts")
    assert info.value.have == E
    assert info.value.want == {E + 2}


def test_wrong_number_of_experts_between_input_and_topk() -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(), _spec(num_experts=E + 1))
    _check_error(info.value, producer="pipeline input", consumer="stage 0 (TopK)", field="num_experts")


def test_wrong_number_of_experts_between_topk_and_dispatch() -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(dispatch=mf.SortedDispatch(E + 1)), _spec())
    _check_error(info.value, producer="stage 0 (TopK)", consumer="stage 1 (SortedDispatch)",
                 field="num_experts")


def _router(where: mf.RoutingWeights) -> mf.TopK:
    return mf.TopK(E, K, mf.RoutingConfig(apply_weights=where))


ON_INPUT, EPILOGUE, IN_COMBINE = (mf.RoutingWeights.ON_INPUT, mf.RoutingWeights.IN_GEMM_EPILOGUE,
                                  mf.RoutingWeights.IN_COMBINE)


def test_routing_weights_on_input_and_in_combine() -> None:
    # The router declares on_input, the dispatch applies them there: the combine applying them again
    # is the double application (the placement rule is tested on its own below).
    stages = _stages(topk=_router(ON_INPUT), dispatch=mf.SortedDispatch(E, apply_routing_weights=True))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 4 (GroupedGemm)", consumer="stage 5 (Combine)",
                 field="routing_weights")
    assert info.value.have is mf.RoutingWeights.ON_INPUT
    assert info.value.want == {mf.RoutingWeights.PENDING}
    assert "apply_routing_weights=False" in info.value.hint


def test_routing_weights_in_gemm_epilogue_and_in_combine() -> None:
    w = _weights()
    stages = _stages(w, topk=_router(EPILOGUE), down=_gemm(mf.GemmRole.DOWN, w.w2, apply_routing_weights=True))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 4 (GroupedGemm)", consumer="stage 5 (Combine)",
                 field="routing_weights")
    assert info.value.have is mf.RoutingWeights.IN_GEMM_EPILOGUE


def test_routing_weights_on_input_and_in_gemm_epilogue() -> None:
    w = _weights()
    stages = _stages(w, topk=_router(ON_INPUT), dispatch=mf.SortedDispatch(E, apply_routing_weights=True),
                     down=_gemm(mf.GemmRole.DOWN, w.w2, apply_routing_weights=True),
                     combine=mf.Combine(apply_routing_weights=False))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 3 (Activate)", consumer="stage 4 (GroupedGemm)",
                 field="routing_weights")
    assert info.value.have is mf.RoutingWeights.ON_INPUT


PLACEMENTS = {
    ON_INPUT: {"dispatch": mf.SortedDispatch(E, apply_routing_weights=True), "combine": mf.Combine(apply_routing_weights=False)},
    EPILOGUE: {"down": "epilogue", "combine": mf.Combine(apply_routing_weights=False)},
    IN_COMBINE: {},
}


@pytest.mark.parametrize("declared", list(PLACEMENTS), ids=lambda r: r.value)
@pytest.mark.parametrize("applied", list(PLACEMENTS), ids=lambda r: r.value)
def test_the_router_declared_placement_is_binding(declared: mf.RoutingWeights, applied: mf.RoutingWeights) -> None:
    # Applied exactly once, but elsewhere than the router declares: Llama-4's input weighting silently
    # replaced by Mixtral's output weighting, or the reverse. Rejected naming the field and the fix.
    w = _weights()
    overrides: dict[str, Any] = dict(PLACEMENTS[applied])
    if overrides.get("down") == "epilogue":
        overrides["down"] = _gemm(mf.GemmRole.DOWN, w.w2, apply_routing_weights=True)
    stages = _stages(w, topk=_router(declared), **overrides)
    if declared is applied:
        pipeline = mf.Pipeline(stages, _spec())
        x = _inputs()
        assert _rel(pipeline(x).hidden_states, _dense(x, w, mf.RoutingConfig(apply_weights=declared))) < 1e-5
        return
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    assert info.value.field == "weights_at" and info.value.have is declared
    assert "apply_routing_weights" in info.value.hint or "apply_weights" in info.value.hint


def test_a_gate_up_gemm_never_applies_the_routing_weights() -> None:
    # The weight would multiply the gate/up output before the activation: no router's placement.
    w = _weights()
    for where in PLACEMENTS:
        stages = _stages(w, topk=_router(where), gate_up=_gemm(mf.GemmRole.GATE_UP, w.w13, apply_routing_weights=True),
                         combine=mf.Combine(apply_routing_weights=False))
        with pytest.raises(mf.ContractError) as info:
            mf.Pipeline(stages, _spec())
        assert info.value.field == "weights_at" and info.value.want == frozenset()
        assert "gate/up GEMM never" in info.value.hint


@pytest.mark.parametrize("where", ["on_input", "epilogue"])
def test_routing_weights_applied_once_elsewhere_builds_and_matches(where: str) -> None:
    w = _weights()
    if where == "on_input":
        overrides: dict[str, Any] = {"dispatch": mf.SortedDispatch(E, apply_routing_weights=True)}
        routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)
        expect = mf.RoutingWeights.ON_INPUT
    else:
        overrides = {"down": _gemm(mf.GemmRole.DOWN, w.w2, apply_routing_weights=True)}
        routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE)
        expect = mf.RoutingWeights.IN_GEMM_EPILOGUE
    overrides["topk"] = mf.TopK(E, K, routing)
    pipeline = mf.Pipeline(_stages(w, combine=mf.Combine(apply_routing_weights=False), **overrides),
                           _spec())
    assert pipeline.output_spec.routing_weights is expect
    x = _inputs()
    assert _rel(pipeline(x).hidden_states, _dense(x, w, routing)) < 1e-5


def test_routing_weights_never_applied_by_unweighted_combine() -> None:
    """The built-in unweighted Combine rejects pending weights itself, naming itself as consumer
    (its hint says exactly what to change)."""
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(combine=mf.Combine(apply_routing_weights=False)), _spec())
    error = info.value
    _check_error(error, producer="stage 4 (GroupedGemm)", consumer="stage 5 (Combine)",
                 field="routing_weights")
    assert error.have is mf.RoutingWeights.PENDING
    assert "apply_routing_weights=True" in error.hint


@attrs.frozen(eq=False)
class PermissiveCombine(mf.Stage[ExpertRows, mf.MoEOutput]):
    """A custom combine that never applies the routing weights and accepts anything expert-shaped:
    only the pipeline's end-of-pipeline check can notice the weights were never applied."""

    kinds: ClassVar = (mf.StageKind.COMBINE,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_OUTPUT)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(kind=mf.PayloadKind.OUTPUT, layout=mf.Layout.TOKEN_MAJOR,
                           group_list_type=None)

    def __call__(self, x: ExpertRows) -> mf.MoEOutput:
        raise AssertionError("never called: the pipeline must not build")


def test_routing_weights_never_applied_is_caught_at_pipeline_output() -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(combine=PermissiveCombine()), _spec())
    error = info.value
    _check_error(error, producer="stage 5 (PermissiveCombine)", consumer=PIPELINE_OUTPUT,
                 field="routing_weights")
    assert error.consumer == "pipeline output"
    assert error.have is mf.RoutingWeights.PENDING
    assert "no stage applied the routing weights" in error.hint


def test_routed_scaling_factor_folded_in_topk_and_applied_in_combine() -> None:
    routing = mf.RoutingConfig(routed_scaling_factor=2.5, scaling_in_weights=True)
    stages = _stages(topk=mf.TopK(E, K, routing), combine=mf.Combine(routed_scaling_factor=2.5))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 4 (GroupedGemm)", consumer="stage 5 (Combine)",
                 field="scaling_factor")
    assert info.value.have is mf.ScalingFactor.IN_WEIGHTS
    assert info.value.want == {mf.ScalingFactor.PENDING}


def test_routed_scaling_factor_in_combine_without_a_factor_in_topk() -> None:
    stages = _stages(combine=mf.Combine(routed_scaling_factor=2.5))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    assert info.value.field == "scaling_factor" and info.value.have is mf.ScalingFactor.NONE


def test_routed_scaling_factor_pending_and_never_applied() -> None:
    routing = mf.RoutingConfig(routed_scaling_factor=2.5, scaling_in_weights=False)
    stages = _stages(topk=mf.TopK(E, K, routing), combine=mf.Combine())
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    error = info.value
    _check_error(error, producer="stage 5 (Combine)", consumer="pipeline output", field="scaling_factor")
    assert error.have is mf.ScalingFactor.PENDING
    assert "routed_scaling_factor" in error.hint


@pytest.mark.parametrize("folded", [True, False])
def test_routed_scaling_factor_applied_once_matches_reference(folded: bool) -> None:
    w = _weights()
    routing = mf.RoutingConfig(routed_scaling_factor=2.5, scaling_in_weights=folded)
    combine = mf.Combine() if folded else mf.Combine(routed_scaling_factor=2.5)
    pipeline = mf.Pipeline(_stages(w, topk=mf.TopK(E, K, routing), combine=combine), _spec())
    expected = mf.ScalingFactor.IN_WEIGHTS if folded else mf.ScalingFactor.APPLIED
    assert pipeline.output_spec.scaling_factor is expected
    x = _inputs()
    assert _rel(pipeline(x).hidden_states, _dense(x, w, routing)) < 1e-5
    unscaled = mf.Pipeline(_stages(w), _spec())(x).hidden_states
    torch.testing.assert_close(pipeline(x).hidden_states, 2.5 * unscaled, rtol=1e-5, atol=1e-6)


def test_quantize_twice_is_rejected() -> None:
    stages = _stages()
    stages[1:1] = [mf.QuantizeTokens(mf.PerTokenQuantizer()), mf.QuantizeTokens(mf.PerTokenQuantizer())]
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 1 (QuantizeTokens)", consumer="stage 2 (QuantizeTokens)",
                 field="dtype")
    assert "already quantized" in info.value.hint


def test_routing_weights_on_input_after_quantization_is_rejected() -> None:
    stages = _stages(dispatch=mf.SortedDispatch(E, apply_routing_weights=True))
    stages.insert(1, mf.QuantizeTokens(mf.PerTokenQuantizer()))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    _check_error(info.value, producer="stage 1 (QuantizeTokens)", consumer="stage 2 (SortedDispatch)",
                 field="dtype")
    assert "QuantizeRows" in info.value.hint


# -- describe --------------------------------------------------------------------------------------


def test_describe_lists_every_stage_spec_and_note() -> None:
    notes = ["dispatch fp32 (rule 1: explicit setting)", "a second note"]
    pipeline = mf.Pipeline(_stages(), _spec(), notes=notes)
    text = pipeline.describe()
    lines = text.splitlines()
    assert "(pipeline input)" in text
    assert pipeline.input_spec.short() in text
    for index, (stage, spec) in enumerate(zip(pipeline.stages, pipeline.specs)):
        row = next(line for line in lines if line.startswith(f"{index} "))
        assert stage.summary() in row
        assert "+".join(kind.value for kind in stage.kinds) in row
        assert spec.short() in row
    assert lines[-2:] == notes
    for name in ("TopK", "SortedDispatch", "GroupedGemm(gate_up", "Activate(swiglu",
                 "GroupedGemm(down", "Combine(weighted"):
        assert name in text
    assert repr(pipeline).startswith("Pipeline(TopK(")


# -- replace ---------------------------------------------------------------------------------------


def test_replace_by_index_and_name_revalidates_and_keeps_the_original() -> None:
    w = _weights()
    original = mf.Pipeline(_stages(w), _spec(), notes=["note"])
    stages_before, specs_before = original.stages, original.specs
    x = _inputs()
    out_before = original(x).hidden_states.clone()
    geglu = mf.ActivationConfig(mf.ActivationKind.GEGLU)

    by_name = original.replace("Activate", mf.Activate(geglu))
    by_index = original.replace(3, mf.Activate(geglu))
    by_negative = original.replace(-3, mf.Activate(geglu))
    for replaced in (by_name, by_index, by_negative):
        assert replaced is not original
        assert isinstance(replaced.stages[3], mf.Activate) and replaced.stages[3].config == geglu
        assert replaced.stages[:3] == original.stages[:3]
        assert replaced.notes == ("note",)
        assert _rel(replaced(x).hidden_states, _dense(x, w, activation=geglu)) < 1e-5
    assert not torch.allclose(by_name(x).hidden_states, out_before)

    # the original is untouched
    assert original.stages == stages_before and original.specs == specs_before
    torch.testing.assert_close(original(x).hidden_states, out_before, rtol=0, atol=0)


def test_bad_replacement_raises_contract_error_and_keeps_the_original() -> None:
    original = mf.Pipeline(_stages(), _spec())
    stages_before = original.stages
    with pytest.raises(mf.ContractError) as info:
        original.replace("Combine", mf.Combine(apply_routing_weights=False))
    assert info.value.consumer == "stage 5 (Combine)"
    with pytest.raises(mf.ContractError) as info:
        original.replace(1, mf.SortedDispatch(E + 1))
    assert info.value.field == "num_experts"
    with pytest.raises(mf.ContractError):
        original.replace("Activate", mf.Activate(mf.ActivationConfig(mf.ActivationKind.SILU)))
    assert original.stages == stages_before


def test_replace_with_an_ambiguous_or_unknown_name_or_bad_index() -> None:
    pipeline = mf.Pipeline(_stages(), _spec())
    with pytest.raises(KeyError, match="2 stages"):
        pipeline.replace("GroupedGemm", mf.Activate())
    with pytest.raises(KeyError, match="0 stages"):
        pipeline.replace("NoSuchStage", mf.Activate())
    with pytest.raises(IndexError):
        pipeline.replace(6, mf.Activate())
    with pytest.raises(IndexError):
        pipeline.replace(-7, mf.Activate())


def test_replace_keeps_debug_mode() -> None:
    pipeline = mf.Pipeline(_stages(), _spec(), debug=True)
    replaced = pipeline.replace("Activate", LyingActivate())
    assert replaced.debug
    with pytest.raises(mf.errors.PayloadError):
        replaced(_inputs())


# -- debug mode and custom stages ------------------------------------------------------------------


@attrs.frozen(eq=False)
class LyingActivate(mf.Stage[ExpertRows, ExpertRows]):
    """Declares a SwiGLU (width halves) but returns the gate/up rows unchanged."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        return x


@attrs.frozen(eq=False)
class WrongDtypeActivate(mf.Stage[ExpertRows, ExpertRows]):
    """Computes a correct SwiGLU but returns bf16 while its spec keeps fp32."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        gate, up = x.x.data.chunk(2, dim=-1)
        return x.with_x(mf.Activations((F.silu(gate) * up).to(torch.bfloat16)))


def test_debug_catches_a_stage_that_lies_about_its_width() -> None:
    pipeline = mf.Pipeline(_stages(act=LyingActivate()), _spec(), debug=True)
    with pytest.raises(mf.errors.PayloadError) as info:
        pipeline(_inputs())
    message = str(info.value)
    assert "stage 3 (LyingActivate)" in message
    assert "width" in message


@pytest.mark.parametrize("dispatch", [mf.SortedDispatch(E), mf.PaddedDispatch(E)],
                         ids=["sorted", "padded"])
def test_debug_catches_a_stage_that_lies_about_its_dtype(dispatch: mf.Stage[Any, Any]) -> None:
    x = _inputs()
    with pytest.raises(mf.errors.PayloadError, match=r"stage 3 \(WrongDtypeActivate\).*dtype"):
        mf.Pipeline(_stages(act=WrongDtypeActivate(), dispatch=dispatch), _spec(), debug=True)(x)
    # without debug the lie is not checked: the forward runs (the GEMM just computes on bf16 rows)
    out = mf.Pipeline(_stages(act=WrongDtypeActivate(), dispatch=dispatch), _spec())(x)
    assert out.hidden_states.shape == (T, H)


def test_without_debug_the_lying_stage_is_not_checked() -> None:
    pipeline = mf.Pipeline(_stages(act=LyingActivate()), _spec(), debug=False)
    # The lie surfaces only as whatever the next kernel does with the wrong width (here a matmul
    # shape error), never as a PayloadError: debug=False runs the stages and nothing else.
    with pytest.raises(Exception) as info:
        pipeline(_inputs())
    assert not isinstance(info.value, mf.errors.PayloadError)


BAD_INPUTS = {
    # A token silently dropped before (a (4, H) output for 5 tokens).
    "logits for fewer tokens": (lambda: torch.randn(T, H), lambda: torch.randn(T - 1, E), "router_logits shape"),
    # An IndexError inside the dispatch before.
    "one logit column too many": (lambda: torch.randn(T, H), lambda: torch.randn(T, E + 1), "router_logits shape"),
    # A RuntimeError inside the GEMM before.
    "wrong hidden size": (lambda: torch.randn(T, H + 1), lambda: torch.randn(T, E), "hidden_states width"),
    "wrong dtype": (lambda: torch.randn(T, H, dtype=torch.bfloat16), lambda: torch.randn(T, E),
                    "hidden_states dtype"),
    "3-d hidden states": (lambda: torch.randn(1, T, H), lambda: torch.randn(T, E), "hidden_states shape"),
    "integer logits": (lambda: torch.randn(T, H), lambda: torch.ones(T, E, dtype=torch.int64), "router_logits dtype"),
    "not a tensor": (lambda: [[0.0] * H] * T, lambda: torch.randn(T, E), "hidden_states: have list"),
}


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_pipeline_checks_its_input_on_every_call(case: str, debug: bool) -> None:
    # Shapes, dtypes and devices are metadata: checked with or without debug, with no device work.
    pipeline = mf.Pipeline(_stages(), _spec(), debug=debug)
    hidden, logits, message = BAD_INPUTS[case]
    with pytest.raises(mf.InputError, match=f"pipeline input.*{message}"):
        pipeline(mf.MoEInput(hidden(), logits()))  # type: ignore[arg-type]


def test_the_pipeline_checks_input_values_only_in_debug_mode() -> None:
    x = _inputs()
    x.hidden_states[0, 0] = float("nan")
    mf.Pipeline(_stages(), _spec())(x)  # reading values would need a host sync: not outside debug
    with pytest.raises(mf.InputError, match="hidden_states: 1 non-finite"):
        mf.Pipeline(_stages(), _spec(), debug=True)(x)


def test_a_payload_of_the_wrong_kind_is_an_input_error() -> None:
    pipeline = mf.Pipeline(_stages(), _spec())
    routed = mf.TopK(E, K)(_inputs())
    with pytest.raises(mf.InputError, match="payload kind"):
        pipeline(routed)  # type: ignore[arg-type]
    with pytest.raises(mf.InputError, match="not a pipeline payload"):
        pipeline((torch.randn(T, H), torch.randn(T, E)))  # type: ignore[arg-type]


@attrs.frozen(eq=False)
class ManualSwiGLU(mf.Stage[ExpertRows, ExpertRows]):
    """A user-written activation stage: SwiGLU with an optional clamp on the product."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)
    calls: list[int] = attrs.field(factory=list)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES,
                          scale_layout=mf.ScaleLayout.NONE)

    def check(self, spec: mf.Spec) -> list[mf.Mismatch]:
        found = super().check(spec)
        if spec.width % 2:
            found.append(mf.Mismatch("width", spec.width, "even", "ManualSwiGLU needs gate and up"))
        return found

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        self.calls.append(int(x.x.data.shape[0]))
        gate, up = x.x.data.chunk(2, dim=-1)
        return x.with_x(mf.Activations(F.silu(gate) * up))


@pytest.mark.parametrize("debug", [False, True])
def test_custom_stage_subclass_works_in_a_pipeline(debug: bool) -> None:
    w = _weights()
    custom = ManualSwiGLU()
    pipeline = mf.Pipeline(_stages(w, act=custom), _spec(), debug=debug)
    builtin = mf.Pipeline(_stages(w), _spec())
    x = _inputs()
    torch.testing.assert_close(pipeline(x).hidden_states, builtin(x).hidden_states, rtol=1e-6, atol=1e-6)
    assert custom.calls == [T * K]
    assert "ManualSwiGLU" in pipeline.describe()
    # its own check() runs at build time
    odd = Weights(torch.randn(E, 2 * I + 1, H), torch.randn(E, H, I))
    with pytest.raises(mf.ContractError, match="ManualSwiGLU needs gate and up"):
        mf.Pipeline(_stages(odd, act=ManualSwiGLU()), _spec())


def test_a_stage_missing_abstract_methods_cannot_be_instantiated() -> None:
    class Incomplete(mf.Stage[ExpertRows, ExpertRows]):
        kinds: ClassVar = (mf.StageKind.ACTIVATION,)

        def accepts(self) -> mf.Accepts:
            return mf.Accepts()

    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]


# -- chain -----------------------------------------------------------------------------------------


def test_chain_builds_the_same_pipeline() -> None:
    w = _weights()
    stages = _stages(w)
    built = (
        mf.chain(stages[0])
        .then(stages[1])
        .then(stages[2])
        .then(stages[3])
        .then(stages[4])
        .then(stages[5])
        .build(_spec(), notes=["n"])
    )
    direct = mf.Pipeline(stages, _spec(), notes=["n"])
    assert isinstance(built, mf.Pipeline)
    assert built.stages == direct.stages
    assert built.specs == direct.specs
    assert built.describe() == direct.describe()
    x = _inputs()
    torch.testing.assert_close(built(x).hidden_states, direct(x).hidden_states, rtol=0, atol=0)
    assert mf.chain(stages[0]).then(stages[1]).then(stages[2]).then(stages[3]).then(stages[4]).then(
        stages[5]).build(_spec(), debug=True).debug


def test_chain_validates_at_build() -> None:
    stages = _stages(combine=mf.Combine(routed_scaling_factor=2.0))
    partial = mf.chain(stages[0]).then(stages[1]).then(stages[2]).then(stages[3]).then(stages[4])
    with pytest.raises(mf.ContractError) as info:
        partial.then(stages[5]).build(_spec())
    assert info.value.field == "scaling_factor"


# -- what changes the math: the checker's soundness rules (issue: a sound contract checker) ------------


def test_the_pending_scaling_factor_must_be_applied_with_its_value() -> None:
    # 2.5 pending, 3.0 applied: the output would be 1.2x too large.
    routing = mf.RoutingConfig(routed_scaling_factor=2.5, scaling_in_weights=False)
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(topk=mf.TopK(E, K, routing), combine=mf.Combine(routed_scaling_factor=3.0)), _spec())
    _check_error(info.value, producer="stage 4 (GroupedGemm)", consumer="stage 5 (Combine)", field="pending_scale")
    assert info.value.have == 2.5 and "routed_scaling_factor=2.5" in info.value.hint
    pipeline = mf.Pipeline(_stages(topk=mf.TopK(E, K, routing), combine=mf.Combine(routed_scaling_factor=2.5)),
                           _spec())
    assert "rsf=pending(x2.5)" in pipeline.describe()


@pytest.mark.parametrize("dtype", [mf.DType.INT8, mf.DType.FP8_E4M3])
def test_a_pipeline_output_is_float(dtype: mf.DType) -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(combine=mf.Combine(out_dtype=dtype)), _spec())
    # The output's dtype is what is wrong, not its missing scales: no quantizer makes a quantized layer output.
    assert info.value.consumer == PIPELINE_OUTPUT and info.value.field == "dtype"
    assert info.value.have is dtype and "float out_dtype" in info.value.hint and "quantizer" not in info.value.hint


@pytest.mark.parametrize("where", ["activation", "gate_up"])
@pytest.mark.parametrize("dtype", [mf.DType.INT8, mf.DType.FP8_E4M3])
def test_a_quantized_dtype_travels_with_its_scales(where: str, dtype: mf.DType) -> None:
    w = _weights()
    if where == "activation":
        overrides: dict[str, Any] = dict(act=mf.Activate(out_dtype=dtype),
                                         down=_gemm(mf.GemmRole.DOWN, w.w2, out_dtype=mf.DType.FP32))
        producer = "stage 3 (Activate)"
    else:
        overrides = dict(gate_up=mf.GroupedGemm(mf.GemmRole.GATE_UP, w.w13, out_dtype=dtype))
        producer = "stage 2 (GroupedGemm)"
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(_stages(w, **overrides), _spec())
    assert info.value.producer == producer and info.value.field == "scale_layout"
    assert info.value.have is mf.ScaleLayout.NONE and "quantizer" in info.value.hint


def test_exactly_one_activation_between_the_expert_gemms() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(E, 4 * I, H, generator=gen)
    twice = _stages(gate_up=_gemm(mf.GemmRole.GATE_UP, wide))
    twice.insert(3, mf.Activate())
    with pytest.raises(mf.ContractError) as info:  # SwiGLU twice on a 4I-wide gate/up output
        mf.Pipeline(twice, _spec())
    assert info.value.field == "activations" and info.value.have == 2
    plain = torch.randn(E, I, H, generator=gen)
    stages = _stages(gate_up=_gemm(mf.GemmRole.GATE_UP, plain))
    stages.remove(stages[3])  # gate/up straight into down
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, _spec())
    assert info.value.field == "activations" and info.value.have == 0 and "IDENTITY" in info.value.hint
    identity = mf.Activate(mf.ActivationConfig(mf.ActivationKind.IDENTITY))
    pipeline = mf.Pipeline(stages[:3] + [identity] + stages[3:], _spec())
    assert "act=1" in pipeline.describe()
