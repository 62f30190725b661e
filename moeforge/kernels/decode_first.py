# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""4-bit weights decoded once into the compute dtype, for the float GEMM to read (``GemmConfig.decode_chunk``).

The grouped GEMM decodes a 4-bit weight tile in registers in every program that reads it: once per row block
of the expert. With few rows per expert that is once or twice per weight, and reading 4-bit weights instead of
16-bit ones is the whole gain. With many rows per expert (a prefill batch) every weight is decoded by many
programs, and the decoding's integer work sits in the K-loop next to the MMAs that bound it (docs/kernels.md,
"Decoding first"). Decoding a chunk of experts' weights once into a scratch in the compute dtype, then running the
float GEMM on it over those experts' row blocks, costs one pass over the weights (read 4-bit, write 16-bit)
and leaves the K-loop the float one.

:func:`decode_weights` writes the values the GEMM's in-register decoding computes (the same
:func:`moeforge.kernels.dequant.weight_tile`, bitwise: an e2m1 value times its E8M0 or e4m3 scale is exact
in bf16 and fp16, an INT4 ``(q - z) * s`` is rounded once either way); NVFP4's per-expert global scale stays
out of them (the GEMM's epilogue applies it, as for the packed weight). :func:`block_ranges` finds each
chunk's row blocks on the device (no host synchronisation: CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.format_codes import W_FIRST_E2M1

from moeforge.kernels import shuffle
from moeforge.kernels.bound_launch import FIXED_OPTIONS
from moeforge.kernels.dequant import group_scales, packed_decoding, weight_tile
from moeforge.kernels.formats import WeightFormat, weight_operand
from moeforge.kernels.sizes import cdiv

# The decoding's tile: [DECODE_BLOCK_N, DECODE_BLOCK_K] weights per program (32 rows of 1 KiB out in bf16), the
# programs along K first (neighbouring programs read and write neighbouring bytes of the same rows). Scale groups are
# powers of two, so a step holds whole groups or lies in one. The fastest tile of a sweep (docs/notes/kernels-log.md,
# "Decoding the weights first").
DECODE_BLOCK_N = 32
DECODE_BLOCK_K = 512
DECODE_WARPS = 8


@triton.jit
def decode_weight_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, K,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
    stride_oe, stride_on, stride_ok,
    B_FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, PTX: tl.constexpr, FP8_CVT: tl.constexpr,
    SHUFFLED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program ``(k, n, e)``: the ``[BLOCK_N, BLOCK_K]`` tile of expert ``e``'s weight ``[N, K]`` (packed
    ``[N, K / 2]`` bytes, ``SHUFFLED``: in the pre-shuffled layout, 2 with paired gate/up rows, with their scales
    ``[N, K / GROUP]``, zero points alike) decoded to ``out``'s dtype (in K order, rows interleaved)."""
    k = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_rows = offs_n
    if SHUFFLED == 2:  # paired gate/up rows (see kernels/shuffle.py): decoded back into their interleaved rows
        out_rows = (offs_n // 32) * 32 + (offs_n % 16) * 2 + (offs_n % 32) // 16
    if SHUFFLED and B_FMT >= W_FIRST_E2M1:  # a shuffled e2m1 weight: its 32-bit words (contiguous bytes, see kernels/shuffle.py)
        offs_kw = k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        rows = (w_ptr + expert * stride_we + offs_n[:, None] * stride_wn).to(tl.pointer_type(tl.int32))
        packed = tl.load(rows + offs_kw[None, :], mask=n_ok[:, None] & (offs_kw < K // 8)[None, :], other=0)
    else:
        offs_kb = k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_kb[None, :] * stride_wk,
                         mask=n_ok[:, None] & (offs_kb < K // 2)[None, :], other=0)
    s = group_scales(s_ptr + expert * stride_se + offs_n * stride_sn, n_ok, k, K, stride_sg, GROUP, BLOCK_K)
    z = s
    if HAS_ZEROS:
        z = group_scales(z_ptr + expert * stride_ze + offs_n * stride_zn, n_ok, k, K, stride_zg, GROUP, BLOCK_K)
    w = weight_tile(packed, s, z, out_ptr.dtype.element_ty, B_FMT, GROUP, HAS_ZEROS, PTX, FP8_CVT, FP8_CVT, False,
                    BLOCK_N, BLOCK_K, SHUFFLED)
    offs_k = k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + expert * stride_oe + out_rows[:, None] * stride_on + offs_k[None, :] * stride_ok, w,
             mask=n_ok[:, None] & (offs_k < K)[None, :])


def decode_weights(weight: torch.Tensor, weight_format: WeightFormat, weight_scale: torch.Tensor,
                   weight_zero: Optional[torch.Tensor] = None, *, out: torch.Tensor,
                   ptx: Optional[bool] = None, shuffled: bool = False, paired_rows: bool = False) -> torch.Tensor:
    """Decode the 4-bit ``weight [E, N, K / 2]`` (INT4 with ``weight_scale`` and optional ``weight_zero``, MXFP4,
    NVFP4 without its global scale) into ``out [E, N, K]`` (bf16 / fp16, or fp32; INT4 scales in ``out``'s dtype)
    and return it. ``ptx``: the packed inline-PTX decoding (NVIDIA, bf16 / fp16; MXFP4 bf16 only), by default
    wherever it applies; the values are the same either way. ``shuffled``: ``weight`` is in the pre-shuffled layout
    (:mod:`moeforge.kernels.shuffle`; ``paired_rows``: shuffled paired, scales and zero points paired too); ``out``
    is in K order either way, its rows interleaved for paired ones."""
    weight_format = WeightFormat(weight_format)
    if not weight_format.packed:
        raise ValueError(f"decode_weights decodes 4-bit weights (INT4, MXFP4, NVFP4), got {weight_format.name}")
    operand = weight_operand(weight_format, weight, weight_scale, weight_zero, None, rows_dtype=out.dtype,
                             global_required=False)
    experts, n_w = weight.shape[0], weight.shape[1]
    if tuple(out.shape) != (experts, n_w, operand.k_dim) or out.dtype not in (torch.bfloat16, torch.float16,
                                                                             torch.float32):
        raise ValueError(f"out must be bf16/fp16/fp32 [{experts}, {n_w}, {operand.k_dim}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    can_ptx = packed_decoding(weight.device, out.dtype, weight_format)
    if ptx and not can_ptx:
        raise ValueError(f"the packed 4-bit decoding runs on NVIDIA GPUs in bf16/fp16 (MXFP4 in bf16), got "
                         f"{weight.device.type} {out.dtype} {weight_format.name}")
    use_ptx = can_ptx if ptx is None else ptx
    if paired_rows and not shuffled:
        raise ValueError("paired_rows is a layout of shuffled weights (shuffled=True)")
    if shuffled:
        shuffle.check_shape(weight, paired=paired_rows)
        if weight_format.e2m1:
            shuffle.check_words(weight, weight_format.name)
    if out.numel() == 0:
        return out
    if weight_scale.dtype == torch.float8_e4m3fn:
        weight_scale = weight_scale.view(torch.uint8)
    capability = torch.cuda.get_device_capability(weight.device) if weight.device.type == "cuda" else None
    zeros = weight_zero if weight_zero is not None else weight_scale
    grid = (cdiv(operand.k_dim, DECODE_BLOCK_K), cdiv(n_w, DECODE_BLOCK_N), experts)
    decode_weight_kernel[grid](
        weight, weight_scale, zeros, out, n_w, operand.k_dim,
        *weight.stride(), *operand.scale_strides, *(operand.zero_strides if weight_zero is not None else (0, 0, 0)),
        *out.stride(),
        B_FMT=int(weight_format), GROUP=operand.group, HAS_ZEROS=weight_zero is not None, PTX=use_ptx,
        FP8_CVT=use_ptx and weight_format is WeightFormat.NVFP4 and capability is not None and capability >= (8, 9),
        SHUFFLED=(2 if paired_rows else 1) if shuffled else 0, BLOCK_N=DECODE_BLOCK_N, BLOCK_K=DECODE_BLOCK_K,
        num_warps=DECODE_WARPS, **FIXED_OPTIONS,
    )
    return out


def block_ranges(block_expert: torch.Tensor, num_padded: torch.Tensor, aligned_block_m: int, chunk: int,
                 num_experts: int) -> torch.Tensor:
    """``[ceil(num_experts / chunk) + 1]`` int32 on the device: entry ``i`` is the first aligned row block whose
    expert is at least ``min(i * chunk, num_experts)``, so the blocks of chunk ``i`` (experts ``i * chunk`` ..
    ``(i + 1) * chunk - 1``) are ``out[i] .. out[i + 1] - 1`` (the rows are sorted by expert). Only the blocks that
    exist (``num_padded / aligned_block_m``) count. Device work only (CUDA-graph capturable)."""
    device = block_expert.device
    blocks = torch.arange(block_expert.numel(), device=device)
    exists = blocks < num_padded.to(blocks.dtype) // aligned_block_m
    chunks = -(-num_experts // chunk)
    limits = (torch.arange(chunks + 1, device=device) * chunk).clamp_(max=num_experts)
    return ((block_expert[None, :].to(limits.dtype) < limits[:, None]) & exists[None, :]).sum(1, dtype=torch.int32)
