"""Stages are generic in their payload types: mypy flags an obviously wrong composition."""

from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

HERE = Path(__file__).parent / "typing"


def _mypy(path: Path) -> tuple[str, int]:
    stdout, stderr, status = api.run(["--strict", "--no-error-summary", "--follow-imports=silent",
                                      str(path)])
    return stdout + stderr, status


def test_well_typed_chain_passes_mypy() -> None:
    out, status = _mypy(HERE / "good_chain.py")
    assert status == 0, out


def test_gemm_after_topk_is_a_type_error() -> None:
    out, status = _mypy(HERE / "bad_chain.py")
    assert status == 1
    assert "bad_chain.py:9" in out and "then" in out, out
