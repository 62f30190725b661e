"""Qwen2-MoE (and Qwen1.5-MoE): softmax (fp32) over all experts -> top-k -> renormalise iff
``norm_topk_prob``; SwiGLU experts with gate/up concatenated, no biases; plus a shared SwiGLU expert
whose output is scaled per token by ``sigmoid(shared_expert_gate(x))`` (``SharedGate.SIGMOID``).

Storage: ``transformers``' ``Qwen2MoeSparseMoeBlock`` stores the routed experts as
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` and the router as
``gate.weight [E, H]`` — moeforge's layout, so the converted layer shares them, as it shares the shared
expert's ``down_proj.weight [H, I]`` and ``shared_expert_gate.weight [1, H]``. The shared expert's
``gate_proj`` and ``up_proj`` are two ``[I_s, H]`` Linear layers, while moeforge's shared MLP has one
``gate_up_proj [2 I_s, H]`` (gate rows then up rows): that weight is a **copy** (the concatenation
cannot share storage with two separate tensors), so later changes to the block's ``gate_proj`` /
``up_proj`` do not reach the layer.

The block returns one tensor ``[B, S, H]`` (router logits reach ``transformers`` through an output
hook on the router).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._convert import adopt, require
from moeforge.families._shared import load_shared_mlp, require_silu
from moeforge.families._softmax_topk import routed_layer, routing
from moeforge.layer import MoELayer
from moeforge.shared_experts import SharedExpertsConfig, SharedGate
from moeforge.stages.activation import ActivationConfig

NAME = "qwen2_moe"
HF_BLOCK_CLASSES = ("Qwen2MoeSparseMoeBlock",)


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           shared_expert_intermediate_size: int, norm_topk_prob: bool = False,
           **layer_kwargs: Any) -> dict[str, Any]:
    """``shared_expert_intermediate_size`` is the shared expert's width (it has no fixed ratio to
    ``intermediate_size`` across the released models, so it has no default); ``norm_topk_prob`` as in
    the model's config (``False`` for the released Qwen1.5/Qwen2-MoE checkpoints)."""
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=routing(norm_topk_prob),
        activation=ActivationConfig(),
        shared_experts=SharedExpertsConfig(shared_expert_intermediate_size, gate=SharedGate.SIGMOID),
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    shared_gate_proj = require(block, "shared_expert.gate_proj.weight", 2)
    shared_up = require(block, "shared_expert.up_proj.weight", 2)
    shared_down = require(block, "shared_expert.down_proj.weight", 2)
    shared_gate = require(block, "shared_expert_gate.weight", 2)
    require_silu(block, "shared_expert.act_fn")
    for path in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                 "shared_expert_gate"):
        if _has_bias(block, path):  # moeforge's shared MLP of this family has no biases: refuse, not drop
            raise ValueError(f"{type(block).__name__}.{path} has a bias; Qwen2-MoE's has none")
    layer = routed_layer(block, preset, layer_kwargs,
                         shared_expert_intermediate_size=int(shared_gate_proj.shape[0]))
    shared = layer.shared_experts
    assert shared is not None and shared.gate is not None
    load_shared_mlp(shared, shared_gate_proj, shared_up, shared_down)
    adopt(shared.gate, "weight", shared_gate)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """``Qwen2MoeSparseMoeBlock`` returns the hidden states ``[B, S, H]`` only (shared expert
    included)."""
    return output


def _has_bias(block: nn.Module, path: str) -> bool:
    module: object = block
    for part in path.split("."):
        module = getattr(module, part, None)
    return getattr(module, "bias", None) is not None
