"""ActivateQuantize: the expert activation fused with the quantization of its output."""

from __future__ import annotations

import pytest
import torch

import moeforge as mf
from moeforge.stages.dispatch import SortedPlan
from moeforge.payloads import SortedRows
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.activation import apply_activation
from moeforge.testing import assert_stage_honours_contract

QUANTIZERS = [mf.PerTokenQuantizer(mf.DType.FP8_E4M3), mf.PerGroupQuantizer(), mf.PerTokenQuantizer(mf.DType.INT8)]
ACTIVATIONS = [mf.ActivationConfig(), mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED),
               mf.ActivationConfig(mf.ActivationKind.RELU2)]


def hidden_spec(width: int, layout: mf.Layout = mf.Layout.EXPERT_SORTED,
                dtype: mf.DType = mf.DType.FP32) -> mf.Spec:
    return mf.Spec(mf.PayloadKind.EXPERT_HIDDEN, layout, dtype, width, num_experts=3, top_k=2,
                   group_list_type=mf.GroupListType.COUNT if layout is mf.Layout.EXPERT_SORTED else None,
                   expert_ids=mf.ExpertIds.LOCAL)


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: q.summary())
@pytest.mark.parametrize("config", ACTIVATIONS, ids=lambda c: c.kind.value)
@pytest.mark.parametrize("layout", [mf.Layout.EXPERT_SORTED, mf.Layout.EXPERT_PADDED])
def test_honours_its_contract(quantizer: mf.Quantizer, config: mf.ActivationConfig, layout: mf.Layout) -> None:
    stage = ActivateQuantize(config, quantizer)
    width = 256 if config.gated else 128
    spec = hidden_spec(width, layout, mf.DType.BF16)
    out = stage.output_spec(spec)
    assert (out.width, out.dtype, out.scale_layout) == (128, quantizer.dtype, quantizer.scale_layout)
    assert out.kind is mf.PayloadKind.EXPERT_HIDDEN and out.layout is layout
    assert_stage_honours_contract(stage, spec, max_examples=8)


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: q.summary())
@pytest.mark.parametrize("config", ACTIVATIONS, ids=lambda c: c.kind.value)
def test_equals_the_activation_then_the_quantizer(quantizer: mf.Quantizer, config: mf.ActivationConfig) -> None:
    width = 256 if config.gated else 128
    rows = torch.randn(7, width, generator=torch.Generator().manual_seed(0)).bfloat16()
    rows[2] = 0.0  # an all-zero row quantizes to zeros with a finite scale
    payload = SortedRows(mf.Activations(rows), torch.tensor([3, 0, 4]), mf.GroupListType.COUNT, torch.ones(7),
                         plan=SortedPlan(torch.arange(7).view(7, 1), torch.ones(7, 1)))
    out = ActivateQuantize(config, quantizer)(payload)
    expected = quantizer(apply_activation(rows, config))  # from the fp32 activation, not rounded to bf16
    assert out.x.scale is not None and expected.scale is not None
    assert torch.equal(out.x.data.view(torch.int8), expected.data.view(torch.int8))
    assert torch.equal(out.x.scale, expected.scale)
    assert bool(torch.isfinite(out.x.scale).all()) and bool((out.x.data[2].float() == 0).all())
    assert torch.equal(out.group_list, payload.group_list) and out.plan is payload.plan
    # the dequantized result is the activation within the quantizer's precision
    deq = mf.stages.dequantize(out.x)
    act = apply_activation(rows, config)
    assert float((deq - act).norm() / act.norm()) < (0.05 if quantizer.dtype is mf.DType.FP8_E4M3 else 0.02)


def test_kinds_and_summary() -> None:
    stage = ActivateQuantize(mf.ActivationConfig(), mf.PerGroupQuantizer())
    assert stage.kinds == (mf.StageKind.ACTIVATION, mf.StageKind.QUANTIZE)
    assert stage.summary() == "ActivateQuantize(swiglu, concatenated -> fp8_e4m3/per_group_128)"


def test_rejects_what_it_cannot_take() -> None:
    group = ActivateQuantize(mf.ActivationConfig(), mf.PerGroupQuantizer())
    fields = lambda spec: [m.field for m in group.check(spec)]  # noqa: E731
    assert fields(hidden_spec(256)) == []
    assert fields(hidden_spec(192)) == ["width"]  # 96 activated values: not a multiple of 128
    assert "activation's output" in (group.check(hidden_spec(192))[0].hint or "")
    assert fields(hidden_spec(255)) == ["width"]  # odd: no gate/up halves
    quantized = hidden_spec(256).evolve(dtype=mf.DType.FP8_E4M3, scale_layout=mf.ScaleLayout.PER_TOKEN)
    assert set(fields(quantized)) == {"dtype", "scale_layout"}
    assert "float output" in (group.check(quantized)[0].hint or "")
    dispatched = hidden_spec(256).evolve(kind=mf.PayloadKind.DISPATCHED)
    assert fields(dispatched) == ["kind"]
    plain = ActivateQuantize(mf.ActivationConfig(mf.ActivationKind.SILU), mf.PerGroupQuantizer())
    assert plain.check(hidden_spec(128)) == [] and plain.output_spec(hidden_spec(128)).width == 128


@torch.no_grad()
def test_in_a_pipeline_it_replaces_activate_then_quantize_rows() -> None:
    """In an fp32 pipeline the fused stage equals Activate + QuantizeRows exactly (no rounding between)."""
    w13 = torch.randn(3, 256, 128) * 128**-0.5
    w2 = torch.randn(3, 128, 128) * 128**-0.5
    quantizer = mf.PerGroupQuantizer()
    head = [mf.TopK(3, 2), mf.SortedDispatch(3), mf.GroupedGemm(mf.GemmRole.GATE_UP, w13)]
    tail = [mf.GroupedGemm(mf.GemmRole.DOWN, w2, out_dtype=mf.DType.FP32), mf.Combine()]
    spec = mf.input_spec(128, torch.float32, 3)
    fused = mf.Pipeline(head + [ActivateQuantize(mf.ActivationConfig(), quantizer)] + tail, spec, debug=True)
    unfused = mf.Pipeline(head + [mf.Activate(), mf.QuantizeRows(quantizer)] + tail, spec, debug=True)
    x, logits = torch.randn(9, 128), torch.randn(9, 3)
    assert torch.equal(fused(mf.MoEInput(x, logits)).hidden_states, unfused(mf.MoEInput(x, logits)).hidden_states)
    assert "activation+quantize" in fused.describe()
