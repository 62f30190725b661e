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

import difflib
import importlib
import inspect
from types import ModuleType
from typing import Any, Optional

import torch

from moeforge.errors import PresetError

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


_SIZES = ("num_experts", "top_k", "hidden_size", "intermediate_size")


def preset(name: str, **kwargs: Any) -> dict[str, Any]:
    """``MoELayer`` keyword arguments for family ``name`` (sizes and family options as keywords).

    Keywords are the sizes, the family's own options (see its module's ``preset``) and any other
    ``MoELayer`` argument except those the family sets itself (its routing, activation, ...). Anything
    else is a :class:`PresetError` listing what the family takes."""
    module = family(name)
    own = _own_options(module)
    missing = [key for key, default in own.items() if default is inspect.Parameter.empty and key not in kwargs]
    base: Optional[dict[str, Any]] = None
    if not missing:
        base = module.preset(**{key: value for key, value in kwargs.items() if key in own})
    # The MoELayer arguments a caller may add: those the family does not set itself.
    layer = [key for key in _layer_options() if base is None or key not in base]
    unknown = [key for key in kwargs if key not in own and key not in layer and (base is None or key not in base)]
    if unknown:
        raise PresetError(_unknown_message(module, unknown, own, layer))
    if base is None:
        raise PresetError(f"the {module.NAME} preset needs {', '.join(repr(key) for key in missing)} "
                          f"(its options: {_show_options(own)})")
    fixed = [key for key in kwargs if key in base and key not in own]
    if fixed:
        raise PresetError(
            f"the {module.NAME} preset sets {', '.join(repr(key) for key in fixed)} itself (the family's "
            f"semantics); to change it, override the preset's settings: settings = moeforge.families."
            f"preset({module.NAME!r}, ...); MoELayer(**{{**settings, {fixed[0]!r}: ...}})")
    settings: dict[str, Any] = module.preset(**kwargs)
    return settings


def _own_options(module: ModuleType) -> dict[str, Any]:
    """The keywords a family's ``preset`` names (sizes and the family's options) -> their defaults."""
    parameters = inspect.signature(module.preset).parameters.values()
    return {p.name: p.default for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _layer_options() -> list[str]:
    from moeforge.layer import MoELayer  # the families import the layer; the layer imports this lazily

    parameters = list(inspect.signature(MoELayer.__init__).parameters)[1:]  # not self
    return [name for name in parameters if name not in _SIZES]


def _show_options(own: dict[str, Any]) -> str:
    options = [key if default is inspect.Parameter.empty else f"{key}={default!r}"
               for key, default in own.items() if key not in _SIZES]
    return ", ".join(options) if options else "none (its routing and activation are fixed)"


def _unknown_message(module: ModuleType, unknown: list[str], own: dict[str, Any], layer: list[str]) -> str:
    lines = [f"the {module.NAME} preset does not take the keyword argument(s) "
             f"{', '.join(repr(key) for key in unknown)}",
             f"  {module.NAME}'s own options: {_show_options(own)}",
             f"  sizes: {', '.join(_SIZES)}; the MoELayer arguments it leaves to you: {', '.join(layer)}"]
    for key in unknown:
        elsewhere = [other for other in sorted(FAMILIES) if other != module.NAME and key in _own_options(family(other))]
        if elsewhere:
            lines.append(f"  '{key}' is an option of {', '.join(elsewhere)}, not of {module.NAME}")
        close = difflib.get_close_matches(key, [*own, *layer], n=1)
        if close:
            lines.append(f"  '{key}': did you mean '{close[0]}'?")
    return "\n".join(lines)


def block_classes() -> dict[str, ModuleType]:
    """``transformers`` block class name -> the family module that converts it."""
    return {class_name: module for module in map(family, FAMILIES) for class_name in module.HF_BLOCK_CLASSES}


def family_of_block(block: torch.nn.Module) -> Optional[ModuleType]:
    """The family module that converts ``block`` (matched by class name), or ``None``."""
    return block_classes().get(type(block).__name__)
