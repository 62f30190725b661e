"""Grouped GEMMs (expert-sorted and expert-padded) and the expert activations.

The oracles are written out here: a per-row loop in float64 for the GEMMs (dequantizing FP8/INT8 by
hand) and the textbook formulas of each activation.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.stages import apply_activation, grouped_gemm_padded, grouped_gemm_sorted

FP8 = mf.DType.FP8_E4M3
INT8 = mf.DType.INT8
AK = mf.ActivationKind


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _weights(experts: int, n: int, k: int, seed: int) -> torch.Tensor:
    return _randn(experts, n, k, seed=seed, scale=k**-0.5)


# -- the GEMM oracle -------------------------------------------------------------------------------


def _dequantize_by_hand(x: mf.Activations) -> torch.Tensor:
    """float64 value of ``x`` (scale per row, per 128 columns of a row, or per tensor)."""
    values = x.data.double()
    if x.scale is None:
        return values
    scale = x.scale.double()
    if scale.dim() == 1:  # per tensor
        return values * scale
    out = values.clone()
    width = values.shape[-1]
    groups = scale.shape[-1]
    for g in range(groups):
        columns = slice(g * width // groups, (g + 1) * width // groups)
        out[..., columns] = values[..., columns] * scale[..., g:g + 1]
    return out


def _sorted_reference(
    x: mf.Activations,
    counts: list[int],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    row_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    values = _dequantize_by_hand(x)
    experts = [e for e, count in enumerate(counts) for _ in range(count)]
    rows = []
    for r, e in enumerate(experts):
        y = weight[e].double() @ values[r]
        if bias is not None:
            y = y + bias[e].double()
        if row_scale is not None:
            y = y * float(row_scale[r])
        rows.append(y)
    if not rows:
        return torch.empty(0, weight.shape[1], dtype=torch.float64)
    return torch.stack(rows)


def _padded_reference(
    x: mf.Activations,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    slot_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    values = _dequantize_by_hand(x)
    experts, capacity, _ = values.shape
    out = torch.empty(experts, capacity, weight.shape[1], dtype=torch.float64)
    for e in range(experts):
        for c in range(capacity):
            y = weight[e].double() @ values[e, c]
            if bias is not None:
                y = y + bias[e].double()
            if slot_scale is not None:
                y = y * float(slot_scale[e, c])
            out[e, c] = y
    return out


def _quantize(kind: str, x: torch.Tensor) -> mf.Activations:
    if kind == "float":
        return mf.Activations(x)
    if kind == "bf16":
        return mf.Activations(x.bfloat16())
    if kind == "fp8-token":
        return mf.PerTokenQuantizer(FP8)(x)
    if kind == "int8-token":
        return mf.PerTokenQuantizer(INT8)(x)
    if kind == "fp8-group":
        return mf.PerGroupQuantizer()(x)
    assert kind == "fp8-tensor"
    scale = x.abs().amax().clamp(min=1e-12) / 448
    return mf.Activations((x / scale).to(torch.float8_e4m3fn), scale.reshape(1).float())


INPUTS = ["float", "bf16", "fp8-token", "int8-token", "fp8-group", "fp8-tensor"]


# -- grouped_gemm_sorted / grouped_gemm_padded -----------------------------------------------------


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
def test_grouped_gemm_sorted_matches_per_row_loop(kind: str, with_bias: bool, with_scale: bool) -> None:
    experts, k, n = 5, 256, 24
    counts = [3, 0, 7, 1, 0]  # idle experts included
    rows = sum(counts)
    x = _quantize(kind, _randn(rows, k, seed=1))
    weight = _weights(experts, n, k, seed=2)
    bias = _randn(experts, n, seed=3) if with_bias else None
    scale = torch.rand(rows, generator=_gen(4)) if with_scale else None
    got = grouped_gemm_sorted(x, torch.tensor(counts), weight, bias, scale, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), _sorted_reference(x, counts, weight, bias, scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
def test_grouped_gemm_padded_matches_per_slot_loop(kind: str, with_bias: bool, with_scale: bool) -> None:
    experts, capacity, k, n = 3, 4, 256, 16
    x = _quantize(kind, _randn(experts, capacity, k, seed=5))
    weight = _weights(experts, n, k, seed=6)
    bias = _randn(experts, n, seed=7) if with_bias else None
    scale = torch.rand(experts, capacity, generator=_gen(8)) if with_scale else None
    got = grouped_gemm_padded(x, weight, bias, scale, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (experts, capacity, n)
    torch.testing.assert_close(got.double(), _padded_reference(x, weight, bias, scale), rtol=1e-5, atol=1e-5)


def test_routing_weight_in_the_epilogue_comes_after_the_bias() -> None:
    """GPT-OSS: y = w * (x @ W.T + b), not w * (x @ W.T) + b."""
    x = mf.Activations(_randn(6, 16, seed=9))
    weight, bias = _weights(2, 8, 16, seed=10), _randn(2, 8, seed=11) + 3
    scale = torch.rand(6, generator=_gen(12)) * 0.5
    counts = torch.tensor([4, 2])
    got = grouped_gemm_sorted(x, counts, weight, bias, scale, torch.float32)
    plain = grouped_gemm_sorted(x, counts, weight, None, None, torch.float32)
    bias_rows = bias[[0, 0, 0, 0, 1, 1]]
    torch.testing.assert_close(got, (plain + bias_rows) * scale[:, None])
    assert not torch.allclose(got, plain * scale[:, None] + bias_rows)
    padded = grouped_gemm_padded(mf.Activations(x.data.view(2, 3, 16)), weight, bias,
                                 scale.view(2, 3), torch.float32)
    bias_slots = bias[:, None, :]
    plain_padded = grouped_gemm_padded(mf.Activations(x.data.view(2, 3, 16)), weight, None, None, torch.float32)
    torch.testing.assert_close(padded, (plain_padded + bias_slots) * scale.view(2, 3, 1))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grouped_gemm_output_dtype(out_dtype: torch.dtype) -> None:
    x = mf.Activations(_randn(5, 32, seed=13).bfloat16())
    weight = _weights(2, 8, 32, seed=14).bfloat16()
    got = grouped_gemm_sorted(x, torch.tensor([2, 3]), weight, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    want = _sorted_reference(x, [2, 3], weight)
    # fp32 accumulation, then one rounding to the output dtype.
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_grouped_gemm_on_empty_inputs() -> None:
    weight = _weights(4, 8, 128, seed=15)
    for kind in ("float", "fp8-token", "fp8-group", "int8-token"):
        x = _quantize(kind, torch.empty(0, 128))
        assert grouped_gemm_sorted(x, torch.zeros(4, dtype=torch.int64), weight).shape == (0, 8)
        empty_padded = _quantize(kind, torch.empty(4, 0, 128))
        assert grouped_gemm_padded(empty_padded, weight).shape == (4, 0, 8)


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 6),
    data=st.data(),
    kind=st.sampled_from(["float", "fp8-token", "int8-token", "fp8-group"]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_sorted_property(
    experts: int, data: st.DataObject, kind: str, with_bias: bool, seed: int
) -> None:
    counts = data.draw(st.lists(st.integers(0, 5), min_size=experts, max_size=experts), label="counts")
    rows = sum(counts)
    x = _quantize(kind, _randn(rows, 128, seed=seed))
    weight = _weights(experts, 12, 128, seed=seed + 1)
    bias = _randn(experts, 12, seed=seed + 2) if with_bias else None
    got = grouped_gemm_sorted(x, torch.tensor(counts, dtype=torch.int64), weight, bias, None, torch.float32)
    torch.testing.assert_close(got.double(), _sorted_reference(x, counts, weight, bias), rtol=1e-5, atol=1e-5)


# -- GroupedGemm stage -----------------------------------------------------------------------------

E, K, H, I = 4, 2, 128, 32
EPILOGUE = mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE)


def _spec(dtype: torch.dtype = torch.float32, hidden: int = H) -> mf.Spec:
    return mf.input_spec(hidden, dtype, E)


def _inputs(tokens: int, seed: int, dtype: torch.dtype = torch.float32, hidden: int = H) -> mf.MoEInput:
    gen = _gen(seed)
    return mf.MoEInput(torch.randn(tokens, hidden, generator=gen).to(dtype), torch.randn(tokens, E, generator=gen))


def test_gemm_stage_specs() -> None:
    w13, w2 = _weights(E, 2 * I, H, seed=16), _weights(E, H, I, seed=17)
    gate_up = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13)
    down = mf.GroupedGemm(mf.GemmRole.DOWN, w2, apply_routing_weights=True)
    assert (gate_up.num_experts, gate_up.in_features, gate_up.out_features) == (E, H, 2 * I)
    pipeline = mf.Pipeline([mf.TopK(E, K, EPILOGUE), mf.SortedDispatch(E), gate_up, mf.Activate(), down,
                            mf.Combine(apply_routing_weights=False)], _spec(), debug=True)
    hidden, act, out = pipeline.specs[2], pipeline.specs[3], pipeline.specs[4]
    assert hidden.kind is mf.PayloadKind.EXPERT_HIDDEN and hidden.width == 2 * I
    assert hidden.layout is mf.Layout.EXPERT_SORTED and hidden.scale_layout is mf.ScaleLayout.NONE
    assert act.kind is mf.PayloadKind.EXPERT_HIDDEN and act.width == I
    assert out.kind is mf.PayloadKind.EXPERT_OUTPUT and out.width == H
    assert out.routing_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE
    assert pipeline.output_spec.routing_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE
    pipeline(_inputs(9, seed=18))  # debug mode checks every payload against these specs
    assert "weights in epilogue" in down.summary() and f"{H}->{2 * I}" in gate_up.summary()


def _token_loop_reference(
    inputs: mf.MoEInput,
    routing: mf.RoutingConfig,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: mf.ActivationConfig,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e]), token by token."""
    topk = mf.stages.select_experts(inputs.router_logits, K, routing)
    x = inputs.hidden_states.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(topk.ids[t, k])
            h = w13[e].double() @ x[t]
            if b13 is not None:
                h = h + b13[e].double()
            y = w2[e].double() @ _activation_by_hand(h, activation)
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(topk.weights[t, k]) * y
    return out


@pytest.mark.parametrize("layout", ["sorted", "padded"])
@pytest.mark.parametrize("weights_at", ["combine", "epilogue"])
def test_gemm_activation_gemm_pipeline_matches_token_loop(layout: str, weights_at: str) -> None:
    w13, w2 = _weights(E, 2 * I, H, seed=19), _weights(E, H, I, seed=20)
    b13, b2 = _randn(E, 2 * I, seed=21), _randn(E, H, seed=22)
    epilogue = weights_at == "epilogue"
    dispatch = mf.SortedDispatch(E) if layout == "sorted" else mf.PaddedDispatch(E)
    pipeline = mf.Pipeline(
        [mf.TopK(E, K, EPILOGUE if epilogue else mf.RoutingConfig()), dispatch,
         mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, b13), mf.Activate(),
         mf.GroupedGemm(mf.GemmRole.DOWN, w2, b2, apply_routing_weights=epilogue),
         mf.Combine(apply_routing_weights=not epilogue)],
        _spec(), debug=True)
    inputs = _inputs(13, seed=23)
    # Weights after the down GEMM's bias, or in the combine: the same sum (the reference weights after).
    want = _token_loop_reference(inputs, mf.RoutingConfig(), w13, w2, mf.ActivationConfig(), b13, b2)
    torch.testing.assert_close(pipeline(inputs).hidden_states.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["sorted", "padded"])
@pytest.mark.parametrize("quantizer", [mf.PerTokenQuantizer(FP8), mf.PerTokenQuantizer(INT8), mf.PerGroupQuantizer()],
                         ids=["fp8-token", "int8-token", "fp8-group"])
def test_gemm_stage_on_quantized_rows(layout: str, quantizer: mf.stages.Quantizer) -> None:
    """Quantized rows are dequantized exactly (scale per row / per group), then multiplied."""
    w13 = _weights(E, 2 * I, H, seed=24)
    dispatch = mf.SortedDispatch(E) if layout == "sorted" else mf.PaddedDispatch(E)
    gemm = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, out_dtype=mf.DType.FP32)
    pipeline = mf.Pipeline([mf.TopK(E, K), mf.QuantizeTokens(quantizer), dispatch, gemm],
                           _spec(torch.bfloat16), debug=True)
    assert pipeline.specs[2].dtype is quantizer.dtype
    assert pipeline.output_spec.dtype is mf.DType.FP32
    assert pipeline.output_spec.scale_layout is mf.ScaleLayout.NONE
    inputs = _inputs(10, seed=25, dtype=torch.bfloat16)
    got = pipeline(inputs)
    dispatched = mf.Pipeline(pipeline.stages[:3], _spec(torch.bfloat16))(inputs)
    if isinstance(dispatched, mf.SortedRows):
        want = _sorted_reference(dispatched.x, dispatched.counts().tolist(), w13)
        torch.testing.assert_close(got.x.data.double(), want, rtol=1e-5, atol=1e-5)
    else:
        want = _padded_reference(dispatched.x, w13)
        for e, valid in enumerate(dispatched.masked_m.tolist()):
            torch.testing.assert_close(got.x.data[e, :valid].double(), want[e, :valid], rtol=1e-5, atol=1e-5)


def test_padded_and_sorted_gemm_agree_on_valid_rows() -> None:
    w13 = _weights(E, 2 * I, H, seed=26)
    b13 = _randn(E, 2 * I, seed=27)
    gemm = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, b13)
    routed = mf.TopK(E, K)(_inputs(15, seed=28))
    sorted_rows = gemm(mf.SortedDispatch(E)(routed))
    padded_rows = gemm(mf.PaddedDispatch(E)(routed))
    assert isinstance(sorted_rows, mf.SortedRows) and isinstance(padded_rows, mf.PaddedRows)
    start = 0
    for e, count in enumerate(sorted_rows.counts().tolist()):
        torch.testing.assert_close(padded_rows.x.data[e, :count], sorted_rows.x.data[start:start + count])
        start += count


def test_gemm_contract_errors() -> None:
    w13, w2 = _weights(E, 2 * I, H, seed=29), _weights(E, H, I, seed=30)
    gate_up, down = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13), mf.GroupedGemm(mf.GemmRole.DOWN, w2)
    spec = _spec()

    def error(stages: list[mf.Stage], spec: mf.Spec = spec) -> mf.ContractError:
        with pytest.raises(mf.ContractError) as caught:
            mf.Pipeline(stages, spec)
        return caught.value

    # Before the dispatch: token-major rows, global ids.
    assert error([mf.TopK(E, K), gate_up]).field == "kind"
    # The down projection straight after the dispatch.
    assert error([mf.TopK(E, K), mf.SortedDispatch(E), down]).field == "kind"
    # Hidden size disagrees with the weights.
    wrong = error([mf.TopK(E, K), mf.SortedDispatch(E), gate_up], _spec(hidden=64))
    assert wrong.field == "width" and wrong.have == 64 and "GroupedGemm" in wrong.consumer
    # Intermediate size disagrees between the two GEMMs.
    down_wide = mf.GroupedGemm(mf.GemmRole.DOWN, _weights(E, H, 2 * I, seed=31))
    assert error([mf.TopK(E, K), mf.SortedDispatch(E), gate_up, mf.Activate(), down_wide]).field == "width"
    # Number of experts disagrees with the dispatch.
    few = mf.GroupedGemm(mf.GemmRole.GATE_UP, _weights(E - 1, 2 * I, H, seed=32))
    assert error([mf.TopK(E, K), mf.SortedDispatch(E), few]).field == "num_experts"
    # Quantized rows without an explicit out_dtype.
    quantized = [mf.TopK(E, K), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)), mf.SortedDispatch(E)]
    no_out = error(quantized + [gate_up], _spec(torch.bfloat16))
    assert no_out.field == "dtype" and "out_dtype" in no_out.hint
    # A GEMM built for float activations only (the unquantized method's) refuses fp8 rows.
    float_only = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, accepts_dtypes=frozenset({mf.DType.BF16}),
                                out_dtype=mf.DType.BF16)
    assert error(quantized + [float_only], _spec(torch.bfloat16)).field == "dtype"
    scales = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, accepts_scales=frozenset({mf.ScaleLayout.PER_TOKEN}),
                            out_dtype=mf.DType.BF16)
    group = [mf.TopK(E, K), mf.QuantizeTokens(mf.PerGroupQuantizer()), mf.SortedDispatch(E), scales]
    assert error(group, _spec(torch.bfloat16)).field == "scale_layout"


def test_routing_weights_in_the_epilogue_exactly_once() -> None:
    w13, w2 = _weights(E, 2 * I, H, seed=33), _weights(E, H, I, seed=34)
    gate_up = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13)
    down = mf.GroupedGemm(mf.GemmRole.DOWN, w2, apply_routing_weights=True)
    head = [mf.TopK(E, K, EPILOGUE), mf.SortedDispatch(E), gate_up, mf.Activate(), down]
    with pytest.raises(mf.ContractError) as caught:
        mf.Pipeline(head + [mf.Combine()], _spec())
    assert caught.value.field == "routing_weights" and "apply_routing_weights=False" in caught.value.hint
    # Already applied on the input (where the router declares): the epilogue may not apply them again.
    on_input = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)
    with pytest.raises(mf.ContractError) as caught:
        mf.Pipeline([mf.TopK(E, K, on_input), mf.SortedDispatch(E, apply_routing_weights=True), gate_up,
                     mf.Activate(), down], _spec())
    assert caught.value.field == "routing_weights"


def test_gemm_weight_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        mf.GroupedGemm(mf.GemmRole.GATE_UP, torch.randn(8, 16))
    with pytest.raises(ValueError, match="bias"):
        mf.GroupedGemm(mf.GemmRole.GATE_UP, torch.randn(2, 8, 16), torch.randn(2, 16))


def test_gemm_stage_reads_layer_weights_at_call_time() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32)
    x = _randn(6, H, seed=35)
    before = layer(x)
    with torch.no_grad():
        layer.w2_weight.mul_(2)
    torch.testing.assert_close(layer(x), before * 2, rtol=1e-5, atol=1e-6)


# -- activations -----------------------------------------------------------------------------------


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gpt_oss(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
    up = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=up.dtype)), torch.tensor(-limit, dtype=up.dtype))
    return (up + 1) * gate * (1 / (1 + torch.exp(-alpha * gate)))


def _gated_by_hand(gate: torch.Tensor, up: torch.Tensor, config: mf.ActivationConfig) -> torch.Tensor:
    if config.kind is AK.SWIGLU:
        return _silu(gate) * up
    if config.kind is AK.GEGLU:
        return _gelu(gate, config.gelu_approximate) * up
    assert config.kind is AK.GPT_OSS_SWIGLU
    return _gpt_oss(gate, up, config.alpha, config.limit)


def _activation_by_hand(h: torch.Tensor, config: mf.ActivationConfig) -> torch.Tensor:
    """The formula for one row (or rows) of float64 pre-activations."""
    if config.kind is AK.SILU:
        return _silu(h)
    if config.kind is AK.GELU:
        return _gelu(h, config.gelu_approximate)
    if config.kind is AK.RELU2:
        return torch.where(h > 0, h * h, torch.zeros_like(h))
    if config.gate_up is mf.GateUpLayout.INTERLEAVED:
        return _gated_by_hand(h[..., 0::2], h[..., 1::2], config)
    half = h.shape[-1] // 2
    return _gated_by_hand(h[..., :half], h[..., half:], config)


def _join(gate: torch.Tensor, up: torch.Tensor, layout: mf.GateUpLayout) -> torch.Tensor:
    if layout is mf.GateUpLayout.CONCATENATED:
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


GATED = [
    mf.ActivationConfig(AK.SWIGLU),
    mf.ActivationConfig(AK.SWIGLU, mf.GateUpLayout.INTERLEAVED),
    mf.ActivationConfig(AK.GEGLU),
    mf.ActivationConfig(AK.GEGLU, gelu_approximate="tanh"),
    mf.ActivationConfig(AK.GEGLU, mf.GateUpLayout.INTERLEAVED, gelu_approximate="tanh"),
    mf.ActivationConfig(AK.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED),
    mf.ActivationConfig(AK.GPT_OSS_SWIGLU, mf.GateUpLayout.CONCATENATED, alpha=1.0, limit=3.0),
]
PLAIN = [mf.ActivationConfig(AK.SILU), mf.ActivationConfig(AK.GELU),
         mf.ActivationConfig(AK.GELU, gelu_approximate="tanh"), mf.ActivationConfig(AK.RELU2)]


@pytest.mark.parametrize("config", GATED, ids=lambda c: c.summary())
def test_gated_activation_formulas(config: mf.ActivationConfig) -> None:
    gate, up = _randn(9, 24, seed=36, scale=5.0), _randn(9, 24, seed=37, scale=5.0)  # past the clamps
    joined = _join(gate, up, config.gate_up)
    want = _gated_by_hand(gate.double(), up.double(), config)
    got = apply_activation(joined, config)
    assert got.dtype == torch.float32 and got.shape == (9, 24)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got64 = apply_activation(joined.double(), config)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(got64, _activation_by_hand(joined.double(), config))


@pytest.mark.parametrize("config", PLAIN, ids=lambda c: c.summary())
def test_plain_activation_formulas(config: mf.ActivationConfig) -> None:
    x = _randn(7, 20, seed=38, scale=3.0)
    want = _activation_by_hand(x.double(), config)
    got = apply_activation(x, config)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_activation(x.double(), config), want, rtol=1e-12, atol=1e-12)


def test_gelu_approximations_differ() -> None:
    x = _randn(64, seed=39, scale=2.0)
    exact = apply_activation(x, mf.ActivationConfig(AK.GELU))
    tanh = apply_activation(x, mf.ActivationConfig(AK.GELU, gelu_approximate="tanh"))
    assert not torch.equal(exact, tanh)
    torch.testing.assert_close(exact, tanh, rtol=0, atol=1e-3)


def test_relu2_by_hand() -> None:
    x = torch.tensor([[-2.0, -0.5, 0.0, 0.5, 3.0]])
    assert torch.equal(apply_activation(x, mf.ActivationConfig(AK.RELU2)), torch.tensor([[0, 0, 0, 0.25, 9.0]]))


def test_gpt_oss_clamps_gate_above_only_and_up_both_sides() -> None:
    config = mf.ActivationConfig(AK.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED)  # alpha 1.702, limit 7
    assert (config.alpha, config.limit) == (1.702, 7.0)

    def act(gate: float, up: float) -> float:
        return float(apply_activation(torch.tensor([[gate, up]], dtype=torch.float64), config)[0, 0])

    def formula(gate: float, up: float) -> float:
        return (up + 1) * gate / (1 + math.exp(-1.702 * gate))

    # gate above the limit is clamped to it; below -limit it is not.
    assert act(10.0, 1.0) == pytest.approx(formula(7.0, 1.0), rel=1e-12)
    assert act(-10.0, 1.0) == pytest.approx(formula(-10.0, 1.0), rel=1e-12)
    assert act(-10.0, 1.0) != pytest.approx(formula(-7.0, 1.0), rel=1e-3)
    # up is clamped on both sides.
    assert act(2.0, 10.0) == pytest.approx(formula(2.0, 7.0), rel=1e-12)
    assert act(2.0, -10.0) == pytest.approx(formula(2.0, -7.0), rel=1e-12)
    # Inside the limits: the plain formula, with the + 1 on up.
    assert act(0.5, -0.25) == pytest.approx(formula(0.5, -0.25), rel=1e-12)
    assert act(1.0, -1.0) == 0.0  # (up + 1) = 0


def test_gpt_oss_alpha_and_limit_are_used() -> None:
    gate, up = torch.tensor([[4.0]]), torch.tensor([[5.0]])
    x = torch.cat([gate, up], dim=-1).double()
    config = mf.ActivationConfig(AK.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED, alpha=0.5, limit=3.0)
    want = (3.0 + 1) * 3.0 / (1 + math.exp(-0.5 * 3.0))
    assert float(apply_activation(x, config)) == pytest.approx(want, rel=1e-12)


def test_the_clamped_swiglu_clamps_as_deepseek_v4_and_hy_v4_do() -> None:
    # silu(min(gate, limit)) * clamp(up, -limit, limit): no alpha, no + 1 (GPT-OSS's form has both)
    config = mf.ActivationConfig(AK.CLAMPED_SWIGLU, limit=2.0)
    gate = torch.tensor([-5.0, 0.5, 5.0], dtype=torch.float64)
    up = torch.tensor([-9.0, 1.5, 9.0], dtype=torch.float64)
    got = apply_activation(torch.cat([gate, up]).reshape(1, -1), config)
    want = torch.nn.functional.silu(gate.clamp(max=2.0)) * up.clamp(-2.0, 2.0)
    torch.testing.assert_close(got.reshape(-1), want, rtol=1e-12, atol=0)
    assert float(got[0, 0]) == pytest.approx(-5.0 / (1 + math.exp(5.0)) * -2.0, rel=1e-12)  # the gate unclamped below
    assert "limit=2" in config.summary() and config.gated


def test_the_softcapped_swiglu_is_inkling2s() -> None:
    # cap_g(gate) * sigmoid(gate) * cap_u(up), cap(x) = c tanh(x / c): the sigmoid sees the raw gate
    config = mf.ActivationConfig(AK.SOFTCAPPED_SWIGLU, gate_softcap=4.0, up_softcap=25.0)
    gate = torch.tensor([-30.0, -1.0, 0.0, 0.5, 30.0], dtype=torch.float64)
    up = torch.tensor([-100.0, 2.0, 3.0, -0.25, 100.0], dtype=torch.float64)
    got = apply_activation(torch.cat([gate, up]).reshape(1, -1), config).reshape(-1)
    want = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert abs(float(got[-1])) < 4.0 * 25.0  # both caps bound it
    with pytest.raises(mf.InputError, match="gate_softcap"):
        mf.ActivationConfig(AK.SOFTCAPPED_SWIGLU, gate_softcap=0.0)


def test_interleaved_and_concatenated_read_the_same_gate_and_up() -> None:
    gate, up = _randn(5, 16, seed=40), _randn(5, 16, seed=41)
    for kind in (AK.SWIGLU, AK.GEGLU, AK.GPT_OSS_SWIGLU, AK.CLAMPED_SWIGLU, AK.SOFTCAPPED_SWIGLU):
        concatenated = apply_activation(_join(gate, up, mf.GateUpLayout.CONCATENATED),
                                        mf.ActivationConfig(kind, mf.GateUpLayout.CONCATENATED))
        interleaved = apply_activation(_join(gate, up, mf.GateUpLayout.INTERLEAVED),
                                       mf.ActivationConfig(kind, mf.GateUpLayout.INTERLEAVED))
        # Not bit equality: a strided view and a contiguous tensor can take different vector paths of
        # the CPU's math library (they differ in the last bits on AVX2). A wrong split would be far off.
        torch.testing.assert_close(concatenated, interleaved, rtol=1e-6, atol=1e-6)


def test_activation_config_validation() -> None:
    with pytest.raises(ValueError, match="gelu_approximate"):
        mf.ActivationConfig(AK.GELU, gelu_approximate="erf")
    assert mf.ActivationConfig(AK.SWIGLU).gated and not mf.ActivationConfig(AK.SILU).gated


# -- Activate stage --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", GATED + PLAIN, ids=lambda c: c.summary())
@pytest.mark.parametrize("layout", ["sorted", "padded"])
def test_activate_stage(config: mf.ActivationConfig, layout: str) -> None:
    width = 2 * I if config.gated else I
    w13 = _weights(E, width, H, seed=42) * 3  # spread the pre-activations past the GPT-OSS limit
    b13 = _randn(E, width, seed=43)
    dispatch = mf.SortedDispatch(E) if layout == "sorted" else mf.PaddedDispatch(E)
    gemm = mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, b13)
    stage = mf.Activate(config)
    pipeline = mf.Pipeline([mf.TopK(E, K), dispatch, gemm, stage], _spec(), debug=True)
    spec = pipeline.output_spec
    assert spec.width == I and spec.kind is mf.PayloadKind.EXPERT_HIDDEN and spec.dtype is mf.DType.FP32
    inputs = _inputs(11, seed=44)
    hidden = mf.Pipeline([mf.TopK(E, K), dispatch, gemm], _spec())(inputs)
    out = pipeline(inputs)
    out.check(spec)
    assert type(out) is type(hidden)
    torch.testing.assert_close(out.x.data.double(), _activation_by_hand(hidden.x.data.double(), config),
                               rtol=1e-5, atol=1e-5)
    assert config.kind.value in stage.summary()


@pytest.mark.parametrize("config", GATED[:3] + PLAIN[:1], ids=lambda c: c.summary())
def test_full_layer_with_each_activation_matches_token_loop(config: mf.ActivationConfig) -> None:
    layer = mf.MoELayer(E, K, H, I, activation=config, expert_bias=True, dtype=torch.float32,
                        routing=mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE))
    with torch.no_grad():
        for name in ("w13_bias", "w2_bias"):
            getattr(layer, name).normal_(generator=_gen(45))
    inputs = _inputs(8, seed=46)
    got = layer(inputs.hidden_states, inputs.router_logits)
    want = _token_loop_reference(inputs, layer.routing, layer.w13_weight.detach(), layer.w2_weight.detach(),
                                 config, layer.w13_bias.detach(), layer.w2_bias.detach())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_activate_out_dtype() -> None:
    w13 = _weights(E, 2 * I, H, seed=47)
    stages = [mf.TopK(E, K), mf.SortedDispatch(E), mf.GroupedGemm(mf.GemmRole.GATE_UP, w13),
              mf.Activate(out_dtype=mf.DType.BF16)]
    pipeline = mf.Pipeline(stages, _spec(), debug=True)
    assert pipeline.output_spec.dtype is mf.DType.BF16
    out = pipeline(_inputs(6, seed=48))
    assert out.x.data.dtype == torch.bfloat16
    assert mf.Pipeline(stages[:3] + [mf.Activate()], _spec()).output_spec.dtype is mf.DType.FP32


@pytest.mark.parametrize("kind", [AK.SWIGLU, AK.GEGLU, AK.GPT_OSS_SWIGLU, AK.CLAMPED_SWIGLU, AK.SOFTCAPPED_SWIGLU])
def test_gated_activation_on_odd_width_is_a_contract_error(kind: mf.ActivationKind) -> None:
    odd = mf.GroupedGemm(mf.GemmRole.GATE_UP, _weights(E, 2 * I + 1, H, seed=49))
    with pytest.raises(mf.ContractError) as caught:
        mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), odd, mf.Activate(mf.ActivationConfig(kind))], _spec())
    assert caught.value.field == "width"
    assert caught.value.have == 2 * I + 1
    assert "Activate" in caught.value.consumer and "GroupedGemm" in caught.value.producer
    assert "2 * intermediate" in caught.value.hint


def test_plain_activation_on_odd_width_is_fine() -> None:
    odd = mf.GroupedGemm(mf.GemmRole.GATE_UP, _weights(E, 2 * I + 1, H, seed=50))
    pipeline = mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), odd, mf.Activate(mf.ActivationConfig(AK.SILU))],
                           _spec(), debug=True)
    assert pipeline.output_spec.width == 2 * I + 1
    pipeline(_inputs(5, seed=51))


def test_activate_contract_errors() -> None:
    with pytest.raises(mf.ContractError) as caught:  # straight after the dispatch
        mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), mf.Activate()], _spec())
    assert caught.value.field == "kind"
    w13 = _weights(E, 2 * I, H, seed=52)
    w2 = _weights(E, H, I, seed=53)
    with pytest.raises(mf.ContractError) as caught:  # after the down projection
        mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), mf.GroupedGemm(mf.GemmRole.GATE_UP, w13),
                     mf.Activate(), mf.GroupedGemm(mf.GemmRole.DOWN, w2), mf.Activate()], _spec())
    assert caught.value.field == "kind"
    with pytest.raises(mf.ContractError) as caught:  # on quantized rows
        mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), mf.GroupedGemm(mf.GemmRole.GATE_UP, w13),
                     mf.QuantizeRows(mf.PerTokenQuantizer(FP8)), mf.Activate()], _spec())
    assert caught.value.field == "dtype"


@pytest.mark.parametrize("layout", ["sorted", "padded"])
def test_expert_stages_on_an_empty_batch(layout: str) -> None:
    w13, w2 = _weights(E, 2 * I, H, seed=54), _weights(E, H, I, seed=55)
    dispatch = mf.SortedDispatch(E) if layout == "sorted" else mf.PaddedDispatch(E)
    for quantize in ([], [mf.QuantizeTokens(mf.PerGroupQuantizer())]):
        out_dtype = mf.DType.FP32 if quantize else None
        pipeline = mf.Pipeline(
            [mf.TopK(E, K), *quantize, dispatch, mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, out_dtype=out_dtype),
             mf.Activate(), mf.GroupedGemm(mf.GemmRole.DOWN, w2), mf.Combine()],
            _spec(), debug=True)
        assert pipeline(_inputs(0, seed=56)).hidden_states.shape == (0, H)
