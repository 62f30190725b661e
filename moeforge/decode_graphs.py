"""CUDA graphs of an eager forward at decode batch sizes, replayed instead of launched (opt-in).

At a decode batch an eager forward's time is the host's time to launch its kernels, several times the GPU's time
(measured in docs/kernels.md, "The eager host path"). :class:`DecodeGraphs`, kept by a layer (``MoELayer(decode_graphs=DecodeGraphSettings())``) or by a
``transformers`` experts module (:func:`moeforge.hf_experts.capture_decode_graphs`), captures the forward once per
batch size up to ``max_tokens`` and input layout, then replays it: a call copies its inputs into the graph's,
replays the graph and returns a copy of its output (a later replay overwrites the graph's own).

The first call of a key runs the forward as it would without graphs (compiling its kernels and filling their launch
memos), returns that output, and then captures the graph for the calls after it: a capture launches nothing, so
every call runs the forward exactly once, eagerly or replayed. That is what an expert-parallel layer needs: each call
is one exchange on every rank, whichever ranks capture at it (their batch sizes differ). Where the owner says a
replay would not do what a call does (``refusal``: an expert-parallel dispatcher that reads a count on the host),
nothing is captured for that key and its calls run eagerly.

A call runs as it would without graphs (``run`` returns ``None`` and the caller launches the forward) when any of
these holds: more than ``max_tokens`` rows or none; inputs off CUDA; a call autograd records (grad mode with an input
or a weight requiring grad); ``torch.compile`` tracing, a dispatch or function mode, a tensor subclass (what
:func:`moeforge.kernels.kernel_op.needs_op` refuses); a stream already capturing (the caller's own graph); a key whose
capture was refused or failed before (it synchronised with the host, say), remembered with the reason.

What a replay reads: the inputs' copies and every other tensor by the address it had at the capture. A weight changed
in place (an optimizer step, ``load_state_dict``) is read as it is at the replay; a weight replaced by another tensor
changes the key (the owner passes its weights: their addresses, shapes, strides and dtypes are part of it) and
captures anew. At most ``max_graphs`` graphs are kept,
the oldest released first; each holds the forward's intermediates for its batch size in its own memory pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import attrs
import torch

from moeforge.errors import InputError
from moeforge.kernels.kernel_op import needs_op


def _positive(instance: Any, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"DecodeGraphSettings.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class DecodeGraphSettings:
    """Which calls :class:`DecodeGraphs` captures: batches of at most ``max_tokens`` rows, at most ``max_graphs``
    graphs kept (the oldest released first)."""

    max_tokens: int = attrs.field(default=16, validator=_positive)
    max_graphs: int = attrs.field(default=8, validator=_positive)


@attrs.frozen(eq=False)
class _Captured:
    graph: Optional[torch.cuda.CUDAGraph]  # None: not captured (``refused`` says why), run eagerly
    inputs: tuple[torch.Tensor, ...]
    output: Optional[torch.Tensor]
    owner: object  # kept alive, so that no other object takes its id while the graph is kept
    refused: Optional[str] = None


class DecodeGraphs:
    """The graphs captured for one owner's forward (see the module docstring)."""

    __slots__ = ("settings", "_graphs")

    def __init__(self, settings: DecodeGraphSettings) -> None:
        if not isinstance(settings, DecodeGraphSettings):
            raise InputError(f"decode graphs take a DecodeGraphSettings, got {type(settings).__name__}")
        self.settings = settings
        self._graphs: dict[tuple[object, ...], _Captured] = {}

    def run(self, forward: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
            weights: Iterable[torch.Tensor], owner: object = None,
            refusal: Optional[Callable[[], Optional[str]]] = None) -> Optional[torch.Tensor]:
        """``forward(*inputs)`` by a graph replay (or, at a key's first call, eagerly, capturing after it), or ``None``
        where this call is not one to capture (the caller then runs ``forward`` itself). ``inputs[0]`` holds the rows
        (its first dimension counts them); ``weights``: every other tensor the forward reads whose replacement must
        capture anew (by address); ``owner``: what else the capture depends on (e.g. the pipeline object: a rebuilt
        one captures anew); ``refusal``: asked after a key's first call, why a replay would not do what that call did
        (``None``: capture)."""
        rows = inputs[0]
        if rows.device.type != "cuda" or not 0 < rows.shape[0] <= self.settings.max_tokens:
            return None
        weights = tuple(weights)
        if needs_op(inputs + weights) or torch.cuda.is_current_stream_capturing():
            return None
        key = (tuple([(t.shape, t.stride(), t.dtype, t.device) for t in inputs]),
               tuple([(w.data_ptr(), w.shape, w.stride(), w.dtype) for w in weights]), id(owner))
        captured = self._graphs.get(key)
        if captured is None:
            output = forward(*inputs)  # (compiles the kernels and fills the launch memos the capture then reads)
            reason = refusal() if refusal is not None else None
            captured = self._capture(forward, inputs, owner) if reason is None else _Captured(None, (), None, owner,
                                                                                              reason)
            if len(self._graphs) >= self.settings.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = captured
            return output
        if captured.graph is None or captured.output is None:
            return None
        for static, given in zip(captured.inputs, inputs):
            static.copy_(given)
        captured.graph.replay()
        return captured.output.clone()

    @staticmethod
    def _capture(forward: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], owner: object) -> _Captured:
        with torch.inference_mode(False):  # plain tensors: a later call outside inference mode copies into them
            static = tuple(t.clone() for t in inputs)
        device = static[0].device
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                output = forward(*static)
        except RuntimeError as error:  # e.g. a host synchronisation in the forward: remember it and run eagerly
            torch.cuda.synchronize(device)
            return _Captured(None, (), None, owner, f"the capture failed: {error}")
        return _Captured(graph, static, output, owner)

    def refusals(self) -> list[str]:
        """Why the keys kept without a graph have none (each reason once)."""
        return sorted({captured.refused for captured in self._graphs.values() if captured.refused is not None})

    def clear(self) -> None:
        """Release every graph (their memory pools with them)."""
        self._graphs.clear()

    def __len__(self) -> int:
        return sum(1 for captured in self._graphs.values() if captured.graph is not None)

    def __deepcopy__(self, memo: dict[int, object]) -> DecodeGraphs:
        return DecodeGraphs(self.settings)  # a copy's forward reads its own tensors: it captures its own graphs

    def __reduce__(self) -> tuple[type[DecodeGraphs], tuple[DecodeGraphSettings]]:
        return DecodeGraphs, (self.settings,)

    def __repr__(self) -> str:
        return f"DecodeGraphs({self.settings.max_tokens} tokens, {len(self)} graphs)"
