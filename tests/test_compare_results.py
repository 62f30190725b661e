"""``benchmarks/compare_results.py``: the cell-by-cell A/B table of bench_moe.py results files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_results  # noqa: E402


def _result(commit: str, times: dict[tuple[str, int, str], float]) -> dict[str, Any]:
    return {"device": "GPU", "commit": commit, "records": [
        {"shape": s, "M": m, "what": w, "median_us": us, "batch_invariant": False} for (s, m, w), us in times.items()]}


def test_common_cells_with_times_and_ratios_to_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _result("aaa", {("mixtral", 8, "experts_nvfp4"): 200.0, ("mixtral", 8, "experts_mxfp4"): 100.0,
                             ("qwen3", 1, "experts_nvfp4"): 30.0})
    after = _result("bbb", {("mixtral", 8, "experts_nvfp4"): 150.0, ("mixtral", 8, "experts_mxfp4"): 100.0})
    paths = []
    for name, result in (("a.json", before), ("b.json", after)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(result))
    assert compare_results.main([str(p) for p in paths] + ["--ratio", "experts_nvfp4,experts_mxfp4"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("mixtral")]
    assert len(rows) == 2 and not any(line.startswith("qwen3") for line in out)  # only the cells both files have
    nvfp4 = next(line for line in rows if "experts_nvfp4" in line)
    assert "200.0 us" in nvfp4 and "150.0 us" in nvfp4 and nvfp4.endswith("0.750")
    assert "aaa: mixtral M=8 2.00" in out[-2] and "bbb: mixtral M=8 1.50" in out[-1]


def test_what_filters_the_cells() -> None:
    result = _result("c", {("gptoss", 1, "experts"): 60.0, ("gptoss", 1, "experts_mxfp4"): 40.0})
    lines = compare_results.compare([result, result], {"experts_mxfp4"})
    assert len(lines) == 2 and "experts_mxfp4" in lines[1] and lines[1].endswith("1.000")


def test_a_ratio_needs_two_kinds(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_result("c", {("gptoss", 1, "experts"): 60.0})))
    with pytest.raises(SystemExit):
        compare_results.main([str(path), "--ratio", "experts"])
