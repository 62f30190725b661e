"""moeforge's expert adapters in peft's layout, both ways: what peft's LoRA on the experts' parameters
(``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``) holds is what an
:class:`~moeforge.adapters.ExpertAdapter` holds, laid out otherwise.

peft keeps one pair per expert parameter ``[E, N, K]`` (``[E, K, N]`` where transposed): ``lora_A [E · r, K]``, the
experts' ``A [r, K]`` one after the other, and ``lora_B [N, r · E]``, whose column ``j · E + e`` is column ``j`` of
expert ``e``'s ``B [N, r]``; its update of expert ``e`` is ``scaling · B_e A_e``, ``scaling = lora_alpha / r`` —
moeforge's ``A [E, r, K]``, ``B [E, N, r]`` and ``scale``. :func:`to_peft` and :func:`load_peft` convert a layer's
adapter; :func:`peft_experts_tensors` reads them off a peft-wrapped ``transformers`` experts module (no import of
peft: it walks the wrappers' ``parameter_name``, ``lora_A``, ``lora_B`` and ``scaling``).

:func:`save_peft_adapter` and :func:`load_peft_adapter` do the same for a whole model patched by
:func:`moeforge.hf.patch_model`, in peft's adapter directory (``adapter_config.json`` and
``adapter_model.safetensors``): what ``PeftModel.from_pretrained`` loads onto the unpatched model, and what
``save_pretrained`` wrote. peft wraps an experts module once per targeted parameter, the first of its parameters
innermost, and names each pair by its place in that nest: ``<block>.experts.base_layer.lora_A.weight`` for
``gate_up_proj`` under ``<block>.experts.lora_A.weight`` for ``down_proj`` when both are targeted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

from moeforge.adapters import ADAPTER_NAMES
from moeforge.errors import InputError
from moeforge.stages.gemm import GemmRole

# The transformers experts' parameter each adapted GEMM reads.
PEFT_NAMES = {GemmRole.GATE_UP: "gate_up_proj", GemmRole.DOWN: "down_proj"}


def _adapter(layer: Any, index: Optional[int]) -> Any:
    adapter = getattr(layer, "adapter", None)
    if adapter is None:
        raise InputError(f"{type(layer).__name__} has no expert adapter: build it with adapter=ExpertAdapter(...)")
    if adapter.stacked and (not isinstance(index, int) or not 0 <= index < adapter.count):
        raise InputError(f"peft's format holds one adapter; this layer's is a stack of {adapter.count}: name which one "
                         f"(index in [0, {adapter.count})), got index={index!r}")
    if not adapter.stacked and index is not None:
        raise InputError(f"index picks an adapter of a stack (ExpertAdapter(count=...)); this layer has one, got "
                         f"index={index!r}")
    return adapter


def _matrices(layer: Any, role: GemmRole, index: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(A, B)`` parameters of ``role``'s adapter (a stack's ``index``-th: views of the stack's parameters)."""
    name_a, name_b = ADAPTER_NAMES[role]
    a, b = getattr(layer, name_a), getattr(layer, name_b)
    return (a[index], b[index]) if index is not None else (a, b)


def to_peft(layer: torch.nn.Module, index: Optional[int] = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{parameter name: (lora_A [E · r, K], lora_B [N, r · E])}`` of ``layer``'s adapter in peft's layout (copies;
    a shared ``A`` repeated for every expert); its ``scaling`` is ``layer.adapter.scale``. ``index``: which adapter of
    a stack (``ExpertAdapter(count=...)``; required there, refused elsewhere)."""
    adapter = _adapter(layer, index)
    tensors = {}
    for role in GemmRole:
        if role not in adapter.targets:
            continue
        a, b = (matrix.detach() for matrix in _matrices(layer, role, index))
        experts, out_features, rank = b.shape
        a = a.expand(experts, -1, -1)
        tensors[PEFT_NAMES[role]] = (a.reshape(experts * rank, a.shape[2]).clone(),
                                     b.permute(1, 2, 0).reshape(out_features, rank * experts).clone())
    return tensors


def load_peft(layer: torch.nn.Module, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
              scaling: float, index: Optional[int] = None) -> None:
    """Fill ``layer``'s adapter from peft's ``{parameter name: (lora_A, lora_B)}`` with ``scaling``: every targeted
    GEMM's pair must be there, of the layer's experts, rank and widths, and ``scaling`` must be the adapter's scale
    (``InputError`` naming what differs). A layer whose adapter shares ``A`` takes only equal experts' ``A``.
    ``index``: which adapter of a stack to fill (many peft fine-tunes of one base, served together)."""
    adapter = _adapter(layer, index)
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
        a_param, b_param = _matrices(layer, role, index)
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


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What peft's file keys start with: the PeftModel's base_model (a LoraModel) and its model.
FILE_PREFIX = "base_model.model."


def _adapted_blocks(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(path, block)`` of each block :func:`moeforge.hf.patch_model` made whose layer has an adapter."""
    from moeforge.hf import HFMoEBlock

    for path, module in model.named_modules():
        if isinstance(module, HFMoEBlock) and getattr(module.layer, "adapter", None) is not None:
            yield path, module


def _nest(block: Any, targeted: list[str]) -> dict[str, str]:
    """``{parameter name: key infix}`` of peft's wrappers on ``block``'s original experts module: the first targeted
    parameter (in the module's own order) innermost, ``.base_layer`` once for each wrapper around it."""
    if getattr(block.family, "EXPERTS_TRANSPOSED", False):
        raise InputError(f"{block.original_class} stores its experts transposed ([E, K, N]); peft's pairs on them are laid "
                         "out otherwise, which moeforge does not convert yet")
    order = [name for name, _ in block.original.experts.named_parameters(recurse=False) if name in targeted]
    missing = sorted(set(targeted) - set(order))
    if missing:
        raise InputError(f"{block.original_class}'s experts have no parameter {missing} (have "
                         f"{[name for name, _ in block.original.experts.named_parameters(recurse=False)]})")
    return {name: ".base_layer" * (len(order) - 1 - index) for index, name in enumerate(order)}


def save_peft_adapter(model: torch.nn.Module, directory: Union[str, Path],
                      base_model_name_or_path: Optional[str] = None, index: Optional[int] = None) -> Path:
    """Write the adapters of ``model``'s patched blocks (:func:`moeforge.hf.patch_model` with
    ``adapter=ExpertAdapter(...)``) as peft's adapter directory, for ``PeftModel.from_pretrained`` on the unpatched
    model: ``adapter_config.json`` (LoRA, ``target_parameters`` the experts' parameters, ``r`` and ``lora_alpha`` of
    the adapters: one rank, scale and target set for all) and ``adapter_model.safetensors``; of a stack, its
    ``index``-th adapter. Returns the directory."""
    from safetensors.torch import save_file

    blocks = list(_adapted_blocks(model))
    if not blocks:
        raise InputError(f"{type(model).__name__} has no block patched by moeforge.hf.patch_model with an expert adapter")
    kinds = {(block.layer.adapter.rank, block.layer.adapter.scale, block.layer.adapter.targets) for _, block in blocks}
    if len(kinds) != 1:
        raise InputError(f"peft's config holds one rank, scale and target set for its pairs; these blocks' adapters differ "
                         f"({sorted((rank, scale, sorted(r.value for r in targets)) for rank, scale, targets in kinds)})")
    rank, scale, targets = kinds.pop()
    tensors: dict[str, torch.Tensor] = {}
    target_parameters = set()
    for path, block in blocks:
        pairs = to_peft(block.layer, index)
        nest = _nest(block, sorted(pairs))
        for name, (lora_a, lora_b) in pairs.items():
            key = f"{FILE_PREFIX}{path}.experts{nest[name]}"
            tensors[f"{key}.lora_A.weight"] = lora_a.contiguous()
            tensors[f"{key}.lora_B.weight"] = lora_b.contiguous()
            target_parameters.add(f"{path}.experts.{name}")
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "target_modules": [],
        "target_parameters": sorted(target_parameters), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "task_type": None, "base_model_name_or_path": base_model_name_or_path,
    }
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def load_peft_adapter(model: torch.nn.Module, directory: Union[str, Path], index: Optional[int] = None) -> None:
    """Fill the adapters of ``model``'s patched blocks from peft's adapter directory (``save_pretrained`` of a peft
    model with LoRA on the experts' parameters, or :func:`save_peft_adapter`). Each adapted block takes the pairs of
    its experts module; its adapter's rank, scale (``lora_alpha / r``, ``lora_alpha / sqrt(r)`` with rsLoRA) and
    targets must match the file's. Raises ``InputError`` for what moeforge does not load (DoRA, LoRA biases, per-module
    ranks or scales, pairs on other modules than the experts' parameters) and for pairs left over or missing. ``index``:
    which adapter of a stack it fills (one peft fine-tune per index: many served together)."""
    from safetensors.torch import load_file

    folder = Path(directory)
    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{folder / CONFIG_FILE} is a {config.get('peft_type')} adapter; moeforge loads LoRA")
    unsupported = [name for name in ("use_dora", "lora_bias") if config.get(name)]
    unsupported += [name for name in ("rank_pattern", "alpha_pattern") if config.get(name)]
    if config.get("target_modules"):
        unsupported.append(f"target_modules {config['target_modules']}")
    if unsupported:
        raise InputError(f"{folder / CONFIG_FILE} uses {', '.join(unsupported)}: moeforge loads LoRA on the experts' "
                         "parameters only (one rank and scale, no DoRA or bias); load the rest with peft")
    rank = int(config["r"])
    scaling = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    unused = set(tensors)
    blocks = list(_adapted_blocks(model))
    if not blocks:
        raise InputError(f"{type(model).__name__} has no block patched by moeforge.hf.patch_model with an expert adapter")
    targets = config.get("target_parameters") or []
    for path, block in blocks:
        names = [PEFT_NAMES[role] for role in GemmRole if role in block.layer.adapter.targets]
        # The parameters peft targeted here (its own matching: the full name, or a suffix after a dot).
        in_file = [name for name in PEFT_NAMES.values()
                   if any(f"{path}.experts.{name}" == t or f"{path}.experts.{name}".endswith(f".{t}") for t in targets)]
        if sorted(in_file) != sorted(names):
            raise InputError(f"{folder / CONFIG_FILE} targets {sorted(in_file)} of {path}'s experts; its layer's adapter "
                             f"targets {sorted(names)}")
        if block.layer.adapter.rank != rank:
            raise InputError(f"{folder / CONFIG_FILE} has rank {rank}; {path}'s adapter has rank "
                             f"{block.layer.adapter.rank}: build it with ExpertAdapter(rank={rank}, ...)")
        nest = _nest(block, names)
        pairs = {}
        for name in names:
            key = f"{FILE_PREFIX}{path}.experts{nest[name]}"
            found = [f"{key}.lora_A.weight", f"{key}.lora_B.weight"]
            if any(item not in tensors for item in found):
                raise InputError(f"{folder / WEIGHTS_FILE} has no pair {key}.lora_A/B for {path}'s {name} (the layer's "
                                 f"adapter targets {sorted(names)})")
            pairs[name] = (tensors[found[0]], tensors[found[1]])
            unused.difference_update(found)
        load_peft(block.layer, pairs, scaling, index)
    if unused:
        raise InputError(f"{folder / WEIGHTS_FILE} holds pairs no adapted block took: {sorted(unused)[:4]}"
                         f"{' ...' if len(unused) > 4 else ''} (patch those blocks with an adapter of these targets)")
