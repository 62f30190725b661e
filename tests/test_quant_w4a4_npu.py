"""W4A4NpuMethod: BF16 dispatch required (rule 3), int4 quantization inside the expert computation,
one fused expert stage calling ``apply_without_routing_weights``, and a fused dispatch -> combine stage.

The reference re-implements the documented numerics independently: nibbles decoded with plain
arithmetic, per-token int4 fake quantization, the integer products summed in float64 (exact), the
dequantizing epilogue ``acc * x_scale * w_scale (+ bias)`` in fp32 in the documented order (so the
intermediate's re-quantization sees the same values and rounds the same way), per expert, densely.
Expert rows agree to rel 1e-5; bf16 layer outputs to rel 1e-2 (bf16 rounding of the rows and output).
Against the float layer the weights were quantized from: measured rel 0.24-0.26 over 5 seeds (int4
has 15 levels, applied to the weights (~0.10 alone) and to both GEMM inputs); bounded loosely (< 0.5).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.errors import BackendUnavailableError, CheckpointError
from moeforge.payloads import ExpertRows, PaddedRows, SortedRows
from moeforge.quant.w4a4_npu import (
    W4A4Experts,
    W4A4FusedEp,
    W4A4NpuMethod,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from moeforge.stages.activation import apply_activation
from moeforge.stages.topk import select_experts
from moeforge.testing import default_settings

E, K, H, I = 4, 2, 32, 16


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _layer(**kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.bfloat16)
    sizes = kwargs.pop("sizes", (E, K, H, I))
    return mf.MoELayer(*sizes, quant=W4A4NpuMethod(), backend="torch", environ={}, **kwargs)


def _float_weights(layer: mf.MoELayer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n13 = 2 * layer.intermediate_size if layer.activation.gated else layer.intermediate_size
    gen = _gen(seed)
    w13 = torch.randn(layer.num_experts, n13, layer.hidden_size, generator=gen) * layer.hidden_size ** -0.5
    w2 = torch.randn(layer.num_experts, layer.hidden_size, layer.intermediate_size, generator=gen)
    return w13, w2 * layer.intermediate_size ** -0.5


def _fill(layer: mf.MoELayer, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w13, w2 = _float_weights(layer, seed)
    quant = layer.quant
    assert isinstance(quant, W4A4NpuMethod)
    quant.quantize_weights(layer, w13, w2)
    gen = _gen(seed + 1000)
    with torch.no_grad():
        for name in ("w13_bias", "w2_bias"):
            bias = getattr(layer, name, None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
        assert layer.router is not None
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
    return w13, w2


def _x(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(tokens, H, generator=_gen(seed)).to(dtype)


# -- the independent reference ------------------------------------------------------------------------------


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """int64 codes from packed bytes, by arithmetic: low nibble first, 4-bit two's complement."""
    low, high = packed.long() % 16, packed.long() // 16
    signed = lambda n: n - 16 * (n >= 8).long()  # noqa: E731
    return torch.stack([signed(low), signed(high)], dim=-1).flatten(-2)


def _fake_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer codes as float64, fp32 scale [..., 1]) per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7.0
    return torch.round(x / scale).clamp(-7, 7).double(), scale


def _expert(layer: mf.MoELayer, x: torch.Tensor, expert: int) -> torch.Tensor:
    """fp32 output of one expert for rows ``x``."""
    def gemm(inputs: torch.Tensor, prefix: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
        codes, x_scale = _fake_int4(inputs)
        w_codes = _codes(getattr(layer, f"{prefix}_weight")[expert]).double()
        acc = (codes @ w_codes.t()).float()  # exact integers
        out = acc * x_scale * getattr(layer, f"{prefix}_weight_scale")[expert].float()
        return out + bias[expert].float() if bias is not None else out

    hidden = gemm(x, "w13", getattr(layer, "w13_bias", None))
    return gemm(apply_activation(hidden, layer.activation), "w2", getattr(layer, "w2_bias", None))


def _reference_rows(layer: mf.MoELayer, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for expert, count in enumerate(counts):
        out.append(_expert(layer, rows[start:start + count], expert))
        start += count
    return torch.cat(out) if out else torch.zeros(0, H)


def _reference(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """float64 layer output: every token through its chosen experts, rows rounded to bf16 as the stage
    returns them, weighted sum."""
    topk = select_experts(logits, layer.top_k, layer.routing)
    rows = x.to(torch.bfloat16)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for e in range(layer.num_experts):
        y = _expert(layer, rows, e).to(torch.bfloat16).double()
        weight = (topk.weights * (topk.ids == e)).sum(dim=-1, keepdim=True).double()
        out += y * weight
    factor = layer.routing.routed_scaling_factor
    return out * factor if factor != 1.0 and not layer.routing.scaling_in_weights else out


# -- int4 ----------------------------------------------------------------------------------------------------


def test_pack_int4_layout() -> None:
    codes = torch.tensor([[-1, 2, 7, -7], [-8, 0, 3, -3]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x2F, 0x97], [0x08, 0xD3]]
    assert torch.equal(unpack_int4(packed), codes)
    assert torch.equal(_codes(packed), codes.long())
    with pytest.raises(mf.InputError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(mf.InputError, match="uint8"):
        unpack_int4(torch.zeros(3, dtype=torch.int8))


@default_settings(max_examples=15)
@given(rows=st.integers(0, 4), width=st.sampled_from([2, 6, 32]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_quantize_int4_per_row(rows: int, width: int, seed: int, scale: float) -> None:
    x = torch.randn(rows, width, generator=_gen(seed)) * scale
    codes, x_scale = quantize_int4(x)
    assert codes.dtype == torch.int8 and x_scale.shape == (rows, 1)
    want, want_scale = _fake_int4(x)
    assert torch.equal(codes.long(), want.long()) and torch.equal(x_scale, want_scale)
    if rows:
        assert int(codes.abs().max()) == 7  # each row's amax maps to +-7
        assert bool(((codes.float() * x_scale - x).abs() <= x_scale / 2 + 1e-6 * scale).all())
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


def test_quantize_int4_edge_rows() -> None:
    codes, scale = quantize_int4(torch.zeros(2, 4))
    assert bool((codes == 0).all()) and bool((scale > 0).all())
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0], [float("inf"), 1.0, 2.0, 3.0]])
    codes, scale = quantize_int4(x)
    assert bool((~torch.isfinite(codes.float() * scale).all(dim=-1) | torch.isnan(scale).squeeze(-1)).all())


# -- capabilities and weights -------------------------------------------------------------------------------


def test_capabilities_are_class_data() -> None:
    for name in ("accepts", "accepts_scales", "expert_parameters", "offers_fused_ep"):
        assert name in vars(W4A4NpuMethod)
    assert W4A4NpuMethod.accepts == {mf.DType.BF16} and W4A4NpuMethod.accepts_scales == {mf.ScaleLayout.NONE}
    assert W4A4NpuMethod.offers_fused_ep
    assert W4A4NpuMethod().required_dispatch_dtype() is mf.DispatchDtype.BF16


@pytest.mark.parametrize("bias", [False, True])
def test_create_and_quantize_weights(bias: bool) -> None:
    layer = _layer(expert_bias=bias)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()
              if not name.startswith("router")}
    expected = {"w13_weight": ((E, 2 * I, H // 2), torch.uint8), "w13_weight_scale": ((E, 2 * I), torch.float32),
                "w2_weight": ((E, H, I // 2), torch.uint8), "w2_weight_scale": ((E, H), torch.float32)}
    if bias:
        expected.update({"w13_bias": ((E, 2 * I), torch.bfloat16), "w2_bias": ((E, H), torch.bfloat16)})
    assert shapes == expected and set(shapes) <= set(W4A4NpuMethod.expert_parameters)
    w13, w2 = _fill(layer, seed=1)
    torch.testing.assert_close(layer.w13_weight_scale, w13.abs().amax(dim=-1) / 7)
    for name, weight in (("w13", w13), ("w2", w2)):
        codes = _codes(getattr(layer, f"{name}_weight"))
        scale = getattr(layer, f"{name}_weight_scale")
        assert torch.equal(codes, torch.round(weight / scale.unsqueeze(-1)).clamp(-7, 7).long())
        assert _rel(codes * scale.unsqueeze(-1), weight) < 0.2  # int4 per channel: measured ~0.10


@pytest.mark.parametrize("sizes, name", [((E, K, 33, I), "hidden_size"), ((E, K, H, 15), "intermediate_size")])
def test_sizes_must_be_even(sizes: tuple[int, int, int, int], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        _layer(sizes=sizes)


def test_process_weights_after_loading_checks_the_tensors() -> None:
    layer = _layer()
    layer.process_weights_after_loading()
    layer.w2_weight_scale = torch.nn.Parameter(torch.ones(E, H, 1), requires_grad=False)
    with pytest.raises(CheckpointError, match="w2_weight_scale"):
        layer.process_weights_after_loading()


# -- dispatch dtype: rule 3 ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_dispatch_by_rule_3_and_one_fused_expert_stage(dtype: torch.dtype) -> None:
    layer = _layer(dtype=dtype)
    assert layer.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.BF16, mf.DispatchRule.QUANT_METHOD)
    assert "dispatch bf16 (rule 3: quant method)" in layer.describe()
    kinds = [stage.kinds for stage in layer.pipeline.stages]
    assert (mf.StageKind.GEMM, mf.StageKind.ACTIVATION, mf.StageKind.GEMM) in kinds
    experts = [stage for stage in layer.pipeline.stages if isinstance(stage, W4A4Experts)]
    assert len(experts) == 1
    assert (mf.StageKind.QUANTIZE in {k for ks in kinds for k in ks}) is (dtype != torch.bfloat16)  # fp32 -> bf16


@pytest.mark.parametrize("dispatch", ["fp8", "int8", "fp32"])
def test_an_explicit_non_bf16_dispatch_is_a_contract_error(dispatch: str) -> None:
    with pytest.raises(mf.ContractError) as info:
        _layer(dispatch_dtype=dispatch)
    assert info.value.field == "dtype" and "W4A4NpuMethod" in info.value.consumer
    assert "rule 1: explicit setting" in info.value.producer


def test_the_process_default_is_ignored_for_this_layer() -> None:
    with pytest.warns(UserWarning, match="MOEFORGE_DISPATCH_DTYPE=fp8 ignored"):
        layer = mf.MoELayer(E, K, H, I, quant=W4A4NpuMethod(), backend="torch",
                            environ={"MOEFORGE_DISPATCH_DTYPE": "fp8"})
    assert layer.dispatch_decision.rule is mf.DispatchRule.QUANT_METHOD


def test_the_triton_backend_is_unavailable() -> None:
    layer = _layer()
    with pytest.raises(BackendUnavailableError, match="backend='torch'"):
        selected_stages(W4A4NpuMethod(), layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                      backend=mf.Backend.TRITON)


# -- forward against the reference -----------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("routing", [
    mf.RoutingConfig(),
    mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE),
    mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5, scaling_in_weights=False),
], ids=["combine", "epilogue", "scaling-factor"])
@torch.no_grad()
def test_forward_matches_the_reference(dispatcher: str, bias: bool, routing: mf.RoutingConfig) -> None:
    layer = _layer(dispatcher=dispatcher, expert_bias=bias, routing=routing, debug=True)
    _fill(layer, seed=2)
    x = _x(12, 3)
    logits = layer.router_logits(x)
    assert _rel(layer(x, logits), _reference(layer, x, logits)) < 1e-2


def _dispatched(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> ExpertRows:
    payload: Any = mf.MoEInput(x, logits)
    for stage in layer.pipeline.stages:
        payload = stage(payload)
        if mf.StageKind.DISPATCH in stage.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


@pytest.mark.parametrize("activation", [mf.ActivationKind.SWIGLU, mf.ActivationKind.GPT_OSS_SWIGLU,
                                        mf.ActivationKind.RELU2])
@pytest.mark.parametrize("group_list_type", [mf.GroupListType.COUNT, mf.GroupListType.CUMSUM])
@torch.no_grad()
def test_apply_without_routing_weights_matches_the_reference_rows(
        activation: mf.ActivationKind, group_list_type: mf.GroupListType) -> None:
    layer = _layer(activation=mf.ActivationConfig(activation), expert_bias=True,
                   dispatcher=mf.SortedDispatch(E, group_list_type=group_list_type))
    _fill(layer, seed=4)
    x = _x(10, 5)
    rows = _dispatched(layer, x, layer.router_logits(x))
    assert isinstance(rows, SortedRows)
    out = layer.quant.apply_without_routing_weights(layer, rows.x.data, None, int(group_list_type), rows.group_list,
                                                    torch.float32)
    expected = _reference_rows(layer, rows.x.data, rows.counts().tolist())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_apply_on_padded_rows_equals_sorted_rows() -> None:
    sorted_layer = _layer()
    _fill(sorted_layer, seed=6)
    padded_layer = _layer(dispatcher="padded")
    padded_layer.load_state_dict(sorted_layer.state_dict())
    x = _x(9, 7)
    logits = sorted_layer.router_logits(x)
    rows = _dispatched(sorted_layer, x, logits)
    slots = _dispatched(padded_layer, x, logits)
    assert isinstance(rows, SortedRows) and isinstance(slots, PaddedRows)
    quant = sorted_layer.quant
    out = quant.apply_without_routing_weights(sorted_layer, rows.x.data, None, 1, rows.group_list, torch.float32)
    padded = quant.apply_without_routing_weights(padded_layer, slots.x.data, None, 1, slots.masked_m, torch.float32)
    a = rows.plan.combine(out, True, None, torch.float32)
    b = slots.plan.combine(padded, True, None, torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hidden, scale, group_list, match", [
    (_x(8, 0), torch.ones(8, 1), None, "hidden_states_scale"),
    (_x(8, 0, torch.float32), None, None, "bf16"),
    (_x(8, 0).to(torch.float16), None, None, "bf16"),
    (torch.randn(8, H + 2).bfloat16(), None, None, "hidden_states"),
    (_x(8, 0), None, torch.tensor([2, 2, 2, 1]), "group_list"),
    (_x(8, 0), None, torch.full((E - 1,), 2), "group_list"),
    (torch.randn(E, 2, H).bfloat16(), None, torch.full((E,), 2), "group_list_type"),
])
def test_apply_rejects_bad_arguments(hidden: torch.Tensor, scale: Optional[torch.Tensor],
                                     group_list: Optional[torch.Tensor], match: str) -> None:
    layer = _layer()
    if group_list is None:
        group_list = torch.full((E,), 2, dtype=torch.int64)
    group_list_type = 0 if hidden.dim() == 3 else 1
    with pytest.raises(mf.InputError, match=match):
        layer.quant.apply_without_routing_weights(layer, hidden, scale, group_list_type, group_list, torch.float32)


@torch.no_grad()
def test_close_to_the_float_layer_it_was_quantized_from() -> None:
    layer = _layer(dtype=torch.float32)
    w13, w2 = _fill(layer, seed=8)
    dense = mf.MoELayer(E, K, H, I, dtype=torch.float32, backend="torch", environ={})
    dense.w13_weight.copy_(w13)
    dense.w2_weight.copy_(w2)
    assert dense.router is not None and layer.router is not None
    dense.router.weight.copy_(layer.router.weight)
    x = _x(64, 9, torch.float32)
    assert 0.02 < _rel(layer(x), dense(x)) < 0.5  # measured 0.24 for this seed


# -- the fused dispatch -> combine stage -------------------------------------------------------------------


def _pair(seed: int, **kwargs: Any) -> tuple[mf.MoELayer, mf.MoELayer]:
    """The unfused layer and the fused-EP layer with the same weights."""
    unfused = _layer(**kwargs)
    _fill(unfused, seed)
    fused = _layer(dispatcher="fused_ep", **{k: v for k, v in kwargs.items() if k != "dispatcher"})
    fused.load_state_dict(unfused.state_dict())
    return unfused, fused


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_the_fused_stage_equals_the_unfused_pipeline(dispatcher: str, dtype: torch.dtype) -> None:
    unfused, fused = _pair(10, dispatcher=dispatcher, dtype=dtype, expert_bias=True, debug=True)
    stages = fused.pipeline.stages
    assert isinstance(stages[-1], W4A4FusedEp)
    assert stages[-1].kinds == (mf.StageKind.DISPATCH, mf.StageKind.GEMM, mf.StageKind.ACTIVATION,
                                mf.StageKind.GEMM, mf.StageKind.COMBINE)
    text = fused.describe()
    assert "W4A4FusedEp(" in text and "dispatch bf16 (rule 3: quant method)" in text
    x = _x(13, 11, dtype)
    assert torch.equal(fused(x), unfused(x))


@torch.no_grad()
def test_the_fused_stage_applies_a_pending_scaling_factor() -> None:
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5, scaling_in_weights=False)
    unfused, fused = _pair(12, routing=routing)
    assert "x2.5" in fused.describe()
    x = _x(7, 13)
    assert torch.equal(fused(x), unfused(x))


@pytest.mark.parametrize("apply_weights", [mf.RoutingWeights.IN_GEMM_EPILOGUE, mf.RoutingWeights.ON_INPUT])
def test_the_fused_stage_applies_routing_weights_only_in_its_combine(apply_weights: mf.RoutingWeights) -> None:
    with pytest.raises(mf.ContractError) as info:
        _layer(dispatcher="fused_ep", routing=mf.RoutingConfig(apply_weights=apply_weights))
    assert info.value.field == "routing_weights" and "IN_COMBINE" in info.value.hint


def test_fused_ep_with_a_method_that_offers_none_is_a_contract_error() -> None:
    assert not mf.UnquantizedMethod.offers_fused_ep
    with pytest.raises(mf.ContractError, match="fused_ep") as info:
        mf.MoELayer(E, K, H, I, dispatcher="fused_ep", backend="torch", environ={})
    assert info.value.field == "fused_ep" and "UnquantizedMethod" in str(info.value)


@torch.no_grad()
def test_rebuilding_the_fused_pipeline_is_idempotent() -> None:
    _, fused = _pair(14)
    x = _x(5, 15)
    before = fused(x)
    fused.process_weights_after_loading()  # prepare_fused_ep_weights runs again
    fused.rebuild_pipeline()
    assert torch.equal(fused(x), before)


@default_settings(max_examples=12)
@given(num_experts=st.integers(1, 4), data=st.data(), tokens=st.sampled_from([0, 1, 2, 6]),
       skew=st.sampled_from(["random", "one_expert"]), dispatcher=st.sampled_from(["sorted", "padded"]),
       seed=st.integers(0, 2**16))
@torch.no_grad()
def test_edge_cases_fused_unfused_and_reference_agree(num_experts: int, data: st.DataObject, tokens: int, skew: str,
                                                      dispatcher: str, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")  # includes top_k == num_experts
    unfused, fused = _pair(seed, sizes=(num_experts, top_k, H, I), dispatcher=dispatcher)
    x = _x(tokens, seed + 1)
    logits = torch.randn(tokens, num_experts, generator=_gen(seed + 2))
    if skew == "one_expert":
        logits[:, -1] += 20.0
    out = unfused(x, logits)
    assert out.shape == (tokens, H)
    assert torch.equal(fused(x, logits), out)
    if tokens:
        assert _rel(out, _reference(unfused, x, logits)) < 1e-2
