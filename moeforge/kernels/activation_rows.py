# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The expert activation as kernels of its own, forward and derivative, for the training forward.

The gate/up grouped GEMM normally applies the activation in its epilogue. A training forward can instead have it
write the pre-activation rows ``pre [R, W]`` (``W = 2I`` for a gated activation, ``I`` otherwise), activate them
with :func:`activate_rows` and keep ``pre``: the backward then takes the activation's derivative from ``pre`` with
:func:`activate_rows_backward` instead of recomputing the GEMM.

Both kernels read a tile of rows and columns, compute in fp32 and write in ``pre``'s dtype. The activation is that
of :mod:`moeforge.kernels.activations` (the same codes, ``glu`` for a gated one, gate and up concatenated
``[gate | up]`` or interleaved ``g0 u0 g1 u1 ...``); the derivatives beside it here are the exact derivatives of
:func:`moeforge.activation.apply_activation`, GPT-OSS's clamps included (a clamp passes the gradient where its
input lies within its bounds, bounds included: ``torch.clamp``'s convention).

Registered as the custom ops ``moeforge::activate_rows`` (differentiable: :func:`autograd_setup_context`,
:func:`autograd_backward`) and ``moeforge::activate_rows_backward`` in :mod:`moeforge.kernels.ops`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from moeforge.errors import InputError
from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.kernel_op import KernelOp
from moeforge.kernels.activations import ACT_SOFTCAPPED_SILU, ACT_NONE, GATED_ONLY, activate, gated, softcap
from moeforge.kernels.launch_plan import glu_strides
from moeforge.kernels.sizes import cdiv, next_power_of_2

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
TILE = 2048  # output (or gate/up pair) columns x rows per program
MAX_BLOCK_C = 1024


# -- derivatives --------------------------------------------------------------------------------------------


@triton.jit
def _gelu_derivative(x, TANH: tl.constexpr):
    """``d gelu(x) / dx`` of fp32 ``x``, erf form or tanh form (the forms of ``activations._gelu``)."""
    if TANH:
        x2 = x * x
        inner = 0.7978845608028654 * (x + 0.044715 * x2 * x)
        # gelu = 0.5 x (1 + tanh(u)): 0.5 (1 + tanh(u)) = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u) sigmoid(-2u),
        # each factor accurate where tanh(u) is close to +-1 (no 1 - t^2 cancellation).
        s = tl.sigmoid(2.0 * inner)
        sech2 = 4.0 * s * tl.sigmoid(-2.0 * inner)
        return s + 0.5 * x * sech2 * 0.7978845608028654 * (1.0 + 0.134145 * x2)
    else:
        # Phi(x) + x phi(x); exp(-x^2 / 2) underflows to 0 for large |x|, never overflows.
        return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def activate_derivative(x, ACT: tl.constexpr):
    """``d activate(x, ACT) / dx`` of fp32 ``x`` (``ACT_NONE``: 1)."""
    if ACT == 1:
        # silu' = s (1 + x (1 - s)), with 1 - s as sigmoid(-x): exact where s rounds to 1.
        return tl.sigmoid(x) * (1.0 + x * tl.sigmoid(-x))
    elif ACT == 2:
        return _gelu_derivative(x, False)
    elif ACT == 3:
        return _gelu_derivative(x, True)
    elif ACT == 4:
        return 2.0 * tl.maximum(x, 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def gated_derivative(gate, up, d, ACT: tl.constexpr, alpha, limit):
    """``(d_gate, d_up)`` of ``gated(gate, up, ACT, alpha, limit)`` (fp32) given ``d``, the gradient of its output.

    GPT-OSS and the clamped SwiGLU: ``gate`` is clamped above at ``limit`` and ``up`` to ``[-limit, limit]``; the
    gradient passes where the input lies within the bounds, bounds included (``torch.clamp``'s backward), and is 0
    beyond them."""
    if ACT == 5:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        s = tl.sigmoid(alpha * g)
        glu = g * s
        # d/dg [g s(alpha g)] = s + alpha g s (1 - s), with 1 - s as sigmoid(-alpha g).
        d_gate = d * (u + 1.0) * (s + alpha * glu * tl.sigmoid(-alpha * g))
        d_up = d * glu
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    elif ACT == 6:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        d_gate = tl.where(gate <= limit, d * u * activate_derivative(g, 1), 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d * activate(g, 1), 0.0)
    elif ACT == 7:  # the softcapped SwiGLU: alpha and limit are the gate's and up's softcaps
        s = tl.sigmoid(gate)
        capped_gate, capped_up = softcap(gate, alpha), softcap(up, limit)
        # d/dx c tanh(x / c) = sech^2(x / c) = 4 e / (1 + e)^2, e = exp(-2 |x| / c): exact where tanh rounds to +-1
        e_gate, e_up = tl.exp(-2.0 * tl.abs(gate) / alpha), tl.exp(-2.0 * tl.abs(up) / limit)
        sech2_gate = 4.0 * e_gate / ((1.0 + e_gate) * (1.0 + e_gate))
        sech2_up = 4.0 * e_up / ((1.0 + e_up) * (1.0 + e_up))
        d_gate = d * capped_up * (sech2_gate * s + capped_gate * s * tl.sigmoid(-gate))
        d_up = d * capped_gate * s * sech2_up
    else:
        d_gate = d * up * activate_derivative(gate, ACT)
        d_up = d * activate(gate, ACT)
    return d_gate, d_up


# -- kernels ------------------------------------------------------------------------------------------------


@triton.jit
def _tile(rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows (int64: ``row * stride`` passes 2^31 on large layers), columns and their mask."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return r, c, (r < rows)[:, None] & (c < width)[None, :]


@triton.jit
def _activate_rows_kernel(
    pre_ptr, out_ptr,
    rows, width, stride_pre, stride_out, gate_step, up_offset, alpha, limit,
    ACT: tl.constexpr, GLU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (BLOCK_R rows, BLOCK_C output columns); gated: output column c reads gate at
    # c * gate_step and up at c * gate_step + up_offset of the same row.
    pdl.wait_for_the_kernel_before(PDL)
    r, c, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    pre = pre_ptr + r[:, None] * stride_pre
    if GLU:
        gate = tl.load(pre + (c * gate_step)[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(pre + (c * gate_step + up_offset)[None, :], mask=mask, other=0.0).to(tl.float32)
        out = gated(gate, up, ACT, alpha, limit)
    else:
        out = activate(tl.load(pre + c[None, :], mask=mask, other=0.0).to(tl.float32), ACT)
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activate_rows_backward_kernel(
    pre_ptr, d_out_ptr, d_pre_ptr,
    rows, width, stride_pre, stride_d_out, stride_d_pre, gate_step, up_offset, alpha, limit,
    ACT: tl.constexpr, GLU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    # The forward's tiling: each program writes the gate and up columns its output columns read.
    pdl.wait_for_the_kernel_before(PDL)
    r, c, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    d = tl.load(d_out_ptr + r[:, None] * stride_d_out + c[None, :], mask=mask, other=0.0).to(tl.float32)
    pre = pre_ptr + r[:, None] * stride_pre
    d_pre = d_pre_ptr + r[:, None] * stride_d_pre
    if GLU:
        gate_cols = (c * gate_step)[None, :]
        up_cols = (c * gate_step + up_offset)[None, :]
        gate = tl.load(pre + gate_cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(pre + up_cols, mask=mask, other=0.0).to(tl.float32)
        d_gate, d_up = gated_derivative(gate, up, d, ACT, alpha, limit)
        tl.store(d_pre + gate_cols, d_gate.to(d_pre_ptr.dtype.element_ty), mask=mask)
        tl.store(d_pre + up_cols, d_up.to(d_pre_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(pre + c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(d_pre + c[None, :], (d * activate_derivative(x, ACT)).to(d_pre_ptr.dtype.element_ty), mask=mask)


# -- launchers ----------------------------------------------------------------------------------------------


def activated_shape(pre: torch.Tensor, act: int, glu: bool) -> tuple[int, int]:
    """``(rows, width)`` of the activation of ``pre [R, W]`` (``width = W // 2`` when gated), after checking
    what the kernels need of the arguments (sizes, dtype and codes only: the ops' fakes call it too)."""
    if pre.dim() != 2:
        raise InputError(f"activate_rows takes 2-D rows [R, W], got a tensor of shape {tuple(pre.shape)}")
    if pre.dtype not in FLOATS:
        raise InputError(f"activate_rows takes float32, bfloat16 or float16 rows, got {pre.dtype}")
    if not ACT_NONE <= act <= ACT_SOFTCAPPED_SILU:
        raise InputError(f"activate_rows: unknown activation code {act} (moeforge.kernels.activations)")
    if act in GATED_ONLY and not glu:
        raise InputError("activate_rows: the GPT-OSS, clamped and softcapped SwiGLUs are gated (glu=True)")
    rows, width = pre.shape
    if glu and width % 2:
        raise InputError(f"activate_rows: a gated activation reads an even number of columns, got {width}")
    return rows, width // 2 if glu else width


def check_gradient(pre: torch.Tensor, d_out: torch.Tensor, act: int, glu: bool) -> None:
    """Check ``d_out``, the gradient of the activated rows of ``pre``, against them (sizes and dtype only)."""
    shape = activated_shape(pre, act, glu)
    if tuple(d_out.shape) != shape:
        raise InputError(f"activate_rows_backward: the gradient has shape {tuple(d_out.shape)}, the activated "
                         f"rows {shape}")
    if d_out.dtype not in FLOATS:
        raise InputError(f"activate_rows_backward takes a float32, bfloat16 or float16 gradient, got {d_out.dtype}")


def _columns(x: torch.Tensor) -> torch.Tensor:
    """``x`` with contiguous columns (the kernels take a row stride only): a view as it is, else a copy. Gradients
    often come expanded (``out.sum()``'s has stride 0), so a copy is the useful answer, not an error."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _blocks(rows: int, width: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)``: up to :data:`MAX_BLOCK_C` columns and rows enough for about :data:`TILE` elements
    per program (few programs of narrow rows, and no more rows than there are)."""
    block_c = min(next_power_of_2(width), MAX_BLOCK_C)
    block_r = max(1, min(TILE // block_c, next_power_of_2(rows)))
    return block_r, block_c


def activate_rows(pre: torch.Tensor, act: int, glu: bool, interleaved: bool, alpha: float,
                  limit: float) -> torch.Tensor:
    """The activation ``act`` (code of :mod:`moeforge.kernels.activations`; ``glu``: gated, gate and up
    ``interleaved`` or concatenated) of the rows of ``pre [R, W]``, computed in fp32: ``[R, W // 2]`` when gated,
    else ``[R, W]``, in ``pre``'s dtype (``alpha``, ``limit``: GPT-OSS's)."""
    rows, width = activated_shape(pre, act, glu)
    out = torch.empty(rows, width, dtype=pre.dtype, device=pre.device)
    if rows == 0 or width == 0:
        return out
    pre = _columns(pre)
    gate_step, up_offset = glu_strides(glu, interleaved, width)
    block_r, block_c = _blocks(rows, width)
    _ACTIVATE.launch((act, glu, block_r, block_c, pre.device), (cdiv(rows, block_r), cdiv(width, block_c)),
                     (pre, out, rows, width, pre.stride(0), out.stride(0), gate_step, up_offset, alpha, limit),
                     _launch_recipe(pre.device, act, glu, block_r, block_c))
    return out


def activate_rows_backward(pre: torch.Tensor, d_out: torch.Tensor, act: int, glu: bool, interleaved: bool,
                           alpha: float, limit: float) -> torch.Tensor:
    """``d_pre [R, W]`` in ``pre``'s dtype: the gradient of the pre-activation rows ``pre`` given ``d_out``, that of
    :func:`activate_rows`'s output (any float dtype), computed in fp32 (arguments as :func:`activate_rows`)."""
    check_gradient(pre, d_out, act, glu)
    rows, width = d_out.shape
    d_pre = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
    if rows == 0 or width == 0:
        return d_pre
    pre, d_out = _columns(pre), _columns(d_out)
    gate_step, up_offset = glu_strides(glu, interleaved, width)
    block_r, block_c = _blocks(rows, width)
    _ACTIVATE_BACKWARD.launch((act, glu, block_r, block_c, pre.device), (cdiv(rows, block_r), cdiv(width, block_c)),
                              (pre, d_out, d_pre, rows, width, pre.stride(0), d_out.stride(0), d_pre.stride(0),
                               gate_step, up_offset, alpha, limit),
                              _launch_recipe(pre.device, act, glu, block_r, block_c))
    return d_pre


def _launch_recipe(device: torch.device, act: int, glu: bool, block_r: int, block_c: int
                   ) -> Callable[[], tuple[dict[str, Any], dict[str, Any]]]:
    """The two kernels' constexprs and launch options (a :class:`LaunchSite`'s ``make``: called once per launch
    key and specialisation)."""

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(device)
        return (dict(ACT=act, GLU=glu, BLOCK_R=block_r, BLOCK_C=block_c, PDL=pdl.flag(dependent)),
                dict(num_warps=4, **pdl.launch_options(dependent)))

    return make


_ACTIVATE = LaunchSite(_activate_rows_kernel)
_ACTIVATE_BACKWARD = LaunchSite(_activate_rows_backward_kernel)


# -- autograd of moeforge::activate_rows --------------------------------------------------------------------


# What the activation's backward formula (autograd_backward) calls: the op where it is needed, else the function.
ACTIVATE_ROWS_BACKWARD = KernelOp("moeforge::activate_rows_backward", activate_rows_backward)


def autograd_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """Keep the pre-activation rows and the activation's arguments for :func:`autograd_backward`."""
    pre, act, glu, interleaved, alpha, limit = inputs
    ctx.save_for_backward(pre)
    ctx.activation = (act, glu, interleaved, alpha, limit)


def autograd_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    """The gradient of ``pre`` through the ``moeforge::activate_rows_backward`` op (traceable: it has a fake);
    the integer, flag and float arguments have none."""
    (pre,) = ctx.saved_tensors
    d_pre = ACTIVATE_ROWS_BACKWARD(pre, grad_out, *ctx.activation)
    return (d_pre,) + (None,) * len(ctx.activation)
