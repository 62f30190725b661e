"""Helpers shared by the DeepSeek-V3, GPT-OSS, Llama-4 and PhiMoE converters: read a block's settings,
refuse what moeforge would compute differently (never a silently different layer), re-lay weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.families._convert import adopt
from moeforge.shared_experts import SharedExperts

# transformers' ACT2FN["silu"] is SiLUActivation, ACT2FN["swish"] is torch's SiLU.
_SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})


def setting(owners: tuple[object, ...], *names: str) -> Any:
    """The first attribute among ``names`` found on the first of ``owners`` that has one (settings move
    between a block and its router across ``transformers`` versions)."""
    for owner in owners:
        for name in names:
            if hasattr(owner, name):
                return getattr(owner, name)
    where = ", ".join(type(owner).__name__ for owner in owners)
    raise TypeError(f"none of {where} has an attribute {' / '.join(names)}; is this the expected block class?")


def require_silu(block: nn.Module, path: str) -> None:
    """The activation module at dotted ``path`` (e.g. ``"experts.act_fn"``) must be SiLU: the
    converted layer computes SwiGLU."""
    value: object = block
    for part in path.split("."):
        value = getattr(value, part, None)
    if type(value).__name__ not in _SILU_CLASSES:
        raise ValueError(f"{type(block).__name__}.{path} is {type(value).__name__}; moeforge converts "
                         "this family with SwiGLU (hidden_act='silu') only")


def transposed(weight: torch.Tensor) -> nn.Parameter:
    """``[E, K, N]`` (HF's ``x @ W`` layout) as moeforge's ``[E, N, K]``: a contiguous copy, keeping
    ``requires_grad``."""
    return nn.Parameter(weight.detach().transpose(1, 2).contiguous(), requires_grad=weight.requires_grad)


def load_shared_mlp(shared: SharedExperts, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """An HF SwiGLU MLP (``gate_proj``, ``up_proj`` ``[I, H]``, ``down_proj [H, I]``) into a layer's
    shared experts: gate and up rows concatenated into ``gate_up_proj`` (a copy), ``down_proj`` shared."""
    with torch.no_grad():
        shared.gate_up_proj.weight.copy_(torch.cat([gate, up]))
    adopt(shared.down_proj, "weight", down)
