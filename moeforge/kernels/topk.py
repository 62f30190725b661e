"""Routing on the device: scores, selection bias, grouped top-k, top-k, renormalisation, scaling.

One program routes ``BLOCK_T`` tokens with all their expert logits in registers (fp32). Groups and
experts are chosen in rounds of "best free value, lowest index among equals", which matches the
reference's stable descending sort. A round only looks at what is still free (not picked yet, not a
padding column): an arg-max over values overwritten with ``-inf`` once picked would pick an index again
as soon as every value left is ``-inf`` (masked experts, the experts past the kept groups).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import triton
import triton.language as tl

from moeforge.errors import InputError
from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.routing import GroupScore, RoutingConfig, Scoring, ScoreOrder
from moeforge.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _ordered(x):
    """fp32 ``x`` (no NaN) as int32 whose signed order is ``x``'s: negative values have their magnitude
    bits flipped. ``-0.0`` must be made ``+0.0`` first (they are equal as floats, not as keys)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The fp32 value of a :func:`_keys` key (the inverse of :func:`_ordered` on its high half)."""
    o = (key >> 32).to(tl.int32)
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _keys(choice, cols, BLOCK_E: tl.constexpr):
    """One int64 per column whose maximum is the best choice, the lowest column among equals: the value's
    order in the high half, ``BLOCK_E - 1 - col`` in the low half (so one max reduction picks both)."""
    canonical = tl.where(choice == 0.0, 0.0, choice)  # -0.0 ties with +0.0, as in the reference's sort
    return (_ordered(canonical).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]


@triton.jit
def _low(key):
    """The low half of a :func:`_keys` key: ``BLOCK_E - 1 - col``."""
    return (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _sum_in_order(values, kcols, COUNT: tl.constexpr):
    """Row sums of ``values [BLOCK_T, BLOCK_K]`` over columns ``0 .. COUNT - 1`` added in column order: the
    same rounding whatever the program's shape and layout (each column is read out exactly: one term of the
    masked reduction is non-zero)."""
    total = tl.sum(tl.where(kcols[None, :] == 0, values, 0.0), axis=1)
    for k in tl.static_range(1, COUNT):
        total += tl.sum(tl.where(kcols[None, :] == k, values, 0.0), axis=1)
    return total


@triton.jit
def _topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    T, E, stride_t, stride_e, scaling, group_fill,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, SELECT_FIRST: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SUM_TOP2: tl.constexpr, BLOCK_G: tl.constexpr,
    GROUPS_AS_AXIS: tl.constexpr, FIXED_ONE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait_for_the_kernel_before(PDL)
    NEG: tl.constexpr = float("-inf")
    POS: tl.constexpr = float("inf")
    NONE: tl.constexpr = -9223372036854775808  # below every key: a column that is not free
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :] * stride_e,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, NEG)  # rows past T stay finite: no NaN from -inf - -inf
    if SELECT_FIRST:
        scores = x
    else:
        if SIGMOID:
            scores = tl.where(col_ok[None, :], tl.sigmoid(x), NEG)
        else:
            # The softmax's denominator is summed in fixed point (each term in [0, 1] times FIXED_ONE, a
            # power of two that leaves room for BLOCK_E terms in an int64, truncated): integer addition
            # does not depend on the order, so a token's weights do not depend on the program's shape or
            # layout (tile), and the sum is within BLOCK_E / FIXED_ONE of exact, closer than a float sum.
            shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
            fixed = (shifted * FIXED_ONE).to(tl.int64)
            total = tl.sum(fixed, axis=1).to(tl.float32) * (1.0 / FIXED_ONE)
            scores = shifted / total[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    # A NaN ranks first (as in torch's sort) instead of never being "the best": the rounds below then
    # always find a free index, so the ids stay distinct and in range even for NaN logits.
    choice = tl.where(choice != choice, POS, choice)

    if N_GROUP > 1:
        per_group = E // N_GROUP
        group_of = cols // per_group
        gcols = tl.arange(0, BLOCK_G)
        if GROUPS_AS_AXIS:  # E == BLOCK_E == N_GROUP * a power of two: each group one row of a 3-D view
            key3 = tl.reshape(_keys(choice, cols, BLOCK_E), (BLOCK_T, N_GROUP, BLOCK_E // N_GROUP))
            best_key = tl.max(key3, axis=2)
            score = _value(best_key)
            if SUM_TOP2:
                first = tl.reshape(_low(best_key), (BLOCK_T, N_GROUP, 1))
                col3 = tl.reshape(BLOCK_E - 1 - cols, (1, N_GROUP, BLOCK_E // N_GROUP))
                score += _value(tl.max(tl.where(col3 == first, NONE, key3), axis=2))
            gscores = score
        else:
            gscores = tl.full((BLOCK_T, BLOCK_G), NEG, tl.float32)
            for g in tl.static_range(N_GROUP):
                member = tl.where((group_of == g)[None, :], choice, NEG)
                best = tl.max(member, axis=1)
                if SUM_TOP2:
                    first = tl.argmax(member, axis=1, tie_break_left=True)
                    second = tl.max(tl.where(cols[None, :] == first[:, None], NEG, member), axis=1)
                    score = best + second
                else:
                    score = best
                gscores = tl.where(gcols[None, :] == g, score[:, None], gscores)
        gscores = tl.where(gscores != gscores, POS, gscores)  # a NaN's +inf plus a -inf in one group
        gfree = tl.broadcast_to((gcols < N_GROUP)[None, :], (BLOCK_T, BLOCK_G))
        keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(gfree, gscores, NEG), axis=1)
            pick = tl.min(tl.where(gfree & (gscores == top[:, None]), gcols[None, :], BLOCK_G), axis=1)
            keep = keep | (group_of[None, :] == pick[:, None])
            gfree = gfree & (gcols[None, :] != pick[:, None])
        # Dropped groups get group_fill (-inf, or the 0.0 of older transformers' DeepSeek-V3).
        choice = tl.where(keep, choice, group_fill)

    # top_k rounds, each one max reduction over the free columns' keys (padding columns are never free).
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    key = tl.where(col_ok[None, :], _keys(choice, cols, BLOCK_E), NONE)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        pick = BLOCK_E - 1 - _low(best)
        hit = cols[None, :] == pick[:, None]
        value = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # exact: one non-zero term
        weights = tl.where(kcols[None, :] == k, value[:, None], weights)
        ids = tl.where(kcols[None, :] == k, pick[:, None], ids)
        key = tl.where(hit, NONE, key)
    k_ok = kcols < TOP_K
    if SELECT_FIRST:
        if SIGMOID:
            weights = tl.sigmoid(weights)
        else:
            chosen = tl.where(k_ok[None, :], weights, NEG)
            shifted = tl.exp(chosen - tl.max(chosen, axis=1)[:, None])
            weights = shifted / _sum_in_order(shifted, kcols, TOP_K)[:, None]
    weights = tl.where(k_ok[None, :], weights, 0.0)
    if RENORM:
        weights = weights / (_sum_in_order(weights, kcols, TOP_K)[:, None] + 1e-20)
    weights = weights * scaling
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
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
    block_e = next_power_of_2(num_experts)
    block_t, num_warps = tile(tokens, block_e)
    # Any strides for the logits (the kernel takes both; Triton specialises a stride of 1); the bias is
    # read as a dense vector.
    bias = selection_bias.contiguous() if selection_bias is not None else weights
    if topk_group >= n_group:
        n_group = topk_group = 1  # every group is kept: nothing to mask

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        # The reference sums a group's best min(2, group size) experts: a group of one expert scores its only
        # expert, as under MAX, not that expert plus a missing second best of -inf (every group would tie).
        sum_top2 = not group_max and num_experts // n_group > 1
        per_group = num_experts // n_group
        dependent = pdl.pdl_applies(router_logits.device)
        return dict(
            TOP_K=top_k, BLOCK_K=next_power_of_2(top_k), BLOCK_E=block_e, BLOCK_T=block_t,
            SIGMOID=sigmoid, SELECT_FIRST=select_first, RENORM=renormalize,
            HAS_BIAS=selection_bias is not None,
            N_GROUP=n_group, TOPK_GROUP=topk_group, SUM_TOP2=sum_top2,
            BLOCK_G=next_power_of_2(n_group),
            # the groups as an axis of a 3-D view (one reduction for every group) where they tile it exactly
            GROUPS_AS_AXIS=n_group > 1 and num_experts == block_e and per_group & (per_group - 1) == 0,
            FIXED_ONE=float(2 ** (62 - block_e.bit_length() + 1)),  # BLOCK_E terms of at most this fit an int64
            PDL=pdl.flag(dependent),
        ), dict(num_warps=num_warps, **pdl.launch_options(dependent))

    _ROUTE.launch((top_k, sigmoid, select_first, renormalize, n_group, topk_group, group_max,
                   selection_bias is not None, router_logits.device), (cdiv(tokens, block_t),),
                  (router_logits, bias, weights, ids, tokens, num_experts, router_logits.stride(0),
                   router_logits.stride(1), scaling, group_mask_value), make)
    return weights, ids


_ROUTE = LaunchSite(_topk_kernel)


def tile(tokens: int, block_e: int) -> tuple[int, int]:
    """``(tokens per program, warps)`` for ``tokens`` rows of ``block_e`` (a power of two) logits: about a warp's
    worth of logits per warp (128: one 16-byte load per lane), at most 4 warps, and one row in one warp from 256
    logits up (a wider tile splits rows across warps, whose reductions then go through shared memory): the best
    tile measured, or close to it, at every token count up to 1024 (docs/notes/kernels-log.md, "The routing
    kernel"). Any tile gives a token the same bits (the kernel's sums do not depend on it), so it may follow the
    batch."""
    if block_e >= 256:
        return 1, 1
    rows_per_warp = 128 // block_e
    block_t = min(next_power_of_2(max(tokens, 1)), 4 * rows_per_warp)
    return block_t, max(1, block_t // rows_per_warp)


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
