"""What Qwen2-MoE, Qwen3-MoE and OLMoE share: softmax over all experts (fp32) -> top-k -> renormalise
the k weights iff ``norm_topk_prob``; SwiGLU experts, gate/up concatenated, no biases.

``transformers`` (>= 5) stores these blocks' experts as ``experts.gate_up_proj [E, 2I, H]`` (gate rows
then up rows) and ``experts.down_proj [E, H, I]``, and the router as ``gate.weight [E, H]``: moeforge's
own layouts, so the converted layer shares their storage. ``top_k`` and ``norm_topk_prob`` are read from
the router (``gate``), or from the block itself where an older version kept them there.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from moeforge.families._convert import fused_expert_layer, require
from moeforge.families._shared import require_silu, setting
from moeforge.layer import MoELayer
from moeforge.stages.topk import RoutingConfig, Scoring, ScoreOrder


def routing(norm_topk_prob: bool) -> RoutingConfig:
    """Softmax over every expert, keep the top-k, renormalise them iff ``norm_topk_prob``."""
    return RoutingConfig(scoring=Scoring.SOFTMAX, order=ScoreOrder.SCORE_THEN_SELECT,
                         renormalize=bool(norm_topk_prob))


def routed_layer(block: nn.Module, preset: Callable[..., dict[str, Any]], layer_kwargs: dict[str, Any],
                 **options: Any) -> MoELayer:
    """A layer built by ``preset`` (sizes, ``norm_topk_prob`` and ``top_k`` read from ``block``, plus
    ``options``) whose router and routed experts share ``block``'s storage. The caller loads any
    shared expert and then calls ``layer.rebuild_pipeline()``."""
    gate_up = require(block, "experts.gate_up_proj", 3)
    down = require(block, "experts.down_proj", 3)
    router = require(block, "gate.weight", 2)
    require_silu(block, "experts.act_fn")
    owners = (getattr(block, "gate"), block)
    return fused_expert_layer(preset, gate_up, down, router, top_k=int(setting(owners, "top_k")),
                              norm_topk_prob=bool(setting(owners, "norm_topk_prob")), **options, **layer_kwargs)
