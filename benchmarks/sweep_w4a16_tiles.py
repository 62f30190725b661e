"""Sweep launch configurations of the W4A16 gate/up GEMM (group 128, zero points) on DeepSeek-V3 shapes (CUDA only).

    python benchmarks/sweep_w4a16_tiles.py

Prints one line per configuration (median of CUDA-event-timed runs after warm-up, random data); the
defaults in moeforge.stages.triton_quant.default_quant_config were chosen from its output on an H100
(2026-11-21). A development tool: it writes no JSON.
"""
import sys, itertools, torch, statistics
sys.path.insert(0, ".")
from moeforge.kernels import align, moe_gemm
from moeforge.kernels.formats import WeightFormat
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.activations import ACT_SILU

def timeit(fn, reps=8):
    for _ in range(2): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

E, K_, H, I, G = 256, 8, 7168, 2048, 128
q = torch.randint(0, 255, (E, 2 * I, H // 2), device="cuda", dtype=torch.uint8)
sc = (torch.rand(E, 2 * I, H // G, device="cuda") * 0.01).to(torch.bfloat16)
z = torch.randint(0, 15, (E, 2 * I, H // G), device="cuda", dtype=torch.uint8)
for M in (8, 256, 4096):
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(M, E, device="cuda").topk(K_, dim=-1).indices.to(torch.int32)
    flops = 2 * M * K_ * 2 * I * H
    out = torch.empty(M * K_, I, device="cuda", dtype=torch.bfloat16)
    bms = (16,) if M == 8 else (16, 32, 64) if M == 256 else (64, 128)
    for bm in bms:
        sid, bexp, npad = align.align_block_size(ids, E, bm)
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
            cfg = GemmConfig(bm, bn, bk, 8, warps, stages)
            try:
                us = timeit(lambda: moe_gemm.moe_gemm(x, q, out, sid, bexp, npad, weight_format=WeightFormat.INT4,
                                                      weight_scale=sc, weight_zero=z, rows_per_a=K_, config=cfg,
                                                      act=ACT_SILU, glu=True))
                print(f"M={M} bm={bm} bn={bn} bk={bk} w={warps} s={stages} {us:9.1f} us {flops/us/1e6:7.1f} TFLOP/s", flush=True)
            except Exception as err:
                print(f"M={M} {cfg} failed: {type(err).__name__}: {str(err)[:80]}", flush=True)
