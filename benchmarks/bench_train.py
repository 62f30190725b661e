"""Benchmark forward + backward of the expert computation on the triton path against the same
computation written with ``torch._grouped_mm`` and autograd (the path torchtitan and transformers train
with), CUDA only.

    python benchmarks/bench_train.py [--shapes mixtral,qwen3,gptoss,deepseek] [--tokens 1024,4096,16384]

(``--shapes`` also takes ``llama4``: Llama-4 Scout's experts, E 16, k 1, H 5120, I 8192, routing weights on the input.)

For each shape and token count M, on random (never zero) bf16 data with the routing fixed: the time of
``forward + backward`` (gradients of the hidden states, both expert weights and the routing weights),
as the median of CUDA-graph replays with the L2 flushed, for moeforge's experts pipeline (from top-k ids
and weights to the combined output) and for the ``torch._grouped_mm`` baseline, their replays taken in turns
(so that both see the same clocks: :func:`bench_moe.time_graphs_interleaved`);
the speedup; and the
TFLOP/s of the step counting 3x the forward's flops (forward, row gradient, weight gradient) against
the bf16 matmul peak measured in the same run (single 8192³ products at the run's start, and the same products back to
back for about 65 ms, the length of a large step, which a power-limited card runs at a lower clock:
``bench_moe.measure_sustained_peak``); the step's peak memory above what was allocated before it
(``torch.cuda.max_memory_allocated``, the second of two eager steps: a training loop's steady state; the first's
is recorded too); whether two eager steps give bitwise the same gradients.
Prints a table and writes JSON (device, commit, date).

``--slot-rows on|off|both`` forces the block-aligned dispatch's layout of the rows (slot order, copy order, or both as
two moeforge steps, ``moeforge_slot_order`` and ``moeforge_copy_order``, timed in turns beside torch) where the
default, ``rule``, leaves it to :func:`moeforge.stages.slot_order.slot_rows_pay`.
``--expert-bias`` builds the layers with expert biases (as GPT-OSS's are): both paths add them and differentiate them.
``--staged`` adds each moeforge step with its stages called one by one (``moeforge_staged``: an autograd node a
stage, as the pipeline ran before its joined run, :mod:`moeforge.stages.triton_step`), timed beside the others.
``--eager`` also times each step called eagerly (no CUDA graph; the host launches every kernel) and its ratio to
the replay; ``--host-profile DIR`` writes a ``cProfile`` listing of a few eager moeforge steps per cell there.
``--profile`` also prints, per cell and per path, where the step's GPU time goes: each kernel's time per step
(``torch.profiler`` over a few eager steps after warm-up, one row per launch in the step's order) — what a backward change should
move. ``--memory-breakdown`` lists, per cell and per path, the blocks live at the step's peak memory by the line
that allocated them (the allocator's recorded history, :func:`live_at_peak`) — what a memory change should move.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import (FLUSH_BYTES, flush_l2, measure_peak, measure_sustained_peak, shape_of, time_graph,  # noqa: E402
                       time_graphs_interleaved)
from provenance import write_results  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages.triton import AlignDispatch  # noqa: E402


def moeforge_forward(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput, slot_rows: Optional[bool] = None,
                     joined: bool = True) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    """The experts' forward from fresh leaves (the hidden states and the routing weights, both requiring
    gradients, so the layer takes its training path): ``(output, [x, weights, w13, w2])``, and both expert biases
    after them where the layer has them. ``slot_rows``: the block-aligned dispatch's
    (:class:`~moeforge.stages.triton.AlignDispatch`; ``None``, the layer's: its rule). ``joined=False``: the stages
    called one by one (an autograd node each) instead of the pipeline's joined run
    (:mod:`moeforge.stages.triton_step`)."""
    stages = list(layer.pipeline.stages[1:])
    if slot_rows is not None:
        stages = [attrs.evolve(stage, slot_rows=slot_rows) if isinstance(stage, AlignDispatch) else stage
                  for stage in stages]
    experts_only = mf.Pipeline(stages, layer.pipeline.specs[0])
    biases = expert_biases(layer)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        xr = x.detach().requires_grad_()
        weights = topk.weights.detach().requires_grad_()
        payload: Any = RoutedTokens(Activations(xr), TopKOutput(weights, topk.ids))
        if joined:
            payload = experts_only(payload)
        else:
            for stage in experts_only.stages:
                payload = stage(payload)
        return payload.hidden_states, [xr, weights, layer.w13_weight, layer.w2_weight, *biases]

    return run


def expert_biases(layer: mf.MoELayer) -> list[torch.Tensor]:
    """The layer's two expert biases (``[E, 2I]``, ``[E, H]``), where it has them (``expert_bias=True``)."""
    return [p for name, p in layer.named_parameters() if name in ("w13_bias", "w2_bias")]


def grouped_mm_forward(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput
                       ) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    """The same forward written with ``torch._grouped_mm`` (what torchtitan and transformers train with); a layer's
    expert biases added to each sorted row by its expert (an index of the bias rows), as such code adds them; a
    layer's routing weights on the input (Llama-4's) scale each copy's row before the experts, as the model's code
    does."""
    tokens, top_k = topk.ids.shape
    w13, w2 = layer.w13_weight, layer.w2_weight
    biases = expert_biases(layer)
    ones = torch.ones(tokens * top_k, dtype=torch.int32, device=x.device)
    on_input = layer.routing.apply_weights is mf.RoutingWeights.ON_INPUT

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        xr = x.detach().requires_grad_()
        weights = topk.weights.detach().requires_grad_()
        flat = topk.ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(layer.num_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        source = order // top_k
        rows_in = xr[source]
        if on_input:  # (Llama-4: each copy's row scaled by its weight before the experts, the rows summed unweighted)
            rows_in = (rows_in.float() * weights.reshape(-1)[order, None]).to(rows_in.dtype)
        hidden = torch._grouped_mm(rows_in, w13.transpose(1, 2), offs=offs)
        if biases:
            hidden = hidden + biases[0][flat[order]]
        gate, up = hidden.chunk(2, dim=-1)
        rows = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
        if biases:
            rows = rows + biases[1][flat[order]]
        if not on_input:
            rows = rows * weights.reshape(-1)[order, None].to(rows.dtype)
        return torch.zeros_like(xr).index_add(0, source, rows), [xr, weights, w13, w2, *biases]

    return run


def training_step(forward: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]], grad: torch.Tensor
                  ) -> Callable[[], Any]:
    """Forward and backward: the gradients of the hidden states, the routing weights and both expert weights."""

    def run() -> Any:
        out, leaves = forward()
        return torch.autograd.grad(out, leaves, grad)

    return run


def moeforge_step(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput, grad: torch.Tensor,
                  slot_rows: Optional[bool] = None, joined: bool = True) -> Callable[[], Any]:
    return training_step(moeforge_forward(layer, x, topk, slot_rows, joined), grad)


# --slot-rows: the moeforge steps a cell times, by record name, each with its dispatch's slot_rows
LAYOUTS: dict[str, tuple[tuple[str, Optional[bool]], ...]] = {
    "rule": (("moeforge", None),), "on": (("moeforge_slot_order", True),), "off": (("moeforge_copy_order", False),),
    "both": (("moeforge_copy_order", False), ("moeforge_slot_order", True)),
}


def grouped_mm_step(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput, grad: torch.Tensor) -> Callable[[], Any]:
    return training_step(grouped_mm_forward(layer, x, topk), grad)


# the shapes whose routing weights scale the experts' input (Llama-4's: the dispatch scales each copy's row, the
# combine sums them unweighted)
WEIGHTS_ON_INPUT = frozenset({"llama4"})

SONICMOE = (64, 4, 4096, 2048)  # (E, k, H, I) at T = 32768: SonicMoE's published configuration
SONICMOE_TOKENS = 32768


def dense_mm(rows: int, hidden: int, inter: int) -> Callable[[], Any]:
    """One dense ``torch.mm`` with a forward's flops (``[rows, H] @ [H, 3I]``, cuBLAS, random bf16): its time is
    the bound the SonicMoE target compares a forward with (twice it, a backward)."""
    a = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(hidden, 3 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, 3 * inter, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=out)


def sonicmoe_cell(flush: torch.Tensor, reps: int, profile: bool = False) -> list[dict[str, Any]]:
    """SonicMoE's configuration: each path's forward (its graph replay) and backward (the step's replay less the
    forward's) against the dense bound of the same flops (:func:`dense_mm`; the backward's flops are twice the
    forward's), all timed in turns; with ``profile``, each path's kernels per step too (:func:`kernel_times`)."""
    experts, top_k, hidden, inter = SONICMOE
    tokens = SONICMOE_TOKENS
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    topk = mf.stages.select_experts(torch.randn(tokens, experts, device="cuda"), top_k, layer.routing)
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    flops = 2 * tokens * top_k * 3 * hidden * inter
    fns: dict[str, Callable[[], Any]] = {"dense": dense_mm(tokens * top_k, hidden, inter)}
    for what, forward in (("moeforge", moeforge_forward(layer, x, topk)),
                          ("torch_grouped_mm", grouped_mm_forward(layer, x, topk))):
        fns[f"{what} step"] = training_step(forward, grad)
        fns[f"{what} forward"] = forward
    times, how = time_steps(fns, reps, flush)
    bound = times["dense"]
    records: list[dict[str, Any]] = []
    if profile:
        for what in ("moeforge", "torch_grouped_mm"):
            profiled = kernel_times(fns[f"{what} step"])
            print_kernel_times(f"sonicmoe M={tokens} {what}", profiled)
            records.append(dict(shape="sonicmoe", M=tokens, what=f"{what}_kernels",
                                kernels=[dict(name=n, us=round(u, 1), launches=c) for n, u, c in profiled]))
    for what in ("moeforge", "torch_grouped_mm"):
        step_us, forward_us = times[f"{what} step"], times[f"{what} forward"]
        backward_us = step_us - forward_us
        record = dict(shape="sonicmoe", E=experts, k=top_k, H=hidden, I=inter, M=tokens, what=f"{what}_sonicmoe",
                      forward_us=round(forward_us, 1), backward_us=round(backward_us, 1), step_us=round(step_us, 1),
                      dense_forward_bound_us=round(bound, 1), dense_backward_bound_us=round(2 * bound, 1),
                      forward_pct_of_bound=round(100 * bound / forward_us, 1),
                      backward_pct_of_bound=round(100 * 2 * bound / backward_us, 1),
                      forward_tflops=round(flops / forward_us / 1e6, 1),
                      backward_tflops=round(2 * flops / backward_us / 1e6, 1), timed=how)
        records.append(record)
        print(f"sonicmoe  M={tokens:6d} {what:17s} forward {forward_us:9.1f} us ({record['forward_pct_of_bound']:5.1f}%"
              f" of the dense bound {bound:.1f}), backward {backward_us:9.1f} us "
              f"({record['backward_pct_of_bound']:5.1f}% of {2 * bound:.1f})", flush=True)
    del layer, fns
    torch.cuda.empty_cache()
    return records


def time_steps(steps: dict[str, Callable[[], Any]], reps: int,
               flush: torch.Tensor) -> tuple[dict[str, float], str]:
    """Each step's median replay in microseconds, and how they were timed: in turns (the fair comparison: both see
    the same clocks), or — where both steps' graphs do not fit in memory together — one after the other."""
    try:
        return time_graphs_interleaved(steps, reps, flush), "in turns"
    except torch.OutOfMemoryError:
        pass
    # (out of the handler: its traceback held the frames, and so the graphs, whose memory must go first)
    gc.collect()
    torch.cuda.empty_cache()
    return {what: time_graph(step, reps, flush) for what, step in steps.items()}, "one after the other"


def _peak_of(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes one call of ``fn`` allocates above what was allocated before it, at its peak; its result)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


def step_peaks(fn: Callable[[], Any]) -> tuple[int, int, bool]:
    """(bytes the first call of a step allocates above what was allocated before it, at its peak; the same for a
    second call; whether the two give bitwise the same gradients). The first call's figure holds whatever only a
    first call allocates and keeps (torch's ``_grouped_mm`` + autograd step peaks higher on its first call in a
    process: docs/notes/kernels-log.md, "A training step's memory: first and later steps"), and so depends on what
    ran before in the process; the second's is a training loop's steady state."""
    first_peak, grads = _peak_of(fn)
    first = [g.clone() for g in grads]
    del grads
    later_peak, second = _peak_of(fn)
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    del first, second
    return first_peak, later_peak, same


def step_memory_and_determinism(fn: Callable[[], Any]) -> tuple[int, bool]:
    """(the steady-state peak of :func:`step_peaks`: bytes a second call of the step allocates above what was
    allocated before it; whether two calls give bitwise the same gradients)."""
    _, later_peak, same = step_peaks(fn)
    return later_peak, same


def leftover_after_steps(fn: Callable[[], Any], steps: int = 2) -> int:
    """Bytes still allocated after ``steps`` more steps whose gradients were dropped, above what was allocated after
    the first such step: 0 unless each step keeps something reachable (a leak). Python's cycle collector runs before
    each count: unreachable blocks whose cycle it had not yet collected (earlier work's in a test process) were freed
    or not at its whim, and moved the count by gigabytes either way (:func:`storages_in_cycles` looks for the
    step's own)."""
    fn()  # (each step's gradients dropped as it returns)
    gc.collect()
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()
    for _ in range(steps):
        fn()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - after_one


def storages_in_cycles(fn: Callable[[], Any]) -> list[int]:
    """The bytes of each tensor or storage that a step leaves in reference cycles (unreachable, freed only when Python's
    cycle collector runs: in a training loop, memory held for an unknown number of steps): none in a sound step."""
    fn()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        found = [o.nbytes() if isinstance(o, torch.UntypedStorage) else o.untyped_storage().nbytes()
                 for o in gc.garbage if isinstance(o, (torch.UntypedStorage, torch.Tensor))]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        if enabled:
            gc.enable()
    return found


def live_at_peak(events: list[dict[str, Any]], top: int = 12) -> tuple[int, list[tuple[str, int, int]]]:
    """From one device's allocation trace (``torch.cuda.memory._snapshot()["device_traces"][d]``: ``alloc`` and
    ``free_requested`` events with ``addr``, ``size`` and Python ``frames``): the peak of the bytes allocated over
    the trace, and the blocks live at that moment grouped by where they were allocated — the innermost frame in
    moeforge, else in this script, else the innermost Python frame — as ``(place, bytes, blocks)``, largest first
    (``top`` of them). Blocks allocated before the trace started are not counted (the step's own peak)."""
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    places: dict[str, list[int]] = {}
    for event in at_peak.values():
        entry = places.setdefault(_allocation_place(event.get("frames", [])), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(((place, size, count) for place, (size, count) in places.items()), key=lambda item: -item[1])
    return peak, ranked[:top]


def _allocation_place(frames: list[dict[str, Any]]) -> str:
    for wanted in ("moeforge/", "bench_train.py", ""):
        for frame in frames:
            if wanted in frame.get("filename", ""):
                return f"{Path(frame['filename']).name}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "(no Python frame)"


def memory_breakdown(fn: Callable[[], Any]) -> tuple[int, list[tuple[str, int, int]]]:
    """:func:`live_at_peak` of one eager call of ``fn`` (the allocator's history recorded with Python stacks)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    return live_at_peak(snapshot["device_traces"][device])


def time_eager(fn: Callable[[], Any], reps: int, flush: torch.Tensor) -> float:
    """Median microseconds of one eager step (no CUDA graph: the host launches every kernel), L2 flushed and the
    device idle before each, timed on the host up to the step's last kernel."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush_l2(flush)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def write_host_profile(fn: Callable[[], Any], path: Path, steps: int = 5) -> None:
    """``cProfile`` of ``steps`` eager steps (after three), by own and by cumulative time, with the wall time per
    step: where a step's host time goes when it is called without a CUDA graph."""
    import cProfile
    import io
    import pstats

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    text.write(f"{steps} eager steps, {(time.perf_counter() - started) / steps * 1e6:.0f} us each under the profiler\n")
    stats = pstats.Stats(profiler, stream=text)
    text.write("\n== by own time ==\n")
    stats.sort_stats("tottime").print_stats(45)
    text.write("\n== by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    print(f"wrote {path}")


def kernel_times(fn: Callable[[], Any], steps: int = 3) -> list[tuple[str, float, int]]:
    """``(kernel name, µs per step, launches per step)`` of ``fn``'s GPU kernels in launch order: a kernel launched
    several times a step (the four GEMMs of a training step) is one row per launch, named ``#1``, ``#2``, … in the
    order the step launches them."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = sorted((event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda event: event.time_range.start)
    launches = collections.Counter(event.name for event in events)
    seen: collections.Counter[str] = collections.Counter()
    totals: dict[str, list[float]] = {}
    for event in events:
        per_step = max(1, launches[event.name] // steps)
        ordinal = seen[event.name] % per_step
        seen[event.name] += 1
        label = event.name[:90] + (f" #{ordinal + 1}" if per_step > 1 else "")
        entry = totals.setdefault(label, [0.0, 0])
        entry[0] += event.device_time
        entry[1] += 1
    return [(name, us / steps, int(n) // steps) for name, (us, n) in totals.items()]


def print_kernel_times(label: str, rows: list[tuple[str, float, int]]) -> None:
    total = sum(us for _, us, _ in rows)
    print(f"  {label}: {total:.0f} us of kernels per step (in launch order)")
    for name, us, launches in rows:
        if us >= 0.01 * total:
            print(f"    {us:9.1f} us {100 * us / total:5.1f}% x{launches:<3d} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3,gptoss,deepseek",
                        help="comma-separated: names of bench_moe.SHAPES (llama4: its routing weights on the input), "
                             "or a shape written out as ExkxHxI (64x8x2048x1024)")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--profile", action="store_true", help="print each kernel's time per step too")
    parser.add_argument("--eager", action="store_true",
                        help="time each step called eagerly too (the host's launches included) beside its replay")
    parser.add_argument("--staged", action="store_true",
                        help="also time each moeforge step with its stages called one by one (``NAME_staged``), "
                             "as the pipeline ran them before its joined run")
    parser.add_argument("--memory-breakdown", action="store_true",
                        help="list, for each step, the blocks live at its peak memory by where they were allocated")
    parser.add_argument("--sonicmoe", action="store_true",
                        help="also SonicMoE's configuration (T 32768, H 4096, I 2048, E 64, k 4): forward and backward "
                             "each against a dense torch.mm of the same flops")
    parser.add_argument("--slot-rows", choices=sorted(LAYOUTS), default="rule",
                        help="the block-aligned dispatch's layout of a training step's rows: the layer's rule, slot "
                             "order (on) or copy order (off) forced, or both forced, timed in turns beside torch")
    parser.add_argument("--host-profile", default=None,
                        help="a folder for cProfile listings of a few eager moeforge steps per cell (the host's time)")
    parser.add_argument("--expert-bias", action="store_true",
                        help="layers with expert biases (GPT-OSS has them): both paths add them and differentiate "
                             "them too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA device")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    peak, read_bw = measure_peak()
    sustained = measure_sustained_peak()
    device = torch.cuda.get_device_name()
    print(f"{device}: bf16 matmul {peak:.0f} TFLOP/s ({sustained:.0f} sustained over ~65 ms), "
          f"HBM read {read_bw:.2f} TB/s")
    records = []
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = shape_of(name)
        routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT) if name in WEIGHTS_ON_INPUT \
            else mf.RoutingConfig()
        layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton",
                            expert_bias=args.expert_bias, routing=routing)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(tokens, experts, device="cuda")
            topk = mf.stages.select_experts(logits, top_k, layer.routing)
            grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            flops = 3 * 2 * tokens * top_k * 3 * hidden * inter
            steps: dict[str, Callable[[], Any]] = {}
            timed_records: dict[str, dict[str, Any]] = {}
            eager_us: dict[str, float] = {}
            makers: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
                (what, functools.partial(moeforge_step, layer, x, topk, grad, slot))
                for what, slot in LAYOUTS[args.slot_rows]]
            if args.staged:
                makers += [(f"{what}_staged", functools.partial(moeforge_step, layer, x, topk, grad, slot, False))
                           for what, slot in LAYOUTS[args.slot_rows]]
            makers.append(("torch_grouped_mm", functools.partial(grouped_mm_step, layer, x, topk, grad)))
            for what, make in makers:
                try:
                    gc.collect()  # (the last cell's steps and graphs, freed before this one's memory is read)
                    torch.cuda.empty_cache()
                    step = make()
                    first_memory, memory, same = step_peaks(step)
                    if args.eager:
                        eager_us[what] = time_eager(step, args.reps, flush)
                    if args.memory_breakdown:
                        traced_peak, places = memory_breakdown(step)
                        print(f"{name:9s} M={tokens:6d} {what}: {traced_peak / 2**20:.0f} MiB at the traced peak:")
                        for place, size, count in places:
                            print(f"    {size / 2**20:9.1f} MiB in {count:3d} blocks  {place}")
                        records.append(dict(shape=name, M=tokens, what=f"{what}_memory", peak_mib=round(
                            traced_peak / 2**20, 1), live=[dict(place=p, mib=round(b / 2**20, 1), blocks=c)
                                                           for p, b, c in places]))
                    if args.host_profile and what.startswith("moeforge"):
                        write_host_profile(step, Path(args.host_profile) / f"train_host_{name}_M{tokens}.txt")
                    if args.profile:
                        profiled = kernel_times(step)
                        print_kernel_times(f"{name} M={tokens} {what}", profiled)
                        records.append(dict(shape=name, M=tokens, what=f"{what}_kernels",
                                            kernels=[dict(name=n, us=round(u, 1), launches=c) for n, u, c in profiled]))
                except Exception as error:  # e.g. out of memory at the largest shapes
                    print(f"{name:9s} M={tokens:6d} {what}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                steps[what] = step
                timed_records[what] = dict(shape=name, E=experts, k=top_k, H=hidden, I=inter, M=tokens, what=what,
                                           expert_bias=args.expert_bias, peak_mib=round(memory / 2**20),
                                           first_call_peak_mib=round(first_memory / 2**20), deterministic=same)
            timed, how = time_steps(steps, args.reps, flush)
            for what, us in timed.items():
                record = timed_records[what]
                record.update(median_us=round(us, 2), tflops=round(flops / (us * 1e-6) / 1e12, 1),
                              pct_peak=round(100 * flops / (us * 1e-6) / 1e12 / peak, 1),
                              pct_sustained_peak=round(100 * flops / (us * 1e-6) / 1e12 / sustained, 1), timed=how)
                eager = eager_us.get(what)
                if eager is not None:
                    record.update(eager_us=round(eager, 2), eager_over_graph=round(eager / us, 2))
                records.append(record)
                print(f"{name:9s} M={tokens:6d} {what:17s} {us:10.1f} us {flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s "
                      f"({record['pct_peak']:4.1f}% of peak, {record['pct_sustained_peak']:4.1f}% sustained) "
                      f"peak memory {record['peak_mib'] / 2**10:6.2f} GiB"
                      f" (first call {record['first_call_peak_mib'] / 2**10:.2f})"
                      f"{'' if record['deterministic'] else ', gradients differ between two runs'}"
                      f"{'' if eager is None else f', eager {eager:.1f} us ({eager / us:.2f}x)'}", flush=True)
            for what in timed:
                if what.startswith("moeforge") and "torch_grouped_mm" in timed:
                    speedup = timed["torch_grouped_mm"] / timed[what]
                    timed_records[what]["speedup_vs_grouped_mm"] = round(speedup, 2)
                    print(f"{'':9s} {what} is {speedup:.2f}x the speed of torch._grouped_mm", flush=True)
        del layer
        torch.cuda.empty_cache()
    if args.sonicmoe:
        records += sonicmoe_cell(flush, args.reps, args.profile)
    write_results("bench_train", device, records, args.out, args.commit, peak_tflops=round(peak, 1),
                  sustained_peak_tflops=round(sustained, 1))


if __name__ == "__main__":
    main()
