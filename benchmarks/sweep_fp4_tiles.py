"""Sweep launch configurations of the 4-bit grouped GEMMs (MXFP4, NVFP4, INT4) on the GPT-OSS-120B
shape (E=128, k=4, H=I=2880), CUDA only.

    python benchmarks/sweep_fp4_tiles.py [--formats mxfp4,nvfp4,int4] [--tokens 1,64,1024]

Prints one line per (format, M, GEMM, configuration): the median of CUDA-graph replays with the L2
flushed (``bench_moe.time_graph``) on random data, and the fraction of the HBM read bandwidth the
weights' bytes would need. The committed log (2026-11-24) was timed with CUDA events around eager launches
instead, whose launch overhead swamps the M = 1 cells; the 4-bit defaults of
``moeforge.stages.triton_quant.default_quant_config`` come from its M = 64 / 1024 cells and from
``bench_moe.py``. A development tool: it writes no JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import FLUSH_BYTES, time_graph  # noqa: E402

from moeforge.kernels import align, moe_gemm  # noqa: E402
from moeforge.kernels.activations import ACT_GPT_OSS  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402

SHAPES = {"gptoss": (128, 4, 2880, 2880), "mixtral": (8, 2, 4096, 14336)}  # (E, top_k, H, I)
E, TOP_K, H, I = SHAPES["gptoss"]


def weight(fmt: str, n: int, k: int) -> dict[str, Any]:
    packed = torch.randint(0, 256, (E, n, k // 2), device="cuda", dtype=torch.uint8)
    if fmt == "mxfp4":
        scale = torch.randint(118, 124, (E, n, k // 32), device="cuda", dtype=torch.uint8)
        return dict(weight=packed, weight_format=WeightFormat.MXFP4, weight_scale=scale)
    if fmt == "nvfp4":
        scale = (torch.rand(E, n, k // 16, device="cuda") + 0.5).to(torch.float8_e4m3fn)
        return dict(weight=packed, weight_format=WeightFormat.NVFP4, weight_scale=scale,
                    weight_global=torch.full((E,), 1e-2, device="cuda"))
    scale = (torch.rand(E, n, k // 32, device="cuda") * 0.01).to(torch.bfloat16)
    return dict(weight=packed, weight_format=WeightFormat.INT4, weight_scale=scale)


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="mxfp4")
    parser.add_argument("--tokens", default="1,64,1024")
    parser.add_argument("--roles", default="gate_up,down")
    parser.add_argument("--shape", default="gptoss", choices=sorted(SHAPES))
    parser.add_argument("--block-m", default="", help="row blocks to try (default: 16, or 16,32,64 past 4 rows "
                        "per expert)")
    parser.add_argument("--block-n", default="16,32,64,128")
    parser.add_argument("--block-k", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--swap", default="0,1")
    args = parser.parse_args()
    global E, TOP_K, H, I
    E, TOP_K, H, I = SHAPES[args.shape]
    read_bw = 2.95e12  # bytes/s, the H100 read bandwidth bench_moe.py measures
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for fmt in args.formats.split(","):
        operands = {"gate_up": weight(fmt, 2 * I, H), "down": weight(fmt, H, I)}
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(tokens, E, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
            used = int(torch.unique(ids).numel())
            rows_per_expert = tokens * TOP_K / E
            block_ms = (16,) if rows_per_expert <= 4 else (16, 32, 64)
            if args.block_m:
                block_ms = tuple(int(b) for b in args.block_m.split(","))
            for role in args.roles.split(","):
                op = operands[role]
                glu = role == "gate_up"
                n_out = I if glu else H
                a = x if glu else torch.randn(tokens * TOP_K, I, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(tokens * TOP_K, n_out, device="cuda", dtype=torch.bfloat16)
                bytes_used = used * op["weight"][0].numel() * (1 + (1 / 16 if fmt == "mxfp4" else 1 / 8))
                for bm in block_ms:
                    plan = align.align_block_size(ids, E, bm)
                    for bn, swap, bk, warps, stages in itertools.product(
                            ints(args.block_n), (bool(s) for s in ints(args.swap)), ints(args.block_k),
                            ints(args.warps), (3,)):
                        config = GemmConfig(bm, bn, bk, 8 if bm >= 32 else 1, warps, stages)
                        try:
                            us = time_graph(lambda: moe_gemm.moe_gemm(
                                a, out=out, sorted_ids=plan[0], block_expert=plan[1], num_padded=plan[2],
                                rows_per_a=TOP_K if glu else 1, config=config, act=ACT_GPT_OSS if glu else 0,
                                glu=glu, interleaved=True, swap=swap, **op), 10, flush)
                        except Exception as error:  # e.g. out of shared memory or registers
                            print(f"{args.shape} {fmt} M={tokens} {role} {config} failed: {type(error).__name__}", flush=True)
                            continue
                        print(f"{args.shape} {fmt} M={tokens:5d} {role:7s} bm={bm:3d} bn={bn:3d} bk={bk:3d} w={warps} s={stages} "
                              f"swap={int(swap)} "
                              f"{us:9.1f} us  {100 * bytes_used / read_bw / (us * 1e-6):5.1f}% of read bw", flush=True)


if __name__ == "__main__":
    main()
