"""Run a function on several local processes joined by a gloo (or NCCL) process group, with a deadline.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` in each (a fresh file store, the given collective timeout), calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. It never waits
forever: when a rank raises, the others are terminated (they may be blocked in a collective that
rank will never join) and :class:`RankFailed` carries the tracebacks of the ranks that failed; when a
deadline passes, every rank is terminated and :class:`RanksTimedOut` names those that did not finish.

There are two deadlines: ``startup_timeout`` for every rank to start and join the process group
(spawning a process and importing torch takes seconds, many more on a loaded machine), then ``timeout``
for ``fn``, counted from the moment the last rank joined. So ``timeout`` bounds the work under test, not
how busy the machine was while the processes started.

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


# what a rank reports on the results queue
_JOINED, _DONE, _FAILED = "joined", "done", "failed"


def _child(rank: int, world_size: int, init_file: str, backend: str, collective_timeout: float,
           fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        # Joined when every rank is out of init_process_group: a rank whose fn returns at once and tears its group
        # down could otherwise close a connection that a slower rank is still setting up (gloo: "connectFullMesh
        # failed ... Connection closed by peer", seen on a loaded machine). A store's keys, not a collective: an
        # NCCL barrier would need the rank's device, which fn chooses.
        joined = dist.FileStore(f"{init_file}.joined", world_size)  # type: ignore[attr-defined]  # (not in its __all__)
        joined.set(f"rank {rank}", "joined")
        joined.wait([f"rank {other}" for other in range(world_size)])
        results.put((rank, _JOINED, b""))
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # by value: a shared-memory tensor would die with this process
        torch.save(value, buffer)
    except BaseException:  # report everything, including a rank's own timeout
        # Reported before any teardown: after a device error an NCCL group may never finish destroying itself,
        # and the parent ends this process once it has the failure.
        results.put((rank, _FAILED, traceback.format_exc()))
        return
    dist.destroy_process_group()
    results.put((rank, _DONE, buffer.getvalue()))


def _more_failures(results: Any, failures: dict[int, str], grace: float = 2.0) -> dict[int, str]:
    """The failures that arrive within ``grace`` seconds of the first one."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if status == _FAILED:
            failures[rank] = value
    return failures


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, collective_timeout: float = 60.0, startup_timeout: float = 600.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own
    process (see the module docstring). ``timeout``: seconds ``fn`` may take on every rank, counted from
    when the last rank joined the process group; ``startup_timeout``: seconds for every rank to start and
    join it; ``collective_timeout``: the process group's timeout for one collective."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [context.Process(target=_child, args=(rank, world_size, init_file, backend, collective_timeout,
                                                          fn, args, results), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        joined: set[int] = set()
        deadline, limit = time.monotonic() + startup_timeout, startup_timeout
        values: dict[int, Any] = {}

        def receive(wait: float) -> None:
            nonlocal deadline, limit
            rank, status, value = results.get(timeout=wait)
            if status == _FAILED:
                raise RankFailed(_more_failures(results, {rank: value}))
            if status == _JOINED:
                joined.add(rank)
                if len(joined) == world_size:
                    deadline, limit = time.monotonic() + timeout, timeout
            else:
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)

        try:
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    try:  # what already arrived counts: name only the ranks that did not finish
                        while len(values) < world_size:
                            receive(0.01)
                    except queue.Empty:
                        pass
                    if len(values) == world_size:
                        break
                    raise RanksTimedOut(sorted(set(range(world_size)) - set(values)), limit)
                try:
                    receive(min(remaining, 1.0))
                except queue.Empty:
                    dead = {r: f"process exited with code {p.exitcode}" for r, p in enumerate(processes)
                            if p.exitcode not in (None, 0) and r not in values}
                    if dead:
                        raise RankFailed(dead) from None
        finally:
            for process in processes:
                if process.is_alive() and len(values) < world_size:
                    process.terminate()
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    return [values[rank] for rank in range(world_size)]
