"""``tests/gpu_shards.py``, the runner of the suite in shards: the cut balances recorded seconds, every
test lands in exactly one shard, and a shard's summary names what failed, what was skipped and what never
ran (a shard stopped by its timeout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_shards


def test_shards_cover_every_test_once_in_order() -> None:
    tests = [f"tests/test_{i // 7}.py::test_{i}" for i in range(50)]
    for shards in (1, 3, 8, 60):
        pieces = gpu_shards.split(tests, shards, {})
        assert len(pieces) == shards and [test for piece in pieces for test in piece] == tests


def test_recorded_seconds_balance_the_shards() -> None:
    tests = [f"t::{i}" for i in range(10)]
    seconds = {"t::0": 90.0, **{f"t::{i}": 10.0 for i in range(1, 10)}}
    pieces = gpu_shards.split(tests, 2, seconds)
    assert pieces[0] == ["t::0"]  # the slow test alone, the nine others together
    assert len(pieces[1]) == 9


def test_a_summary_names_failures_skips_and_tests_that_never_ran(tmp_path: Path) -> None:
    log = tmp_path / "shard-0.jsonl"
    lines = [
        {"test": "a", "when": "call", "outcome": "passed", "seconds": 1.0, "reason": ""},
        {"test": "b", "when": "call", "outcome": "failed", "seconds": 2.0, "reason": "AssertionError: 1 != 2"},
        {"test": "c", "when": "setup", "outcome": "skipped", "seconds": 0.0, "reason": "needs a CUDA device"},
        {"test": "a", "when": "teardown", "outcome": "failed", "seconds": 0.1, "reason": "leaked"},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = gpu_shards.summarize(0, ["a", "b", "c", "d"], log, 12.0, -9, tmp_path)
    assert summary["failed"] == ["a", "b"] and summary["passed"] == 0
    assert summary["skipped"] == {"c": "needs a CUDA device"}
    assert summary["not_run"] == ["d"]
    assert summary["failures"]["b"] == "AssertionError: 1 != 2"
    text = (tmp_path / "shard-0.txt").read_text()
    assert "FAILED b" in text and "NOT RUN d" in text and "pytest exit -9" in text
    assert gpu_shards.known_durations([str(tmp_path)]) == {"a": 0.1, "b": 2.0, "c": 0.0}
    # a results folder's gathered runs count too (benchmarks/results' gpu_suite*.json), read in name order
    (tmp_path / "gpu_suite-card-2026-01-01.json").write_text(json.dumps({"seconds": {"a": 5.0, "e": 3.0}}))
    (tmp_path / "gpu_suite_touched-card-2026-01-02.json").write_text(json.dumps({"device": "card"}))
    assert gpu_shards.known_durations([str(tmp_path)]) == {"a": 0.1, "b": 2.0, "c": 0.0, "e": 3.0}


def test_a_shard_the_cut_leaves_empty_runs_nothing(tmp_path: Path) -> None:
    # One slow test fills two of three shards' estimate: the middle shard gets no test, and must not run pytest
    # without node ids (which would run every test of the folder). A copy of the runner in a folder of two tests.
    import shutil
    import subprocess
    import sys

    (tmp_path / "tests").mkdir()
    shutil.copy(Path(gpu_shards.__file__), tmp_path / "tests" / "gpu_shards.py")
    (tmp_path / "tests" / "test_tiny.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    (tmp_path / "tests" / "test_other.py").write_text("def test_c():\n    pass\n")
    durations = tmp_path / "seconds.json"
    durations.write_text(json.dumps({"seconds": {"tests/test_tiny.py::test_a": 100.0,
                                                 "tests/test_tiny.py::test_b": 0.01}}))
    done = subprocess.run([sys.executable, "tests/gpu_shards.py", "--shards", "3", "--jobs", "3", "--durations",
                           str(durations), "--out", "out", "--", "tests/test_tiny.py"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    summaries = [json.loads((tmp_path / "out" / f"shard-{index}.json").read_text()) for index in range(3)]
    assert [(summary["tests"], summary["passed"]) for summary in summaries] == [(1, 1), (0, 0), (1, 1)]
    run = json.loads((tmp_path / "out" / "gpu_suite.json").read_text())  # the whole run in one record
    assert run["totals"] == {"tests": 2, "with_outcome": 2, "passed": 2, "skipped": 0, "failed": 0, "not_run": 0}
    assert sorted(run["seconds"]) == ["tests/test_tiny.py::test_a", "tests/test_tiny.py::test_b"]
    assert run["collected"] == ["tests/test_tiny.py"] and run["shards"] == 3


def test_a_copy_of_the_tree_inside_another_project_runs_its_own_tests(tmp_path: Path) -> None:
    # An A/B tree (a copy of moeforge and its tests) inside the repository: pytest would take the outer
    # pyproject.toml's folder as its rootdir and name the copy's tests from there, node ids the shards (run in the
    # copy) cannot find. The runner pins --rootdir to its own tree.
    import shutil
    import subprocess
    import sys

    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = ''\n")
    tree = tmp_path / "ab" / "copy"
    (tree / "tests").mkdir(parents=True)
    shutil.copy(Path(gpu_shards.__file__), tree / "tests" / "gpu_shards.py")
    (tree / "tests" / "test_tiny.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    assert False\n")
    done = subprocess.run([sys.executable, "tests/gpu_shards.py", "--shards", "2", "--jobs", "2", "--out", "out", "--",
                           "tests/test_tiny.py"], cwd=tree, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr  # (test_b fails: every test had an outcome)
    run = json.loads((tree / "out" / "gpu_suite.json").read_text())
    assert run["totals"]["passed"] == 1 and run["failed"] == ["tests/test_tiny.py::test_b"] and not run["not_run"]
    assert "assert False" in run["failures"]["tests/test_tiny.py::test_b"]


def test_the_deadline_stops_the_run_and_lists_what_has_no_outcome(tmp_path: Path) -> None:
    # One job, two shards: the first sleeps past the run's deadline (stopped, what it finished kept), the second never
    # starts; every summary is written, and unfinished.txt lists the tests without an outcome for the next run.
    import shutil
    import subprocess
    import sys

    (tmp_path / "tests").mkdir()
    shutil.copy(Path(gpu_shards.__file__), tmp_path / "tests" / "gpu_shards.py")
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\n\ndef test_a():\n    pass\n\n\ndef test_b():\n    time.sleep(600)\n")
    (tmp_path / "tests" / "test_later.py").write_text("def test_c():\n    pass\n\n\ndef test_d():\n    pass\n")
    done = subprocess.run([sys.executable, "tests/gpu_shards.py", "--shards", "2", "--jobs", "1", "--deadline", "1",
                           "--out", "out", "--", "tests/test_slow.py", "tests/test_later.py"], cwd=tmp_path,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    first, second = (json.loads((tmp_path / "out" / f"shard-{index}.json").read_text()) for index in range(2))
    # (whether test_a finished before the stop depends on how fast the machine started pytest: either is right)
    assert "tests/test_slow.py::test_b" in first["not_run"] and first["passed"] + len(first["not_run"]) == 2
    assert second["passed"] == 0 and second["pytest_exit"] is None
    assert (tmp_path / "out" / "unfinished.txt").read_text().split() == [
        *first["not_run"], "tests/test_later.py::test_c", "tests/test_later.py::test_d"]


def test_the_shards_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # each shard's pools get the cores over the shards running side by side, at least one; a caller's
    # OMP_NUM_THREADS is kept
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert gpu_shards.shard_threads(16, cpus=32) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert gpu_shards.shard_threads(40, cpus=32) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert gpu_shards.shard_threads(8, cpus=32) == {}
