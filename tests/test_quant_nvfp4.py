"""Nvfp4Method: NVFP4 weights (+ optional NVFP4 activations with a static global scale), emulated GEMMs.

References: the layer's weights dequantized with :mod:`moeforge.quant.fp4` (tested on its own in
test_fp4_formats.py), the input tokens fake-quantized the same way when the dispatch is NVFP4, then the
dense float64 oracle :func:`moeforge.reference.dense_moe`. fp32 layers agree to rel 1e-5 (only fp32
summation order differs). Against the *float* layer whose weights were quantized, the error is the
quantization's, compounded over two GEMMs and the SwiGLU: measured rel 0.16-0.19 (weights only) and
0.20-0.25 (weights and activations, global scale amax / 2688) over 5 seeds at these sizes (one e2m1
rounding alone costs ~0.10, see test_fp4_formats.py); the test bounds it loosely (< 0.3 / < 0.35) and
from below (> 0.01, so quantization did happen).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.dispatch_dtype import DeviceDispatchSupport
from moeforge.errors import CheckpointError, DispatchDtypeError
from moeforge.payloads import ExpertRows, PaddedRows, SortedRows
from moeforge.quant.fp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from moeforge.quant.nvfp4 import EmulatedGroupedGemm, Nvfp4Method, Nvfp4Quantizer, Nvfp4WeightRef
from moeforge.reference import dense_moe
from moeforge.spec import FLOAT_DTYPES, Layout, PayloadKind, Spec
from moeforge.testing import assert_stage_honours_contract, default_settings, dispatch_outputs

E, K, H, I = 4, 2, 32, 16
G = 0.004  # a static input global scale that covers |x| up to 6 * 448 * G ~ 10.8


@pytest.fixture
def nvfp4_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU carries NVFP4 dispatch (the torch reference quantizer exists; see the report's diff
    for moeforge/dispatch_dtype.py)."""
    monkeypatch.setattr(DeviceDispatchSupport, "for_device", classmethod(lambda cls, device: cls(nvfp4=True)))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _float_weights(layer: mf.MoELayer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n13 = 2 * layer.intermediate_size if layer.activation.gated else layer.intermediate_size
    gen = _gen(seed)
    w13 = torch.randn(layer.num_experts, n13, layer.hidden_size, generator=gen) * layer.hidden_size ** -0.5
    w2 = torch.randn(layer.num_experts, layer.hidden_size, layer.intermediate_size, generator=gen)
    return w13, w2 * layer.intermediate_size ** -0.5


def _fill(layer: mf.MoELayer, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float weights, quantized into the layer; random router and biases. Returns the floats."""
    w13, w2 = _float_weights(layer, seed)
    quant = layer.quant
    assert isinstance(quant, Nvfp4Method)
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


def _layer(method: Optional[Nvfp4Method] = None, **kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    sizes = kwargs.pop("sizes", (E, K, H, I))
    return mf.MoELayer(*sizes, quant=method or Nvfp4Method(), backend="torch", environ={}, **kwargs)


def _dequantized(layer: mf.MoELayer, prefix: str) -> torch.Tensor:
    return dequantize_nvfp4(getattr(layer, f"{prefix}_weight"), getattr(layer, f"{prefix}_weight_scale"),
                            getattr(layer, f"{prefix}_weight_global_scale"))


def _reference(layer: mf.MoELayer, x: torch.Tensor, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64: (fake-quantized input if the dispatch is NVFP4) through dequantized weights."""
    if logits is None:
        logits = layer.router_logits(x)
    quant = layer.quant
    assert isinstance(quant, Nvfp4Method)
    inputs = x
    if layer.dispatch_decision.dtype is mf.DispatchDtype.NVFP4:
        assert quant.input_global_scale is not None
        inputs = quantize_nvfp4(x, quant.input_global_scale).dequantize()
    return dense_moe(inputs, logits, top_k=layer.top_k, w13=_dequantized(layer, "w13"), w2=_dequantized(layer, "w2"),
                     w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
                     routing=layer.routing, activation=layer.activation)


def _x(tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, H, generator=_gen(seed)).to(dtype)


# -- capabilities and configuration --------------------------------------------------------------------


def test_capabilities_are_class_data() -> None:
    for name in ("accepts", "accepts_scales", "expert_parameters"):
        assert name in vars(Nvfp4Method)
    assert Nvfp4Method.accepts == FLOAT_DTYPES | {mf.DType.NVFP4}
    assert Nvfp4Method.accepts_scales == {mf.ScaleLayout.NONE, mf.ScaleLayout.NVFP4_BLOCK16}
    assert Nvfp4Method.prefers is None and not Nvfp4Method.offers_fused_ep
    assert Nvfp4Method().required_dispatch_dtype() is None
    assert Nvfp4Method(G).required_dispatch_dtype() is mf.DispatchDtype.NVFP4
    assert repr(Nvfp4Method(0.5)) == "Nvfp4Method(input_global_scale=0.5)"


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.1", True])
def test_input_global_scale_must_be_positive_and_finite(bad: Any) -> None:
    with pytest.raises(mf.InputError, match="input_global_scale"):
        Nvfp4Method(bad)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_create_weights(gated: bool, bias: bool) -> None:
    holder = torch.nn.Module()
    Nvfp4Method().create_weights(holder, num_experts=E, hidden_size=H, intermediate_size=I, gated=gated,
                                 bias=bias, dtype=torch.bfloat16, device="cpu")
    n13 = 2 * I if gated else I
    params = dict(holder.named_parameters())
    expected = {
        "w13_weight": ((E, n13, H // 2), torch.uint8), "w13_weight_scale": ((E, n13, H // 16), torch.float8_e4m3fn),
        "w13_weight_global_scale": ((E,), torch.float32), "w2_weight": ((E, H, I // 2), torch.uint8),
        "w2_weight_scale": ((E, H, I // 16), torch.float8_e4m3fn), "w2_weight_global_scale": ((E,), torch.float32),
    }
    if bias:
        expected.update({"w13_bias": ((E, n13), torch.bfloat16), "w2_bias": ((E, H), torch.bfloat16)})
    assert {name: (tuple(p.shape), p.dtype) for name, p in params.items()} == expected
    assert set(params) <= set(Nvfp4Method.expert_parameters)
    assert Nvfp4Method().expert_parameter_names(holder) == tuple(
        n for n in Nvfp4Method.expert_parameters if n in params)
    assert not any(p.requires_grad for name, p in params.items() if "bias" not in name)
    assert bool((holder.w13_weight_global_scale > 0).all()) and int(holder.w13_weight.count_nonzero()) > 0
    w13 = dequantize_nvfp4(holder.w13_weight, holder.w13_weight_scale, holder.w13_weight_global_scale)
    assert bool(torch.isfinite(w13).all()) and 0.5 < float(w13.std() * H ** 0.5) < 1.5  # ~N(0, 1/H)


@pytest.mark.parametrize("sizes, name", [((E, K, 24, I), "hidden_size"), ((E, K, H, 8), "intermediate_size")])
def test_sizes_must_be_multiples_of_16(sizes: tuple[int, int, int, int], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        _layer(sizes=sizes)


def test_quantize_weights_per_expert_global_scale() -> None:
    layer = _layer()
    w13, w2 = _fill(layer, seed=1)
    torch.testing.assert_close(layer.w13_weight_global_scale, w13.abs().amax(dim=(1, 2)) / 2688)
    torch.testing.assert_close(layer.w2_weight_global_scale, w2.abs().amax(dim=(1, 2)) / 2688)
    assert _rel(_dequantized(layer, "w13"), w13) < 0.12 and _rel(_dequantized(layer, "w2"), w2) < 0.12
    with pytest.raises(mf.InputError, match="w13 must be"):
        layer.quant.quantize_weights(layer, w13[:, :-1], w2)  # type: ignore[attr-defined]
    with pytest.raises(mf.InputError, match="w2 must be"):
        layer.quant.quantize_weights(layer, w13, w2.transpose(1, 2))  # type: ignore[attr-defined]


def test_quantize_weights_equals_quantizing_the_whole_tensor() -> None:
    """Expert by expert (small temporaries) gives what one call over ``[E, N, K]`` gives."""
    layer = _layer()
    w13, w2 = _fill(layer, seed=2)
    for prefix, weight in (("w13", w13), ("w2", w2)):
        whole = quantize_nvfp4(weight, nvfp4_global_scale(weight, leading_dims=1))
        assert torch.equal(getattr(layer, f"{prefix}_weight"), whole.data)
        assert torch.equal(getattr(layer, f"{prefix}_weight_scale").view(torch.uint8), whole.scale.view(torch.uint8))
        assert torch.equal(getattr(layer, f"{prefix}_weight_global_scale"), whole.global_scale)


def test_process_weights_after_loading_checks_the_tensors() -> None:
    layer = _layer()
    layer.process_weights_after_loading()  # valid: passes and rebuilds
    with torch.no_grad():
        layer.w2_weight_global_scale[1] = 0.0
    with pytest.raises(CheckpointError, match="w2_weight_global_scale"):
        layer.process_weights_after_loading()
    layer.w13_weight_scale = torch.nn.Parameter(torch.ones(E, 2 * I, H // 16), requires_grad=False)
    with pytest.raises(CheckpointError, match="w13_weight_scale"):
        layer.process_weights_after_loading()


def test_state_dict_round_trip() -> None:
    layer = _layer()
    _fill(layer, seed=2)
    other = _layer()
    other.load_state_dict(layer.state_dict())
    x = _x(5, 3)
    assert torch.equal(layer(x), other(x))


# -- float activations (W4A16-style emulation) -----------------------------------------------------------


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [mf.ActivationKind.SWIGLU, mf.ActivationKind.GPT_OSS_SWIGLU,
                                        mf.ActivationKind.RELU2])
@torch.no_grad()
def test_float_dispatch_matches_the_dequantized_reference(dispatcher: str, bias: bool,
                                                          activation: mf.ActivationKind) -> None:
    layer = _layer(dispatcher=dispatcher, expert_bias=bias, activation=mf.ActivationConfig(activation), debug=True)
    _fill(layer, seed=4)
    assert layer.dispatch_decision.dtype is mf.DispatchDtype.FP32
    assert [type(s).__name__ for s in layer.pipeline.stages][2:5] == ["EmulatedGroupedGemm", "Activate",
                                                                      "EmulatedGroupedGemm"]
    x = _x(12, 5)
    assert _rel(layer(x), _reference(layer, x)) < 1e-5


@torch.no_grad()
def test_bf16_layer_and_routing_weights_in_the_epilogue() -> None:
    routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE)
    layer = _layer(dtype=torch.bfloat16, routing=routing, expert_bias=True)
    _fill(layer, seed=6)
    assert "weights in epilogue" in layer.describe()
    x = _x(9, 7, torch.bfloat16)
    assert _rel(layer(x), _reference(layer, x)) < 2e-2  # bf16 intermediates and output


# -- NVFP4 activations (static input global scale, rule 3) ----------------------------------------------


def test_the_resolver_picks_nvfp4_by_rule_3() -> None:
    method = Nvfp4Method(G)
    decision = mf.resolve_dispatch_dtype(experts_accept=method.accepts,
                                         quant_requires=method.required_dispatch_dtype(),
                                         device=DeviceDispatchSupport(nvfp4=True), environ={})
    assert decision == mf.DispatchDecision(mf.DispatchDtype.NVFP4, mf.DispatchRule.QUANT_METHOD)
    assert decision.explain() == "dispatch nvfp4 (rule 3: quant method)"
    with pytest.raises(DispatchDtypeError, match="nvfp4"):
        mf.resolve_dispatch_dtype(experts_accept=method.accepts, quant_requires=method.required_dispatch_dtype(),
                                  device=DeviceDispatchSupport(nvfp4=False), environ={})
    # explicit settings win over the method (rule 1)
    decision = mf.resolve_dispatch_dtype("bf16", experts_accept=method.accepts,
                                         quant_requires=method.required_dispatch_dtype(),
                                         device=DeviceDispatchSupport(nvfp4=True), environ={})
    assert decision.dtype is mf.DispatchDtype.BF16 and decision.rule is mf.DispatchRule.EXPLICIT


@pytest.mark.usefixtures("nvfp4_device")
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_nvfp4_dispatch_matches_the_fake_quantized_reference(dispatcher: str, bias: bool) -> None:
    layer = _layer(Nvfp4Method(G), dispatcher=dispatcher, expert_bias=bias, debug=True)
    _fill(layer, seed=8)
    assert layer.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.NVFP4, mf.DispatchRule.QUANT_METHOD)
    text = layer.describe()
    assert "dispatch nvfp4 (rule 3: quant method)" in text
    assert "QuantizeTokens(nvfp4/nvfp4_block16, global 0.004)" in text
    quantize = layer.pipeline.stages[1]
    assert isinstance(quantize, mf.QuantizeTokens) and quantize.quantizer == Nvfp4Quantizer(G)
    dispatched = layer.pipeline.specs[2]
    assert dispatched.dtype is mf.DType.NVFP4 and dispatched.scale_layout is mf.ScaleLayout.NVFP4_BLOCK16
    x = _x(10, 9)
    assert _rel(layer(x), _reference(layer, x)) < 1e-5


@pytest.mark.usefixtures("nvfp4_device")
@torch.no_grad()
def test_nvfp4_dispatch_in_a_bf16_layer() -> None:
    layer = _layer(Nvfp4Method(G), dtype=torch.bfloat16)
    _fill(layer, seed=10)
    x = _x(7, 11, torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(layer, x)) < 2e-2


@pytest.mark.usefixtures("nvfp4_device")
def test_explicit_nvfp4_without_a_global_scale_is_a_contract_error() -> None:
    with pytest.raises(mf.ContractError) as info:
        _layer(Nvfp4Method(), dispatch_dtype="nvfp4")
    assert info.value.field == "input_global_scale" and "input_global_scale=" in info.value.hint
    assert "produces: None" not in str(info.value) and "produces: no global scale" in str(info.value)


def test_nvfp4_dispatch_is_rejected_where_the_device_cannot_carry_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DeviceDispatchSupport, "for_device", classmethod(lambda cls, device: cls(nvfp4=False)))
    with pytest.raises(DispatchDtypeError, match="cannot carry nvfp4"):
        _layer(Nvfp4Method(G))


def test_the_triton_experts_are_the_nvfp4_kernel() -> None:
    """The triton experts are the one grouped GEMM (tests/test_triton_fp4_gemm.py checks its numbers),
    reading NVFP4 rows with the method's static global scale when the dispatch is NVFP4."""
    pytest.importorskip("triton")
    from moeforge.dispatch_dtype import DispatchDtype
    from moeforge.kernels.config import ConfigTable
    from moeforge.kernels.formats import WeightFormat
    from moeforge.stages.triton_quant import FusedQuantGroupedGemm

    layer = _layer()
    for method, dispatch in ((Nvfp4Method(), None), (Nvfp4Method(G), DispatchDtype.NVFP4)):
        stages = selected_stages(method, layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                      backend=mf.Backend.TRITON, configs=ConfigTable(E, K), dispatch=dispatch)
        assert all(isinstance(s, FusedQuantGroupedGemm) and s.weight_format is WeightFormat.NVFP4 for s in stages)
        first = stages[0]
        assert isinstance(first, FusedQuantGroupedGemm)
        assert first.input_global_scale == (G if dispatch is not None else None)
    with pytest.raises(mf.ContractError, match="input_global_scale"):
        selected_stages(Nvfp4Method(), layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                    backend=mf.Backend.TRITON, configs=ConfigTable(E, K),
                                    dispatch=DispatchDtype.NVFP4)


def test_the_quantizer() -> None:
    q = Nvfp4Quantizer(G)
    assert q.dtype is mf.DType.NVFP4 and q.scale_layout is mf.ScaleLayout.NVFP4_BLOCK16
    assert q.check_width(32) is None and "16" in (q.check_width(24) or "")
    x = _x(3, 12)
    out = q(x)
    expected = quantize_nvfp4(x, G)
    assert out.scale is not None
    assert torch.equal(out.data, expected.data) and torch.equal(out.scale.float(), expected.scale.float())
    with pytest.raises(mf.InputError, match="global_scale"):
        Nvfp4Quantizer(0.0)


# -- against the float layer (loose: the quantization error itself) --------------------------------------


@pytest.mark.usefixtures("nvfp4_device")
@torch.no_grad()
def test_close_to_the_float_layer_it_was_quantized_from() -> None:
    dense = mf.MoELayer(E, K, H, I, dtype=torch.float32, backend="torch", environ={})
    x = _x(64, 13)
    errors = {}
    for name, method in (("weights", Nvfp4Method()),
                         ("weights+activations", Nvfp4Method(float(x.abs().max()) / 2688))):
        layer = _layer(method)
        w13, w2 = _fill(layer, seed=14)
        dense.w13_weight.copy_(w13)
        dense.w2_weight.copy_(w2)
        assert dense.router is not None and layer.router is not None
        dense.router.weight.copy_(layer.router.weight)
        errors[name] = _rel(layer(x), dense(x))
    # measured 0.161 (weights) and 0.203 (weights + activations) for this seed
    assert 0.01 < errors["weights"] < 0.3 and 0.01 < errors["weights+activations"] < 0.35
    assert errors["weights"] < errors["weights+activations"]


# -- edge cases, property-based -------------------------------------------------------------------------


@pytest.mark.usefixtures("nvfp4_device")
@default_settings(max_examples=12)
@given(num_experts=st.integers(1, 4), data=st.data(), tokens=st.sampled_from([0, 1, 2, 5]),
       skew=st.sampled_from(["random", "one_expert"]), nvfp4=st.booleans(),
       dispatcher=st.sampled_from(["sorted", "padded"]), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_edge_cases_match_the_reference(num_experts: int, data: st.DataObject, tokens: int, skew: str,
                                        nvfp4: bool, dispatcher: str, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")  # includes top_k == num_experts
    layer = _layer(Nvfp4Method(G) if nvfp4 else Nvfp4Method(), sizes=(num_experts, top_k, H, I),
                   dispatcher=dispatcher)
    _fill(layer, seed)
    x = _x(tokens, seed + 1)
    logits = torch.randn(tokens, num_experts, generator=_gen(seed + 2))
    if skew == "one_expert":  # every token's first choice is the last expert; others get nothing when k=1
        logits[:, -1] += 20.0
    out = layer(x, logits)
    assert out.shape == (tokens, H)
    ref = _reference(layer, x, logits)
    if tokens:
        assert _rel(out, ref) < 1e-5
    else:
        assert out.numel() == 0


# -- apply_without_routing_weights ---------------------------------------------------------------------


def _dispatched(layer: mf.MoELayer, x: torch.Tensor) -> ExpertRows:
    payload: Any = mf.MoEInput(x, layer.router_logits(x))
    for stage in layer.pipeline.stages:
        payload = stage(payload)
        if mf.StageKind.DISPATCH in stage.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


def _combine(layer: mf.MoELayer, rows: ExpertRows, out: torch.Tensor) -> torch.Tensor:
    if isinstance(rows, SortedRows):
        return rows.plan.combine(out, True, None, layer.dtype)
    assert isinstance(rows, PaddedRows)
    return rows.plan.combine(out, True, None, layer.dtype)


@pytest.mark.usefixtures("nvfp4_device")
@pytest.mark.parametrize("nvfp4", [False, True])
@pytest.mark.parametrize("dispatcher, group_list_type", [
    (mf.SortedDispatch(E), 1), (mf.SortedDispatch(E), mf.GroupListType.COUNT),
    (mf.SortedDispatch(E, group_list_type=mf.GroupListType.CUMSUM), 0), ("padded", 1)])
@torch.no_grad()
def test_apply_without_routing_weights_equals_the_forward(nvfp4: bool, dispatcher: Any,
                                                          group_list_type: Any) -> None:
    layer = _layer(Nvfp4Method(G) if nvfp4 else Nvfp4Method(), dispatcher=dispatcher, expert_bias=True)
    _fill(layer, seed=15)
    x = _x(11, 16)
    rows = _dispatched(layer, x)
    assert (rows.x.data.dtype == torch.uint8) is nvfp4
    group_list = rows.group_list if isinstance(rows, SortedRows) else rows.masked_m  # type: ignore[attr-defined]
    out = layer.quant.apply_without_routing_weights(layer, rows.x.data, rows.x.scale, group_list_type, group_list,
                                                    torch.float32)
    assert out.shape == rows.x.data.shape[:-1] + (H,) and out.dtype == torch.float32
    torch.testing.assert_close(_combine(layer, rows, out), layer(x), rtol=1e-5, atol=1e-6)


@pytest.fixture
def layer() -> mf.MoELayer:
    return _layer(Nvfp4Method(G), dispatch_dtype="fp32")


def _apply(layer: mf.MoELayer, hidden: torch.Tensor, scale: Optional[torch.Tensor] = None, group_list_type: Any = 1,
           group_list: Optional[torch.Tensor] = None, method: Optional[Nvfp4Method] = None) -> torch.Tensor:
    if group_list is None:
        group_list = torch.full((E,), hidden.shape[0] // E, dtype=torch.int64)
    return (method or layer.quant).apply_without_routing_weights(layer, hidden, scale, group_list_type, group_list,
                                                                 torch.float32)


def test_apply_with_no_rows_and_empty_experts(layer: mf.MoELayer) -> None:
    assert _apply(layer, torch.empty(0, H), group_list=torch.zeros(E, dtype=torch.int64)).shape == (0, H)
    rows = _x(3, 17)
    out = _apply(layer, rows, group_list=torch.tensor([0, 3, 0, 0]))
    w13 = _dequantized(layer, "w13")[1].double()
    hidden = rows.double() @ w13.t()
    expected = torch.nn.functional.silu(hidden[:, :I]) * hidden[:, I:] @ _dequantized(layer, "w2")[1].double().t()
    assert _rel(out, expected) < 1e-5


@pytest.mark.parametrize("call, match", [
    (lambda l: _apply(l, _x(8, 0), scale=torch.ones(8, 1)), "hidden_states_scale"),
    (lambda l: _apply(l, _x(8, 0).to(torch.int8)), "hidden_states"),
    (lambda l: _apply(l, _x(8, 0).double()), "hidden_states"),
    (lambda l: _apply(l, torch.randn(8, H + 16)), "hidden_states"),
    (lambda l: _apply(l, torch.randn(8)), "hidden_states"),
    (lambda l: _apply(l, torch.randn(E + 1, 2, H), group_list=torch.ones(E, dtype=torch.int64)), "hidden_states"),
    (lambda l: _apply(l, _x(8, 0), group_list=torch.full((E + 1,), 2)), "group_list"),
    (lambda l: _apply(l, _x(8, 0), group_list=torch.tensor([2, 2, 2, 1])), "group_list"),
    (lambda l: _apply(l, _x(8, 0), group_list=torch.tensor([4, 4, 2, -2])), "group_list"),
    (lambda l: _apply(l, _x(8, 0), group_list_type=0, group_list=torch.tensor([2, 4, 6, 7])), "group_list"),
    (lambda l: _apply(l, torch.randn(E, 2, H), group_list_type=0, group_list=torch.ones(E, dtype=torch.int64)),
     "group_list_type"),
    (lambda l: _apply(l, _x(8, 0), group_list_type=2), "group_list_type"),
    # NVFP4 rows: the scale must come with them, in e4m3, one per 16 elements
    (lambda l: _apply(l, torch.zeros(8, H // 2, dtype=torch.uint8)), "hidden_states_scale"),
    (lambda l: _apply(l, torch.zeros(8, H // 2, dtype=torch.uint8), scale=torch.ones(8, H // 16)),
     "hidden_states_scale"),
    (lambda l: _apply(l, torch.zeros(8, H // 2, dtype=torch.uint8),
                      scale=torch.ones(8, 1).to(torch.float8_e4m3fn)), "hidden_states_scale"),
    (lambda l: _apply(l, torch.zeros(8, H, dtype=torch.uint8),
                      scale=torch.ones(8, H // 16).to(torch.float8_e4m3fn)), "hidden_states"),
    (lambda l: _apply(l, torch.zeros(8, H // 2, dtype=torch.uint8),
                      scale=torch.ones(8, H // 16).to(torch.float8_e4m3fn), method=Nvfp4Method()),
     "input_global_scale"),
])
def test_apply_rejects_bad_arguments(layer: mf.MoELayer, call: Any, match: str) -> None:
    with pytest.raises(mf.InputError, match=match):
        call(layer)


def test_apply_on_nvfp4_rows_equals_float_rows_fake_quantized(layer: mf.MoELayer) -> None:
    rows = _x(8, 18)
    q = quantize_nvfp4(rows, G)
    out = _apply(layer, q.data, scale=q.scale)
    torch.testing.assert_close(out, _apply(layer, q.dequantize()), rtol=0, atol=0)


# -- the GEMM stage's contract ---------------------------------------------------------------------------


def _spec(layout: Layout, dtype: mf.DType, scale: mf.ScaleLayout = mf.ScaleLayout.NONE) -> Spec:
    return Spec(kind=PayloadKind.DISPATCHED, layout=layout, dtype=dtype, width=H, scale_layout=scale,
                group_list_type=mf.GroupListType.COUNT if layout is Layout.EXPERT_SORTED else None,
                expert_ids=mf.ExpertIds.LOCAL, num_experts=E, top_k=K)


@pytest.mark.parametrize("layout", [Layout.EXPERT_SORTED, Layout.EXPERT_PADDED])
def test_emulated_gemm_honours_its_contract(layout: Layout) -> None:
    layer = _layer()
    gate_up = Nvfp4WeightRef(layer.quant.expert_weights(layer).gate_up)
    float_stage = EmulatedGroupedGemm(mf.GemmRole.GATE_UP, gate_up)
    assert_stage_honours_contract(float_stage, _spec(layout, mf.DType.FP32), max_examples=8)
    nvfp4_stage = EmulatedGroupedGemm(mf.GemmRole.GATE_UP, gate_up, input_global_scale=G, out_dtype=mf.DType.BF16)
    float_rows = dispatch_outputs(_spec(layout, mf.DType.FP32))
    nvfp4_rows = float_rows.map(lambda rows: rows.with_x(Nvfp4Quantizer(G)(rows.x.data)))
    assert_stage_honours_contract(nvfp4_stage, _spec(layout, mf.DType.NVFP4, mf.ScaleLayout.NVFP4_BLOCK16),
                                  nvfp4_rows, max_examples=8)


def test_emulated_gemm_rejects_formats_it_cannot_read() -> None:
    layer = _layer()
    gate_up = Nvfp4WeightRef(layer.quant.expert_weights(layer).gate_up)
    stage = EmulatedGroupedGemm(mf.GemmRole.GATE_UP, gate_up)
    nvfp4 = _spec(Layout.EXPERT_SORTED, mf.DType.NVFP4, mf.ScaleLayout.NVFP4_BLOCK16)
    assert [m.field for m in stage.check(nvfp4)] == ["dtype", "scale_layout"]
    with_scale = EmulatedGroupedGemm(mf.GemmRole.GATE_UP, gate_up, input_global_scale=G)
    assert [m.field for m in with_scale.check(nvfp4)] == ["dtype"]  # needs an explicit out_dtype
    mixed = _spec(Layout.EXPERT_SORTED, mf.DType.FP32, mf.ScaleLayout.NVFP4_BLOCK16)
    assert [m.field for m in with_scale.check(mixed)] == ["scale_layout"]
    assert [m.field for m in stage.check(_spec(Layout.EXPERT_SORTED, mf.DType.FP8_E4M3,
                                               mf.ScaleLayout.PER_TOKEN))] == ["dtype", "scale_layout"]


def test_nvfp4_rows_quantized_with_another_global_scale_are_rejected() -> None:
    # The global scale stays with the quantizer and the GEMM, not the payload: a GEMM dequantizing with
    # another value would be off by their ratio, silently. The spec carries the value.
    layer = mf.MoELayer(4, 2, 64, 32, quant=Nvfp4Method(input_global_scale=G), dtype=torch.float32)
    stages = list(layer.pipeline.stages)
    quantize = next(index for index, stage in enumerate(stages) if isinstance(stage, mf.QuantizeTokens))
    stages[quantize] = mf.QuantizeTokens(Nvfp4Quantizer(G * 2))
    with pytest.raises(mf.ContractError) as info:
        mf.Pipeline(stages, layer.pipeline.input_spec)
    assert info.value.field == "global_scale" and "one value" in info.value.hint
    stages[quantize] = mf.QuantizeTokens(Nvfp4Quantizer(G))
    mf.Pipeline(stages, layer.pipeline.input_spec)
