"""Load one MoE block of a Hugging Face checkpoint into a :class:`~moeforge.MoELayer`.

    report = load_weights(layer, ["model-00001-of-00002.safetensors", ...], prefix="model.layers.3.mlp.")
    report = load_weights(layer, state_dict, prefix="model.layers.3.mlp.")

Names are read relative to ``prefix``. The experts come in one of three namings (detected; a mix is
an error), :class:`ExpertNaming`:

* ``W1_W3_W2`` — ``experts.{i}.w1.weight`` (gate) and ``w3`` (up) ``[I, H]``, ``w2`` (down) ``[H, I]``:
  Mixtral's original checkpoints (what ``transformers``' ``save_pretrained`` writes for Mixtral);
* ``PROJ`` — ``experts.{i}.gate_proj.weight``, ``up_proj``, ``down_proj``: Qwen2/3-MoE, DeepSeek,
  OLMoE checkpoints;
* ``FUSED`` — ``experts.gate_up_proj [E, 2I, H]`` (gate rows then up rows) and
  ``experts.down_proj [E, H, I]``: the ``transformers`` 5 in-memory layout (a model's ``state_dict()``).

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
``layer.process_weights_after_loading()`` runs. Safetensors files are opened lazily
(``safetensors.safe_open``): only the needed tensors are read.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import attrs
import torch

from moeforge.errors import CheckpointError
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


class ExpertNaming(enum.Enum):
    W1_W3_W2 = "experts.{i}.w1/w3/w2.weight"
    PROJ = "experts.{i}.gate_proj/up_proj/down_proj.weight"
    FUSED = "experts.gate_up_proj / experts.down_proj"
    QUANT_METHOD = "the quant method's own format (QuantMethod.load_checkpoint_experts)"


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
    from safetensors import safe_open

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
        raise CheckpointError(f"under prefix '{view.prefix}': {error}") from error
    allowed = set(layer.quant.expert_parameter_names(layer))
    for name, value in experts.items():
        if name not in allowed:
            raise CheckpointError(f"{layer.quant.name}.load_checkpoint_experts returned '{name}', which is not one of "
                                  f"the layer's expert tensors {sorted(allowed)}")
        target = getattr(layer, name)
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise CheckpointError(f"{layer.quant.name} built '{name}' as {tuple(value.shape)} {value.dtype}; the layer "
                                  f"holds {tuple(target.shape)} {target.dtype}")
    return experts


_PER_EXPERT = re.compile(r"experts\.(\d+)\.([A-Za-z0-9_]+)\.")


def _naming(planner: _Planner) -> ExpertNaming:
    found: dict[ExpertNaming, str] = {}
    for name in sorted(planner.names):
        match = _PER_EXPERT.match(name)
        if match is not None:
            proj = match.group(2)
            if proj in ("w1", "w2", "w3"):
                found.setdefault(ExpertNaming.W1_W3_W2, name)
            elif proj in ("gate_proj", "up_proj", "down_proj"):
                found.setdefault(ExpertNaming.PROJ, name)
        elif name in ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj"):
            found.setdefault(ExpertNaming.FUSED, name)
    if len(found) > 1:
        examples = ", ".join(f"'{planner.prefix}{key}' ({naming.name})" for naming, key in found.items())
        raise CheckpointError(f"the experts under '{planner.prefix}' mix naming schemes: {examples}")
    if not found:
        p = planner.prefix
        raise MissingWeightError(
            f"{p}experts.0.w1.weight",
            f" (no expert weights under '{p}': expected '{p}experts.{{i}}.w1.weight' / "
            f"'{p}experts.{{i}}.gate_proj.weight' per expert, or fused '{p}experts.gate_up_proj')")
    return next(iter(found))


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
    if naming is ExpertNaming.W1_W3_W2:
        if not gated:
            raise CheckpointError("the w1/w3/w2 naming is for gated experts (w1 = gate, w3 = up); this layer's "
                                  f"activation {layer.activation.kind.value} is not gated")
        gate, up, down = "w1", "w3", "w2"
    else:
        gate, up, down = "gate_proj", "up_proj", "down_proj"
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
        prefix: the block's key prefix, e.g. ``"model.layers.3.mlp."`` (with its trailing dot).
        on_unused: what to do with keys under ``prefix`` that were not read: ``"warn"``
            (:class:`UnusedWeightsWarning`), ``"raise"`` (:class:`UnusedWeightsError`, before any
            copy) or ``"ignore"``. They are in the returned report in every case.
    """
    if on_unused not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_unused must be 'warn', 'raise' or 'ignore', got {on_unused!r}")
    quantized = not isinstance(layer.quant, UnquantizedMethod)
    if not quantized and (getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None):
        raise CheckpointError("the layer's experts have biases (GPT-OSS): no supported naming carries them; "
                              "convert the transformers block with moeforge.hf.from_hf")
    experts: dict[str, torch.Tensor] = {}
    with _open(source) as tensors:
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
