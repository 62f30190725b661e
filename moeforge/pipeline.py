"""Pipelines: an ordered sequence of stages, validated once when built and cheap to call.

Validation walks the specs from the input through every stage: each stage must accept the spec its
predecessor produces, and a pipeline that ends in an ``OUTPUT`` payload must have applied the
routing weights and the routed scaling factor exactly once. Any disagreement raises
:class:`~moeforge.errors.ContractError` before a tensor exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar, Union, cast

from moeforge.errors import ContractError, InputError, PayloadError
from moeforge.payloads import check_payload
from moeforge.spec import PayloadKind, RoutingWeights, ScalingFactor, Spec
from moeforge.stage import Mismatch, Stage

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
    return f"stage {index} ({stage.name})"


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
        mismatches = stage.check(spec)
        if mismatches:
            _raise(producer, _label(index, stage), mismatches[0])
        spec = stage.output_spec(spec)
        specs.append(spec)
        producer = _label(index, stage)
    if spec.kind is PayloadKind.OUTPUT:
        if spec.routing_weights is RoutingWeights.PENDING:
            _raise(producer, PIPELINE_OUTPUT, Mismatch(
                "routing_weights", spec.routing_weights, "applied exactly once",
                "no stage applied the routing weights: enable them in the combine, the second GEMM's "
                "epilogue or the dispatch (input scaling)"))
        if spec.scaling_factor is ScalingFactor.PENDING:
            _raise(producer, PIPELINE_OUTPUT, Mismatch(
                "scaling_factor", spec.scaling_factor, "applied exactly once",
                "the top-k left the routed scaling factor to a later stage but none applied it: set "
                "routed_scaling_factor on the combine, or let the top-k fold it into the weights"))
    return specs


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
    """

    __slots__ = ("stages", "input_spec", "specs", "debug", "notes")

    def __init__(
        self,
        stages: Sequence[Stage[Any, Any]],
        input_spec: Spec,
        *,
        debug: bool = False,
        notes: Sequence[str] = (),
    ) -> None:
        self.stages: tuple[Stage[Any, Any], ...] = tuple(stages)
        self.input_spec = input_spec
        self.specs: tuple[Spec, ...] = tuple(validate(self.stages, input_spec))
        self.debug = debug
        self.notes: tuple[str, ...] = tuple(notes)

    @property
    def output_spec(self) -> Spec:
        return self.specs[-1]

    def __call__(self, x: InT) -> OutT:
        return self.run(x)

    def run(self, x: InT, *, input_checked: bool = False) -> OutT:
        """Run the stages on ``x``. ``input_checked=True`` skips the input's metadata checks, for a
        caller that has just made the same checks with its own messages (``MoELayer.forward``);
        debug mode checks everything regardless."""
        if self.debug:
            return self._run_checked(x)
        if not input_checked:
            self._check_input(x, values=False)
        payload: Any = x
        for stage in self.stages:
            payload = stage(payload)
        return cast(OutT, payload)

    def _run_checked(self, x: Any) -> OutT:
        self._check_input(x, values=True)
        for index, (stage, spec) in enumerate(zip(self.stages, self.specs)):
            x = stage(x)
            self._check(x, spec, _label(index, stage))
        return cast(OutT, x)

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
        return Pipeline(stages, self.input_spec, debug=self.debug, notes=self.notes)

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
        return "\n".join(lines + list(self.notes))

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(stage.summary() for stage in self.stages)})"


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

    def build(self, input_spec: Spec, *, debug: bool = False, notes: Sequence[str] = ()) -> Pipeline[InT, OutT]:
        return Pipeline(self._stages, input_spec, debug=debug, notes=notes)


def chain(first: Stage[InT, OutT]) -> Chain[InT, OutT]:
    """Start a typed pipeline with its first stage."""
    return Chain((first,))
