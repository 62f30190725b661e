"""The stage interface: one step of the MoE forward, with a declared contract.

A stage is generic in its input and output payload types, so a type checker can flag an obviously
wrong composition built with :func:`moeforge.chain`. At build time the pipeline asks each stage
what it accepts (:meth:`Stage.check`) and what it produces (:meth:`Stage.output_spec`); at run time
it only calls the stage.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, ClassVar, Generic, Optional, Protocol, TypeVar

import attrs

from moeforge.spec import Accepts, Spec

InT = TypeVar("InT", contravariant=True)
OutT = TypeVar("OutT", covariant=True)


class StageKind(enum.Enum):
    TOPK = "topk"
    QUANTIZE = "quantize"
    DISPATCH = "dispatch"
    GEMM = "gemm"
    ACTIVATION = "activation"
    COMBINE = "combine"


@attrs.frozen
class Mismatch:
    """One field a stage cannot accept, with a hint for the person who composed the pipeline."""

    field: str
    have: object
    want: object
    hint: Optional[str] = None


class Stage(abc.ABC, Generic[InT, OutT]):
    """Base class of every stage.

    Subclasses set ``kinds`` (several consecutive kinds for a fused stage) and implement
    :meth:`accepts`, :meth:`output_spec` and :meth:`__call__`. Override :meth:`check` for constraints
    that a per-field set of allowed values cannot express (e.g. "width must be even"), and
    :meth:`hint` to give a better hint than the generic one for a field.
    """

    kinds: ClassVar[tuple[StageKind, ...]]

    @property
    def name(self) -> str:
        return type(self).__name__

    def summary(self) -> str:
        """A short description for ``Pipeline.describe()``; defaults to the class name."""
        return self.name

    @abc.abstractmethod
    def accepts(self) -> Accepts:
        """The allowed values of each input-spec field."""

    def check(self, spec: Spec) -> list[Mismatch]:
        """Every reason this stage cannot consume ``spec`` (empty when it can)."""
        return [
            Mismatch(field, have, want, self.hint(field, have))
            for field, have, want in self.accepts().mismatches(spec)
        ]

    def hint(self, field: str, have: object) -> Optional[str]:
        """A stage-specific hint for a mismatch on ``field``; ``None`` uses the generic one."""
        return None

    @abc.abstractmethod
    def output_spec(self, spec: Spec) -> Spec:
        """The spec this stage produces from an accepted input spec."""

    @abc.abstractmethod
    def __call__(self, x: InT) -> OutT:
        """Run the stage on one payload."""

    def joined(self, following: tuple[Stage[Any, Any], ...]) -> Optional[JoinedRun]:
        """A run of this stage and the first stages of ``following`` (the stages after it in a pipeline) as one
        unit, which the pipeline calls instead of them where it takes a call (:class:`JoinedRun`); ``None``, the
        default: none."""
        return None


class JoinedRun(Protocol):
    """A stage and the ``joins`` stages after it run as one unit (:meth:`Stage.joined`), giving what the stages give
    (the same payload, bit for bit, and the same gradients), faster. Called with the first stage's input, it returns
    the last one's output, or ``None`` where the call is not one it takes: the pipeline then runs the stages one by
    one. ``summary()`` is a line for ``Pipeline.describe()``."""

    @property
    def joins(self) -> int: ...

    def summary(self) -> str: ...

    def __call__(self, x: Any) -> Optional[Any]: ...
