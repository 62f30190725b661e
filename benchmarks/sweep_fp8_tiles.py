"""Sweep launch configurations of the FP8 W8A8 gate/up GEMM (block/group and token/channel scales) on DeepSeek-V3 shapes (CUDA only).

    python benchmarks/sweep_fp8_tiles.py

Prints one line per configuration (median of CUDA-event-timed runs after warm-up, random data); the
defaults in moeforge.stages.triton_quant.default_quant_config were chosen from its output on an H100
(2026-11-21). A development tool: it writes no JSON.
"""
import sys, itertools, torch
sys.path.insert(0, ".")
from moeforge.kernels import align, moe_gemm
from moeforge.kernels.formats import WeightFormat
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.activations import ACT_SILU
import statistics

def timeit(fn, reps=10):
    for _ in range(2): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

E, K_, H, I = 256, 8, 7168, 2048
w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.05).to(torch.float8_e4m3fn)
s13b = torch.rand(E, 2 * I // 128, H // 128, device="cuda") + 0.5
s13c = torch.rand(E, 2 * I, device="cuda") + 0.5
for M in (256, 4096):
    x = torch.randn(M, H, device="cuda").to(torch.float8_e4m3fn)
    xs_g = torch.rand(M, H // 128, device="cuda") + 0.5
    xs_t = torch.rand(M, 1, device="cuda") + 0.5
    ids = torch.rand(M, E, device="cuda").topk(K_, dim=-1).indices.to(torch.int32)
    flops = 2 * M * K_ * 2 * I * H
    for bm in (64, 128):
        sid, bexp, npad = align.align_block_size(ids, E, bm)
        out = torch.empty(M * K_, I, device="cuda", dtype=torch.bfloat16)
        for bn, warps, stages in itertools.product((64, 128), (4, 8), (3, 4)):
            cfg = GemmConfig(bm, bn, 128, 8, warps, stages)
            for name, xs, ws in (("group/block", xs_g, s13b), ("token/channel", xs_t, s13c)):
                try:
                    us = timeit(lambda: moe_gemm.moe_gemm(x, w13, out, sid, bexp, npad, weight_format=WeightFormat.FP8, a_scale=xs, weight_scale=ws, rows_per_a=K_,
                                                                 config=cfg, act=ACT_SILU, glu=True))
                    print(f"M={M} bm={bm} bn={bn} w={warps} s={stages} {name:14s} {us:9.1f} us {flops/us/1e6:7.1f} TFLOP/s", flush=True)
                except Exception as err:
                    print(f"M={M} {cfg} {name} failed: {type(err).__name__}: {str(err)[:100]}", flush=True)
