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
    if adapter is not None:  # its A (unless one shared by every expert) and B are per expert too
        expert_names |= {prefix + name for role in adapter.targets for name in ADAPTER_NAMES[role][adapter.shared_a:]}
    sharded: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key in expert_names:
            if tensor.dim() == 0 or tensor.shape[0] != ep.num_experts:
                raise InputError(f"'{key}' has shape {tuple(tensor.shape)}: expected the experts of the whole "
                                 f"layer ({ep.num_experts}) along dim 0")
            tensor = tensor[ep.first_expert:ep.first_expert + ep.local_experts]
        sharded[key] = tensor
    return sharded
