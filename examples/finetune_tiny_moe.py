"""Fine-tune a Hugging Face Qwen3-MoE causal LM whose experts run on moeforge.

``moeforge.hf_experts.register()`` makes ``"moeforge"`` an experts implementation of ``transformers``;
a model built (or loaded with ``from_pretrained``) with ``experts_implementation="moeforge"`` then runs
its experts through a moeforge pipeline — on the CPU the torch reference stages, which autograd
differentiates — while ``transformers`` keeps its router, attention and loss.

A tiny random ``Qwen3MoeForCausalLM`` (built from a config in code, no download) takes a few AdamW steps
on a synthetic, learnable task: sequences that count up by a per-sequence stride, modulo the vocabulary.
The same steps from the same initial weights with ``transformers``' eager experts give the same loss
curve (within fp32 rounding, which the optimizer carries from step to step).

Run it: ``python examples/finetune_tiny_moe.py [--steps N]`` (needs ``transformers`` >= 5.17).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from moeforge import hf_experts

VOCAB = 128
TOLERANCE = 1e-4  # largest relative difference of the two loss curves, step by step


def build_model(experts_implementation: str, seed: int = 0) -> Any:
    """A tiny random Qwen3-MoE (Qwen3-30B-A3B's shape, scaled down: 8 experts, 2 per token)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        experts_implementation=experts_implementation)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # every parameter random (transformers leaves the expert weights uninitialised)
        for param in model.parameters():
            param.normal_(std=0.1)
    return model.train()


def batches(steps: int, batch: int = 8, length: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` batches of sequences ``start, start + stride, start + 2 * stride, ...`` (mod the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(3, VOCAB, (batch, 1), generator=generator)
        stride = torch.randint(1, 4, (batch, 1), generator=generator)
        out.append((start + stride * torch.arange(length)) % VOCAB)
    return out


def finetune(experts_implementation: str, steps: int, seed: int = 0) -> list[float]:
    """The loss at each of ``steps`` AdamW steps of a fresh model with ``experts_implementation``."""
    model = build_model(experts_implementation, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids in batches(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    if experts_implementation == "moeforge":  # every experts module of the model ran through moeforge
        function = hf_experts.registered_function()
        assert function is not None
        experts = [layer.mlp.experts for layer in model.model.layers]
        assert all(function.pipelines_for(module) for module in experts)
    return losses


def main(argv: Optional[list[str]] = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)

    function = hf_experts.register()  # explicit; a second call changes nothing
    experts = build_model("moeforge").model.layers[0].mlp.experts
    print(function.pipeline(experts, torch.empty(0, 64), top_k=2).describe())

    curves = {name: finetune(name, args.steps) for name in ("eager", "moeforge")}
    print(f"\n{'step':>4}  {'eager':>10}  {'moeforge':>10}  {'rel. diff':>9}")
    worst = 0.0
    for step, (eager, ours) in enumerate(zip(curves["eager"], curves["moeforge"])):
        difference = abs(ours - eager) / abs(eager)
        worst = max(worst, difference)
        print(f"{step:>4}  {eager:>10.6f}  {ours:>10.6f}  {difference:>9.1e}")
    first, last = curves["moeforge"][0], curves["moeforge"][-1]
    print(f"\nthe loss went from {first:.4f} to {last:.4f}; largest relative difference to eager: {worst:.1e}")
    if worst > TOLERANCE or not last < first:
        raise SystemExit("the moeforge loss curve does not follow the eager one")
    print("the loss curves agree")
    return curves


if __name__ == "__main__":
    main()
