"""Benchmark the experts' weight gradient alone (``moeforge/kernels/weight_grad.py``): the default launch against the
warp-specialised Gluon kernel and other tiles, CUDA only.

    python benchmarks/bench_weight_grad.py [--shapes mixtral,qwen3,gptoss,deepseek] [--tokens 1024,4096,16384]

For each shape and token count M, the training step's two weight gradients — gate/up (``d_pre [copies, 2I]`` by the
token rows ``[M, H]``, each read ``top_k`` times) and down (``dy [copies, H]`` by the activated rows
``[copies, I]``) — on random bf16 data routed by a random top-k and aligned as a training forward aligns (blocks of
128): each launch's time (its gather passes included; the median of CUDA-graph replays taken in turns with the other
launches', L2 flushed), its TFLOP/s against the bf16 matmul peak measured in the same run, the rate it writes dW at
(bf16 ``[E, N, K]`` over its time: what bounds the short reductions of many experts), its speed-up on the default,
and whether its gradient is bitwise the default launch's. "default again" is the default launch timed as another:
how far apart the same launch measures in this run. Prints a table and writes JSON (device, commit, date).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import FLUSH_BYTES, SHAPES, measure_peak, time_graphs_interleaved  # noqa: E402
from provenance import write_results  # noqa: E402

from moeforge.kernels import align  # noqa: E402
from moeforge.kernels.weight_grad import WeightGradTiles, expert_weight_grad, weight_grad_tiles  # noqa: E402


def candidates(default: WeightGradTiles, n: int, k: int) -> dict[str, WeightGradTiles]:
    """The launches compared with the default: the Gluon kernel (ping-pong 128 x 128 tiles, on rows gathered first,
    and with its tiles stored by TMA; one partition with the default's tiles), and the Triton kernel with the other
    family of tiles."""
    wide = (128, 256) if k >= n else (256, 128)
    pingpong = WeightGradTiles(128, 128, default.block_m, 4, 4, True, warp_specialized=True, pingpong=True)
    one = attrs.evolve(default, warp_specialized=True, num_stages=max(default.num_stages, 3))
    found = {"default": default, "default again": default, "gluon ping-pong 128x128": pingpong,
             "gluon ping-pong, stored by TMA": attrs.evolve(pingpong, tma_store=True),
             "gluon one partition": one}
    other = (WeightGradTiles(128, 128, default.block_m, 4, 2, True, tma_store=True) if default.block_n != 128
             or default.block_k != 128 else WeightGradTiles(*wide, default.block_m, 8, 3, True))
    found["triton 128x128" if other.block_n == other.block_k else "triton wide"] = other
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3,gptoss,deepseek")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_weight_grad.py needs a CUDA device")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    peak, _ = measure_peak()
    device = torch.cuda.get_device_name()
    print(f"{device}: bf16 matmul {peak:.0f} TFLOP/s")
    records: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = SHAPES[name]
        for tokens in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(0)
            ids = torch.randn(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices
            plan = align.align_block_size(ids.to(torch.int32), experts, 128)
            copies = tokens * top_k
            operands = {
                "gate/up": (torch.randn(copies, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen),
                            torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen), top_k),
                "down": (torch.randn(copies, hidden, device="cuda", dtype=torch.bfloat16, generator=gen),
                         torch.randn(copies, inter, device="cuda", dtype=torch.bfloat16, generator=gen), 1),
            }
            for gemm, (d_rows, rows, per_row) in operands.items():
                n, k = d_rows.shape[1], rows.shape[1]
                default = weight_grad_tiles(n, k, torch.bfloat16, 128, d_rows.device, copies / experts)
                flops = 2 * copies * n * k
                dw_bytes = experts * n * k * 2  # (bf16 dW: what a short reduction's time is bound by writing)
                launches = candidates(default, n, k)
                steps = {label: functools.partial(expert_weight_grad, d_rows, rows, per_row, *plan, experts, 128,
                                                  False, torch.bfloat16, tiles=tiles)
                         for label, tiles in launches.items()}
                want = steps["default"]()[0]
                same = {label: label == "default" or bool(torch.equal(step()[0], want))
                        for label, step in steps.items()}
                del want
                times = time_graphs_interleaved(steps, args.reps, flush)
                for label, tiles in launches.items():
                    us = times[label]
                    tflops = flops / (us * 1e-6) / 1e12
                    records.append(dict(shape=name, M=tokens, gemm=gemm, launch=label, tiles=attrs.asdict(tiles),
                                        median_us=round(us, 1), tflops=round(tflops, 1),
                                        pct_peak=round(100 * tflops / peak, 1),
                                        dw_write_tb_s=round(dw_bytes / (us * 1e-6) / 1e12, 2),
                                        bitwise_default=same[label], vs_default=round(times["default"] / us, 3)))
                    print(f"{name:9s} M={tokens:6d} {gemm:8s} {label:30s} {us:9.1f} us {tflops:6.1f} TFLOP/s "
                          f"dW {dw_bytes / (us * 1e-6) / 1e12:4.2f} TB/s "
                          f"{times['default'] / us:5.2f}x{'' if same[label] else ' BITS DIFFER'}", flush=True)
                torch.cuda.empty_cache()
    write_results("bench_weight_grad", device, records, args.out, args.commit, peak_tflops=round(peak, 1))


if __name__ == "__main__":
    main()
