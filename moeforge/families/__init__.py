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

import importlib
from types import ModuleType
from typing import Any, Optional

import torch

FAMILIES: dict[str, str] = {
    "mixtral": "moeforge.families.mixtral",
    "qwen2_moe": "moeforge.families.qwen2_moe",
    "qwen3_moe": "moeforge.families.qwen3_moe",
    "olmoe": "moeforge.families.olmoe",
    "deepseek_v3": "moeforge.families.deepseek_v3",
    "gpt_oss": "moeforge.families.gpt_oss",
    "llama4": "moeforge.families.llama4",
    "granite_moe": "moeforge.families.granite_moe",
    "phimoe": "moeforge.families.phimoe",
}


def family(name: str) -> ModuleType:
    """The module of family ``name`` (see :data:`FAMILIES`)."""
    key = name.lower().replace("-", "_")
    if key not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[key])


def preset(name: str, **kwargs: Any) -> dict[str, Any]:
    """``MoELayer`` keyword arguments for family ``name`` (sizes and family options as keywords)."""
    settings: dict[str, Any] = family(name).preset(**kwargs)
    return settings


def block_classes() -> dict[str, ModuleType]:
    """``transformers`` block class name -> the family module that converts it."""
    return {class_name: module for module in map(family, FAMILIES) for class_name in module.HF_BLOCK_CLASSES}


def family_of_block(block: torch.nn.Module) -> Optional[ModuleType]:
    """The family module that converts ``block`` (matched by class name), or ``None``."""
    return block_classes().get(type(block).__name__)
