"""Run the test suite in shards, several at a time, and write one summary per shard.

The whole suite on a GPU (real Triton kernels, each specialisation compiled on first use) takes longer
than one call of the device machine allows; its compilation is CPU-bound, so shards running side by side
on the machine's cores share the GPU well (each shard's CPU thread pools get the cores over the shards side by side:
:func:`shard_threads`). Usage, from the repository root::

    python3 tests/gpu_shards.py --shards 8 --jobs 8 --out "$OUT/shards"           # everything
    python3 tests/gpu_shards.py --shards 8 --only 0,1 --jobs 2 --out "$OUT/shards"  # two shards of eight
    python3 tests/gpu_shards.py --shards 8 --list                                   # which tests, where
    python3 tests/gpu_shards.py --shards 4 --jobs 4 --out "$OUT/again" -- @unfinished.txt  # node ids from a file
    python3 tests/gpu_shards.py --shards 64 --jobs 48 --gpus 4 --out "$OUT/shards"  # a machine of four GPUs
    python3 tests/gpu_shards.py --shards 40 --only $(seq -s, 0 19) --jobs 16 --durations benchmarks/results \
        --timeout 420 --deadline 540 --out "$OUT/shards"   # one H200 (16 cores): half the suite a call, ~220 s

The collected tests (``pytest --collect-only``, in pytest's order) are cut into ``--shards`` contiguous
pieces of about equal estimated time: the seconds each test took in earlier summaries given with
``--durations`` (files or folders of ``shard-*.json`` or ``gpu_suite*.json``), else one second a test. Each shard runs as its own
``pytest`` process and records every test's outcome as it finishes (``shard-K.jsonl``), so a shard
stopped by ``--timeout`` still says what ran; then ``shard-K.json`` (counts, failures with their
messages, skips with their reasons, each test's seconds, the tests that never ran) and ``shard-K.txt``,
and ``summary.txt`` for the shards of this run, ``unfinished.txt``: the node ids with no outcome (a shard stopped,
or never started before ``--deadline``, the run's own time limit: stop the run from inside, so that every summary is
written), which ``-- @unfinished.txt`` runs next time, and ``gpu_suite.json``: the whole run in one record
(:func:`merge`: the form of ``benchmarks/results``' ``gpu_suite*.json``, less the device, commit and note) — the one
file to bring back from a machine that returns few files. pytest runs with ``--rootdir`` at this file's repository,
so that a copy of the tree inside another project (an A/B tree) collects and runs node ids of its own. With
``--gpus N`` shard K sees only GPU K mod N (``CUDA_VISIBLE_DEVICES``), so the shards of a machine with several GPUs
spread over them; tests that need several GPUs then skip, and run in a call of their own. The exit status is 0 when
no test failed or went unrun in the shards run.

Passing ``-p gpu_shards`` to pytest (with ``tests`` on ``PYTHONPATH``) loads this file as the plugin
that writes the per-test lines to ``$GPU_SHARDS_LOG``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
LOG_VARIABLE = "GPU_SHARDS_LOG"


# -- the pytest plugin (loaded in each shard's process with -p gpu_shards) -----------------------------

def pytest_runtest_logreport(report: Any) -> None:
    """Append one line per test outcome: the call's, or the setup's when it failed or skipped."""
    path = os.environ.get(LOG_VARIABLE)
    if not path or not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")
                        or (report.when == "teardown" and report.outcome == "failed")):
        return
    if report.skipped:
        outcome = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    else:
        outcome = "failed" if report.failed else "passed"
        reason = report.longreprtext[-4000:] if report.failed else ""
    line = {"test": report.nodeid, "when": report.when, "outcome": outcome, "seconds": round(report.duration, 3),
            "reason": reason}
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(line) + "\n")


# -- the runner ---------------------------------------------------------------------------------------

def collect(extra: list[str]) -> list[str]:
    """The node ids pytest would run, in its order (``@FILE`` stands for the node ids listed in FILE, one a
    line: the tests an earlier run did not finish, say)."""
    extra = [line for arg in extra for line in (Path(arg[1:]).read_text().splitlines() if arg.startswith("@")
                                                 else [arg]) if line.strip()]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"--rootdir={ROOT}", *extra], cwd=ROOT, capture_output=True, text=True, check=False)
    tests = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not tests:
        raise SystemExit(f"pytest collected nothing:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return tests


def known_durations(paths: list[str]) -> dict[str, float]:
    """Seconds per test from earlier summaries: ``shard-*.json`` files, or the ``gpu_suite*.json`` files that
    gather a whole run's ``seconds`` table (``benchmarks/results``), given as files or as folders holding them;
    read in name order, a later file's time for a test replacing an earlier one's. A file without the table adds
    nothing."""
    found: dict[str, float] = {}
    for given in paths:
        path = Path(given)
        for summary in (sorted([*path.glob("shard-*.json"), *path.glob("gpu_suite*.json")]) if path.is_dir()
                        else [path]):
            found.update(json.loads(summary.read_text()).get("seconds", {}))
    return found


def split(tests: list[str], shards: int, durations: dict[str, float]) -> list[list[str]]:
    """``tests`` cut into ``shards`` contiguous pieces of about equal estimated seconds (a test without a
    recorded time counts as the median recorded time, one second when none is recorded)."""
    default = statistics.median(durations.values()) if durations else 1.0
    weights = [durations.get(test, default) for test in tests]
    total = sum(weights)
    pieces: list[list[str]] = [[] for _ in range(shards)]
    spent = 0.0
    for test, weight in zip(tests, weights):
        index = min(int(spent / total * shards), shards - 1) if total else 0
        pieces[index].append(test)
        spent += weight
    return pieces


def outcomes(log: Path) -> dict[str, dict[str, Any]]:
    """The last recorded outcome of each test in a shard's log."""
    found: dict[str, dict[str, Any]] = {}
    if log.exists():
        for line in log.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["test"] in found and found[record["test"]]["outcome"] == "failed":
                continue  # a failing teardown after a passing call: keep the failure
            found[record["test"]] = record
    return found


def summarize(index: int, tests: list[str], log: Path, seconds: float, returncode: Optional[int],
              out: Path) -> dict[str, Any]:
    """Write ``shard-K.json`` and ``shard-K.txt`` and return the summary."""
    results = outcomes(log)
    by = {kind: sorted(test for test, record in results.items() if record["outcome"] == kind)
          for kind in ("passed", "failed", "skipped")}
    summary: dict[str, Any] = {
        "shard": index, "tests": len(tests), "passed": len(by["passed"]), "failed": by["failed"],
        "skipped": {test: results[test]["reason"] for test in by["skipped"]},
        "not_run": [test for test in tests if test not in results],
        "wall_seconds": round(seconds, 1), "pytest_exit": returncode,
        "failures": {test: results[test]["reason"] for test in by["failed"]},
        "seconds": {test: record["seconds"] for test, record in results.items()},
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / f"shard-{index}.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"shard {index}: {len(tests)} tests, {summary['passed']} passed, {len(by['failed'])} failed, "
             f"{len(by['skipped'])} skipped, {len(summary['not_run'])} not run, {seconds:.0f} s "
             f"(pytest exit {returncode})"]
    lines += [f"  FAILED {test}" for test in by["failed"]]
    lines += [f"  NOT RUN {test}" for test in summary["not_run"]]
    (out / f"shard-{index}.txt").write_text("\n".join(lines) + "\n")
    return summary


def merge(summaries: list[dict[str, Any]], asked: list[str]) -> dict[str, Any]:
    """The shards' summaries as one record of the run, in the form of ``benchmarks/results``' ``gpu_suite*.json``
    (less the device, commit and note, which the caller knows): totals, failures with their messages, skips with their
    reasons, the tests without an outcome, each test's seconds."""
    seconds = {test: value for summary in summaries for test, value in summary["seconds"].items()}
    skipped = {test: reason for summary in summaries for test, reason in summary["skipped"].items()}
    failed = sorted(test for summary in summaries for test in summary["failed"])
    not_run = [test for summary in summaries for test in summary["not_run"]]
    return {
        "collected": asked or ["tests"], "shards": len(summaries),
        "totals": {"tests": sum(summary["tests"] for summary in summaries), "with_outcome": len(seconds),
                   "passed": sum(summary["passed"] for summary in summaries), "skipped": len(skipped),
                   "failed": len(failed), "not_run": len(not_run)},
        "failed": failed,
        "failures": {test: reason for summary in summaries for test, reason in summary["failures"].items()},
        "not_run": not_run, "skipped": skipped, "seconds": seconds,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def shard_threads(jobs: int, cpus: Optional[int] = None) -> dict[str, str]:
    """The thread count of each shard's CPU work (torch's intra-op pool, OpenMP, MKL): the machine's cores shared by
    the ``jobs`` shards running side by side, at least one — left to the caller where ``OMP_NUM_THREADS`` is set. Each
    pytest process would otherwise start a pool as wide as the machine, and thirty shards on 32 cores then spent their
    time switching (the 2026-11-30 run at 3e43db3: most shards stopped at their timeout compiling)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    threads = str(max(1, (cpus or os.cpu_count() or 1) // max(jobs, 1)))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, required=True, help="how many pieces the suite is cut into")
    parser.add_argument("--only", default="", help="comma-separated shard numbers to run (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="shards run side by side")
    parser.add_argument("--out", default="shards", help="folder for the summaries")
    parser.add_argument("--timeout", type=float, default=0, help="seconds before a shard is stopped (0: never)")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds for the whole run: then the running shards are stopped and the waiting ones "
                             "not started, every summary written (0: none)")
    parser.add_argument("--durations", action="append", default=[],
                        help="earlier summaries (files or folders) whose seconds balance the shards")
    parser.add_argument("--gpus", type=int, default=0,
                        help="spread the shards over this many GPUs, one visible to each shard (0: leave as is)")
    parser.add_argument("--list", action="store_true", help="print each shard's tests and stop")
    parser.add_argument("pytest_args", nargs="*", help="after --: what to collect (default: the tests folder)")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.jobs < 1 or args.gpus < 0:
        parser.error("--shards and --jobs must be at least 1, --gpus at least 0")
    chosen = sorted({int(part) for part in args.only.split(",") if part.strip()}) or list(range(args.shards))
    if any(not 0 <= index < args.shards for index in chosen):
        parser.error(f"--only takes shard numbers 0..{args.shards - 1}, got {args.only}")

    pieces = split(collect(args.pytest_args), args.shards, known_durations(args.durations))
    if args.list:
        for index, piece in enumerate(pieces):
            print(f"# shard {index}: {len(piece)} tests")
            print("\n".join(piece))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, LOG_VARIABLE: "", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]), **shard_threads(args.jobs)}
    waiting = list(chosen)
    running: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
    summaries: list[dict[str, Any]] = []
    begun = time.monotonic()
    while waiting or running:
        late = bool(args.deadline) and time.monotonic() - begun > args.deadline
        while late and waiting:  # never started: every test not run
            index = waiting.pop(0)
            (out / f"shard-{index}.jsonl").unlink(missing_ok=True)
            summaries.append(summarize(index, pieces[index], out / f"shard-{index}.jsonl", 0.0, None, out))
        while waiting and len(running) < args.jobs:
            index = waiting.pop(0)
            log = out / f"shard-{index}.jsonl"
            log.unlink(missing_ok=True)
            if not pieces[index]:  # (more shards than the estimate fills: pytest without node ids runs them all)
                summaries.append(summarize(index, [], log, 0.0, 0, out))
                continue
            visible = {"CUDA_VISIBLE_DEVICES": str(index % args.gpus)} if args.gpus else {}
            with open(out / f"shard-{index}.log", "wb") as output:
                process = subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_shards",
                     f"--rootdir={ROOT}", *pieces[index]], cwd=ROOT,
                    env={**env, **visible, LOG_VARIABLE: str(log.resolve())},
                    stdout=output, stderr=subprocess.STDOUT)
            running[index] = (process, time.monotonic())
        time.sleep(1)
        for index, (process, started) in list(running.items()):
            elapsed = time.monotonic() - started
            if process.poll() is None and (late or args.timeout and elapsed > args.timeout):
                process.kill()
                process.wait()
            if process.poll() is not None:
                del running[index]
                summary = summarize(index, pieces[index], out / f"shard-{index}.jsonl", elapsed,
                                    process.returncode, out)
                summaries.append(summary)
                print((out / f"shard-{index}.txt").read_text(), end="", flush=True)
    summaries.sort(key=lambda summary: summary["shard"])
    text = "".join((out / f"shard-{summary['shard']}.txt").read_text() for summary in summaries)
    (out / "summary.txt").write_text(text)
    # what has no outcome (stopped, never started), for the next run: -- @unfinished.txt
    (out / "unfinished.txt").write_text("".join(f"{test}\n" for summary in summaries for test in summary["not_run"]))
    (out / "gpu_suite.json").write_text(json.dumps(merge(summaries, args.pytest_args), indent=1) + "\n")
    return 0 if all(not summary["failed"] and not summary["not_run"] for summary in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
