"""Slice a whole layer's state dict to the experts one expert-parallel rank owns."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeforge.adapters import ADAPTER_NAMES
from moeforge.errors import InputError
from moeforge.quant.base import QuantMethod


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], layer: torch.nn.Module,
                     prefix: str = "") -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` (of a layer holding all experts) that ``layer`` — an
    expert-parallel :class:`~moeforge.MoELayer` — loads: its quant method's per-expert tensors
    sliced to the rank's expert range (and its expert adapter's, :mod:`moeforge.adapters`), everything else (router,
    selection bias, shared experts, an adapter's shared ``A``) as it is. ``layer.load_state_dict(shard_state_dict(full.state_dict(), layer))``."""
    ep = getattr(layer, "expert_parallel", None)
    if ep is None:
        raise InputError("shard_state_dict needs an expert-parallel layer (MoELayer(..., expert_parallel=...))")
    quant = getattr(layer, "quant")
    assert isinstance(quant, QuantMethod)
    expert_names = {prefix + name for name in quant.expert_parameter_names(layer)}
    adapter = getattr(layer, "adapter", None)
    adapter_names: set[str] = set()
    if adapter is not None:  # its A (unless one shared by every expert) and B are per expert too
        adapter_names = {prefix + name for role in adapter.targets for name in ADAPTER_NAMES[role][adapter.shared_a:]}
    stacked = adapter is not None and adapter.stacked
    sharded: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key in expert_names or key in adapter_names:
            dim = 1 if stacked and key in adapter_names else 0  # a stack's matrices: [count, experts, ...]
            if tensor.dim() <= dim or tensor.shape[dim] != ep.num_experts:
                raise InputError(f"'{key}' has shape {tuple(tensor.shape)}: expected the experts of the whole "
                                 f"layer ({ep.num_experts}) along dim {dim}")
            tensor = tensor.narrow(dim, ep.first_expert, ep.local_experts)
        sharded[key] = tensor
    return sharded
