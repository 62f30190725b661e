# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Quantized grouped GEMMs over block-aligned expert rows: FP8 / INT8 W8A8 and W4A16.

The same plan, gather and epilogue as :mod:`moeforge.kernels.grouped_gemm` (read its docstring
first): a program computes a ``BLOCK_M x BLOCK_N`` tile of one expert, gathers its input rows by
copy index, accumulates gate and up side by side for a gated activation, and its epilogue adds the
bias, applies the activation and the routing weight and writes each row at its copy index. What
differs is the operands (layouts in ``/docs/kernels.md``; weights ``[E, N, K]``):

* **W8A8** (:func:`w8a8_moe_gemm`): FP8-e4m3 or INT8 activations and weights, ``tl.dot`` on the
  8-bit operands (FP8 -> fp32, INT8 -> int32 accumulation). Activation scales per token ``[R, 1]``,
  per tensor ``[1]`` or per 128-group ``[R, K / 128]``; weight scales per channel ``[E, N]`` or per
  128x128 block ``[E, ceil(N / 128), ceil(K / 128)]``. Per-token / per-channel scales are constant
  along K, so they multiply the finished accumulator in the epilogue; group / block scales change
  every 128 K-elements, so each K-step's partial product is scaled before it is added (the
  DeepGEMM / vLLM w8a8-block scheme; it also promotes Hopper's reduced-precision FP8 accumulation
  to fp32 every K-step). The first GEMM can quantize its activated output to FP8 per 128-group in
  the epilogue (``out_scale``) for the second GEMM, when ``BLOCK_N`` is a multiple of 128.
* **W4A16** (:func:`w4a16_moe_gemm`): bf16 / fp16 / fp32 activations; weights packed two 4-bit
  values per byte ``[E, N, K / 2]`` (even k in the low nibble), scales ``[E, N, K / G]`` in the
  activation dtype, optional zero points ``[E, N, K / G]`` (else 8). The kernel loads the packed
  bytes (half the bytes of an fp8 tile), splits the nibbles, dequantizes in registers and calls
  ``tl.dot`` in the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels.config import GemmConfig, fit_shared_memory
from moeforge.kernels.grouped_gemm import ACT_NONE, _activate, _gated
from moeforge.kernels.quantize import FP8_MAX, GROUP, quantize_values, scale_of

SCALE_BLOCK = 128  # the K (and N) extent of one group / block scale


# -- shared pieces -----------------------------------------------------------------------------------

@triton.jit
def _tile(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of this program in grouped order: neighbouring programs share weight
    tiles in L2 (the order of :func:`~moeforge.kernels.grouped_gemm.fused_moe_gemm_kernel`)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.cdiv(tl.num_programs(0), num_pid_n)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, acc_up, expert, gate_rows, up_offset, n_ok, copies, row_ok,
              bias_ptr, stride_bias_e, stride_bias_n, weights_ptr, alpha, limit,
              ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr):
    """Bias, activation and routing weight on the fp32 (already dequantized) accumulators."""
    if HAS_BIAS:
        bias_base = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_base + gate_rows * stride_bias_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            up_bias = tl.load(bias_base + (gate_rows + up_offset) * stride_bias_n, mask=n_ok, other=0.0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if GLU:
        acc = _gated(acc, acc_up, ACT, alpha, limit)
    else:
        acc = _activate(acc, ACT)
    if MUL_WEIGHTS:
        w = tl.load(weights_ptr + copies, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    return acc


@triton.jit
def _store(acc, copies, row_ok, offs_n, n_ok, c_ptr, stride_cm, stride_cn):
    c_ptrs = c_ptr + copies.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _store_fp8_groups(acc, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn,
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


# -- W8A8 --------------------------------------------------------------------------------------------

@triton.jit
def _dot8(a, b, INT8: tl.constexpr):
    """``a @ b`` of 8-bit operands as fp32 (INT8 sums exactly in int32, FP8 in fp32)."""
    if INT8:
        return tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    else:
        return tl.dot(a, b)


@triton.jit
def w8a8_moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, c_scale_ptr, weights_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_copies, rows_per_a,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,
    stride_bse, stride_bsn, stride_bsk,
    stride_bias_e, stride_bias_n,
    stride_cm, stride_cn, stride_csm, stride_csg,
    gate_stride, up_offset,
    alpha, limit,
    A_GROUPED: tl.constexpr, B_BLOCKED: tl.constexpr, PER_K: tl.constexpr, INT8: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(N, BLOCK_N, GROUP_M)
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
    up_rows = gate_rows + up_offset
    b_gate = b_base + gate_rows[None, :] * stride_bn
    b_up = b_base + up_rows[None, :] * stride_bn
    a_scale_rows = a_scale_ptr + a_rows * stride_asm
    b_scale_base = b_scale_ptr + expert * stride_bse
    # A group/block scale (PER_K) changes every 128 K-elements: the partial product of each K-step
    # is scaled before it is added (BLOCK_K divides 128, so a K-step never straddles two scales).
    # Otherwise INT8 accumulates exactly in int32 and FP8 in fp32, scaled once in the epilogue.
    if INT8 and not PER_K:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_gate, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_gate, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if GLU:
            if EVEN_K:
                bu = tl.load(b_up, mask=n_ok[None, :], other=0.0)
            else:
                bu = tl.load(b_up, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PER_K:
            kb = (k * BLOCK_K) // 128
            part = _dot8(a, b, INT8)
            if GLU:
                part_up = _dot8(a, bu, INT8)
            if A_GROUPED:
                sa = tl.load(a_scale_rows + kb * stride_ask, mask=row_ok, other=0.0)[:, None]
                part = part * sa
                if GLU:
                    part_up = part_up * sa
            if B_BLOCKED:
                sb = tl.load(b_scale_base + (gate_rows // 128) * stride_bsn + kb * stride_bsk,
                             mask=n_ok, other=0.0)
                part = part * sb[None, :]
                if GLU:
                    sbu = tl.load(b_scale_base + (up_rows // 128) * stride_bsn + kb * stride_bsk,
                                  mask=n_ok, other=0.0)
                    part_up = part_up * sbu[None, :]
            acc += part
            if GLU:
                acc_up += part_up
        elif INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            if GLU:
                acc_up = tl.dot(a, bu, acc_up, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc)
            if GLU:
                acc_up = tl.dot(a, bu, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_gate += BLOCK_K * stride_bk
        b_up += BLOCK_K * stride_bk

    # Scales constant along K multiply the finished accumulator once.
    out = acc.to(tl.float32)
    out_up = acc_up.to(tl.float32)
    if not A_GROUPED:
        sa = tl.load(a_scale_rows, mask=row_ok, other=0.0)[:, None]
        out = out * sa
        out_up = out_up * sa
    if not B_BLOCKED:
        out = out * tl.load(b_scale_base + gate_rows * stride_bsn, mask=n_ok, other=0.0)[None, :]
        if GLU:
            out_up = out_up * tl.load(b_scale_base + up_rows * stride_bsn, mask=n_ok, other=0.0)[None, :]
    out = _epilogue(out, out_up, expert, gate_rows, up_offset, n_ok, copies, row_ok,
                    bias_ptr, stride_bias_e, stride_bias_n, weights_ptr, alpha, limit,
                    ACT, GLU, HAS_BIAS, MUL_WEIGHTS)
    if QUANT_OUT:
        _store_fp8_groups(out, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn,
                          c_scale_ptr, stride_csm, stride_csg, BLOCK_M, BLOCK_N)
    else:
        _store(out, copies, row_ok, offs_n, n_ok, c_ptr, stride_cm, stride_cn)


def _glu_strides(glu: bool, interleaved: bool, n_out: int) -> tuple[int, int]:
    """``(gate_stride, up_offset)``: weight row of output column n's gate is ``n * gate_stride``,
    its up row ``n * gate_stride + up_offset`` ([gate | up] or interleaved g0 u0 g1 u1 ...)."""
    if not glu:
        return 1, 0
    return (2, 1) if interleaved else (1, n_out)


def w8a8_config(config: GemmConfig, per_k_scales: bool, glu: bool) -> GemmConfig:
    """``config`` fitted to the W8A8 kernel: a K-step within one 128-wide scale group when scales
    change along K, and operand tiles (1 byte per element) that fit in shared memory."""
    if per_k_scales and config.block_k > SCALE_BLOCK:
        config = GemmConfig(config.block_m, config.block_n, SCALE_BLOCK, config.group_m,
                            config.num_warps, config.num_stages)
    return fit_shared_memory(config, 1, 2 if glu else 1)


def w8a8_moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
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
    out_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the W8A8 kernel.

    ``a [rows, K]`` float8_e4m3fn or int8 with fp32 ``a_scale`` ``[rows, 1]`` (per token), ``[1]``
    (per tensor) or ``[rows, K / 128]`` (per group); ``weight [E, N_w, K]`` of the same dtype with
    fp32 ``weight_scale`` ``[E, N_w]`` (per channel) or ``[E, ceil(N_w / 128), ceil(K / 128)]``
    (per block); ``out [num_copies, N]`` (``N = N_w // 2`` when ``glu``) in bf16/fp16/fp32, or
    float8_e4m3fn with ``out_scale [num_copies, N / 128]`` to quantize per 128-group in the epilogue
    (needs ``config.block_n`` and ``N`` multiples of 128). ``config.block_m`` must be the one
    ``sorted_ids`` was aligned with.
    """
    num_copies, n_out = out.shape
    rows, k_dim = a.shape
    if a.dtype != weight.dtype or a.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"w8a8_moe_gemm needs fp8 or int8 operands of one dtype, got {a.dtype} and {weight.dtype}")
    if a_scale.numel() == 1 and a_scale.dim() <= 1:
        a_grouped, stride_asm, stride_ask = False, 0, 0  # per tensor: every row reads the one scale
    elif a_scale.dim() == 2 and a_scale.shape[1] == 1 and k_dim > SCALE_BLOCK:
        a_grouped, stride_asm, stride_ask = False, a_scale.stride(0), 0
    elif a_scale.dim() == 2 and a_scale.shape[1] == triton.cdiv(k_dim, SCALE_BLOCK):
        # (with K <= 128 one group is the whole row: per token and per group coincide)
        a_grouped, stride_asm, stride_ask = True, a_scale.stride(0), a_scale.stride(1)
    else:
        raise ValueError(f"a_scale must be [1], [{rows}, 1] or [{rows}, {k_dim // SCALE_BLOCK}], "
                         f"got {tuple(a_scale.shape)}")
    b_blocked = weight_scale.dim() == 3
    if b_blocked:
        stride_bsk = weight_scale.stride(2)
    else:
        stride_bsk = 0
    quant_out = out_scale is not None
    config = w8a8_config(config, a_grouped or b_blocked, glu)
    if quant_out and (config.block_n % SCALE_BLOCK or n_out % SCALE_BLOCK):
        raise ValueError(f"FP8 output quantization in the epilogue needs block_n and N multiples of 128, "
                         f"got {config.block_n} and {n_out}")
    if num_copies == 0 or n_out == 0:
        return out
    gate_stride, up_offset = _glu_strides(glu, interleaved, n_out)
    grid = (sorted_ids.numel() // config.block_m * triton.cdiv(n_out, config.block_n),)
    scale_out = out_scale if out_scale is not None else a_scale
    w8a8_moe_gemm_kernel[grid](
        a, a_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, scale_out,
        topk_weights if topk_weights is not None else a_scale,
        sorted_ids, block_expert, num_padded,
        n_out, k_dim, num_copies, rows_per_a,
        a.stride(0), a.stride(1), stride_asm, stride_ask,
        weight.stride(0), weight.stride(1), weight.stride(2),
        weight_scale.stride(0), weight_scale.stride(1), stride_bsk,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1),
        scale_out.stride(0) if quant_out else 0, scale_out.stride(1) if quant_out else 0,
        gate_stride, up_offset,
        alpha, limit,
        A_GROUPED=a_grouped, B_BLOCKED=b_blocked, PER_K=a_grouped or b_blocked, INT8=a.dtype == torch.int8,
        QUANT_OUT=quant_out,
        ACT=act, GLU=glu, HAS_BIAS=bias is not None, MUL_WEIGHTS=topk_weights is not None,
        EVEN_K=k_dim % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# -- W4A16 -------------------------------------------------------------------------------------------

@triton.jit
def _dequant_int4(b_ptrs, s_ptrs, z_ptrs, k, n_ok, K, stride_sg, stride_zg,
                  GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` operand of K-step ``k``, dequantized to the scales' dtype (the
    activation dtype).

    ``b_ptrs [BLOCK_N, BLOCK_K // 2]`` point at the step's packed bytes (K contiguous, so the loads
    are wide), ``s_ptrs`` / ``z_ptrs [BLOCK_N]`` at the columns' first scale / zero point of the
    step."""
    if EVEN_K:
        packed = tl.load(b_ptrs, mask=n_ok[:, None], other=0)
    else:
        byte_ok = k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2) < K // 2
        packed = tl.load(b_ptrs, mask=n_ok[:, None] & byte_ok[None, :], other=0)
    # Byte j holds k = 2j (low nibble) and k = 2j + 1 (high nibble): join on a new last axis and
    # flatten it into K order.
    q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
    if BLOCK_K <= GROUP:
        # The whole step lies in one group (GROUP is a multiple of BLOCK_K): one scale per column.
        g = (k * BLOCK_K) // GROUP
        s = tl.load(s_ptrs + g * stride_sg, mask=n_ok, other=0.0)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptrs + g * stride_zg, mask=n_ok, other=0)[:, None]
    else:
        # BLOCK_K // GROUP groups per step: load them side by side and repeat each GROUP times.
        g = k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        g_ok = n_ok[:, None] & (g < K // GROUP)[None, :]
        s = tl.load(s_ptrs[:, None] + g[None, :] * stride_sg, mask=g_ok, other=0.0)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
        if HAS_ZEROS:
            z = tl.load(z_ptrs[:, None] + g[None, :] * stride_zg, mask=g_ok, other=0)
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
    # (q - z) is an integer in [-15, 15], exact in every float dtype; one rounding in the product.
    if HAS_ZEROS:
        w = (q.to(s.dtype) - z.to(s.dtype)) * s
    else:
        w = (q.to(s.dtype) - 8.0) * s
    return tl.trans(w)


@triton.jit
def w4a16_moe_gemm_kernel(
    a_ptr, b_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, weights_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_copies, rows_per_a,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sg,
    stride_ze, stride_zn, stride_zg,
    stride_bias_e, stride_bias_n,
    stride_cm, stride_cn,
    gate_stride, up_offset,
    alpha, limit,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(N, BLOCK_N, GROUP_M)
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
    offs_kb = tl.arange(0, BLOCK_K // 2)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    gate_rows = offs_n * gate_stride
    up_rows = gate_rows + up_offset
    b_base = b_ptr + expert * stride_be + offs_kb[None, :] * stride_bk
    b_gate = b_base + gate_rows[:, None] * stride_bn
    b_up = b_base + up_rows[:, None] * stride_bn
    # Scales and zero points: [E, N, K / GROUP].
    s_gate = s_ptr + expert * stride_se + gate_rows * stride_sn
    s_up = s_ptr + expert * stride_se + up_rows * stride_sn
    z_gate = z_ptr + expert * stride_ze + gate_rows * stride_zn
    z_up = z_ptr + expert * stride_ze + up_rows * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = _dequant_int4(b_gate, s_gate, z_gate, k, n_ok, K, stride_sg, stride_zg,
                          GROUP, HAS_ZEROS, EVEN_K, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GLU:
            bu = _dequant_int4(b_up, s_up, z_up, k, n_ok, K, stride_sg, stride_zg,
                               GROUP, HAS_ZEROS, EVEN_K, BLOCK_N, BLOCK_K)
            acc_up = tl.dot(a, bu, acc_up, input_precision=PRECISION)
            b_up += (BLOCK_K // 2) * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_gate += (BLOCK_K // 2) * stride_bk

    acc = _epilogue(acc, acc_up, expert, gate_rows, up_offset, n_ok, copies, row_ok,
                    bias_ptr, stride_bias_e, stride_bias_n, weights_ptr, alpha, limit,
                    ACT, GLU, HAS_BIAS, MUL_WEIGHTS)
    _store(acc, copies, row_ok, offs_n, n_ok, c_ptr, stride_cm, stride_cn)


def w4a16_config(config: GemmConfig, element_bytes: int, glu: bool) -> GemmConfig:
    """``config`` fitted to the W4A16 kernel: ``block_k >= 32`` (16 packed bytes per row), operand
    tiles that fit in shared memory (the dequantized B tile is in the activation dtype)."""
    if config.block_k < 32:
        config = GemmConfig(config.block_m, config.block_n, 32, config.group_m, config.num_warps,
                            config.num_stages)
    fitted = fit_shared_memory(config, element_bytes, 2 if glu else 1)
    if fitted.block_k < 32:
        fitted = GemmConfig(fitted.block_m, fitted.block_n, 32, fitted.group_m, fitted.num_warps, 2)
    return fitted


def w4a16_moe_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    *,
    rows_per_a: int,
    config: GemmConfig,
    zeros: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    act: int = ACT_NONE,
    glu: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Launch the W4A16 kernel.

    ``a [rows, K]`` bf16/fp16/fp32; ``qweight [E, N_w, K / 2]`` uint8 (element k in byte k // 2,
    even k in the low nibble); ``scales [E, N_w, K / G]`` in ``a``'s dtype; ``zeros`` uint8 of the
    same shape holding 0..15, or ``None`` for the symmetric zero point 8; ``out [num_copies, N]``
    (``N = N_w // 2`` when ``glu``). ``G`` (32, 64, 128, ...) is ``K // scales.shape[2]``.
    """
    num_copies, n_out = out.shape
    k_dim = a.shape[1]
    groups = scales.shape[2]
    if qweight.dtype != torch.uint8 or qweight.shape[2] * 2 != k_dim:
        raise ValueError(f"qweight must be uint8 [E, N, {k_dim // 2}], got {qweight.dtype} {tuple(qweight.shape)}")
    if groups == 0 or k_dim % groups or (k_dim // groups) & (k_dim // groups - 1) or k_dim // groups < 16:
        raise ValueError(f"scales [E, N, K / G] must give a power-of-two group size G >= 16 for K={k_dim}, "
                         f"got {groups} groups")
    if scales.dtype != a.dtype:
        raise ValueError(f"scales must be in the activations' dtype {a.dtype}, got {scales.dtype}")
    group = k_dim // groups
    config = w4a16_config(config, a.element_size(), glu)
    if num_copies == 0 or n_out == 0:
        return out
    gate_stride, up_offset = _glu_strides(glu, interleaved, n_out)
    grid = (sorted_ids.numel() // config.block_m * triton.cdiv(n_out, config.block_n),)
    w4a16_moe_gemm_kernel[grid](
        a, qweight, scales, zeros if zeros is not None else qweight,
        bias if bias is not None else scales, out,
        topk_weights if topk_weights is not None else scales,
        sorted_ids, block_expert, num_padded,
        n_out, k_dim, num_copies, rows_per_a,
        a.stride(0), a.stride(1),
        qweight.stride(0), qweight.stride(1), qweight.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        *(zeros.stride() if zeros is not None else (0, 0, 0)),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1),
        gate_stride, up_offset,
        alpha, limit,
        GROUP=group, HAS_ZEROS=zeros is not None,
        ACT=act, GLU=glu, HAS_BIAS=bias is not None, MUL_WEIGHTS=topk_weights is not None,
        EVEN_K=k_dim % config.block_k == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


__all__ = ["FP8_MAX", "GROUP", "w8a8_moe_gemm", "w4a16_moe_gemm", "w8a8_config", "w4a16_config"]
