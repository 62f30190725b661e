"""Grouped GEMM over block-aligned expert rows, with a fused epilogue.

One program computes a ``BLOCK_M x BLOCK_N`` tile of one expert: it reads the copy indices of its
rows from ``sorted_ids`` (see :mod:`moeforge.kernels.align`), gathers the input rows by index inside
the kernel (``copy // rows_per_a`` — the token for the first GEMM, the copy itself for the second),
multiplies by the expert's ``[N, K]`` weight, and in the epilogue adds the bias, applies the
activation (for a gated activation the program accumulates the gate and the up tile side by side and
writes ``act(gate) * up``: the ``2 * I`` wide intermediate never reaches memory), multiplies by the
routing weight, and writes each row at its copy index.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.config import GemmConfig, fit_shared_memory

# Activation codes shared with the launcher (tl.constexpr ints).
ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU2, ACT_GPT_OSS = 0, 1, 2, 3, 4, 5


@triton.jit
def _gelu(x, TANH: tl.constexpr):
    if TANH:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh(y) = 2 * sigmoid(2y) - 1
        return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _activate(x, ACT: tl.constexpr):
    if ACT == 1:
        return x * tl.sigmoid(x)
    elif ACT == 2:
        return _gelu(x, False)
    elif ACT == 3:
        return _gelu(x, True)
    elif ACT == 4:
        r = tl.maximum(x, 0.0)
        return r * r
    else:
        return x


@triton.jit
def _gated(gate, up, ACT: tl.constexpr, alpha, limit):
    """A gated activation of fp32 ``gate`` and ``up``: ``act(gate) * up``, or GPT-OSS's clamped
    SwiGLU (``ACT_GPT_OSS``). The same arithmetic as the epilogue of :func:`fused_moe_gemm_kernel`,
    for the quantized kernels (:mod:`moeforge.kernels.quant_gemm`, :mod:`moeforge.kernels.quantize`)."""
    if ACT == 5:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:
        return _activate(gate, ACT) * up


@triton.jit
def fused_moe_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, weights_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_copies, rows_per_a,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_bias_e, stride_bias_n,
    stride_cm, stride_cn,
    gate_stride, up_offset,
    alpha, limit,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: neighbouring programs share weight tiles in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    copies = tl.load(sorted_ids_ptr + offs_m)
    row_ok = copies < num_copies
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (copies // rows_per_a).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk
    gate_rows = offs_n * gate_stride
    b_gate = b_base + gate_rows[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        b_up = b_base + (gate_rows + up_offset)[None, :] * stride_bn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_gate, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_gate, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GLU:
            if EVEN_K:
                bu = tl.load(b_up, mask=n_ok[None, :], other=0.0)
            else:
                bu = tl.load(b_up, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, bu, acc_up, input_precision=PRECISION)
            b_up += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_gate += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias_base = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_base + gate_rows * stride_bias_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            up_bias = tl.load(bias_base + (gate_rows + up_offset) * stride_bias_n, mask=n_ok, other=0.0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if GLU:
        if ACT == 5:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        else:
            acc = _activate(acc, ACT) * acc_up
    else:
        acc = _activate(acc, ACT)
    if MUL_WEIGHTS:
        w = tl.load(weights_ptr + copies, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + copies.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    *,
    rows_per_a: int,
    config: GemmConfig,
    bias: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    act: int = ACT_NONE,
    glu: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Launch the kernel. ``a [rows, K]``, ``weight [E, N_w, K]``, ``out [num_copies, N]`` where
    ``N = N_w // 2`` for a gated activation (``glu``) else ``N_w``. ``block_m`` of ``config`` must
    be the one ``sorted_ids`` was aligned with."""
    config = fit_shared_memory(config, a.element_size(), 2 if glu else 1)
    num_copies, n_out = out.shape
    k_dim = a.shape[1]
    if num_copies == 0 or n_out == 0:
        return out
    if glu:
        gate_stride, up_offset = (2, 1) if interleaved else (1, n_out)
    else:
        gate_stride, up_offset = 1, 0
    max_blocks = sorted_ids.numel() // config.block_m
    grid = (max_blocks * triton.cdiv(n_out, config.block_n),)
    bias_arg = bias if bias is not None else weight
    weights_arg = topk_weights if topk_weights is not None else weight
    fused_moe_gemm_kernel[grid](
        a, weight, bias_arg, out, weights_arg,
        sorted_ids, block_expert, num_padded,
        n_out, k_dim, num_copies, rows_per_a,
        a.stride(0), a.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1),
        gate_stride, up_offset,
        alpha, limit,
        ACT=act, GLU=glu, HAS_BIAS=bias is not None, MUL_WEIGHTS=topk_weights is not None,
        EVEN_K=k_dim % config.block_k == 0,
        # fp32 operands: full-precision products, so fp32 layers match the reference to ~1e-6.
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
