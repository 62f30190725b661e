"""The eager forward's host cost: a layer called without a CUDA graph, as ``generate()`` and most training loops
call it (CUDA only).

    python benchmarks/bench_eager.py [--parts layer,block,generate] [--tokens 1,16,256,4096] [--profile DIR]

``layer``: a ``MoELayer`` of Qwen3-30B-A3B's MoE sizes (128 experts, top-8, H = 2048, I = 768), bf16 and FP8 block
scales, routing included, against

* ``by_hand``: the same Triton kernels called directly (no stages, no payloads, the custom ops): the pipeline's own
  cost is the difference;
* ``grouped_mm``: the computation written with ``torch._grouped_mm`` (softmax, top-k, sort, gather, two grouped
  GEMMs, SwiGLU, weighted scatter-add): the plain PyTorch path.

Each is measured four ways, medians over ``--reps`` calls:

* ``host_us``: the CPU time of one call that starts with the GPU idle (``perf_counter`` around the call, the device
  synchronised before): what the host spends launching it;
* ``host_busy_us``: the same while the GPU is busy with a kernel of about 20 ms queued before: a call that waits for
  the device (a host synchronisation) shows as those milliseconds; short of that it reads higher than ``host_us`` for
  every implementation (launches queued behind a running kernel cost the host more);
* ``eager_us``: back-to-back calls, the device synchronised after the last: the time per call of an eager loop
  (the larger of host and GPU time, where they overlap);
* ``graph_us``: one CUDA-graph replay (the GPU time alone).

``block`` and ``generate``: a 4-layer random ``Qwen3MoeForCausalLM`` with those MoE sizes (bf16), for
``experts_implementation`` ``grouped_mm`` (``transformers``' default), ``moeforge`` and ``moeforge+graphs`` (moeforge
with :func:`moeforge.hf_experts.capture_decode_graphs` up to 16 tokens): one MoE block
(``model.model.layers[0].mlp``, router included) called eagerly on 1 / 16 / 256 tokens (wall time of the call with
the device synchronised after it), and greedy ``generate()`` of 32 new tokens from 8, batch 1 and 16 (time per
token, the median of 5 rounds after a warm-up one, the implementations taking turns).

``--profile DIR`` also writes ``cProfile`` listings of the moeforge layer's eager call (bf16, 16 tokens), of the
moeforge MoE block, and of one ``generate()`` (batch 1) with ``grouped_mm`` and with ``moeforge``: where the host time
goes, function by function. Prints a table and writes JSON (device,
versions, commit, date, records).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_hf_experts import MODELS, build  # noqa: E402
from bench_moe import build_layer, grouped_mm_baseline, kernels_by_hand, random_batch, time_graph  # noqa: E402
from provenance import measured_commit  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.payloads import TopKOutput  # noqa: E402

SHAPE = (128, 8, 2048, 768)  # Qwen3-30B-A3B's MoE layer: experts, top_k, hidden, intermediate
TOKENS = (1, 16, 256, 4096)
BLOCK_TOKENS = (1, 16, 256)
GENERATE_BATCHES = (1, 16)
NEW_TOKENS = 32
BUSY_CYCLES = 40_000_000  # torch.cuda._sleep's spin: about 20 ms at the H100's and H200's clocks


def host_us(fn: Callable[[], Any], reps: int, busy: bool = False) -> float:
    """Median CPU microseconds of one call of ``fn``, the device idle (or busy, ``busy``) when it starts."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def eager_us(fn: Callable[[], Any], reps: int) -> float:
    """Microseconds per call of ``reps`` back-to-back calls, the device synchronised after the last (median of 5)."""
    return _rounds_us(fn, reps, wait=True)


def _rounds_us(fn: Callable[[], Any], reps: int, wait: bool) -> float:
    """Median over 5 rounds of the microseconds per call of ``reps`` back-to-back calls, the clock stopped after the
    device has finished them (``wait``) or as the host has launched them."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if wait:
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / reps)
    torch.cuda.synchronize()
    return statistics.median(rounds) * 1e6


def wall_us(fn: Callable[[], Any], reps: int) -> float:
    """Median microseconds of one call and the device's work for it (synchronised before and after)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def grouped_mm_with_routing(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    """:func:`bench_moe.grouped_mm_baseline` with its routing (softmax, top-k, renormalised) in the call."""
    top_k = layer.top_k

    def routed() -> torch.Tensor:
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        topk = TopKOutput(weights=weights / weights.sum(-1, keepdim=True), ids=ids)
        return grouped_mm_baseline(layer, x, topk)()

    return routed


def layer_call(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: layer(x, logits)


def measure(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    with torch.no_grad():
        return dict(host_us=host_us(fn, reps), host_busy_us=host_us(fn, reps, busy=True), eager_us=eager_us(fn, reps),
                    graph_us=time_graph(fn, reps, None))


def bench_layers(tokens_list: tuple[int, ...], reps: int) -> list[dict[str, Any]]:
    records = []
    for fmt in ("bf16", "fp8"):
        layer = build_layer(SHAPE, fmt)
        for tokens in tokens_list:
            x, logits = random_batch(tokens, SHAPE[2], SHAPE[0])
            runs: dict[str, Callable[[], Any]] = {"moeforge": layer_call(layer, x, logits)}
            if fmt == "bf16":
                runs["by_hand"] = kernels_by_hand(layer, x, logits)
                runs["grouped_mm"] = grouped_mm_with_routing(layer, x, logits)
            for name, fn in runs.items():
                record = dict(part="layer", format=fmt, tokens=tokens, run=name, **measure(fn, reps))
                records.append(record)
                print(f"layer {fmt:5s} M={tokens:5d} {name:10s} host {record['host_us']:8.1f} us  busy "
                      f"{record['host_busy_us']:8.1f} us  eager {record['eager_us']:8.1f} us  graph "
                      f"{record['graph_us']:8.1f} us", flush=True)
        del layer
        torch.cuda.empty_cache()
    return records


def build_model() -> Any:
    """The 4-layer random ``Qwen3MoeForCausalLM`` of :data:`SHAPE` in bf16 (``bench_hf_experts.py``'s ``medium``)."""
    assert MODELS["medium"][:4] == SHAPE
    return build("medium")


IMPLEMENTATIONS = ("grouped_mm", "moeforge", "moeforge+graphs")  # the last: hf_experts.capture_decode_graphs
GENERATE_ROUNDS = 5


def generate_ms(model: Any, batch: int) -> float:
    """Milliseconds per new token of one greedy ``generate()`` of :data:`NEW_TOKENS` tokens from 8."""
    ids = torch.randint(0, 1024, (batch, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / NEW_TOKENS


def use(model: Any, implementation: str) -> None:
    """Set ``model``'s experts implementation; ``moeforge+graphs``: moeforge with decode graphs up to 16 tokens."""
    from moeforge import hf_experts
    from moeforge.decode_graphs import DecodeGraphSettings

    model.set_experts_implementation(implementation.split("+")[0])
    hf_experts.capture_decode_graphs(model, DecodeGraphSettings(max_tokens=16) if "+graphs" in implementation else None)


def bench_model(parts: set[str], reps: int) -> list[dict[str, Any]]:
    """The block and ``generate()`` records; the implementations take turns (``generate()``: one round each, after
    a warm-up round each, :data:`GENERATE_ROUNDS` times, the median), so that a drift of the host's speed during
    the run weighs on both alike."""
    from moeforge import hf_experts

    hf_experts.register()
    model = build_model()
    block = model.model.layers[0].mlp
    records = []
    with torch.no_grad():
        if "block" in parts:
            for tokens in BLOCK_TOKENS:
                hidden = torch.randn(1, tokens, SHAPE[2], device="cuda", dtype=torch.bfloat16)
                for implementation in IMPLEMENTATIONS:
                    use(model, implementation)
                    record = dict(part="block", tokens=tokens, run=implementation,
                                  wall_us=wall_us(lambda: block(hidden), reps),
                                  host_busy_us=host_us(lambda: block(hidden), reps, busy=True))
                    records.append(record)
                    print(f"block M={tokens:5d} {implementation:15s} wall {record['wall_us']:8.1f} us  busy host "
                          f"{record['host_busy_us']:8.1f} us", flush=True)
        if "generate" in parts:
            for batch in GENERATE_BATCHES:
                rounds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
                for index in range(GENERATE_ROUNDS + 1):
                    for implementation in IMPLEMENTATIONS:
                        use(model, implementation)
                        ms = generate_ms(model, batch)
                        if index:  # the first round warms up
                            rounds[implementation].append(ms)
                for implementation, times in rounds.items():
                    record = dict(part="generate", batch=batch, run=implementation,
                                  ms_per_token=statistics.median(times), rounds=times)
                    records.append(record)
                    print(f"generate batch {batch:3d} {implementation:15s} {record['ms_per_token']:7.2f} ms per token "
                          f"(rounds {', '.join(f'{t:.2f}' for t in times)})", flush=True)
    return records


def write_profile(fn: Callable[[], Any], calls: int, path: Path, warm: int = 5) -> None:
    """``cProfile`` of ``calls`` eager calls of ``fn`` (after ``warm`` more), by own time and by cumulative time."""
    with torch.no_grad():
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{calls} calls\n\n== by own time ==\n")
    stats.sort_stats("tottime").print_stats(45)
    text.write("\n== by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(text.getvalue())
    print(f"wrote {path}")


def profiles(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    layer = build_layer(SHAPE, "bf16")
    x, logits = random_batch(16, SHAPE[2], SHAPE[0])
    write_profile(lambda: layer(x, logits), 200, out / "profile_layer_bf16_m16.txt")
    from moeforge import hf_experts

    hf_experts.register()
    model = build_model()
    model.set_experts_implementation("moeforge")
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 16, SHAPE[2], device="cuda", dtype=torch.bfloat16)
    write_profile(lambda: block(hidden), 200, out / "profile_hf_block_m16.txt")
    for implementation in ("grouped_mm", "moeforge"):  # one greedy generate() of batch 1, after two
        model.set_experts_implementation(implementation)
        write_profile(lambda: generate_ms(model, 1), 1, out / f"profile_generate_{implementation}.txt", warm=2)


def loop_us(fn: Callable[[], Any], reps: int) -> float:
    """Host microseconds per call of ``reps`` back-to-back calls, timed before the device is synchronised (median
    of 5 rounds; the device keeps up, so nothing waits)."""
    return _rounds_us(fn, reps, wait=False)


@torch.library.custom_op("bench_eager::noop", mutates_args=())
def _noop(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(n)


@_noop.register_fake
def _(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(n)


def raw_launches(rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, top_k: int
                 ) -> dict[str, Callable[[], Any]]:
    """The combine kernel launched through Triton's JIT (``kernel[grid](...)``) and through the compiled kernel's
    launcher (the binding, cache lookup and checks of the JIT skipped): what one launch costs either way."""
    from triton.runtime.driver import driver

    from moeforge.kernels import combine, pdl

    hidden = out.shape[1]
    block_h = min(1024, 1 << (hidden - 1).bit_length())
    grid = (out.shape[0], -(-hidden // block_h))
    dependent = pdl.pdl_applies(out.device)
    args = (rows, weights, rows, out, hidden, 1.0, rows.stride(0), out.stride(0))
    options = dict(TOP_K=top_k, HAS_WEIGHTS=True, HAS_INDEX=False, BLOCK_H=block_h, PDL=pdl.flag(dependent),
                   num_warps=4 if block_h >= 512 else 2, **pdl.launch_options(dependent))
    kernel = combine._combine_kernel
    compiled = kernel[grid](*args, **options)
    device = driver.active.get_current_device()
    binder = kernel.device_caches[device][-1]
    bound = tuple(binder(*args, **options)[0].values())
    stream = driver.active.get_current_stream(device)

    def by_handle() -> None:
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *bound)

    return {"combine kernel, JIT launch": lambda: kernel[grid](*args, **options),
            "combine kernel, compiled launcher": by_handle}


def breakdown(tokens: int, reps: int) -> list[dict[str, Any]]:
    """Host microseconds of each piece of the bf16 layer's eager forward at ``tokens`` tokens: each stage, each
    kernel through its custom op and called directly, and the elementary costs (an allocation, a no-op custom op)."""
    from moeforge.kernels import align, combine, moe_gemm, topk
    from moeforge.kernels.activations import ACT_SILU
    from moeforge.kernels.grouped_gemm_call import GemmEpilogue, GemmRoute, GemmRows, GemmWeight, grouped_gemm
    from moeforge.payloads import MoEInput

    layer = build_layer(SHAPE, "bf16")
    experts, top_k = layer.num_experts, layer.top_k
    x, logits = random_batch(tokens, SHAPE[2], SHAPE[0])
    ops = torch.ops.moeforge
    flags = topk.routing_flags(layer.routing)
    config = layer.pipeline.stages[1].configs.lookup(tokens)
    weights, ids = ops.route(logits, None, top_k, **flags)
    sorted_ids, block_expert, num_padded = ops.align_block_size(ids, experts, config.block_m, False)
    route = GemmRoute(sorted_ids, block_expert, num_padded, tokens * top_k, aligned_block_m=config.block_m)
    hidden = torch.empty(tokens * top_k, SHAPE[3], device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(tokens * top_k, SHAPE[2], device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, SHAPE[2], device="cuda", dtype=torch.bfloat16)
    w13 = layer.w13_weight
    pieces: dict[str, Callable[[], Any]] = {
        "torch.empty": lambda: torch.empty(tokens, SHAPE[2], device="cuda", dtype=torch.bfloat16),
        "no-op custom op": lambda: torch.ops.bench_eager.noop(x, 4),
        "route (op)": lambda: ops.route(logits, None, top_k, **flags),
        "route (direct)": lambda: topk.route(logits, None, top_k, **flags),
        "align (op)": lambda: ops.align_block_size(ids, experts, config.block_m, False),
        "align (direct)": lambda: align.align_block_size(ids, experts, config.block_m, False),
        "gate/up gemm (op)": lambda: grouped_gemm(GemmRows(x, rows_per_a=top_k), GemmWeight(w13), route,
                                                  GemmEpilogue(x.dtype, act=ACT_SILU, glu=True), config.gate_up),
        "gate/up gemm (direct)": lambda: moe_gemm.moe_gemm(x, w13, hidden, sorted_ids, block_expert, num_padded,
                                                           rows_per_a=top_k, config=config.gate_up, act=ACT_SILU,
                                                           glu=True, aligned_block_m=config.block_m),
        "combine (op)": lambda: ops.combine(rows, weights, top_k, 1.0, x.dtype),
        "combine (direct)": lambda: combine.combine_copies(rows, top_k, out, weights, 1.0),
    }
    pieces.update(raw_launches(rows, weights, out, top_k))
    payload: Any = MoEInput(x, logits)
    for index, stage in enumerate(layer.pipeline.stages):
        pieces[f"stage {index} {type(stage).__name__}"] = (lambda s, p: lambda: s(p))(stage, payload)
        payload = stage(payload)
    pieces["pipeline.run"] = lambda: layer.pipeline.run(MoEInput(x, logits), input_checked=True)
    pieces["layer(x, logits)"] = lambda: layer(x, logits)
    records = []
    with torch.no_grad():
        for name, fn in pieces.items():
            records.append(dict(part="breakdown", tokens=tokens, piece=name, host_us=loop_us(fn, reps)))
            print(f"breakdown M={tokens:4d} {name:42s} {records[-1]['host_us']:8.1f} us", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="layer,block,generate", help="any of layer, block, generate; or none")
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--breakdown", action="store_true", help="the host time of each piece at 16 tokens")
    parser.add_argument("--profile", type=Path, default=None, help="a folder for the cProfile listings")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None, help="the commit measured, when run from a copy without its git")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager.py needs a CUDA device")
    parts = set(args.parts.split(","))
    records: list[dict[str, Any]] = []
    if "layer" in parts:
        records += bench_layers(tuple(int(t) for t in args.tokens.split(",")), args.reps)
    if parts & {"block", "generate"}:
        records += bench_model(parts, args.reps)
    if args.breakdown:
        records += breakdown(16, args.reps)
    if args.profile is not None:
        profiles(args.profile)
    import transformers
    import triton

    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, commit=args.commit or measured_commit(),
                  date=datetime.date.today().isoformat(), records=records)
    out: Optional[Path] = args.out or (Path(__file__).resolve().parent / "results" /
                                       f"bench_eager-{re.sub(r'[^a-z0-9]+', '_', device.lower()).strip('_')}-"
                                       f"{result['date']}.json")
    assert out is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
