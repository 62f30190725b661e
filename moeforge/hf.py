"""Hugging Face ``transformers`` interop: convert an MoE block, or patch every block of a model.

Nothing here imports ``transformers``: blocks are recognised by class name through
:mod:`moeforge.families`, so this module works with whatever version the caller has installed.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import torch
from torch import nn

from moeforge.families import family_of_block
from moeforge.layer import MoELayer


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    """A :class:`MoELayer` with ``block``'s weights and semantics (see :mod:`moeforge.families`).

    ``layer_kwargs`` (e.g. ``backend``, ``debug``) are passed to the layer. Raises ``TypeError`` for a
    block of an unsupported class."""
    module = family_of_block(block)
    if module is None:
        raise TypeError(f"no moeforge converter for {type(block).__name__}")
    layer: MoELayer = module.from_hf(block, **layer_kwargs)
    return layer


class HFMoEBlock(nn.Module):
    """Drop-in replacement of a ``transformers`` MoE block: runs a :class:`MoELayer` and returns
    what the original block returned (a tensor or a tuple with router logits)."""

    def __init__(self, layer: MoELayer, family: ModuleType, original: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self._family = family
        self._original_class = type(original).__name__
        self._original = [original]  # kept for hf_output's needs, hidden from the module tree

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.layer.router_logits(x)
        out = self.layer(x, logits).view(shape)
        return self._family.hf_output(self._original[0], out, logits)

    def extra_repr(self) -> str:
        return f"replaces {self._original_class}"


@attrs.frozen
class PatchReport:
    """What :func:`patch_model` did: ``replaced`` (module path, original class) and ``skipped``
    (module path, class) for MoE-looking blocks it has no converter for."""

    replaced: tuple[tuple[str, str], ...]
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} MoE block(s)"]
        lines += [f"  {path}: {cls}" for path, cls in self.replaced]
        if self.skipped:
            lines.append(f"left {len(self.skipped)} unsupported block(s) alone")
            lines += [f"  {path}: {cls}" for path, cls in self.skipped]
        return "\n".join(lines)


def patch_model(model: nn.Module, **layer_kwargs: Any) -> PatchReport:
    """Replace every supported MoE block of ``model`` in place by an :class:`HFMoEBlock`.

    Blocks that look like MoE blocks (they have an ``experts`` child) but have no converter are
    left alone and listed in the report."""
    replaced: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    for path, module in list(model.named_modules()):
        if isinstance(module, HFMoEBlock) or not path:
            continue
        family = family_of_block(module)
        if family is None:
            if hasattr(module, "experts") and not _inside(path, replaced):
                skipped.append((path, type(module).__name__))
            continue
        if _inside(path, replaced):
            continue
        layer = family.from_hf(module, **layer_kwargs)
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, HFMoEBlock(layer, family, module))
        replaced.append((path, type(module).__name__))
    return PatchReport(tuple(replaced), tuple(skipped))


def _inside(path: str, replaced: list[tuple[str, str]]) -> bool:
    return any(path.startswith(done + ".") for done, _ in replaced)
