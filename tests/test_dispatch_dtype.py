"""The dispatch dtype: one pure resolver with a fixed priority, hardware validation, and no global state.

Every call passes ``environ`` explicitly (``{}`` or a dict) so no test depends on the real environment,
and devices are emulated with :class:`DeviceDispatchSupport`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge import DeviceDispatchSupport, DispatchDecision, DispatchDtype, DispatchRule, DType
from moeforge.reference import layer_reference
from moeforge.spec import FLOAT_DTYPES

ENV = mf.ENV_VAR
FP8_AND_FLOATS = FLOAT_DTYPES | {DType.FP8_E4M3}
EVERYTHING = FLOAT_DTYPES | {DType.FP8_E4M3, DType.INT8, DType.NVFP4}
FULL_DEVICE = DeviceDispatchSupport(fp8=True, int8=True, nvfp4=True)


def resolve(setting: Any = "auto", **kwargs: Any) -> DispatchDecision:
    kwargs.setdefault("experts_accept", EVERYTHING)
    kwargs.setdefault("device", FULL_DEVICE)
    kwargs.setdefault("environ", {})
    return mf.resolve_dispatch_dtype(setting, **kwargs)


@pytest.fixture
def no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- the priority rules, each deciding --------------------------------------------------------------


@pytest.mark.parametrize("setting", ["bf16", DispatchDtype.BF16, " BF16 ", "bfloat16"])
def test_rule1_explicit_setting_beats_everything(setting: Any, no_warnings: None) -> None:
    decision = resolve(setting, environ={ENV: "fp16"}, quant_requires=DispatchDtype.FP8,
                       backend_requires=DispatchDtype.INT8,
                       device=DeviceDispatchSupport(default=DispatchDtype.FP32))
    assert decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.EXPLICIT)
    assert decision.converted_from is None
    assert decision.explain() == "dispatch bf16 (rule 1: explicit setting)"


def test_rule2_environment_beats_quant_backend_device_and_library() -> None:
    with pytest.warns(UserWarning, match=ENV):
        decision = resolve(environ={ENV: "fp16"}, quant_requires=DispatchDtype.FP8,
                           backend_requires=DispatchDtype.INT8,
                           device=DeviceDispatchSupport(default=DispatchDtype.FP32))
    assert decision.dtype is DispatchDtype.FP16
    assert decision.rule is DispatchRule.PROCESS_DEFAULT
    assert decision.explain() == f"dispatch fp16 (rule 2: process default {ENV})"


@pytest.mark.parametrize("setting", ["auto", "AUTO", " auto ", None])
def test_auto_and_none_fall_through_to_the_environment(setting: Any) -> None:
    with pytest.warns(UserWarning, match=ENV):
        decision = resolve(setting, environ={ENV: "int8"})
    assert decision.rule is DispatchRule.PROCESS_DEFAULT and decision.dtype is DispatchDtype.INT8


def test_rule3_quant_method_beats_backend_device_and_library(no_warnings: None) -> None:
    decision = resolve(quant_requires=DispatchDtype.NVFP4, backend_requires=DispatchDtype.BF16,
                       device=DeviceDispatchSupport(nvfp4=True, default=DispatchDtype.INT8))
    assert decision == DispatchDecision(DispatchDtype.NVFP4, DispatchRule.QUANT_METHOD)
    assert decision.explain() == "dispatch nvfp4 (rule 3: quant method)"


def test_rule4_expert_backend_beats_device_and_library(no_warnings: None) -> None:
    decision = resolve(backend_requires=DispatchDtype.BF16,
                       device=DeviceDispatchSupport(default=DispatchDtype.INT8))
    assert decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.EXPERT_BACKEND)
    assert "rule 4: expert backend" in decision.explain()


def test_rule5_device_default_beats_library(no_warnings: None) -> None:
    decision = resolve(device=DeviceDispatchSupport(default=DispatchDtype.INT8))
    assert decision == DispatchDecision(DispatchDtype.INT8, DispatchRule.DEVICE_DEFAULT)
    assert "rule 5: device default" in decision.explain()


def test_rule6_library_default_is_fp8_when_the_experts_accept_it(no_warnings: None) -> None:
    decision = resolve(experts_accept=FP8_AND_FLOATS)
    assert decision == DispatchDecision(DispatchDtype.FP8, DispatchRule.LIBRARY_DEFAULT)
    assert decision.explain() == "dispatch fp8 (rule 6: library default)"


@pytest.mark.parametrize("act, expected", [(torch.bfloat16, DispatchDtype.BF16),
                                           (torch.float16, DispatchDtype.FP16),
                                           (torch.float32, DispatchDtype.FP32)])
def test_rule6_library_default_is_the_activation_dtype_for_float_only_experts(
    act: torch.dtype, expected: DispatchDtype, no_warnings: None
) -> None:
    decision = resolve(experts_accept=FLOAT_DTYPES, activation_dtype=act)
    assert decision == DispatchDecision(expected, DispatchRule.LIBRARY_DEFAULT)


def test_rule6_without_fp8_on_the_device_uses_the_activation_dtype(no_warnings: None) -> None:
    decision = resolve(experts_accept=FP8_AND_FLOATS, device=DeviceDispatchSupport(fp8=False))
    assert decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.LIBRARY_DEFAULT)


def test_rule6_falls_back_to_bf16_when_the_layer_dtype_is_not_accepted(no_warnings: None) -> None:
    decision = resolve(experts_accept={DType.BF16, DType.INT8}, activation_dtype=torch.float32)
    assert decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.LIBRARY_DEFAULT)


def test_rule6_with_no_fitting_default_raises() -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match="set dispatch_dtype explicitly"):
        resolve(experts_accept={DType.INT8}, activation_dtype=torch.bfloat16)


def test_each_rule_decides_when_all_higher_rules_are_silent(no_warnings: None) -> None:
    """Peel the rules off one at a time: the decision always names the highest rule present."""
    args: dict[str, Any] = dict(setting="fp32", environ={}, quant_requires=DispatchDtype.FP16,
                                backend_requires=DispatchDtype.INT8,
                                device=DeviceDispatchSupport(default=DispatchDtype.FP8))
    expected = [(DispatchRule.EXPLICIT, DispatchDtype.FP32), (DispatchRule.QUANT_METHOD, DispatchDtype.FP16),
                (DispatchRule.EXPERT_BACKEND, DispatchDtype.INT8),
                (DispatchRule.DEVICE_DEFAULT, DispatchDtype.FP8),
                (DispatchRule.LIBRARY_DEFAULT, DispatchDtype.FP8)]
    for rule, dtype in expected:
        decision = mf.resolve_dispatch_dtype(args.pop("setting", "auto"), experts_accept=EVERYTHING,
                                             **{k: v for k, v in args.items()})
        assert (decision.rule, decision.dtype) == (rule, dtype)
        if rule is DispatchRule.EXPLICIT:
            continue
        if rule is DispatchRule.QUANT_METHOD:
            args["quant_requires"] = None
        elif rule is DispatchRule.EXPERT_BACKEND:
            args["backend_requires"] = None
        elif rule is DispatchRule.DEVICE_DEFAULT:
            args["device"] = DeviceDispatchSupport()


def test_rule_labels_and_numbers() -> None:
    assert [int(rule) for rule in DispatchRule] == [1, 2, 3, 4, 5, 6]
    for rule in DispatchRule:
        assert rule.label
        assert f"rule {int(rule)}: {rule.label}" in DispatchDecision(DispatchDtype.BF16, rule).explain()


# -- the environment variable -----------------------------------------------------------------------


def test_environment_warning_names_the_variable() -> None:
    with pytest.warns(UserWarning) as record:
        resolve(environ={ENV: "fp8"})
    assert any(ENV in str(w.message) for w in record)


def test_environment_is_ignored_with_a_warning_for_experts_that_cannot_consume_it() -> None:
    with pytest.warns(UserWarning, match=f"{ENV}=fp8 ignored") as record:
        decision = resolve(environ={ENV: "fp8"}, experts_accept=FLOAT_DTYPES,
                           activation_dtype=torch.bfloat16, experts_name="experts (Draft)")
    assert decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.LIBRARY_DEFAULT)
    assert "experts (Draft)" in str(record[0].message)


def test_ignored_environment_falls_through_to_the_quant_method() -> None:
    with pytest.warns(UserWarning, match="ignored"):
        decision = resolve(environ={ENV: "int8"}, experts_accept=FP8_AND_FLOATS,
                           quant_requires=DispatchDtype.FP8)
    assert decision.rule is DispatchRule.QUANT_METHOD


@pytest.mark.parametrize("value", ["fp4", "bogus", "8"])
def test_invalid_environment_value_raises_naming_the_variable(value: str) -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match=ENV):
        resolve(environ={ENV: value})


@pytest.mark.parametrize("value", ["", "   ", "auto", "Auto"])
def test_empty_or_auto_environment_is_silent(value: str, no_warnings: None) -> None:
    decision = resolve(environ={ENV: value}, experts_accept=FLOAT_DTYPES)
    assert decision.rule is DispatchRule.LIBRARY_DEFAULT


def test_explicit_setting_does_not_read_an_invalid_environment(no_warnings: None) -> None:
    assert resolve("fp8", environ={ENV: "bogus"}).rule is DispatchRule.EXPLICIT


def test_layer_reads_the_environment_it_is_given() -> None:
    with pytest.warns(UserWarning, match=ENV):
        layer = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={ENV: "bf16"})
    assert layer.dispatch_decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.PROCESS_DEFAULT)
    assert f"rule 2: process default {ENV}" in layer.describe()
    with pytest.warns(UserWarning, match="ignored"):
        draft = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={ENV: "fp8"})
    assert draft.dispatch_decision == DispatchDecision(DispatchDtype.FP32, DispatchRule.LIBRARY_DEFAULT)


# -- hardware validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["fp8", "auto"])
def test_fp8_on_a_device_without_fp8_becomes_int8_with_a_warning(setting: str) -> None:
    device = DeviceDispatchSupport(fp8=False, int8=True, default=DispatchDtype.FP8)
    with pytest.warns(UserWarning, match="fp8 is not supported on this device; using int8"):
        decision = resolve(setting, device=device)
    assert decision.dtype is DispatchDtype.INT8
    assert decision.converted_from is DispatchDtype.FP8
    assert decision.rule is (DispatchRule.EXPLICIT if setting == "fp8" else DispatchRule.DEVICE_DEFAULT)
    assert decision.explain().startswith("dispatch int8 (rule")
    assert "converted from fp8" in decision.explain()


def test_int8_where_int8_dispatch_is_unsupported_becomes_fp8() -> None:
    with pytest.warns(UserWarning, match="int8 is not supported"):
        decision = resolve(quant_requires=DispatchDtype.INT8, device=DeviceDispatchSupport(int8=False))
    assert decision == DispatchDecision(DispatchDtype.FP8, DispatchRule.QUANT_METHOD,
                                        converted_from=DispatchDtype.INT8)
    assert "converted from int8" in decision.explain()


def test_nvfp4_where_unsupported_is_rejected() -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match="nvfp4") as info:
        resolve(quant_requires=DispatchDtype.NVFP4, device=DeviceDispatchSupport(nvfp4=False))
    assert "rule 3" in str(info.value)


def test_nvfp4_where_supported_is_kept(no_warnings: None) -> None:
    decision = resolve("nvfp4", device=DeviceDispatchSupport(nvfp4=True))
    assert decision == DispatchDecision(DispatchDtype.NVFP4, DispatchRule.EXPLICIT)


def test_fp8_on_a_device_with_neither_fp8_nor_int8_is_rejected() -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match="cannot carry fp8"):
        resolve("fp8", device=DeviceDispatchSupport(fp8=False, int8=False))


def test_conversion_to_a_dtype_the_experts_cannot_consume_is_a_contract_error() -> None:
    with pytest.warns(UserWarning, match="using int8"), pytest.raises(mf.ContractError) as info:
        resolve("fp8", experts_accept={DType.FP8_E4M3}, device=DeviceDispatchSupport(fp8=False))
    assert info.value.field == "dtype" and info.value.have is DType.INT8


@pytest.mark.parametrize("dtype", [DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32])
def test_float_dtypes_are_carried_by_any_device(dtype: DispatchDtype) -> None:
    assert DeviceDispatchSupport(fp8=False, int8=False, nvfp4=False).carries(dtype)


def test_cpu_device_support() -> None:
    support = DeviceDispatchSupport.for_device("cpu")
    assert support.carries(DispatchDtype.FP8) and support.carries(DispatchDtype.INT8)
    assert support.carries(DispatchDtype.NVFP4)  # the torch reference quantizer (Nvfp4Quantizer)
    assert DeviceDispatchSupport.for_device(None) == support
    assert DeviceDispatchSupport.for_device(torch.device("cpu")) == support


# -- explicit FP8 into the unquantized method -------------------------------------------------------


@pytest.mark.parametrize("setting", ["fp8", "int8", DispatchDtype.FP8])
def test_explicit_quantized_dispatch_into_float_only_experts_is_a_contract_error(setting: Any) -> None:
    with pytest.raises(mf.ContractError) as info:
        resolve(setting, experts_accept=mf.UnquantizedMethod.accepts, experts_name="experts (X)")
    error = info.value
    assert error.field == "dtype"
    assert error.consumer == "experts (X)"
    assert "rule 1: explicit setting" in error.producer
    assert error.want == mf.UnquantizedMethod.accepts
    assert "bf16" in error.hint and error.hint in str(error)


@pytest.mark.parametrize("setting", ["fp8", "int8"])
def test_layer_with_quantized_dispatch_and_unquantized_method_fails_to_build(setting: str) -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.MoELayer(4, 2, 16, 8, dispatch_dtype=setting, environ={})
    assert info.value.field == "dtype"
    assert "UnquantizedMethod" in info.value.consumer
    assert "UnquantizedMethod" in str(info.value)


# -- DispatchDtype ----------------------------------------------------------------------------------


def test_params_bytes() -> None:
    assert {d: d.params_bytes for d in DispatchDtype} == {
        DispatchDtype.BF16: 2.0, DispatchDtype.FP16: 2.0, DispatchDtype.FP32: 4.0, DispatchDtype.FP64: 8.0,
        DispatchDtype.FP8: 1.0, DispatchDtype.INT8: 1.0, DispatchDtype.NVFP4: 0.5,
    }
    # consistent with the element size of the torch dtype that carries it (NVFP4 packs two per byte)
    for d in DispatchDtype:
        if d is not DispatchDtype.NVFP4:
            assert d.params_bytes == d.activation_dtype.torch_dtype.itemsize


@pytest.mark.parametrize("text, expected", [
    ("fp8", DispatchDtype.FP8), ("FP8", DispatchDtype.FP8), ("fp8_e4m3", DispatchDtype.FP8),
    ("fp8-e4m3", DispatchDtype.FP8), ("e4m3", DispatchDtype.FP8), (" Fp8 ", DispatchDtype.FP8),
    ("bf16", DispatchDtype.BF16), ("bfloat16", DispatchDtype.BF16),
    ("fp16", DispatchDtype.FP16), ("float16", DispatchDtype.FP16), ("half", DispatchDtype.FP16),
    ("fp32", DispatchDtype.FP32), ("float32", DispatchDtype.FP32), ("float", DispatchDtype.FP32),
    ("int8", DispatchDtype.INT8), ("INT8", DispatchDtype.INT8), ("nvfp4", DispatchDtype.NVFP4),
    (DispatchDtype.NVFP4, DispatchDtype.NVFP4),
])
def test_parse_aliases(text: Any, expected: DispatchDtype) -> None:
    assert DispatchDtype.parse(text) is expected


@pytest.mark.parametrize("text", ["fp4", "", "auto", "e5m2", "int4", "bf 16"])
def test_parse_errors_list_the_choices(text: str) -> None:
    with pytest.raises(mf.errors.DispatchDtypeError) as info:
        DispatchDtype.parse(text)
    message = str(info.value)
    assert repr(text) in message
    for member in DispatchDtype:
        assert member.value in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [None, 8, torch.bfloat16, DType.BF16])
def test_parse_of_a_non_string_is_a_dispatch_dtype_error(value: Any) -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match="dispatch dtype"):
        DispatchDtype.parse(value)


def test_layer_with_a_non_string_dispatch_dtype_raises_a_clear_error() -> None:
    with pytest.raises(mf.errors.DispatchDtypeError, match="dispatch dtype"):
        mf.MoELayer(4, 2, 16, 8, dispatch_dtype=torch.bfloat16, environ={})  # type: ignore[arg-type]


def test_dtype_mapping() -> None:
    assert DispatchDtype.FP8.activation_dtype is DType.FP8_E4M3
    assert DispatchDtype.FP8.is_quantized and DispatchDtype.INT8.is_quantized
    assert DispatchDtype.NVFP4.is_quantized and not DispatchDtype.BF16.is_quantized
    for d in DispatchDtype:
        assert DispatchDtype.from_dtype(d.activation_dtype) is d


# -- no global state --------------------------------------------------------------------------------


def _fail(*args: Any, **kwargs: Any) -> None:
    raise AssertionError(f"the library wrote the process environment: {args}")


def test_the_library_never_writes_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    before = dict(os.environ)
    x = torch.randn(5, 16)
    with pytest.MonkeyPatch.context() as patch:
        environ_type = type(os.environ)
        patch.setattr(environ_type, "__setitem__", _fail)
        patch.setattr(environ_type, "__delitem__", _fail)
        patch.setattr(os, "putenv", _fail)
        patch.setattr(os, "unsetenv", _fail)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layers = [
                mf.MoELayer(4, 2, 16, 8, dtype=torch.float32),  # reads the real os.environ
                mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, dispatch_dtype="bf16"),
                mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={ENV: "fp16"}),
                mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={ENV: "fp8"}, dispatcher="padded"),
            ]
            for layer in layers:
                layer(x)
                layer.describe()
                layer.process_weights_after_loading()
                layer(x)
            resolve(environ=None, experts_accept=FLOAT_DTYPES)
            resolve(environ=os.environ, experts_accept=FLOAT_DTYPES)
    assert dict(os.environ) == before
    assert ENV not in os.environ


def test_the_real_environment_is_read_at_build_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "fp16")
    with pytest.warns(UserWarning, match=ENV):
        layer = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32)
    assert layer.dispatch_decision.dtype is DispatchDtype.FP16
    monkeypatch.setenv(ENV, "bf16")  # a later change does not affect the built layer
    assert layer.dispatch_decision.dtype is DispatchDtype.FP16
    layer(torch.randn(3, 16))
    assert "dispatch fp16" in layer.describe()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


@torch.no_grad()
def test_two_layers_with_different_dispatch_dtypes_are_independent(no_warnings: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 32)
    cast = mf.MoELayer(8, 2, 32, 16, dtype=torch.float32, dispatch_dtype="bf16", environ={})
    stages_before, describe_before = cast.pipeline.stages, cast.describe()
    out_cast = cast(x).clone()

    auto = mf.MoELayer(8, 2, 32, 16, dtype=torch.float32, dispatch_dtype="auto", environ={})
    auto.load_state_dict(cast.state_dict())  # same weights: only the dispatch dtype differs
    out_auto = auto(x)

    # each layer keeps its own decision and pipeline
    assert cast.dispatch_decision == DispatchDecision(DispatchDtype.BF16, DispatchRule.EXPLICIT)
    assert auto.dispatch_decision == DispatchDecision(DispatchDtype.FP32, DispatchRule.LIBRARY_DEFAULT)
    quantize = [s for s in cast.pipeline.stages if mf.StageKind.QUANTIZE in s.kinds]
    assert len(quantize) == 1 and isinstance(quantize[0], mf.QuantizeTokens)
    assert quantize[0].quantizer == mf.Cast(DType.BF16)
    assert cast.pipeline.specs[1].dtype is DType.BF16
    assert not [s for s in auto.pipeline.stages if mf.StageKind.QUANTIZE in s.kinds]
    assert "dispatch bf16 (rule 1: explicit setting)" in cast.describe()
    assert "dispatch fp32 (rule 6: library default)" in auto.describe()

    # building and running the second layer changed nothing in the first
    assert cast.pipeline.stages == stages_before
    assert cast.describe() == describe_before
    torch.testing.assert_close(cast(x), out_cast, rtol=0, atol=0)

    # outputs: fp32 dispatch is fp32-exact, bf16 dispatch is within bf16 tolerance, and they differ
    ref = layer_reference(auto, x)
    assert _rel(out_auto, ref) < 1e-5
    assert _rel(out_cast, ref) < 2e-2
    assert not torch.equal(out_cast, out_auto)

    # rebuilding one does not touch the other
    auto.process_weights_after_loading()
    assert cast.pipeline.stages == stages_before
    torch.testing.assert_close(cast(x), out_cast, rtol=0, atol=0)


def test_layers_with_different_environments_are_independent() -> None:
    with pytest.warns(UserWarning, match=ENV):
        target = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={ENV: "bf16"})
    draft = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, environ={})
    assert target.dispatch_decision.dtype is DispatchDtype.BF16
    assert draft.dispatch_decision.dtype is DispatchDtype.FP32
    draft.process_weights_after_loading()
    assert target.dispatch_decision.dtype is DispatchDtype.BF16


# -- routing weights on the input need float rows ---------------------------------------------------

ON_INPUT = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)


def test_weights_on_input_pick_a_float_dispatch_and_say_why(no_warnings: None) -> None:
    decision = resolve(experts_accept=FP8_AND_FLOATS, activation_dtype=torch.float16, weights_on_input=True)
    assert decision.dtype is DispatchDtype.FP16 and decision.rule is DispatchRule.LIBRARY_DEFAULT
    assert "routing weights on the input need float rows" in decision.explain()
    # Without the weights on the input the same experts get FP8, and no reason is recorded.
    assert resolve(experts_accept=FP8_AND_FLOATS).dtype is DispatchDtype.FP8
    assert resolve(experts_accept=FP8_AND_FLOATS).reason is None


def test_weights_on_input_skip_a_quantized_preference_and_device_default(no_warnings: None) -> None:
    device = DeviceDispatchSupport(fp8=True, int8=True, default=DispatchDtype.FP8)
    decision = resolve(experts_accept=FP8_AND_FLOATS, device=device, quant_prefers=DispatchDtype.FP8,
                       activation_dtype=torch.bfloat16, weights_on_input=True)
    assert decision.dtype is DispatchDtype.BF16


@pytest.mark.parametrize("setting", ["fp8", "int8"])
def test_explicit_quantized_dispatch_with_weights_on_input_names_the_settings(setting: str) -> None:
    with pytest.raises(mf.ContractError) as caught:
        resolve(setting, weights_on_input=True)
    error = caught.value
    assert error.field == "dtype" and "rule 1" in error.producer
    assert "dispatch_dtype" in error.hint and "apply_weights=RoutingWeights.IN_COMBINE" in error.hint
    assert "QuantizeRows" not in error.hint  # a layer user has no such setting


def test_required_quantized_dispatch_with_weights_on_input_is_a_contract_error() -> None:
    with pytest.raises(mf.ContractError, match="rule 3"):
        resolve(quant_requires=DispatchDtype.NVFP4, weights_on_input=True)


def test_environment_fp8_is_ignored_for_rows_scaled_on_the_input() -> None:
    with pytest.warns(UserWarning, match=f"{ENV}=fp8 ignored.*scales rows on the input"):
        decision = resolve(experts_accept=FP8_AND_FLOATS, environ={ENV: "fp8"}, weights_on_input=True,
                           activation_dtype=torch.float32)
    assert decision.dtype is DispatchDtype.FP32 and decision.rule is DispatchRule.LIBRARY_DEFAULT


def test_experts_taking_only_quantized_rows_cannot_have_weights_on_the_input() -> None:
    with pytest.raises(mf.ContractError, match="apply the weights in the combine"):
        resolve(experts_accept={DType.FP8_E4M3}, weights_on_input=True)


@pytest.mark.parametrize("method", [mf.Fp8W8A8Method, mf.Int8W8A8Method], ids=lambda m: m.__name__)
def test_w8a8_layer_with_weights_on_the_input_builds_under_auto(method: Any) -> None:
    # Was a ContractError whose hint told a layer user to insert QuantizeRows.
    from moeforge.quant.w8a8 import quantize_layer

    torch.manual_seed(0)
    float_layer = mf.MoELayer(4, 1, 32, 16, routing=ON_INPUT, dtype=torch.float32)
    with torch.no_grad():
        float_layer.router.weight.mul_(4)  # decisive routing: weights well away from 1
    layer = quantize_layer(float_layer, method())
    assert layer.dispatch_decision.dtype is DispatchDtype.FP32
    assert "routing weights on the input need float rows" in layer.describe()
    x = torch.randn(5, 32)
    out, reference = layer(x), layer_reference(float_layer, x)
    assert _rel(out, reference) < 0.09  # the FP8 tests' bound: quantization after the dispatch (~0.07 here)
    explicit = quantize_layer(float_layer, method())
    explicit.dispatch_dtype_setting = "fp32"
    explicit.rebuild_pipeline()
    assert "rule 1" in explicit.dispatch_decision.explain()
    assert torch.equal(explicit(x), out)  # "auto" chose exactly what the explicit setting runs


def test_w8a8_layer_with_weights_on_input_and_explicit_fp8_names_the_layer_settings() -> None:
    with pytest.raises(mf.ContractError) as caught:
        mf.MoELayer(4, 1, 32, 16, routing=ON_INPUT, quant=mf.Fp8W8A8Method(), dispatch_dtype="fp8")
    assert "dispatch_dtype" in caught.value.hint and "QuantizeRows" not in caught.value.hint
