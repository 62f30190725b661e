"""OLMoE: softmax (fp32) over all experts -> top-k -> renormalise iff ``norm_topk_prob`` (``False`` for
the released OLMoE checkpoints); SwiGLU with gate/up concatenated; no shared expert, no biases — the
MoE block of Qwen3-MoE.

``transformers``' ``OlmoeSparseMoeBlock`` stores the experts as ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` and the router as ``gate.weight [E, H]``: moeforge's own layout, so the
converted layer shares their storage. ``norm_topk_prob`` is read from the block's router. The block
returns one tensor ``[B, S, H]``.
"""

from __future__ import annotations

# The same block semantics and layout as Qwen3-MoE: reuse its preset and converter.
from moeforge.families.qwen3_moe import from_hf, hf_output, preset

NAME = "olmoe"
HF_BLOCK_CLASSES = ("OlmoeSparseMoeBlock",)

__all__ = ["HF_BLOCK_CLASSES", "NAME", "from_hf", "hf_output", "preset"]
