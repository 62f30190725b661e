"""W4A16Method on the torch backend: weights, quantization, the layer against an independent
dequantize-then-float64 reference, against the float layer it was quantized from, edge cases, the
expert-grouped entry point, contracts and errors."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.payloads import ExpertRows, PaddedRows, SortedRows
from moeforge.quant.int4_packing import pack_int4
from moeforge.quant.w4a16 import W4A16GroupedGemm, W4A16Method, quantize_int4
from moeforge.reference import dense_moe
from moeforge.spec import FLOAT_DTYPES
from moeforge.testing import assert_stage_honours_contract

E, K, H, I = 4, 2, 64, 32


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def ref_dequant(qweight: torch.Tensor, scales: torch.Tensor, qzeros: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 weights from moeforge's int4 layout, written independently of the library: byte % 16 is
    the even input, byte // 16 the odd one; scales and zeros repeated over their group."""
    q = torch.empty(*qweight.shape[:-1], 2 * qweight.shape[-1], dtype=torch.float64)
    q[..., 0::2] = (qweight.long() % 16).double()
    q[..., 1::2] = (qweight.long() // 16).double()
    group = q.shape[-1] // scales.shape[-1]
    z = qzeros.double().repeat_interleave(group, dim=-1) if qzeros is not None else 8.0
    return (q - z) * scales.double().repeat_interleave(group, dim=-1)


def reference(layer: mf.MoELayer, x: torch.Tensor, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense float64 MoE over the layer's dequantized weights (no grouped GEMM, no dispatch)."""
    w13 = ref_dequant(layer.w13_qweight, layer.w13_scales, getattr(layer, "w13_qzeros", None))
    w2 = ref_dequant(layer.w2_qweight, layer.w2_scales, getattr(layer, "w2_qzeros", None))
    if logits is None:
        logits = layer.router_logits(x)
    return dense_moe(x, logits, top_k=layer.top_k, w13=w13, w2=w2, w13_bias=getattr(layer, "w13_bias", None),
                     w2_bias=getattr(layer, "w2_bias", None), routing=layer.routing, activation=layer.activation)


def build(group_size: int = 32, zero_points: bool = True, *, seed: int = 0, num_experts: int = E,
          top_k: int = K, hidden: int = H, inter: int = I, bias: bool = False, **kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(seed)
    layer = mf.MoELayer(num_experts, top_k, hidden, inter, quant=W4A16Method(group_size, zero_points),
                        backend="torch", environ={}, expert_bias=bias, **kwargs)
    if bias:
        with torch.no_grad():
            layer.w13_bias.normal_(std=0.1)
            layer.w2_bias.normal_(std=0.1)
    return layer


def _x(tokens: int, hidden: int = H, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- capabilities, construction, weights -------------------------------------------------------------------


def test_capabilities_are_class_data() -> None:
    assert W4A16Method.accepts == FLOAT_DTYPES
    assert W4A16Method.accepts_scales == frozenset({mf.ScaleLayout.NONE})
    assert W4A16Method.prefers is None
    assert set(W4A16Method.expert_parameters) == {"w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight",
                                                  "w2_scales", "w2_qzeros", "w13_bias", "w2_bias"}
    method = W4A16Method()
    assert (method.group_size, method.zero_points) == (128, True)
    assert repr(method) == "W4A16Method(group_size=128, zero_points=True, checkpoint_format='gptq')"


@pytest.mark.parametrize("kwargs, match", [
    ({"group_size": 16}, "group_size"), ({"group_size": 256}, "group_size"), ({"group_size": True}, "group_size"),
    ({"group_size": "128"}, "group_size"), ({"zero_points": 1}, "zero_points"),
    ({"checkpoint_format": "exl2"}, "checkpoint_format"),
])
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(mf.InputError, match=match):
        W4A16Method(**kwargs)


@pytest.mark.parametrize("hidden, inter, match", [
    (96, 64, "hidden_size=96 is not divisible by group_size=64"),
    (64, 32, "intermediate_size=32 is not divisible by group_size=64"),
    (63, 64, "hidden_size=63 is odd"),
])
def test_sizes_must_fit_the_group_size(hidden: int, inter: int, match: str) -> None:
    with pytest.raises(mf.InputError, match=match):
        mf.MoELayer(E, K, hidden, inter, quant=W4A16Method(64), backend="torch", environ={})


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("gated, bias", [(True, False), (False, True)])
def test_create_weights(group_size: int, zero_points: bool, gated: bool, bias: bool) -> None:
    holder = torch.nn.Module()
    W4A16Method(group_size, zero_points).create_weights(
        holder, num_experts=E, hidden_size=128, intermediate_size=128, gated=gated, bias=bias,
        dtype=torch.bfloat16, device="cpu")
    n13 = 256 if gated else 128
    params = dict(holder.named_parameters())
    assert params["w13_qweight"].shape == (E, n13, 64) and params["w13_qweight"].dtype == torch.uint8
    assert params["w2_qweight"].shape == (E, 128, 64)
    assert params["w13_scales"].shape == (E, n13, 128 // group_size)
    assert params["w2_scales"].dtype == torch.bfloat16 and bool((params["w2_scales"] > 0).all())
    if zero_points:
        assert params["w13_qzeros"].shape == params["w13_scales"].shape
        assert int(params["w2_qzeros"].max()) <= 15
    else:
        assert holder.w13_qzeros is None and holder.w2_qzeros is None
    assert (holder.w13_bias is not None) == bias
    assert not any(p.requires_grad for name, p in params.items() if "bias" not in name)
    # a fresh layer's weights have the unquantized method's spread, ~ fan_in ** -0.5
    w = ref_dequant(params["w13_qweight"], params["w13_scales"], params.get("w13_qzeros"))
    assert 0.5 < float(w.std()) * 128**0.5 < 1.5


# -- quantization ---------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(group_size=st.sampled_from([32, 64, 128]), zero_points=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), shift=st.floats(-2, 2))
def test_quantize_int4_error_is_within_one_step(group_size: int, zero_points: bool, seed: int,
                                                 dtype: torch.dtype, shift: float) -> None:
    w = (torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(seed)) + shift).to(dtype)
    q = quantize_int4(w, group_size, zero_points=zero_points)
    assert q.scales.dtype == dtype and q.group_size == group_size
    assert (q.qzeros is not None) == zero_points
    error = (ref_dequant(q.qweight, q.scales, q.qzeros) - w.double()).abs()
    scale = q.scales.double().repeat_interleave(group_size, dim=-1)
    # zero points: the range [min(w, 0), max(w, 0)] spans 15 steps, but the rounded zero point can push
    # the top value half a step past 15 (clamped): one step. Symmetric: +-7 steps around 8, half a step.
    bound = 1.0 if zero_points else 0.5
    assert bool((error <= scale * bound * (1 + 1e-2) + 1e-6).all())


def test_quantize_int4_exact_cases() -> None:
    w = torch.zeros(2, 64)
    w[1, :32] = 0.75  # a constant group
    w[1, 32:] = torch.arange(32) / 31 * 1.5 - 0.5
    for zero_points in (True, False):
        q = quantize_int4(w, 32, zero_points=zero_points)
        deq = ref_dequant(q.qweight, q.scales, q.qzeros)
        assert bool((deq[0] == 0).all())  # an all-zero row stays zero
        torch.testing.assert_close(deq[1, :32], torch.full((32,), 0.75, dtype=torch.float64))
    with pytest.raises(mf.InputError, match="non-finite"):
        quantize_int4(torch.full((2, 32), float("nan")), 32)
    with pytest.raises(mf.InputError, match="groups of 32"):
        quantize_int4(torch.zeros(2, 48), 32)


# -- the layer against the dequantize-then-float64 reference ---------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@torch.no_grad()
def test_layer_matches_the_dequantized_reference(group_size: int, zero_points: bool, dispatcher: str) -> None:
    hidden = inter = max(64, group_size)
    layer = build(group_size, zero_points, hidden=hidden, inter=inter, dtype=torch.float32,
                  dispatcher=dispatcher, debug=True)
    x = _x(12, hidden)
    assert _rel(layer(x), reference(layer, x)) < 1e-5


@pytest.mark.parametrize("activation", [
    mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED),
    mf.ActivationConfig(mf.ActivationKind.RELU2),
    mf.ActivationConfig(mf.ActivationKind.GEGLU),
])
@pytest.mark.parametrize("epilogue", [False, True])
@torch.no_grad()
def test_layer_with_biases_other_activations_and_weights_in_the_epilogue(
    activation: mf.ActivationConfig, epilogue: bool
) -> None:
    routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE if epilogue
                               else mf.RoutingWeights.IN_COMBINE)
    layer = build(32, True, bias=True, activation=activation, routing=routing, dtype=torch.float32, debug=True)
    x = _x(10)
    assert _rel(layer(x), reference(layer, x)) < 1e-5
    if epilogue:
        assert "weights in epilogue" in layer.describe()


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@torch.no_grad()
def test_16_bit_layer_matches_the_reference_within_rounding(dtype: torch.dtype, bound: float,
                                                            dispatcher: str) -> None:
    layer = build(64, True, inter=64, dtype=dtype, dispatcher=dispatcher)
    x = _x(16, dtype=dtype)
    out = layer(x)
    assert out.dtype == dtype
    # measured: bf16 3.5e-3, fp16 4.5e-4 (the gate/up output and the activation are rounded to the
    # layer's dtype between the stages, as the unquantized method does)
    assert _rel(out, reference(layer, x)) < bound


# -- against the float layer it was quantized from -------------------------------------------------------------


def _quantized_pair(group_size: int, zero_points: bool) -> tuple[mf.MoELayer, mf.MoELayer]:
    torch.manual_seed(5)
    hidden, inter = 128, 128
    dense = mf.MoELayer(E, K, hidden, inter, backend="torch", environ={}, dtype=torch.float32)
    layer = mf.MoELayer(E, K, hidden, inter, quant=W4A16Method(group_size, zero_points), backend="torch",
                        environ={}, dtype=torch.float32)
    assert dense.router is not None and layer.router is not None
    layer.router.load_state_dict(dense.router.state_dict())
    layer.quant.quantize_weights(layer, dense.w13_weight, dense.w2_weight)  # type: ignore[attr-defined]
    return dense, layer


# Measured relative errors (fp32, E=4, k=2, H=I=128, 64 tokens, N(0, 1/fan_in) weights, SwiGLU):
#   weights w13:  zero points g32 0.081, g64 0.091, g128 0.101;  symmetric g32 0.097, g64 0.108, g128 0.117
#   layer output: zero points g32 0.142, g64 0.160, g128 0.180;  symmetric g32 0.173, g64 0.193, g128 0.210
# (round-to-nearest int4 of Gaussian weights: ~0.1 per GEMM operand, three of them compound).
QUANT_ERROR_BOUND = 0.25


@pytest.mark.parametrize("zero_points", [True, False])
@torch.no_grad()
def test_quantized_layer_is_close_to_the_float_layer(zero_points: bool) -> None:
    x = _x(64, 128, seed=6)
    errors = {}
    for group_size in (32, 64, 128):
        dense, layer = _quantized_pair(group_size, zero_points)
        out = layer(x)
        assert _rel(out, reference(layer, x)) < 1e-5  # the layer computes its int4 weights exactly
        errors[group_size] = _rel(out, dense(x))
    assert max(errors.values()) < QUANT_ERROR_BOUND, errors
    assert errors[32] < errors[128], errors  # smaller groups, finer scales


def test_quantize_weights_checks_shapes() -> None:
    layer = build(32)
    with pytest.raises(mf.InputError, match="w13 must be"):
        layer.quant.quantize_weights(layer, torch.zeros(E, 2 * I, H + 2), torch.zeros(E, H, I))  # type: ignore[attr-defined]


# -- edge cases -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("case", ["empty", "one_token", "idle_experts", "all_on_one", "top_k_all"])
@torch.no_grad()
def test_edge_cases(dispatcher: str, case: str) -> None:
    top_k = E if case == "top_k_all" else K
    layer = build(32, True, top_k=top_k, dtype=torch.float32, dispatcher=dispatcher, debug=True)
    tokens = {"empty": 0, "one_token": 1}.get(case, 6)
    x = _x(tokens)
    logits = torch.randn(tokens, E, generator=torch.Generator().manual_seed(2))
    if case == "idle_experts":
        logits[:, 2:] = -30.0  # experts 2 and 3 get no token
    if case == "all_on_one":
        layer = build(32, True, top_k=1, dtype=torch.float32, dispatcher=dispatcher, debug=True)
        logits = torch.full((tokens, E), -5.0)
        logits[:, 1] = 5.0
    out = layer(x, logits)
    assert out.shape == (tokens, H)
    if tokens:
        assert _rel(out, reference(layer, x, logits)) < 1e-5


# -- apply_without_routing_weights ---------------------------------------------------------------------------


def _dispatched(layer: mf.MoELayer, x: torch.Tensor) -> ExpertRows:
    payload: Any = mf.MoEInput(x, layer.router_logits(x))
    for stage in layer.pipeline.stages:
        payload = stage(payload)
        if mf.StageKind.DISPATCH in stage.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


def _combine(layer: mf.MoELayer, rows: ExpertRows, expert_out: torch.Tensor) -> torch.Tensor:
    if isinstance(rows, SortedRows):
        return rows.plan.combine(expert_out, True, None, layer.dtype)
    assert isinstance(rows, PaddedRows)
    flat = expert_out.reshape(-1, expert_out.shape[-1])
    return rows.plan.combine(flat, True, None, layer.dtype)


@pytest.mark.parametrize("dispatcher, group_list_type", [
    (mf.SortedDispatch(E), 1), (mf.SortedDispatch(E, group_list_type=mf.GroupListType.CUMSUM), 0),
    ("padded", 1),
])
@torch.no_grad()
def test_apply_without_routing_weights_equals_the_forward(dispatcher: Any, group_list_type: int) -> None:
    layer = build(32, False, bias=True, dtype=torch.float32, dispatcher=dispatcher)
    x = _x(12)
    rows = _dispatched(layer, x)
    group_list = rows.group_list if isinstance(rows, SortedRows) else rows.masked_m  # type: ignore[attr-defined]
    expert_out = layer.quant.apply_without_routing_weights(layer, rows.x.data, None, group_list_type, group_list,
                                                           torch.float32)
    assert expert_out.shape == rows.x.data.shape
    torch.testing.assert_close(_combine(layer, rows, expert_out), layer(x), rtol=1e-5, atol=1e-6)


def test_apply_without_routing_weights_rejects_bad_input() -> None:
    layer = build(32)
    method = layer.quant
    counts = torch.full((E,), 2, dtype=torch.int64)
    with pytest.raises(mf.InputError, match="hidden_states_scale"):
        method.apply_without_routing_weights(layer, _x(8), torch.ones(8, 1), 1, counts, torch.float32)
    with pytest.raises(mf.InputError, match="hidden_states"):
        method.apply_without_routing_weights(layer, _x(8, H + 2), None, 1, counts, torch.float32)
    with pytest.raises(mf.InputError, match="group_list"):
        method.apply_without_routing_weights(layer, _x(9), None, 1, counts, torch.float32)
    with pytest.raises(mf.InputError, match="group_list_type"):
        method.apply_without_routing_weights(layer, _x(8), None, 3, counts, torch.float32)
    empty = method.apply_without_routing_weights(layer, _x(0), None, 1, torch.zeros(E, dtype=torch.int64),
                                                 torch.float32)
    assert empty.shape == (0, H)


# -- contracts, backends, validation ---------------------------------------------------------------------------


def test_quantized_dispatch_is_a_contract_error() -> None:
    with pytest.raises(mf.ContractError) as info:
        mf.MoELayer(E, K, H, I, quant=W4A16Method(32), backend="torch", environ={}, dispatch_dtype="fp8")
    assert info.value.field == "dtype" and "W4A16Method" in info.value.consumer


def test_dispatch_dtype_follows_the_layer() -> None:
    layer = build(32, dtype=torch.float16)
    assert layer.dispatch_decision.dtype is mf.DispatchDtype.FP16
    # the process default asking for fp8 is ignored (with a warning) for experts that cannot take it
    with pytest.warns(UserWarning):
        other = mf.MoELayer(E, K, H, I, quant=W4A16Method(32), backend="torch",
                            environ={"MOEFORGE_DISPATCH_DTYPE": "fp8"}, dtype=torch.bfloat16)
    assert other.dispatch_decision.dtype is mf.DispatchDtype.BF16


def test_triton_expert_stages_are_the_fused_int4_kernels() -> None:
    from moeforge.kernels.config import ConfigTable

    layer = build(32)
    stages = selected_stages(layer.quant, layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                       backend=mf.Backend.TRITON, configs=ConfigTable(layer.num_experts, layer.top_k))
    assert [type(stage).__name__ for stage in stages] == ["FusedQuantGroupedGemm", "FusedQuantGroupedGemm"]
    with pytest.raises(ValueError, match="ConfigTable"):
        selected_stages(layer.quant, layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                  backend=mf.Backend.TRITON)


def _rows_spec(kind: mf.PayloadKind, layout: mf.Layout, width: int,
               group_list: mf.GroupListType = mf.GroupListType.COUNT) -> mf.Spec:
    return mf.Spec(kind, layout, mf.DType.FP32, width,
                   group_list_type=group_list if layout is mf.Layout.EXPERT_SORTED else None,
                   routing_weights=mf.RoutingWeights.PENDING, expert_ids=mf.ExpertIds.LOCAL, num_experts=E,
                   top_k=K)


@pytest.mark.parametrize("layout, group_list", [
    (mf.Layout.EXPERT_SORTED, mf.GroupListType.COUNT), (mf.Layout.EXPERT_SORTED, mf.GroupListType.CUMSUM),
    (mf.Layout.EXPERT_PADDED, mf.GroupListType.COUNT),
])
def test_gemm_stage_honours_its_contract(layout: mf.Layout, group_list: mf.GroupListType) -> None:
    layer = build(32, True, bias=True)
    gate_up = W4A16GroupedGemm(mf.GemmRole.GATE_UP, layer.w13_qweight, layer.w13_scales, layer.w13_qzeros,
                               layer.w13_bias)
    down = W4A16GroupedGemm(mf.GemmRole.DOWN, layer.w2_qweight, layer.w2_scales, None,
                            apply_routing_weights=True)
    assert_stage_honours_contract(gate_up, _rows_spec(mf.PayloadKind.DISPATCHED, layout, H, group_list),
                                  max_examples=5)
    assert_stage_honours_contract(down, _rows_spec(mf.PayloadKind.EXPERT_HIDDEN, layout, I, group_list),
                                  max_examples=5)
    assert down.summary() == "W4A16GroupedGemm(down, 32->64, int4 g32, symmetric, weights in epilogue)"


def test_gemm_stage_rejects_inconsistent_weights() -> None:
    q = pack_int4(torch.zeros(E, 8, 64, dtype=torch.long))
    with pytest.raises(mf.InputError, match="scales"):
        W4A16GroupedGemm(mf.GemmRole.DOWN, q, torch.ones(E, 8, 3))
    with pytest.raises(mf.InputError, match="bias"):
        W4A16GroupedGemm(mf.GemmRole.DOWN, q, torch.ones(E, 8, 2), bias=torch.zeros(E, 9))
    with pytest.raises(mf.InputError, match="E, N, K // 2"):
        W4A16GroupedGemm(mf.GemmRole.DOWN, q[0], torch.ones(8, 2))


@pytest.mark.parametrize("name, value, match", [
    ("w13_qzeros", lambda t: t.fill_(16), "zero points are 4-bit"),
    ("w2_scales", lambda t: t.fill_(float("inf")), "non-finite"),
])
def test_process_weights_after_loading_validates(name: str, value: Any, match: str) -> None:
    layer = build(32)
    layer.process_weights_after_loading()  # a fresh layer is valid
    with torch.no_grad():
        value(getattr(layer, name))
    with pytest.raises(mf.InputError, match=match):
        layer.process_weights_after_loading()


def test_process_weights_after_loading_checks_shapes_and_dtypes() -> None:
    layer = build(32)
    layer.w2_scales = torch.nn.Parameter(torch.ones(E, H, 2), requires_grad=False)
    with pytest.raises(mf.InputError, match="w2_scales must be float"):
        layer.process_weights_after_loading()
    layer = build(32)
    layer.w13_qzeros = torch.nn.Parameter(layer.w13_qzeros.int(), requires_grad=False)
    with pytest.raises(mf.InputError, match="w13_qzeros must be uint8"):
        layer.process_weights_after_loading()
