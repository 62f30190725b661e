"""The commit a benchmark's results file records (``benchmarks/provenance.py``): HEAD's, marked when the tracked
files differ from it, so that a run of uncommitted code does not pass for a run of its commit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from provenance import CHANGED, measured_commit  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_commit_then_marked_for_tracked_changes_only(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    _git(tmp_path, "add", "kernel.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert measured_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked\n")  # untracked files do not count
    assert measured_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("x = 2\n")  # an edit not committed
    assert measured_commit(tmp_path) == head + CHANGED
    _git(tmp_path, "add", "kernel.py")  # staged but not committed: still not the commit
    assert measured_commit(tmp_path) == head + CHANGED
    _git(tmp_path, "commit", "-q", "-m", "second")
    assert measured_commit(tmp_path) == _git(tmp_path, "rev-parse", "--short", "HEAD")


def test_unknown_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no further up for a checkout
    (tmp_path / "plain").mkdir()
    assert measured_commit(tmp_path / "plain") == "unknown"
