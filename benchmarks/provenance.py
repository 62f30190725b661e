"""Which code a benchmark measured: the commit, marked when the checkout's tracked files differ from it.

The results files carry this in their ``commit`` field (``bench_moe.py``, ``bench_train.py``, ``bench_ep.py``,
``bench_hf_experts.py``, ``bench_weight_grad.py``), so that a run of uncommitted code on the GPU machine, a copy of the
working tree, does not pass for a run of the commit it started from. :func:`write_results` writes such a file.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any, Optional

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


def write_results(bench: str, device: str, records: list[dict[str, Any]], out: Optional[str] = None,
                  commit: Optional[str] = None, **fields: Any) -> Path:
    """Write a benchmark's results as JSON — ``device``, ``commit`` (:func:`measured_commit` unless given), today's
    ``date``, torch's version, ``fields``, ``records`` — to ``out`` or ``benchmarks/results/<bench>-<device>-<date>
    .json``, and say where."""
    import torch

    from moeforge.kernels.config import device_key

    date = datetime.date.today().isoformat()
    result = dict(device=device, commit=commit or measured_commit(), date=date, torch=torch.__version__, **fields,
                  records=records)
    path = Path(out) if out else ROOT / "benchmarks" / "results" / f"{bench}-{device_key(device)}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path
