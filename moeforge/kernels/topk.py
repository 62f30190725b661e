"""Routing on the device: scores, selection bias, grouped top-k, top-k, renormalisation, scaling.

One program routes ``BLOCK_T`` tokens with all their expert logits in registers (fp32). Selection is
``top_k`` rounds of arg-max with ties going to the lower expert index, which matches the reference's
stable descending sort.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from moeforge.errors import InputError
from moeforge.stages.topk import GroupScore, RoutingConfig, Scoring, ScoreOrder


@triton.jit
def _topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    T, E, stride_t, scaling, group_fill,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, SELECT_FIRST: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_MAX: tl.constexpr, BLOCK_G: tl.constexpr,
):
    NEG: tl.constexpr = float("-inf")
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, NEG)  # rows past T stay finite: no NaN from -inf - -inf
    if SELECT_FIRST:
        scores = x
    else:
        if SIGMOID:
            scores = tl.where(col_ok[None, :], tl.sigmoid(x), NEG)
        else:
            shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
            scores = shifted / tl.sum(shifted, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    choice = tl.where(col_ok[None, :], choice, NEG)

    if N_GROUP > 1:
        per_group = E // N_GROUP
        group_of = cols // per_group
        gcols = tl.arange(0, BLOCK_G)
        gscores = tl.full((BLOCK_T, BLOCK_G), NEG, tl.float32)
        for g in tl.static_range(N_GROUP):
            member = tl.where((group_of == g)[None, :], choice, NEG)
            best = tl.max(member, axis=1)
            if GROUP_MAX:
                score = best
            else:
                first = tl.argmax(member, axis=1, tie_break_left=True)
                second = tl.max(tl.where(cols[None, :] == first[:, None], NEG, member), axis=1)
                score = best + second
            gscores = tl.where(gcols[None, :] == g, score[:, None], gscores)
        keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(gscores, axis=1, tie_break_left=True)
            keep = keep | (group_of[None, :] == pick[:, None])
            gscores = tl.where(gcols[None, :] == pick[:, None], NEG, gscores)
        # Dropped groups get group_fill (-inf, or the 0.0 of older transformers' DeepSeek-V3); the padding
        # columns past E stay -inf so that they can never be picked.
        choice = tl.where(keep, choice, tl.where(col_ok[None, :], group_fill, NEG))

    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=1, tie_break_left=True)
        hit = cols[None, :] == pick[:, None]
        value = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(kcols[None, :] == k, value[:, None], weights)
        ids = tl.where(kcols[None, :] == k, pick[:, None].to(tl.int32), ids)
        choice = tl.where(hit, NEG, choice)
    k_ok = kcols < TOP_K
    if SELECT_FIRST:
        if SIGMOID:
            weights = tl.sigmoid(weights)
        else:
            chosen = tl.where(k_ok[None, :], weights, NEG)
            shifted = tl.exp(chosen - tl.max(chosen, axis=1)[:, None])
            weights = shifted / tl.sum(shifted, axis=1)[:, None]
    weights = tl.where(k_ok[None, :], weights, 0.0)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    out = rows[:, None] * TOP_K + kcols[None, :]
    mask = row_ok[:, None] & k_ok[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route(
    router_logits: torch.Tensor,
    selection_bias: Optional[torch.Tensor],
    top_k: int,
    *,
    sigmoid: bool,
    select_first: bool,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_max: bool,
    scaling: float,
    group_mask_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, ids [T, k] int32)``; the flags mirror
    :class:`~moeforge.stages.topk.RoutingConfig` (see :func:`routing_flags`)."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))
    grid = (triton.cdiv(tokens, block_t),)
    bias = selection_bias if selection_bias is not None else weights
    _topk_kernel[grid](
        router_logits, bias, weights, ids,
        tokens, num_experts, router_logits.stride(0), scaling, group_mask_value,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, BLOCK_T=block_t,
        SIGMOID=sigmoid, SELECT_FIRST=select_first, RENORM=renormalize,
        HAS_BIAS=selection_bias is not None,
        N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_MAX=group_max,
        BLOCK_G=triton.next_power_of_2(n_group),
        num_warps=4,
    )
    return weights, ids


def routing_flags(config: RoutingConfig) -> dict[str, Union[bool, int, float]]:
    """The kernel's keyword flags for a routing config (computed once, when a stage is built).

    Raises :class:`~moeforge.InputError` for a config the kernel cannot compute (see
    ``TritonTopK.supports``)."""
    if config.sparsemixer_eps is not None:
        raise InputError("the Triton routing kernel does not implement the sparsemixer routing; "
                         "use the torch TopK stage")
    select_first = config.order is ScoreOrder.SELECT_THEN_SCORE
    sigmoid = config.scoring is Scoring.SIGMOID
    return dict(
        sigmoid=sigmoid,
        select_first=select_first,
        # A softmax over the chosen k is already normalised: renormalising it again is a no-op.
        renormalize=config.renormalize and (not select_first or sigmoid),
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        group_max=config.group_score is GroupScore.MAX,
        scaling=config.routed_scaling_factor if config.scaling_in_weights else 1.0,
        group_mask_value=config.group_mask_value,
    )
