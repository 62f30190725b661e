"""moeforge's expert adapters in peft's layout, both ways: what peft's LoRA on the experts' parameters
(``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``) holds is what an
:class:`~moeforge.adapters.ExpertAdapter` holds, laid out otherwise.

peft keeps one pair per expert parameter ``[E, N, K]`` (``[E, K, N]`` where transposed): ``lora_A [E · r, K]``, the
experts' ``A [r, K]`` one after the other, and ``lora_B [N, r · E]``, whose column ``j · E + e`` is column ``j`` of
expert ``e``'s ``B [N, r]``; its update of expert ``e`` is ``scaling · B_e A_e``, ``scaling = lora_alpha / r`` —
moeforge's ``A [E, r, K]``, ``B [E, N, r]`` and ``scale``. :func:`to_peft` and :func:`load_peft` convert a layer's
adapter; :func:`peft_experts_tensors` reads them off a peft-wrapped ``transformers`` experts module (no import of
peft: it walks the wrappers' ``parameter_name``, ``lora_A``, ``lora_B`` and ``scaling``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from moeforge.adapters import ADAPTER_NAMES
from moeforge.errors import InputError
from moeforge.stages.gemm import GemmRole

# The transformers experts' parameter each adapted GEMM reads.
PEFT_NAMES = {GemmRole.GATE_UP: "gate_up_proj", GemmRole.DOWN: "down_proj"}


def _adapter(layer: Any) -> Any:
    adapter = getattr(layer, "adapter", None)
    if adapter is None:
        raise InputError(f"{type(layer).__name__} has no expert adapter: build it with adapter=ExpertAdapter(...)")
    return adapter


def to_peft(layer: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{parameter name: (lora_A [E · r, K], lora_B [N, r · E])}`` of ``layer``'s adapter in peft's layout (copies;
    a shared ``A`` repeated for every expert); its ``scaling`` is ``layer.adapter.scale``."""
    adapter = _adapter(layer)
    tensors = {}
    for role in GemmRole:
        if role not in adapter.targets:
            continue
        name_a, name_b = ADAPTER_NAMES[role]
        a, b = getattr(layer, name_a).detach(), getattr(layer, name_b).detach()
        experts, out_features, rank = b.shape
        a = a.expand(experts, -1, -1)
        tensors[PEFT_NAMES[role]] = (a.reshape(experts * rank, a.shape[2]).clone(),
                                     b.permute(1, 2, 0).reshape(out_features, rank * experts).clone())
    return tensors


def load_peft(layer: torch.nn.Module, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
              scaling: float) -> None:
    """Fill ``layer``'s adapter from peft's ``{parameter name: (lora_A, lora_B)}`` with ``scaling``: every targeted
    GEMM's pair must be there, of the layer's experts, rank and widths, and ``scaling`` must be the adapter's scale
    (``InputError`` naming what differs). A layer whose adapter shares ``A`` takes only equal experts' ``A``."""
    adapter = _adapter(layer)
    if not math.isclose(scaling, adapter.scale, rel_tol=1e-6):
        raise InputError(f"peft's scaling {scaling:g} (lora_alpha / r) differs from the layer's adapter scale "
                         f"{adapter.scale:g}: build the layer with ExpertAdapter(rank=r, alpha=lora_alpha)")
    for role in GemmRole:
        if role not in adapter.targets:
            continue
        name = PEFT_NAMES[role]
        if name not in tensors:
            raise InputError(f"peft's adapter has no pair for {name!r} (has {sorted(tensors)}); the layer's adapter "
                             f"targets the {role.value} GEMM")
        name_a, name_b = ADAPTER_NAMES[role]
        a_param, b_param = getattr(layer, name_a), getattr(layer, name_b)
        experts, out_features, rank = b_param.shape
        peft_a, peft_b = tensors[name]
        if tuple(peft_a.shape) != (experts * rank, a_param.shape[2]) or tuple(peft_b.shape) != (out_features,
                                                                                                rank * experts):
            raise InputError(f"peft's {name} pair is lora_A {tuple(peft_a.shape)}, lora_B {tuple(peft_b.shape)}; this "
                             f"layer's adapter needs [{experts * rank}, {a_param.shape[2]}] and "
                             f"[{out_features}, {rank * experts}] ({experts} experts, rank {rank})")
        a = peft_a.reshape(experts, rank, -1)
        if a_param.shape[0] == 1:
            if not torch.equal(a, a[:1].expand_as(a)):
                raise InputError(f"peft's {name} has one A per expert; this layer's adapter shares one (shared_a=True)")
            a = a[:1]
        with torch.no_grad():
            a_param.copy_(a)
            b_param.copy_(peft_b.reshape(out_features, rank, experts).permute(2, 0, 1))


def peft_experts_tensors(experts: torch.nn.Module, adapter_name: str = "default"
                         ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """``({parameter name: (lora_A, lora_B)}, scaling)`` of a ``transformers`` experts module wrapped by peft's
    parameter LoRA (one wrapper per targeted parameter, each around the next). Raises ``InputError`` for a module
    that carries none, or pairs of different scalings."""
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings = set()
    module: Any = experts  # peft's wrappers, read by their attributes
    while hasattr(module, "parameter_name") and hasattr(module, "lora_A"):
        tensors[module.parameter_name] = (module.lora_A[adapter_name].weight.detach(),
                                          module.lora_B[adapter_name].weight.detach())
        scalings.add(float(module.scaling[adapter_name]))
        module = module.base_layer
    if not tensors:
        raise InputError(f"{type(experts).__name__} carries no peft LoRA on its parameters (target_parameters)")
    if len(scalings) != 1:
        raise InputError(f"peft's pairs on {sorted(tensors)} have different scalings {sorted(scalings)}: one "
                         "moeforge adapter has one scale")
    return tensors, scalings.pop()
