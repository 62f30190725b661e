"""Llama-4 (text): top-k of the router logits -> weight = sigmoid(chosen logit), not renormalised; the
weight scales the expert's *input* (``RoutingWeights.ON_INPUT``), not its output; SwiGLU experts
(gate/up concatenated) plus an ungated shared SwiGLU MLP.

``transformers``' ``Llama4TextMoe`` stores the experts transposed: ``gate_up_proj [E, H, 2I]``
(``x @ W``, gate columns then up columns) and ``down_proj [E, I, H]``. moeforge's GEMMs take
``[E, N, K]``, so the converted layer holds transposed *copies* ``[E, 2I, H]`` and ``[E, H, I]``
(later changes to the block's expert weights do not reach the layer); the router and the shared
MLP's ``down_proj`` are shared, its ``gate_proj`` / ``up_proj`` concatenated into one weight (a copy).

HF runs every expert on every token, with the unchosen tokens' inputs scaled by ``sigmoid(-inf) = 0``;
the experts have no biases, so those contribute exactly zero and the sparse layer is the same function.
The triton backend does not apply routing weights on the input yet: use ``backend="torch"``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from moeforge.families._shared import load_shared_mlp, require_silu, setting, transposed
from moeforge.families._convert import adopt, require
from moeforge.layer import MoELayer
from moeforge.shared_experts import SharedExpertsConfig
from moeforge.spec import RoutingWeights
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig, Scoring, ScoreOrder

NAME = "llama4"
EXPERTS_TRANSPOSED = True  # the block stores [E, K, N]; the layer holds transposed copies
HF_BLOCK_CLASSES = ("Llama4TextMoe",)


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           shared_intermediate_size: Optional[int] = None, **layer_kwargs: Any) -> dict[str, Any]:
    """``shared_intermediate_size`` defaults to ``intermediate_size`` (Llama-4's shared expert is one
    expert-sized MLP); 0 means no shared expert."""
    shared = intermediate_size if shared_intermediate_size is None else shared_intermediate_size
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=RoutingConfig(scoring=Scoring.SIGMOID, order=ScoreOrder.SELECT_THEN_SCORE, renormalize=False,
                              apply_weights=RoutingWeights.ON_INPUT),
        activation=ActivationConfig(),
        shared_experts=SharedExpertsConfig(shared) if shared > 0 else None,
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    gate_up = require(block, "experts.gate_up_proj", 3)  # [E, H, 2I]
    down = require(block, "experts.down_proj", 3)  # [E, I, H]
    router = require(block, "router.weight", 2)
    shared_gate = require(block, "shared_expert.gate_proj.weight", 2)
    shared_up = require(block, "shared_expert.up_proj.weight", 2)
    shared_down = require(block, "shared_expert.down_proj.weight", 2)
    require_silu(block, "experts.act_fn")
    require_silu(block, "shared_expert.activation_fn")
    num_experts, hidden, double_inter = gate_up.shape
    layer_kwargs.setdefault("dtype", gate_up.dtype)
    layer_kwargs.setdefault("device", gate_up.device)
    layer = MoELayer(**preset(
        num_experts=num_experts, top_k=int(setting((getattr(block, "router"), block), "top_k")),
        hidden_size=hidden, intermediate_size=double_inter // 2,
        shared_intermediate_size=int(shared_gate.shape[0]), **layer_kwargs))
    adopt(layer, "w13_weight", transposed(gate_up))
    adopt(layer, "w2_weight", transposed(down))
    assert layer.router is not None and layer.shared_experts is not None
    adopt(layer.router, "weight", router)
    load_shared_mlp(layer.shared_experts, shared_gate, shared_up, shared_down)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor,
              router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe`` returns ``(hidden_states [T, H], router_logits [T, E])``: the hidden states
    flattened over batch and sequence, and the raw router logits (not the sigmoid scores)."""
    return output.reshape(-1, output.shape[-1]), router_logits
