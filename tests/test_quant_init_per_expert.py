"""Quantized methods draw a layer's random initial weights one expert at a time: the float weights of a
DeepSeek-V3-size layer would take 45 GB in fp32 at once (an MXFP4 one ran out of memory on an 80 GB H100 that
way). Each method's weight quantizer is wrapped to record the shapes it is called with."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import moeforge as mf
import moeforge.quant.mxfp4 as mxfp4
import moeforge.quant.nvfp4 as nvfp4
import moeforge.quant.w4a4_npu as w4a4_npu

E, K, H, I = 4, 2, 64, 32  # sizes every method here takes (MXFP4 blocks of 32)

METHODS: dict[str, tuple[Any, str, Callable[[], mf.QuantMethod]]] = {
    "mxfp4": (mxfp4, "quantize_mxfp4", mf.Mxfp4Method),
    "nvfp4": (nvfp4, "quantize_nvfp4", mf.Nvfp4Method),
    "w4a4-npu": (w4a4_npu, "quantize_int4", w4a4_npu.W4A4NpuMethod),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_create_weights_quantizes_one_expert_at_a_time(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, quantizer, make = METHODS[name]
    original = getattr(module, quantizer)
    shapes: list[tuple[int, ...]] = []

    def recording(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(module, quantizer, recording)
    mf.MoELayer(E, K, H, I, quant=make(), dtype=torch.bfloat16, backend="torch", environ={})
    assert sorted(set(shapes)) == [(H, I), (2 * I, H)] and len(shapes) == 2 * E


def test_w4a4_quantize_weights_per_expert_equals_the_whole_tensor() -> None:
    """``W4A4NpuMethod.quantize_weights`` quantizes one expert at a time: the same codes and scales as one call
    on the whole tensor (one scale per output channel)."""
    layer = mf.MoELayer(E, K, H, I, quant=w4a4_npu.W4A4NpuMethod(), dtype=torch.bfloat16, backend="torch", environ={})
    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    quant = layer.quant
    assert isinstance(quant, w4a4_npu.W4A4NpuMethod)
    quant.quantize_weights(layer, w13, w2)
    for prefix, weight in (("w13", w13), ("w2", w2)):
        codes, scale = w4a4_npu.quantize_int4(weight)
        assert torch.equal(getattr(layer, f"{prefix}_weight"), w4a4_npu.pack_int4(codes))
        assert torch.equal(getattr(layer, f"{prefix}_weight_scale"), scale.squeeze(-1))
