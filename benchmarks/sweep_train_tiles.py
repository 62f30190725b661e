"""Time the training step's four grouped GEMMs with candidate tiles (CUDA only).

    python benchmarks/sweep_train_tiles.py [--shapes mixtral,qwen3,deepseek,gptoss,sonicmoe] [--tokens 1024,4096,16384]
                                           [--gemms gate_up,down,down_dgrad,gate_up_dgrad] [--out FILE]

A training step launches four grouped GEMMs on the layer's aligned rows: the forward's gate/up product without its
activation (``x @ W13ᵀ``, kept for the backward), the forward's down product (``h @ W2ᵀ``), and the row gradients of
both (``d_out @ W2``, ``d_pre @ W13``: the weights read through their transposed view; the gate/up one's ``top_k``
copies per token summed after). Their tiles today are the tuned inference table's (the gate/up
entry widened, :meth:`GemmConfig.unfused_gate_up`; the row gradients the forward's, :func:`row_gradient_config`).
This script times each of those GEMMs alone, on random (never zero) bf16 data and a random routing aligned as the
table aligns it, with the layer's tile (``current``) and with candidate tiles (``moe_gemm`` and, where it serves the
launch, the warp-specialised Gluon kernel), as CUDA-graph replays taken in turns with the L2 flushed (medians); each
candidate's output is checked against the current one's. The percentages are of the same run's bf16 matmul peak
(8192³). Prints a table and writes JSON (device, commit, date, peak, records).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import warp_specialized  # noqa: E402
from moeforge.kernels.config import GemmConfig, fit_shared_memory, row_gradient_config  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmWeight,  # noqa: E402
                                                grouped_gemm)
from bench_moe import FLUSH_BYTES, SHAPES, measure_peak, time_graphs_interleaved  # noqa: E402
from provenance import write_results  # noqa: E402

ALL_SHAPES = {**SHAPES, "sonicmoe": (64, 4, 4096, 2048)}
SONICMOE_TOKENS = 32768  # SonicMoE's published configuration's batch (bench_train.py's)
GEMMS = ("gate_up", "down", "down_dgrad", "gate_up_dgrad")


def candidates(block_m: int) -> list[GemmConfig]:
    """The tiles tried for every GEMM on rows aligned by ``block_m`` (fitted to shared memory by the launcher)."""
    warps = 8 if block_m >= 128 else 4
    tiles = [GemmConfig(block_m, n, k, group_m=8, num_warps=warps, num_stages=s)
             for n, k, s in ((128, 64, 3), (128, 64, 4), (128, 64, 5), (128, 128, 3), (256, 64, 3), (256, 64, 4),
                             (256, 32, 6))]
    tiles += [attrs.evolve(tile, tma=tma) for tile in tiles[:2] + tiles[4:6] for tma in (True, False)]
    tiles += [GemmConfig(block_m, 128, 64, group_m=8, num_warps=warps, num_stages=4, warp_specialized=True),
              GemmConfig(block_m, 256, 64, group_m=8, num_warps=warps, num_stages=3, warp_specialized=True)]
    return list(dict.fromkeys(tiles))


def label(config: GemmConfig) -> str:
    return (f"{config.block_m}x{config.block_n}x{config.block_k} s{config.num_stages} w{config.num_warps}"
            + ("" if config.tma is None else f" tma={int(config.tma)}") + (" ws" if config.warp_specialized else ""))


def sweep(name: str, tokens: int, gemms: tuple[str, ...], peak: float, reps: int,
          flush: torch.Tensor) -> list[dict[str, Any]]:
    experts, top_k, hidden, inter = ALL_SHAPES[name]
    layer = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    w13 = (torch.randn_like(layer.w13_weight) * hidden ** -0.5).detach()
    w2 = (torch.randn_like(layer.w2_weight) * inter ** -0.5).detach()
    copies = tokens * top_k
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.topk(torch.randn(tokens, experts, device="cuda"), top_k, dim=-1).indices.to(torch.int32)
    table = layer.pipeline.stages[1].configs.lookup(tokens)
    block_m = table.block_m
    plan = torch.ops.moeforge.align_block_size(ids, experts, block_m, False)
    route = GemmRoute(*plan, copies, aligned_block_m=block_m)
    h = torch.randn(copies, inter, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn(copies, hidden, device="cuda", dtype=torch.bfloat16)
    d_pre = torch.randn(copies, 2 * inter, device="cuda", dtype=torch.bfloat16)
    gate_up = table.gate_up_unfused
    current = {"gate_up": gate_up, "down": table.down,
               "down_dgrad": row_gradient_config(table.down, inter, hidden),
               "gate_up_dgrad": row_gradient_config(gate_up, hidden, 2 * inter)}
    problems: dict[str, tuple[GemmRows, GemmWeight, GemmEpilogue]] = {
        "gate_up": (GemmRows(x, rows_per_a=top_k), GemmWeight(w13), GemmEpilogue(torch.bfloat16)),
        "down": (GemmRows(h), GemmWeight(w2), GemmEpilogue(torch.bfloat16)),
        "down_dgrad": (GemmRows(d_out), GemmWeight(w2.transpose(1, 2)), GemmEpilogue(torch.bfloat16)),
        "gate_up_dgrad": (GemmRows(d_pre), GemmWeight(w13.transpose(1, 2)), GemmEpilogue(torch.bfloat16)),
    }
    flops = {gemm: 2 * copies * hidden * inter * (2 if gemm.startswith("gate_up") else 1) for gemm in GEMMS}
    records: list[dict[str, Any]] = []
    for gemm in gemms:
        rows, weight, epilogue = problems[gemm]

        def run(config: GemmConfig, rows: GemmRows = rows, weight: GemmWeight = weight,
                epilogue: GemmEpilogue = epilogue) -> torch.Tensor:
            return grouped_gemm(rows, weight, route, epilogue, config)[0]

        want = run(current[gemm])
        fns: dict[str, Callable[[], Any]] = {"current " + label(current[gemm]): lambda c=current[gemm]: run(c)}
        for config in candidates(block_m):
            if config.warp_specialized and warp_specialized.problem(
                    rows.data, weight.data, quantized=False, weight_format=WeightFormat.FLOAT, bias=False, act=0,
                    glu=False, interleaved=False, out_dtype=epilogue.out_dtype, fp8_out=False, update=None,
                    config=config, aligned_block_m=block_m) is not None:
                continue
            fitted = fit_shared_memory(config, 2, 1)
            try:
                got = run(fitted)
                error = float((got.float() - want.float()).norm() / want.float().norm())
                del got
            except Exception as failure:  # (a tile this Triton cannot build: said, the others go on)
                print(f"{name:8s} M={tokens:6d} {gemm:13s} {label(fitted):28s} failed: {type(failure).__name__}")
                continue
            if error > 1e-2:
                print(f"{name:8s} M={tokens:6d} {gemm:13s} {label(fitted):28s} wrong: relative error {error:.1e}")
                continue
            fns.setdefault(label(fitted), lambda c=fitted: run(c))
        del want
        times = time_graphs_interleaved(fns, reps, flush)
        base = next(us for what, us in times.items() if what.startswith("current"))
        for what, us in sorted(times.items(), key=lambda item: item[1]):
            tflops = flops[gemm] / (us * 1e-6) / 1e12
            records.append(dict(shape=name, M=tokens, gemm=gemm, tile=what, median_us=round(us, 2),
                                tflops=round(tflops, 1), pct_peak=round(100 * tflops / peak, 1),
                                over_current=round(us / base, 3)))
            print(f"{name:8s} M={tokens:6d} {gemm:13s} {what:36s} {us:9.1f} us {tflops:6.1f} TFLOP/s "
                  f"({100 * tflops / peak:4.1f}%) {us / base:5.3f}x", flush=True)
        torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3,deepseek,gptoss,sonicmoe")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gemms = tuple(args.gemms.split(","))
    if unknown := set(gemms) - set(GEMMS):
        raise SystemExit(f"unknown GEMMs {sorted(unknown)}: choose from {GEMMS}")
    torch.manual_seed(0)
    peak, _ = measure_peak()
    device = torch.cuda.get_device_name()
    print(f"{device}: bf16 matmul {peak:.0f} TFLOP/s")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").random_(0, 7)
    records = [record for name in args.shapes.split(",")
               for tokens in ((SONICMOE_TOKENS,) if name == "sonicmoe" else map(int, args.tokens.split(",")))
               for record in sweep(name, tokens, gemms, peak, args.reps, flush)]
    write_results("sweep_train_tiles", device, records, args.out, args.commit, peak_tflops=round(peak, 1))


if __name__ == "__main__":
    main()
