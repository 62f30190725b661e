"""The Triton kernels as ``torch.library`` custom ops (namespace ``moeforge``).

Custom ops with fake (meta) implementations let ``torch.compile`` trace through the forward and let
CUDA graphs capture it: every output size depends only on input sizes, never on values. Importing
this module registers the ops once; the Triton stages import it when they are first built.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from moeforge.kernels import align, combine, grouped_gemm, topk
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
