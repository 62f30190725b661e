"""Patch a Hugging Face Qwen3-MoE causal LM so that its MoE blocks run on moeforge.

A tiny ``Qwen3MoeForCausalLM`` is built from a config in code (no download) with every parameter
random — ``transformers`` leaves the expert weights uninitialised — and one dense layer
(``mlp_only_layers``) that must stay as it is. ``moeforge.hf.patch_model`` replaces each
``Qwen3MoeSparseMoeBlock`` in place; the logits and the greedily generated tokens (with a KV cache)
are the same as before, and the report says what was replaced.

Run it: ``python examples/hf_patch_qwen3.py`` (needs ``transformers``).
"""

from __future__ import annotations

import torch

from moeforge.hf import PatchReport, patch_model


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.1)
    return model


def main() -> PatchReport:
    model = build_model()
    prompt = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(prompt, attention_mask=mask).logits
        tokens = model.generate(prompt, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, use_cache=True, pad_token_id=0)
        return logits, tokens

    logits_before, tokens_before = run()
    report = patch_model(model)
    print(report)
    logits_after, tokens_after = run()

    rel = float((logits_after - logits_before).norm() / logits_before.norm())
    same_tokens = torch.equal(tokens_after, tokens_before)
    print(f"logits: relative difference {rel:.2e} (fp32)")
    print(f"generated tokens: {'the same' if same_tokens else 'DIFFERENT'}: {tokens_after[:, prompt.shape[1]:].tolist()}")
    if rel > 1e-5 or not same_tokens:
        raise SystemExit("the patched model does not match the original")
    print("the patched model matches the original")
    return report


if __name__ == "__main__":
    main()
