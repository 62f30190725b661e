"""Benchmark the triton backend's MoE forward against the hardware roofline (CUDA only).

    python benchmarks/bench_moe.py [--shapes mixtral,qwen3 ...] [--tokens 1,8,...] [--out FILE]

For each shape (experts E, top-k k, hidden H, intermediate I) and token count M it times, as CUDA
graph replays with the L2 flushed before every replay, on random (never zero) bf16 data:

* ``experts``: from top-k ids/weights to the combined output (alignment, both GEMMs, activation,
  combine) -- the pipeline without its top-k stage;
* ``layer``: the whole layer forward from router logits;
* ``by_hand``: the same kernels as ``layer`` called directly -- the pipeline's overhead is
  ``layer / by_hand - 1``;
* ``baseline_torch_grouped_mm``: the ``experts`` computation written with PyTorch's
  ``torch._grouped_mm`` (an open baseline; other open kernels are not installed on our GPU machines).

With ``--quant fp8,w4a16,mxfp4,nvfp4`` it also times the ``experts`` span of quantized layers on the
same shapes and M grid — FP8 W8A8 (128x128 block weights, per-128-group activations quantized before
the dispatch, DeepSeek-V3 style; ``fp8-channel``: per-channel weights, per-token activations;
``int8``: INT8 per-channel / per-token, against the fp8 peak, which the H100's int8 peak equals), W4A16 (int4, group 128 or the largest of 64 / 32 dividing the sizes, zero points), MXFP4 (GPT-OSS's format) and
NVFP4 (weights only, bf16 activations; ``mxfp4-shuffled`` / ``nvfp4-shuffled``: the weights held in the triton
GEMMs' pre-shuffled layout) — records ``experts_<quant>`` with the speedup over the bf16
``experts`` of the same run, against a roofline computed from the quantized weight bytes (scales and
zero points included) and, for FP8, the fp8 matmul peak.

One roofline everywhere, measured in the same run: the bf16 (or fp8) matmul peak (8192^3) and the HBM
*read* bandwidth (the fastest of a torch reduction and Triton streaming reads, ``read_bandwidth.py``; a copy's
bandwidth is lower and would put cells above 100 %).
roofline time = max(flops / peak, bytes / read bandwidth) with flops = 2 M k (H 2I + I H) and bytes =
the weights of the experts actually used, in their stored format + input + output. It prints a table
and writes JSON (device, commit, date, peak_tflops, read_bandwidth_tbps, records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moeforge as mf  # noqa: E402
from moeforge.kernels.config import ConfigTable, device_key  # noqa: E402
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmWeight,  # noqa: E402
                                                grouped_gemm)
from moeforge.kernels.topk import routing_flags  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import measured_commit  # noqa: E402
from read_bandwidth import measure_read_bandwidth  # noqa: E402

SHAPES = {
    "mixtral": (8, 2, 4096, 14336),
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "gptoss": (128, 4, 2880, 2880),
    "llama4": (16, 1, 5120, 8192),  # Llama-4 Scout's experts (its routing weights scale their input: bench_train)
    # shapes no shipped table covers (their layers run the fallback tiles): Llama-4 Maverick, Mixtral-8x22B, OLMoE,
    # Qwen2-57B-A14B, DeepSeek-V2-Lite
    "llama4_maverick": (128, 1, 5120, 8192),
    "mixtral_8x22b": (8, 2, 6144, 16384),
    "olmoe": (64, 8, 2048, 1024),
    "qwen2_57b": (64, 8, 3584, 2560),
    "deepseek_v2_lite": (64, 6, 2048, 1408),
}
# the shapes a run takes unless --shapes names others: the four of the README's tables
DEFAULT_SHAPES = "mixtral,qwen3,deepseek,gptoss"


def shape_of(name: str) -> tuple[int, int, int, int]:
    """``(E, k, H, I)`` of a shape named in :data:`SHAPES`, or written out as ``ExkxHxI`` (``64x8x2048x1024``: a
    model of your own, for ``--shapes``); anything else is a ``SystemExit`` naming both forms."""
    if name in SHAPES:
        return SHAPES[name]
    parts = name.split("x")
    if len(parts) == 4 and all(part.isdigit() and int(part) > 0 for part in parts):
        experts, top_k, hidden, inter = (int(part) for part in parts)
        if top_k <= experts:
            return experts, top_k, hidden, inter
    raise SystemExit(f"unknown shape {name!r}: name one of {', '.join(SHAPES)}, or write it out as ExkxHxI "
                     f"(experts x top-k x hidden x intermediate, top-k at most the experts: 64x8x2048x1024)")
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
FLUSH_BYTES = 256 * 1024 * 1024


def _graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def flush_l2(buffer: torch.Tensor) -> None:
    """Evict the L2 by *reading* a buffer larger than it: writing one (zero_) would leave dirty lines
    whose write-back lands inside the next timed region."""
    torch.sum(buffer, dtype=torch.int32)


def time_graph(fn: Callable[[], Any], reps: int, flush: Optional[torch.Tensor]) -> float:
    """Median microseconds of one replay, L2 flushed before each (unless ``flush`` is None)."""
    return time_graphs_interleaved({"": fn}, reps, flush)[""]


def time_graphs_interleaved(fns: dict[str, Callable[[], Any]], reps: int,
                            flush: Optional[torch.Tensor]) -> dict[str, float]:
    """Median microseconds of one replay of each function, the replays taken in turns (one of each per round, L2
    flushed before each unless ``flush`` is None): launches compared this way see the same clocks, which drift under
    minutes of compute-bound kernels (docs/notes/kernels-log.md, "The Gluon weight gradient on the GPU")."""
    graphs = {name: _graph(fn) for name, fn in fns.items()}
    for graph in graphs.values():
        for _ in range(3):
            graph.replay()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(reps):
        for name, graph in graphs.items():
            if flush is not None:
                flush_l2(flush)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure_peak() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3 random data, read-only TB/s of 1 GiB, :func:`measure_read_bandwidth`). The
    MoE kernels mostly *read* weights, which runs faster than a copy: the read bandwidth is the roofline's.

    Both operands far exceed the L2, so no flush is needed."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_graph(lambda: torch.mm(a, b, out=out), 20, None)
    tflops = 2 * n**3 / (us * 1e-6) / 1e12
    return tflops, measure_read_bandwidth(lambda fn: time_graph(fn, 20, None))


def measure_sustained_peak(products: int = 40, warm_seconds: float = 1.0) -> float:
    """bf16 matmul TFLOP/s of ``products`` 8192^3 products back to back in one graph (tens of milliseconds, as long as
    a large training step), timed after ``warm_seconds`` of the same load. :func:`measure_peak` times single products
    at the start of a run, bursts a card runs at its top clock; under a long load a card with a power limit lowers its
    clock (measured in docs/kernels.md, "Clocks under a step"). Both ceilings go into a training run's results: a long
    step is compared with the dense products it could have run in its time and power."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        for _ in range(products):
            torch.mm(a, b, out=out)

    warm = _graph(run)
    end = time.perf_counter() + warm_seconds
    while time.perf_counter() < end:
        warm.replay()
        torch.cuda.synchronize()
    return products * 2 * n**3 / (time_graph(run, 5, None) * 1e-6) / 1e12


def roofline_us(shape: tuple[int, int, int, int], tokens: int, ids: torch.Tensor, peak: float,
                bw: float) -> tuple[float, float]:
    experts, top_k, hidden, inter = shape
    flops = 2 * tokens * top_k * (hidden * 2 * inter + inter * hidden)
    used = int(torch.unique(ids).numel())
    weight_bytes = used * (2 * inter * hidden + hidden * inter) * 2
    io_bytes = 2 * tokens * hidden * 2
    seconds = max(flops / (peak * 1e12), (weight_bytes + io_bytes) / (bw * 1e12))
    return seconds * 1e6, flops


def kernels_by_hand(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same kernels as ``layer(x, logits)``, called directly (no stages, no payloads): the
    baseline for the pipeline's overhead."""
    ops = torch.ops.moeforge
    tokens, (experts, top_k) = x.shape[0], (layer.num_experts, layer.top_k)
    config = layer.pipeline.stages[1].configs.lookup(tokens)
    flags = routing_flags(layer.routing)
    w13, w2 = layer.w13_weight, layer.w2_weight

    def run() -> torch.Tensor:
        weights, ids = ops.route(logits, None, top_k, **flags)
        sorted_ids, block_expert, num_padded = ops.align_block_size(ids, experts, config.block_m, False)
        route = GemmRoute(sorted_ids, block_expert, num_padded, tokens * top_k, aligned_block_m=config.block_m)
        hidden, _ = grouped_gemm(GemmRows(x, rows_per_a=top_k), GemmWeight(w13), route,
                                 GemmEpilogue(x.dtype, act=ACT_SILU, glu=True), config.gate_up)
        out, _ = grouped_gemm(GemmRows(hidden), GemmWeight(w2), route, GemmEpilogue(x.dtype), config.down)
        return ops.combine(out, weights, top_k, 1.0, x.dtype)

    return run


def grouped_mm_baseline(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput) -> Callable[[], torch.Tensor]:
    """The expert computation written with PyTorch's ``torch._grouped_mm`` (an open baseline):
    sort copies by expert, gather, grouped GEMM, SwiGLU, grouped GEMM, weighted scatter-add."""
    tokens, top_k = topk.ids.shape
    w13t, w2t = layer.w13_weight.transpose(1, 2), layer.w2_weight.transpose(1, 2)
    ones = torch.ones(tokens * top_k, dtype=torch.int32, device=x.device)

    def run() -> torch.Tensor:
        flat = topk.ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(layer.num_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        source = order // top_k
        hidden = torch._grouped_mm(x[source], w13t, offs=offs)
        gate, up = hidden.chunk(2, dim=-1)
        rows = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2t, offs=offs)
        rows = rows * topk.weights.reshape(-1)[order, None].to(rows.dtype)
        return torch.zeros_like(x).index_add_(0, source, rows)

    return run


def random_batch(tokens: int, hidden: int, experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows and router logits, the same for a token count (and ``seed``) in every layer of a shape:
    a quantized layer is compared with bf16 on the same routing (at small M the number of experts a random
    routing touches moves the time by up to 1/E)."""
    gen = torch.Generator(device="cuda").manual_seed(1_000_003 * tokens + hidden + 7_919 * seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.float32, generator=gen)
    return x, logits


def bench_shape(name: str, tokens_list: tuple[int, ...], peak: float, read_bw: float,
                flush: torch.Tensor, reps: int, experts_only_timing: bool = False,
                batch_invariant: bool = False) -> list[dict[str, Any]]:
    experts, top_k, hidden, inter = shape_of(name)
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda",
                        backend="triton", batch_invariant=batch_invariant)
    experts_only = mf.Pipeline(layer.pipeline.stages[1:], layer.pipeline.specs[0])
    records = []
    for tokens in tokens_list:
        x, logits = random_batch(tokens, hidden, experts)
        topk = mf.stages.select_experts(logits, top_k, layer.routing)
        routed = RoutedTokens(Activations(x), TopKOutput(topk.weights, topk.ids))
        roof, flops = roofline_us(shape_of(name), tokens, topk.ids, peak, read_bw)
        with torch.no_grad():
            timed = {}
            spans = (("experts", lambda: experts_only(routed)), ("layer", lambda: layer(x, logits)),
                     ("by_hand", kernels_by_hand(layer, x, logits)))
            for what, fn in spans[:1] if experts_only_timing else spans:
                us = timed[what] = time_graph(fn, reps, flush)
                records.append(dict(shape=name, E=experts, k=top_k, H=hidden, I=inter, M=tokens, what=what,
                                    median_us=round(us, 2), roofline_us=round(roof, 2),
                                    tflops=round(flops / (us * 1e-6) / 1e12, 1),
                                    pct_roofline=round(100 * roof / us, 1), batch_invariant=batch_invariant))
                print(f"{name:9s} M={tokens:6d} {what:8s} {us:10.1f} us  roofline {roof:9.1f} us "
                      f"{100 * roof / us:6.1f}%  {flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s", flush=True)
            if experts_only_timing:
                continue
            try:
                base = time_graph(grouped_mm_baseline(layer, x, topk), reps, flush)
            except Exception as error:  # not every PyTorch build has _grouped_mm for this device
                print(f"{'':9s} torch._grouped_mm baseline unavailable: {type(error).__name__}: {error}")
            else:
                records.append(dict(shape=name, E=experts, k=top_k, H=hidden, I=inter, M=tokens,
                                    what="baseline_torch_grouped_mm", median_us=round(base, 2),
                                    roofline_us=round(roof, 2), tflops=round(flops / (base * 1e-6) / 1e12, 1),
                                    pct_roofline=round(100 * roof / base, 1)))
                print(f"{'':9s} torch._grouped_mm baseline {base:10.1f} us ({100 * roof / base:5.1f}%): "
                      f"moeforge is {base / timed['experts']:.2f}x faster", flush=True)
            overhead = 100 * (timed["layer"] / timed["by_hand"] - 1)
            next(r for r in records if r["M"] == tokens and r["what"] == "layer")["layer_overhead_pct"] = \
                round(overhead, 2)
            print(f"{'':9s} pipeline overhead (layer vs the same kernels by hand): {overhead:+.2f}%", flush=True)
    return records


def w4a16_group(hidden: int, inter: int) -> int:
    """128, or the largest of 64 / 32 that divides both sizes (GPT-OSS's 2880 takes 64)."""
    return next(g for g in (128, 64, 32) if hidden % g == 0 and inter % g == 0)


EIGHT_BIT = ("fp8", "fp8-channel", "int8")  # the formats timed against the fp8 matmul peak
QUANT_METHODS: dict[str, Callable[[int, int], mf.QuantMethod]] = {
    "fp8": lambda h, i: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),
    "fp8-channel": lambda h, i: mf.Fp8W8A8Method(weight_scales="channel", activation_scales="token"),
    "int8": lambda h, i: mf.Int8W8A8Method(),
    "w4a16": lambda h, i: mf.W4A16Method(group_size=w4a16_group(h, i), zero_points=True),
    "mxfp4": lambda h, i: mf.Mxfp4Method(),
    # the blocks in the pre-shuffled layout of the triton GEMMs (swapped tiles; its own tuned tables)
    "mxfp4-shuffled": lambda h, i: mf.Mxfp4Method(shuffled=True),
    "nvfp4": lambda h, i: mf.Nvfp4Method(),
    "nvfp4-shuffled": lambda h, i: mf.Nvfp4Method(shuffled=True),
}


def format_problem(shape: tuple[int, int, int, int], fmt: str) -> Optional[str]:
    """Why ``fmt`` cannot hold a layer of ``shape`` (e.g. FP8 per-128-group activations need a hidden size that 128
    divides: not GPT-OSS's 2880), or None: a one-expert layer of the shape's sizes is built on the CPU."""
    if fmt == "bf16":
        return None
    _, _, hidden, inter = shape
    try:
        mf.MoELayer(1, 1, hidden, inter, quant=QUANT_METHODS[fmt](hidden, inter), dtype=torch.bfloat16,
                    device="cpu", backend="torch")
    except mf.InputError as error:
        return str(error)
    return None


def held_formats(name: str, formats: Iterable[str]) -> Iterator[str]:
    """The formats of ``formats`` a layer of shape ``name`` can hold (:func:`format_problem`); each other one is
    reported and skipped."""
    for fmt in formats:
        problem = format_problem(shape_of(name), fmt)
        if problem is None:
            yield fmt
        else:
            print(f"{name} {fmt}: skipped, {problem}", flush=True)


def build_layer(shape: tuple[int, int, int, int], fmt: str, backend: str = "triton") -> mf.MoELayer:
    """A bf16 layer of ``shape`` on the GPU in ``fmt`` (``bf16`` or one of :data:`QUANT_METHODS`), random weights."""
    experts, top_k, hidden, inter = shape
    quant = QUANT_METHODS[fmt](hidden, inter) if fmt != "bf16" else None
    return mf.MoELayer(experts, top_k, hidden, inter, quant=quant, dtype=torch.bfloat16, device="cuda",
                       backend=backend, environ={})


def launch_entry(table: ConfigTable, fmt: str, tokens: int) -> str:
    """What decides the launch of ``tokens`` tokens in ``fmt`` under ``table``: its entry, or (a quantized format
    without a table of its own) the format's rules on the entry's ``block_m``, which a printed entry would hide."""
    if not table.tokens:
        return f"no table: default rules, block_m {table.lookup(tokens).block_m}"
    if fmt != "bf16" and table.weight_format is None:
        return f"no {fmt} table: the format's rules on block_m {table.lookup(tokens).block_m}"
    return str(table.lookup(tokens))


def measure_fp8_peak() -> float:
    """fp8 e4m3 matmul TFLOP/s on 8192^3 (``torch._scaled_mm``); 2x the bf16 peak if unavailable."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    us = time_graph(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20, None)
    return 2 * n**3 / (us * 1e-6) / 1e12


def quant_weight_bytes(quant: str, hidden: int, inter: int) -> float:
    """Bytes of one expert's weights (gate/up + down) in the quantized format, scales included."""
    elements = 3 * hidden * inter
    if quant == "fp8":  # 1 byte each + one fp32 scale per 128x128 block
        return elements + 4 * elements / (128 * 128)
    if quant in EIGHT_BIT:  # per channel (fp8 blocks above): 1 byte each + one fp32 scale per channel
        return elements + 4 * (2 * inter + hidden)
    if quant in ("mxfp4", "mxfp4-shuffled"):  # 4 bits each + one E8M0 byte per 32
        return elements / 2 + elements / 32
    if quant in ("nvfp4", "nvfp4-shuffled"):  # 4 bits each + one e4m3 byte per 16 (+ two fp32 global scales)
        return elements / 2 + elements / 16 + 8
    # 4 bits each + a bf16 scale and a uint8 zero point per 128 elements of a row
    return elements / 2 + 3 * elements / 128


def bench_quant(name: str, quant: str, tokens_list: tuple[int, ...], bf16_us: dict[int, float], peak: float,
                bw: float, flush: torch.Tensor, reps: int) -> list[dict[str, Any]]:
    experts, top_k, hidden, inter = shape_of(name)
    layer = build_layer(shape_of(name), quant)
    experts_only = mf.Pipeline(layer.pipeline.stages[1:], layer.pipeline.specs[0])
    records = []
    for tokens in tokens_list:
        x, logits = random_batch(tokens, hidden, experts)
        topk = mf.stages.select_experts(logits, top_k, layer.routing)
        routed = RoutedTokens(Activations(x), TopKOutput(topk.weights, topk.ids))
        used = int(torch.unique(topk.ids).numel())
        flops = 2 * tokens * top_k * 3 * hidden * inter
        data = used * quant_weight_bytes(quant, hidden, inter) + 2 * tokens * hidden * 2
        roof = max(flops / (peak * 1e12), data / (bw * 1e12)) * 1e6
        with torch.no_grad():
            us = time_graph(lambda: experts_only(routed), reps, flush)
        speedup = bf16_us[tokens] / us
        records.append(dict(shape=name, E=experts, k=top_k, H=hidden, I=inter, M=tokens, what=f"experts_{quant}",
                            median_us=round(us, 2), roofline_us=round(roof, 2), pct_roofline=round(100 * roof / us, 1),
                            tflops=round(flops / (us * 1e-6) / 1e12, 1), speedup_vs_bf16=round(speedup, 2)))
        print(f"{name:9s} M={tokens:6d} {quant:8s} {us:10.1f} us  roofline {roof:9.1f} us {100 * roof / us:6.1f}%  "
              f"{speedup:5.2f}x vs bf16", flush=True)
    return records


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated: names of bench_moe.SHAPES, or a shape written out as ExkxHxI "
                             "(64x8x2048x1024)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: HEAD's, "
                        "+changes when the tracked files differ from it: provenance.py)")
    parser.add_argument("--quant", default="",
                        help=f"quantized layers to time too, of {','.join(QUANT_METHODS)}")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also time the bf16 experts span with MoELayer(batch_invariant=True)")
    parser.add_argument("--skip-bf16-extras", action="store_true",
                        help="time only the bf16 experts span (no layer / by-hand / baseline)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    peak, read_bw = measure_peak()
    device = torch.cuda.get_device_name()
    print(f"{device}: bf16 matmul {peak:.0f} TFLOP/s, HBM read {read_bw:.2f} TB/s")
    fp8_peak = measure_fp8_peak() if any(q in EIGHT_BIT for q in args.quant.split(",")) else None
    if fp8_peak is not None:
        print(f"fp8 matmul {fp8_peak:.0f} TFLOP/s")
    records = []
    for name in args.shapes.split(","):
        tokens = tuple(int(t) for t in args.tokens.split(","))
        records += bench_shape(name, tokens, peak, read_bw, flush, args.reps, args.skip_bf16_extras)
        if args.batch_invariant:
            invariant = bench_shape(name, tokens, peak, read_bw, flush, args.reps, True, batch_invariant=True)
            default = {r["M"]: r["median_us"] for r in records if r["shape"] == name and r["what"] == "experts"}
            for record in invariant:
                record["what"] = "experts_batch_invariant"
                record["cost_vs_default"] = round(record["median_us"] / default[record["M"]], 3)
            records += invariant
        torch.cuda.empty_cache()  # the layer of this shape is gone: free its weights for the next
        bf16_us = {r["M"]: r["median_us"] for r in records if r["shape"] == name and r["what"] == "experts"}
        for quant in held_formats(name, filter(None, args.quant.split(","))):
            quant_peak = fp8_peak if quant in EIGHT_BIT and fp8_peak is not None else peak
            records += bench_quant(name, quant, tokens, bf16_us, quant_peak, read_bw, flush, args.reps)
            torch.cuda.empty_cache()
    def geomean(key: str) -> tuple[float, float]:
        values = [r[key] for r in records if r["what"] == "experts"]
        return math.exp(sum(math.log(v) for v in values) / len(values)), min(values)

    gm, low = geomean("pct_roofline")
    print(f"\ngeometric mean of % roofline (experts): {gm:.1f}% (min {low:.1f}%)")
    invariant_costs = [r["cost_vs_default"] for r in records if r["what"] == "experts_batch_invariant"]
    invariant_cost = (math.exp(sum(math.log(c) for c in invariant_costs) / len(invariant_costs))
                      if invariant_costs else None)
    if invariant_cost is not None:
        print(f"batch-invariant mode: geometric mean {invariant_cost:.3f}x the default's time")
    quant_summary = {}
    for quant in filter(None, args.quant.split(",")):
        cells = [r for r in records if r["what"] == f"experts_{quant}"]
        if not cells:  # no shape asked for could hold the format (format_problem)
            continue
        gm_q = math.exp(sum(math.log(r["pct_roofline"]) for r in cells) / len(cells))
        quant_summary[quant] = dict(geomean_pct_quant_roofline=round(gm_q, 1),
                                    min_speedup=min(r["speedup_vs_bf16"] for r in cells),
                                    max_speedup=max(r["speedup_vs_bf16"] for r in cells))
        print(f"{quant}: geometric mean {gm_q:.1f}% of the quantized roofline; speedup vs bf16 "
              f"{quant_summary[quant]['min_speedup']:.2f}x .. {quant_summary[quant]['max_speedup']:.2f}x")
    result = dict(device=device, commit=args.commit or measured_commit(),
                  date=datetime.date.today().isoformat(),
                  torch=torch.__version__, triton=_triton_version(), peak_tflops=round(peak, 1),
                  read_bandwidth_tbps=round(read_bw, 3), geomean_pct_roofline_experts=round(gm, 1),
                  batch_invariant_geomean_cost=round(invariant_cost, 3) if invariant_cost is not None else None,
                  fp8_peak_tflops=round(fp8_peak, 1) if fp8_peak is not None else None, quant=quant_summary,
                  records=records)
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"bench_moe-{device_key(device)}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
