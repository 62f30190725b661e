"""Benchmark expert-parallel dispatch + combine against a raw NCCL all-to-all of the same bytes.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py [--tokens 1,16,...] [--out FILE] [--commit SHA]

Per token count T (tokens per rank), DeepSeek-V3 shapes (E=256 experts, top-8, H=7168), uniform random
routing, random bf16 activations (never zero), for BF16 and FP8 (per-128-group scales) dispatch:

* ``normal``: :class:`AllToAllDispatch` then its combine (bf16 expert outputs back),
  against ``raw`` = the two ``all_to_all_single`` calls with the same split sizes and the same bytes
  (packed dispatch rows, then the outputs) on preallocated buffers; and the dispatch alone against
  its raw all-to-all (FP8 halves the dispatch's bytes, not the combine's);
* ``low_latency``: :class:`LowLatencyDispatch` (capacity = T, which never drops) + combine, eager
  and replayed as a CUDA graph, against the raw equal-split all-to-alls of its fixed buffers;
* ``symmetric``: :class:`SymmetricDispatch` (capacity = T) + combine, eager and replayed as a CUDA graph, against
  ``raw`` of the normal mode (the two all-to-alls of exactly the routed rows: the bytes it moves), T up to
  ``SYMMETRIC_MAX`` (its expert buffers hold ``W * T`` rows per local expert);
* ``compact``: :class:`SymmetricDispatch` with compact buffers (``max_rows = 2 * T * k``) block-aligned for the
  triton GEMMs, the same way, at every T;
* ``symmetric_per_copy``, ``compact_per_copy``: the same with ``send_tokens_once=False`` (one row per copy crosses
  NVLink, as the NCCL dispatchers send; the default sends each token's row once per owning rank). ``bytes_sent``
  is the per-copy bytes of ``raw`` for every mode;
* ``symmetric_summed``, ``compact_summed``: tokens sent once and ``sum_on_owner=True`` (each owner returns one fp32
  partial per token instead of one row per copy); ``*_summed_bf16``: the partials in bf16;
* ``symmetric_decode_graphs``, ``compact_decode_graphs`` (T up to ``DECODE_GRAPHS_MAX``): an eager call of the
  symmetric step (compact: buffers that cannot overflow, ``max_rows = W * T * k``, and bf16 partials) through :class:`~moeforge.decode_graphs.DecodeGraphs`, as an
  expert-parallel ``MoELayer(decode_graphs=...)`` calls its experts: the inputs copied in, the graph replayed, the
  output copied out — its ``us`` is the eager time a layer's exchange then costs (no ``graph_us``: it is one).

Times are medians of CUDA-event-timed runs after warm-up, each run started after a barrier; the
slowest rank's median is reported (a step waits for it). A graph's time is that of ``GRAPH_STEPS`` steps captured
back to back, divided by them (one replay's start differs between ranks by some microseconds). Bandwidth = bytes
this rank sent (dispatch + combine) / time. Before timing, a correctness check compares the expert-parallel layer with
the whole layer on each GPU. Prints a table, writes JSON (device, world size, commit, date, records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.distributed import (  # noqa: E402
    AllToAllDispatch,
    ExpertParallel,
    LowLatencyDispatch,
    RowFormat,
    SymmetricDispatch,
    shard_state_dict,
)
from moeforge.kernels.config import ConfigTable  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402
from provenance import measured_commit  # noqa: E402

E, K, H = 256, 8, 7168
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
LOW_LATENCY_MAX = 512  # fixed buffers of E * T rows: beyond this they are gigabytes
GRAPH_STEPS = 10  # steps in one captured graph
SYMMETRIC_MAX = 4096  # expert buffers of E * T rows (bf16: 3.7 GB per 1024 tokens)
DECODE_GRAPHS_MAX = 256  # the decode batches a layer's decode graphs are for


def _timed(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _routed(tokens: int, fp8: bool, seed: int) -> RoutedTokens:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=generator).to(torch.bfloat16)
    ids = torch.rand(tokens, E, device="cuda", generator=generator).topk(K, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, K, device="cuda", generator=generator) + 0.1
    acts = mf.PerGroupQuantizer()(x) if fp8 else Activations(x)
    return RoutedTokens(acts, TopKOutput(weights, ids))


def _check_correctness(rank: int, ep_small: ExpertParallel) -> dict[str, float]:
    """The expert-parallel layer against the whole layer on this GPU (NCCL exchange)."""
    errors = {}
    sizes = dict(num_experts=ep_small.num_experts, top_k=4, hidden_size=256, intermediate_size=128, n_group=4,
                 topk_group=2, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        whole = mf.MoELayer.from_preset("deepseek_v3", **sizes, dtype=dtype, backend="torch")
        with torch.no_grad():
            whole.e_score_correction_bias.normal_()
        x = torch.randn(5 + 7 * rank, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).to(dtype)
        want = whole(x).float()
        for name, dispatcher in (("normal", "auto"), ("low_latency", LowLatencyDispatch(ep_small, max_tokens=64)),
                                 ("symmetric", SymmetricDispatch(ep_small, max_tokens=64)),
                                 ("symmetric_once", SymmetricDispatch(ep_small, max_tokens=64, send_tokens_once=True)),
                                 ("symmetric_summed_bf16", SymmetricDispatch(ep_small, max_tokens=64,
                                                                             sum_on_owner=torch.bfloat16))):
            layer = mf.MoELayer.from_preset("deepseek_v3", **sizes, dtype=dtype, expert_parallel=ep_small,
                                            dispatcher=dispatcher)
            layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
            got = layer(x).float()
            errors[f"{name}/{str(dtype)[6:]}"] = float((got - want).norm() / want.norm())
            if name.startswith("symmetric"):
                errors[f"{name}_transport"] = float("symmetric memory (NVLink)" not in layer.describe())
            if name != "normal":  # the same under CUDA-graph replay
                static = x.clone()
                layer(static)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = layer(static)
                graph.replay()
                errors[f"{name}_graph/{str(dtype)[6:]}"] = float((captured.float() - want).norm() / want.norm())
    worst = {key: torch.tensor([value], device="cuda") for key, value in errors.items()}
    for value in worst.values():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return {key: float(value.item()) for key, value in worst.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtypes", default="bf16,fp8", help="the rows' formats on the wire: bf16, fp8 or both")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    ep = ExpertParallel(E)
    with torch.inference_mode():
        errors = _check_correctness(rank, ExpertParallel(8 * world))
    if rank == 0:
        print("correctness (max over ranks, rel L2 vs the whole layer):", errors, flush=True)

    records = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for dtype in args.dtypes.split(","):
            with torch.inference_mode():
                records += _bench(ep, tokens, dtype, args.iters)
            if rank == 0:
                for rec in records[-_modes(tokens):]:
                    print(f"T={tokens:6d} {dtype:4s} {rec['dispatcher']:11s} ours {rec['us']:9.1f} us  "
                          f"raw {rec['raw_us']:9.1f} us  ratio {rec['ratio']:5.2f}  "
                          f"{rec['gbps']:7.1f} GB/s  graph {rec.get('graph_us') or float('nan'):9.1f} us  "
                          f"dispatch {rec.get('dispatch_us', float('nan')):9.1f} us "
                          f"(raw {rec.get('raw_dispatch_us', float('nan')):9.1f})", flush=True)
            torch.cuda.empty_cache()
    if rank == 0:
        by = {(r["tokens"], r["dispatcher"], r["dtype"]): r["us"] for r in records}
        dispatch_only = {(r["tokens"], r["dtype"]): r["dispatch_us"] for r in records if "dispatch_us" in r}
        for r in records:
            if r["dtype"] == "fp8" and (r["tokens"], r["dispatcher"], "bf16") in by:
                r["fp8_speedup_vs_bf16"] = by[(r["tokens"], r["dispatcher"], "bf16")] / r["us"]
                if "dispatch_us" in r and (r["tokens"], "bf16") in dispatch_only:
                    r["fp8_dispatch_speedup_vs_bf16"] = dispatch_only[(r["tokens"], "bf16")] / r["dispatch_us"]
        result = dict(device=torch.cuda.get_device_name(), world_size=world,
                      commit=args.commit or measured_commit(),
                      date=datetime.date.today().isoformat(), shape=dict(experts=E, top_k=K, hidden=H),
                      correctness=errors, records=records)
        out = Path(args.out or f"benchmarks/results/bench_ep-x{world}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()


def _bench(ep: ExpertParallel, tokens: int, dtype: str, iters: int) -> list[dict[str, Any]]:
    routed = _routed(tokens, dtype == "fp8", seed=1000 + ep.rank)
    records = []
    dispatch = AllToAllDispatch(ep)
    combine = dispatch.combine_stage(out_dtype=mf.DType.BF16)
    rows = dispatch(routed)
    outputs = torch.randn(rows.x.data.shape[0], H, device="cuda").to(torch.bfloat16)

    def ours() -> None:
        combine(dispatch(routed).with_x(Activations(outputs)))

    plan = rows.plan
    wire = RowFormat.of(routed.x)
    send, recv = (torch.empty(sum(s), wire.row_bytes, dtype=torch.uint8, device="cuda")
                  for s in (plan.send_splits, plan.recv_splits))
    back_send, back_recv = (torch.empty(sum(s), 2 * H, dtype=torch.uint8, device="cuda")
                            for s in (plan.recv_splits, plan.send_splits))
    send_splits, recv_splits = list(plan.send_splits), list(plan.recv_splits)

    def raw() -> None:
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        dist.all_to_all_single(back_recv, back_send, send_splits, recv_splits)

    def raw_dispatch() -> None:
        dist.all_to_all_single(recv, send, recv_splits, send_splits)

    sent = send.numel() + back_send.numel()
    raw_us = _timed(raw, iters)
    record = _record(tokens, "normal", dtype, _timed(ours, iters), raw_us, sent, None)
    # The dispatch alone (what FP8 shrinks; the combine returns bf16 outputs either way).
    record.update(dispatch_us=_timed(lambda: dispatch(routed), iters), raw_dispatch_us=_timed(raw_dispatch, iters))
    records.append(record)

    if tokens <= LOW_LATENCY_MAX:
        low = LowLatencyDispatch(ep, max_tokens=tokens)
        ours_low = _padded_step(low, routed)
        slots = E * low.slots
        lsend, lrecv = (torch.empty(slots, wire.row_bytes, dtype=torch.uint8, device="cuda") for _ in range(2))
        lback_send, lback_recv = (torch.empty(slots, 2 * H, dtype=torch.uint8, device="cuda") for _ in range(2))

        def raw_low() -> None:
            dist.all_to_all_single(lrecv, lsend)
            dist.all_to_all_single(lback_recv, lback_send)

        graph_us = _graph_step_us(ours_low, iters, ep.rank)
        records.append(_record(tokens, "low_latency", dtype, _timed(ours_low, iters), _timed(raw_low, iters),
                               lsend.numel() + lback_send.numel(), graph_us))
        del lsend, lrecv, lback_send, lback_recv

    # each token's row once per owning rank, or one row per copy; copies returned one by one, or summed on the owner
    for suffix, once, summed in (("", True, False), ("_per_copy", False, False), ("_summed", True, True),
                                 ("_summed_bf16", True, torch.bfloat16)):
        options = dict(max_tokens=tokens, send_tokens_once=once, sum_on_owner=summed)
        if tokens <= SYMMETRIC_MAX:
            records.append(_symmetric_record(tokens, "symmetric" + suffix, dtype, SymmetricDispatch(ep, **options),
                                             routed, iters, raw_us, sent))
        # compact buffers (max_rows: twice the copies a rank receives on average), block-aligned for the triton GEMMs
        compact = SymmetricDispatch(ep, max_rows=2 * tokens * K, configs=ConfigTable(ep.local_experts, K), **options)
        records.append(_symmetric_record(tokens, "compact" + suffix, dtype, compact, routed, iters, raw_us, sent))
        del compact
        torch.cuda.empty_cache()
    if tokens <= DECODE_GRAPHS_MAX:
        every_copy = ep.world_size * tokens * K  # (compact buffers that cannot overflow: no host read to replay)
        for name, decoding in (("symmetric", SymmetricDispatch(ep, max_tokens=tokens)),
                               ("compact", SymmetricDispatch(ep, max_tokens=tokens, max_rows=every_copy,
                                                             configs=ConfigTable(ep.local_experts, K),
                                                             sum_on_owner=torch.bfloat16))):
            step = _decode_graphs_step(decoding, routed)
            record = _record(tokens, name + "_decode_graphs", dtype, _timed(step, iters), raw_us, sent, None)
            record["transport"] = decoding.summary()
            records.append(record)
    return records


def _decode_graphs_step(dispatch: SymmetricDispatch, routed: RoutedTokens) -> Callable[[], None]:
    """A symmetric step called eagerly through decode graphs (the layer's ``decode_graphs``): its first call runs it
    and captures, later calls copy the routed tensors in, replay, and copy the output out."""
    from moeforge.decode_graphs import DecodeGraphs, DecodeGraphSettings

    tokens = routed.topk.ids.shape[0]
    graphs = DecodeGraphs(DecodeGraphSettings(max_tokens=tokens))
    combine = dispatch.combine_stage(out_dtype=mf.DType.BF16)
    outputs = torch.randn(dispatch(routed).x.data.shape[:-1] + (H,), device="cuda").to(torch.bfloat16)

    def forward(data: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor:
        rows = dispatch(RoutedTokens(Activations(data, scale[0] if scale else None), TopKOutput(weights, ids)))
        return combine(rows.with_x(Activations(outputs))).hidden_states

    inputs = (routed.x.data, routed.topk.weights, routed.topk.ids) + (
        (routed.x.scale,) if routed.x.scale is not None else ())
    device = routed.topk.ids.device

    def step() -> None:
        if graphs.run(forward, inputs, (), owner=dispatch, refusal=lambda: dispatch.replay_refusal(device)) is None:
            raise RuntimeError(f"not replayed: {graphs.refusals()}")

    step()  # (the capture)
    if not len(graphs):
        raise RuntimeError(f"not captured: {graphs.refusals()}")
    return step


def _symmetric_record(tokens: int, name: str, dtype: str, dispatch: SymmetricDispatch, routed: RoutedTokens,
                      iters: int, raw_us: float, sent: int) -> dict[str, Any]:
    """A symmetric dispatcher's step, eager and replayed, against the raw all-to-all of the routed rows."""
    step = _padded_step(dispatch, routed)
    graph_us = _graph_step_us(step, iters, dispatch.ep.rank)
    record = _record(tokens, name, dtype, _timed(step, iters), raw_us, sent, graph_us)
    record["transport"] = dispatch.summary()
    return record


def _padded_step(dispatch: Any, routed: RoutedTokens) -> Callable[[], None]:
    """One step of a dispatcher with fixed shapes: dispatch ``routed``, then combine random bf16 expert outputs
    (one per row of the dispatched buffer, padded or compact)."""
    combine = dispatch.combine_stage(out_dtype=mf.DType.BF16)
    outputs = torch.randn(dispatch(routed).x.data.shape[:-1] + (H,), device="cuda").to(torch.bfloat16)

    def step() -> None:
        combine(dispatch(routed).with_x(Activations(outputs)))

    return step


def _graph_step_us(step: Callable[[], None], iters: int, rank: int) -> float | None:
    """One step's time replayed as a CUDA graph: ``GRAPH_STEPS`` steps captured back to back (as decode steps run), the
    replay's time divided by them, so the ranks' skew in starting a replay is spread over the steps; ``None`` (and
    why, printed) where the capture fails."""
    try:
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_STEPS):
                step()
    except Exception as error:  # report, do not hide: the JSON says why
        if rank == 0:
            print(f"CUDA graph capture failed: {type(error).__name__}: {error}", flush=True)
        return None
    return _timed(graph.replay, iters) / GRAPH_STEPS


def _modes(tokens: int) -> int:
    return 5 + (tokens <= LOW_LATENCY_MAX) + 4 * (tokens <= SYMMETRIC_MAX) + 2 * (tokens <= DECODE_GRAPHS_MAX)


def _record(tokens: int, dispatcher: str, dtype: str, us: float, raw_us: float, sent: int,
            graph_us: float | None) -> dict[str, Any]:
    return dict(tokens=tokens, dispatcher=dispatcher, dtype=dtype, us=us, raw_us=raw_us, ratio=us / raw_us,
                bytes_sent=sent, gbps=sent / us / 1e3, graph_us=graph_us,
                graph_ratio=graph_us / raw_us if graph_us else None)


if __name__ == "__main__":
    main()
