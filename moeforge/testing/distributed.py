"""Run a function on several local processes joined by a gloo (or NCCL) process group, with a deadline.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` in each (a fresh file store, the given collective timeout), calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. It never waits
forever: when a rank raises, the others are terminated (they may be blocked in a collective that
rank will never join) and :class:`RankFailed` carries the tracebacks of the ranks that failed; when the deadline
passes, every rank is terminated and :class:`RanksTimedOut` names those that did not finish.

``fn`` must be importable by the child processes (a module-level function) and return picklable
values (CPU tensors are fine).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """Ranks raised: ``failures`` maps each to its formatted traceback. When one rank fails, the others
    often fail in the collective it left (a closed connection): all are reported."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"rank {rank} failed:\n{trace}" for rank, trace in sorted(failures.items()))
        super().__init__(text)


class RanksTimedOut(TimeoutError):
    """Some ranks did not finish before the deadline (``ranks``); all were terminated."""

    def __init__(self, ranks: list[int], seconds: float) -> None:
        self.ranks = ranks
        super().__init__(f"ranks {ranks} did not finish within {seconds:g} s (terminated)")


def _child(rank: int, world_size: int, init_file: str, backend: str, collective_timeout: float,
           fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()  # by value: a shared-memory tensor would die with this process
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including a rank's own timeout
        results.put((rank, False, traceback.format_exc()))


def _more_failures(results: Any, failures: dict[int, str], grace: float = 2.0) -> dict[int, str]:
    """The failures that arrive within ``grace`` seconds of the first one."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if not ok:
            failures[rank] = value
    return failures


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, collective_timeout: float = 60.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own
    process (see the module docstring). ``timeout``: the whole run's deadline in seconds;
    ``collective_timeout``: the process group's timeout for one collective."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [context.Process(target=_child, args=(rank, world_size, init_file, backend, collective_timeout,
                                                          fn, args, results), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        try:
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RanksTimedOut(sorted(set(range(world_size)) - set(values)), timeout)
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = {r: f"process exited with code {p.exitcode}" for r, p in enumerate(processes)
                            if p.exitcode not in (None, 0) and r not in values}
                    if dead:
                        raise RankFailed(dead) from None
                    continue
                if not ok:
                    raise RankFailed(_more_failures(results, {rank: value}))
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for process in processes:
                if process.is_alive() and len(values) < world_size:
                    process.terminate()
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    return [values[rank] for rank in range(world_size)]
