"""Pipelines: an ordered sequence of stages, validated once when built and cheap to call.

Validation walks the specs from the input through every stage: each stage must accept the spec its
predecessor produces. Beyond each stage's own ``accepts``, the checker holds every composition to
what an MoE forward is:

* every spec's dtype travels with the scales it needs (a quantized dtype with them, a float one
  without): anything else would be read as the integers it stores;
* the expert computation holds exactly one activation between its two GEMMs (counted from the stages'
  ``kinds``; a fused GEMM + activation counts as that one; a model without one uses the identity);
* an ``OUTPUT`` payload has a float dtype (checked before its scales: an int8 output is not fixed by
  giving it scales), and a pipeline that ends in one has applied the routing weights exactly once, at the
  place the router declared, and the routed scaling factor exactly once.

Any disagreement raises :class:`~moeforge.errors.ContractError` before a tensor exists.

A pipeline also knows whether it has a backward: one whose activations are quantized at some boundary
(a quantizer's rounding has no gradient), or that was told so (``no_backward``: a layer with a quantized
method says why, naming it), gives its output a backward that raises
:class:`~moeforge.errors.InferenceOnlyError` (:mod:`moeforge.no_backward`); the forward is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Optional, TypeVar, Union, cast

import torch

from moeforge.device_guard import on_device_of, several_devices
from moeforge.errors import ContractError, InputError, PayloadError
from moeforge.no_backward import no_backward, payload_tensors
from moeforge.payloads import Activations, ExpertRows, MoEOutput, RoutedTokens, check_payload
from moeforge.spec import REFERENCE_FLOAT_DTYPES, SCALES_OF, PayloadKind, RoutingWeights, ScalingFactor, Spec
from moeforge.stage import JoinedRun, Mismatch, Stage, StageKind

InT = TypeVar("InT")
OutT = TypeVar("OutT")
NewT = TypeVar("NewT")

PIPELINE_INPUT = "pipeline input"
PIPELINE_OUTPUT = "pipeline output"

_GENERIC_HINTS = {
    "kind": "stages are out of order or one is missing; the forward runs "
    "topk -> quantize -> dispatch -> gemm -> activation -> gemm -> combine",
    "layout": "use a dispatch stage that produces the layout this stage consumes, or a stage built for "
    "the other layout",
    "dtype": "insert a quantize stage, pick a dispatch dtype the consumer accepts, or use a quant method "
    "whose GEMMs accept this format",
    "scale_layout": "quantize with the scale layout the consumer accepts (per token vs per 128-group)",
    "width": "the sizes disagree: check hidden_size / intermediate_size and the weight shapes",
    "group_list_type": "configure the dispatch stage with the group_list type (count or cumsum) the "
    "consumer reads",
    "routing_weights": "routing weights must be applied exactly once: configure only one stage (input "
    "scaling, GEMM epilogue or combine) to apply them",
    "scaling_factor": "the routed scaling factor must be applied exactly once: fold it into the top-k "
    "weights or apply it in the combine, not both",
    "expert_ids": "GEMMs index weights by local expert id: put a dispatch stage before them",
    "num_experts": "the dispatch stage and the expert weights disagree on the number of (local) experts",
    "top_k": "the top-k and the stage after it disagree on k",
    "weights_at": "the router declares where its weights are applied (RoutingConfig.apply_weights): only the "
    "stage at that place may apply them: the dispatch (on_input), the down GEMM's epilogue "
    "(in_gemm_epilogue) or the combine (in_combine); a gate/up GEMM never does, the activation comes after it",
    "pending_scale": "the stage applying the routed scaling factor must apply the value the top-k left "
    "pending: use the top-k's routed_scaling_factor",
    "activations": "the expert computation holds exactly one activation between its two GEMMs: add an "
    "Activate stage (ActivationKind.IDENTITY where the model has none), or remove the extra one",
    "alignment": "the block-aligned dispatch and the GEMMs after it must align rows alike: build them from "
    "the same ConfigTable",
    "slot_order": "this stage would read the rows as copies, and a training step's block-aligned rows may come in "
    "slot order, where row r is not copy r: build the dispatch with "
    "AlignDispatch(..., slot_rows=False), "
    "or, for a stage that reads only the rows the alignment uses (row by row, or by its plan), accept them with "
    "Accepts(slot_order={False, True})",
}


def _raise(producer: str, consumer: str, mismatch: Mismatch) -> None:
    raise ContractError(
        producer=producer,
        consumer=consumer,
        field=mismatch.field,
        have=mismatch.have,
        want=mismatch.want,
        hint=mismatch.hint or _GENERIC_HINTS.get(mismatch.field, "make the two stages agree"),
    )


def _label(index: int, stage: Stage[Any, Any]) -> str:
    return f"stage {index} ({getattr(stage, 'name', type(stage).__name__)})"


def validate(stages: Sequence[Stage[Any, Any]], input_spec: Spec) -> list[Spec]:
    """Check every boundary; return the spec after each stage. Raises :class:`ContractError`."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    specs = []
    spec = input_spec
    producer = PIPELINE_INPUT
    for index, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise TypeError(f"stages[{index}] is a {type(stage).__name__}, not a moeforge Stage")
        label = _label(index, stage)
        if index == 0:
            _check_scales(spec, producer, label)
        mismatches = stage.check(spec)
        if mismatches:
            _raise(producer, label, mismatches[0])
        spec = _count_activations(spec, stage.output_spec(spec), stage, producer, label)
        consumer = _label(index + 1, stages[index + 1]) if index + 1 < len(stages) else PIPELINE_OUTPUT
        if spec.kind is PayloadKind.OUTPUT:
            # Before the scales: a quantized layer output is wrong with or without them, and the scales'
            # hint (produce them with a quantizer) would lead nowhere.
            _check_output_dtype(spec, label, consumer)
        _check_scales(spec, label, consumer)
        specs.append(spec)
        producer = label
    if spec.kind is PayloadKind.OUTPUT:
        _check_output(spec, producer)
    return specs


_ORDER = {kind: index for index, kind in enumerate(PayloadKind)}  # the order the forward produces them


def _count_activations(before: Spec, after: Spec, stage: Stage[Any, Any], producer: str, label: str) -> Spec:
    """``after`` with the activations applied since the dispatch counted; when ``stage`` completes the
    expert computation (its output is at or past ``EXPERT_OUTPUT``, its input before), exactly one."""
    count = before.activations + list(stage.kinds).count(StageKind.ACTIVATION)
    completes = _ORDER[before.kind] < _ORDER[PayloadKind.EXPERT_OUTPUT] <= _ORDER[after.kind]
    if completes and count != 1:
        _raise(producer, label, Mismatch(
            "activations", count, 1,
            f"the expert computation has {count} activations between its two GEMMs, not one: "
            + ("add an Activate stage between them (ActivationKind.IDENTITY where the model has none)" if count == 0
               else "keep one (a fused GEMM + activation already is one)")))
    return after.evolve(activations=count) if count != after.activations else after


def _check_scales(spec: Spec, producer: str, consumer: str) -> None:
    """Every dtype travels with the scales its format needs (SCALES_OF)."""
    allowed = SCALES_OF[spec.dtype]
    if spec.scale_layout not in allowed:
        if spec.dtype.is_quantized:
            hint = (f"{spec.dtype.value} values mean nothing without their scales: produce them with a quantizer "
                    "(QuantizeTokens / QuantizeRows / ActivateQuantize), not with an out_dtype")
        else:
            hint = f"a {spec.dtype.value} tensor carries no scales: a stage declared a scale layout it does not produce"
        _raise(producer, consumer, Mismatch("scale_layout", spec.scale_layout, allowed, hint))


def _check_output_dtype(spec: Spec, producer: str, consumer: str) -> None:
    if spec.dtype not in REFERENCE_FLOAT_DTYPES:
        _raise(producer, consumer, Mismatch(
            "dtype", spec.dtype, REFERENCE_FLOAT_DTYPES,
            "the layer's output is float: give the combine a float out_dtype (or None: the expert outputs' dtype)"))


def _check_output(spec: Spec, producer: str) -> None:
    """The rules of a layer's output beyond its dtype (checked with the stage that produced it)."""
    if spec.routing_weights is RoutingWeights.PENDING:
        _raise(producer, PIPELINE_OUTPUT, Mismatch(
            "routing_weights", spec.routing_weights, "applied exactly once",
            "no stage applied the routing weights: enable them "
            + (f"at the place the router declares ({spec.weights_at.value})" if spec.weights_at is not None
               else "in the combine, the second GEMM's epilogue or the dispatch (input scaling)")))
    if spec.weights_at is not None and spec.routing_weights is not spec.weights_at:
        _raise(producer, PIPELINE_OUTPUT, Mismatch(
            "weights_at", spec.routing_weights, spec.weights_at,
            f"the router declares its weights applied {spec.weights_at.value} but a stage applied them "
            f"{spec.routing_weights.value}: {_GENERIC_HINTS['weights_at']}"))
    if spec.scaling_factor is ScalingFactor.PENDING:
        _raise(producer, PIPELINE_OUTPUT, Mismatch(
            "scaling_factor", spec.scaling_factor, "applied exactly once",
            "the top-k left the routed scaling factor to a later stage but none applied it: set "
            + (f"routed_scaling_factor={spec.pending_scale:g} " if spec.pending_scale is not None
               else "routed_scaling_factor ")
            + "on the combine, or let the top-k fold it into the weights"))


def quantized_boundary(stages: Sequence[Stage[Any, Any]], specs: Sequence[Spec]) -> Optional[str]:
    """Why a pipeline with these stages and specs (as :func:`validate` returns them) has no backward:
    the first stage that produces quantized activations (their rounding has no gradient); ``None``
    when every boundary is float."""
    for index, (stage, spec) in enumerate(zip(stages, specs)):
        if spec.dtype.is_quantized:
            return (f"{_label(index, stage)} quantizes the activations to {spec.dtype.value}: quantized "
                    "activations have no gradient, so this pipeline is inference-only; run it under torch.no_grad()")
    return None


def _without_backward(reason: str, output: Any, x: Any) -> Any:
    """``output`` whose tensor has a backward raising ``reason`` (see :func:`moeforge.no_backward.no_backward`),
    tied to the float tensors of the pipeline's input ``x``."""
    sources = list(payload_tensors(x))
    if isinstance(output, MoEOutput):
        return MoEOutput(no_backward(reason, output.hidden_states, sources))
    if isinstance(output, (ExpertRows, RoutedTokens)):
        return output.with_x(Activations(no_backward(reason, output.x.data, sources), output.x.scale))
    return output


class Pipeline(Generic[InT, OutT]):
    """A validated, callable sequence of stages.

    Build it from a list of stages and the input spec (or with :func:`chain` for static typing).
    Validation happens here, once. Each call checks its input payload against the input spec
    (types, shapes, dtypes, devices: metadata only, no device work) and raises
    :class:`~moeforge.InputError` naming the argument, then runs the stages. With ``debug=True`` the
    input's values are checked too (non-finite hidden states or logits), and every payload is checked
    against its spec after each stage, values included (off by default: those checks synchronise
    with the device).
    ``notes`` are extra lines for :meth:`describe`, such as the dispatch-dtype decision.

    A stage may offer to run itself and the stages after it as one unit (:meth:`~moeforge.Stage.joined`: the triton
    experts as one unit, one autograd node for a training step, :mod:`moeforge.stages.triton_step`); a call runs that
    unit where it takes the call, and the stages one by one otherwise (and always in debug mode, which checks each
    stage's payload).
    :meth:`describe` names each such unit.

    ``no_backward``: why the computation has no backward (e.g. a quantized method's reason, naming it),
    ``None`` when it has one. A pipeline whose activations are quantized at some boundary has none
    either way (see :func:`quantized_boundary`). Without a backward, the output of a call that records
    gradients gets a backward that raises :class:`~moeforge.errors.InferenceOnlyError` with the reason
    (:attr:`no_backward` holds it).
    """

    __slots__ = ("stages", "input_spec", "specs", "debug", "notes", "declared_no_backward", "no_backward", "joined")

    def __init__(
        self,
        stages: Sequence[Stage[Any, Any]],
        input_spec: Spec,
        *,
        debug: bool = False,
        notes: Sequence[str] = (),
        no_backward: Optional[str] = None,
    ) -> None:
        self.stages: tuple[Stage[Any, Any], ...] = tuple(stages)
        self.input_spec = input_spec
        self.specs: tuple[Spec, ...] = tuple(validate(self.stages, input_spec))
        self.debug = debug
        self.notes: tuple[str, ...] = tuple(notes)
        self.declared_no_backward = no_backward
        self.no_backward: Optional[str] = no_backward or quantized_boundary(self.stages, self.specs)
        self.joined: tuple[Optional[JoinedRun], ...] = joined_runs(self.stages)

    @property
    def output_spec(self) -> Spec:
        return self.specs[-1]

    def __call__(self, x: InT) -> OutT:
        return self.run(x)

    def run(self, x: InT, *, input_checked: bool = False) -> OutT:
        """Run the stages on ``x``, on the CUDA device its tensors are on (:mod:`moeforge.device_guard`).
        ``input_checked=True`` skips the input's metadata checks, for a caller that has just made the same checks
        with its own messages (``MoELayer.forward``); debug mode checks everything regardless."""
        with on_device_of(next(payload_tensors(x), None) if several_devices() else None):
            if self.debug:
                return self._run_checked(x)
            if not input_checked:
                self._check_input(x, values=False)
            payload: Any = x
            stages, joined, index = self.stages, self.joined, 0
            while index < len(stages):
                run = joined[index]
                if run is not None:
                    output = run(payload)
                    if output is not None:
                        payload, index = output, index + run.joins + 1
                        continue
                payload = stages[index](payload)
                index += 1
            if self.no_backward is not None and torch.is_grad_enabled():
                payload = _without_backward(self.no_backward, payload, x)
            return cast(OutT, payload)

    def _run_checked(self, x: Any) -> OutT:
        self._check_input(x, values=True)
        payload: Any = x
        for index, (stage, spec) in enumerate(zip(self.stages, self.specs)):
            payload = stage(payload)
            self._check(payload, spec, _label(index, stage))
        if self.no_backward is not None and torch.is_grad_enabled():
            payload = _without_backward(self.no_backward, payload, x)
        return cast(OutT, payload)

    def _check_input(self, payload: Any, values: bool) -> None:
        try:
            check_payload(payload, self.input_spec, values=values)
        except PayloadError as error:
            raise InputError(f"the pipeline input does not match its input spec "
                             f"({self.input_spec.short()}): {error}") from None

    @staticmethod
    def _check(payload: Any, spec: Spec, where: str) -> None:
        try:
            check_payload(payload, spec)
        except PayloadError as error:
            raise PayloadError(f"{where} produced a payload that breaks its spec: {error}") from error

    def replace(self, which: Union[int, str], stage: Stage[Any, Any]) -> Pipeline[InT, OutT]:
        """A new pipeline with one stage replaced (by index or by stage name), validated again."""
        index = self.index(which)
        stages = list(self.stages)
        stages[index] = stage
        return Pipeline(stages, self.input_spec, debug=self.debug, notes=self.notes,
                        no_backward=self.declared_no_backward)

    def index(self, which: Union[int, str]) -> int:
        if isinstance(which, int):
            if not -len(self.stages) <= which < len(self.stages):
                raise IndexError(f"stage index {which} out of range for {len(self.stages)} stages")
            return which % len(self.stages)
        names = [stage.name for stage in self.stages]
        if names.count(which) != 1:
            raise KeyError(
                f"stage name {which!r} matches {names.count(which)} stages (names: {names}); "
                "use an index"
            )
        return names.index(which)

    def describe(self) -> str:
        """A table: the input spec, then each stage with its kinds and the spec it produces (which
        the next stage consumes), then the notes (e.g. which rule chose the dispatch dtype)."""
        rows = [("#", "stage", "kinds", "produces"), ("in", "(pipeline input)", "", self.input_spec.short())]
        for index, (stage, spec) in enumerate(zip(self.stages, self.specs)):
            kinds = "+".join(kind.value for kind in stage.kinds)
            rows.append((str(index), stage.summary(), kinds, spec.short()))
        widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        notes = list(self.notes)
        notes += [f"stages {index}-{index + run.joins}: {run.summary()}" for index, run in enumerate(self.joined)
                  if run is not None]
        if self.no_backward is not None:
            notes.append(f"no backward: {self.no_backward}")
        return "\n".join(lines + notes)

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(stage.summary() for stage in self.stages)})"


def joined_runs(stages: Sequence[Stage[Any, Any]]) -> tuple[Optional[JoinedRun], ...]:
    """Each stage's :class:`~moeforge.stage.JoinedRun` where it offers one (:meth:`~moeforge.Stage.joined`) that ends
    inside the pipeline and starts after the previous one's last stage; ``None`` at every other position."""
    runs: list[Optional[JoinedRun]] = [None] * len(stages)
    index = 0
    while index < len(stages):
        run = stages[index].joined(tuple(stages[index + 1:]))
        if run is not None and 0 < run.joins < len(stages) - index:
            runs[index] = run
            index += run.joins + 1
        else:
            index += 1
    return tuple(runs)


class Chain(Generic[InT, OutT]):
    """A statically typed pipeline under construction: ``chain(a).then(b).then(c).build(spec)``.

    Each ``then`` requires a stage whose input type accepts the previous output type, so a type
    checker flags e.g. a combine placed before a dispatch.
    """

    __slots__ = ("_stages",)

    def __init__(self, stages: tuple[Stage[Any, Any], ...]) -> None:
        self._stages = stages

    def then(self, stage: Stage[OutT, NewT]) -> Chain[InT, NewT]:
        return Chain(self._stages + (stage,))

    def build(self, input_spec: Spec, *, debug: bool = False, notes: Sequence[str] = (),
              no_backward: Optional[str] = None) -> Pipeline[InT, OutT]:
        return Pipeline(self._stages, input_spec, debug=debug, notes=notes, no_backward=no_backward)


def chain(first: Stage[InT, OutT]) -> Chain[InT, OutT]:
    """Start a typed pipeline with its first stage."""
    return Chain((first,))
