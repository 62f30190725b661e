"""The README's training figure reads the timed steps of a ``bench_train.py`` result (``benchmarks/plot_train.py``;
the drawing needs matplotlib, the data does not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot_train  # noqa: E402

OURS, THEIRS = plot_train.PATHS["moeforge"], plot_train.PATHS["torch_grouped_mm"]


def test_series_take_the_timed_steps_and_their_speed_up() -> None:
    result = dict(records=[
        dict(shape="s", M=4096, what="moeforge", median_us=50.0, pct_peak=60.0),
        dict(shape="s", M=1024, what="moeforge", median_us=20.0, pct_peak=30.0),
        dict(shape="s", M=1024, what="torch_grouped_mm", median_us=30.0, pct_peak=20.0),
        dict(shape="s", M=1024, what="moeforge_memory", peak_mib=5.0),  # a listing, not a timed step
        dict(shape="s", M=4096, what="torch_grouped_mm_kernels", kernels=[]),
        dict(shape="sonicmoe", M=32768, what="moeforge_sonicmoe", forward_us=1.0),
    ])
    assert plot_train.series(result) == {"s": {
        OURS: [(1024, 30.0), (4096, 60.0)], THEIRS: [(1024, 20.0)], "speed-up": [(1024, 1.5)]}}


def test_a_run_of_both_layouts_draws_its_slot_order_step() -> None:
    # bench_train.py --slot-rows both: the slot-order step is the layer's (the rule takes it everywhere)
    result = dict(records=[
        dict(shape="s", M=1024, what="moeforge_copy_order", median_us=25.0, pct_peak=24.0),
        dict(shape="s", M=1024, what="moeforge_slot_order", median_us=20.0, pct_peak=30.0),
        dict(shape="s", M=1024, what="torch_grouped_mm", median_us=30.0, pct_peak=20.0),
    ])
    assert plot_train.series(result) == {"s": {OURS: [(1024, 30.0)], THEIRS: [(1024, 20.0)], "speed-up": [(1024, 1.5)]}}


def test_the_committed_results_give_every_cell_of_the_readme_table() -> None:
    result = json.loads(plot_train.DEFAULT_FILE.read_text())
    data = plot_train.series(result)
    assert set(data) == {"mixtral", "qwen3", "gptoss", "deepseek"}
    for shape, lines in data.items():
        assert [m for m, _ in lines["speed-up"]] == [1024, 4096, 16384]
        recorded = [r["speedup_vs_grouped_mm"] for r in result["records"]  # (the steps the figure draws)
                    if r.get("shape") == shape and plot_train.PATHS.get(r.get("what", "")) == OURS]
        assert [round(x, 2) for _, x in lines["speed-up"]] == pytest.approx(recorded, abs=0.011)
        assert all(0 < pct < 100 for path in (OURS, THEIRS) for _, pct in lines[path])


def test_the_figure_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = plot_train.series(json.loads(plot_train.DEFAULT_FILE.read_text()))
    out = tmp_path / "training.png"
    plot_train.plot(data, out, "test")
    assert out.stat().st_size > 10_000
