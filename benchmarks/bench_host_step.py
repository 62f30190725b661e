"""The host's time of an eager training step of the experts, on the CPU, with every Triton launch stubbed out.

    TRITON_INTERPRET=1 python benchmarks/bench_host_step.py [--experts 128] [--top-k 8] [--tokens 256] [--steps 200]
                                                           [--slot-rows rule|on|off] [--profile N]

A step called without a CUDA graph is bound by the host at small batches (``bench_train.py --eager``: the Qwen3
step at M = 1024 on an H200 takes 1.9x its replay). This harness measures the Python side of that cost where no GPU
is: the triton backend's training step (``bench_train.py``'s: the experts' forward from leaves requiring
gradients, then ``torch.autograd.grad`` of the hidden states, the routing weights and both weights) on CPU tensors
of toy widths, with every kernel launch of moeforge's a no-op (``BoundLaunch.__call__``: the bound launches and the
launch sites' first calls alike; the Gluon kernels do not run on the CPU). What it times is the pipeline's and the
backward's Python, the custom ops' and autograd's dispatch and the torch allocations; not the driver's launches, nor
the GPU-only paths (TMA descriptors, the Gluon weight gradient, which the CPU's tiles never take). Prints the median
microseconds of the forward and of the step over ``--steps`` steps; ``--slot-rows`` whether the dispatch gives its
rows in slot order (``rule``: where :func:`~moeforge.stages.slot_order.slot_rows_pay` takes it); ``--profile N``
prints a ``cProfile`` listing of N steps. The outputs are uninitialised memory: nothing is checked, only timed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moeforge as mf  # noqa: E402
from moeforge.kernels import bound_launch  # noqa: E402
from moeforge.kernels.config import ConfigTable  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    """Inside, every moeforge kernel launch (through :class:`~moeforge.kernels.bound_launch.BoundLaunch`) does
    nothing; the launcher is restored on the way out."""
    launch = bound_launch.BoundLaunch.__call__
    bound_launch.BoundLaunch.__call__ = lambda self, *args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        bound_launch.BoundLaunch.__call__ = launch  # type: ignore[method-assign]


def training_step(experts: int, top_k: int, tokens: int, hidden: int, inter: int,
                  slot_rows: Optional[bool] = None) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(forward, step)`` of a bf16 triton layer's experts on CPU tensors (the routing given; ``slot_rows``: the
    dispatch's, see :class:`~moeforge.stages.triton.AlignDispatch`)."""
    # (the stages a triton MoELayer builds after its routing; a layer refuses the triton backend on the CPU)
    table = ConfigTable(experts, top_k)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=True)
    full = mf.Pipeline([
        TritonTopK(experts, top_k, mf.RoutingConfig()), AlignDispatch(experts, table, slot_rows),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
        FusedGroupedGemm(mf.GemmRole.DOWN, w2, table),
        Combine(apply_routing_weights=True),
    ], mf.input_spec(hidden, torch.bfloat16, experts))
    experts_only = mf.Pipeline(full.stages[1:], full.specs[0])
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k)
    grad = torch.randn(tokens, hidden, dtype=torch.bfloat16)

    def forward() -> Any:
        xr = x.detach().requires_grad_()
        w = weights.detach().requires_grad_()
        out = experts_only(RoutedTokens(Activations(xr), TopKOutput(w, ids))).hidden_states
        return out, [xr, w, w13, w2]

    def step() -> Any:
        out, leaves = forward()
        return torch.autograd.grad(out, leaves, grad)

    return forward, step


def median_us(fn: Callable[[], Any], steps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slot-rows", choices=("rule", "on", "off"), default="rule")
    parser.add_argument("--profile", type=int, default=0, help="print a cProfile listing of this many steps")
    args = parser.parse_args()
    slot_rows = {"rule": None, "on": True, "off": False}[args.slot_rows]
    forward, step = training_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter, slot_rows)
    with launches_stubbed():
        print(f"E={args.experts} k={args.top_k} M={args.tokens} (H={args.hidden}, I={args.inter}), slot rows "
              f"{args.slot_rows}, launches "
              f"stubbed: forward {median_us(forward, args.steps):.0f} us, step {median_us(step, args.steps):.0f} us "
              f"(medians of {args.steps}; torch {torch.__version__}, {torch.get_num_threads()} threads)")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.profile):
                step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(50)


if __name__ == "__main__":
    main()
