"""Mxfp4Method: MXFP4 weights in GPT-OSS's checkpoint format, float activations, emulated GEMMs.

References: the weights dequantized with :mod:`moeforge.quant.fp4` (tested in test_fp4_formats.py)
through the dense float64 oracle :func:`moeforge.reference.dense_moe`: fp32 layers agree to rel 1e-5.
Against the float layer the weights were quantized from: measured rel 0.19-0.23 over 5 seeds (an MXFP4
rounding alone costs ~0.11, compounded over two GEMMs and the activation); bounded loosely (< 0.35).
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
from moeforge.quant.fp4 import MxScaleRounding, dequantize_mxfp4, quantize_mxfp4
from moeforge.quant.mxfp4 import CHECKPOINT_KEYS, Mxfp4Method
from moeforge.reference import dense_moe
from moeforge.spec import FLOAT_DTYPES
from moeforge.testing import default_settings

E, K, H, I = 4, 2, 64, 32


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _layer(**kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    sizes = kwargs.pop("sizes", (E, K, H, I))
    return mf.MoELayer(*sizes, quant=Mxfp4Method(), backend="torch", environ={}, **kwargs)


def _fill(layer: mf.MoELayer, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n13 = 2 * layer.intermediate_size if layer.activation.gated else layer.intermediate_size
    gen = _gen(seed)
    w13 = torch.randn(layer.num_experts, n13, layer.hidden_size, generator=gen) * layer.hidden_size ** -0.5
    w2 = torch.randn(layer.num_experts, layer.hidden_size, layer.intermediate_size, generator=gen)
    w2 = w2 * layer.intermediate_size ** -0.5
    quant = layer.quant
    assert isinstance(quant, Mxfp4Method)
    quant.quantize_weights(layer, w13, w2)
    with torch.no_grad():
        for name in ("w13_bias", "w2_bias"):
            bias = getattr(layer, name, None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
        assert layer.router is not None
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
        if layer.router.bias is not None:
            layer.router.bias.copy_(torch.randn(layer.router.bias.shape, generator=gen))
    return w13, w2


def _dequantized(layer: mf.MoELayer, prefix: str) -> torch.Tensor:
    blocks = getattr(layer, f"{prefix}_blocks")
    return dequantize_mxfp4(blocks.reshape(*blocks.shape[:2], -1), getattr(layer, f"{prefix}_scales"))


def _reference(layer: mf.MoELayer, x: torch.Tensor, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    if logits is None:
        logits = layer.router_logits(x)
    return dense_moe(x, logits, top_k=layer.top_k, w13=_dequantized(layer, "w13"), w2=_dequantized(layer, "w2"),
                     w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
                     routing=layer.routing, activation=layer.activation)


def _x(tokens: int, seed: int, dtype: torch.dtype = torch.float32, hidden: int = H) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=_gen(seed)).to(dtype)


# -- capabilities, weights ------------------------------------------------------------------------------


def test_capabilities_are_class_data() -> None:
    for name in ("accepts", "accepts_scales", "expert_parameters"):
        assert name in vars(Mxfp4Method)
    assert Mxfp4Method.accepts == FLOAT_DTYPES and Mxfp4Method.accepts_scales == {mf.ScaleLayout.NONE}
    assert Mxfp4Method().required_dispatch_dtype() is None and Mxfp4Method.prefers is None
    assert not Mxfp4Method.offers_fused_ep


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_create_weights_in_gpt_oss_layout(gated: bool, bias: bool) -> None:
    holder = torch.nn.Module()
    Mxfp4Method().create_weights(holder, num_experts=E, hidden_size=H, intermediate_size=I, gated=gated,
                                 bias=bias, dtype=torch.bfloat16, device="cpu")
    n13 = 2 * I if gated else I
    expected = {"w13_blocks": ((E, n13, H // 32, 16), torch.uint8), "w13_scales": ((E, n13, H // 32), torch.uint8),
                "w2_blocks": ((E, H, I // 32, 16), torch.uint8), "w2_scales": ((E, H, I // 32), torch.uint8)}
    if bias:
        expected.update({"w13_bias": ((E, n13), torch.bfloat16), "w2_bias": ((E, H), torch.bfloat16)})
    params = dict(holder.named_parameters())
    assert {name: (tuple(p.shape), p.dtype) for name, p in params.items()} == expected
    assert set(params) <= set(Mxfp4Method.expert_parameters)
    w13 = dequantize_mxfp4(holder.w13_blocks.reshape(E, n13, H // 2), holder.w13_scales)
    assert bool(torch.isfinite(w13).all()) and 0.5 < float(w13.std() * H ** 0.5) < 1.5


@pytest.mark.parametrize("sizes, name", [((E, K, 48, I), "hidden_size"), ((E, K, H, 16), "intermediate_size")])
def test_sizes_must_be_multiples_of_32(sizes: tuple[int, int, int, int], name: str) -> None:
    with pytest.raises(mf.InputError, match=name):
        _layer(sizes=sizes)


def test_quantize_weights() -> None:
    layer = _layer()
    w13, w2 = _fill(layer, seed=1)
    expected = quantize_mxfp4(w13)
    assert torch.equal(layer.w13_blocks.reshape(E, 2 * I, H // 2), expected.data)
    assert torch.equal(layer.w13_scales, expected.scale)
    assert _rel(_dequantized(layer, "w13"), w13) < 0.14 and _rel(_dequantized(layer, "w2"), w2) < 0.14
    quant = layer.quant
    assert isinstance(quant, Mxfp4Method)
    quant.quantize_weights(layer, w13, w2, rounding=MxScaleRounding.CEIL)
    assert torch.equal(layer.w13_scales, quantize_mxfp4(w13, MxScaleRounding.CEIL).scale)
    with pytest.raises(mf.InputError, match="w2 must be"):
        quant.quantize_weights(layer, w13, w2[:, :, :16])


def test_process_weights_after_loading_checks_the_tensors() -> None:
    layer = _layer()
    layer.process_weights_after_loading()
    layer.w2_scales = torch.nn.Parameter(torch.zeros(E, H, 2, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(CheckpointError, match="w2_scales"):
        layer.process_weights_after_loading()
    layer.w13_blocks = torch.nn.Parameter(torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(CheckpointError, match="w13_blocks"):
        layer.process_weights_after_loading()


# -- forward against the reference ------------------------------------------------------------------------


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [mf.ActivationKind.SWIGLU, mf.ActivationKind.GELU])
@torch.no_grad()
def test_forward_matches_the_dequantized_reference(dispatcher: str, bias: bool,
                                                   activation: mf.ActivationKind) -> None:
    layer = _layer(dispatcher=dispatcher, expert_bias=bias, activation=mf.ActivationConfig(activation), debug=True)
    _fill(layer, seed=2)
    assert "mxfp4 weights -> fp32" in layer.describe()
    x = _x(12, 3)
    assert _rel(layer(x), _reference(layer, x)) < 1e-5


@torch.no_grad()
def test_gpt_oss_preset_with_mxfp4_experts() -> None:
    layer = mf.MoELayer.from_preset("gpt_oss", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                    quant=Mxfp4Method(), dtype=torch.float32, backend="torch", environ={})
    _fill(layer, seed=4)
    assert layer.activation.gate_up is mf.GateUpLayout.INTERLEAVED and layer.w13_bias is not None
    x = _x(9, 5)
    assert _rel(layer(x), _reference(layer, x)) < 1e-5


@torch.no_grad()
def test_bf16_layer() -> None:
    layer = _layer(dtype=torch.bfloat16)
    _fill(layer, seed=6)
    x = _x(8, 7, torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and _rel(out, _reference(layer, x)) < 2e-2


@pytest.mark.parametrize("dispatch", ["fp8", "int8"])
def test_quantized_dispatch_is_a_contract_error(dispatch: str) -> None:
    with pytest.raises(mf.ContractError) as info:
        _layer(dispatch_dtype=dispatch)
    assert info.value.field == "dtype" and "Mxfp4Method" in info.value.consumer


def test_the_triton_experts_are_the_mxfp4_kernel() -> None:
    """The triton experts are the one grouped GEMM on the stored blocks (tests/test_triton_fp4_gemm.py
    checks its numbers); without a CUDA device the layer cannot pick them."""
    pytest.importorskip("triton")
    from moeforge.kernels.config import ConfigTable
    from moeforge.kernels.formats import WeightFormat
    from moeforge.stages.triton_quant import FusedQuantGroupedGemm

    layer = _layer()
    stages = selected_stages(Mxfp4Method(), layer, activation=layer.activation, routing_weights_in_epilogue=True,
                                         backend=mf.Backend.TRITON, configs=ConfigTable(E, K))
    assert [type(s) for s in stages] == [FusedQuantGroupedGemm, FusedQuantGroupedGemm]
    assert all(isinstance(s, FusedQuantGroupedGemm) and s.weight_format is WeightFormat.MXFP4 for s in stages)
    assert "mxfp4" in stages[0].summary() and "weights in epilogue" in stages[1].summary()
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            mf.MoELayer(E, K, H, I, quant=Mxfp4Method(), backend="triton", environ={})


@torch.no_grad()
def test_close_to_the_float_layer_it_was_quantized_from() -> None:
    layer = _layer()
    w13, w2 = _fill(layer, seed=8)
    dense = mf.MoELayer(E, K, H, I, dtype=torch.float32, backend="torch", environ={})
    dense.w13_weight.copy_(w13)
    dense.w2_weight.copy_(w2)
    assert dense.router is not None and layer.router is not None
    dense.router.weight.copy_(layer.router.weight)
    x = _x(64, 9)
    assert 0.01 < _rel(layer(x), dense(x)) < 0.35  # measured 0.19 for this seed


@default_settings(max_examples=10)
@given(num_experts=st.integers(1, 4), data=st.data(), tokens=st.sampled_from([0, 1, 2, 5]),
       skew=st.sampled_from(["random", "one_expert"]), dispatcher=st.sampled_from(["sorted", "padded"]),
       seed=st.integers(0, 2**16))
@torch.no_grad()
def test_edge_cases_match_the_reference(num_experts: int, data: st.DataObject, tokens: int, skew: str,
                                        dispatcher: str, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")  # includes top_k == num_experts
    layer = _layer(sizes=(num_experts, top_k, H, I), dispatcher=dispatcher)
    _fill(layer, seed)
    x = _x(tokens, seed + 1)
    logits = torch.randn(tokens, num_experts, generator=_gen(seed + 2))
    if skew == "one_expert":
        logits[:, 0] += 20.0
    out = layer(x, logits)
    assert out.shape == (tokens, H)
    if tokens:
        assert _rel(out, _reference(layer, x, logits)) < 1e-5


# -- GPT-OSS checkpoint tensors ------------------------------------------------------------------------


def _checkpoint(layer: mf.MoELayer) -> dict[str, torch.Tensor]:
    names = {name: key for key, name in CHECKPOINT_KEYS.items()}
    return {names[name]: getattr(layer, name).detach().clone().to(
        torch.bfloat16 if "bias" in name else torch.uint8) for name in names}


@torch.no_grad()
def test_load_checkpoint_experts_reads_gpt_oss_names() -> None:
    source = _layer(expert_bias=True)
    _fill(source, seed=10)
    tensors = _checkpoint(source)
    assert set(tensors) == {"experts.gate_up_proj_blocks", "experts.gate_up_proj_scales",
                            "experts.gate_up_proj_bias",
                            "experts.down_proj_blocks", "experts.down_proj_scales", "experts.down_proj_bias"}
    target = _layer(expert_bias=True)
    assert source.router is not None and target.router is not None
    target.router.weight.copy_(source.router.weight)
    loaded = target.quant.load_checkpoint_experts(target, tensors)
    assert set(loaded) == {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias"}
    assert loaded["w13_bias"].dtype == torch.float32  # bf16 on disk, the layer's dtype here
    for name, value in loaded.items():
        getattr(target, name).copy_(value)
    target.process_weights_after_loading()
    x = _x(6, 11)
    torch.testing.assert_close(target(x), source(x), rtol=2e-2, atol=1e-2)  # the biases went through bf16
    no_bias = _layer()
    assert set(no_bias.quant.load_checkpoint_experts(no_bias, tensors)) == {"w13_blocks", "w13_scales",
                                                                            "w2_blocks", "w2_scales"}


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop("experts.down_proj_scales"), "'experts.down_proj_scales' is missing"),
    (lambda t: t.update({"experts.gate_up_proj_blocks": t["experts.gate_up_proj_blocks"][:, :-1]}),
     "'experts.gate_up_proj_blocks' has shape"),
    (lambda t: t.update({"experts.gate_up_proj_scales": t["experts.gate_up_proj_scales"].float()}),
     "'experts.gate_up_proj_scales' is torch.float32"),
    (lambda t: t.update({"experts.down_proj_bias": t["experts.down_proj_bias"].to(torch.int32)}),
     "'experts.down_proj_bias' is torch.int32"),
])
def test_load_checkpoint_experts_names_the_bad_key(change: Any, match: str) -> None:
    layer = _layer(expert_bias=True)
    tensors = _checkpoint(layer)
    change(tensors)
    with pytest.raises(CheckpointError, match=match):
        layer.quant.load_checkpoint_experts(layer, tensors)


# -- apply_without_routing_weights ---------------------------------------------------------------------


def _dispatched(layer: mf.MoELayer, x: torch.Tensor) -> ExpertRows:
    payload: Any = mf.MoEInput(x, layer.router_logits(x))
    for stage in layer.pipeline.stages:
        payload = stage(payload)
        if mf.StageKind.DISPATCH in stage.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


@pytest.mark.parametrize("dispatcher, group_list_type", [
    (mf.SortedDispatch(E), 1), (mf.SortedDispatch(E, group_list_type=mf.GroupListType.CUMSUM), 0), ("padded", 1)])
@torch.no_grad()
def test_apply_without_routing_weights_equals_the_forward(dispatcher: Any, group_list_type: int) -> None:
    layer = _layer(dispatcher=dispatcher, expert_bias=True)
    _fill(layer, seed=12)
    x = _x(10, 13)
    rows = _dispatched(layer, x)
    if isinstance(rows, SortedRows):
        out = layer.quant.apply_without_routing_weights(layer, rows.x.data, None, group_list_type, rows.group_list,
                                                        torch.float32)
        combined = rows.plan.combine(out, True, None, torch.float32)
    else:
        assert isinstance(rows, PaddedRows)
        out = layer.quant.apply_without_routing_weights(layer, rows.x.data, None, group_list_type, rows.masked_m,
                                                        torch.float32)
        combined = rows.plan.combine(out, True, None, torch.float32)
    torch.testing.assert_close(combined, layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden, scale, group_list, match", [
    (_x(8, 0), torch.ones(8, 1), None, "hidden_states_scale"),
    (torch.zeros(8, H // 2, dtype=torch.uint8), None, None, "hidden_states"),
    (_x(8, 0, hidden=H + 32), None, None, "hidden_states"),
    (_x(8, 0), None, torch.tensor([2, 2, 2, 1]), "group_list"),
    (_x(8, 0), None, torch.full((E + 1,), 2), "group_list"),
])
def test_apply_rejects_bad_arguments(hidden: torch.Tensor, scale: Optional[torch.Tensor],
                                     group_list: Optional[torch.Tensor], match: str) -> None:
    layer = _layer()
    if group_list is None:
        group_list = torch.full((E,), 2, dtype=torch.int64)
    with pytest.raises(mf.InputError, match=match):
        layer.quant.apply_without_routing_weights(layer, hidden, scale, 1, group_list, torch.float32)
