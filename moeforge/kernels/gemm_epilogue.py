# Triton kernels (``@triton.jit`` bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The grouped GEMMs' epilogue, shared by every kernel that finishes a tile of expert rows: the bias, the activation
(fused gate/up: the gated activation of the two accumulators), the routing weight, and the store at the rows' copy
indices — in the output's dtype, or as FP8 with one scale per 128 columns for the next GEMM; or, for a row gradient
of rows an activation made (:func:`store_activation_grad`), that activation's derivative and the store of the
gradient of its input rows. ``@triton.jit`` functions
a kernel calls on its fp32 accumulators (fully scaled: the format's constant scales already applied); the decode
kernel (:mod:`moeforge.kernels.moe_gemm`) and its split K-loop's reduction use them, and so does any new grouped
GEMM, so that a format's outputs do not depend on which kernel computed them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeforge.kernels.activations import activate, activate_derivative, gated, gated_derivative
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


@triton.jit
def _halves(x, COLUMNS: tl.constexpr):
    """The two halves of ``x``'s last dimension (``COLUMNS`` wide): columns ``[0, COLUMNS / 2)`` and the rest."""
    if len(x.shape) == 2:
        halves = tl.permute(tl.reshape(x, (x.shape[0], 2, COLUMNS // 2)), (0, 2, 1))
    else:
        halves = tl.permute(tl.reshape(x, (2, COLUMNS // 2)), (1, 0))
    return tl.split(halves)


@triton.jit
def _store_activation_grad_part(d_act, rows, ok_rows, cols, cols_ok, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                gate_stride, up_offset, alpha, limit, ACT: tl.constexpr, GLU: tl.constexpr):
    ok = ok_rows[:, None] & cols_ok[None, :]
    pre_rows = pre_ptr + rows[:, None] * stride_pre
    out_rows = c_ptr + rows[:, None] * stride_cm
    # (the activated rows' gradient rounded to their dtype first, as the separate kernels hand it over)
    d = d_act.to(pre_ptr.dtype.element_ty).to(tl.float32)
    if GLU:
        gate_cols = cols * gate_stride
        up_cols = gate_cols + up_offset
        gate = tl.load(pre_rows + gate_cols[None, :], mask=ok, other=0.0).to(tl.float32)
        up = tl.load(pre_rows + up_cols[None, :], mask=ok, other=0.0).to(tl.float32)
        d_gate, d_up = gated_derivative(gate, up, d, ACT, alpha, limit)
        tl.store(out_rows + gate_cols[None, :] * stride_cn, d_gate.to(c_ptr.dtype.element_ty), mask=ok)
        tl.store(out_rows + up_cols[None, :] * stride_cn, d_up.to(c_ptr.dtype.element_ty), mask=ok)
    else:
        x = tl.load(pre_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_rows + cols[None, :] * stride_cn, (d * activate_derivative(x, ACT)).to(c_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def store_activation_grad(d_act, copies, row_ok, offs_n, n_ok, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                          gate_stride, up_offset, alpha, limit, ACT: tl.constexpr, GLU: tl.constexpr,
                          BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """A row gradient of rows ``act = activation(pre)`` finished: ``d_act`` (fp32, the gradient of the activated
    rows' columns ``offs_n``) times the activation's derivative at ``pre``'s rows (the tile's copies), stored as the
    gradient of those ``pre`` rows — gated: of their gate columns ``offs_n * gate_stride`` and up columns ``+
    up_offset``, the layout the gate/up GEMM wrote them in; else of columns ``offs_n``. The arithmetic of the
    activation's own backward kernel (:mod:`moeforge.kernels.activation_rows`): the same bits for the same
    ``d_act``. In ``PARTS`` (1, 2 or 4) column ranges one after another, so that the derivative's temporaries of a
    wide tile fit in registers beside the accumulator."""
    rows = copies.to(tl.int64)
    if PARTS == 1:
        _store_activation_grad_part(d_act, rows, row_ok, offs_n, n_ok, pre_ptr, stride_pre, c_ptr, stride_cm,
                                    stride_cn, gate_stride, up_offset, alpha, limit, ACT, GLU)
    elif PARTS == 2:
        d0, d1 = _halves(d_act, BLOCK_N)
        n0, n1 = _halves(offs_n, BLOCK_N)
        ok0, ok1 = _halves(n_ok, BLOCK_N)
        _store_activation_grad_part(d0, rows, row_ok, n0, ok0, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
        _store_activation_grad_part(d1, rows, row_ok, n1, ok1, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
    else:
        d0, d1 = _halves(d_act, BLOCK_N)
        n0, n1 = _halves(offs_n, BLOCK_N)
        ok0, ok1 = _halves(n_ok, BLOCK_N)
        d00, d01 = _halves(d0, BLOCK_N // 2)
        n00, n01 = _halves(n0, BLOCK_N // 2)
        ok00, ok01 = _halves(ok0, BLOCK_N // 2)
        d10, d11 = _halves(d1, BLOCK_N // 2)
        n10, n11 = _halves(n1, BLOCK_N // 2)
        ok10, ok11 = _halves(ok1, BLOCK_N // 2)
        _store_activation_grad_part(d00, rows, row_ok, n00, ok00, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
        _store_activation_grad_part(d01, rows, row_ok, n01, ok01, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
        _store_activation_grad_part(d10, rows, row_ok, n10, ok10, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
        _store_activation_grad_part(d11, rows, row_ok, n11, ok11, pre_ptr, stride_pre, c_ptr, stride_cm, stride_cn,
                                    gate_stride, up_offset, alpha, limit, ACT, GLU)
