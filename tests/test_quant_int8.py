"""INT8 W8A8 (torch reference): per-channel INT8 weights, per-token INT8 activations.

Oracles as in ``tests/test_quant_fp8.py`` (whose helpers this module imports): the independent
float64 reference (measured rel L2 <= 5.5e-7 for fp32 layers, <= 1.7e-3 for bf16 layers — the
output's own bf16 rounding — plus rare rounding flips of the quantized intermediate, hence the
bounds 5e-3 / 1e-2), and the unquantized float layer (quantization error: measured rel L2
0.020-0.021, checked against 0.03).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.payloads import SortedRows
from moeforge.quant.int8 import Int8W8A8Method
from moeforge.quant.w8a8 import W8A8GroupedGemm, W8A8Method, dequantize_weight, quantize_weight_per_channel
from moeforge.reference import layer_reference
from moeforge.stages.activate_quantize import ActivateQuantize
from test_quant_fp8 import (  # noqa: E402  (the tests directory is on sys.path)
    assert_matches_reference,
    combine,
    dispatched,
    inputs,
    quantized_pair,
    rel,
    stage,
)


def test_capabilities_are_class_data() -> None:
    assert "accepts" in vars(Int8W8A8Method) and "accepts_scales" in vars(Int8W8A8Method)
    assert Int8W8A8Method.accepts == frozenset({mf.DType.BF16, mf.DType.FP16, mf.DType.FP32, mf.DType.INT8})
    assert Int8W8A8Method.accepts_scales == frozenset({mf.ScaleLayout.NONE, mf.ScaleLayout.PER_TOKEN})
    assert Int8W8A8Method.prefers is mf.DispatchDtype.INT8
    assert "w13_weight_scale" in Int8W8A8Method.expert_parameters
    method = Int8W8A8Method()
    assert method.name == "Int8W8A8Method" and method == Int8W8A8Method()
    assert not method.block_weights and method.activation_quantizer == mf.PerTokenQuantizer(mf.DType.INT8)


@pytest.mark.parametrize("gated", [True, False])
def test_create_weights(gated: bool) -> None:
    holder = torch.nn.Module()
    Int8W8A8Method().create_weights(holder, num_experts=3, hidden_size=64, intermediate_size=40, gated=gated,
                                    bias=True, dtype=torch.float16, device="cpu")
    n13 = 80 if gated else 40
    assert holder.w13_weight.shape == (3, n13, 64) and holder.w13_weight.dtype == torch.int8
    assert holder.w2_weight.shape == (3, 64, 40) and holder.w2_weight.dtype == torch.int8
    assert holder.w13_weight_scale.shape == (3, n13) and holder.w2_weight_scale.shape == (3, 64)
    assert holder.w2_bias.shape == (3, 64) and holder.w2_bias.dtype == torch.float16
    assert int(holder.w13_weight.abs().max()) == 127  # every row's amax maps to 127


def test_weight_quantization_is_round_to_nearest() -> None:
    w = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_weight_per_channel(w, mf.DType.INT8)
    torch.testing.assert_close(scale, w.abs().amax(-1) / 127.0)
    assert bool((q.abs() <= 127).all())
    # within half a step of each row's scale
    assert bool(((dequantize_weight(q, scale) - w).abs() <= scale.unsqueeze(-1) * 0.5 + 1e-7).all())


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("dispatch", ["auto", "fp32"])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_matches_the_reference(dispatcher: str, dispatch: str, bias: bool) -> None:
    float_layer, layer = quantized_pair(Int8W8A8Method(), hidden=256, dispatcher=dispatcher,
                                        dispatch_dtype=dispatch, expert_bias=bias, debug=True)
    x, logits = inputs(24, 256, 4)
    assert_matches_reference(layer, x, logits)
    with torch.no_grad():
        assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.03  # measured 0.020


def test_bf16_layer_and_rule_6() -> None:
    float_layer, layer = quantized_pair(Int8W8A8Method(), dtype=torch.bfloat16)
    assert layer.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.INT8, mf.DispatchRule.LIBRARY_DEFAULT,
                                                          preferred=True)
    text = layer.describe()
    assert "dispatch int8 (rule 6: library default, the quant method's preference)" in text
    assert "QuantizeTokens(int8/per_token)" in text and "ActivateQuantize(swiglu, concatenated -> int8/per_token)" in text
    x, logits = inputs(32, 128, 4, torch.bfloat16)
    assert_matches_reference(layer, x, logits)
    with torch.no_grad():
        assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.03


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
def test_quantizing_before_or_after_the_dispatch_gives_the_same_output(dispatcher: str) -> None:
    _, before = quantized_pair(Int8W8A8Method(), dispatcher=dispatcher)
    _, after = quantized_pair(Int8W8A8Method(), dispatcher=dispatcher, dispatch_dtype="fp32")
    assert isinstance(stage(before, mf.StageKind.QUANTIZE), mf.QuantizeTokens)
    assert isinstance(stage(after, mf.StageKind.QUANTIZE), mf.QuantizeRows)
    x, logits = inputs(20, 128, 4)
    with torch.no_grad():
        assert torch.equal(before(x, logits), after(x, logits))


@pytest.mark.parametrize("case", ["empty", "one_token", "one_expert", "top_k_all"])
def test_edge_cases(case: str) -> None:
    top_k = {"top_k_all": 4, "one_expert": 1}.get(case, 2)
    _, layer = quantized_pair(Int8W8A8Method(), top_k=top_k, debug=True)
    x, logits = inputs({"empty": 0, "one_token": 1}.get(case, 9), 128, 4)
    if case == "one_expert":
        logits[:, 3] += 50.0
    assert_matches_reference(layer, x, logits)


@settings(max_examples=10, deadline=None)
@given(num_experts=st.integers(1, 8), data=st.data(), hidden=st.sampled_from([64, 128]),
       inter=st.sampled_from([32, 128]), tokens=st.integers(0, 10), dispatcher=st.sampled_from(["sorted", "padded"]),
       dispatch=st.sampled_from(["auto", "fp32"]), seed=st.integers(0, 2**16))
def test_layer_matches_the_reference_on_random_shapes(num_experts: int, data: st.DataObject, hidden: int,
                                                      inter: int, tokens: int, dispatcher: str, dispatch: str,
                                                      seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    _, layer = quantized_pair(Int8W8A8Method(), num_experts=num_experts, top_k=top_k, hidden=hidden, inter=inter,
                              dispatcher=dispatcher, dispatch_dtype=dispatch, seed=seed)
    assert_matches_reference(layer, *inputs(tokens, hidden, num_experts, seed=seed + 1))


def test_stages_and_contracts() -> None:
    method = Int8W8A8Method()
    _, layer = quantized_pair(method)
    kinds = [type(s) for s in layer.pipeline.stages]
    assert kinds[-4:-1] == [W8A8GroupedGemm, ActivateQuantize, W8A8GroupedGemm]
    with pytest.raises(mf.ContractError) as info:
        layer.replace_stage("QuantizeTokens", mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.FP8_E4M3)))
    assert info.value.field == "dtype" and info.value.want == {mf.DType.INT8}
    with pytest.raises(mf.ContractError, match="rule 1"):
        mf.MoELayer(4, 2, 128, 128, quant=method, dispatch_dtype="fp8", environ={})
    with pytest.raises(mf.ContractError):
        method.quantize_stage(mf.DispatchDtype.FP8, mf.DType.BF16)
    from moeforge.kernels.config import ConfigTable

    triton = selected_stages(method, layer, activation=mf.ActivationConfig(), routing_weights_in_epilogue=False,
                                  backend=mf.Backend.TRITON, configs=ConfigTable(4, 2),
                                  dispatch=mf.DispatchDtype.INT8)
    assert [type(stage).__name__ for stage in triton] == ["FusedQuantGroupedGemm", "FusedQuantGroupedGemm"]


def test_a_device_without_int8_dispatch_quantizes_after() -> None:
    decision = mf.resolve_dispatch_dtype(
        "auto", experts_accept=Int8W8A8Method.accepts, quant_prefers=Int8W8A8Method.prefers,
        device=mf.DeviceDispatchSupport(fp8=True, int8=False), environ={})
    assert decision.dtype is mf.DispatchDtype.BF16


@pytest.mark.parametrize("group_list_type", [0, 1])
@torch.no_grad()
def test_apply_without_routing_weights_equals_the_forward(group_list_type: int) -> None:
    choice: Any = mf.SortedDispatch(4, group_list_type=mf.GroupListType(group_list_type))
    _, layer = quantized_pair(Int8W8A8Method(), dispatcher=choice)
    x, logits = inputs(16, 128, 4)
    rows = dispatched(layer, x, logits)
    assert isinstance(rows, SortedRows) and rows.x.data.dtype == torch.int8
    out = layer.quant.apply_without_routing_weights(layer, rows.x.data, rows.x.scale, group_list_type,
                                                    rows.group_list, torch.float32)
    torch.testing.assert_close(combine(layer, rows, out), layer(x, logits), rtol=1e-6, atol=1e-6)
    row_token = torch.empty(rows.row_weights.shape[0], dtype=torch.int64)
    row_token[rows.plan.token_rows.reshape(-1)] = torch.arange(row_token.numel()) // rows.plan.token_rows.shape[1]
    from_float = layer.quant.apply_without_routing_weights(layer, x[row_token], None, group_list_type,
                                                           rows.group_list, torch.float32)
    assert torch.equal(out, from_float)
    with pytest.raises(mf.InputError, match="int8"):
        layer.quant.apply_without_routing_weights(layer, rows.x.data.to(torch.float8_e4m3fn), rows.x.scale,
                                                  group_list_type, rows.group_list, torch.float32)


def test_an_int8_layer_is_a_w8a8_method() -> None:
    assert issubclass(Int8W8A8Method, W8A8Method) and issubclass(Int8W8A8Method, mf.QuantMethod)
