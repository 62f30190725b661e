"""How a layer of packed 4-bit expert weights holds them: plain (the checkpoint's bytes), or pre-shuffled for the
triton GEMMs (:mod:`moeforge.kernels.shuffle`), and the hooks that keep state dicts in the plain layout.

A method with a ``shuffled`` option (``Mxfp4Method``, ``Nvfp4Method``) records a :class:`StoredLayout` on the layer
when it creates the weights (:func:`record_layout`) and stores every write in it (:meth:`StoredLayout.stored`);
its weight references undo it when they dequantize (:meth:`StoredLayout.plain`). ``state_dict()`` gives the plain
bytes and ``load_state_dict`` takes them (hooks), so a shuffled layer and a plain one exchange state dicts and
checkpoints. Only the packed bytes and the rows of their scales move: per-expert global scales and biases do not.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from moeforge.errors import InputError
from moeforge.expert_weights import StoredLayout
from moeforge.stages.activation import ActivationConfig, GateUpLayout

PREFIXES = ("w13", "w2")  # the gate/up weight, the down weight
LAYOUT_ATTRIBUTE = "packed_weight_layout"  # the layer's StoredLayout, set by record_layout
HOOKS_ATTRIBUTE = "_packed_weight_layout_hooks"  # the handles of its state-dict hooks


@attrs.frozen
class PackedNames:
    """The names of a method's packed weight and its scales, ``{}`` standing for the prefix (``"{}_blocks"``)."""

    data: str
    scales: str

    def of(self, prefix: str) -> tuple[str, str]:
        return self.data.format(prefix), self.scales.format(prefix)


def stored_layout(layer: torch.nn.Module) -> StoredLayout:
    """The layout ``layer`` holds its packed weights in (plain for a layer that recorded none)."""
    layout = getattr(layer, LAYOUT_ATTRIBUTE, None)
    return layout if isinstance(layout, StoredLayout) else StoredLayout()


def record_layout(layer: torch.nn.Module, names: PackedNames, *, shuffled: bool, gated: bool) -> None:
    """Record on ``layer`` the layout its packed weights ``names`` are held in (``shuffled``: gate/up rows paired
    when ``gated`` and the layer's activation interleaves them) and, for a shuffled one, the state-dict hooks that
    give and take those tensors in the plain layout. Weights created again keep one pair of hooks, the new
    layout's."""
    activation = getattr(layer, "activation", None)
    interleaved = isinstance(activation, ActivationConfig) and activation.gate_up is GateUpLayout.INTERLEAVED
    layout = StoredLayout(shuffled, shuffled and gated and interleaved)
    setattr(layer, LAYOUT_ATTRIBUTE, layout)
    for handle in getattr(layer, HOOKS_ATTRIBUTE, ()):
        handle.remove()
    hooks = []
    if layout.shuffled:
        # (torch's hook registration is untyped)
        hooks.append(layer.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
            functools.partial(_plain_state_dict, layout, names)))
        hooks.append(layer.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
            functools.partial(_stored_state_dict, layout, names)))
    setattr(layer, HOOKS_ATTRIBUTE, tuple(hooks))


def store_expert(layer: torch.nn.Module, names: PackedNames, prefix: str, expert: int, data: torch.Tensor,
                 scales: torch.Tensor) -> None:
    """Copy one expert's plain packed ``data`` and ``scales`` into ``layer``'s tensors, in its layout."""
    data_name, scales_name = names.of(prefix)
    target = getattr(layer, data_name)
    stored, stored_scales = stored_layout(layer).of(prefix).stored(data.reshape(target.shape[1:]), scales)
    with torch.no_grad():
        target[expert].copy_(stored)
        getattr(layer, scales_name)[expert].copy_(stored_scales)


def check_gate_up_rows(layout: StoredLayout, activation: ActivationConfig, method: str) -> None:
    """Raise InputError if a layer shuffled for one gate/up row layout is asked to run the other."""
    interleaved = activation.gated and activation.gate_up is GateUpLayout.INTERLEAVED
    if layout.shuffled and layout.paired != interleaved:
        rows = "interleaved" if layout.paired else "concatenated"
        raise InputError(f"the layer's {method} weights were shuffled for {rows} gate/up rows, but the experts run "
                         f"{activation.summary()}: build the layer with the activation it runs")


def _plain_state_dict(layout: StoredLayout, names: PackedNames, module: torch.nn.Module, state_dict: dict[str, Any],
                      prefix: str, local_metadata: Any) -> None:
    """A ``state_dict`` post-hook: the packed weights and scales in the plain layout."""
    for name in PREFIXES:
        data, scales = (prefix + key for key in names.of(name))
        if data in state_dict and scales in state_dict:
            state_dict[data], state_dict[scales] = layout.of(name).plain(state_dict[data], state_dict[scales])


def _stored_state_dict(layout: StoredLayout, names: PackedNames, module: torch.nn.Module, state_dict: dict[str, Any],
                       prefix: str, *args: Any) -> None:
    """A ``load_state_dict`` pre-hook: plain packed weights and scales into ``layout`` (tensors of another shape or
    dtype are left for ``load_state_dict`` to report)."""
    for name in PREFIXES:
        data_name, scales_name = names.of(name)
        data, scales = prefix + data_name, prefix + scales_name
        if data not in state_dict or scales not in state_dict:
            continue
        target, target_scales = getattr(module, data_name, None), getattr(module, scales_name, None)
        value, value_scales = state_dict[data], state_dict[scales]
        tensors = (target, target_scales, value, value_scales)
        if all(isinstance(t, torch.Tensor) for t in tensors) and value.dtype == torch.uint8 \
                and [t.shape for t in tensors[2:]] == [t.shape for t in tensors[:2]]:  # type: ignore[union-attr]
            state_dict[data], state_dict[scales] = layout.of(name).stored(value, value_scales)
