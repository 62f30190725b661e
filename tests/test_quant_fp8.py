"""FP8 W8A8 (torch reference): weights, stages, dispatch decisions, the expert-grouped entry point.

Two oracles:

* :func:`w8a8_reference` — independent of the library's quantizers and GEMM: it quantizes the
  activations with its own formula, dequantizes the weights by indexing the scales, and computes
  dense float64 math over every expert (masked by the routing). It rounds where the pipeline rounds
  (the first GEMM's output and the second GEMM's output to the layer dtype), so the comparison is
  tight: measured rel L2 <= 5.5e-7 for fp32 layers, and <= 1.7e-3 for bf16 layers, which is the bf16
  rounding of the output itself (the reference returns the unrounded float64 sum). Now and then
  (about once per 1000 token-expert pairs) the first GEMM's fp32 (pipeline) and float64 (reference)
  sums round an intermediate value to neighbouring fp8 values; such a flip moved the output by up to
  1.1e-3 in 1,800 random layers. So the layer-level bound is 5e-3 for fp32 layers (still 12x below
  the quantization error) and 1e-2 for bf16 layers, while each piece is pinned down tightly on its
  own: the GEMM stage (no quantization after it) to 1e-6, ActivateQuantize bit for bit
  (``tests/test_activate_quantize.py``).
* the unquantized float layer with the same float weights — quantization error: measured rel L2
  0.059-0.068 for every FP8 configuration (e4m3 keeps 3 mantissa bits; weights, activations and the
  intermediate are each quantized), checked against 0.09.

(``tests/test_quant_int8.py`` imports the helpers of this module.)
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.payloads import ExpertRows, PaddedRows, SortedRows
from moeforge.quant.fp8 import ActivationScales, Fp8W8A8Method, WeightScales
from moeforge.quant.int8 import Int8W8A8Method
from moeforge.quant.w8a8 import (
    W8A8GroupedGemm,
    W8A8Method,
    dequantize_weight,
    quantize_layer,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
)
from moeforge.reference import layer_reference
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.activation import apply_activation
from moeforge.stages.topk import select_experts

FP8_CONFIGS = [("channel", "token"), ("channel", "group"), ("block", "token"), ("block", "group")]
FP8_IDS = [f"{w}-{a}" for w, a in FP8_CONFIGS]
FP8_MAX, INT8_MAX = 448.0, 127.0


# -- the independent reference ------------------------------------------------------------------------


def ref_quantize(x: torch.Tensor, dtype: torch.dtype, group: Optional[int]) -> torch.Tensor:
    """Quantize ``x`` symmetrically (one scale per row, or per ``group`` elements) and return the
    dequantized values in float64."""
    values = x.float()
    shape = values.shape
    grouped = values.reshape(*shape[:-1], shape[-1] // group, group) if group else values.unsqueeze(-2)
    qmax = FP8_MAX if dtype == torch.float8_e4m3fn else INT8_MAX
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    scaled = (grouped / scale).clamp(-qmax, qmax)
    q = scaled.to(dtype) if dtype == torch.float8_e4m3fn else scaled.round().to(torch.int8)
    return (q.double() * scale.double()).reshape(shape)


def ref_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` quantized weights in float64: per-channel ``[E, N]`` or block ``[E, nb, kb]``."""
    if scale.dim() == 2:
        return q.double() * scale.double()[:, :, None]
    rows = torch.arange(q.shape[1]) // 128
    cols = torch.arange(q.shape[2]) // 128
    return q.double() * scale.double()[:, rows][:, :, cols]


def act_format(method: W8A8Method) -> tuple[torch.dtype, Optional[int]]:
    quantizer = method.activation_quantizer
    group = 128 if quantizer.scale_layout is mf.ScaleLayout.PER_GROUP_128 else None
    return quantizer.dtype.torch_dtype, group


def w8a8_reference(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (float64) of a W8A8 layer, shared experts excluded."""
    assert isinstance(layer.quant, W8A8Method)
    qdtype, group = act_format(layer.quant)
    routing = layer.routing
    topk = select_experts(logits.float(), layer.top_k, routing, getattr(layer, "e_score_correction_bias", None))
    tokens = x.shape[0]
    gates = torch.zeros(tokens, layer.num_experts, dtype=torch.float64)
    gates.scatter_(1, topk.ids.long(), topk.weights.double())
    chosen = torch.zeros(tokens, layer.num_experts, dtype=torch.bool)
    chosen.scatter_(1, topk.ids.long(), True)
    w13 = ref_weight(layer.w13_weight, layer.w13_weight_scale)
    w2 = ref_weight(layer.w2_weight, layer.w2_weight_scale)
    b13, b2 = layer.w13_bias, layer.w2_bias
    on_input = routing.apply_weights is mf.RoutingWeights.ON_INPUT
    epilogue = routing.apply_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE
    out = torch.zeros(tokens, layer.hidden_size, dtype=torch.float64)
    for expert in range(layer.num_experts):
        gate = gates[:, expert : expert + 1]
        inputs = (x.double() * gate).to(layer.dtype) if on_input else x  # the dispatch rounds scaled rows
        hidden = ref_quantize(inputs, qdtype, group) @ w13[expert].t()
        if b13 is not None:
            hidden = hidden + b13[expert].double()
        activated = apply_activation(hidden.to(layer.dtype), layer.activation)
        y = ref_quantize(activated, qdtype, group) @ w2[expert].t()
        if b2 is not None:
            y = y + b2[expert].double()
        if epilogue:
            y = (y * gate).to(layer.dtype).double()
        else:
            y = y.to(layer.dtype).double()
            y = y if on_input else y * gate
        out += torch.where(chosen[:, expert : expert + 1], y, 0.0)
    if routing.routed_scaling_factor != 1.0 and not routing.scaling_in_weights:
        out = out * routing.routed_scaling_factor
    return out


# -- helpers ------------------------------------------------------------------------------------------


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def quantized_pair(method: W8A8Method, *, num_experts: int = 4, top_k: int = 2, hidden: int = 128,
                   inter: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0,
                   **kwargs: Any) -> tuple[mf.MoELayer, mf.MoELayer]:
    """An unquantized layer with seeded random weights and its quantized copy."""
    torch.manual_seed(seed)
    kwargs.setdefault("environ", {})
    float_layer = mf.MoELayer(num_experts, top_k, hidden, inter, dtype=dtype, **kwargs)
    with torch.no_grad():
        for name in ("w13_bias", "w2_bias"):
            bias = getattr(float_layer, name, None)
            if bias is not None:
                bias.normal_(std=0.1)
    return float_layer, quantize_layer(float_layer, method)


def inputs(tokens: int, hidden: int, num_experts: int, dtype: torch.dtype = torch.float32,
           seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).to(dtype), torch.randn(tokens, num_experts, generator=gen)


def assert_matches_reference(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor,
                             tol: Optional[float] = None) -> float:
    with torch.no_grad():
        out = layer(x, logits)
    ref = w8a8_reference(layer, x, logits)
    assert out.shape == x.shape and out.dtype == layer.dtype
    assert bool(torch.isfinite(out).all())
    if ref.numel() == 0:
        return 0.0
    error = rel(out, ref)
    limit = tol if tol is not None else (5e-3 if layer.dtype == torch.float32 else 1e-2)
    assert error < limit, error
    return error


def stage(layer: mf.MoELayer, kind: mf.StageKind) -> mf.Stage[Any, Any]:
    return next(s for s in layer.pipeline.stages if kind in s.kinds)


# -- the method's data and weights ----------------------------------------------------------------------


def test_capabilities_are_class_data() -> None:
    for name in ("accepts", "accepts_scales", "prefers", "expert_parameters"):
        assert name in vars(Fp8W8A8Method) or name in vars(W8A8Method), name
    assert Fp8W8A8Method.accepts == frozenset({mf.DType.BF16, mf.DType.FP16, mf.DType.FP32, mf.DType.FP8_E4M3})
    assert mf.ScaleLayout.NONE in Fp8W8A8Method.accepts_scales  # float rows are accepted too
    assert {mf.ScaleLayout.PER_TOKEN, mf.ScaleLayout.PER_GROUP_128} <= Fp8W8A8Method.accepts_scales
    assert Fp8W8A8Method.prefers is mf.DispatchDtype.FP8
    assert set(Fp8W8A8Method.expert_parameters) == {"w13_weight", "w2_weight", "w13_weight_scale",
                                                    "w2_weight_scale", "w13_bias", "w2_bias"}
    method = Fp8W8A8Method("block", "group")
    assert method.weight_scales is WeightScales.BLOCK and method.activation_scales is ActivationScales.GROUP
    assert Fp8W8A8Method(WeightScales.BLOCK, ActivationScales.GROUP) == method
    assert method.required_dispatch_dtype() is None
    assert "block" in method.name and "group" in method.name


@pytest.mark.parametrize("kwargs", [{"weight_scales": "tensor"}, {"activation_scales": "block"},
                                    {"weight_scales": 3}])
def test_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(mf.InputError, match=next(iter(kwargs))):
        Fp8W8A8Method(**kwargs)


@pytest.mark.parametrize("weights, acts", FP8_CONFIGS, ids=FP8_IDS)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_create_weights(weights: str, acts: str, gated: bool, bias: bool) -> None:
    holder = torch.nn.Module()
    E, H, I = 3, 256, 128
    Fp8W8A8Method(weights, acts).create_weights(holder, num_experts=E, hidden_size=H, intermediate_size=I,
                                                gated=gated, bias=bias, dtype=torch.bfloat16, device="cpu")
    n13 = 2 * I if gated else I
    assert holder.w13_weight.shape == (E, n13, H) and holder.w13_weight.dtype == torch.float8_e4m3fn
    assert holder.w2_weight.shape == (E, H, I) and holder.w2_weight.dtype == torch.float8_e4m3fn
    block = weights == "block"
    assert holder.w13_weight_scale.shape == ((E, n13 // 128, H // 128) if block else (E, n13))
    assert holder.w2_weight_scale.shape == ((E, H // 128, I // 128) if block else (E, H))
    assert holder.w13_weight_scale.dtype == torch.float32
    assert not holder.w13_weight.requires_grad
    # A usable layer before loading: ~N(0, 1/fan_in) once dequantized.
    w = dequantize_weight(holder.w13_weight, holder.w13_weight_scale)
    assert 0.5 < float(w.std()) * H**0.5 < 1.5
    if bias:
        assert holder.w13_bias.shape == (E, n13) and holder.w13_bias.dtype == torch.bfloat16
    else:
        assert holder.w13_bias is None and holder.w2_bias is None


@pytest.mark.parametrize("method, sizes, match", [
    (Fp8W8A8Method("channel", "group"), (96, 128), "hidden_size"),
    (Fp8W8A8Method("channel", "group"), (128, 64), "intermediate_size"),
    (Fp8W8A8Method("block", "token"), (128, 64), "intermediate_size"),
])
def test_sizes_a_configuration_cannot_take(method: Fp8W8A8Method, sizes: tuple[int, int], match: str) -> None:
    with pytest.raises(mf.InputError, match=match):
        mf.MoELayer(4, 2, *sizes, quant=method, environ={})


def test_block_weights_with_partial_blocks() -> None:
    """Block scales cover partial edge blocks (ceil); only gated + block needs I % 128 == 0."""
    layer = mf.MoELayer(2, 1, 200, 72, quant=Fp8W8A8Method("block", "token"), environ={}, dtype=torch.float32,
                        activation=mf.ActivationConfig(mf.ActivationKind.RELU2))
    assert layer.w13_weight_scale.shape == (2, 1, 2) and layer.w2_weight_scale.shape == (2, 2, 1)
    assert_matches_reference(layer, *inputs(5, 200, 2))


@pytest.mark.parametrize("shape", [(2, 256, 384), (1, 200, 72), (3, 1, 5)])
def test_weight_quantization(shape: tuple[int, ...]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, shape[-1])
    for q, scale in (quantize_weight_per_channel(w, mf.DType.FP8_E4M3), quantize_weight_blockwise(w)):
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        deq = dequantize_weight(q, scale)
        assert torch.equal(deq.double(), ref_weight(q, scale).float().double())
        # e4m3: within 2^-4 relative (normal range) + half a subnormal step of the group's scale
        step = ref_weight(torch.ones_like(q, dtype=torch.float32), scale).float()
        assert bool(((deq - w).abs() <= w.abs() * 2**-4 + step * 2**-10 + 1e-30).all())
    _, channel = quantize_weight_per_channel(w, mf.DType.FP8_E4M3)
    torch.testing.assert_close(channel, w.abs().amax(-1) / FP8_MAX)
    _, block = quantize_weight_blockwise(w)
    for b in range(block.shape[1]):
        for c in range(block.shape[2]):
            tile = w[:, b * 128 : (b + 1) * 128, c * 128 : (c + 1) * 128]
            torch.testing.assert_close(block[:, b, c], tile.abs().amax(dim=(1, 2)) / FP8_MAX)


def test_zero_weights_quantize_to_zero() -> None:
    q, scale = quantize_weight_blockwise(torch.zeros(1, 128, 128))
    assert bool((q.float() == 0).all()) and bool(torch.isfinite(scale).all())
    assert bool((dequantize_weight(q, scale) == 0).all())


# -- the layer against the references -------------------------------------------------------------------


@pytest.mark.parametrize("weights, acts", FP8_CONFIGS, ids=FP8_IDS)
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("dispatch", ["auto", "fp32"])
def test_layer_matches_the_reference(weights: str, acts: str, dispatcher: str, dispatch: str) -> None:
    float_layer, layer = quantized_pair(Fp8W8A8Method(weights, acts), num_experts=4, top_k=2, hidden=256,
                                        dispatcher=dispatcher, dispatch_dtype=dispatch, debug=True)
    x, logits = inputs(24, 256, 4)
    assert_matches_reference(layer, x, logits)
    with torch.no_grad():
        # quantization error vs the float layer: measured 0.060-0.066
        assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.09


@pytest.mark.parametrize("weights, acts", [("channel", "token"), ("block", "group")])
def test_bf16_layer(weights: str, acts: str) -> None:
    float_layer, layer = quantized_pair(Fp8W8A8Method(weights, acts), dtype=torch.bfloat16, seed=2)
    x, logits = inputs(32, 128, 4, torch.bfloat16)
    assert_matches_reference(layer, x, logits)  # measured 1.7e-3: the output's bf16 rounding
    with torch.no_grad():
        assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.09  # measured ~0.064


@pytest.mark.parametrize("weights, acts", FP8_CONFIGS, ids=FP8_IDS)
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
def test_quantizing_before_or_after_the_dispatch_gives_the_same_output(
        weights: str, acts: str, dispatcher: str) -> None:
    """Quantization is per row (or per group of a row), so it commutes with moving rows."""
    method = Fp8W8A8Method(weights, acts)
    _, before = quantized_pair(method, dispatcher=dispatcher, dtype=torch.bfloat16)
    after = quantize_layer(quantized_pair(method, dispatcher=dispatcher, dtype=torch.bfloat16)[0], method)
    after.dispatch_dtype_setting = "bf16"
    after.rebuild_pipeline()
    assert isinstance(stage(before, mf.StageKind.QUANTIZE), mf.QuantizeTokens)
    names = [s.name for s in after.pipeline.stages]
    assert names.index("QuantizeRows") == names.index(stage(after, mf.StageKind.DISPATCH).name) + 1
    x, logits = inputs(20, 128, 4, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(before(x, logits), after(x, logits))


@pytest.mark.parametrize("weights, acts", [("channel", "token"), ("block", "group")])
@pytest.mark.parametrize("case", ["empty", "one_token", "one_expert", "top_k_all", "idle_experts"])
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
def test_edge_cases(weights: str, acts: str, case: str, dispatcher: str) -> None:
    E = 4
    top_k = E if case == "top_k_all" else 2
    _, layer = quantized_pair(Fp8W8A8Method(weights, acts), num_experts=E, top_k=top_k, dispatcher=dispatcher,
                              debug=True)
    tokens = {"empty": 0, "one_token": 1}.get(case, 9)
    x, logits = inputs(tokens, 128, E)
    if case == "one_expert":
        logits[:, 1] += 50.0  # every token's first choice
        layer = quantized_pair(Fp8W8A8Method(weights, acts), num_experts=E, top_k=1, dispatcher=dispatcher)[1]
    if case == "idle_experts":
        logits[:, 2:] -= 50.0  # experts 2 and 3 receive nothing
    assert_matches_reference(layer, x, logits)
    if case == "empty":
        with torch.no_grad():
            assert layer(x, logits).shape == (0, 128)


@pytest.mark.parametrize("apply_weights", [mf.RoutingWeights.IN_GEMM_EPILOGUE, mf.RoutingWeights.ON_INPUT])
def test_biases_and_where_the_routing_weights_go(apply_weights: mf.RoutingWeights) -> None:
    """GPT-OSS-style experts: biases, interleaved gated activation, weights in the epilogue; and
    Llama-4-style weights on the input, which need float rows: dispatch bf16 (quantize after)."""
    routing = mf.RoutingConfig(apply_weights=apply_weights, routed_scaling_factor=2.0, scaling_in_weights=False)
    activation = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED)
    dispatch = "fp32" if apply_weights is mf.RoutingWeights.ON_INPUT else "auto"
    float_layer, layer = quantized_pair(Fp8W8A8Method("block", "group"), expert_bias=True, routing=routing,
                                        activation=activation, dispatch_dtype=dispatch, debug=True)
    gemm = [s for s in layer.pipeline.stages if isinstance(s, W8A8GroupedGemm)]
    assert all(g.bias is not None for g in gemm)
    assert gemm[1].apply_routing_weights is (apply_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE)
    assert torch.equal(layer.w13_bias, float_layer.w13_bias)
    x, logits = inputs(16, 128, 4)
    assert_matches_reference(layer, x, logits)
    with torch.no_grad():
        assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.09


def test_weights_on_the_input_with_fp8_dispatch_is_a_contract_error() -> None:
    # Under "auto" such a layer dispatches float rows (tests/test_dispatch_dtype.py); an explicit FP8
    # dispatch is refused with a hint naming the layer's own settings.
    routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)
    with pytest.raises(mf.ContractError, match="dispatch_dtype"):
        mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method(), routing=routing, environ={}, dispatch_dtype="fp8")
    layer = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method(), routing=routing, environ={}, dtype=torch.bfloat16)
    assert layer.dispatch_decision.dtype is mf.DispatchDtype.BF16


@settings(max_examples=15, deadline=None)
@given(
    config=st.sampled_from(FP8_CONFIGS),
    num_experts=st.integers(1, 8),
    data=st.data(),
    hidden=st.sampled_from([128, 256]),
    inter=st.sampled_from([128, 256]),
    tokens=st.integers(0, 12),
    dispatcher=st.sampled_from(["sorted", "padded"]),
    dispatch=st.sampled_from(["auto", "fp32"]),
    kind=st.sampled_from([mf.ActivationKind.SWIGLU, mf.ActivationKind.SILU, mf.ActivationKind.GEGLU]),
    seed=st.integers(0, 2**16),
)
def test_layer_matches_the_reference_on_random_shapes(
        config: tuple[str, str], num_experts: int, data: st.DataObject, hidden: int, inter: int, tokens: int,
        dispatcher: str, dispatch: str, kind: mf.ActivationKind, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    _, layer = quantized_pair(Fp8W8A8Method(*config), num_experts=num_experts, top_k=top_k, hidden=hidden,
                              inter=inter, dispatcher=dispatcher, dispatch_dtype=dispatch, seed=seed,
                              activation=mf.ActivationConfig(kind))
    x, logits = inputs(tokens, hidden, num_experts, seed=seed + 1)
    skew = data.draw(st.sampled_from(["random", "one_expert"]))
    if skew == "one_expert" and tokens:
        logits[:, data.draw(st.integers(0, num_experts - 1))] += 30.0
    assert_matches_reference(layer, x, logits)


def test_deepseek_v3_preset() -> None:
    """DeepSeek-V3 routing (sigmoid, selection bias, grouped top-k, scaling folded) with block FP8
    weights and per-group activations; the bf16 shared experts are added on top."""
    torch.manual_seed(0)
    layer = mf.MoELayer.from_preset(
        "deepseek_v3", num_experts=8, top_k=2, hidden_size=128, intermediate_size=128, n_group=4,
        topk_group=2, quant=Fp8W8A8Method("block", "group"), dtype=torch.bfloat16, environ={}, debug=True)
    assert isinstance(layer.quant, Fp8W8A8Method) and layer.shared_experts is not None
    with torch.no_grad():
        layer.e_score_correction_bias.normal_(std=0.5)
    x, logits = inputs(12, 128, 8, torch.bfloat16)
    with torch.no_grad():
        out = layer(x, logits)
        shared = layer.shared_experts(x).double()
    assert rel(out.double() - shared, w8a8_reference(layer, x, logits)) < 1e-2  # measured 2.4e-3 (bf16 sums)
    assert isinstance(stage(layer, mf.StageKind.QUANTIZE), mf.QuantizeTokens)
    assert "dispatch fp8 (rule 6" in layer.describe()


# -- build-time contracts and dispatch decisions -----------------------------------------------------------


def test_describe_shows_the_dispatch_decision() -> None:
    layer = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method("block", "group"), environ={}, dtype=torch.bfloat16)
    text = layer.describe()
    assert layer.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.FP8, mf.DispatchRule.LIBRARY_DEFAULT,
                                                          preferred=True)
    assert "dispatch fp8 (rule 6: library default, the quant method's preference)" in text
    assert "QuantizeTokens(fp8_e4m3/per_group_128)" in text
    assert "W8A8GroupedGemm(gate_up, 128->256, w=fp8_e4m3/block128, a=fp8_e4m3/per_group_128)" in text
    assert "ActivateQuantize(swiglu, concatenated -> fp8_e4m3/per_group_128)" in text
    assert "QuantizeRows" not in text
    explicit = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method("block", "group"), environ={},
                           dispatch_dtype="bf16", dtype=torch.bfloat16)
    text = explicit.describe()
    assert "dispatch bf16 (rule 1: explicit setting)" in text
    assert "QuantizeTokens" not in text
    rows = text.splitlines()
    dispatch_row = next(i for i, row in enumerate(rows) if "SortedDispatch" in row)
    assert "QuantizeRows(fp8_e4m3/per_group_128)" in rows[dispatch_row + 1]
    assert "dispatched expert_sorted bf16" in rows[dispatch_row]


def test_a_device_without_fp8_dispatches_float_and_quantizes_after() -> None:
    decision = mf.resolve_dispatch_dtype(
        "auto", experts_accept=Fp8W8A8Method.accepts, quant_prefers=Fp8W8A8Method.prefers,
        device=mf.DeviceDispatchSupport(fp8=False, int8=True), environ={})
    assert decision.dtype is mf.DispatchDtype.BF16  # int8 is not an fp8 method's format
    stages = Fp8W8A8Method().expert_stages(_holder(), activation=mf.ActivationConfig(),
                                           routing_weights_in_epilogue=False, dispatch=decision.dtype)
    assert isinstance(stages[0], mf.QuantizeRows)


def _holder(method: Optional[W8A8Method] = None, gated: bool = True) -> torch.nn.Module:
    holder = torch.nn.Module()
    (method or Fp8W8A8Method()).create_weights(holder, num_experts=4, hidden_size=128, intermediate_size=128,
                                               gated=gated, bias=False, dtype=torch.bfloat16, device="cpu")
    holder.dtype = torch.bfloat16
    holder.activation = mf.ActivationConfig()
    return holder


def _pipeline(quantize: Optional[mf.Stage[Any, Any]], method: W8A8Method,
              dispatch: mf.DispatchDtype) -> mf.Pipeline[Any, Any]:
    holder = _holder(method)
    stages: list[mf.Stage[Any, Any]] = [mf.TopK(4, 2)]
    if quantize is not None:
        stages.append(quantize)
    stages.append(mf.SortedDispatch(4))
    stages += method.expert_stages(holder, activation=mf.ActivationConfig(), routing_weights_in_epilogue=False,
                                   dispatch=dispatch)
    stages.append(mf.Combine())
    return mf.Pipeline(stages, mf.input_spec(128, torch.bfloat16, 4))


def test_a_mismatching_scale_layout_is_a_contract_error() -> None:
    group = Fp8W8A8Method("block", "group")
    with pytest.raises(mf.ContractError) as info:
        _pipeline(mf.QuantizeTokens(mf.PerTokenQuantizer()), group, mf.DispatchDtype.FP8)
    assert info.value.field == "scale_layout" and "W8A8GroupedGemm" in info.value.consumer
    assert info.value.have is mf.ScaleLayout.PER_TOKEN and info.value.want == {mf.ScaleLayout.PER_GROUP_128}
    assert "quant method's own quantizer" in info.value.hint
    with pytest.raises(mf.ContractError) as info:
        _pipeline(mf.QuantizeTokens(mf.PerGroupQuantizer()), Fp8W8A8Method(), mf.DispatchDtype.FP8)
    assert info.value.field == "scale_layout"
    with pytest.raises(mf.ContractError) as info:
        _pipeline(mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.INT8)), Fp8W8A8Method(), mf.DispatchDtype.FP8)
    assert info.value.field == "dtype"
    # the matching quantizer builds
    _pipeline(group.quantize_stage(mf.DispatchDtype.FP8, mf.DType.BF16), group, mf.DispatchDtype.FP8)
    # and a layer whose quantize stage is swapped for the wrong one refuses it
    layer = mf.MoELayer(4, 2, 128, 128, quant=group, environ={})
    with pytest.raises(mf.ContractError, match="scale_layout"):
        layer.replace_stage("QuantizeTokens", mf.QuantizeTokens(mf.PerTokenQuantizer()))


def test_quantize_stage() -> None:
    group, token = Fp8W8A8Method("channel", "group"), Fp8W8A8Method()
    def quantizer(stage: Optional[mf.Stage[Any, Any]]) -> object:
        assert isinstance(stage, mf.QuantizeTokens)
        return stage.quantizer

    assert quantizer(group.quantize_stage(mf.DispatchDtype.FP8, mf.DType.BF16)) == mf.PerGroupQuantizer()
    assert quantizer(token.quantize_stage(mf.DispatchDtype.FP8, mf.DType.BF16)) == mf.PerTokenQuantizer(
        mf.DType.FP8_E4M3)
    assert token.quantize_stage(mf.DispatchDtype.BF16, mf.DType.BF16) is None
    # a float dispatch in another dtype than the layer's is a cast (the experts quantize after it)
    assert quantizer(token.quantize_stage(mf.DispatchDtype.BF16, mf.DType.FP32)) == mf.Cast(mf.DType.BF16)
    with pytest.raises(mf.ContractError, match="dtype"):
        token.quantize_stage(mf.DispatchDtype.INT8, mf.DType.BF16)
    with pytest.raises(mf.ContractError, match="rule 1"):
        mf.MoELayer(4, 2, 128, 128, quant=token, dispatch_dtype="int8", environ={})


def test_expert_stages() -> None:
    method = Fp8W8A8Method("block", "group")
    holder = _holder(method)
    kwargs: dict[str, Any] = dict(activation=mf.ActivationConfig(), routing_weights_in_epilogue=True)
    fp8 = method.expert_stages(holder, dispatch=mf.DispatchDtype.FP8, **kwargs)
    assert [type(s) for s in fp8] == [W8A8GroupedGemm, ActivateQuantize, W8A8GroupedGemm]
    assert fp8[2].apply_routing_weights and not fp8[0].apply_routing_weights  # type: ignore[attr-defined]
    assert fp8[0].out_dtype is mf.DType.BF16  # type: ignore[attr-defined]
    for dispatch in (None, mf.DispatchDtype.BF16):
        stages = method.expert_stages(holder, dispatch=dispatch, **kwargs)
        assert isinstance(stages[0], mf.QuantizeRows) and len(stages) == 4
        assert stages[0].quantizer == mf.PerGroupQuantizer()
    from moeforge.kernels.config import ConfigTable

    triton = selected_stages(method, holder, backend=mf.Backend.TRITON, configs=ConfigTable(4, 2), **kwargs)
    assert [type(stage).__name__ for stage in triton] == ["QuantizeAligned", "FusedQuantGroupedGemm",
                                                          "FusedQuantGroupedGemm"]
    with pytest.raises(ValueError, match="ConfigTable"):
        selected_stages(method, holder, backend=mf.Backend.TRITON, **kwargs)


def test_gemm_stage_rejects_bad_weights() -> None:
    holder = _holder()
    args = (mf.DType.FP8_E4M3, mf.ScaleLayout.PER_TOKEN, mf.DType.BF16)
    with pytest.raises(ValueError, match="weight_scale"):
        W8A8GroupedGemm(mf.GemmRole.GATE_UP, holder.w13_weight, holder.w2_weight_scale, *args)
    with pytest.raises(ValueError, match="weight must be"):
        W8A8GroupedGemm(mf.GemmRole.GATE_UP, holder.w13_weight.float(), holder.w13_weight_scale, *args)
    with pytest.raises(ValueError, match="float dtype"):
        W8A8GroupedGemm(mf.GemmRole.GATE_UP, holder.w13_weight, holder.w13_weight_scale, mf.DType.FP8_E4M3,
                        mf.ScaleLayout.PER_TOKEN, mf.DType.FP8_E4M3)
    with pytest.raises(ValueError, match="bias"):
        W8A8GroupedGemm(mf.GemmRole.GATE_UP, holder.w13_weight, holder.w13_weight_scale, *args,
                        bias=torch.zeros(4, 128))


@pytest.mark.parametrize("weights, acts", FP8_CONFIGS, ids=FP8_IDS)
@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("epilogue", [False, True])
@torch.no_grad()
def test_gemm_stage_matches_dense_math(weights: str, acts: str, dispatcher: str, epilogue: bool) -> None:
    """``W8A8GroupedGemm`` alone against dequantize-then-matmul in float64 (measured rel L2 ~1e-7)."""
    method = Fp8W8A8Method(weights, acts)
    holder = _holder(method)
    holder.w13_bias = torch.nn.Parameter(torch.randn(4, 256), requires_grad=False)
    x, logits = inputs(13, 128, 4, seed=5)
    logits[:, 3] -= 50.0  # expert 3 gets no rows
    routed = mf.TopK(4, 2)(mf.MoEInput(x, logits))
    routed = routed.with_x(method.activation_quantizer(routed.x.data))
    rows: ExpertRows = mf.SortedDispatch(4)(routed) if dispatcher == "sorted" else mf.PaddedDispatch(4)(routed)
    gemm = W8A8GroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(holder, "w13_weight"),
                           mf.ParamRef(holder, "w13_weight_scale"), *act_format_dtypes(method), mf.DType.FP32,
                           mf.ParamRef(holder, "w13_bias"), epilogue)
    out = gemm(rows).x.data
    qdtype, group = act_format(method)
    values = ref_quantize(x, qdtype, group)
    w13 = ref_weight(holder.w13_weight, holder.w13_weight_scale)
    if isinstance(rows, SortedRows):
        experts = torch.repeat_interleave(torch.arange(4), rows.group_list)
        row_token = torch.empty(rows.row_weights.shape[0], dtype=torch.int64)
        row_token[rows.plan.token_rows.reshape(-1)] = torch.arange(row_token.numel()) // rows.plan.token_rows.shape[1]
        inputs_, weight = values[row_token], rows.row_weights
    else:
        assert isinstance(rows, PaddedRows)
        experts = torch.arange(4).repeat_interleave(rows.capacity)
        slots = rows.plan.token_slots.reshape(-1)
        inputs_ = torch.zeros(4 * rows.capacity, 128, dtype=torch.float64)
        inputs_[slots] = values.repeat_interleave(2, dim=0)
        weight = rows.slot_weights.reshape(-1)
        out = out.reshape(-1, 256)
    ref = torch.einsum("rk,rnk->rn", inputs_, w13[experts]) + holder.w13_bias.double()[experts]
    if epilogue:
        ref = ref * weight.double().unsqueeze(-1)
    assert rel(out, ref) < 1e-6


def act_format_dtypes(method: W8A8Method) -> tuple[mf.DType, mf.ScaleLayout]:
    return method.activation_quantizer.dtype, method.activation_quantizer.scale_layout


def test_layers_with_different_methods_keep_their_own_decisions() -> None:
    environ = {"MOEFORGE_DISPATCH_DTYPE": "fp8"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bf16 = torch.bfloat16
        fp8 = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method("block", "group"), environ=environ, dtype=bf16)
        int8 = mf.MoELayer(4, 2, 128, 128, quant=Int8W8A8Method(), environ=environ, dtype=bf16)
        plain = mf.MoELayer(4, 2, 128, 128, environ=environ, dtype=bf16)
        default = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method(), environ={}, dtype=bf16)
    assert fp8.dispatch_decision.rule is mf.DispatchRule.PROCESS_DEFAULT
    assert int8.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.INT8, mf.DispatchRule.LIBRARY_DEFAULT,
                                                         preferred=True)
    assert plain.dispatch_decision.dtype is mf.DispatchDtype.BF16
    assert default.dispatch_decision.dtype is mf.DispatchDtype.FP8
    assert any("ignored" in str(w.message) and "Int8W8A8Method" in str(w.message) for w in caught)
    before = [layer.describe() for layer in (fp8, int8, plain)]
    default.dispatch_dtype_setting = "bf16"
    default.rebuild_pipeline()
    assert [layer.describe() for layer in (fp8, int8, plain)] == before
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        outs = [layer(x) for layer in (fp8, int8, plain, default)]
    assert all(out.shape == x.shape and bool(torch.isfinite(out).all()) for out in outs)


# -- weights in place ----------------------------------------------------------------------------------


def test_quantize_weights_and_param_refs() -> None:
    """The stages read the parameters at call time: new weights are seen without a rebuild."""
    float_layer, layer = quantized_pair(Fp8W8A8Method("block", "token"), seed=3)
    other, _ = quantized_pair(Fp8W8A8Method("block", "token"), seed=4)
    x, logits = inputs(8, 128, 4)
    with torch.no_grad():
        first = layer(x, logits)
        layer.quant.quantize_weights(layer, other.w13_weight, other.w2_weight)  # type: ignore[attr-defined]
        second = layer(x, logits)
    assert not torch.equal(first, second)
    assert_matches_reference(layer, x, logits)
    with pytest.raises(mf.InputError, match="w13_weight"):
        layer.quant.quantize_weights(layer, other.w13_weight[:2], other.w2_weight)  # type: ignore[attr-defined]
    with pytest.raises(mf.InputError, match="float"):
        layer.quant.quantize_weights(layer, layer.w13_weight, other.w2_weight)  # type: ignore[attr-defined]
    # the float layer was not touched by quantize_layer
    assert float_layer.w13_weight.dtype == torch.float32 and isinstance(float_layer.quant, mf.UnquantizedMethod)
    with pytest.raises(mf.InputError, match="float expert weights"):
        quantize_layer(layer, Fp8W8A8Method())


def test_process_weights_after_loading_checks_the_tensors() -> None:
    layer = mf.MoELayer(4, 2, 128, 128, quant=Fp8W8A8Method("block", "group"), environ={})
    layer.process_weights_after_loading()
    with torch.no_grad():
        layer.w2_weight_scale[0, 0, 0] = float("nan")
    with pytest.raises(mf.InputError, match="non-finite"):
        layer.process_weights_after_loading()
    layer.w2_weight_scale = torch.nn.Parameter(torch.ones(4, 128), requires_grad=False)
    with pytest.raises(mf.InputError, match="w2_weight_scale"):
        layer.process_weights_after_loading()
    layer.w2_weight_scale = torch.nn.Parameter(torch.ones(4, 1, 1), requires_grad=False)
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.float(), requires_grad=False)
    with pytest.raises(mf.InputError, match="w13_weight must be"):
        layer.process_weights_after_loading()


# -- apply_without_routing_weights --------------------------------------------------------------------------


def dispatched(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> ExpertRows:
    payload: Any = mf.MoEInput(x, logits)
    for s in layer.pipeline.stages:
        payload = s(payload)
        if mf.StageKind.DISPATCH in s.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


def combine(layer: mf.MoELayer, rows: ExpertRows, expert_out: torch.Tensor) -> torch.Tensor:
    if isinstance(rows, SortedRows):
        return rows.plan.combine(expert_out, True, None, layer.dtype)
    assert isinstance(rows, PaddedRows)
    flat = expert_out.reshape(-1, expert_out.shape[-1])
    return rows.plan.combine(flat, True, None, layer.dtype)


@pytest.mark.parametrize("weights, acts", [("channel", "token"), ("block", "group")])
@pytest.mark.parametrize("dispatcher, group_list_type", [("sorted", 1), ("sorted", 0), ("padded", 1)])
@pytest.mark.parametrize("dispatch", ["auto", "bf16"])
@torch.no_grad()
def test_apply_without_routing_weights_equals_the_forward(
        weights: str, acts: str, dispatcher: str, group_list_type: int, dispatch: str) -> None:
    glt = mf.GroupListType(group_list_type)
    choice: Any = mf.SortedDispatch(4, group_list_type=glt) if dispatcher == "sorted" else "padded"
    _, layer = quantized_pair(Fp8W8A8Method(weights, acts), dispatcher=choice, dispatch_dtype=dispatch,
                              dtype=torch.bfloat16, expert_bias=True)
    x, logits = inputs(16, 128, 4, torch.bfloat16)
    x[3] = 0.0  # an all-zero row
    rows = dispatched(layer, x, logits)
    group_list = rows.group_list if isinstance(rows, SortedRows) else rows.masked_m  # type: ignore[attr-defined]
    out = layer.quant.apply_without_routing_weights(layer, rows.x.data, rows.x.scale, group_list_type,
                                                    group_list, torch.float32)
    assert out.shape == rows.x.data.shape and out.dtype == torch.float32
    # the pipeline rounds the second GEMM's output to bf16 before the combine; here it stays fp32
    assert rel(combine(layer, rows, out), layer(x, logits)) < 4e-3


@torch.no_grad()
def test_apply_without_routing_weights_quantized_or_float_rows_agree() -> None:
    _, layer = quantized_pair(Fp8W8A8Method("block", "group"))
    rows = torch.randn(10, 128)
    counts = torch.tensor([4, 0, 6, 0])
    quantized = mf.PerGroupQuantizer()(rows)
    apply = layer.quant.apply_without_routing_weights
    from_float = apply(layer, rows, None, 1, counts, torch.float32)
    assert torch.equal(from_float, apply(layer, quantized.data, quantized.scale, 1, counts, torch.float32))
    assert torch.equal(from_float, apply(layer, rows, None, 0, counts.cumsum(0), torch.float32))
    empty = apply(layer, torch.empty(0, 128), None, 1, torch.zeros(4, dtype=torch.int64), torch.bfloat16)
    assert empty.shape == (0, 128) and empty.dtype == torch.bfloat16
    padded = apply(layer, torch.randn(4, 3, 128), None, 1, torch.tensor([3, 0, 1, 2]), torch.float32)
    assert padded.shape == (4, 3, 128)


@pytest.mark.parametrize("args, match", [
    (dict(hidden=torch.randn(8, 128), scale=torch.ones(8, 1)), "must be None for float"),
    (dict(hidden=torch.randn(8, 128).to(torch.float8_e4m3fn)), "hidden_states_scale is required"),
    (dict(hidden=torch.randn(8, 128).to(torch.float8_e4m3fn), scale=torch.ones(8, 1).half()), r"fp32 \(8, 1\)"),
    (dict(hidden=torch.randn(8, 128).to(torch.float8_e4m3fn), scale=torch.ones(8, 2)), "hidden_states_scale"),
    (dict(hidden=torch.randn(8, 128).to(torch.int8), scale=torch.ones(8, 1)), "float8"),
    (dict(hidden=torch.randn(8, 128).double()), "hidden_states"),
    (dict(hidden=torch.randn(8, 64)), "hidden_states"),
    (dict(hidden=torch.randn(8, 128), group_list=torch.tensor([8, 0, 0])), "group_list"),
    (dict(hidden=torch.randn(8, 128), group_list=torch.tensor([4, 0, 0, 3])), "group_list"),
    (dict(hidden=torch.randn(8, 128), group_list_type=2), "group_list_type"),
    (dict(hidden=torch.randn(4, 2, 128), group_list_type=0), "group_list_type=1"),
    (dict(hidden=torch.randn(5, 2, 128)), "hidden_states"),
])
def test_apply_without_routing_weights_rejects_bad_arguments(args: dict[str, Any], match: str) -> None:
    _, layer = quantized_pair(Fp8W8A8Method("channel", "token"))
    group_list = args.get("group_list", torch.tensor([4, 0, 4, 0]))
    with pytest.raises(mf.InputError, match=match):
        layer.quant.apply_without_routing_weights(layer, args["hidden"], args.get("scale"),
                                                  args.get("group_list_type", 1), group_list, torch.float32)
    group = quantized_pair(Fp8W8A8Method("channel", "group"))[1]
    with pytest.raises(mf.InputError, match=r"\(8, 1\)"):
        fp8 = torch.randn(8, 128).to(torch.float8_e4m3fn)
        group.quant.apply_without_routing_weights(group, fp8, torch.ones(8, 2), 1, torch.tensor([4, 0, 4, 0]),
                                                  torch.float32)
