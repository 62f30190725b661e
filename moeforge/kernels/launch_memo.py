"""A bounded memo of launch recipes, keyed by the metadata of the operands.

A launcher decides everything about a launch from the operands' metadata — shapes, strides, dtypes, device, the
16-byte alignment of their addresses — and its options, never from their values: which configuration fits, which
grid, which constexprs, which Triton specialisation. For a grouped GEMM deciding it costs more host time than the
launch itself (docs/kernels.md, "The eager host path"), and an eager forward at a decode batch is bound by its host
time. A launcher keeps what it decided in a :class:`LaunchMemo` by the key of
everything it read (:func:`tensor_key` of each operand and the options as given) and looks it up before deciding
again: the same operands' metadata give the same recipe, so a hit changes nothing but the time. Values never enter
the key; a tensor's address enters only as its alignment, so a recipe holds no tensor and keeps none alive.

The memo is the launcher module's, shared by every layer in the process as Triton's own kernel cache is: it holds
what a pure function of the key returned, so one layer's calls can make another's faster, never different. It is
bounded (:data:`CAPACITY` recipes; the oldest goes first), since the token count is part of the key.
"""

from __future__ import annotations

from typing import Generic, Hashable, Optional, TypeVar

import torch

V = TypeVar("V")

CAPACITY = 1024  # recipes per launcher: token counts x layers' shapes x the forward's and the backward's GEMMs


def tensor_key(tensor: Optional[torch.Tensor]) -> Optional[tuple[object, ...]]:
    """What a launcher may read of ``tensor``: shape, strides, dtype and the address's remainder modulo 16 (Triton
    specialises pointers on 16-byte alignment; TMA and vector loads need it); ``None`` for an absent operand."""
    if tensor is None:
        return None
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.data_ptr() % 16


class LaunchMemo(Generic[V]):
    """Recipes by key, at most ``capacity`` of them (the oldest dropped first)."""

    __slots__ = ("capacity", "_recipes")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a launch memo holds at least one recipe, got capacity {capacity}")
        self.capacity = capacity
        self._recipes: dict[Hashable, V] = {}

    def get(self, key: Hashable) -> Optional[V]:
        return self._recipes.get(key)

    def put(self, key: Hashable, recipe: V) -> None:
        if len(self._recipes) >= self.capacity:
            self._recipes.pop(next(iter(self._recipes)))
        self._recipes[key] = recipe

    def __len__(self) -> int:
        return len(self._recipes)

    def clear(self) -> None:
        self._recipes.clear()
