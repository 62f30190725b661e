# Triton kernels (``@triton.jit`` bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The grouped GEMMs' epilogue, shared by every kernel that finishes a tile of expert rows: the bias, the activation
(fused gate/up: the gated activation of the two accumulators), the routing weight, and the store at the rows' copy
indices — in the output's dtype, or as FP8 with one scale per 128 columns for the next GEMM. ``@triton.jit`` functions
a kernel calls on its fp32 accumulators (fully scaled: the format's constant scales already applied); the decode
kernel (:mod:`moeforge.kernels.moe_gemm`) and its split K-loop's reduction use them, and so does any new grouped
GEMM, so that a format's outputs do not depend on which kernel computed them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeforge.kernels.activations import activate, gated
from moeforge.kernels.quantize import quantize_values, scale_of


@triton.jit
def add_bias(acc, acc_up, expert, gate_rows, up_offset, ok, bias_ptr, stride_bias_e, stride_bias_n,
              GLU: tl.constexpr):
    """``(acc, acc_up)`` plus the expert's bias of the gate (and up) columns where ``ok``."""
    bias_base = bias_ptr + expert * stride_bias_e
    acc += tl.load(bias_base + gate_rows * stride_bias_n, mask=ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        up_bias = tl.load(bias_base + (gate_rows + up_offset) * stride_bias_n, mask=ok, other=0.0)
        acc_up += up_bias.to(tl.float32)[None, :]
    return acc, acc_up


@triton.jit
def epilogue(acc, acc_up, expert, gate_rows, up_offset, n_ok, copies, row_ok,
              bias_ptr, stride_bias_e, stride_bias_n, weights_ptr, alpha, limit,
              ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr):
    """Bias, activation and routing weight on the fp32 (fully scaled) accumulators."""
    if HAS_BIAS:
        acc, acc_up = add_bias(acc, acc_up, expert, gate_rows, up_offset, n_ok, bias_ptr, stride_bias_e,
                                stride_bias_n, GLU)
    if GLU:
        acc = gated(acc, acc_up, ACT, alpha, limit)
    else:
        acc = activate(acc, ACT)
    if MUL_WEIGHTS:
        w = tl.load(weights_ptr + copies, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    return acc


@triton.jit
def store_fp8_groups(acc, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn,
                      c_scale_ptr, stride_csm, stride_csg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantize the tile to FP8 with one scale per 128 columns (``PerGroupQuantizer``'s arithmetic)
    and write data and scales: the activated rows never reach memory in a float dtype."""
    v = tl.where(n_ok[None, :], acc, 0.0)  # columns past N must not raise a group's amax
    groups = tl.reshape(v, (BLOCK_M, BLOCK_N // 128, 128))
    scale = scale_of(tl.max(tl.abs(groups), axis=2), 448.0)
    q = tl.reshape(quantize_values(groups, scale[:, :, None], 448.0, False), (BLOCK_M, BLOCK_N))
    rows = copies.to(tl.int64)
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, q,
             mask=row_ok[:, None] & n_ok[None, :])
    group_ids = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
    tl.store(c_scale_ptr + rows[:, None] * stride_csm + group_ids[None, :] * stride_csg, scale,
             mask=row_ok[:, None] & (group_ids * 128 < N)[None, :])


@triton.jit
def store(out, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn, c_scale_ptr, stride_csm,
           stride_csg, QUANT_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the finished tile at its rows' copy indices: FP8 with per-128-group scales, or ``c``'s dtype."""
    if QUANT_OUT:
        store_fp8_groups(out, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn,
                          c_scale_ptr, stride_csm, stride_csg, BLOCK_M, BLOCK_N)
    else:
        c_ptrs = c_ptr + copies.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
