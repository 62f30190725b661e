"""Checks of user-supplied forward arguments: clear errors instead of silent wrong answers.

Shape, dtype and device checks read only tensor metadata (no host sync) and always run; the
non-finite check reads values and runs only in debug mode.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from moeforge.errors import InputError

FLOAT_TYPES = (torch.bfloat16, torch.float16, torch.float32)
LOGIT_TYPES = FLOAT_TYPES + (torch.float64,)  # routing runs in fp32 whatever the logits' dtype


def check_hidden_states(
    x: object, hidden_size: int, dtype: torch.dtype, device: torch.device, debug: bool = False
) -> torch.Tensor:
    if device.type == "meta":
        # The only meta output would be an empty tensor of the input's shape, standing in for a computation
        # (routing, dispatch sizes) that reads values meta tensors do not have: an error says so instead.
        raise InputError("the layer is on the meta device: its weights hold no data, so it cannot run; "
                         "materialise it first with layer.to_empty(device=...) (e.g. 'cuda' or 'cpu'), then fill "
                         "its weights (moeforge.checkpoint.load_weights, or load_state_dict)")
    if not isinstance(x, torch.Tensor):
        raise InputError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != hidden_size:
        raise InputError(
            f"hidden_states must be [tokens, {hidden_size}] or [batch, seq, {hidden_size}], "
            f"got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise InputError(f"hidden_states must have the layer's dtype {dtype}, got {x.dtype}")
    if x.device != device:
        raise InputError(f"hidden_states must be on the layer's device {device}, got {x.device}")
    if debug:
        _check_finite(x, "hidden_states")
    return x


def _check_finite(tensor: torch.Tensor, name: str) -> None:
    """Reads values (a host synchronisation): debug mode only."""
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise InputError(f"{name} contain {bad} non-finite values (NaN or inf)")


def check_router_logits(
    logits: object, hidden_shape: torch.Size, num_experts: int, device: torch.device, debug: bool
) -> torch.Tensor:
    """``logits`` as ``[T, E]``, row ``t`` routing token ``t`` of the hidden states flattened to ``[T, H]``.

    Accepted: ``[T, E]`` for hidden states ``[T, H]``; ``[B, S, E]`` or ``[B * S, E]`` (what a router
    applied to the flattened tokens returns) for ``[B, S, H]``. Any other shape with the same number of
    elements (batch and sequence swapped, an extra dimension) would pair tokens with another token's
    logits, so it is refused."""
    if not isinstance(logits, torch.Tensor):
        raise InputError(f"router_logits must be a torch.Tensor, got {type(logits).__name__}")
    lead = hidden_shape[:-1]
    tokens = math.prod(lead)
    paired = logits.shape[:-1] == lead or (len(lead) > 1 and logits.dim() == 2 and logits.shape[0] == tokens)
    if logits.shape[-1:] != (num_experts,) or not paired:
        accepted = [tuple(lead)] if len(lead) == 1 else [tuple(lead), (tokens,)]
        wanted = " or ".join(str(list(shape + (num_experts,))) for shape in accepted)
        raise InputError(
            f"router_logits must be {wanted} (the hidden states' tokens x {num_experts} experts) for "
            f"hidden_states of shape {tuple(hidden_shape)}, got router_logits of shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_TYPES:
        raise InputError(f"router_logits must be a float tensor (bf16, fp16, fp32, fp64), got {logits.dtype}")
    if logits.device != device:
        raise InputError(f"router_logits must be on the layer's device {device}, got {logits.device}")
    if debug:
        _check_finite(logits, "router_logits")
    return logits.reshape(tokens, num_experts)


def check_topk_ids(ids: torch.Tensor, num_experts: int) -> None:
    """For user-supplied routing: every expert id must lie in ``[0, num_experts)`` (reads values)."""
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_experts:
            raise InputError(f"expert ids must be in [0, {num_experts}), got values in [{low}, {high}]")


def first_device(module: torch.nn.Module) -> Optional[torch.device]:
    for param in module.parameters():
        return param.device
    return None
