"""Reading a quant method's experts from a per-expert checkpoint: the loop every method shares.

A quantized checkpoint stores each expert's projections as separate linear layers
(``experts.{i}.gate_proj.weight`` + ``weight_scale_inv``, ``experts.{i}.w1.qweight`` + ``scales`` ...).
What is the same for every format is owned here:

* the naming (``gate_proj`` / ``up_proj`` / ``down_proj`` or Mixtral's ``w1`` / ``w3`` / ``w2``,
  detected by :func:`moeforge.expert_naming.detect_naming`);
* the experts the layer holds (:func:`held_experts`: an expert-parallel rank reads the global ids of its
  ``expert_range``);
* the projections each expert has (a plain, non-gated activation reads ``up`` only), the gate and up
  rows joined in the activation's layout (concatenated or interleaved);
* the expert biases (``{projection}.bias``, float, cast to the layer's bias dtype);
* stacking the experts into the layer's ``[E, ...]`` tensors, named ``w13_<name>`` / ``w2_<name>``.

A quant method supplies one thing, :meth:`~moeforge.QuantMethod.read_projection`: one projection's
tensors in its format (rows = the projection's output features), e.g. ``{"weight": ..., "weight_scale":
...}``. Nothing is copied into the layer here: :func:`moeforge.checkpoint.load_weights` copies after
every check passed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol

import attrs
import torch

from moeforge.errors import CheckpointError
from moeforge.expert_naming import per_expert_projections
from moeforge.stages.activation import ActivationConfig, GateUpLayout


class Part(enum.Enum):
    """Which projection of an expert: its rows go to ``w13`` (gate, up) or ``w2`` (down)."""

    GATE = "gate"
    UP = "up"
    DOWN = "down"


@attrs.frozen
class Projection:
    """One expert projection to read: the checkpoint names its tensors ``{key}.<suffix>``
    (``key`` = ``"experts.3.gate_proj"``, relative to the block prefix), an ``[out_features,
    in_features]`` linear layer. ``interleaved``: its rows will be interleaved with the other half of
    gate/up (row ``2j`` gate ``j``, row ``2j + 1`` up ``j``), which a format whose scales span several
    rows (128x128 blocks) cannot hold."""

    key: str
    part: Part
    out_features: int
    in_features: int
    interleaved: bool = False


def held_experts(layer: torch.nn.Module, local_experts: int) -> range:
    """The global ids of the ``local_experts`` experts whose tensors ``layer`` holds, the ids a
    checkpoint names them by: ``layer.expert_range`` (an expert-parallel
    :class:`~moeforge.MoELayer` holds its rank's experts only, e.g. 2..3 of 4 on rank 1), or
    ``range(local_experts)`` for a module without one."""
    experts = getattr(layer, "expert_range", None)
    if experts is None:
        return range(local_experts)
    if not isinstance(experts, range) or len(experts) != local_experts:
        raise CheckpointError(f"{type(layer).__name__}.expert_range is {experts!r}, but its expert tensors hold "
                              f"{local_experts} experts")
    return experts


class ReadsProjections(Protocol):
    """What :func:`read_per_expert` asks of a quant method (:class:`~moeforge.QuantMethod` has it)."""

    @property
    def name(self) -> str: ...

    def expert_parameter_names(self, layer: torch.nn.Module) -> tuple[str, ...]: ...

    def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                        projection: Projection) -> dict[str, torch.Tensor]: ...


def read_per_expert(method: ReadsProjections, layer: torch.nn.Module,
                    tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``layer``'s expert tensors read from per-expert projections, each through
    ``method.read_projection``; every check runs before anything is returned. Raises
    :class:`CheckpointError` naming the key of a missing or misshapen tensor."""
    hidden, inter, activation = _sizes(layer)
    names = method.expert_parameter_names(layer)
    if not names:
        raise CheckpointError(f"{type(layer).__name__} holds no expert tensors of {method.name}")
    local = int(getattr(layer, names[0]).shape[0])
    gate, up, down = per_expert_projections(tensors.keys(), activation.gated)
    interleaved = activation.gated and activation.gate_up is GateUpLayout.INTERLEAVED
    bias13, bias2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
    parts: dict[str, list[torch.Tensor]] = {}
    for i in held_experts(layer, local):
        up_part = _read(method, layer, tensors, Projection(f"experts.{i}.{up}", Part.UP, inter, hidden, interleaved),
                        bias13)
        if activation.gated:
            gate_part = _read(method, layer, tensors,
                              Projection(f"experts.{i}.{gate}", Part.GATE, inter, hidden, interleaved), bias13)
            if set(gate_part) != set(up_part):
                raise CheckpointError(f"{method.name} read {sorted(gate_part)} for 'experts.{i}.{gate}' but "
                                      f"{sorted(up_part)} for 'experts.{i}.{up}'")
            up_part = {name: _join(gate_part[name], value, interleaved) for name, value in up_part.items()}
        down_part = _read(method, layer, tensors, Projection(f"experts.{i}.{down}", Part.DOWN, hidden, inter), bias2)
        for prefix, found in (("w13", up_part), ("w2", down_part)):
            for name, value in found.items():
                parts.setdefault(f"{prefix}_{name}", []).append(value)
    return {name: torch.stack(values) for name, values in parts.items()}


def _sizes(layer: torch.nn.Module) -> tuple[int, int, ActivationConfig]:
    hidden, inter = getattr(layer, "hidden_size", None), getattr(layer, "intermediate_size", None)
    activation = getattr(layer, "activation", None)
    if not isinstance(hidden, int) or not isinstance(inter, int) or not isinstance(activation, ActivationConfig):
        raise CheckpointError(f"{type(layer).__name__} needs hidden_size, intermediate_size and activation (as a "
                              "moeforge.MoELayer has) to read per-expert checkpoint tensors")
    return hidden, inter, activation


def _read(method: ReadsProjections, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
          projection: Projection, bias: object) -> dict[str, torch.Tensor]:
    found = dict(method.read_projection(layer, tensors, projection))
    if "bias" in found:
        raise CheckpointError(f"{method.name}.read_projection returned a 'bias': the loader reads the biases")
    if isinstance(bias, torch.Tensor):
        found["bias"] = _read_bias(tensors, f"{projection.key}.bias", projection.out_features, bias.dtype)
    return found


def _read_bias(tensors: Mapping[str, torch.Tensor], key: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(f"missing tensor '{key}' (the layer's experts have biases)")
    bias = tensors[key]
    if tuple(bias.shape) != (rows,) or not bias.dtype.is_floating_point:
        raise CheckpointError(f"tensor '{key}' is {bias.dtype} {tuple(bias.shape)}, expected float ({rows},)")
    return bias.to(dtype)


def _join(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Gate rows and up rows (each ``[I, ...]``) -> ``[2I, ...]`` in the activation's layout."""
    if interleaved:
        return torch.stack([gate, up], dim=1).flatten(0, 1)
    return torch.cat([gate, up])
