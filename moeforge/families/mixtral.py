"""Mixtral: softmax (fp32) over all experts -> top-k -> renormalise; SwiGLU with gate/up
concatenated; no shared experts, no biases. ``transformers``' ``MixtralSparseMoeBlock`` stores the
experts as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``: moeforge's own layout, so the
converted layer shares their storage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._convert import fused_expert_layer, require
from moeforge.layer import MoELayer
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig, Scoring, ScoreOrder

NAME = "mixtral"
HF_BLOCK_CLASSES = ("MixtralSparseMoeBlock",)


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           **layer_kwargs: Any) -> dict[str, Any]:
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=RoutingConfig(scoring=Scoring.SOFTMAX, order=ScoreOrder.SCORE_THEN_SELECT, renormalize=True),
        activation=ActivationConfig(),
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    gate_up = require(block, "experts.gate_up_proj", 3)
    down = require(block, "experts.down_proj", 3)
    router = require(block, "gate.weight", 2)
    layer = fused_expert_layer(preset, gate_up, down, router, top_k=int(getattr(block, "top_k")), **layer_kwargs)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    return output
