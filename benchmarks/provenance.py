"""Which code a benchmark measured: the commit, marked when the checkout's tracked files differ from it.

The results files carry this in their ``commit`` field (``bench_moe.py``, ``bench_train.py``, ``bench_ep.py``,
``bench_hf_experts.py``), so that a run of uncommitted code on the GPU machine, a copy of the working tree, does not
pass for a run of the commit it started from.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANGED = "+changes"  # appended to the commit of a checkout whose tracked files differ from it


def measured_commit(repo: Path = ROOT) -> str:
    """``git rev-parse --short HEAD`` of ``repo``, with :data:`CHANGED` appended when its tracked files differ from
    that commit (untracked files do not count); ``"unknown"`` outside a git checkout or without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=repo, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + (CHANGED if diff.returncode == 1 else "")
