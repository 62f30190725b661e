"""The HBM *read* bandwidth of the roofline (``bench_moe.py``): the fastest of a few streaming reads.

A torch reduction (``torch.sum`` of 1 GiB of bf16) was the only probe; on an H200 it reads at 4.20 TB/s while the
MoE GEMMs stream their weights at up to 4.4, which put bf16 decode cells at 104-106 % of the roofline. A Triton
kernel that only loads (16-byte loads, XOR-accumulated per lane so the loads stay) reads at 4.49 TB/s there and
3.04 on an H100 against torch's 2.98 (``results/read_bandwidth_probes-...log``); the roofline takes the fastest.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

GIB = 1 << 30
# (programs, BLOCK, warps): the fastest probes on an H100 and an H200 (1 GiB, int32 words)
PROBES = ((256, 2048, 8), (512, 1024, 8), (512, 2048, 8), (1024, 1024, 8))


@triton.jit
def xor_read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """Program ``p`` XORs its ``per_program`` words (a multiple of ``BLOCK``) lane by lane into ``out[p]``."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in range(0, per_program, BLOCK):
        acc ^= tl.load(base + offset + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def xor_read(words: torch.Tensor, programs: int, block: int, warps: int = 8,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[programs, block]``: the XOR of ``words`` (int32, its size a multiple of ``programs * block``) per program
    and lane."""
    if words.dtype != torch.int32 or words.numel() % (programs * block):
        raise ValueError(f"need int32 words, a multiple of {programs} x {block}, got {words.dtype} {words.numel()}")
    out = torch.empty((programs, block), dtype=torch.int32, device=words.device) if out is None else out
    xor_read_kernel[(programs,)](words, out, words.numel() // programs, BLOCK=block, num_warps=warps)
    return out


def measure_read_bandwidth(time_us: Callable[[Callable[[], Any]], float]) -> float:
    """TB/s: the fastest read of 1 GiB (``time_us``: the median time of a function, e.g. CUDA-graph replays) among
    ``torch.sum`` in fp32 over bf16 and the :func:`xor_read` probes."""
    src = torch.randn(GIB // 2, device="cuda", dtype=torch.bfloat16)
    total = torch.empty((), device="cuda", dtype=torch.float32)
    best = time_us(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=total))
    words = src.view(torch.int32)
    for programs, block, warps in PROBES:
        out = torch.empty((programs, block), dtype=torch.int32, device="cuda")
        best = min(best, time_us(lambda: xor_read(words, programs, block, warps, out)))
    return GIB / (best * 1e-6) / 1e12
