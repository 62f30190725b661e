"""DeepSeek-V3: router logits in fp32 -> sigmoid -> ``e_score_correction_bias`` added for the choice
only -> grouped top-k (a group's score is the sum of its two best biased scores; ``topk_group`` groups
kept) -> top-k -> weights from the unbiased scores, renormalised when ``norm_topk_prob`` -> times
``routed_scaling_factor``. SwiGLU experts (gate/up concatenated) plus an ungated shared MLP.

``transformers``' ``DeepseekV3MoE`` stores the experts as ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` (moeforge's layout: shared storage); the shared MLP's separate ``gate_proj``
and ``up_proj`` are concatenated into one ``[2I, H]`` weight (a copy).

What the dropped groups are masked with depends on the ``transformers`` version: ``0.0`` in 4.x and
5.0 (seen in 4.55 and 5.0.0; a dropped expert then beats kept experts whose biased score is
negative), ``-inf`` in later releases (seen in 5.23), as in DeepSeek's own code. :func:`from_hf`
reads it from the block's source (see :func:`hf_group_mask_value`); the preset's default is ``-inf``.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Optional

import torch
from torch import nn

from moeforge.families._shared import load_shared_mlp, require_silu, setting
from moeforge.families._convert import fused_expert_layer, require
from moeforge.layer import MoELayer
from moeforge.shared_experts import SharedExpertsConfig
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import GroupScore, RoutingConfig, Scoring, ScoreOrder

NAME = "deepseek_v3"
HF_BLOCK_CLASSES = ("DeepseekV3MoE",)

_ZERO_FILL = re.compile(r"masked_fill\(\s*~\s*score_mask\.bool\(\)\s*,\s*0(\.0*)?\s*\)")


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, n_group: int = 8,
           topk_group: int = 4, norm_topk_prob: bool = True, routed_scaling_factor: float = 2.5,
           n_shared_experts: int = 1, shared_intermediate_size: Optional[int] = None,
           group_mask_value: float = float("-inf"), **layer_kwargs: Any) -> dict[str, Any]:
    """The defaults are ``DeepseekV3Config``'s. ``shared_intermediate_size`` defaults to
    ``intermediate_size * n_shared_experts`` (no shared experts when that is 0)."""
    grouped = n_group > 1
    shared = intermediate_size * n_shared_experts if shared_intermediate_size is None else shared_intermediate_size
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=RoutingConfig(
            scoring=Scoring.SIGMOID, order=ScoreOrder.SCORE_THEN_SELECT, renormalize=norm_topk_prob,
            selection_bias=True, n_group=n_group if grouped else None, topk_group=topk_group if grouped else None,
            group_score=GroupScore.SUM_TOP2, group_mask_value=group_mask_value,
            routed_scaling_factor=routed_scaling_factor, scaling_in_weights=True, router_in_fp32=True,
        ),
        activation=ActivationConfig(),
        shared_experts=SharedExpertsConfig(shared) if shared > 0 else None,
        **layer_kwargs,
    )


def hf_group_mask_value(block: nn.Module) -> float:
    """``0.0`` when the block's routing code masks the dropped groups with zeros (e.g. ``transformers``
    5.0.0's ``DeepseekV3MoE.route_tokens_to_experts``), else ``-inf`` (e.g. 5.23's
    ``DeepseekV3TopkRouter.forward``). Without readable source, ``-inf``."""
    for cls in (type(block), type(getattr(block, "gate", None))):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if _ZERO_FILL.search(source):
            return 0.0
    return float("-inf")


def from_hf(block: nn.Module, *, group_mask_value: Optional[float] = None, **layer_kwargs: Any) -> MoELayer:
    """``group_mask_value`` overrides the value read by :func:`hf_group_mask_value`."""
    gate_up = require(block, "experts.gate_up_proj", 3)
    down = require(block, "experts.down_proj", 3)
    router = require(block, "gate.weight", 2)
    bias = require(block, "gate.e_score_correction_bias", 1)
    shared_gate = require(block, "shared_experts.gate_proj.weight", 2)
    shared_up = require(block, "shared_experts.up_proj.weight", 2)
    shared_down = require(block, "shared_experts.down_proj.weight", 2)
    require_silu(block, "experts.act_fn")
    require_silu(block, "shared_experts.act_fn")
    # Recent transformers keep these settings on the router, the 5.0 releases on the block.
    owners = (getattr(block, "gate"), block)
    layer = fused_expert_layer(
        preset, gate_up, down, router, top_k=int(setting(owners, "top_k")), n_group=int(setting(owners, "num_group", "n_group")),
        topk_group=int(setting(owners, "topk_group")), norm_topk_prob=bool(setting(owners, "norm_topk_prob")),
        routed_scaling_factor=float(setting(owners, "routed_scaling_factor")),
        shared_intermediate_size=int(shared_gate.shape[0]),
        group_mask_value=hf_group_mask_value(block) if group_mask_value is None else group_mask_value,
        **layer_kwargs)
    # The router weight keeps its dtype: the layer's router computes in fp32, as HF's does.
    assert layer.shared_experts is not None
    # A buffer, read by the top-k at call time: shared when fp32, else widened exactly (HF adds it to
    # fp32 scores, so a bf16 buffer acts with its bf16 values there too).
    layer.e_score_correction_bias = bias.detach().to(torch.float32)
    load_shared_mlp(layer.shared_experts, shared_gate, shared_up, shared_down)
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """``DeepseekV3MoE`` returns the hidden states only, in the input's shape."""
    return output
