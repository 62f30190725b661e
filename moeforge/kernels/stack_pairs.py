# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The (adapter, expert) pair of each copy for a stack of expert adapters, on the device, in two launches.

A stack of ``S`` adapters over ``E`` experts aligns the copies a second time, by pair ``adapter * E + expert``
(:mod:`moeforge.adapters`), from each copy's adapter id (``-1``: none) and its expert. :func:`stack_pairs` gives, in
copy order: the pair key (int32), the copy's adapter clamped into the stack (``chosen``, 0 for none or an id outside
it) and the weight of its low-rank product (``used``: the adapters' ``scale`` for an adapter, 0 for none, NaN for an
id outside ``[-1, S)``, which the stages cannot refuse on the device without waiting for it). Each copy's expert is given
(``copy_experts``, where the dispatcher knows it) or read off the block alignment: the expert of the block each
copy's slot lies in, a copy placed in no slot taking expert 0. One launch over the copies writes all three (the
key with the given expert, or expert 0); without ``copy_experts`` a second over the alignment's slots writes each
placed copy's key with its block's expert: two launches at most, where the same computation in torch takes a
launch per elementwise step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv

_BLOCK = 1024


@triton.jit
def copy_adapters(ids_ptr, copies, mask, stack, scale):
    """``(chosen, used)`` of the copies ``copies`` (where ``mask``): each one's adapter clamped into the stack (0 for
    none or an id outside it) and the weight of its low-rank product (see the module docstring)."""
    ids = tl.load(ids_ptr + copies, mask=mask, other=-1).to(tl.int32)
    inside = (ids >= -1) & (ids < stack)
    chosen = tl.where(inside, tl.maximum(ids, 0), 0)
    used = tl.where(inside, (ids >= 0).to(tl.float32) * scale, float("nan"))
    return chosen, used


@triton.jit
def _copies_kernel(ids_ptr, experts_ptr, keys_ptr, chosen_ptr, used_ptr, num_copies, stack, num_experts, scale,
                   HAS_EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_copies
    chosen, used = copy_adapters(ids_ptr, offs, mask, stack, scale)
    expert = tl.zeros_like(chosen)
    if HAS_EXPERTS:
        expert = tl.load(experts_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(keys_ptr + offs, chosen * num_experts + expert, mask=mask)
    tl.store(chosen_ptr + offs, chosen, mask=mask)
    tl.store(used_ptr + offs, used, mask=mask)


@triton.jit
def _slots_kernel(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, chosen_ptr, keys_ptr, slots, num_copies,
                  num_experts, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    copy = tl.load(sorted_ids_ptr + slot, mask=slot < slots, other=num_copies)
    placed = (slot < tl.load(num_padded_ptr)) & (copy < num_copies)
    expert = tl.load(block_expert_ptr + slot // BLOCK_M, mask=placed, other=0)
    chosen = tl.load(chosen_ptr + copy, mask=placed, other=0)
    tl.store(keys_ptr + copy, chosen * num_experts + expert, mask=placed)


def stack_pairs(ids: torch.Tensor, copy_experts: Optional[torch.Tensor], sorted_ids: torch.Tensor,
                block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int, stack: int, num_experts: int,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, chosen, used)`` for the copies' adapter ids ``ids [C]`` (any integer dtype; see the module
    docstring): ``keys`` and ``chosen`` int32, ``used`` fp32 (``scale`` for a copy with an adapter), each ``[C]``. ``copy_experts [C]`` each copy's
    expert, or ``None`` to read it off the alignment (``sorted_ids``, ``block_expert``, ``num_padded``, by
    ``block_m``)."""
    ids = ids.reshape(-1)
    copies = ids.numel()
    keys = torch.empty(copies, dtype=torch.int32, device=ids.device)
    chosen = torch.empty(copies, dtype=torch.int32, device=ids.device)
    used = torch.empty(copies, dtype=torch.float32, device=ids.device)
    if copies == 0:
        return keys, chosen, used
    has_experts = copy_experts is not None

    def copies_launch() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(HAS_EXPERTS=has_experts, BLOCK=_BLOCK), dict(num_warps=4)

    _COPIES.launch(("copies", has_experts), (cdiv(copies, _BLOCK),),
                   (ids, copy_experts.reshape(-1) if copy_experts is not None else ids, keys, chosen, used, copies,
                    stack, num_experts, float(scale)), copies_launch)
    if copy_experts is None:
        slots = sorted_ids.numel()

        def slots_launch() -> tuple[dict[str, Any], dict[str, Any]]:
            return dict(BLOCK_M=block_m, BLOCK=_BLOCK), dict(num_warps=4)

        _SLOTS.launch(("slots", block_m), (cdiv(slots, _BLOCK),),
                      (sorted_ids, block_expert, num_padded, chosen, keys, slots, copies, num_experts), slots_launch)
    return keys, chosen, used


_COPIES = LaunchSite(_copies_kernel)
_SLOTS = LaunchSite(_slots_kernel)
