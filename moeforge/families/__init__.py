"""Model families: each family's exact MoE semantics as a preset, and its Hugging Face converter.

One module per family (``moeforge/families/<name>.py``), listed explicitly in :data:`FAMILIES` and
imported only when asked for (no import-time registration). Each module provides:

* ``NAME`` — the family's name;
* ``HF_BLOCK_CLASSES`` — the ``transformers`` MoE block class names it converts;
* ``preset(*, num_experts, top_k, hidden_size, intermediate_size, **options) -> dict`` — the
  :class:`~moeforge.MoELayer` keyword arguments with the family's routing, activation, shared
  experts and biases (``options`` are the family's own knobs, e.g. ``norm_topk_prob``);
* ``from_hf(block, **layer_kwargs) -> MoELayer`` — a layer with the block's weights (sharing
  storage where the layout allows);
* ``hf_output(block, output, router_logits)`` — the block's own return value built from the
  layer's output ``[..., H]`` and the router logits ``[T, E]`` (some blocks return tuples).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch

from moeforge.errors import PresetError
from moeforge.layer import MoELayer
from moeforge.presets import FAMILIES, family, layer_arguments, settings

__all__ = ["FAMILIES", "PresetError", "block_classes", "family", "family_of_block", "preset"]


def preset(name: str, **kwargs: Any) -> dict[str, Any]:
    """``MoELayer`` keyword arguments for family ``name`` (sizes and family options as keywords): see
    :func:`moeforge.presets.settings`."""
    return settings(name, kwargs, layer_arguments(MoELayer))


def block_classes() -> dict[str, ModuleType]:
    """``transformers`` block class name -> the family module that converts it."""
    return {class_name: module for module in map(family, FAMILIES) for class_name in module.HF_BLOCK_CLASSES}


def family_of_block(block: torch.nn.Module) -> Optional[ModuleType]:
    """The family module that converts ``block`` (matched by class name), or ``None``."""
    return block_classes().get(type(block).__name__)
