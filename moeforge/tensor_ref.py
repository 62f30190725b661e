"""Tensors a stage reads at call time, either held directly or looked up on a module.

Stages built by a :class:`~moeforge.MoELayer` refer to the layer's parameters by name
(:class:`ParamRef`) rather than holding the tensors, so ``layer.to(...)``, ``load_state_dict`` and
``process_weights_after_loading`` (which may replace a parameter) are seen by the next call without
rebuilding the pipeline.
"""

from __future__ import annotations

from typing import Union

import attrs
import torch


@attrs.frozen(eq=False)
class ParamRef:
    """The tensor attribute ``name`` of ``owner`` (a parameter or buffer), read at call time."""

    owner: torch.nn.Module
    name: str

    def get(self) -> torch.Tensor:
        value = getattr(self.owner, self.name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(self.owner).__name__}.{self.name} is not a tensor")
        return value

    def __repr__(self) -> str:
        return f"ParamRef({type(self.owner).__name__}.{self.name})"


TensorSource = Union[torch.Tensor, ParamRef]


def resolve(source: TensorSource) -> torch.Tensor:
    return source.get() if isinstance(source, ParamRef) else source
