"""GPT-OSS: a router with a bias -> top-k of the logits -> softmax over the k chosen; experts with biases
on both GEMMs and the clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
``g = min(gate, limit)``, on gate/up *interleaved* (``g0 u0 g1 u1 ...``); the routing weight scales
the expert output including its bias. No shared experts.

``transformers``' ``GptOssMLP`` stores the experts transposed: ``gate_up_proj [E, H, 2I]`` (``x @ W``)
and ``down_proj [E, I, H]``. moeforge's GEMMs take ``[E, N, K]`` (``x @ W.T``), so the converted layer
holds transposed *copies* (``[E, 2I, H]`` with the interleaved columns becoming interleaved rows, and
``[E, H, I]``): later changes to the block's expert weights do not reach the layer. The router and the
expert biases are shared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._shared import setting, transposed
from moeforge.families._convert import adopt, require
from moeforge.layer import MoELayer
from moeforge.stages.activation import ActivationConfig, ActivationKind, GateUpLayout
from moeforge.stages.topk import RoutingConfig, Scoring, ScoreOrder

NAME = "gpt_oss"
EXPERTS_TRANSPOSED = True  # the block stores [E, K, N]; the layer holds transposed copies
HF_BLOCK_CLASSES = ("GptOssMLP",)


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, **layer_kwargs: Any) -> dict[str, Any]:
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        # A softmax over the k chosen logits is already normalised: renormalize would be a no-op.
        routing=RoutingConfig(scoring=Scoring.SOFTMAX, order=ScoreOrder.SELECT_THEN_SCORE, renormalize=False,
                              router_bias=True),
        activation=ActivationConfig(ActivationKind.GPT_OSS_SWIGLU, gate_up=GateUpLayout.INTERLEAVED,
                                    alpha=swiglu_alpha, limit=swiglu_limit),
        expert_bias=True,
        **layer_kwargs,
    )


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    gate_up = require(block, "experts.gate_up_proj", 3)  # [E, H, 2I]
    gate_up_bias = require(block, "experts.gate_up_proj_bias", 2)
    down = require(block, "experts.down_proj", 3)  # [E, I, H]
    down_bias = require(block, "experts.down_proj_bias", 2)
    router = require(block, "router.weight", 2)
    router_bias = require(block, "router.bias", 1)
    experts = getattr(block, "experts")
    num_experts, hidden, double_inter = gate_up.shape
    layer_kwargs.setdefault("dtype", gate_up.dtype)
    layer_kwargs.setdefault("device", gate_up.device)
    layer = MoELayer(**preset(
        num_experts=num_experts, top_k=int(setting((getattr(block, "router"),), "top_k")), hidden_size=hidden,
        intermediate_size=double_inter // 2, swiglu_alpha=float(setting((experts,), "alpha")),
        swiglu_limit=float(setting((experts,), "limit")), **layer_kwargs))
    adopt(layer, "w13_weight", transposed(gate_up))
    adopt(layer, "w2_weight", transposed(down))
    adopt(layer, "w13_bias", gate_up_bias)
    adopt(layer, "w2_bias", down_bias)
    assert layer.router is not None
    adopt(layer.router, "weight", router)
    adopt(layer.router, "bias", router_bias)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor,
              router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``GptOssMLP`` returns ``(hidden_states [B, S, H], router_scores [T, k])``: the softmax (in the
    logits' dtype) of the k largest logits, in descending order, as its router computes them."""
    top_k = int(setting((getattr(block, "router"),), "top_k"))
    top = router_logits.topk(top_k, dim=-1).values
    return output, torch.softmax(top, dim=1, dtype=top.dtype)
