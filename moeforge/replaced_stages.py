"""Stages a user swapped into a layer (``MoELayer.replace_stage``), and how a rebuilt pipeline gets them back.

A layer rebuilds its pipeline whenever what it is built from changes: a new dtype or device, loaded
weights, another quant method (``quantize_layer``). The stages around a replaced one may differ then — a
quantizer appears before the dispatch, the activation becomes an ``ActivateQuantize`` — so the index or
name the user gave may point at another step of the forward, or at none. A replacement is remembered by
its :class:`Place` instead: the payloads the replaced stage read and produced, the kinds of work it did,
and which such stage it was. The rebuilt pipeline's stage at that place is swapped again and checked like
any replacement; where the new pipeline has no stage there, or the custom stage disagrees with a neighbour,
:class:`~moeforge.errors.ReplacedStageError` names it and says what to do (never a silent drop: the
custom stage is the user's math).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import attrs

from moeforge.errors import ContractError, ReplacedStageError
from moeforge.pipeline import Pipeline
from moeforge.spec import PayloadKind
from moeforge.stage import Stage, StageKind

WHAT_TO_DO = ("rebuild (or quantize) a layer without this custom stage — remove it from its replaced_stages, or "
              "start from one without it — then swap in a stage made for the new pipeline with replace_stage "
              "(layer.describe() lists its stages)")


@attrs.frozen
class Place:
    """Where a stage sits in the forward, whatever the stages around it."""

    reads: PayloadKind
    produces: PayloadKind
    kinds: tuple[StageKind, ...]
    nth: int = 0  # among the stages with the same three: which one

    @classmethod
    def of(cls, pipeline: Pipeline[Any, Any], index: int) -> Place:
        places = _places(pipeline)
        return cls(*places[index], nth=places[:index].count(places[index]))

    def find(self, pipeline: Pipeline[Any, Any]) -> Optional[int]:
        """The index of the stage at this place in ``pipeline``, or ``None``."""
        found = [index for index, place in enumerate(_places(pipeline))
                 if place == (self.reads, self.produces, self.kinds)]
        return found[self.nth] if self.nth < len(found) else None

    def describe(self) -> str:
        return f"the {_kinds(self.kinds)} stage ({self.reads.value} -> {self.produces.value})"


def _places(pipeline: Pipeline[Any, Any]) -> list[tuple[PayloadKind, PayloadKind, tuple[StageKind, ...]]]:
    reads = [pipeline.input_spec.kind] + [spec.kind for spec in pipeline.specs[:-1]]
    return [(read, spec.kind, tuple(stage.kinds)) for read, spec, stage in zip(reads, pipeline.specs, pipeline.stages)]


def _kinds(kinds: tuple[StageKind, ...]) -> str:
    return "+".join(kind.value for kind in kinds)


@attrs.frozen(eq=False)
class ReplacedStage:
    """One ``replace_stage(which, stage)`` call: the custom stage and the place of the stage it replaced."""

    which: Union[int, str]  # as the user named it (for messages)
    stage: Stage[Any, Any]
    place: Place

    def put_back(self, pipeline: Pipeline[Any, Any], built_for: str) -> Pipeline[Any, Any]:
        """``pipeline`` with this custom stage at its place, validated; :class:`ReplacedStageError` where it
        does not fit (``built_for`` says what the pipeline was rebuilt for)."""
        name = self.stage.name
        summary = (f"this layer has a custom stage, {name} (replace_stage({self.which!r}, ...)), that does not fit "
                   f"its pipeline rebuilt for {built_for}")
        index = self.place.find(pipeline)
        if index is None:
            there = [stage for stage, place in zip(pipeline.stages, _places(pipeline))
                     if place[:2] == (self.place.reads, self.place.produces)
                     or set(self.place.kinds) & set(stage.kinds)]
            found = ", ".join(f"{stage.name} ({_kinds(tuple(stage.kinds))})" for stage in there) or "none"
            raise ReplacedStageError(
                f"{summary}: it took the place of {self.place.describe()}, which the new pipeline does not have "
                f"(there: {found})",
                stage=name, producer="the rebuilt pipeline", consumer=f"custom stage {name}", field="kinds",
                have=found, want=_kinds(self.place.kinds),
                hint=f"{name} cannot take the place of {found}: {WHAT_TO_DO}")
        try:
            return pipeline.replace(index, self.stage)
        except ContractError as error:
            raise ReplacedStageError(
                f"{summary}: at stage {index} it disagrees with a neighbour", stage=name, producer=error.producer,
                consumer=error.consumer, field=error.field, have=error.have, want=error.want,
                hint=f"{error.hint}; or {WHAT_TO_DO}") from error


def record(pipeline: Pipeline[Any, Any], replaced: list[ReplacedStage], which: Union[int, str],
           stage: Stage[Any, Any]) -> list[ReplacedStage]:
    """``replaced`` after ``replace_stage(which, stage)`` on ``pipeline`` (which holds the stages before
    it). Replacing a custom stage again supersedes it: the new one takes its place."""
    current = pipeline.stages[pipeline.index(which)]
    earlier = next((item for item in replaced if item.stage is current), None)
    place = earlier.place if earlier is not None else Place.of(pipeline, pipeline.index(which))
    return [item for item in replaced if item is not earlier] + [ReplacedStage(which, stage, place)]
