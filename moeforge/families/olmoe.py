"""OLMoE: softmax (fp32) over all experts -> top-k -> renormalise iff ``norm_topk_prob`` (``False`` for
the released OLMoE checkpoints); SwiGLU with gate/up concatenated; no shared expert, no biases — the
MoE block of Qwen3-MoE.

``transformers``' ``OlmoeSparseMoeBlock`` stores the experts as ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` and the router as ``gate.weight [E, H]``: moeforge's own layout, so the
converted layer shares their storage. ``norm_topk_prob`` is read from the block's router. The block
returns one tensor ``[B, S, H]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._softmax_topk import routed_layer, routing
from moeforge.layer import MoELayer
from moeforge.stages.activation import ActivationConfig

NAME = "olmoe"
HF_BLOCK_CLASSES = ("OlmoeSparseMoeBlock",)


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           norm_topk_prob: bool = False, **layer_kwargs: Any) -> dict[str, Any]:
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=routing(norm_topk_prob),
        activation=ActivationConfig(),
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    layer = routed_layer(block, preset, layer_kwargs)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """``OlmoeSparseMoeBlock`` returns the hidden states ``[B, S, H]`` only."""
    return output
