"""The backward of the triton path's custom ops (``moeforge::moe_gemm``, ``moeforge::combine``,
``moeforge::route``), registered with ``torch.library.register_autograd`` in :mod:`moeforge.kernels.ops`.

**Grouped GEMM** ``out[c] = epilogue(rows[c // r] @ W[e]^T + b[e])`` (``e`` the expert of copy ``c``, the
epilogue an activation and the routing weight). ``d_pre``, the gradient of the product, is ``grad_out`` itself
where the epilogue is plain (the down projection, and the training forward's gate/up GEMM, whose activation is
then its own op, :mod:`moeforge.kernels.activation_rows`, keeping the pre-activation rows). With an activation or
routing weights in the epilogue (inference layouts that are differentiated anyway) the backward recomputes the
pre-activation with the same kernel in fp32 and takes the epilogue's derivative with torch autograd on those rows
(the same activation formulas as the torch backend). Then:

* rows: ``d_rows[c] = d_pre[c] @ W[e]`` is the same kernel again on the transposed weight view
  (``W.transpose(1, 2)``: strides, no copy), one copy per row, in the rows' dtype; the token rows of the first
  GEMM (``r = top_k`` copies each) sum their copies in fp32 in a fixed order (each copy rounded to the rows'
  dtype first, as torch's path rounds each product: half the bytes of fp32 copies, and a 2-byte output lets
  the launch overlap a tile's epilogue with the next tile's loads);
  rows a dispatch gathered from token rows (:class:`~moeforge.kernels.grouped_gemm_call.GemmRows`'s
  ``gathered_from``: slot order), into those token rows by the gather's index, the rows themselves given no gradient
  (the gather's backward would make the same sum after this backward: the rows' gradient, as large as the rows, would
  be held through the weight gradient);
* weights and biases: :func:`moeforge.kernels.weight_grad.expert_weight_grad`, a k-grouped GEMM on the rows
  gathered in slot order, deterministic (no atomics; each expert's copies summed in ascending order);
* routing weights in the epilogue: ``<d_out[c], epilogue input[c]>`` from the autograd step;
* a low-rank update ``scale * u[c] @ B[e]^T`` (:class:`~moeforge.kernels.grouped_gemm_call.GemmUpdate`): ``u``'s
  gradient ``scale * d_pre[c] @ B[e]`` (rank-wide tiles) and ``B``'s by the k-grouped GEMM; where ``u`` came from
  the GEMM's own rows, ``u[c] = rows[c // r] @ A[e]^T`` recorded by no op (the update's ``source`` ``A``), ``A``'s
  gradient too, and ``d u[c] @ A[e]`` joins the rows' gradient as the row-gradient launch's own update — the rows'
  copies summed once, where ``x Aᵀ``'s own launch would have a row gradient, a sum over the copies and an add of its own.

Only float weights differentiate: the quantized formats are inference-only and their backward raises.
**Combine**: one kernel (:func:`moeforge.kernels.combine.combine_backward`). **Routing** weights: a small torch
computation on ``[T, k]`` tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moeforge.errors import InputError
from moeforge.kernels import activations as codes
from moeforge.kernels import combine, narrow_weight_grad, slot_rows, weight_grad
from moeforge.kernels.formats import WeightFormat
from moeforge.activation import ActivationConfig, apply_activation
from moeforge.kernels.config import GemmConfig, narrow_config, row_gradient_config
from moeforge.kernels.grouped_gemm_call import ARGUMENT_NAMES as _MOE_GEMM_INPUTS
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmUpdate, GemmWeight,
                                                config_of, grouped_gemm)


# -- the ops' backward ------------------------------------------------------------------------------

_GATHERED_FROM = _MOE_GEMM_INPUTS.index("gathered_from")


def moe_gemm_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    args = dict(zip(_MOE_GEMM_INPUTS, inputs))
    ctx.args = {name: value for name, value in args.items() if not isinstance(value, torch.Tensor)}
    ctx.save_for_backward(args["a"], args["weight"], args["bias"], args["topk_weights"], args["sorted_ids"],
                          args["block_expert"], args["num_padded"], args.get("update_rows"), args.get("update_weight"),
                          args.get("slot_runs"), args.get("update_source"), args.get("gathered_index"))
    update_weight = args.get("update_weight")
    ctx.stacked_update = args.get("update_ids") is not None or (update_weight is not None and update_weight.dim() == 4)
    ctx.quantized = (args["weight_format"] != int(WeightFormat.FLOAT) or args["fp8_out"]
                     or args["a"].dtype not in (torch.bfloat16, torch.float16, torch.float32))


def moe_gemm_backward(ctx: Any, grad_out: torch.Tensor, grad_out_scale: Optional[torch.Tensor]) -> tuple[Any, ...]:
    if ctx.quantized:
        raise InputError("the quantized grouped GEMMs are inference-only: they have no backward (train an "
                         "unquantized layer, then quantize it)")
    if ctx.stacked_update:
        raise InputError("a stack of low-rank updates inside the grouped GEMM (update_weight [S, E, N_w, R]) is the "
                         "serving path: it has no backward (an adapter stack trains through its own launches)")
    (a, weight, bias, topk_weights, sorted_ids, block_expert, num_padded, update_rows, update_weight,
     slot_runs, source, gathered_index) = ctx.saved_tensors
    p = ctx.args
    config = config_of(p["config"])
    aligned = p.get("aligned_block_m", 0) or config.block_m  # the block sorted_ids was aligned with
    route = GemmRoute(sorted_ids, block_expert, num_padded, p["num_copies"], aligned_block_m=aligned,
                      slot_copies=p.get("slot_copies", 0), slot_runs=slot_runs)
    activation = codes.config_of(p["act"], p["glu"], p["interleaved"], p["alpha"], p["limit"])
    if activation is None and topk_weights is None:
        # A plain GEMM (the down projection; the training forward's gate/up, whose activation is its own op):
        # the gradient of the rows it wrote is the gradient of its product.
        d_pre, d_topk = grad_out.to(a.dtype).contiguous(), None
    else:
        update = (GemmUpdate(update_rows, update_weight, p.get("update_scale", 1.0)) if update_rows is not None
                  else None)
        d_pre, d_topk = _epilogue_backward(a, weight, bias, topk_weights, grad_out, route, config, p, activation,
                                           update)
    needs = ctx.needs_input_grad
    d_a = d_weight = d_bias = d_source = d_gathered = None
    # rows gathered from token rows (GemmRows.gathered_from): their gradient goes to the token rows, summed here, and
    # the rows get none (they are the gather's output, whose gradient would only reach those token rows)
    gathered = gathered_index is not None and len(needs) > _GATHERED_FROM and needs[_GATHERED_FROM]
    source_needs = len(needs) > 32 and needs[32]
    d_low = None  # the update rows' gradient where they came from ``source`` (see GemmUpdate.source)
    update_grads = None  # (the update's gradients where computed with d_low: its rows' none, its weight's)
    if source is not None and (needs[0] or source_needs):
        d_low, d_update_weight = _update_backward(d_pre, update_rows, update_weight, route, config, p, True,
                                                  needs[27])
        update_grads = (None, d_update_weight)
    if (needs[0] and gathered_index is None) or gathered:
        # d_rows[c] = d_pre[c] @ W[e]: the same kernel on the transposed weight, one copy per row in the rows'
        # dtype (and, for an update's rows from ``source``, d_low[c] @ source[e] as its update: one more K-step).
        # Copies that share a row (the first GEMM's top_k) are summed in fp32, in a fixed order (the combine's
        # kernel: one launch, written in the rows' dtype); rows gathered from token rows, into those token rows by
        # their index, the same sum the gather's backward makes.
        r = p["rows_per_a"]
        d_rows, _ = grouped_gemm(GemmRows(d_pre), GemmWeight(weight.transpose(1, 2)), route,
                                 GemmEpilogue(a.dtype),
                                 row_gradient_config(config, int(weight.shape[2]), int(weight.shape[1])),
                                 GemmUpdate(d_low, source.transpose(1, 2)) if d_low is not None else None)
        if gathered:
            d_gathered = combine.COMBINE(d_rows, None, int(gathered_index.shape[1]), 1.0, a.dtype, gathered_index)
        else:
            d_a = combine.COMBINE(d_rows, None, r, 1.0, a.dtype) if r > 1 else d_rows
        del d_rows  # (the copies, [copies, K]: released before the weight gradient allocates its own)
    if d_low is not None and source_needs:
        d_source, _ = weight_grad.EXPERT_WEIGHT_GRAD(d_low, a, p["rows_per_a"], sorted_ids, block_expert, num_padded,
                                                     source.shape[0], aligned, False, source.dtype,
                                                     route.slot_copies, route.slot_runs)
    if needs[2] or (bias is not None and needs[6]):
        dw, db = weight_grad.EXPERT_WEIGHT_GRAD(d_pre, a, p["rows_per_a"], sorted_ids, block_expert, num_padded,
                                                weight.shape[0], aligned, bias is not None and needs[6], weight.dtype,
                                                route.slot_copies, route.slot_runs)
        d_weight = dw if needs[2] else None
        d_bias = db if bias is not None and needs[6] else None
    grads_out: list[Any] = [None] * len(_MOE_GEMM_INPUTS)
    grads_out[0], grads_out[2], grads_out[6], grads_out[7] = d_a, d_weight, d_bias, d_topk
    if update_rows is not None and update_weight is not None:
        grads_out[26], grads_out[27] = update_grads or _update_backward(
            d_pre, update_rows, update_weight, route, config, p, needs[26] and source is None, needs[27])
    grads_out[32] = d_source
    grads_out[_GATHERED_FROM] = d_gathered
    return tuple(grads_out[:len(ctx.needs_input_grad)])


def _update_backward(d_pre: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, route: GemmRoute,
                     config: GemmConfig, p: dict[str, Any], rows_need: bool, weight_needs: bool
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients of a low-rank update ``scale * rows[c] @ weight[e]^T`` (:class:`GemmUpdate`) from ``d_pre``, the
    product's: ``scale * d_pre[c] @ weight[e]`` for the rows (the kernel on the transposed weight, rank-wide
    tiles), ``scale * sum_c d_pre[c]^T rows[c]`` for the weight (the k-grouped GEMM, deterministic); both from one
    read of ``d_pre`` where both are asked and the update is an adapter's
    (:func:`moeforge.kernels.narrow_weight_grad.update_grads`)."""
    scale = float(p.get("update_scale", 1.0))
    d_pre = d_pre.to(rows.dtype)
    if rows_need and weight_needs and narrow_weight_grad.update_grads_problem(d_pre, rows, weight,
                                                                              route.slot_copies) is None:
        # both from one read of d_pre (an adapter's: rank at most 64, rows by index from the alignment)
        return narrow_weight_grad.UPDATE_GRADS(d_pre, rows, weight, route.sorted_ids, route.block_expert,
                                               route.num_padded, route.aligned_block_m or config.block_m, scale)
    d_rows = d_weight = None
    if rows_need:
        d_rows, _ = grouped_gemm(GemmRows(d_pre), GemmWeight(weight.transpose(1, 2)), route,
                                 GemmEpilogue(rows.dtype), narrow_config(config.block_m, int(weight.shape[2]),
                                                                         int(weight.shape[1])))
        d_rows = d_rows * scale if scale != 1.0 else d_rows
    if weight_needs:
        d_weight, _ = weight_grad.EXPERT_WEIGHT_GRAD(d_pre, rows, 1, route.sorted_ids,
                                                     route.block_expert, route.num_padded, weight.shape[0],
                                                     route.aligned_block_m or config.block_m, False, weight.dtype,
                                                     route.slot_copies, route.slot_runs, scale)
    return d_rows, d_weight


def _epilogue_backward(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       topk_weights: Optional[torch.Tensor], grad_out: torch.Tensor, route: GemmRoute,
                       config: GemmConfig, p: dict[str, Any], activation: Optional[ActivationConfig],
                       update: Optional[GemmUpdate] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(d_pre, d_topk)`` through an epilogue with an activation or routing weights: the pre-activation rows
    (with the low-rank update, where there is one) recomputed by the same kernel in fp32 (``[copies, N_w]``, in the
    weight's row order), the epilogue's derivative by torch autograd on them."""
    pre, _ = grouped_gemm(GemmRows(a, rows_per_a=p["rows_per_a"]), GemmWeight(weight), route,
                          GemmEpilogue(torch.float32, bias=bias), config, update)
    with torch.enable_grad():
        pre_leaf = pre.detach().requires_grad_()
        weights_leaf = topk_weights.detach().float().requires_grad_() if topk_weights is not None else None
        y = apply_activation(pre_leaf, activation) if activation is not None else pre_leaf
        if weights_leaf is not None:
            y = y * weights_leaf[:, None]
        leaves = [pre_leaf] + ([weights_leaf] if weights_leaf is not None else [])
        grads = torch.autograd.grad(y, leaves, grad_out.float())
    d_topk = grads[1].to(topk_weights.dtype) if topk_weights is not None else None
    return grads[0].to(a.dtype), d_topk


def combine_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    rows, weights, top_k, scale, _ = inputs[:5]
    index = inputs[5] if len(inputs) > 5 else None
    ctx.save_for_backward(rows, weights, index)
    ctx.top_k, ctx.scale, ctx.inputs = top_k, scale, len(inputs)


def combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    """``out[t] = scale * sum_j rows[r(t, j)] * w[t, j]`` (``r(t, j) = t k + j``, or ``index[t, j]``):
    ``d_rows[r(t, j)] = scale * w[t, j] * d_out[t]``, ``d_w[t, j] = scale * <d_out[t], rows[r(t, j)]>`` (the
    ``moeforge::combine_backward`` op: :func:`moeforge.kernels.combine.combine_backward`, one pass)."""
    rows, weights, index = ctx.saved_tensors
    weight_grad = weights is not None and ctx.needs_input_grad[1]
    d_rows, d_weights = combine.COMBINE_BACKWARD(grad_out, rows, weights, ctx.top_k, ctx.scale, weight_grad, index)
    grads: tuple[Any, ...] = (d_rows, d_weights if weight_grad else None) + (None,) * (ctx.inputs - 2)
    return grads


def gather_slots_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weights, _, _, _, top_k, _, _ = inputs
    ctx.save_for_backward(output[2])
    ctx.top_k, ctx.dtype = top_k, x.dtype
    # (an output nothing read, the slots' routing weights where the combine applies the weights, has no gradient:
    # None, not zeros, so that its backward is skipped)
    ctx.set_materialize_grads(False)


def gather_slots_backward(ctx: Any, d_xs: torch.Tensor, d_slot_weights: Optional[torch.Tensor], d_slot_of: Any,
                          d_positions: Any, d_runs: Any) -> tuple[Any, ...]:
    """``xs[s] = x[c // k]`` and ``slot_weights[s] = w[c]`` for the copy ``c`` in slot ``s``: each token's slot rows'
    gradients summed (:func:`moeforge.kernels.slot_rows.gather_slots_backward`), each copy's weight's gradient read
    at its slot."""
    (slot_of,) = ctx.saved_tensors
    weights_need = ctx.needs_input_grad[1] and d_slot_weights is not None
    if d_xs is None:  # (the rows unread: a gradient of the weights alone)
        d_weights = d_slot_weights.index_select(0, slot_of) if weights_need else None
        return (None, d_weights) + (None,) * 6
    d_x, d_weights = slot_rows.gather_slots_backward(d_xs, d_slot_weights if weights_need else None, slot_of,
                                                     ctx.top_k, ctx.dtype)
    return (d_x if ctx.needs_input_grad[0] else None, d_weights) + (None,) * 6


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
