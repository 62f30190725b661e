"""The kernels test a group of weight formats by a range of codes (``B_FMT >= W_FIRST_PACKED``); the ranges must
say what the descriptor says of every format, so that a new format placed in the wrong group fails here instead of
being decoded as another group's."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from moeforge.kernels import format_codes as codes  # noqa: E402
from moeforge.kernels.formats import KTail, RowFormat, RowScales, WeightFormat  # noqa: E402


@pytest.mark.parametrize("fmt", list(WeightFormat), ids=lambda f: f.name)
def test_the_kernels_ranges_agree_with_the_descriptor(fmt: WeightFormat) -> None:
    assert (fmt >= int(codes.W_FIRST_PACKED.value)) == fmt.packed
    assert (fmt >= int(codes.W_FIRST_E2M1.value)) == fmt.e2m1


def test_every_code_has_its_name() -> None:
    named = {"W_" + fmt.name: int(fmt) for fmt in WeightFormat}
    named.update({"ROWS_" + fmt.name: int(fmt) for fmt in RowFormat})
    named.update({"SCALES_" + mode.name: int(mode) for mode in RowScales})
    named.update({"K_" + tail.name: int(tail) for tail in KTail})
    for name, value in named.items():
        assert int(getattr(codes, name).value) == value, name
