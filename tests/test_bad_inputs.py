"""Bad input and bad configuration: refused with an error that names the argument (and what to do),
never a silent wrong answer or an error from deep inside torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moeforge as mf

E, K, H, I = 8, 2, 16, 8


def make_layer(**kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("environ", {})
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, **kwargs)


# -- item 7: router logits paired with the hidden states ----------------------------------------------


def token_by_token(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The intended pairing: token ``t`` of ``x [T, H]`` routed by row ``t`` of ``logits [T, E]``."""
    return torch.cat([layer(x[t:t + 1], logits[t:t + 1]) for t in range(x.shape[0])])


# (hidden states' leading shape, router logits' leading shape) accepted.
ACCEPTED = [((6,), (6,)), ((2, 3), (2, 3)), ((2, 3), (6,)), ((1, 5), (1, 5)), ((3, 1), (3,))]


@pytest.mark.parametrize("lead, logits_lead", ACCEPTED, ids=[f"{a}-{b}" for a, b in ACCEPTED])
def test_every_accepted_router_logits_shape_pairs_token_by_token(
        lead: tuple[int, ...], logits_lead: tuple[int, ...]) -> None:
    layer = make_layer(router=False)
    x = torch.randn(*lead, H)
    logits = torch.randn(*logits_lead, E)
    with torch.no_grad():
        out = layer(x, logits)
        expected = token_by_token(layer, x.reshape(-1, H), logits.reshape(-1, E))
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, H), expected)


# (hidden states' leading shape, router logits' leading shape) refused: same token count, another pairing.
REFUSED = [((2, 3), (3, 2)), ((2, 3), (1, 6)), ((6,), (2, 3)), ((6,), (3, 2)), ((2, 3), (6, 1)),
           ((2, 3), (2, 3, 1))]


@pytest.mark.parametrize("lead, logits_lead", REFUSED, ids=[f"{a}-{b}" for a, b in REFUSED])
def test_router_logits_whose_leading_shape_differs_are_refused_naming_both_shapes(
        lead: tuple[int, ...], logits_lead: tuple[int, ...]) -> None:
    layer = make_layer(router=False)
    x, logits = torch.randn(*lead, H), torch.randn(*logits_lead, E)
    with pytest.raises(mf.InputError, match="router_logits") as info:
        layer(x, logits)
    assert str(tuple(logits.shape)) in str(info.value) and str(tuple(x.shape)) in str(info.value)


# -- item 9: bad configuration values, refused at construction naming the argument -------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, name", [
    (dict(routed_scaling_factor=NAN), "routed_scaling_factor"),
    (dict(routed_scaling_factor=-2.5), "routed_scaling_factor"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(routed_scaling_factor=INF), "routed_scaling_factor"),
    (dict(routed_scaling_factor=True), "routed_scaling_factor"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor"),
    (dict(n_group=True, topk_group=1), "n_group"),
    (dict(n_group=4, topk_group=2.0), "topk_group"),
    (dict(renormalize="no"), "renormalize"),
    (dict(selection_bias=1), "selection_bias"),
    (dict(scaling_in_weights=None), "scaling_in_weights"),
    (dict(router_bias="false"), "router_bias"),
    (dict(router_in_fp32=0), "router_in_fp32"),
    (dict(group_mask_value=True), "group_mask_value"),
    (dict(group_mask_value="-inf"), "group_mask_value"),
    (dict(sparsemixer_eps=True), "sparsemixer_eps"),
    (dict(sparsemixer_eps=NAN), "sparsemixer_eps"),
], ids=lambda value: repr(value) if isinstance(value, dict) else None)
def test_bad_routing_config_values_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        mf.RoutingConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(routed_scaling_factor=2.5), dict(routed_scaling_factor=1.0), dict(routed_scaling_factor=16),
    dict(routed_scaling_factor=0.125), dict(n_group=4, topk_group=4), dict(group_mask_value=0.0),
    dict(sparsemixer_eps=0.0), dict(sparsemixer_eps=0.01),
])
def test_values_real_models_use_are_accepted(kwargs: dict[str, Any]) -> None:
    routing = mf.RoutingConfig(**kwargs)
    layer = mf.MoELayer(E, E, H, I, routing=routing, environ={}, router=False)  # top_k == num_experts too
    assert layer(torch.randn(3, H), torch.randn(3, E)).shape == (3, H)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_experts=True), "num_experts"),
    (dict(top_k=True), "top_k"),
    (dict(hidden_size=True), "hidden_size"),
    (dict(intermediate_size=False), "intermediate_size"),
    (dict(expert_bias="yes"), "expert_bias"),
    (dict(router=1), "router"),
    (dict(debug="no"), "debug"),
])
def test_bad_layer_sizes_and_flags_are_named(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, environ={})
    args.update(kwargs)
    with pytest.raises(mf.InputError, match=name):
        mf.MoELayer(**args)


@pytest.mark.parametrize("kwargs, name", [
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(intermediate_size=True), "intermediate_size"),
    (dict(intermediate_size=16.0), "intermediate_size"),
    (dict(intermediate_size=16, bias="no"), "bias"),
])
def test_bad_shared_experts_config_values_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        mf.SharedExpertsConfig(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(alpha=NAN), "alpha"), (dict(alpha=0.0), "alpha"), (dict(alpha=-1.702), "alpha"),
    (dict(alpha=INF), "alpha"), (dict(alpha=True), "alpha"),
    (dict(limit=NAN), "limit"), (dict(limit=0.0), "limit"), (dict(limit=-7.0), "limit"),
    (dict(limit=-INF), "limit"), (dict(limit=None), "limit"),
    (dict(gelu_approximate="fast"), "gelu_approximate"),
])
def test_bad_activation_config_values_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, **kwargs)


def test_gpt_oss_activation_values_and_an_unbounded_limit_are_accepted() -> None:
    # limit=inf: the clamp does nothing, a well-defined SwiGLU with alpha.
    for kwargs in (dict(alpha=1.702, limit=7.0), dict(alpha=1, limit=INF), dict(alpha=0.5, limit=0.25)):
        config = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, **kwargs)  # type: ignore[arg-type]
        x = torch.randn(3, 2 * I)
        assert torch.isfinite(mf.stages.activation.apply_activation(x, config)).all()


@pytest.mark.parametrize("kwargs, name", [
    (dict(hidden_size=0), "hidden_size"), (dict(hidden_size=True), "hidden_size"),
    (dict(hidden_size=16.0), "hidden_size"), (dict(num_experts=0), "num_experts"),
    (dict(num_experts=True), "num_experts"), (dict(dtype=torch.int8), "dtype"),
    (dict(dtype=torch.float8_e4m3fn), "dtype"), (dict(dtype=torch.complex64), "dtype"),
    (dict(dtype="float32"), "dtype"),
])
def test_bad_input_spec_values_are_named(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = dict(hidden_size=H, dtype=torch.float32, num_experts=E)
    args.update(kwargs)
    with pytest.raises(mf.InputError, match=name):
        mf.input_spec(**args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_input_spec_takes_the_compute_dtypes(dtype: torch.dtype) -> None:
    assert mf.input_spec(H, dtype, E).dtype is mf.DType.from_torch(dtype)


@pytest.mark.parametrize("num_experts, top_k, name", [
    (True, 1, "num_experts"), (4, True, "top_k"), (4.0, 2, "num_experts"), (4, 2.0, "top_k")])
def test_routing_stage_sizes_must_be_ints(num_experts: Any, top_k: Any, name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        mf.TopK(num_experts, top_k)


# -- item 11: enum-typed arguments take the member or its value string, and name the enum otherwise ------


def _custom_topk(**kwargs: Any) -> mf.CustomTopK:
    return mf.CustomTopK(E, K, lambda x, logits, k: logits.topk(k), **kwargs)


# (builder, argument, enum, a member the default is not): every user-facing enum-typed argument.
ENUM_ARGUMENTS: list[tuple[Any, str, type[Any], Any]] = [
    (mf.RoutingConfig, "scoring", mf.Scoring, mf.Scoring.SIGMOID),
    (mf.RoutingConfig, "order", mf.ScoreOrder, mf.ScoreOrder.SELECT_THEN_SCORE),
    (mf.RoutingConfig, "group_score", mf.GroupScore, mf.GroupScore.MAX),
    (mf.RoutingConfig, "apply_weights", mf.RoutingWeights, mf.RoutingWeights.ON_INPUT),
    (mf.ActivationConfig, "kind", mf.ActivationKind, mf.ActivationKind.GPT_OSS_SWIGLU),
    (mf.ActivationConfig, "gate_up", mf.GateUpLayout, mf.GateUpLayout.INTERLEAVED),
    (lambda **kw: mf.SharedExpertsConfig(I, **kw), "gate", mf.SharedGate, mf.SharedGate.SIGMOID),
    (_custom_topk, "apply_weights", mf.RoutingWeights, mf.RoutingWeights.IN_GEMM_EPILOGUE),
    (lambda **kw: mf.PaddedDispatch(E, **kw), "overflow", mf.Overflow, mf.Overflow.DROP),
    (mf.Fp8W8A8Method, "weight_scales", mf.WeightScales, mf.WeightScales.BLOCK),
]
ENUM_IDS = [f"{kind.__name__}-{argument}" for _, argument, kind, _ in ENUM_ARGUMENTS]


@pytest.mark.parametrize("build, argument, kind, member", ENUM_ARGUMENTS, ids=ENUM_IDS)
def test_an_enum_argument_takes_its_value_string(build: Any, argument: str, kind: type[Any], member: Any) -> None:
    for spelling in (member.value, member.value.upper(), f" {member.value} "):
        assert getattr(build(**{argument: spelling}), argument) is member
    assert getattr(build(**{argument: member}), argument) is member


@pytest.mark.parametrize("build, argument, kind, member", ENUM_ARGUMENTS, ids=ENUM_IDS)
@pytest.mark.parametrize("bad", ["nonsense", 1, None, mf.DType.BF16], ids=["string", "int", "none", "other-enum"])
def test_anything_else_for_an_enum_argument_names_the_enum_and_its_values(
        build: Any, argument: str, kind: type[Any], member: Any, bad: Any) -> None:
    with pytest.raises(mf.InputError, match=argument) as info:
        build(**{argument: bad})
    message = str(info.value)
    assert kind.__name__ in message and all(repr(other.value) in message for other in kind)


def test_activation_config_takes_the_kind_positionally_as_a_string() -> None:
    assert mf.ActivationConfig("swiglu") == mf.ActivationConfig(mf.ActivationKind.SWIGLU)
    assert mf.ActivationConfig("gpt_oss_swiglu", "interleaved").gated


def test_a_routing_config_from_strings_routes_like_the_enums() -> None:
    strings = mf.RoutingConfig(scoring="sigmoid", order="select_then_score", apply_weights="on_input")
    enums = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, order=mf.ScoreOrder.SELECT_THEN_SCORE,
                             apply_weights=mf.RoutingWeights.ON_INPUT)
    assert strings == enums


# -- item 11: a class, a string or a config of the wrong kind where an instance is meant -----------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(quant=mf.Fp8W8A8Method),
     r"quant=Fp8W8A8Method is the class: pass an instance, quant=Fp8W8A8Method\(\)"),
    (dict(quant="fp8"), r"quant must be a QuantMethod"),
    (dict(routing=mf.RoutingConfig),
     r"routing=RoutingConfig is the class: pass an instance, routing=RoutingConfig\(\)"),
    (dict(routing="softmax"), r"routing must be a RoutingConfig"),
    (dict(activation="swiglu"), r"activation must be an ActivationConfig \(e.g. ActivationConfig\('swiglu'\)\)"),
    (dict(activation=mf.ActivationKind.GEGLU), r"activation must be an ActivationConfig"),
    (dict(shared_experts=64),
     r"shared_experts must be a SharedExpertsConfig \(e.g. SharedExpertsConfig\(64\)\) or None"),
])
def test_a_layer_argument_of_the_wrong_kind_says_what_to_pass(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(mf.InputError, match=match):
        make_layer(**kwargs)


def test_shared_experts_config_activation_of_the_wrong_kind_says_what_to_pass() -> None:
    with pytest.raises(mf.InputError, match=r"SharedExpertsConfig.activation must be an ActivationConfig"):
        mf.SharedExpertsConfig(32, activation="swiglu")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [torch.float32, None, mf.DispatchDtype.BF16])
def test_a_backend_of_the_wrong_type_is_named(backend: Any) -> None:
    with pytest.raises(mf.BackendUnavailableError, match="backend must be a Backend or 'auto', 'torch' or 'triton'"):
        make_layer(backend=backend)


# -- item 12: our errors where torch's would say nothing a user can act on ----------------------------


def test_a_layer_can_be_built_on_the_meta_device() -> None:
    layer = make_layer(device="meta")
    assert layer.device == torch.device("meta") and layer.w13_weight.is_meta


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_calling_a_meta_layer_says_to_materialise_it(device: str) -> None:
    layer = make_layer(device="meta")
    with pytest.raises(mf.InputError, match=r"meta device.*to_empty\(device=.*load_weights"):
        layer(torch.randn(3, H, device=device))


@pytest.mark.parametrize("call", [
    lambda layer: layer.to(torch.int8), lambda layer: layer.to(dtype=torch.int64),
    lambda layer: layer.to("cpu", torch.bool), lambda layer: layer.to(torch.empty(0, dtype=torch.uint8)),
], ids=["to(int8)", "to(dtype=int64)", "to(cpu, bool)", "to(tensor)"])
def test_an_integer_dtype_conversion_is_refused_naming_the_float_dtypes(call: Any) -> None:
    layer = make_layer()
    with pytest.raises(mf.InputError, match=r"new dtype must be torch.bfloat16, torch.float16 or torch.float32.*"
                                            r"got torch\.(int8|int64|bool|uint8).*quant method"):
        call(layer)
    assert layer.dtype == torch.float32 and layer.w13_weight.dtype == torch.float32
    assert layer(torch.randn(2, H)).shape == (2, H)


def test_conversions_to_float_dtypes_and_devices_still_work() -> None:
    layer = make_layer()
    assert layer.to("cpu") is layer and layer.to(torch.device("cpu"), non_blocking=True) is layer
    assert layer.to(torch.float16).dtype == torch.float16
    assert layer.to(torch.empty(0, dtype=torch.bfloat16)).dtype == torch.bfloat16


HF_KEYS = {
    "per-expert w1/w3/w2": ["experts.0.w1.weight", "experts.0.w3.weight", "experts.0.w2.weight", "gate.weight"],
    "per-expert proj": ["experts.3.gate_proj.weight", "experts.3.up_proj.weight", "experts.3.down_proj.weight"],
    "fused": ["experts.gate_up_proj", "experts.down_proj"],
    "router": ["gate.weight"],
    "shared experts": ["shared_expert.gate_proj.weight", "shared_expert_gate.weight"],
}


@pytest.mark.parametrize("prefix", ["", "model.layers.3.mlp."])
@pytest.mark.parametrize("keys", list(HF_KEYS.values()), ids=list(HF_KEYS))
def test_load_state_dict_with_checkpoint_names_points_to_load_weights(keys: list[str], prefix: str) -> None:
    layer = make_layer()
    state = {prefix + key: torch.zeros(1) for key in keys}
    before = layer.w13_weight.clone()
    with pytest.raises(mf.CheckpointError, match=r"moeforge\.checkpoint\.load_weights") as info:
        layer.load_state_dict(state)
    message = str(info.value)
    assert f"'{prefix}{keys[0]}'" in message and f"prefix={prefix!r}" in message
    assert isinstance(info.value, RuntimeError)  # what nn.Module.load_state_dict raises: callers keep working
    assert torch.equal(layer.w13_weight, before)


def test_load_state_dict_with_checkpoint_names_and_strict_false_works_as_in_torch() -> None:
    layer = make_layer()
    result = layer.load_state_dict({"experts.0.w1.weight": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["experts.0.w1.weight"] and "w13_weight" in result.missing_keys


def test_load_state_dict_with_the_layers_own_names_works() -> None:
    layer, other = make_layer(), make_layer(shared_experts=None)
    with torch.no_grad():
        other.w13_weight.mul_(2)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer.w13_weight, other.w13_weight)
    with pytest.raises(RuntimeError, match="Unexpected key") as info:  # not a checkpoint's names: torch's error
        layer.load_state_dict({**other.state_dict(), "something_else": torch.zeros(1)})
    assert not isinstance(info.value, mf.CheckpointError)
