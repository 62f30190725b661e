"""The library's exceptions. Each one says what was wrong and what to do about it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "MoEForgeError", "ContractError", "PayloadError", "InputError", "DispatchDtypeError", "BackendUnavailableError",
    "CheckpointError", "CheckpointNamesError", "MissingPackageError", "PresetError", "UnsupportedExpertsError",
    "InferenceOnlyError", "ReplacedStageError",
]


class MoEForgeError(Exception):
    """Base class of every error moeforge raises on purpose."""


class ContractError(MoEForgeError):
    """Two neighbouring stages disagree about the format that crosses their boundary.

    Raised when a pipeline is *built*, before any tensor exists. The attributes let tests and tools
    inspect the mismatch without parsing the message.
    """

    def __init__(
        self,
        *,
        producer: str,
        consumer: str,
        field: str,
        have: Any,
        want: Any,
        hint: str,
    ) -> None:
        self.producer = producer
        self.consumer = consumer
        self.field = field
        self.have = have
        self.want = want
        self.hint = hint
        super().__init__(
            f"{producer} -> {consumer}: field '{field}' does not match.\n"
            f"  {producer} produces: {_show(have)}\n"
            f"  {consumer} accepts:  {_show(want)}\n"
            f"  hint: {hint}"
        )


class ReplacedStageError(ContractError):
    """A stage swapped into a layer with ``replace_stage`` does not fit the pipeline the layer rebuilds for
    new settings (another quant method, as ``quantize_layer`` gives it; a new dtype or device): the new
    pipeline has no stage of the replaced one's kinds at its place (``field="kinds"``), or the custom stage
    disagrees with a neighbour there (that boundary's field). The message names the custom stage and what
    to do; ``stage`` is its name."""

    def __init__(self, summary: str, *, stage: str, producer: str, consumer: str, field: str, have: Any, want: Any,
                 hint: str) -> None:
        super().__init__(producer=producer, consumer=consumer, field=field, have=have, want=want, hint=hint)
        self.stage = stage
        self.args = (f"{summary}\n{self.args[0]}",)  # what happened first, then the mismatch as usual


class PayloadError(MoEForgeError):
    """A payload does not match the spec its stage declared (raised in debug mode)."""


class InputError(MoEForgeError, ValueError):
    """A user-supplied argument has the wrong shape, dtype, device or value.

    Subclasses ``ValueError`` so that callers who catch the generic error keep working.
    """


class DispatchDtypeError(MoEForgeError, ValueError):
    """A dispatch dtype was asked for that this device or these experts cannot carry."""


class BackendUnavailableError(MoEForgeError, RuntimeError):
    """The requested backend cannot run here (missing package, wrong device, not built)."""


class InferenceOnlyError(MoEForgeError, RuntimeError):
    """A backward pass reached a computation that has none (a quantized method's experts, a decode-only
    dispatcher). Raised by ``loss.backward()``, never by the forward: the message names what has no
    backward and what to use instead."""


class CheckpointError(MoEForgeError, ValueError):
    """A checkpoint cannot fill this layer (missing or misshapen tensor, unsupported format)."""


class CheckpointNamesError(CheckpointError, RuntimeError):
    """``MoELayer.load_state_dict`` was given a checkpoint's names (a Hugging Face MoE block's, which
    :func:`moeforge.checkpoint.load_weights` reads). A ``RuntimeError`` too, as the errors of
    ``nn.Module.load_state_dict`` are."""


class MissingPackageError(MoEForgeError, ImportError):
    """A package an optional feature needs is not installed (the message says how to install it)."""


class PresetError(MoEForgeError, TypeError):
    """A family preset was given a keyword it does not take, lacks a required one, or was given a
    ``MoELayer`` setting that the family fixes itself (a ``TypeError``, as Python's own)."""


class UnsupportedExpertsError(MoEForgeError, TypeError):
    """A ``transformers`` experts module has a layout or an activation that moeforge's experts
    implementation does not compute (the message names it, and what to use instead)."""


def _show(value: Any) -> str:
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_show(v) for v in value)) + "}"
    name = getattr(value, "name", None)
    if isinstance(name, str) and hasattr(value, "value"):
        return name.lower()
    return str(value)
