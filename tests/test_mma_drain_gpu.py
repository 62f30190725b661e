"""The race the two old fences hid, on the shapes where it showed (GPU, Hopper).

With Triton before 3.9, a warpgroup MMA that takes its left operand from registers (the decoded 4-bit weight tile
of the swapped product; decoded NVFP4 rows) may still be reading them when the next K-step's decoding writes them
(ptxas reuses the registers; ``launch_plan.drain_mma``): the output is wrong on some grids and tiles, right on others.
The launcher makes each K-step wait for its MMAs there. These tests compare every element against a product whose
MMA reads both operands from shared memory, on the two configurations that were wrong every time without the wait
(an H200 at a7432f3: Mixtral's shuffled MXFP4 down GEMM on 128-row tiles, one program per tile; NVFP4 rows against
bf16 weights with half tiles, one program per tile). With the wait switched off (``drain_mma`` patched to ``False``)
both fail on Triton 3.6.
"""

from __future__ import annotations

import pytest
import torch

from moeforge.kernels import align, shuffle
from moeforge.kernels import moe_gemm as mg
from moeforge.kernels.activations import ACT_SILU
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.formats import WeightFormat
from moeforge.quant.fp4 import dequantize_nvfp4, quantize_nvfp4

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the register-operand wgmma is Hopper's")


def _bad(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements that are not finite or differ from ``ref`` beyond the two roundings' reach."""
    o, r = out.float(), ref.float()
    bound = 0.02 * r.abs() + 0.02 * r.pow(2).mean().sqrt()
    return int(((~torch.isfinite(o)) | ((o - r).abs() > bound)).sum())


def test_the_swapped_product_of_a_shuffled_weight_on_one_program_per_tile() -> None:
    """Mixtral's down GEMM (E=8, K=14336, N=4096), MXFP4 weights shuffled, 128x128x64 tiles on 8 warps, 256 tokens
    of top-2, one program per tile: against the plain weight's unswapped product."""
    experts, hidden, inter, top_k, tokens = 8, 4096, 14336, 2, 256
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    plain = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.randint(119, 125, (experts, hidden, inter // 32), dtype=torch.uint8, device=device, generator=gen)
    shuffled = shuffle.shuffle(plain, e2m1=True)
    config = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=False)
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)])
    plan = align.align_block_size(ids.to(torch.int32), experts, config.block_m)
    rows = torch.randn(tokens * top_k, inter, device=device, dtype=torch.bfloat16, generator=gen)
    common = dict(rows_per_a=1, glu=False, weight_scale=scale, weight_format=WeightFormat.MXFP4, weight_scale_max=128)
    ref = torch.empty(tokens * top_k, hidden, device=device, dtype=torch.bfloat16)
    mg.moe_gemm(rows, plain, ref, *plan, config=config, swap=False, tma=False, grid="tiles", **common)
    for _ in range(3):
        out = torch.full_like(ref, float("nan"))
        mg.moe_gemm(rows, shuffled, out, *plan, config=config, swap=True, weight_shuffled=True, tma=False,
                    grid="tiles", **common)
        assert _bad(out, ref) == 0


def test_nvfp4_rows_with_half_tiles_on_one_program_per_tile() -> None:
    """GPT-OSS-like gate/up (E=32, top-4, H=2880), NVFP4 rows against bf16 weights, 64x128x64 tiles with half
    tiles, 1024 tokens, one program per tile: against the decoded rows' product."""
    experts, hidden, top_k, tokens = 32, 2880, 4, 1024
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)])
    config = GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3)
    plan = align.align_block_size(ids.to(torch.int32), experts, config.block_m)
    weight = (torch.randn(experts, 2 * hidden, hidden, device=device, generator=gen) * hidden ** -0.5
              ).to(torch.bfloat16)
    a_global = 2.0 ** -9
    q = quantize_nvfp4(torch.randn(tokens, hidden, device=device, generator=gen), a_global)
    decoded = dequantize_nvfp4(q.data, q.scale, a_global, torch.bfloat16)
    common = dict(rows_per_a=top_k, glu=True, act=ACT_SILU)
    ref = torch.empty(tokens * top_k, hidden, device=device, dtype=torch.bfloat16)
    mg.moe_gemm(decoded, weight, ref, *plan, config=config, grid="tiles", **common)
    for _ in range(3):
        out = torch.full_like(ref, float("nan"))
        mg.moe_gemm(q.data, weight, out, *plan, config=config, grid="tiles", half_tail=True, a_scale=q.scale,
                    a_global=a_global, **common)
        assert _bad(out, ref) == 0
