# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Activation quantization on the device: per-token FP8 / INT8 and per-128-group FP8.

The kernels compute exactly what :class:`~moeforge.stages.quantize.PerTokenQuantizer` and
:class:`~moeforge.stages.quantize.PerGroupQuantizer` compute: ``scale = max(amax, 1e-12) / qmax``,
``q = clamp(x / scale, -qmax, qmax)`` cast to FP8 (round to nearest, ties to even) or rounded to
the nearest integer (ties to even) for INT8. Both divisions are IEEE-rounded (``div_rn``; Triton's
``/`` is an approximate division on NVIDIA GPUs), so for the same input the data and the scales
are bit-identical to the torch quantizers.

:func:`quantize_rows` can apply the expert activation first (a gated one reads ``2 * W`` wide rows
of gate and up), so the rows the second GEMM consumes are produced in one pass over the first
GEMM's output.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.activations import ACT_NONE, activate, gated
from moeforge.kernels.sizes import cdiv, next_power_of_2

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
GROUP = 128  # elements per scale of the per-group layout
TINY = 1e-12  # the torch quantizers' clamp of amax: an all-zero row keeps a finite scale


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32, ``|x| <= 448``) rounded to the nearest float8_e4m3fn value, ties to even, as fp32.

    The result is exactly representable, so the following cast to fp8 is exact on every target.
    Why not just cast: Triton's interpreter (our CPU tests) rounds up a mantissa without carrying
    into the exponent (127.6 becomes 64), and on the GPU these few ALU operations are free in a
    memory-bound kernel, so one code path is tested everywhere.
    """
    ax = tl.abs(x)
    # The bits of 2^floor(log2|x|), at least 2^-6: e4m3 keeps 3 mantissa bits, so its spacing is
    # binade / 8 (and 2^-9 for the subnormals below 2^-6).
    binade = tl.maximum(ax.to(tl.uint32, bitcast=True) & 0x7F800000, 0x3C800000)
    ulp = binade.to(tl.float32, bitcast=True) * 0.125
    inv_ulp = ((0x7F000000 - binade) + 0x01800000).to(tl.float32, bitcast=True)  # 1 / ulp, exactly
    # (y + 2^23) - 2^23 rounds 0 <= y < 2^22 to an integer, ties to even (fp32 addition rounds so);
    # ax * inv_ulp < 16 is exact (a power-of-two scaling).
    steps = (ax * inv_ulp + 8388608.0) - 8388608.0
    r = (steps * ulp).to(tl.uint32, bitcast=True)
    sign = (x.to(tl.uint32, bitcast=True) >> 31) << 31  # keeps -0.0 and negatives rounded to zero
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(y):
    """``y`` (fp32, ``|y| < 2^22``) rounded to an integer, ties to even (``torch.round``)."""
    # 1.5 * 2^23: adding it leaves no fractional bits for |y| < 2^22, whatever the sign.
    return (y + 12582912.0) - 12582912.0


@triton.jit
def quantize_values(v, scale, QMAX: tl.constexpr, INT8: tl.constexpr):
    """``v / scale`` clamped to ``[-QMAX, QMAX]`` and cast to int8 or fp8 e4m3 (``scale`` broadcasts)."""
    y = tl.math.div_rn(v, scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:
        return round_half_even(y).to(tl.int8)
    else:
        return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def scale_of(amax, QMAX: tl.constexpr):
    """The symmetric scale of values whose largest magnitude is ``amax``."""
    return tl.math.div_rn(tl.maximum(amax, 1e-12), QMAX)


@triton.jit
def _load_activated(x_ptr, cols, mask, gate_stride, up_offset, alpha, limit,
                    ACT: tl.constexpr, GLU: tl.constexpr):
    """Columns ``cols`` of one row after the activation, in fp32 (``x_ptr`` points at the row)."""
    if GLU:
        gate = tl.load(x_ptr + cols * gate_stride, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + cols * gate_stride + up_offset, mask=mask, other=0.0).to(tl.float32)
        v = gated(gate, up, ACT, alpha, limit)
    else:
        v = activate(tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32), ACT)
    # Masked columns must not raise the amax (an activation of 0 is 0, but say it explicitly).
    return tl.where(mask, v, 0.0)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr,
    W, stride_xm, stride_qm, stride_sm,
    gate_stride, up_offset, alpha, limit,
    QMAX: tl.constexpr, INT8: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per row: a first pass finds the row's amax, the second quantizes (its reads hit
    # the cache; a row is at most a few tens of KiB).
    pdl.wait_for_the_kernel_before(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for start in range(0, W, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        v = _load_activated(x_row, cols, cols < W, gate_stride, up_offset, alpha, limit, ACT, GLU)
        amax = tl.maximum(amax, tl.abs(v))
    scale = scale_of(tl.max(amax, axis=0), QMAX)
    tl.store(s_ptr + row * stride_sm, scale)
    for start in range(0, W, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        mask = cols < W
        v = _load_activated(x_row, cols, mask, gate_stride, up_offset, alpha, limit, ACT, GLU)
        tl.store(q_ptr + row * stride_qm + cols, quantize_values(v, scale, QMAX, INT8), mask=mask)


@triton.jit
def _quantize_per_group_kernel(
    x_ptr, q_ptr, s_ptr,
    W, stride_xm, stride_qm, stride_sm, stride_sg,
    gate_stride, up_offset, alpha, limit,
    QMAX: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (row, GROUPS consecutive 128-groups): a single pass, the groups side by side.
    pdl.wait_for_the_kernel_before(PDL)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUPS
    cols = first * 128 + tl.arange(0, GROUPS * 128)
    mask = cols < W  # W is a multiple of 128: a group is entirely in or out
    v = _load_activated(x_ptr + row * stride_xm, cols, mask, gate_stride, up_offset, alpha, limit, ACT, GLU)
    groups = tl.reshape(v, (GROUPS, 128))
    scale = scale_of(tl.max(tl.abs(groups), axis=1), QMAX)
    q = tl.reshape(quantize_values(groups, scale[:, None], QMAX, False), (GROUPS * 128,))
    tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
    group_ids = first + tl.arange(0, GROUPS)
    tl.store(s_ptr + row * stride_sm + group_ids * stride_sg, scale, mask=group_ids * 128 < W)



def quantize_rows(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    per_group: bool,
    act: int = ACT_NONE,
    glu: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None:
    """Quantize the rows of ``x [R, W_in]`` (any float dtype, last dimension contiguous) into
    ``q [R, W]`` (float8_e4m3fn or int8) and fp32 ``scale`` (``[R, 1]`` per token, ``[R, W // 128]``
    per group; per group is FP8 only). With ``act``, the activation is applied first; a gated one
    (``glu``) reads gate and up from ``W_in = 2 * W`` columns (concatenated, or interleaved)."""
    rows, width = q.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if q.stride(-1) != 1:
        raise ValueError("quantize_rows writes rows with a contiguous last dimension")
    int8 = q.dtype == torch.int8
    if per_group and (int8 or width % GROUP):
        raise ValueError(f"per-group quantization is fp8 with a width divisible by {GROUP}, got {q.dtype}, {width}")
    if rows == 0 or width == 0:
        return
    if glu:
        gate_stride, up_offset = (2, 1) if interleaved else (1, width)
    else:
        gate_stride, up_offset = 1, 0
    if per_group:
        groups = min(next_power_of_2(width // GROUP), 8)

        def grouped() -> tuple[dict[str, Any], dict[str, Any]]:
            dependent = pdl.pdl_applies(x.device)
            return (dict(QMAX=FP8_MAX, ACT=act, GLU=glu, GROUPS=groups, PDL=pdl.flag(dependent)),
                    dict(num_warps=4 if groups >= 4 else 2, **pdl.launch_options(dependent)))

        _PER_GROUP.launch((act, glu, x.device), (rows, cdiv(width // GROUP, groups)),
                          (x, q, scale, width, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                           gate_stride, up_offset, alpha, limit), grouped)
        return
    block_w = min(next_power_of_2(width), 4096)

    def per_token() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(x.device)
        return (dict(QMAX=INT8_MAX if int8 else FP8_MAX, INT8=int8, ACT=act, GLU=glu, BLOCK_W=block_w,
                     PDL=pdl.flag(dependent)),
                dict(num_warps=8 if block_w >= 4096 else 4, **pdl.launch_options(dependent)))

    _PER_TOKEN.launch((act, glu, x.device), (rows,),
                      (x, q, scale, width, x.stride(0), q.stride(0), scale.stride(0), gate_stride, up_offset, alpha,
                       limit), per_token)


_PER_GROUP = LaunchSite(_quantize_per_group_kernel)
_PER_TOKEN = LaunchSite(_quantize_per_token_kernel)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype, per_group: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``x [R, W]``: per-token FP8/INT8 (``dtype``) or per-128-group FP8."""
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=dtype, device=x.device)
    scale = torch.empty(rows, width // GROUP if per_group else 1, dtype=torch.float32, device=x.device)
    quantize_rows(x, q, scale, per_group=per_group)
    return q, scale
