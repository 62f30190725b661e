"""Checks of construction arguments (sizes, flags, factors, enum choices): each raises
:class:`~moeforge.InputError` naming the argument, when the object is built rather than as a wrong
answer in its first forward.

The enum policy of the library: an enum-typed argument takes the member or its value string
(``"swiglu"`` for ``ActivationKind.SWIGLU``; case and surrounding spaces ignored), and anything else
is refused with the enum's name and its values.
"""

from __future__ import annotations

import enum
import math
from typing import TypeVar

from moeforge.errors import InputError

E = TypeVar("E", bound=enum.Enum)


def enum_member(kind: type[E], argument: str, value: object) -> E:
    """``value`` as a member of ``kind``: the member itself or its value string."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in kind:
            if member.value == key:
                return member
    choices = ", ".join(repr(member.value) for member in kind)
    raise InputError(f"{argument} must be a {kind.__name__} or one of its values {choices}, got {value!r}")


def positive_int(argument: str, value: object) -> int:
    """``value`` if it is an int >= 1 (a bool is not a size: ``True`` would be taken as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{argument} must be a positive int, got {value!r}")
    return value


def flag(argument: str, value: object) -> bool:
    """``value`` if it is a bool (a truthy string such as ``"no"`` would silently mean ``True``)."""
    if not isinstance(value, bool):
        raise InputError(f"{argument} must be a bool, got {value!r}")
    return value


def real(argument: str, value: object) -> float:
    """``value`` as a float if it is an int or a float (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InputError(f"{argument} must be a number, got {value!r}")
    return float(value)


def positive_finite(argument: str, value: object) -> float:
    """``value`` as a float if it is finite and > 0."""
    number = real(argument, value)
    if not 0.0 < number < math.inf:
        raise InputError(f"{argument} must be finite and > 0, got {value!r}")
    return number


def instance_of(argument: str, value: object, kind: type, example: str) -> None:
    """Refuses a ``value`` that is not a ``kind`` saying what to pass (``example``: a call that builds one),
    and a ``kind`` class given instead of an instance saying to pass an instance."""
    if isinstance(value, kind):
        return
    if isinstance(value, type) and issubclass(value, kind):
        raise InputError(f"{argument}={value.__name__} is the class: pass an instance, {argument}={value.__name__}()")
    article = "an" if kind.__name__[0] in "AEIOU" else "a"
    raise InputError(f"{argument} must be {article} {kind.__name__} (e.g. {example}), got {type(value).__name__} "
                     f"{value!r}")
