"""Hugging Face ``transformers`` interop: convert an MoE block, or patch every block of a model.

Nothing here imports ``transformers``: blocks are recognised by class name through
:mod:`moeforge.families`, so this module works with whatever version the caller has installed.

What a patched model looks like
-------------------------------
:func:`patch_model` replaces each supported block (e.g. ``model.layers.3.mlp``, a
``MixtralSparseMoeBlock``) by an :class:`HFMoEBlock` at the same path. Its only child is the
:class:`~moeforge.MoELayer` it runs, ``layer``, so the patched model's ``parameters()`` and
``state_dict()`` hold every tensor of the block exactly once, under moeforge's names::

    model.layers.3.mlp.layer.router.weight            # was  model.layers.3.mlp.gate.weight
    model.layers.3.mlp.layer.w13_weight                # was  model.layers.3.mlp.experts.gate_up_proj
    model.layers.3.mlp.layer.w2_weight                 # was  model.layers.3.mlp.experts.down_proj
    (+ layer.e_score_correction_bias, layer.w13_bias / w2_bias, layer.shared_experts.* where the
     family has them)

These are the tensors the forward reads — for families whose converter copies or re-lays weights
(GPT-OSS, Llama-4, fused shared experts) the block's original tensors are no longer used — so
training, ``load_state_dict`` and ``model.to(...)`` act on the right ones, and ``torch.save`` /
``safetensors`` see no aliased tensors. A patched model's ``state_dict()`` therefore loads into
another model patched the same way, not into an unpatched one (``save_pretrained`` writes these
names too, under whatever block prefix ``transformers`` saves to; ``from_pretrained`` of the
unpatched class does not read them). To start from a Hugging Face checkpoint, load the unpatched model and patch it, or fill a layer with
:func:`moeforge.checkpoint.load_weights`.

Each layer is built on its block's device and dtype, and ``backend="auto"`` is resolved then (triton
on CUDA, torch on CPU): patch after moving the model to its device. ``model.to(dtype)`` after
patching is followed (the layers adopt the new dtype); a model patched on the CPU and moved to a GPU
keeps the torch backend.

The original block is kept, outside the module tree, only for its settings (``hf_output`` reads
e.g. its router's ``top_k``); its tensors are released (replaced by ``meta`` tensors) so that a
converter's copies do not double the model's memory. Do not run an original block after patching.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Optional

import attrs
import torch
from torch import nn

from moeforge.errors import MoEForgeError
from moeforge.families import block_classes
from moeforge.layer import MoELayer

# Converters take the dtype and device from the block's own tensors: a patched block must take and
# return the activations of the model around it.
_FORBIDDEN_PATCH_KWARGS = ("dtype", "device")


def from_hf(block: nn.Module, **layer_kwargs: Any) -> MoELayer:
    """A :class:`MoELayer` with ``block``'s weights and semantics (see :mod:`moeforge.families`).

    ``layer_kwargs`` (e.g. ``backend``, ``debug``) are passed to the layer. The layer shares the
    block's storage where the layouts agree (see each family's notes). An :class:`HFMoEBlock` gives
    back the layer it runs. Raises ``TypeError`` for a block of an unsupported class."""
    if not isinstance(block, nn.Module):
        raise TypeError(f"from_hf: block must be a transformers MoE block (a torch.nn.Module, e.g. "
                        f"model.model.layers[0].mlp), got {type(block).__name__}")
    if isinstance(block, HFMoEBlock):
        return block.layer
    classes = block_classes()
    module = classes.get(type(block).__name__)
    if module is None:
        raise TypeError(f"no moeforge converter for {type(block).__name__}; supported blocks: "
                        f"{', '.join(sorted(classes))}")
    layer: MoELayer = module.from_hf(block, **layer_kwargs)
    return layer


class HFMoEBlock(nn.Module):
    """Drop-in replacement of a ``transformers`` MoE block: runs a :class:`MoELayer` and returns
    what the original block returned (a tensor, or a tuple with router logits / scores), through
    the family's ``hf_output``.

    Its only child is ``layer`` (see the module notes for its ``state_dict``). After
    ``model.to(dtype)`` the layer adopts the new floating dtype of its expert weights."""

    def __init__(self, layer: MoELayer, family: ModuleType, original: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.family_name: str = family.NAME
        self.original_class: str = type(original).__name__
        # By module name, not the module object: a patched model must stay deep-copyable and picklable.
        self._family_module: str = family.__name__
        # hf_output may read the block's settings; a list keeps it out of the module tree.
        self._original = [original]
        # The original forward's first parameter (``hidden_states``; Granite calls it ``layer_input``):
        # callers passing it by keyword keep working.
        self._input_name = _first_parameter(original)
        self.train(original.training)

    @property
    def original(self) -> nn.Module:
        """The replaced block (its tensors released: settings only)."""
        return self._original[0]

    @property
    def family(self) -> ModuleType:
        """The family module that converted the block (:mod:`moeforge.families`)."""
        return importlib.import_module(self._family_module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden_states = self._hidden_states(args, kwargs)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.layer.router_logits(x)
        out = self.layer(x, logits).reshape(shape)
        _record_router_logits(logits)
        return self.family.hf_output(self._original[0], out, logits)

    def _hidden_states(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        if len(args) == 1 and not kwargs:
            value = args[0]
        elif not args and set(kwargs) == {self._input_name}:
            value = kwargs[self._input_name]
        else:
            # The replaced blocks take exactly one argument: anything else would be silently ignored.
            given = [f"{len(args)} positional"] + [f"{name}=" for name in kwargs]
            raise TypeError(f"{self.original_class} (patched by moeforge) takes one argument "
                            f"'{self._input_name}', got {', '.join(given)}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.original_class} (patched by moeforge): '{self._input_name}' must be a "
                            f"tensor, got {type(value).__name__}")
        return value

    def extra_repr(self) -> str:
        return f"replaces {self.original_class} ({self.family_name})"


def _record_router_logits(logits: torch.Tensor) -> None:
    """Give the router logits to ``transformers``' output capture (``output_router_logits=True``, the
    auxiliary load-balancing loss). ``transformers`` 5 records them with a forward hook on the
    family's router module, which the patched block no longer calls; every supported family
    records the raw ``[T, E]`` logits. Versions without this mechanism are left alone."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    if collector is None:
        return
    outputs = collector.get()
    if isinstance(outputs, dict) and "router_logits" in outputs:
        outputs["router_logits"].append(logits)


def _first_parameter(module: nn.Module) -> str:
    try:
        parameters = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return "hidden_states"
    return parameters[0] if parameters else "hidden_states"


@attrs.frozen
class ReplacedBlock:
    path: str
    block_class: str
    family: str


@attrs.frozen
class SkippedBlock:
    path: str
    block_class: str
    reason: str


@attrs.frozen
class PatchReport:
    """What :func:`patch_model` did.

    * ``replaced`` — blocks now run by moeforge (module path, original class, family);
    * ``skipped`` — MoE-looking blocks (a module with an ``experts`` child) left untouched, with why:
      no converter for the class, or the converter refused this block's configuration;
    * ``already_patched`` — paths that were :class:`HFMoEBlock` before the call (patching twice is
      harmless: the second call replaces nothing).
    """

    replaced: tuple[ReplacedBlock, ...]
    skipped: tuple[SkippedBlock, ...]
    already_patched: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} MoE block(s)"]
        lines += [f"  {entry.path}: {entry.block_class} -> moeforge ({entry.family})" for entry in self.replaced]
        if self.skipped:
            lines.append(f"left {len(self.skipped)} MoE-looking block(s) alone")
            lines += [f"  {entry.path}: {entry.block_class} ({entry.reason})" for entry in self.skipped]
        if self.already_patched:
            lines.append(f"{len(self.already_patched)} block(s) were already patched")
            lines += [f"  {path}" for path in self.already_patched]
        return "\n".join(lines)


class PatchError(TypeError):
    """``patch_model(strict=True)`` met a block it cannot replace (raised before anything changed)."""


class NothingPatchedWarning(UserWarning):
    """``patch_model`` replaced no block (and none was patched before): the model runs as it did."""


def patch_model(model: nn.Module, *, strict: bool = False, **layer_kwargs: Any) -> PatchReport:
    """Replace every supported MoE block of ``model`` in place by an :class:`HFMoEBlock`.

    A block is replaced at every path it appears at (a module shared by two parents stays shared).
    MoE-looking blocks (a module with an ``experts`` child module) that have no converter, or whose
    converter refuses their configuration, are left untouched and listed in ``report.skipped``;
    with ``strict=True`` they raise :class:`PatchError` instead, before any block is replaced.
    Blocks already patched are listed in ``report.already_patched`` and left as they are. When
    nothing is replaced and nothing was patched before, a :class:`NothingPatchedWarning` says so,
    listing the MoE-looking blocks that were left alone and why (or that there were none).

    ``layer_kwargs`` (e.g. ``backend="torch"``, ``debug=True``) go to every layer; ``dtype`` and
    ``device`` come from each block's tensors (cast or move the model, before or after patching).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model: model must be a torch.nn.Module (e.g. a transformers model from "
                        f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__}; "
                        "load the model first, then patch it")
    for name in _FORBIDDEN_PATCH_KWARGS:
        if name in layer_kwargs:
            raise TypeError(f"patch_model takes no {name!r}: each layer keeps its block's {name}; "
                            f"use model.to(...) before or after patching")
    classes = block_classes()
    if type(model).__name__ in classes:
        raise TypeError(f"the model itself is a {type(model).__name__}: it cannot be replaced in place; "
                        "use moeforge.hf.from_hf(block)")
    replaced: list[ReplacedBlock] = []
    skipped: list[SkippedBlock] = []
    already: list[str] = []
    # id(block) -> (block, replacement, every path it is found at)
    plans: dict[int, tuple[nn.Module, Optional[HFMoEBlock], list[str]]] = {}
    for path, module in _walk(model):
        if isinstance(module, HFMoEBlock):
            already.append(path)
            continue
        key = id(module)
        if key in plans:  # the same block reached by a second path
            original, replacement, paths = plans[key]
            paths.append(path)
            if replacement is not None:
                replaced.append(ReplacedBlock(path, type(module).__name__, replacement.family_name))
            else:
                first = next(entry for entry in skipped if entry.path == paths[0])
                skipped.append(SkippedBlock(path, first.block_class, first.reason))
            continue
        family = classes.get(type(module).__name__)
        if family is None:
            skipped.append(SkippedBlock(path, type(module).__name__,
                                        "no moeforge converter for this class"))
            plans[key] = (module, None, [path])
            continue
        reason = _unpatchable(module)
        if reason is None:
            try:
                layer = family.from_hf(module, **layer_kwargs)
            except (TypeError, ValueError, NotImplementedError, MoEForgeError) as error:
                reason = f"{family.NAME} converter refused it: {error}"
        if reason is not None:
            if strict:
                raise PatchError(f"cannot patch {path} ({type(module).__name__}): {reason}")
            skipped.append(SkippedBlock(path, type(module).__name__, reason))
            plans[key] = (module, None, [path])
            continue
        replacement = HFMoEBlock(layer, family, module)
        plans[key] = (module, replacement, [path])
        replaced.append(ReplacedBlock(path, type(module).__name__, family.NAME))
    if strict and skipped:
        entry = skipped[0]
        raise PatchError(f"cannot patch {entry.path} ({entry.block_class}): {entry.reason}")

    for original, replacement, paths in plans.values():
        if replacement is None:
            continue
        for path in paths:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, name, replacement)
        _share_hooks(original, replacement)
        _release_tensors(original)
    report = PatchReport(tuple(replaced), tuple(skipped), tuple(already))
    if not replaced and not already:
        warnings.warn(_nothing_patched(model, report), NothingPatchedWarning, stacklevel=2)
    return report


def _nothing_patched(model: nn.Module, report: PatchReport) -> str:
    name = type(model).__name__
    if not report.skipped:
        return (f"patch_model replaced nothing: {name} has no MoE-looking block (a module with an 'experts' "
                f"child); supported blocks: {', '.join(sorted(block_classes()))}")
    shown = [f"  {entry.path}: {entry.block_class} ({entry.reason})" for entry in report.skipped[:8]]
    if len(report.skipped) > 8:
        shown.append(f"  ... and {len(report.skipped) - 8} more (see the returned report's 'skipped')")
    return "\n".join([f"patch_model replaced nothing in {name}: left {len(report.skipped)} MoE-looking "
                      "block(s) alone", *shown])


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` for every MoE-looking module or :class:`HFMoEBlock` under ``model`` (the
    root excluded), not descending into them; a module reachable by two paths is yielded twice."""
    def visit(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, HFMoEBlock) or isinstance(getattr(child, "experts", None), nn.Module):
                yield path, child
            else:
                yield from visit(child, path + ".")
    yield from visit(model, "")


def _unpatchable(block: nn.Module) -> Optional[str]:
    if hasattr(block, "_hf_hook"):
        # accelerate wraps the block's forward to move (or load offloaded) weights by the block's
        # own parameter names: the replacement would not get them.
        return "it carries an accelerate hook (device_map / offloading): patch before dispatching the model"
    return None


def _share_hooks(original: nn.Module, replacement: nn.Module) -> None:
    """Forward hooks registered on the original block keep firing (and their handles keep removing
    them): the replacement uses the very same hook dictionaries."""
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(original, name):
            setattr(replacement, name, getattr(original, name))


def _release_tensors(original: nn.Module) -> None:
    """Drop the original block's references to its tensors (the layer keeps those it uses): a
    converter's copies must not leave the originals alive, unseen by ``model.parameters()``."""
    with torch.no_grad():
        for module in original.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                            requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device="meta")
