"""The HBM *read* bandwidth of the roofline (``bench_moe.py``): the fastest of a few streaming reads of a large buffer.

A torch reduction (``torch.sum`` of 1 GiB of bf16) was the only probe; on an H200 it read 4.20 TB/s while the MoE
GEMMs streamed their weights at up to 4.63 (DeepSeek-V3 decode: 101-106 % of the roofline). Two things closed the
gap (docs/notes/kernels-log.md, "The read bandwidth of the roofline"): a Triton kernel that only loads (16-byte
loads, XOR-accumulated per lane so that the loads stay) reads 4.49-4.52 TB/s of the same 1 GiB, and a larger buffer
amortises the launch and the tail: 4.60 TB/s over 4 GiB, 4.64-4.66 over 16 GiB (torch.sum: 4.31 / 4.32); on an
H100 3.03 over 1 GiB, 3.13 over 16 GiB (torch.sum over 1 GiB: 2.98). The roofline takes the fastest probe over up
to 16 GiB (half the free memory at most); a GEMM that streams as fast as the probe can still land a fraction of a
percent above 100 %.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

GIB = 1 << 30
# (programs, BLOCK, warps, UNROLL): the fastest probes over 16 GiB on an H100 and an H200 (int32 words)
PROBES = ((512, 2048, 4, 4), (1024, 1024, 4, 4), (1024, 2048, 4, 4), (512, 1024, 4, 1), (256, 1024, 8, 4))


@triton.jit
def xor_read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program ``p`` XORs its ``per_program`` words (a multiple of ``BLOCK * UNROLL``) lane by lane into ``out[p]``,
    ``UNROLL`` blocks per step (their loads issued together: more bytes in flight per thread)."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_program
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in range(0, per_program, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            acc ^= tl.load(base + offset + u * BLOCK + lanes)
    tl.store(out_ptr + pid * BLOCK + lanes, acc)


def xor_read(words: torch.Tensor, programs: int, block: int, warps: int = 8, unroll: int = 1,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[programs, block]``: the XOR of ``words`` (int32, its size a multiple of ``programs * block * unroll``) per
    program and lane."""
    if words.dtype != torch.int32 or words.numel() % (programs * block * unroll):
        raise ValueError(f"need int32 words, a multiple of {programs} x {block} x {unroll}, got {words.dtype} "
                         f"{words.numel()}")
    out = torch.empty((programs, block), dtype=torch.int32, device=words.device) if out is None else out
    xor_read_kernel[(programs,)](words, out, words.numel() // programs, BLOCK=block, UNROLL=unroll, num_warps=warps)
    return out


def probe_bytes(free_bytes: int, most: int = 16 * GIB) -> int:
    """The buffer the probes read: the largest power of two of at most ``most`` and half the free memory (at least
    64 MiB, so every probe's programs x blocks divide it)."""
    size = 64 << 20
    while size * 2 <= min(most, free_bytes // 2):
        size *= 2
    return size


def measure_read_bandwidth(time_us: Callable[[Callable[[], Any]], float]) -> float:
    """TB/s: the fastest read of :func:`probe_bytes` (``time_us``: the median time of a function, e.g. CUDA-graph
    replays) among ``torch.sum`` in fp32 over bf16 and the :func:`xor_read` probes."""
    size = probe_bytes(torch.cuda.mem_get_info()[0])
    src = torch.randn(size // 2, device="cuda", dtype=torch.bfloat16)
    total = torch.empty((), device="cuda", dtype=torch.float32)
    best = time_us(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=total))
    words = src.view(torch.int32)
    for programs, block, warps, unroll in PROBES:
        out = torch.empty((programs, block), dtype=torch.int32, device="cuda")
        best = min(best, time_us(lambda: xor_read(words, programs, block, warps, unroll, out)))
    return size / (best * 1e-6) / 1e12
