"""The README's performance figure reads only read-bandwidth roofline figures from the results files
(``benchmarks/plot_roofline.py``; the drawing needs matplotlib, the data does not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot_roofline  # noqa: E402


def _write(path: Path, result: dict[str, object]) -> Path:
    path.write_text(json.dumps(result))
    return path


def test_series_keep_read_bandwidth_figures_and_later_files_win(tmp_path: Path) -> None:
    old = _write(tmp_path / "old.json", dict(date="2026-01-01", bandwidth_tbps=2.3, records=[
        dict(shape="s", M=1, what="experts", pct_roofline=120.0, pct_roofline_read=90.0),
        dict(shape="s", M=8, what="experts", pct_roofline=130.0, pct_roofline_read=95.0),
        dict(shape="s", M=8, what="experts_fp8", pct_roofline=50.0),  # copy bandwidth only: left out
        dict(shape="s", M=8, what="layer", pct_roofline=1.0, pct_roofline_read=1.0),
    ]))
    new = _write(tmp_path / "new.json", dict(date="2026-02-01", read_bandwidth_tbps=2.9, records=[
        dict(shape="s", M=8, what="experts", pct_roofline=97.0),
        dict(shape="s", M=8, what="experts_mxfp4", pct_roofline=40.0),
        dict(shape="s", M=8, what="experts_batch_invariant", pct_roofline=93.0),
    ]))
    data = plot_roofline.series([old, new])
    assert data == {
        "s bf16 (2026-01-01, 2026-02-01)": [(1, 90.0), (8, 97.0)],
        "s bf16 batch-invariant (2026-02-01)": [(8, 93.0)],
        "s mxfp4 (2026-02-01)": [(8, 40.0)],
    }


def test_the_committed_results_give_every_shape() -> None:
    data = plot_roofline.series(list(plot_roofline.DEFAULT_FILES))
    shapes = {label.split()[0] for label in data}
    assert shapes == {"mixtral", "qwen3", "deepseek", "gptoss"}
    assert all(0 < pct < 150 for points in data.values() for _, pct in points)
