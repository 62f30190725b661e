"""Model families' presets, below the layer: which family modules exist (:data:`FAMILIES`), each family's module
(imported only when asked for: no import-time registration), and the layer arguments a family's preset gives
(:func:`settings`). ``MoELayer.from_preset`` and :func:`moeforge.families.preset` both read this module; the
family modules themselves (:mod:`moeforge.families`) build layers, so they sit above the layer."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Optional

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


def settings(name: str, kwargs: dict[str, Any], layer_arguments: Sequence[str]) -> dict[str, Any]:
    """The layer's keyword arguments for family ``name`` (sizes and family options in ``kwargs``).

    Keywords are the sizes, the family's own options (see its module's ``preset``) and any other of the
    ``layer_arguments`` (the layer class's own, :func:`layer_arguments`) except those the family sets itself
    (its routing, activation, ...). Anything else is a :class:`PresetError` listing what the family takes."""
    module = family(name)
    own = _own_options(module)
    missing = [key for key, default in own.items() if default is inspect.Parameter.empty and key not in kwargs]
    base: Optional[dict[str, Any]] = None
    if not missing:
        base = module.preset(**{key: value for key, value in kwargs.items() if key in own})
    # The MoELayer arguments a caller may add: those the family does not set itself.
    layer = [key for key in layer_arguments if key not in _SIZES and (base is None or key not in base)]
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
    found: dict[str, Any] = module.preset(**kwargs)
    return found


def _own_options(module: ModuleType) -> dict[str, Any]:
    """The keywords a family's ``preset`` names (sizes and the family's options) -> their defaults."""
    parameters = inspect.signature(module.preset).parameters.values()
    return {p.name: p.default for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def layer_arguments(layer_class: type) -> list[str]:
    """The keyword arguments of ``layer_class``'s constructor (``MoELayer``'s)."""
    return list(inspect.signature(layer_class).parameters)


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
