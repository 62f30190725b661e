"""The Triton kernels as ``torch.library`` custom ops (namespace ``moeforge``).

Custom ops with fake (meta) implementations let ``torch.compile`` trace through the forward and let
CUDA graphs capture it: every output size depends only on input sizes, never on values. Importing
this module registers the ops once; the Triton stages import it when they are first built.

Each kernel is a :class:`~moeforge.kernels.kernel_op.KernelOp` of this module (``ops.moe_gemm``, ``ops.route``,
...): called like its op, it runs the implementation directly in an eager call that records no gradient on plain
tensors, and the op everywhere else (``torch.compile``, autograd, fake tensors, dispatch modes). The package calls
the kernels that way; ``torch.ops.moeforge.<name>`` is the op itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.kernels import (activation_rows, align, backward, combine, grouped_gemm_call, narrow_weight_grad,
                              quantize, slot_rows, stack_pairs as pairs, stack_shrink as shrink, stack_wide as wide,
                              topk, weight_grad)
from moeforge.kernels.kernel_op import KernelOp
from moeforge.kernels.sizes import cdiv


def _align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, ordered: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return align.align_block_size(topk_ids, num_experts, block_m, ordered)


_align_block_size_op = torch.library.custom_op("moeforge::align_block_size", _align_block_size, mutates_args=())
align_block_size = KernelOp(_align_block_size_op, _align_block_size)


@_align_block_size_op.register_fake
def _(topk_ids: torch.Tensor, num_experts: int, block_m: int,
      ordered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    size = max(align.max_padded_rows(topk_ids.numel(), num_experts, block_m), block_m)
    new = topk_ids.new_empty
    return new(size, dtype=torch.int32), new(cdiv(size, block_m), dtype=torch.int32), new(1, dtype=torch.int32)


def _stack_pairs(ids: torch.Tensor, copy_experts: Optional[torch.Tensor], sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int, stack: int, num_experts: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return pairs.stack_pairs(ids, copy_experts, sorted_ids, block_expert, num_padded, block_m, stack, num_experts,
                             scale)


_stack_pairs_op = torch.library.custom_op("moeforge::stack_pairs", _stack_pairs, mutates_args=())
stack_pairs = KernelOp(_stack_pairs_op, _stack_pairs)


@_stack_pairs_op.register_fake
def _(ids: torch.Tensor, copy_experts: Optional[torch.Tensor], sorted_ids: torch.Tensor, block_expert: torch.Tensor,
      num_padded: torch.Tensor, block_m: int, stack: int, num_experts: int,
      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    copies = ids.numel()
    return (ids.new_empty(copies, dtype=torch.int32), ids.new_empty(copies, dtype=torch.int32),
            ids.new_empty(copies, dtype=torch.float32))


def _stack_shrink(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, copy_experts: torch.Tensor,
                  rows_per_a: int) -> torch.Tensor:
    return shrink.stack_shrink(rows, a, ids, copy_experts, rows_per_a)


_stack_shrink_op = torch.library.custom_op("moeforge::stack_shrink", _stack_shrink, mutates_args=())
stack_shrink = KernelOp(_stack_shrink_op, _stack_shrink)


@_stack_shrink_op.register_fake
def _(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, copy_experts: torch.Tensor,
      rows_per_a: int) -> torch.Tensor:
    copies = ids.numel()
    ranges, _ = shrink.shrink_ranges(copies, a.shape[3], rows.device)
    return rows.new_empty(ranges, copies, a.shape[2], dtype=torch.float32)


def _stack_reduce(parts: torch.Tensor, ids: torch.Tensor, stack: int, scale: float,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return shrink.reduce_parts(parts, ids, stack, scale, out_dtype)


_stack_reduce_op = torch.library.custom_op("moeforge::stack_reduce", _stack_reduce, mutates_args=())
stack_reduce = KernelOp(_stack_reduce_op, _stack_reduce)


@_stack_reduce_op.register_fake
def _(parts: torch.Tensor, ids: torch.Tensor, stack: int, scale: float,
      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (parts.new_empty(parts.shape[1], parts.shape[2], dtype=out_dtype),
            ids.new_empty(parts.shape[1], dtype=torch.int32))


def _stack_wide(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, sorted_ids: torch.Tensor,
                block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int, num_copies: int, rows_per_a: int,
                scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    return wide.stack_wide(rows, a, ids, sorted_ids, block_expert, num_padded, block_m, num_copies, rows_per_a, scale,
                           out_dtype)


_stack_wide_op = torch.library.custom_op("moeforge::stack_wide", _stack_wide, mutates_args=())
stack_wide = KernelOp(_stack_wide_op, _stack_wide)


@_stack_wide_op.register_fake
def _(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
      num_padded: torch.Tensor, block_m: int, num_copies: int, rows_per_a: int, scale: float,
      out_dtype: torch.dtype) -> torch.Tensor:
    return rows.new_empty(num_copies, a.shape[0] * a.shape[2], dtype=out_dtype)


_moe_gemm_op = torch.library.custom_op("moeforge::moe_gemm", grouped_gemm_call.launch, mutates_args=())
moe_gemm = grouped_gemm_call.MOE_GEMM  # its implementation lives beside its one caller


@_moe_gemm_op.register_fake
def _(a: torch.Tensor, a_scale: Optional[torch.Tensor], weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
      weight_zero: Optional[torch.Tensor], weight_global: Optional[torch.Tensor], bias: Optional[torch.Tensor],
      topk_weights: Optional[torch.Tensor], sorted_ids: torch.Tensor, block_expert: torch.Tensor,
      num_padded: torch.Tensor, num_copies: int, rows_per_a: int, weight_format: int, a_global: float, act: int,
      glu: bool, interleaved: bool, alpha: float, limit: float, config: list[int], out_dtype: torch.dtype,
      fp8_out: bool, aligned_block_m: int = 0, weight_scale_max: int = 255, weight_shuffled: bool = False,
      update_rows: Optional[torch.Tensor] = None, update_weight: Optional[torch.Tensor] = None,
      update_scale: float = 1.0, update_ids: Optional[torch.Tensor] = None, slot_copies: int = 0,
      slot_runs: Optional[torch.Tensor] = None, update_source: Optional[torch.Tensor] = None,
      gathered_from: Optional[torch.Tensor] = None, gathered_index: Optional[torch.Tensor] = None
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_gemm_call.outputs(a, weight, num_copies, glu, out_dtype, fp8_out)


def _quantized_shapes(x: torch.Tensor, per_group: bool, glu: bool) -> tuple[int, int, int]:
    width = x.shape[1] // 2 if glu else x.shape[1]
    return x.shape[0], width, width // quantize.GROUP if per_group else 1


def _quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    per_group: bool,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the rows of ``x`` (after the activation ``act``, when not 0)."""
    rows, width, groups = _quantized_shapes(x, per_group, glu)
    q = torch.empty(rows, width, dtype=dtype, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    quantize.quantize_rows(x, q, scale, per_group=per_group, act=act, glu=glu, interleaved=interleaved,
                           alpha=alpha, limit=limit)
    return q, scale


_quantize_rows_op = torch.library.custom_op("moeforge::quantize_rows", _quantize_rows, mutates_args=())
quantize_rows = KernelOp(_quantize_rows_op, _quantize_rows)


@_quantize_rows_op.register_fake
def _(x: torch.Tensor, dtype: torch.dtype, per_group: bool, act: int, glu: bool, interleaved: bool,
      alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width, groups = _quantized_shapes(x, per_group, glu)
    return x.new_empty(rows, width, dtype=dtype), x.new_empty(rows, groups, dtype=torch.float32)


_combine_copies_op = torch.library.custom_op("moeforge::combine", combine.combined, mutates_args=())
combine_copies = KernelOp(_combine_copies_op, combine.combined, differentiable=True)


@_combine_copies_op.register_fake
def _(rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, scale: float,
      out_dtype: torch.dtype, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    tokens = index.shape[0] if index is not None else rows.shape[0] // top_k
    return rows.new_empty(tokens, rows.shape[1], dtype=out_dtype)


_combine_backward_op = torch.library.custom_op("moeforge::combine_backward", combine.backward_for_op,
                                               mutates_args=())
combine_backward = combine.COMBINE_BACKWARD


@_combine_backward_op.register_fake
def _(grad_out: torch.Tensor, rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, scale: float,
      weight_grad: bool, index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    d_weights = grad_out.new_empty(grad_out.shape[0], top_k, dtype=weights.dtype) \
        if weight_grad and weights is not None else rows.new_empty(0, dtype=torch.float32)
    return rows.new_empty(rows.shape), d_weights


def _route(
    router_logits: torch.Tensor,
    selection_bias: Optional[torch.Tensor],
    top_k: int,
    sigmoid: bool,
    select_first: bool,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_max: bool,
    scaling: float,
    group_mask_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return topk.route(router_logits, selection_bias, top_k, sigmoid=sigmoid, select_first=select_first,
                      renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                      group_max=group_max, scaling=scaling, group_mask_value=group_mask_value)


_route_op = torch.library.custom_op("moeforge::route", _route, mutates_args=())
route = KernelOp(_route_op, _route, differentiable=True)


@_route_op.register_fake
def _(router_logits: torch.Tensor, selection_bias: Optional[torch.Tensor], top_k: int, sigmoid: bool,
      select_first: bool, renormalize: bool, n_group: int, topk_group: int, group_max: bool,
      scaling: float, group_mask_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = router_logits.shape[0]
    return (router_logits.new_empty(tokens, top_k, dtype=torch.float32),
            router_logits.new_empty(tokens, top_k, dtype=torch.int32))


_expert_weight_grad_op = torch.library.custom_op("moeforge::expert_weight_grad", weight_grad.grads_for_op,
                                                 mutates_args=())
expert_weight_grad = weight_grad.EXPERT_WEIGHT_GRAD


@_expert_weight_grad_op.register_fake
def _(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
      block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int, with_bias: bool,
      dtype: torch.dtype, slot_copies: int = 0, slot_runs: Optional[torch.Tensor] = None,
      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = d_rows.shape[1], rows.shape[1]
    return (d_rows.new_empty(num_experts, n, k, dtype=dtype),
            d_rows.new_empty(num_experts, n, dtype=dtype) if with_bias else d_rows.new_empty(0, dtype=dtype))


_update_grads_op = torch.library.custom_op("moeforge::update_grads", narrow_weight_grad.update_grads_for_op,
                                           mutates_args=())


@_update_grads_op.register_fake
def _(d_pre: torch.Tensor, u: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
      num_padded: torch.Tensor, aligned_block_m: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return u.new_empty(d_pre.shape[0], b.shape[2]), b.new_empty(b.shape)


def _gather_slots(x: torch.Tensor, weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, num_experts: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token rows in the alignment's slot order: :func:`moeforge.kernels.slot_rows.gather_slots`.
    Differentiable in ``x`` and ``weights``."""
    return slot_rows.gather_slots(x, weights, sorted_ids, block_expert, num_padded, top_k, num_experts, block_m)


_gather_slots_op = torch.library.custom_op("moeforge::gather_slots", _gather_slots, mutates_args=())
gather_slots = KernelOp(_gather_slots_op, _gather_slots, differentiable=True)


@_gather_slots_op.register_fake
def _(x: torch.Tensor, weights: Optional[torch.Tensor], sorted_ids: torch.Tensor, block_expert: torch.Tensor,
      num_padded: torch.Tensor, top_k: int, num_experts: int,
      block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.shape[0] * top_k
    return (x.new_empty(rows, x.shape[1]), x.new_empty(rows if weights is not None else 0, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.int32), x.new_empty(sorted_ids.numel(), dtype=torch.int32),
            x.new_empty(4, num_experts + 1, dtype=torch.int32))


def _activate_rows(pre: torch.Tensor, act: int, glu: bool, interleaved: bool, alpha: float,
                  limit: float) -> torch.Tensor:
    """The activation ``act`` of the pre-activation rows ``pre [R, W]`` (``[R, W // 2]`` when gated), in ``pre``'s
    dtype: :func:`moeforge.kernels.activation_rows.activate_rows`. Differentiable: its backward keeps ``pre``."""
    return activation_rows.activate_rows(pre, act, glu, interleaved, alpha, limit)


_activate_rows_op = torch.library.custom_op("moeforge::activate_rows", _activate_rows, mutates_args=())
activate_rows = KernelOp(_activate_rows_op, _activate_rows, differentiable=True)


@_activate_rows_op.register_fake
def _(pre: torch.Tensor, act: int, glu: bool, interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    return pre.new_empty(activation_rows.activated_shape(pre, act, glu))


_activate_rows_backward_op = torch.library.custom_op("moeforge::activate_rows_backward",
                                                     activation_rows.activate_rows_backward, mutates_args=())
activate_rows_backward = activation_rows.ACTIVATE_ROWS_BACKWARD


@_activate_rows_backward_op.register_fake
def _(pre: torch.Tensor, d_out: torch.Tensor, act: int, glu: bool, interleaved: bool, alpha: float,
      limit: float) -> torch.Tensor:
    activation_rows.check_gradient(pre, d_out, act, glu)
    return pre.new_empty(pre.shape)


# Backward formulas (moeforge/kernels/backward.py): the float grouped GEMM, the combine and the routing
# weights differentiate; the quantized GEMMs and the quantization kernels are inference-only.
_moe_gemm_op.register_autograd(backward.moe_gemm_backward, setup_context=backward.moe_gemm_setup_context)
_combine_copies_op.register_autograd(backward.combine_backward, setup_context=backward.combine_setup_context)
_route_op.register_autograd(backward.route_backward, setup_context=backward.route_setup_context)
_gather_slots_op.register_autograd(backward.gather_slots_backward, setup_context=backward.gather_slots_setup_context)
_activate_rows_op.register_autograd(activation_rows.autograd_backward,
                              setup_context=activation_rows.autograd_setup_context)
