"""The host's share of an eager expert-parallel step: dispatch + combine, called without a CUDA graph, GPU only, on
every GPU of one host.

    torchrun --nproc-per-node 2 benchmarks/bench_ep_host.py [--tokens 1,128] [--dispatcher symmetric] [--trace DIR]
        [--out F] [--commit C]

``--dispatcher``: ``symmetric`` (``SymmetricDispatch``, fixed capacity), ``compact`` (``SymmetricDispatch`` with
compact buffers, ``max_rows = 2 * T * k``, block-aligned for the triton GEMMs) or ``normal`` (``AllToAllDispatch``,
whose split sizes are read on the host); several, comma-separated. ``--trace DIR``: rank 0 also writes a Chrome trace
(``torch.profiler``, CPU and CUDA) of five steps per dispatcher and T, for reading where a step's time goes.

For each T (tokens per rank; DeepSeek-V3 shapes, bf16 rows, random routing as in ``bench_ep.py``), rank 0 reports
the step's wall time per call over 200 calls launched back to back (``launching``: the loop's time; ``with the GPU``:
until the GPU finished them), the loop's time per call while the GPU is held busy far ahead by a sleeping kernel
(``host only``: what the host spends launching when no launch waits on the device -- equal to ``launching`` unless
something in the step waits for the GPU), and the torch operators' host time per call (``torch.profiler``, CPU
activity, by operator). Prints a table and writes JSON (device, world size, commit, date, records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_ep  # noqa: E402
from provenance import measured_commit  # noqa: E402

from moeforge.distributed import AllToAllDispatch, ExpertParallel, SymmetricDispatch  # noqa: E402
from moeforge.kernels.config import ConfigTable  # noqa: E402

CALLS = 200


def _dispatcher(name: str, ep: ExpertParallel, tokens: int) -> Any:
    if name == "symmetric":
        return SymmetricDispatch(ep, max_tokens=tokens)
    if name == "compact":
        return SymmetricDispatch(ep, max_tokens=tokens, max_rows=2 * tokens * bench_ep.K,
                                 configs=ConfigTable(ep.local_experts, bench_ep.K))
    if name == "normal":
        return AllToAllDispatch(ep)
    raise SystemExit(f"--dispatcher: symmetric, compact or normal, got {name!r}")


def _measure(ep: ExpertParallel, tokens: int, name: str, trace: Optional[str]) -> dict[str, Any]:
    routed = bench_ep._routed(tokens, False, seed=1000 + ep.rank)
    dispatch = _dispatcher(name, ep, tokens)
    with torch.inference_mode():
        step = bench_ep._padded_step(dispatch, routed)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            step()
        launching = (time.perf_counter() - start) / CALLS * 1e6
        torch.cuda.synchronize()
        with_gpu = (time.perf_counter() - start) / CALLS * 1e6
        dist.barrier()
        torch.cuda._sleep(int(2e9))  # about a second of GPU work ahead of every launch below
        start = time.perf_counter()
        for _ in range(CALLS // 4):
            step()
        host_only = (time.perf_counter() - start) / (CALLS // 4) * 1e6
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(20):
                step()
        torch.cuda.synchronize()
        if trace is not None:
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as timeline:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            if ep.rank == 0:
                Path(trace).mkdir(parents=True, exist_ok=True)
                timeline.export_chrome_trace(str(Path(trace) / f"ep_host-{name}-T{tokens}.json"))
    operators = {event.key: (event.self_cpu_time_total / 20, event.count / 20) for event in profile.key_averages()}
    return dict(tokens=tokens, dispatcher=name, launching_us=launching, with_gpu_us=with_gpu, host_only_us=host_only,
                operators_us_and_calls_per_step=operators)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--dispatcher", default="symmetric", help="symmetric, compact or normal (comma-separated)")
    parser.add_argument("--trace", default=None, help="a folder for rank 0's Chrome traces")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    ep = ExpertParallel(bench_ep.E)
    records = [_measure(ep, int(tokens), name, args.trace) for name in args.dispatcher.split(",")
               for tokens in args.tokens.split(",")]
    if rank == 0:
        for record in records:
            print(f"{record['dispatcher']:9s} T={record['tokens']:5d}: launching {record['launching_us']:7.1f} us/step, with the GPU "
                  f"{record['with_gpu_us']:7.1f}, host only {record['host_only_us']:7.1f}")
            for name, (us, calls) in sorted(record["operators_us_and_calls_per_step"].items(),
                                            key=lambda item: -item[1][0])[:12]:
                print(f"    {us:7.1f} us  {calls:5.1f} calls  {name}")
        result = dict(device=torch.cuda.get_device_name(), world_size=world, commit=args.commit or measured_commit(),
                      date=datetime.date.today().isoformat(), records=records)
        out = Path(args.out or f"benchmarks/results/bench_ep_host-x{world}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
