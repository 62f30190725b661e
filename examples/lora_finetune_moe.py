"""Fine-tune a LoRA adapter on the experts of a Qwen3-MoE layer whose expert weights are frozen int4.

A Qwen3-MoE-shaped layer (``MoELayer.from_preset("qwen3_moe", ...)``, scaled down: 8 experts, 2 per token) has its
expert weights quantized to int4 (W4A16, groups of 32, round to nearest) and carries a rank-4 adapter on both
expert GEMMs (``ExpertAdapter``: ``A [E, r, K]`` drawn, ``B [E, N, r]`` zero). Only the adapter trains: a few AdamW
steps fit a teacher layer's outputs on random tokens. The reference is dense and float: the same layer with the
int4 weights' float values (dequantized) and the same adapter, trained the same way. Both loss curves agree to
fp32 rounding — the int4 GEMMs pass their gradients to their rows through the frozen weights, and the adapter's
update is computed on the same rows, never as a full-size ``B A``.

Run it: ``python examples/lora_finetune_moe.py [--steps N]`` (CPU, no download).
"""

from __future__ import annotations

import argparse

import torch

import moeforge as mf
from moeforge.adapters import ExpertAdapter
from moeforge.quant.w4a16 import int4_experts

SIZES = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
ADAPTER = ExpertAdapter(rank=4, alpha=8)
TOLERANCE = 1e-4  # largest relative difference of the two loss curves, step by step


def layers(seed: int = 0) -> tuple[mf.MoELayer, mf.MoELayer, mf.MoELayer]:
    """``(int4 + adapter, dense float reference + adapter, teacher)``: the reference holds the int4 weights' float
    values, the router and the adapter's initial matrices of the int4 layer."""
    torch.manual_seed(seed)
    float_layer = mf.MoELayer.from_preset("qwen3_moe", **SIZES, backend="torch")
    teacher = mf.MoELayer.from_preset("qwen3_moe", **SIZES, backend="torch")
    quantized = mf.MoELayer.from_preset("qwen3_moe", **SIZES, backend="torch", adapter=ADAPTER,
                                        quant=mf.W4A16Method(group_size=32))
    quantized.quant.quantize_weights(quantized, float_layer.w13_weight.detach(), float_layer.w2_weight.detach())
    with torch.no_grad():
        assert quantized.router is not None and float_layer.router is not None
        quantized.router.weight.copy_(float_layer.router.weight)
    reference = mf.MoELayer.from_preset("qwen3_moe", **SIZES, backend="torch", adapter=ADAPTER)
    state = {name: value for name, value in quantized.state_dict().items() if "lora" in name or "router" in name}
    for index, name in ((2, "w13_weight"), (4, "w2_weight")):  # the int4 GEMMs' weights, decoded to fp32
        stage = quantized.pipeline.stages[index]
        decoded = int4_experts(stage.base.weight())  # type: ignore[attr-defined]
        state[name] = torch.stack([decoded.expert(e) for e in range(SIZES["num_experts"])])
    reference.load_state_dict(state)
    for layer in (quantized, reference):
        for name, param in layer.named_parameters():
            param.requires_grad_("lora" in name)  # the adapter trains; the base, the router stay frozen
    return quantized, reference, teacher


def train(layer: mf.MoELayer, teacher: mf.MoELayer, steps: int) -> list[float]:
    """AdamW on the adapter: fit the teacher's outputs on fixed random tokens; the loss of each step."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, SIZES["hidden_size"], generator=gen)
    with torch.no_grad():
        target = teacher(x)
    optimizer = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main(steps: int = 8) -> None:
    quantized, reference, teacher = layers()
    print(next(line for line in quantized.describe().splitlines() if "gate_up" in line))
    ours, dense = train(quantized, teacher, steps), train(reference, teacher, steps)
    for step, (a, b) in enumerate(zip(ours, dense)):
        print(f"step {step}: int4 + adapter {a:.6f}   dense float + adapter {b:.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, dense))
    assert worst < TOLERANCE, f"the loss curves differ by {worst:.2e} (relative)"
    assert ours[-1] < ours[0], "the adapter did not lower the loss"
    assert quantized.w13_lora_b.abs().sum() > 0 and all(
        param.grad is None for name, param in quantized.named_parameters() if "lora" not in name)
    print(f"the loss curves agree (largest relative difference {worst:.1e}); the int4 weights stayed frozen")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    main(parser.parse_args().steps)
