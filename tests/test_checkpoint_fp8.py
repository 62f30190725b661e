"""FP8 (and INT8) expert checkpoints through ``QuantMethod.load_checkpoint_experts``.

The checkpoints are built here with the test's own quantizer (one scale per 128 x 128 tile as
DeepSeek-V3's ``weight_scale_inv``, per channel as compressed-tensors / vLLM's ``weight_scale``), so
the hook is checked against tensors it did not produce.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.checkpoint import load_weights
from moeforge.errors import CheckpointError
from moeforge.quant.fp8 import Fp8W8A8Method
from moeforge.quant.int8 import Int8W8A8Method
from moeforge.quant.w8a8 import W8A8Method
from moeforge.reference import layer_reference
from test_quant_fp8 import assert_matches_reference, inputs, rel  # noqa: E402

E, H, I = 3, 256, 128
FP8 = torch.float8_e4m3fn


def tile_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> fp8 ``[N, K]`` and ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, tile by tile."""
    rows, cols = w.shape
    scales = torch.empty(-(-rows // 128), -(-cols // 128))
    q = torch.empty(rows, cols, dtype=FP8)
    for b in range(scales.shape[0]):
        for c in range(scales.shape[1]):
            tile = w[b * 128 : (b + 1) * 128, c * 128 : (c + 1) * 128]
            scales[b, c] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[b * 128 : (b + 1) * 128, c * 128 : (c + 1) * 128] = (tile / scales[b, c]).to(FP8)
    return q, scales


def channel_quantize(w: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``[N, K]`` and ``weight_scale [N, 1]``."""
    qmax = 448.0 if dtype == FP8 else 127.0
    scale = w.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    scaled = w / scale
    return (scaled.to(FP8) if dtype == FP8 else scaled.round().to(torch.int8)), scale


def float_experts(seed: int = 0, gated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = 2 * I if gated else I
    return torch.randn(E, gate_up, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5


def checkpoint(w13: torch.Tensor, w2: torch.Tensor, layout: str = "block", gated: bool = True,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
               dtype: torch.dtype = FP8) -> dict[str, torch.Tensor]:
    """Per-expert quantized tensors; ``layout``: ``block`` (weight_scale_inv), ``channel`` ([N, 1]),
    ``channel_flat`` ([N]) or ``tensor`` (a 0-d weight_scale, as per-tensor fp8 checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    gate_name, up_name, down_name = names
    for i in range(w13.shape[0]):
        parts = {down_name: w2[i]}
        if gated:
            parts[gate_name], parts[up_name] = w13[i, :I], w13[i, I:]
        else:
            parts[up_name] = w13[i]
        for proj, weight in parts.items():
            base = f"experts.{i}.{proj}"
            if layout == "block":
                out[f"{base}.weight"], out[f"{base}.weight_scale_inv"] = tile_quantize(weight)
            elif layout == "tensor":
                scale = weight.abs().max() / (448.0 if dtype == FP8 else 127.0)
                scaled = weight / scale
                out[f"{base}.weight"] = scaled.to(FP8) if dtype == FP8 else scaled.round().to(torch.int8)
                out[f"{base}.weight_scale"] = scale.reshape(())
            else:
                q, scale = channel_quantize(weight, dtype)
                out[f"{base}.weight"] = q
                out[f"{base}.weight_scale"] = scale if layout == "channel" else scale.reshape(-1)
            out[f"{base}.input_scale"] = torch.ones(())  # static activation scales: not read (dynamic here)
    return out


def layer_for(method: W8A8Method, gated: bool = True, **kwargs: Any) -> mf.MoELayer:
    activation = kwargs.pop("activation", mf.ActivationConfig() if gated else mf.ActivationConfig(mf.ActivationKind.RELU2))
    return mf.MoELayer(E, 2, H, I, quant=method, activation=activation, dtype=torch.float32, environ={}, **kwargs)


class CountingMapping(Mapping[str, torch.Tensor]):
    """A lazily read checkpoint: records which tensors were loaded."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.read = tensors, set()  # type: ignore[var-annotated]

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def copy_into(layer: mf.MoELayer, tensors: dict[str, torch.Tensor]) -> None:
    """What ``load_weights`` does with the hook's result once every check passed."""
    with torch.no_grad():
        for name, value in tensors.items():
            target = getattr(layer, name)
            assert value.shape == target.shape and value.dtype == target.dtype, name
            target.copy_(value)
    layer.process_weights_after_loading()


# -- DeepSeek-V3 block-scaled FP8 ---------------------------------------------------------------------


@torch.no_grad()
def test_deepseek_v3_block_checkpoint() -> None:
    w13, w2 = float_experts()
    tensors = checkpoint(w13, w2, "block")
    layer = layer_for(Fp8W8A8Method("block", "group"))
    before = {name: getattr(layer, name).clone() for name in ("w13_weight", "w13_weight_scale")}
    lazy = CountingMapping(tensors)
    loaded = layer.quant.load_checkpoint_experts(layer, lazy)
    # nothing was copied into the layer by the hook, and static input scales were not read
    assert all(torch.equal(getattr(layer, name).view(torch.uint8) if name == "w13_weight" else getattr(layer, name),
                           value.view(torch.uint8) if name == "w13_weight" else value) for name, value in before.items())
    assert not any(key.endswith("input_scale") for key in lazy.read)
    assert set(loaded) == {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}
    assert loaded["w13_weight_scale"].shape == (E, 2, 2) and loaded["w2_weight_scale"].shape == (E, 2, 1)
    for i in range(E):
        gate, up = tensors[f"experts.{i}.gate_proj.weight"], tensors[f"experts.{i}.up_proj.weight"]
        assert torch.equal(loaded["w13_weight"][i].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
        assert torch.equal(loaded["w13_weight_scale"][i], torch.cat([tensors[f"experts.{i}.gate_proj.weight_scale_inv"],
                                                                    tensors[f"experts.{i}.up_proj.weight_scale_inv"]]))
        assert torch.equal(loaded["w2_weight_scale"][i], tensors[f"experts.{i}.down_proj.weight_scale_inv"])
    copy_into(layer, loaded)
    x, logits = inputs(12, H, E)
    assert_matches_reference(layer, x, logits)
    float_layer = mf.MoELayer(E, 2, H, I, dtype=torch.float32, environ={})
    float_layer.w13_weight.copy_(w13)
    float_layer.w2_weight.copy_(w2)
    assert rel(layer(x, logits), layer_reference(float_layer, x, logits)) < 0.09  # measured ~0.06


@pytest.mark.parametrize("layout", ["channel", "channel_flat", "tensor"])
@pytest.mark.parametrize("weights", ["channel", "block"])
@torch.no_grad()
def test_per_channel_and_per_tensor_checkpoints(layout: str, weights: str) -> None:
    w13, w2 = float_experts(1)
    tensors = checkpoint(w13, w2, layout)
    layer = layer_for(Fp8W8A8Method(weights, "token"))
    if layout != "tensor" and weights == "block":
        with pytest.raises(CheckpointError, match="per-channel scales, use weight_scales='channel'"):
            layer.quant.load_checkpoint_experts(layer, tensors)
        return
    loaded = layer.quant.load_checkpoint_experts(layer, tensors)
    copy_into(layer, loaded)
    # the layer's dequantized weights are the checkpoint's, exactly
    for i in range(E):
        for proj, rows, weight, scale_name in (("gate_proj", slice(0, I), "w13_weight", "w13_weight_scale"),
                                               ("up_proj", slice(I, 2 * I), "w13_weight", "w13_weight_scale"),
                                               ("down_proj", slice(0, H), "w2_weight", "w2_weight_scale")):
            base = f"experts.{i}.{proj}"
            expected = tensors[f"{base}.weight"].float() * tensors[f"{base}.weight_scale"].reshape(-1, 1)
            got = _dequantized(getattr(layer, weight)[i], getattr(layer, scale_name)[i])[rows]
            assert torch.equal(got, expected)
    assert_matches_reference(layer, *inputs(10, H, E))


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from moeforge.quant.w8a8 import dequantize_weight

    return dequantize_weight(q, scale)


@torch.no_grad()
def test_interleaved_gate_up_and_w1_w3_w2_naming() -> None:
    w13, w2 = float_experts(2)
    tensors = checkpoint(w13, w2, "channel", names=("w1", "w3", "w2"))
    activation = mf.ActivationConfig(mf.ActivationKind.SWIGLU, mf.GateUpLayout.INTERLEAVED)
    layer = layer_for(Fp8W8A8Method(), activation=activation)
    loaded = layer.quant.load_checkpoint_experts(layer, tensors)
    for i in range(E):
        assert torch.equal(loaded["w13_weight"][i, 0::2].view(torch.uint8), tensors[f"experts.{i}.w1.weight"].view(torch.uint8))
        assert torch.equal(loaded["w13_weight"][i, 1::2].view(torch.uint8), tensors[f"experts.{i}.w3.weight"].view(torch.uint8))
        assert torch.equal(loaded["w13_weight_scale"][i, 1::2], tensors[f"experts.{i}.w3.weight_scale"].reshape(-1))
    copy_into(layer, loaded)
    assert_matches_reference(layer, *inputs(10, H, E))
    with pytest.raises(CheckpointError, match="interleaved"):
        blocky = layer_for(Fp8W8A8Method("block"), activation=activation)
        blocky.quant.load_checkpoint_experts(blocky, checkpoint(w13, w2, "block"))


@torch.no_grad()
def test_plain_activation_reads_up_and_down_only() -> None:
    w13, w2 = float_experts(3, gated=False)
    tensors = checkpoint(w13, w2, "block", gated=False)
    layer = layer_for(Fp8W8A8Method("block", "group"), gated=False)
    copy_into(layer, layer.quant.load_checkpoint_experts(layer, tensors))
    assert_matches_reference(layer, *inputs(10, H, E))
    with pytest.raises(CheckpointError, match="not gated"):
        layer.quant.load_checkpoint_experts(layer, checkpoint(w13, w2, "channel", gated=False, names=("w1", "w3", "w2")))


@pytest.mark.parametrize("layout", ["channel", "tensor"])
@torch.no_grad()
def test_int8_channel_checkpoint(layout: str) -> None:
    w13, w2 = float_experts(4)
    tensors = checkpoint(w13, w2, layout, dtype=torch.int8)
    layer = layer_for(Int8W8A8Method())
    loaded = layer.quant.load_checkpoint_experts(layer, tensors)
    assert loaded["w13_weight"].dtype == torch.int8
    copy_into(layer, loaded)
    assert_matches_reference(layer, *inputs(10, H, E))
    with pytest.raises(CheckpointError, match="torch.int8"):
        layer.quant.load_checkpoint_experts(layer, checkpoint(w13, w2, "channel"))  # fp8 into int8


@pytest.mark.parametrize("interleaved", [False, True])
@torch.no_grad()
def test_expert_biases_are_read(interleaved: bool) -> None:
    """A layer with expert biases reads ``bias`` beside each projection's weight (before, they kept
    their initial zeros and nothing said so)."""
    w13, w2 = float_experts(7)
    tensors = checkpoint(w13, w2, "channel")
    gen = torch.Generator().manual_seed(7)
    for i in range(E):
        for proj, rows in (("gate_proj", I), ("up_proj", I), ("down_proj", H)):
            tensors[f"experts.{i}.{proj}.bias"] = torch.randn(rows, generator=gen)
    layout = mf.GateUpLayout.INTERLEAVED if interleaved else mf.GateUpLayout.CONCATENATED
    layer = layer_for(Fp8W8A8Method(), expert_bias=True, activation=mf.ActivationConfig(gate_up=layout))
    loaded = layer.quant.load_checkpoint_experts(layer, tensors)
    for i in range(E):
        gate, up = tensors[f"experts.{i}.gate_proj.bias"], tensors[f"experts.{i}.up_proj.bias"]
        want = torch.stack([gate, up], dim=1).flatten() if interleaved else torch.cat([gate, up])
        assert torch.equal(loaded["w13_bias"][i], want)
        assert torch.equal(loaded["w2_bias"][i], tensors[f"experts.{i}.down_proj.bias"])
    copy_into(layer, loaded)
    assert_matches_reference(layer, *inputs(10, H, E))
    del tensors["experts.2.down_proj.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'experts\.2\.down_proj\.bias'"):
        layer.quant.load_checkpoint_experts(layer, tensors)


# -- errors name the key -------------------------------------------------------------------------------


def _broken(change: str) -> tuple[W8A8Method, dict[str, torch.Tensor]]:
    w13, w2 = float_experts(5)
    method: W8A8Method = Fp8W8A8Method("block", "group")
    tensors = checkpoint(w13, w2, "block")
    if change == "missing weight":
        del tensors["experts.2.down_proj.weight"]
    elif change == "missing scale":
        del tensors["experts.1.up_proj.weight_scale_inv"]
    elif change == "weight shape":
        tensors["experts.0.gate_proj.weight"] = tensors["experts.0.gate_proj.weight"][:64]
    elif change == "scale shape":
        tensors["experts.1.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    elif change == "bf16 weight":
        tensors["experts.0.up_proj.weight"] = tensors["experts.0.up_proj.weight"].bfloat16()
    elif change == "two scales":
        tensors["experts.2.gate_proj.weight_scale"] = tensors["experts.2.gate_proj.weight_scale_inv"]
    elif change == "block into channel":
        method = Fp8W8A8Method("channel")
    elif change == "int scale":
        tensors["experts.0.gate_proj.weight_scale_inv"] = torch.ones(1, 2, dtype=torch.int32)
    elif change == "mixed naming":
        tensors["experts.0.w1.weight"] = tensors["experts.0.gate_proj.weight"]
    elif change == "nothing":
        tensors = {"gate.weight": torch.zeros(E, H)}
    return method, tensors


@pytest.mark.parametrize("change, match", [
    ("missing weight", r"missing tensor 'experts\.2\.down_proj\.weight'"),
    ("missing scale", r"missing tensor 'experts\.1\.up_proj\.weight_scale_inv'"),
    ("weight shape", r"'experts\.0\.gate_proj\.weight' has shape \(64, 256\), expected \(128, 256\)"),
    ("scale shape", r"'experts\.1\.down_proj\.weight_scale_inv' has shape \(2, 2\), expected \(2, 1\)"),
    ("bf16 weight", r"'experts\.0\.up_proj\.weight' is torch\.bfloat16"),
    ("two scales", r"both 'experts\.2\.gate_proj\.weight_scale_inv' and 'experts\.2\.gate_proj\.weight_scale'"),
    ("block into channel", r"'experts\.0\.up_proj\.weight_scale_inv' has shape \(1, 2\).*weight_scales='block'"),
    ("int scale", r"'experts\.0\.gate_proj\.weight_scale_inv' is torch\.int32"),
    ("mixed naming", "mix"),
    ("nothing", r"missing tensor 'experts\.0\.up_proj\.weight'"),
])
def test_errors_name_the_key(change: str, match: str) -> None:
    method, tensors = _broken(change)
    layer = layer_for(method)
    before = layer.w2_weight.clone().view(torch.uint8)
    with pytest.raises(CheckpointError, match=match):
        layer.quant.load_checkpoint_experts(layer, tensors)
    assert torch.equal(layer.w2_weight.view(torch.uint8), before)


# -- through moeforge.checkpoint.load_weights ------------------------------------------------------------


@torch.no_grad()
def test_load_weights_delegates_the_experts() -> None:
    """Runs once ``load_weights`` hands quantized experts to ``layer.quant.load_checkpoint_experts``."""
    w13, w2 = float_experts(6)
    layer = mf.MoELayer.from_preset("deepseek_v3", num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                                    n_group=1, quant=Fp8W8A8Method("block", "group"), dtype=torch.float32,
                                    environ={})
    assert layer.shared_experts is not None
    tensors = {f"model.layers.3.mlp.{key}": value for key, value in checkpoint(w13, w2, "block").items()}
    router = torch.randn(E, H)
    tensors["model.layers.3.mlp.gate.weight"] = router
    tensors["model.layers.3.mlp.gate.e_score_correction_bias"] = torch.randn(E)
    shared = {name: torch.randn(I, H) if name != "down_proj" else torch.randn(H, I)
              for name in ("gate_proj", "up_proj", "down_proj")}
    for name, value in shared.items():
        tensors[f"model.layers.3.mlp.shared_experts.{name}.weight"] = value
    # a bad shared-expert shape fails before anything is copied, experts included
    bad = dict(tensors, **{"model.layers.3.mlp.shared_experts.down_proj.weight": torch.randn(H, I + 1)})
    before = layer.w13_weight.clone().view(torch.uint8)
    with pytest.raises(CheckpointError):
        _delegates_prefixed(layer, bad)
    assert torch.equal(layer.w13_weight.view(torch.uint8), before)
    report = _delegates_prefixed(layer, tensors)
    assert "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv" in report.loaded
    assert all(key.endswith("input_scale") for key in report.unused)
    assert torch.equal(layer.router.weight, router)
    expected = torch.cat([tensors["model.layers.3.mlp.experts.1.gate_proj.weight"],
                          tensors["model.layers.3.mlp.experts.1.up_proj.weight"]])
    assert torch.equal(layer.w13_weight[1].view(torch.uint8), expected.view(torch.uint8))


def _delegates_prefixed(layer: mf.MoELayer, tensors: dict[str, torch.Tensor]) -> Any:
    return load_weights(layer, tensors, prefix="model.layers.3.mlp.", on_unused="ignore")
