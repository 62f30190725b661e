"""Load one MoE block of a Hugging Face checkpoint into a :class:`~moeforge.MoELayer`.

    report = load_weights(layer, ["model-00001-of-00002.safetensors", ...], prefix="model.layers.3.mlp.")
    report = load_weights(layer, state_dict, prefix="model.layers.3.mlp.")

Names are read relative to ``prefix``, the block's module path with its trailing dot
(``"model.layers.3.mlp."``; ``"model.layers.3.mlp"`` is taken to mean the same when the checkpoint has
keys under ``"model.layers.3.mlp."``). The experts come in one of three namings (detected by
:func:`moeforge.expert_naming.detect_naming`, which the quantized loop of
:mod:`moeforge.expert_checkpoint` shares; a mix is an error), :class:`ExpertNaming`:

* ``W1_W3_W2`` — ``experts.{i}.w1.weight`` (gate) and ``w3`` (up) ``[I, H]``, ``w2`` (down) ``[H, I]``:
  Mixtral's original checkpoints (what ``transformers``' ``save_pretrained`` writes for Mixtral);
* ``PROJ`` — ``experts.{i}.gate_proj.weight``, ``up_proj``, ``down_proj``: Qwen2/3-MoE, DeepSeek,
  OLMoE checkpoints;
* ``FUSED`` — ``experts.gate_up_proj [E, 2I, H]`` (gate rows then up rows) and
  ``experts.down_proj [E, H, I]``: the ``transformers`` 5 in-memory layout (a model's ``state_dict()``).

An expert-parallel layer (``MoELayer(..., expert_parallel=...)``) reads the experts of its
``expert_range`` only (their global ids: rank 1 of 2 with 4 experts reads experts 2 and 3); the other
experts' tensors are reported unused (another rank loads them).

A layer with a plain (non-gated) activation reads ``up_proj`` only (``experts.up_proj [E, I, H]``
when fused). Gate and up rows are laid out as the layer's activation wants them (concatenated, or
interleaved for an ``INTERLEAVED`` activation). GPT-OSS and Llama-4 store their fused experts
transposed (``[E, H, 2I]``), and GPT-OSS has expert biases: convert those blocks with
:func:`moeforge.hf.from_hf` instead.

Besides the experts, what the layer has is read and must be there: the router ``gate.weight``
(``gate.bias`` when the router has a bias), the selection bias ``gate.e_score_correction_bias`` (or
``e_score_correction_bias``), the shared experts ``shared_expert.*`` or ``shared_experts.*``
(``gate_proj`` / ``up_proj`` / ``down_proj``, ``.bias`` when they have biases) and their gate
``shared_expert_gate.weight``.

Checks come before any tensor is copied, so a failed load leaves the layer as it was:

* a tensor the layer needs and the checkpoint lacks: :class:`MissingWeightError`, naming the full key;
* a tensor of the wrong shape: :class:`WeightShapeError`, naming the key and both shapes;
* a tensor that is not float (e.g. an FP8 checkpoint, whose scales this loader would ignore):
  :class:`CheckpointError`.

Keys under the prefix that nothing read (experts beyond the layer's ``num_experts``, quantization
scales, a router the layer does not own, shared experts it does not have, ...) are returned in
:attr:`LoadReport.unused` and, by default, reported by an :class:`UnusedWeightsWarning`
(``on_unused="raise"`` makes them an :class:`UnusedWeightsError`, ``"ignore"`` silences them): a
prefix that selects exactly one block leaves none.

Tensors are converted to the dtype (and device) of the layer's tensor they go into, then
``layer.process_weights_after_loading()`` runs. A layer built on the ``meta`` device has no storage
to copy into: :class:`~moeforge.errors.InputError` says to call ``layer.to_empty(device=...)`` first
(on the device the layer will run on; ``load_weights`` then writes every tensor the layer has, so
none keeps ``to_empty``'s uninitialised values).

Safetensors files are opened lazily (``safetensors.safe_open``): only the needed tensors are read.
Reading files needs the ``safetensors`` package (``pip install 'moeforge[safetensors]'``; without
it, :class:`MissingPackageError`); a state dict needs nothing more.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import attrs
import torch

from moeforge.errors import CheckpointError, InputError, MissingPackageError
from moeforge.expert_naming import FUSED_NAMES, ExpertNaming, detect_naming, projection_names
from moeforge.layer import MoELayer
from moeforge.quant.unquantized import UnquantizedMethod
from moeforge.stages.activation import GateUpLayout

PathLike = Union[str, "os.PathLike[str]"]
Source = Union[Mapping[str, torch.Tensor], PathLike, Sequence[PathLike]]
OnUnused = Literal["warn", "raise", "ignore"]

_FLOAT_DTYPES = {torch.bfloat16, torch.float16, torch.float32, torch.float64}
_SAFETENSORS_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class MissingWeightError(CheckpointError):
    """A tensor the layer needs is not in the checkpoint (``key`` is its full name)."""

    def __init__(self, key: str, note: str = "") -> None:
        self.key = key
        super().__init__(f"missing tensor '{key}'{note}")


class WeightShapeError(CheckpointError):
    """A tensor has another shape than the layer needs."""

    def __init__(self, key: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
        self.key, self.expected, self.found = key, expected, found
        super().__init__(f"tensor '{key}' has shape {found}, expected {expected}")


class UnusedWeightsError(CheckpointError):
    """``on_unused="raise"`` and tensors under the prefix were not read (``keys``)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        super().__init__(_unused_message(keys))


class UnusedWeightsWarning(UserWarning):
    """Tensors under the prefix were not read (see :attr:`LoadReport.unused`)."""


@attrs.frozen
class LoadReport:
    """What :func:`load_weights` read (full keys) and what it left under the prefix."""

    prefix: str
    naming: ExpertNaming
    loaded: tuple[str, ...]
    unused: tuple[str, ...]


# -- sources ----------------------------------------------------------------------------------------

class _Tensors:
    """Read-only access to a checkpoint: names, shapes and dtypes without loading, then tensors."""

    def keys(self) -> Iterator[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def float_dtype(self, key: str) -> Optional[str]:
        """``None`` for a float tensor, else the dtype's name."""
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError


class _StateDict(_Tensors):
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def keys(self) -> Iterator[str]:
        return iter(self._tensors.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def float_dtype(self, key: str) -> Optional[str]:
        dtype = self._tensors[key].dtype
        return None if dtype in _FLOAT_DTYPES else str(dtype).removeprefix("torch.")

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]


class _SafetensorsFiles(_Tensors):
    def __init__(self, handles: dict[str, Any]) -> None:
        self._where: dict[str, Any] = {}
        where_file: dict[str, str] = {}
        for path, handle in handles.items():
            for key in handle.keys():
                if key in where_file:
                    raise CheckpointError(f"tensor '{key}' is in two files: {where_file[key]} and {path}")
                where_file[key] = path
                self._where[key] = handle

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self._where[key].get_slice(key).get_shape())

    def float_dtype(self, key: str) -> Optional[str]:
        name: str = self._where[key].get_slice(key).get_dtype()
        return None if name in _SAFETENSORS_FLOAT else name

    def get(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._where[key].get_tensor(key)
        return tensor


def _files(source: Union[PathLike, Sequence[PathLike]]) -> list[Path]:
    paths = [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(p) for p in source]
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise CheckpointError(f"no *.safetensors file in directory {path}")
            files += found
        elif not path.exists():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        elif path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file; load other formats yourself "
                                  "(e.g. torch.load) and pass the state dict")
        else:
            files.append(path)
    if not files:
        raise CheckpointError("no checkpoint file given")
    return files


@contextlib.contextmanager
def _open(source: Source) -> Iterator[_Tensors]:
    if isinstance(source, Mapping):
        yield _StateDict(source)
        return
    if not isinstance(source, (str, os.PathLike, Sequence)):
        raise TypeError("source must be a state dict (a mapping of names to tensors), a .safetensors path "
                        f"or directory, or a list of paths; got {type(source).__name__}")
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise MissingPackageError(
            "reading .safetensors checkpoint files needs the 'safetensors' package, which is not installed: "
            "pip install 'moeforge[safetensors]' (or pip install safetensors); or pass a state dict "
            "(a mapping of names to tensors) as the source") from error

    with contextlib.ExitStack() as stack:
        handles = {str(path): stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                   for path in _files(source)}
        yield _SafetensorsFiles(handles)


# -- the plan: every copy, checked before the first one ---------------------------------------------

@attrs.frozen
class _Copy:
    key: str  # full name in the checkpoint
    shape: tuple[int, ...]  # what the layer needs
    target: Callable[[], torch.Tensor]  # the view of the layer's tensor the values go into
    relayout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # checkpoint -> layer layout


class _Planner:
    def __init__(self, tensors: _Tensors, prefix: str) -> None:
        self.prefix = prefix
        self.tensors = tensors
        self.names = {key[len(prefix):] for key in tensors.keys() if key.startswith(prefix)}
        self.copies: list[_Copy] = []

    def has(self, name: str) -> bool:
        return name in self.names

    def take(self, name: str, shape: tuple[int, ...], target: Callable[[], torch.Tensor], note: str = "",
             relayout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        key = self.prefix + name
        if name not in self.names:
            raise MissingWeightError(key, note)
        found = self.tensors.shape(key)
        if found != shape:
            raise WeightShapeError(key, shape, found)
        dtype = self.tensors.float_dtype(key)
        if dtype is not None:
            raise CheckpointError(f"tensor '{key}' is {dtype}: this loader reads float (unquantized) weights; "
                                  "a quantized checkpoint needs its quant method")
        self.copies.append(_Copy(key, shape, target, relayout))

    def gate_up(self, gate: Optional[str], up: str, shape: tuple[int, ...], layout: GateUpLayout,
                weight: Callable[[], torch.Tensor], note: str = "") -> None:
        """Gate and up (each ``shape = [I, ...]``) into ``weight() [2I, ...]`` in the layer's layout,
        or up alone into ``weight() [I, ...]`` when ``gate`` is None (a plain activation)."""
        if gate is None:
            self.take(up, shape, weight, note)
            return
        rows = shape[0]
        if layout is GateUpLayout.INTERLEAVED:
            self.take(gate, shape, lambda: weight()[0::2], note)
            self.take(up, shape, lambda: weight()[1::2], note)
        else:
            self.take(gate, shape, lambda: weight()[:rows], note)
            self.take(up, shape, lambda: weight()[rows:], note)


class _ExpertView(Mapping[str, torch.Tensor]):
    """The tensors under the prefix, by relative name, for a quant method's checkpoint hook: lazy
    (membership reads nothing) and recording which names were read."""

    def __init__(self, tensors: _Tensors, prefix: str, names: set[str]) -> None:
        self._tensors, self.prefix, self._names = tensors, prefix, names
        self.read: set[str] = set()

    def all_keys(self) -> Iterator[str]:
        """Every key of the checkpoint, under the prefix or not (for error hints)."""
        return self._tensors.keys()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        self.read.add(name)
        return self._tensors.get(self.prefix + name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


def _quantized_experts(layer: MoELayer, view: _ExpertView) -> dict[str, torch.Tensor]:
    try:
        experts = layer.quant.load_checkpoint_experts(layer, view)
    except CheckpointError as error:
        hint = "" if len(view) else _prefix_hint(view.all_keys(), view.prefix)
        raise CheckpointError(f"under prefix '{view.prefix}': {error}{hint}") from error
    names = layer.quant.expert_parameter_names(layer)
    allowed = set(names)
    unfilled = [name for name in names if name not in experts]
    if unfilled:
        raise CheckpointError(f"{layer.quant.name}.load_checkpoint_experts filled {sorted(experts)} but not "
                              f"{unfilled}: they would keep the values they had before loading")
    for name, value in experts.items():
        if name not in allowed:
            raise CheckpointError(f"{layer.quant.name}.load_checkpoint_experts returned '{name}', which is not one of "
                                  f"the layer's expert tensors {sorted(allowed)}")
        target = getattr(layer, name)
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise CheckpointError(f"{layer.quant.name} built '{name}' as {tuple(value.shape)} {value.dtype}; the layer "
                                  f"holds {tuple(target.shape)} {target.dtype}")
    return experts


def _naming(planner: _Planner) -> ExpertNaming:
    naming = detect_naming(planner.names, planner.prefix)
    if naming is None:
        p = planner.prefix
        raise MissingWeightError(
            f"{p}experts.0.w1.weight",
            f" (no expert weights under '{p}': expected '{p}experts.{{i}}.w1.weight' / "
            f"'{p}experts.{{i}}.gate_proj.weight' per expert, or fused '{p}{FUSED_NAMES[0]}')"
            f"{_prefix_hint(planner.tensors.keys(), p)}")
    return naming


def _prefix_hint(keys: Iterable[str], prefix: str) -> str:
    """Where the checkpoint's expert tensors are, when there are none under ``prefix``."""
    blocks = sorted({key[:at] for key in keys if (at := key.find("experts.")) >= 0
                     and (at == 0 or key[at - 1] == ".")})
    if not blocks:
        return f"; the checkpoint has no key containing 'experts.' (is '{prefix}' the MoE block's prefix?)"
    more = f" and {len(blocks) - 4} more" if len(blocks) > 4 else ""
    shown = ", ".join(f"'{block}'" for block in blocks[:4]) + more
    return f"; the checkpoint's experts are under {shown}"


def _block_prefix(prefix: str, keys: Iterable[str]) -> str:
    """``prefix``, with a trailing dot added when it names a module: ``"model.layers.3.mlp"`` for
    keys ``"model.layers.3.mlp.experts..."`` (without the dot the names would read ``".experts..."``,
    and ``"model.layers.1"`` would also select ``"model.layers.10..."``)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str (the block's key prefix, e.g. 'model.layers.3.mlp.'), got "
                        f"{type(prefix).__name__}")
    if prefix and not prefix.endswith("."):
        dotted = prefix + "."
        if any(key.startswith(dotted) for key in keys):
            return dotted
    return prefix


def _check_storage(layer: MoELayer) -> None:
    """A layer on the meta device has nowhere to copy the values to (``copy_`` would do nothing)."""
    meta = [name for name, tensor in itertools.chain(layer.named_parameters(), layer.named_buffers())
            if tensor.is_meta]
    if meta:
        shown = ", ".join(meta[:4]) + (f" and {len(meta) - 4} more" if len(meta) > 4 else "")
        raise InputError(f"layer: its tensors are on the meta device ({shown}), with no storage to load into: "
                         "call layer.to_empty(device=...) first (the device it will run on, e.g. 'cuda'), "
                         "then load_weights, which fills every tensor the layer has")


def _plan_experts(planner: _Planner, layer: MoELayer, naming: ExpertNaming) -> None:
    gated = layer.activation.gated
    layout = layer.activation.gate_up
    num_experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
    # An expert-parallel layer holds experts[first : first + len(experts)] only; the others stay unread
    # (reported as unused: another rank loads them).
    experts = layer.expert_range

    def w13() -> torch.Tensor:
        weight: torch.Tensor = getattr(layer, "w13_weight")
        return weight

    def w2() -> torch.Tensor:
        weight: torch.Tensor = getattr(layer, "w2_weight")
        return weight

    if naming is ExpertNaming.FUSED:
        if planner.has("experts.gate_up_proj_bias"):
            raise CheckpointError(f"'{planner.prefix}experts.gate_up_proj_bias': this is GPT-OSS's layout "
                                  "(transposed [E, H, 2I] experts with biases); convert the transformers block "
                                  "with moeforge.hf.from_hf")

        def mine(relayout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
            def select(tensor: torch.Tensor) -> torch.Tensor:
                tensor = tensor[experts.start:experts.stop]
                return relayout(tensor) if relayout is not None else tensor
            return select

        if gated:
            relayout = _interleave if layout is GateUpLayout.INTERLEAVED else None
            planner.take("experts.gate_up_proj", (num_experts, 2 * inter, hidden), w13, relayout=mine(relayout))
        else:
            planner.take("experts.up_proj", (num_experts, inter, hidden), w13, relayout=mine())
        planner.take("experts.down_proj", (num_experts, hidden, inter), w2, relayout=mine())
        return
    gate, up, down = projection_names(naming, gated)
    for local, i in enumerate(experts):
        def expert13(local: int = local) -> torch.Tensor:
            return w13()[local]

        def expert2(local: int = local) -> torch.Tensor:
            return w2()[local]

        planner.gate_up(f"experts.{i}.{gate}.weight" if gated else None, f"experts.{i}.{up}.weight",
                        (inter, hidden), layout, expert13)
        planner.take(f"experts.{i}.{down}.weight", (hidden, inter), expert2)


def _interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` gate rows then up rows -> rows ``g0 u0 g1 u1 ...`` (an INTERLEAVED layer)."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def _plan_router(planner: _Planner, layer: MoELayer) -> None:
    router = layer.router
    if router is not None:
        planner.take("gate.weight", (layer.num_experts, layer.hidden_size), lambda: router.weight)
        bias = router.bias
        if bias is not None:
            planner.take("gate.bias", (layer.num_experts,), lambda: bias,
                         " (the layer's router has a bias: RoutingConfig(router_bias=True))")
    if getattr(layer, "e_score_correction_bias", None) is not None:
        name = "e_score_correction_bias" if planner.has("e_score_correction_bias") and not planner.has(
            "gate.e_score_correction_bias") else "gate.e_score_correction_bias"
        planner.take(name, (layer.num_experts,), lambda: getattr(layer, "e_score_correction_bias"),
                     f" (or '{planner.prefix}e_score_correction_bias'; the layer routes with a selection bias)")


def _plan_shared(planner: _Planner, layer: MoELayer) -> None:
    shared = layer.shared_experts
    if shared is None:
        return
    bases = [base for base in ("shared_expert.", "shared_experts.")
             if any(name.startswith(base) for name in planner.names)]
    if len(bases) > 1:
        raise CheckpointError(f"both '{planner.prefix}shared_expert.*' and '{planner.prefix}shared_experts.*' "
                              "are in the checkpoint: which are the shared experts?")
    base = bases[0] if bases else "shared_expert."
    note = f" (or '{planner.prefix}shared_experts.*'; the layer has shared experts)" if not bases else ""
    config = shared.config
    inter, hidden = config.intermediate_size, shared.down_proj.weight.shape[0]
    gated = config.activation.gated
    planner.gate_up(f"{base}gate_proj.weight" if gated else None, f"{base}up_proj.weight", (inter, hidden),
                    config.activation.gate_up, lambda: shared.gate_up_proj.weight, note)
    planner.take(f"{base}down_proj.weight", (hidden, inter), lambda: shared.down_proj.weight, note)
    if config.bias:
        gate_up_bias, down_bias = shared.gate_up_proj.bias, shared.down_proj.bias
        assert gate_up_bias is not None and down_bias is not None
        planner.gate_up(f"{base}gate_proj.bias" if gated else None, f"{base}up_proj.bias", (inter,),
                        config.activation.gate_up, lambda: gate_up_bias, note)
        planner.take(f"{base}down_proj.bias", (hidden,), lambda: down_bias, note)
    gate = shared.gate
    if gate is not None:
        planner.take("shared_expert_gate.weight", (1, hidden), lambda: gate.weight,
                     " (the layer's shared experts are gated: SharedGate.SIGMOID)")


# -- entry point ------------------------------------------------------------------------------------

def load_weights(layer: MoELayer, source: Source, prefix: str = "", *, on_unused: OnUnused = "warn") -> LoadReport:
    """Fill ``layer`` from the checkpoint tensors named ``prefix + ...`` (see the module notes), then
    call ``layer.process_weights_after_loading()``.

    Args:
        layer: a :class:`~moeforge.MoELayer` (its sizes must match the checkpoint's). A quantized
            layer's experts are read by its quant method's
            :meth:`~moeforge.QuantMethod.load_checkpoint_experts` (e.g. FP8 ``weight_scale_inv``,
            GPTQ/AWQ ``qweight``/``qzeros``/``scales``); the router and shared experts as usual.
        source: a state dict, a ``.safetensors`` file or a directory of them, or a list of files (the
            shards of one checkpoint).
        prefix: the block's key prefix, e.g. ``"model.layers.3.mlp."``. Without its trailing dot
            (``"model.layers.3.mlp"``) the dot is added when the checkpoint has keys under
            ``"model.layers.3.mlp."``; the report holds the prefix used.
        on_unused: what to do with keys under ``prefix`` that were not read: ``"warn"``
            (:class:`UnusedWeightsWarning`), ``"raise"`` (:class:`UnusedWeightsError`, before any
            copy) or ``"ignore"``. They are in the returned report in every case.

    Raises:
        InputError: ``layer`` is on the meta device (call ``layer.to_empty(device=...)`` first).
        MissingPackageError: ``source`` names files and ``safetensors`` is not installed.
        CheckpointError: the checkpoint cannot fill the layer (see the module notes); nothing was
            copied.
    """
    if on_unused not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_unused must be 'warn', 'raise' or 'ignore', got {on_unused!r}")
    quantized = not isinstance(layer.quant, UnquantizedMethod)
    if not quantized and (getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None):
        raise CheckpointError("the layer's experts have biases (GPT-OSS): no supported naming carries them; "
                              "convert the transformers block with moeforge.hf.from_hf")
    _check_storage(layer)
    experts: dict[str, torch.Tensor] = {}
    with _open(source) as tensors:
        prefix = _block_prefix(prefix, tensors.keys())
        planner = _Planner(tensors, prefix)
        view = _ExpertView(tensors, prefix, planner.names)
        if quantized:  # the method reads its own format; checked here before anything is copied
            naming = ExpertNaming.QUANT_METHOD
            experts = _quantized_experts(layer, view)
        else:
            naming = _naming(planner)
            _plan_experts(planner, layer, naming)
        _plan_router(planner, layer)
        _plan_shared(planner, layer)
        loaded = tuple(copy.key for copy in planner.copies) + tuple(prefix + name for name in sorted(view.read))
        read = {key[len(prefix):] for key in loaded}
        unused = tuple(sorted(prefix + name for name in planner.names - read))
        if unused and on_unused == "raise":
            raise UnusedWeightsError(unused)
        with torch.no_grad():
            for copy in planner.copies:
                value = tensors.get(copy.key)
                copy.target().copy_(value if copy.relayout is None else copy.relayout(value))
            for name, value in experts.items():
                getattr(layer, name).copy_(value)
    if unused and on_unused == "warn":
        warnings.warn(_unused_message(unused), UnusedWeightsWarning, stacklevel=2)
    layer.process_weights_after_loading()
    return LoadReport(prefix, naming, loaded, unused)


def _unused_message(keys: tuple[str, ...]) -> str:
    shown = ", ".join(f"'{key}'" for key in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return f"{len(keys)} tensor(s) under the prefix were not loaded: {shown}{more}"
