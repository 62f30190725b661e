# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The backward of the triton path's custom ops (``moeforge::moe_gemm``, ``moeforge::combine``,
``moeforge::route``), registered with ``torch.library.register_autograd`` in :mod:`moeforge.kernels.ops`.

**Grouped GEMM** ``out[c] = epilogue(rows[c // r] @ W[e]^T + b[e])`` (``e`` the expert of copy ``c``, the
epilogue an activation and the routing weight). The backward recomputes the pre-activation with the same
kernel (no activation, fp32 out: nothing of size ``[copies, 2I]`` is kept from the forward), takes the
epilogue's derivative with torch autograd on those rows (the same activation formulas as the torch
backend), then:

* rows: ``d_rows[c] = d_pre[c] @ W[e]`` is the same kernel again on the transposed weight view
  (``W.transpose(1, 2)``: strides, no copy), one copy per row; the token rows of the first GEMM sum their
  ``top_k`` copies in a fixed order;
* weights and biases: :func:`expert_weight_grad`, one program per (expert, N-block, K-block) walking that
  expert's row blocks in order: ``dW[e] = sum_c d_pre[c]^T rows[c // r]`` and ``db[e] = sum_c d_pre[c]``,
  deterministic (no atomics; each expert's copies summed in ascending order, :func:`canonical_order`, not in
  the order the alignment's atomics placed them);
* routing weights: ``<d_out[c], epilogue input[c]>`` from the autograd step.

Only float weights differentiate: the quantized formats are inference-only and their backward raises.
**Combine** and **routing** backward are small torch computations on ``[T, k]`` / ``[T, k, H]`` tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.errors import InputError
from moeforge.kernels import activations as codes
from moeforge.kernels.formats import WeightFormat
from moeforge.activation import apply_activation
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmWeight, decode_config,
                                                grouped_gemm)


# -- expert weight gradient ---------------------------------------------------------------------------


@triton.jit
def _expert_weight_grad_kernel(
    dy_ptr, x_ptr, dw_ptr, db_ptr, sorted_ids_ptr, first_block_ptr,
    N, K, num_copies, rows_per_a,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_dwe, stride_dwn, stride_dwk, stride_dbe, stride_dbn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0).to(tl.int64)  # expert * stride_dwe passes 2**31 on DeepSeek-sized layers
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    first = tl.load(first_block_ptr + expert)
    last = tl.load(first_block_ptr + expert + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for block in range(first, last):  # the expert's row blocks, in order
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        copies = tl.load(sorted_ids_ptr + offs_m)
        ok = copies < num_copies
        dy = tl.load(dy_ptr + copies.to(tl.int64)[None, :] * stride_dym + offs_n[:, None] * stride_dyn,
                     mask=ok[None, :] & n_ok[:, None], other=0.0)
        rows = (copies // rows_per_a).to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(dy, x, acc, input_precision=PRECISION)
        if HAS_BIAS:
            bias += tl.sum(dy.to(tl.float32), axis=1)
    tl.store(dw_ptr + expert * stride_dwe + offs_n[:, None] * stride_dwn + offs_k[None, :] * stride_dwk,
             acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            tl.store(db_ptr + expert * stride_dbe + offs_n * stride_dbn, bias.to(db_ptr.dtype.element_ty), mask=n_ok)


def expert_first_blocks(block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int,
                        num_experts: int) -> torch.Tensor:
    """``first[e]`` = the first row block of expert ``e`` (``[E + 1]``; ``first[E]`` = the number of used
    blocks), from the alignment's block -> expert table (experts in ascending order), on the device."""
    blocks = torch.arange(block_expert.numel(), device=block_expert.device)
    used = blocks < num_padded.to(torch.int64) // block_m
    owners = torch.where(used, block_expert.to(torch.int64), num_experts)
    return torch.searchsorted(owners, torch.arange(num_experts + 1, device=owners.device)).to(torch.int32)


def canonical_order(sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int,
                    num_copies: int, num_experts: int) -> torch.Tensor:
    """``sorted_ids`` with each expert's copies in ascending order, its padding after them, in the same
    slots (every expert keeps its blocks), on the device. The alignment's scatter places an expert's
    copies in the order its atomics happened to run, which changes from run to run; a sum over an
    expert's rows in slot order (the weight gradient) would change in its last bits with it."""
    slots = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    used = slots < num_padded.to(torch.int64)
    owner = block_expert.to(torch.int64).repeat_interleave(block_m)[:sorted_ids.numel()]
    stride = num_copies + 1  # the padding sentinel is num_copies: last of its expert
    keys = torch.where(used, owner * stride + sorted_ids.to(torch.int64), num_experts * stride + slots)
    ordered = torch.sort(keys).values  # the used keys, in expert order, fill exactly the used slots
    return torch.where(used, ordered % stride, sorted_ids.to(torch.int64)).to(sorted_ids.dtype)


def expert_weight_grad(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
                       block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int,
                       with_bias: bool, dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(dW [E, N, K], db [E, N] or None)`` in ``dtype`` (summed in fp32): for each expert the sum over its
    copies ``c`` of ``d_rows[c]^T rows[c // rows_per_a]`` (``d_rows [copies, N]``, ``rows [R, K]`` of one
    dtype), each expert's copies summed in ascending order (:func:`canonical_order` of ``sorted_ids``, aligned
    with ``block_m``): the same bits from run to run, whatever order the alignment's atomics gave."""
    num_copies, n = d_rows.shape
    k = rows.shape[1]
    dw = torch.empty(num_experts, n, k, dtype=dtype, device=rows.device)
    db = torch.empty(num_experts, n, dtype=dtype, device=rows.device) if with_bias else None
    first = expert_first_blocks(block_expert, num_padded, block_m, num_experts)
    sorted_ids = canonical_order(sorted_ids, block_expert, num_padded, block_m, num_copies, num_experts)
    wide = rows.element_size() < 4 and rows.is_cuda
    block_n, block_k = (128, 128) if wide else (32, 32)
    grid = (num_experts, triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    dbias = db if db is not None else dw
    _expert_weight_grad_kernel[grid](
        d_rows, rows, dw, dbias, sorted_ids, first,
        n, k, num_copies, rows_per_a,
        d_rows.stride(0), d_rows.stride(1), rows.stride(0), rows.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        dbias.stride(0), dbias.stride(1),
        HAS_BIAS=with_bias, PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8 if wide else 4, num_stages=3 if wide else 2,
    )
    return dw, db


# -- the ops' backward ------------------------------------------------------------------------------

_MOE_GEMM_INPUTS = ("a", "a_scale", "weight", "weight_scale", "weight_zero", "weight_global", "bias",
                    "topk_weights", "sorted_ids", "block_expert", "num_padded", "num_copies", "rows_per_a",
                    "weight_format", "a_global", "act", "glu", "interleaved", "alpha", "limit", "config",
                    "out_dtype", "fp8_out", "aligned_block_m", "weight_scale_max", "weight_shuffled")


def moe_gemm_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    args = dict(zip(_MOE_GEMM_INPUTS, inputs))
    ctx.args = {name: value for name, value in args.items() if not isinstance(value, torch.Tensor)}
    ctx.save_for_backward(args["a"], args["weight"], args["bias"], args["topk_weights"], args["sorted_ids"],
                          args["block_expert"], args["num_padded"])
    ctx.quantized = (args["weight_format"] != int(WeightFormat.FLOAT) or args["fp8_out"]
                     or args["a"].dtype not in (torch.bfloat16, torch.float16, torch.float32))


def moe_gemm_backward(ctx: Any, grad_out: torch.Tensor, grad_out_scale: Optional[torch.Tensor]) -> tuple[Any, ...]:
    if ctx.quantized:
        raise InputError("the quantized grouped GEMMs are inference-only: they have no backward (train an "
                         "unquantized layer, then quantize it)")
    a, weight, bias, topk_weights, sorted_ids, block_expert, num_padded = ctx.saved_tensors
    p = ctx.args
    config = decode_config(p["config"])
    aligned = p.get("aligned_block_m", 0) or config.block_m  # the block sorted_ids was aligned with
    route = GemmRoute(sorted_ids, block_expert, num_padded, p["num_copies"], aligned_block_m=aligned)
    # The pre-activation rows, recomputed in fp32 ([copies, N_w], in the weight's row order).
    pre, _ = grouped_gemm(GemmRows(a, rows_per_a=p["rows_per_a"]), GemmWeight(weight), route,
                          GemmEpilogue(torch.float32, bias=bias), config)
    activation = codes.config_of(p["act"], p["glu"], p["interleaved"], p["alpha"], p["limit"])
    with torch.enable_grad():
        pre_leaf = pre.detach().requires_grad_()
        weights_leaf = topk_weights.detach().float().requires_grad_() if topk_weights is not None else None
        y = apply_activation(pre_leaf, activation) if activation is not None else pre_leaf
        if weights_leaf is not None:
            y = y * weights_leaf[:, None]
        leaves = [pre_leaf] + ([weights_leaf] if weights_leaf is not None else [])
        grads = torch.autograd.grad(y, leaves, grad_out.float())
    d_pre = grads[0].to(a.dtype)
    d_topk = grads[1].to(topk_weights.dtype) if topk_weights is not None else None
    needs = ctx.needs_input_grad
    d_a = d_weight = d_bias = None
    if needs[0]:
        # d_rows[c] = d_pre[c] @ W[e]: the same kernel on the transposed weight, one copy per row.
        d_rows, _ = grouped_gemm(GemmRows(d_pre), GemmWeight(weight.transpose(1, 2)), route,
                                 GemmEpilogue(torch.float32), config)
        r = p["rows_per_a"]
        d_a = (d_rows.view(-1, r, d_rows.shape[1]).sum(1) if r > 1 else d_rows).to(a.dtype)
    if needs[2] or (bias is not None and needs[6]):
        dw, db = torch.ops.moeforge.expert_weight_grad(d_pre, a, p["rows_per_a"], sorted_ids, block_expert,
                                                       num_padded, weight.shape[0], aligned,
                                                       bias is not None and needs[6], weight.dtype)
        d_weight = dw if needs[2] else None
        d_bias = db if bias is not None and needs[6] else None
    grads_out: list[Any] = [None] * len(_MOE_GEMM_INPUTS)
    grads_out[0], grads_out[2], grads_out[6], grads_out[7] = d_a, d_weight, d_bias, d_topk
    return tuple(grads_out)


def combine_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    rows, weights, top_k, scale, _ = inputs
    ctx.save_for_backward(rows, weights)
    ctx.top_k, ctx.scale = top_k, scale


def combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    """``out[t] = scale * sum_j rows[t k + j] * w[t, j]``: ``d_rows[t k + j] = scale * w[t, j] * d_out[t]``,
    ``d_w[t, j] = scale * <d_out[t], rows[t k + j]>``."""
    rows, weights = ctx.saved_tensors
    k, scale = ctx.top_k, ctx.scale
    g = grad_out.float()[:, None, :] * scale  # [T, 1, H]
    w = weights.float()[..., None] if weights is not None else g.new_ones(1, k, 1)  # [T or 1, k, 1]
    d_rows = (g * w).reshape(rows.shape).to(rows.dtype)
    d_weights = None
    if weights is not None and ctx.needs_input_grad[1]:
        d_weights = (g * rows.float().view(-1, k, rows.shape[1])).sum(-1).to(weights.dtype)
    return d_rows, d_weights, None, None, None


_ROUTE_INPUTS = ("router_logits", "selection_bias", "top_k", "sigmoid", "select_first", "renormalize", "n_group",
                 "topk_group", "group_max", "scaling", "group_mask_value")


def route_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    args = dict(zip(_ROUTE_INPUTS, inputs))
    ctx.save_for_backward(args["router_logits"], output[1])
    ctx.flags = (args["sigmoid"], args["select_first"], args["renormalize"], args["scaling"])


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, sigmoid: bool, select_first: bool, renormalize: bool,
                    scaling: float) -> torch.Tensor:
    """The routing kernel's weights of the chosen ``ids`` as a differentiable function of ``logits``
    (the selection itself, biases and group masks included, is piecewise constant)."""
    logits = logits.float()
    ids = ids.long()
    if select_first:
        chosen = logits.gather(-1, ids)
        weights = chosen.sigmoid() if sigmoid else chosen.softmax(-1)
    else:
        scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
        weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling


def route_backward(ctx: Any, grad_weights: torch.Tensor, grad_ids: Optional[torch.Tensor]) -> tuple[Any, ...]:
    logits, ids = ctx.saved_tensors
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_()
        weights = routing_weights(leaf, ids, *ctx.flags)
        (d_logits,) = torch.autograd.grad(weights, leaf, grad_weights.float())
    return (d_logits.to(logits.dtype),) + (None,) * (len(_ROUTE_INPUTS) - 1)
