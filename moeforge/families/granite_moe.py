"""Granite-MoE (and Granite-MoE-Shared): top-k of the router logits (fp32) -> softmax over those k
(``ScoreOrder.SELECT_THEN_SCORE``, ``Scoring.SOFTMAX``; already normalised); SwiGLU experts with gate/up
concatenated (``chunk(2)``: gate rows then up rows), no biases.

Blocks and layouts (``transformers``' ``GraniteMoeMoE`` and ``GraniteMoeSharedMoE``, the same block):

* transformers >= 5 (3D experts): ``router.weight [E, H]``, ``experts.gate_up_proj [E, 2I, H]``,
  ``experts.down_proj [E, H, I]``;
* earlier versions (``GraniteMoeParallelExperts``): ``router.layer.weight [E, H]``,
  ``input_linear.weight [E, 2I, H]``, ``output_linear.weight [E, H, I]``.

Both are moeforge's own layout: the converted layer shares their storage.

Granite-MoE-Shared's shared MLP (``GraniteMoeSharedMLP``: ``input_linear`` Linear ``[2 I_s, H]``, gate
rows then up rows, and ``output_linear [H, I_s]``, ungated) is **not** part of its MoE block: it is
``shared_mlp`` of the *decoder layer*, which adds ``shared_mlp(x)`` to the block's output itself. So the
block converter covers the routed experts only — that is what the block computes, and what
``moeforge.hf.patch_model`` must replace (folding the shared MLP in would count it twice, since the
decoder layer keeps calling its own). To build one standalone layer computing ``block(x) +
shared_mlp(x)``, pass the decoder layer's MLP: ``from_hf(block, shared_mlp=decoder.shared_mlp)``
(its weights are shared too, ``SharedGate.NONE``); such a layer must not replace the block inside a
decoder layer that still has its ``shared_mlp``.

What the block returns: ``transformers`` >= 5 (and the versions whose model collects router logits
with output hooks, ``_can_record_outputs``): the hidden states ``[B, S, H]`` only. The 4.x versions
returned ``(hidden_states [B, S, H], router_logits [T, E] fp32)``; :func:`hf_output` follows the
version that defined the block's class.
"""

from __future__ import annotations

import functools
import re
import inspect
import sys
from typing import Any, Optional, Union

import torch
from torch import nn

from moeforge.families._convert import adopt, find, fused_expert_layer, require
from moeforge.families._shared import require_silu, setting
from moeforge.layer import MoELayer
from moeforge.shared_experts import SharedExpertsConfig
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig, Scoring, ScoreOrder

NAME = "granite_moe"
HF_BLOCK_CLASSES = ("GraniteMoeMoE", "GraniteMoeSharedMoE")


def preset(*, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
           shared_intermediate_size: int = 0, **layer_kwargs: Any) -> dict[str, Any]:
    """``shared_intermediate_size`` (Granite-MoE-Shared's config field; 0: none) adds the ungated
    shared MLP that the decoder layer runs beside the block (see the module notes)."""
    shared = SharedExpertsConfig(shared_intermediate_size) if shared_intermediate_size > 0 else None
    return dict(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
        routing=RoutingConfig(scoring=Scoring.SOFTMAX, order=ScoreOrder.SELECT_THEN_SCORE, renormalize=False),
        activation=ActivationConfig(),
        shared_experts=shared,
        **layer_kwargs,
    )


def from_hf(block: nn.Module, *, shared_mlp: Optional[nn.Module] = None, **layer_kwargs: Any) -> MoELayer:
    """The block's routed experts (and, with ``shared_mlp``, a decoder layer's shared MLP too)."""
    if find(block, "experts.gate_up_proj") is not None:
        gate_up = require(block, "experts.gate_up_proj", 3)
        down = require(block, "experts.down_proj", 3)
        router = require(block, "router.weight", 2)
        require_silu(block, "experts.act_fn")
    else:  # GraniteMoeParallelExperts (transformers 4.x)
        gate_up = require(block, "input_linear.weight", 3)
        down = require(block, "output_linear.weight", 3)
        router = require(block, "router.layer.weight", 2)
        require_silu(block, "activation")
    shared_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    if shared_mlp is not None:
        shared_weights = (require(shared_mlp, "input_linear.weight", 2),
                          require(shared_mlp, "output_linear.weight", 2))
        require_silu(shared_mlp, "activation")
        for name in ("input_linear", "output_linear"):
            if getattr(getattr(shared_mlp, name), "bias", None) is not None:
                raise ValueError(f"{type(shared_mlp).__name__}.{name} has a bias; Granite's shared MLP has none")
    layer = fused_expert_layer(
        preset, gate_up, down, router, top_k=int(setting((getattr(block, "router"), block), "top_k")),
        shared_intermediate_size=0 if shared_weights is None else int(shared_weights[1].shape[1]),
        **layer_kwargs)
    if shared_weights is not None:
        assert layer.shared_experts is not None
        adopt(layer.shared_experts.gate_up_proj, "weight", shared_weights[0])
        adopt(layer.shared_experts.down_proj, "weight", shared_weights[1])
    layer.rebuild_pipeline()
    return layer


def hf_output(block: nn.Module, output: torch.Tensor,
              router_logits: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The hidden states ``[B, S, H]``; with the 4.x blocks, ``(hidden_states, router_logits [T, E])``
    with the logits in fp32, as their router computed them (``linear(x, W).float()``)."""
    if returns_router_logits(type(block)):
        return output, router_logits.float()
    return output


def returns_router_logits(block_class: type) -> bool:
    """Whether ``block_class`` returns ``(hidden_states, router_logits)`` (the 4.x Granite blocks did)
    or the hidden states only (later versions, which collect router logits with output hooks).

    Read from the ``return`` statements of the forward of the first ``transformers`` class in the MRO
    (a subclass defined elsewhere returns what its parent does); when no source is available, from
    whether that class's module records router logits with output hooks."""
    owner = next((cls for cls in block_class.__mro__ if cls.__module__.startswith("transformers.")), block_class)
    verdict = _returns_tuple(owner)
    return verdict if verdict is not None else not _records_router_logits(owner.__module__)


@functools.lru_cache(maxsize=None)
def _returns_tuple(owner: type) -> Optional[bool]:
    try:
        source = inspect.getsource(owner.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError, AttributeError):
        return None
    returns = re.findall(r"^\s*return\s+(.+)$", source, flags=re.MULTILINE)
    return any("," in value and "router_logits" in value for value in returns)


@functools.lru_cache(maxsize=None)
def _records_router_logits(module_name: str) -> bool:
    """Whether a class defined in module ``module_name`` records router logits with output hooks
    (cached: ``hf_output`` runs on every forward of a patched block)."""
    module = sys.modules.get(module_name)
    for value in vars(module).values() if module is not None else ():
        if not isinstance(value, type) or value.__module__ != module_name:
            continue  # classes imported from elsewhere say nothing about this module's blocks
        recorded = getattr(value, "_can_record_outputs", None)
        if isinstance(recorded, dict) and "router_logits" in recorded:
            return True
    return False
