"""PhiMoE (Phi-3.5-MoE): the sparsemixer top-2 routing in eval mode, then SwiGLU experts (gate/up
concatenated); no shared experts, no biases.

Sparsemixer (see :class:`~moeforge.RoutingConfig`, ``sparsemixer_eps``): the first expert is the best
logit ``m``, weighted by the softmax over the experts whose logit ``s`` has
``(m - s) / max(|s|, m) <= 2 * router_jitter_noise``; the second is the best of the rest, weighted the
same way among the rest. Not renormalised. In eval mode ``router_jitter_noise`` is this threshold, not
noise, and ``input_jitter_noise`` is not used. The converted layer computes the eval-mode routing
whatever the block's ``training`` flag (training samples experts at random, with its own gradient).

HF's sparsemixer always picks two experts whatever ``num_experts_per_tok`` says, so :func:`from_hf`
builds a top-2 layer. ``PhimoeSparseMoeBlock`` stores ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``: moeforge's layout, so the converted layer shares their storage.

The Triton routing kernel does not implement the sparsemixer: on the triton backend the layer routes
with the torch ``TopK`` stage (see ``TritonTopK.supports``) and runs the rest with the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._convert import fused_expert_layer, require
from moeforge.families._shared import require_silu, setting
from moeforge.layer import MoELayer
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig

NAME = "phimoe"
HF_BLOCK_CLASSES = ("PhimoeSparseMoeBlock",)
HF_TOP_K = 2  # what HF's sparsemixer computes, whatever the config's num_experts_per_tok


def preset(*, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int = HF_TOP_K,
           router_jitter_noise: float = 0.01, **layer_kwargs: Any) -> dict[str, Any]:
    """``router_jitter_noise`` defaults to ``PhimoeConfig``'s; ``top_k`` other than 2 continues the
    sparsemixer's rounds (each picks the best remaining expert)."""
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=RoutingConfig(sparsemixer_eps=router_jitter_noise, renormalize=False),
        activation=ActivationConfig(),
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    gate_up = require(block, "experts.gate_up_proj", 3)
    down = require(block, "experts.down_proj", 3)
    router = require(block, "router.weight", 2)
    require_silu(block, "experts.act_fn")
    layer = fused_expert_layer(
        preset, gate_up, down, router, top_k=HF_TOP_K,
        router_jitter_noise=float(setting((getattr(block, "router"),), "router_jitter_noise")), **layer_kwargs)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """``PhimoeSparseMoeBlock`` returns the hidden states only, ``[B, S, H]``."""
    return output
