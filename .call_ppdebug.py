"""Bisect the ping-pong fault: one launch per process (a fault poisons the context)."""
import json, sys, torch
from moeforge.kernels import align
from moeforge.kernels import gluon_grouped_gemm as g
from moeforge.kernels.config import GemmConfig
opts = json.loads(sys.argv[1])
torch.manual_seed(0)
T, E, k, H, N = opts.get("T", 300), 8, 2, opts.get("H", 512), 384
glu = opts.get("glu", False)
x = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16)
w = torch.randn(E, 2 * N if glu else N, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
route = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to("cuda", torch.int32)
plan = align.align_block_size(route, E, 128)
out = torch.full((T * k, N), float("nan"), dtype=torch.bfloat16, device="cuda")
cfg = GemmConfig(opts.get("bm", 64), 128, 64, num_warps=4, num_stages=opts.get("stages", 4))
g.ws_grouped_gemm(x, w, out, *plan, rows_per_a=1, config=cfg, glu=glu, aligned_block_m=128,
                  pingpong=opts.get("pp", True), coalesced_store=opts.get("coalesced", True),
                  programs=opts.get("programs"))
torch.cuda.synchronize()
flat = route.reshape(-1).long()
pre = torch.einsum("ch,cnh->cn", x.double(), w.double()[flat])
if glu:
    gate, up = pre.chunk(2, -1); pre = torch.nn.functional.silu(gate) * up
print("ok", "nan rows", int(out.isnan().any(-1).sum()), "rel", float((out.double() - pre).norm() / pre.norm()))
