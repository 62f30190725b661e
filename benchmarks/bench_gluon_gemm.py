"""The warp-specialised Gluon grouped GEMM against its Triton twin, GEMM by GEMM (Hopper only).

    python benchmarks/bench_gluon_gemm.py [--shapes mixtral,qwen3,...] [--tokens 1024,4096,16384]
                                          [--tiles all|plain|pingpong] [--out FILE]

For each shape and token count: the gate/up GEMM (SwiGLU fused), the down GEMM (routing weights in the epilogue) and
the down GEMM's row gradient (``d_out @ W2``, the weight read by its rows) of bf16 experts on random (never zero)
data and a random routing, timed alone as CUDA-graph replays with the L2 flushed before each (medians): ``moe_gemm``
with the shipped table's configuration for that batch (the layer's), and
:func:`moeforge.kernels.gluon_grouped_gemm.ws_grouped_gemm` with each of a few tiles, on a plan aligned by 128 rows.
Each Gluon output is checked against the twin's before it is timed (relative error, printed). The percentages are of
the same run's bf16 matmul peak (8192³). Prints a table and writes JSON (device, commit, date, peak, records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import gluon_grouped_gemm as gluon_gemm  # noqa: E402
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.config import GemmConfig, MoEConfig, row_gradient_config  # noqa: E402
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmWeight,  # noqa: E402
                                                grouped_gemm)
from bench_moe import FLUSH_BYTES, SHAPES, measure_peak, time_graph  # noqa: E402
from provenance import measured_commit  # noqa: E402

GLUON_TILES = {  # (tile, ping-pong MMA partitions, the output through shared memory in 16-byte row pieces)
    "gate_up": [(GemmConfig(128, 128, 64, num_warps=8, num_stages=4), False, True),
                (GemmConfig(128, 128, 64, num_warps=8, num_stages=4), False, False),
                (GemmConfig(128, 64, 64, num_warps=8, num_stages=4), False, True),
                (GemmConfig(64, 128, 64, num_warps=4, num_stages=4), False, True),
                (GemmConfig(64, 128, 64, num_warps=4, num_stages=4), True, True)],
    "down": [(GemmConfig(128, 128, 64, num_warps=8, num_stages=4), False, True),
             (GemmConfig(128, 128, 64, num_warps=8, num_stages=4), False, False),
             (GemmConfig(128, 256, 64, num_warps=8, num_stages=3), False, True),
             (GemmConfig(128, 256, 64, num_warps=8, num_stages=4), False, False),
             (GemmConfig(128, 128, 64, num_warps=4, num_stages=4), True, True),
             (GemmConfig(64, 256, 64, num_warps=4, num_stages=4), True, True)],
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def bench(name: str, tokens: int, peak: float, reps: int, flush: torch.Tensor, tiles: str = "all"
          ) -> list[dict[str, Any]]:
    experts, top_k, hidden, inter = SHAPES[name]
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    with torch.no_grad():
        for param in (layer.w13_weight, layer.w2_weight):
            param.copy_(torch.randn_like(param) * hidden ** -0.5)
    w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    ids = torch.topk(logits, top_k, dim=-1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens * top_k, device="cuda"), -1) * tokens
    hidden_rows = torch.randn(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.moeforge
    # the table's tiles, always on moe_gemm (an entry marked warp_specialized would launch the Gluon kernel)
    table = layer.pipeline.stages[1].configs.lookup(tokens)
    config = MoEConfig(attrs.evolve(table.gate_up, warp_specialized=False),
                       attrs.evolve(table.down, warp_specialized=False))
    table_plan = ops.align_block_size(ids, experts, config.block_m, False)
    table_route = GemmRoute(*table_plan, tokens * top_k, aligned_block_m=config.block_m)
    plan = ops.align_block_size(ids, experts, 128, False)
    grad_rows = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    flops = {"gate_up": 2 * tokens * top_k * hidden * 2 * inter, "down": 2 * tokens * top_k * inter * hidden,
             "down_dgrad": 2 * tokens * top_k * hidden * inter}

    def twin(gemm: str) -> torch.Tensor:
        if gemm == "gate_up":
            return grouped_gemm(GemmRows(x, rows_per_a=top_k), GemmWeight(w13), table_route,
                                GemmEpilogue(torch.bfloat16, act=ACT_SILU, glu=True), config.gate_up)[0]
        if gemm == "down":
            return grouped_gemm(GemmRows(hidden_rows), GemmWeight(w2), table_route,
                                GemmEpilogue(torch.bfloat16, routing_weights=weights), config.down)[0]
        # the down GEMM's row gradient, as the backward launches it
        return grouped_gemm(GemmRows(grad_rows), GemmWeight(w2.transpose(1, 2)), table_route,
                            GemmEpilogue(torch.bfloat16), row_gradient_config(config.down, inter, hidden))[0]

    records: list[dict[str, Any]] = []
    for gemm in ("gate_up", "down", "down_dgrad"):
        want = twin(gemm)
        us = time_graph(lambda gemm=gemm: twin(gemm), reps, flush)
        tflops = flops[gemm] / (us * 1e-6) / 1e12
        records.append(dict(shape=name, M=tokens, gemm=gemm, what="moe_gemm", median_us=round(us, 2),
                            tflops=round(tflops, 1), pct_peak=round(100 * tflops / peak, 1)))
        print(f"{name:8s} M={tokens:6d} {gemm:10s} moe_gemm              {us:9.1f} us {tflops:6.1f} TFLOP/s "
              f"({100 * tflops / peak:4.1f}%)")
        for tile, pingpong, coalesced in GLUON_TILES["down" if gemm == "down_dgrad" else gemm]:
            if tiles != "all" and pingpong != (tiles == "pingpong"):
                continue
            out = torch.empty_like(want)
            options = dict(config=tile, aligned_block_m=128, pingpong=pingpong, coalesced_store=coalesced)
            if gemm == "gate_up":
                def run(out: torch.Tensor = out, options: dict[str, Any] = options) -> torch.Tensor:
                    return gluon_gemm.ws_grouped_gemm(x, w13, out, *plan, rows_per_a=top_k, glu=True, **options)
            elif gemm == "down":
                def run(out: torch.Tensor = out, options: dict[str, Any] = options) -> torch.Tensor:
                    return gluon_gemm.ws_grouped_gemm(hidden_rows, w2, out, *plan, rows_per_a=1, topk_weights=weights,
                                                      **options)
            else:
                def run(out: torch.Tensor = out, options: dict[str, Any] = options) -> torch.Tensor:
                    return gluon_gemm.ws_grouped_gemm(grad_rows, w2, out, *plan, rows_per_a=1, weight_kn=True,
                                                      **options)
            label = (f"gluon {tile.block_m}x{tile.block_n}x{tile.block_k} s{tile.num_stages} w{tile.num_warps}"
                     + (" pp" if pingpong else "") + ("" if coalesced else " mma-st"))
            try:
                error = _rel(run(), want)
                us = time_graph(run, reps, flush)
            except Exception as failure:  # (a tile that does not fit this Triton: recorded, the others go on)
                print(f"{name:8s} M={tokens:6d} {gemm:10s} {label:31s} failed: {type(failure).__name__}: {failure}")
                records.append(dict(shape=name, M=tokens, gemm=gemm, what=label, error=str(failure)[:500]))
                continue
            tflops = flops[gemm] / (us * 1e-6) / 1e12
            records.append(dict(shape=name, M=tokens, gemm=gemm, what=label, median_us=round(us, 2),
                                tflops=round(tflops, 1), pct_peak=round(100 * tflops / peak, 1),
                                rel_error_vs_moe_gemm=error))
            print(f"{name:8s} M={tokens:6d} {gemm:10s} {label:31s} {us:9.1f} us {tflops:6.1f} TFLOP/s "
                  f"({100 * tflops / peak:4.1f}%), relative difference {error:.1e}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3,deepseek,gptoss")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiles", choices=("all", "plain", "pingpong"), default="all",
                        help="the Gluon tiles timed: all, those of one MMA partition, or the ping-pong ones")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if gluon_gemm.unavailable_reason() is not None:
        raise SystemExit(gluon_gemm.unavailable_reason())
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("the warp-specialised Gluon GEMM is for sm_90 (Hopper) GPUs")
    torch.manual_seed(0)
    peak, _ = measure_peak()
    device = torch.cuda.get_device_name()
    print(f"{device}: bf16 matmul {peak:.0f} TFLOP/s")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").random_(0, 7)
    records = [record for name in args.shapes.split(",") for tokens in map(int, args.tokens.split(","))
               for record in bench(name, tokens, peak, args.reps, flush, args.tiles)]
    result = dict(device=device, commit=args.commit or measured_commit(), date=datetime.date.today().isoformat(),
                  torch=torch.__version__, peak_tflops=round(peak, 1), records=records)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
