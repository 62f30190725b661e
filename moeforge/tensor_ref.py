"""Tensors a stage reads at call time, either held directly or looked up on a module.

Stages built by a :class:`~moeforge.MoELayer` refer to the layer's parameters by name
(:class:`ParamRef`) rather than holding the tensors, so ``layer.to(...)``, ``load_state_dict`` and
``process_weights_after_loading`` (which may replace a parameter) are seen by the next call without
rebuilding the pipeline.

A ``ParamRef`` holds the module's parameter and buffer tables (the dicts ``nn.Module`` keeps them in),
not the module: the layer holds its pipeline, whose stages hold these references, and a reference to
the layer itself would make a cycle that keeps a deleted layer's weights alive (on the GPU) until the
garbage collector happens to run. Without the cycle, ``del layer`` frees them at once, and a pipeline
taken from a layer (``pipeline = layer.pipeline``) still works after the layer is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Optional, Union

import attrs
import torch


@attrs.frozen(eq=False, init=False)
class ParamRef:
    """The parameter or buffer ``name`` of a module, read at call time: ``ParamRef(layer, "w13_weight")``.

    Reads the module's parameter table first, then its buffer table, as ``getattr`` does; a value
    assigned later (``layer.w13_weight = nn.Parameter(...)``, ``layer.to(...)``) is seen."""

    name: str
    owner_type: str
    _parameters: Mapping[str, object]
    _buffers: Mapping[str, object]

    def __init__(self, owner: torch.nn.Module, name: str) -> None:
        if not isinstance(owner, torch.nn.Module):
            raise TypeError(f"ParamRef needs a torch.nn.Module, got {type(owner).__name__}")
        if name not in owner._parameters and name not in owner._buffers:
            raise ValueError(f"{type(owner).__name__} has no parameter or buffer named {name!r}")
        self.__attrs_init__(name, type(owner).__name__, owner._parameters, owner._buffers)  # type: ignore[attr-defined]

    def get(self) -> torch.Tensor:
        value = self._parameters.get(self.name)
        if value is None:
            value = self._buffers.get(self.name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.owner_type}.{self.name} is not a tensor (it is {type(value).__name__})")
        return value

    def __repr__(self) -> str:
        return f"ParamRef({self.owner_type}.{self.name})"


@attrs.frozen(eq=False, init=False)
class TransposedParamRef(ParamRef):
    """A :class:`ParamRef` read with its last two dimensions swapped (a view, taken when the stage runs, so
    autograd and ``.to()`` see the parameter itself): an ``[E, K, N]`` parameter (transformers' layout) read
    as the ``[E, N, K]`` weight the GEMM stages take."""

    def get(self) -> torch.Tensor:
        return super().get().transpose(-2, -1)

    def __repr__(self) -> str:
        return f"TransposedParamRef({self.owner_type}.{self.name})"


@attrs.frozen(eq=False, init=False)
class ParametrizedRef(ParamRef):  # type: ignore[override]  # (attrs adds two fields to the init)
    """A tensor ``torch.nn.utils.parametrize`` computes from a module's parameter (peft's LoRA on a parameter,
    ``LoraConfig(target_parameters=...)``: the weight plus its low-rank update), read as ``getattr(module, name)``
    when the stage runs: the parametrization runs then, with autograd, so gradients reach what it computes from (the
    adapter's matrices). A module whose parametrization is removed again (peft registers it for each forward) reads
    as its parameter. Held by a weak reference: the pipeline reading it is kept on the module itself."""

    _module: weakref.ReferenceType[torch.nn.Module]
    transposed: bool

    def __init__(self, owner: torch.nn.Module, name: str, transposed: bool = False) -> None:
        if not isinstance(getattr(owner, name, None), torch.Tensor):
            raise ValueError(f"{type(owner).__name__} has no tensor named {name!r}")
        self.__attrs_init__(name, type(owner).__name__, owner._parameters, owner._buffers,  # type: ignore[attr-defined]
                            weakref.ref(owner), transposed)

    def get(self) -> torch.Tensor:
        owner = self._module()
        if owner is None:
            raise ReferenceError(f"the {self.owner_type} whose {self.name} this stage reads was deleted")
        value = getattr(owner, self.name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.owner_type}.{self.name} is not a tensor (it is {type(value).__name__})")
        return value.transpose(-2, -1) if self.transposed else value

    def __repr__(self) -> str:
        return f"ParametrizedRef({self.owner_type}.{self.name}{', transposed' if self.transposed else ''})"


def parametrized(owner: torch.nn.Module, name: str) -> bool:
    """Whether ``owner.name`` is computed by a ``torch.nn.utils.parametrize`` parametrization (then it is no entry
    of the module's parameter or buffer table: its stored tensor is ``owner.parametrizations[name].original``)."""
    parametrizations = owner._modules.get("parametrizations")
    return parametrizations is not None and name in parametrizations._modules


@attrs.frozen(eq=False, init=False)
class LayerRef:
    """A stage's weak reference to the layer whose quant method it calls with the whole layer
    (``apply_without_routing_weights(layer, ...)``): a strong one would make the cycle layer ->
    pipeline -> stage -> layer. Such a stage lives as long as its layer; :meth:`get` after the layer
    was deleted raises ``ReferenceError``."""

    _ref: weakref.ReferenceType[torch.nn.Module]
    owner_type: str

    def __init__(self, layer: torch.nn.Module) -> None:
        self.__attrs_init__(weakref.ref(layer), type(layer).__name__)  # type: ignore[attr-defined]

    def get(self) -> torch.nn.Module:
        layer = self._ref()
        if layer is None:
            raise ReferenceError(f"the {self.owner_type} this stage computes for was deleted: a stage that calls "
                                 "its quant method with the whole layer lives only as long as the layer")
        return layer

    def __repr__(self) -> str:
        return f"LayerRef({self.owner_type})"


def optional_ref(owner: torch.nn.Module, name: str) -> Optional[ParamRef]:
    """A :class:`ParamRef` to ``owner.name``, or ``None`` when the module has it as ``None`` (an
    optional tensor such as a bias)."""
    return ParamRef(owner, name) if getattr(owner, name, None) is not None else None


TensorSource = Union[torch.Tensor, ParamRef]


def resolve(source: TensorSource) -> torch.Tensor:
    return source.get() if isinstance(source, ParamRef) else source
