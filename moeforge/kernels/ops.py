"""The Triton kernels as ``torch.library`` custom ops (namespace ``moeforge``).

Custom ops with fake (meta) implementations let ``torch.compile`` trace through the forward and let
CUDA graphs capture it: every output size depends only on input sizes, never on values. Importing
this module registers the ops once; the Triton stages import it when they are first built.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from moeforge.kernels import align, combine, grouped_gemm, quant_gemm, quantize, topk
from moeforge.kernels.config import GemmConfig


@torch.library.custom_op("moeforge::align_block_size", mutates_args=())
def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return align.align_block_size(topk_ids, num_experts, block_m)


@align_block_size.register_fake
def _(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    size = max(align.max_padded_rows(topk_ids.numel(), num_experts, block_m), block_m)
    new = topk_ids.new_empty
    return new(size, dtype=torch.int32), new(triton.cdiv(size, block_m), dtype=torch.int32), new(1, dtype=torch.int32)


@torch.library.custom_op("moeforge::fused_moe_gemm", mutates_args=())
def fused_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    num_copies: int,
    rows_per_a: int,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    config: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    n_out = weight.shape[1] // 2 if glu else weight.shape[1]
    out = torch.empty(num_copies, n_out, dtype=out_dtype, device=a.device)
    return grouped_gemm.fused_moe_gemm(
        a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
        config=GemmConfig(*config), bias=bias, topk_weights=topk_weights, act=act, glu=glu,
        interleaved=interleaved, alpha=alpha, limit=limit)


@fused_moe_gemm.register_fake
def _(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
      sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor, num_copies: int,
      rows_per_a: int, act: int, glu: bool, interleaved: bool, alpha: float, limit: float,
      config: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    n_out = weight.shape[1] // 2 if glu else weight.shape[1]
    return a.new_empty(num_copies, n_out, dtype=out_dtype)


def _gemm_out_width(weight: torch.Tensor, glu: bool) -> int:
    return weight.shape[1] // 2 if glu else weight.shape[1]


@torch.library.custom_op("moeforge::w8a8_moe_gemm", mutates_args=())
def w8a8_moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    num_copies: int,
    rows_per_a: int,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    config: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(num_copies, _gemm_out_width(weight, glu), dtype=out_dtype, device=a.device)
    return quant_gemm.w8a8_moe_gemm(
        a, a_scale, weight, weight_scale, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
        config=GemmConfig(*config), bias=bias, topk_weights=topk_weights, act=act, glu=glu,
        interleaved=interleaved, alpha=alpha, limit=limit)


@w8a8_moe_gemm.register_fake
def _(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
      bias: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
      block_expert: torch.Tensor, num_padded: torch.Tensor, num_copies: int, rows_per_a: int, act: int,
      glu: bool, interleaved: bool, alpha: float, limit: float, config: list[int],
      out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty(num_copies, _gemm_out_width(weight, glu), dtype=out_dtype)


@torch.library.custom_op("moeforge::w8a8_moe_gemm_fp8_out", mutates_args=())
def w8a8_moe_gemm_fp8_out(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    num_copies: int,
    rows_per_a: int,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 GEMM whose epilogue quantizes its (activated) output to FP8 per 128-group."""
    n_out = _gemm_out_width(weight, glu)
    out = torch.empty(num_copies, n_out, dtype=torch.float8_e4m3fn, device=a.device)
    out_scale = torch.empty(num_copies, n_out // quant_gemm.GROUP, dtype=torch.float32, device=a.device)
    quant_gemm.w8a8_moe_gemm(
        a, a_scale, weight, weight_scale, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
        config=GemmConfig(*config), bias=bias, topk_weights=topk_weights, act=act, glu=glu,
        interleaved=interleaved, alpha=alpha, limit=limit, out_scale=out_scale)
    return out, out_scale


@w8a8_moe_gemm_fp8_out.register_fake
def _(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
      bias: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
      block_expert: torch.Tensor, num_padded: torch.Tensor, num_copies: int, rows_per_a: int, act: int,
      glu: bool, interleaved: bool, alpha: float, limit: float,
      config: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n_out = _gemm_out_width(weight, glu)
    return (a.new_empty(num_copies, n_out, dtype=torch.float8_e4m3fn),
            a.new_empty(num_copies, n_out // quant_gemm.GROUP, dtype=torch.float32))


@torch.library.custom_op("moeforge::w4a16_moe_gemm", mutates_args=())
def w4a16_moe_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    num_copies: int,
    rows_per_a: int,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    config: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(num_copies, _gemm_out_width(qweight, glu), dtype=out_dtype, device=a.device)
    return quant_gemm.w4a16_moe_gemm(
        a, qweight, scales, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
        config=GemmConfig(*config), zeros=zeros, bias=bias, topk_weights=topk_weights, act=act, glu=glu,
        interleaved=interleaved, alpha=alpha, limit=limit)


@w4a16_moe_gemm.register_fake
def _(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
      bias: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], sorted_ids: torch.Tensor,
      block_expert: torch.Tensor, num_padded: torch.Tensor, num_copies: int, rows_per_a: int, act: int,
      glu: bool, interleaved: bool, alpha: float, limit: float, config: list[int],
      out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty(num_copies, _gemm_out_width(qweight, glu), dtype=out_dtype)


def _quantized_shapes(x: torch.Tensor, per_group: bool, glu: bool) -> tuple[int, int, int]:
    width = x.shape[1] // 2 if glu else x.shape[1]
    return x.shape[0], width, width // quantize.GROUP if per_group else 1


@torch.library.custom_op("moeforge::quantize_rows", mutates_args=())
def quantize_rows(
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


@quantize_rows.register_fake
def _(x: torch.Tensor, dtype: torch.dtype, per_group: bool, act: int, glu: bool, interleaved: bool,
      alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width, groups = _quantized_shapes(x, per_group, glu)
    return x.new_empty(rows, width, dtype=dtype), x.new_empty(rows, groups, dtype=torch.float32)


@torch.library.custom_op("moeforge::combine", mutates_args=())
def combine_copies(
    rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(rows.shape[0] // top_k, rows.shape[1], dtype=out_dtype, device=rows.device)
    return combine.combine_copies(rows, top_k, out, weights, scale)


@combine_copies.register_fake
def _(rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, scale: float,
      out_dtype: torch.dtype) -> torch.Tensor:
    return rows.new_empty(rows.shape[0] // top_k, rows.shape[1], dtype=out_dtype)


@torch.library.custom_op("moeforge::route", mutates_args=())
def route(
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


@route.register_fake
def _(router_logits: torch.Tensor, selection_bias: Optional[torch.Tensor], top_k: int, sigmoid: bool,
      select_first: bool, renormalize: bool, n_group: int, topk_group: int, group_max: bool,
      scaling: float, group_mask_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = router_logits.shape[0]
    return (router_logits.new_empty(tokens, top_k, dtype=torch.float32),
            router_logits.new_empty(tokens, top_k, dtype=torch.int32))
