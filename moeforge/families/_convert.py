"""Helpers shared by the family converters: find a block's tensors, give them to a layer."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from moeforge.layer import MoELayer


def find(block: nn.Module, path: str) -> Optional[torch.Tensor]:
    """The tensor at dotted ``path`` under ``block`` (``"experts.gate_up_proj"``), or ``None``."""
    value: object = block
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def require(block: nn.Module, path: str, rank: int) -> torch.Tensor:
    """Like :func:`find`, but a missing tensor or one of the wrong rank is a clear error."""
    value = find(block, path)
    if value is None:
        raise TypeError(f"{type(block).__name__} has no tensor '{path}'; is this the expected block class?")
    if value.dim() != rank:
        raise ValueError(f"{type(block).__name__}.{path} has shape {tuple(value.shape)}, expected rank {rank}")
    return value


def adopt(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``module.<name>`` the very same storage as ``tensor`` (a shared ``Parameter`` when it is
    one, else a new ``Parameter`` over the same storage), after checking the shape matches."""
    current = getattr(module, name)
    if current is not None and tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(f"{type(module).__name__}.{name}: expected shape {tuple(current.shape)}, "
                         f"got {tuple(tensor.shape)}")
    param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=tensor.requires_grad)
    setattr(module, name, param)


def fused_expert_layer(preset: Callable[..., dict[str, Any]], gate_up: torch.Tensor, down: torch.Tensor,
                       router: torch.Tensor, **preset_kwargs: Any) -> MoELayer:
    """A layer built by a family's ``preset`` — sizes read from ``gate_up [E, 2I, H]``, dtype and device
    from it unless given — whose routed experts and router share the storage of ``gate_up``,
    ``down [E, H, I]`` and ``router [E, H]`` (the transformers 5 layout, which is moeforge's).
    The caller loads anything else (biases, shared experts) and calls ``rebuild_pipeline()``."""
    num_experts, double_inter, hidden = gate_up.shape
    preset_kwargs.setdefault("dtype", gate_up.dtype)
    preset_kwargs.setdefault("device", gate_up.device)
    layer = MoELayer(**preset(num_experts=num_experts, hidden_size=hidden, intermediate_size=double_inter // 2,
                              **preset_kwargs))
    adopt(layer, "w13_weight", gate_up)
    adopt(layer, "w2_weight", down)
    assert layer.router is not None
    adopt(layer.router, "weight", router)
    return layer
