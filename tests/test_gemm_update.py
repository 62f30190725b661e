"""The grouped GEMM's low-rank update (``moe_gemm(..., update_rows=U, update_weight=B, update_scale=s)``): the
product of every copy gains ``s * U[copy] @ B[expert]^T`` before the epilogue, one more K-step of the kernel (an
adapter's update, :mod:`moeforge.adapters`); with ``update_ids``, a stack's: ``B[ids[copy], expert]``; with
rows ``[C, S·R]`` and no ids, a stack's in every adapter's columns (K-steps of several adapters). Checked against float64 through the whole epilogue (the gated
activation on both gate/up layouts, bias, routing weights, a split K-loop), and in every weight format by
linearity (the output with the update less the output without it is the update, with no activation), the swapped
4-bit product included. On CPU under Triton's interpreter, on a GPU compiled; outputs poisoned with NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, moe_gemm, ops  # noqa: E402,F401  (ops: the custom ops registered)
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.stages.activation import apply_activation  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from grids import grid  # noqa: E402
from test_weight_tma import CUDA, DEVICE, DTYPE, FORMATS, operands  # noqa: E402

SMALL = GemmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)
FLOATS = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
GATED = {"concatenated": mf.ActivationConfig(),
         "interleaved": mf.ActivationConfig(mf.ActivationKind.SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED)}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out.float()).any(), "an output element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _routing(tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    # the last expert gets no rows (its weight and update rows are read past N only)
    return torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)


def _wide_rows(u: torch.Tensor, chosen: torch.Tensor, stack: int, weight: float) -> torch.Tensor:
    """Every adapter's columns of rows ``u [C, R]`` (``stack_wide``'s layout): copy ``c``'s weighed row in adapter
    ``chosen[c]``'s ``R`` columns, zero elsewhere (none for ``-1``)."""
    copies, rank = u.shape
    wide = torch.zeros(copies, stack, rank, dtype=u.dtype, device=u.device)
    picked = chosen >= 0
    wide[picked.nonzero()[:, 0], chosen[picked].long()] = u[picked] * weight
    return wide.reshape(copies, stack * rank)


LAYOUTS = sorted(GATED) + ["plain"]
ONE_FORMS = [(16, 1, "one"), (16, 2, "one"), (5, 1, "one"), (5, 2, "one")]
WIDE_FORMS = [(16, 1, "wide"), (5, 2, "wide"), (32, 1, "wide"), (8, 1, "wide"), (64, 1, "wide"), (3, 1, "wide"),
              (16, 1, "wide persistent"), (16, 1, "wide flattened")]


def _update_cases() -> list[Any]:
    """``(dtype, layout, rank, split_k, form)``: every case of one update; of a stack's in every adapter's columns a
    covering part on the CPU (tests/grids.py), every case on a GPU."""
    cases = [pytest.param(dtype, layout, *form, id=f"{dtype}-{layout}-{form[0]}-{form[1]}-{form[2]}")
             for form in ONE_FORMS for layout in LAYOUTS for dtype in FLOATS]
    for case in grid(WIDE_FORMS, LAYOUTS, FLOATS):
        form, layout, dtype = case.values
        cases.append(pytest.param(dtype, layout, *form, id=f"{dtype}-{layout}-{form[0]}-{form[1]}-{form[2]}",
                                  marks=case.marks))
    return cases


@pytest.mark.parametrize("dtype, layout, rank, split_k, form", _update_cases())
def test_the_update_reaches_the_product_before_the_epilogue(dtype: torch.dtype, layout: str, rank: int,
                                                            split_k: int, form: str) -> None:
    # form "one": one update [E, N_w, R] for every copy; "wide": a stack's in every adapter's columns (update_rows
    # [C, S·R] without ids: more K-steps on every tile, the stack's B gathered adapter by adapter; the rows carry each
    # copy's own adapter's columns alone, stack_wide's layout, so the result is each copy's own update whichever
    # adapters a tile's rows chose; K-steps of several adapters, moe_gemm.wide_group: on one program per tile ranks
    # 8 and 16 one step for the three, 32 two, the second half empty, 64 three, 5 one step of four 8-wide adapters
    # masked along R, 3 one step of four 4-wide ones; on the persistent grids rank 16 two steps). With a split K-loop,
    # in its first range alone.
    tokens, k, experts, hidden, n_out, scale, stack = 9, 2, 5, 64, 24, 0.75, 3
    form, _, grid = form.partition(" ")
    gen = torch.Generator().manual_seed(rank + split_k)
    act: Optional[mf.ActivationConfig] = GATED.get(layout)
    n_w = 2 * n_out if act is not None else n_out
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    bias = torch.randn(experts, n_w, generator=gen).to(DEVICE, dtype)
    u = torch.randn(tokens * k, rank, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    flat = ids.reshape(-1).long()
    if form == "one":
        ub = (torch.randn(experts, n_w, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
        update_args: dict[str, Any] = dict(update_rows=u, update_weight=ub, update_scale=scale)
        update = scale * torch.einsum("cr,cnr->cn", u.double(), ub.double()[flat])
    else:
        ub = (torch.randn(stack, experts, n_w, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
        chosen = torch.randint(-1, stack, (tokens * k,), generator=gen).to(DEVICE)
        update_args = dict(update_rows=_wide_rows(u, chosen, stack, scale), update_weight=ub)
        update = scale * torch.einsum("cr,cnr->cn", u.double(), ub.double()[chosen.clamp(min=0).long(), flat])
        update = torch.where((chosen >= 0)[:, None], update, torch.zeros_like(update))
    plan = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, n_out), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=k, config=SMALL, bias=bias, topk_weights=weights.reshape(-1),
                      act=act_code(act) if act is not None else 0, glu=act is not None,
                      interleaved=act is not None and act.gate_up is mf.GateUpLayout.INTERLEAVED, split_k=split_k,
                      grid=grid or None, **update_args)
    copies = torch.arange(tokens * k, device=DEVICE)
    pre = (torch.einsum("ch,cnh->cn", x.double()[copies // k], w.double()[flat]) + bias.double()[flat] + update)
    ref = (apply_activation(pre, act) if act is not None else pre) * weights.double().reshape(-1, 1)
    assert _rel(out, ref) < TOL[dtype]


def test_a_wide_update_step_covers_whole_adapters_in_at_least_16_columns() -> None:
    # (moe_gemm.wide_group: the MMA's K is at least 16; a step is a power of two of whole padded adapters, at most
    # the grid's step unless one adapter is wider, and no more adapters than the stack rounded up to a power of two)
    for tile_grid, step in (("tiles", moe_gemm.WIDE_STEP), ("persistent", moe_gemm.WIDE_STEP_PERSISTENT),
                            ("flattened", moe_gemm.WIDE_STEP_PERSISTENT)):
        for padded in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for stack in range(1, 41):
                group = moe_gemm.wide_group(padded, stack, tile_grid)
                width = group * padded
                assert group >= 1 and group & (group - 1) == 0
                assert width >= 16 and width & (width - 1) == 0
                assert width <= max(step, padded, 16)
                assert group <= max(1, -(-16 // padded), 1 << (stack - 1).bit_length())


@pytest.mark.parametrize("swap", [False, True], ids=["", "swapped"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_update_adds_to_the_product_of_every_weight_format(fmt: str, swap: bool) -> None:
    if swap and not (fmt.startswith("int4") or fmt in ("mxfp4", "nvfp4")):
        pytest.skip("the swapped product is the 4-bit weights'")
    tokens, k, experts, hidden, n_out = 7, 2, 4, 128, 32
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    args: dict[str, Any] = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    if fmt.startswith("int4") or fmt in ("mxfp4", "nvfp4"):
        args["swap"] = swap
    u = torch.randn(tokens * k, 16, generator=gen).to(DEVICE, DTYPE)
    ub = (torch.randn(experts, n_out, 16, generator=gen) * 0.25).to(DEVICE, DTYPE)
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, 16)
    config = GemmConfig(16, 32, 32 if fmt != "nvfp4-rows" else 64, num_warps=4, num_stages=1)
    outs = []
    for update in (False, True):
        out = torch.full((tokens * k, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        extra: dict[str, Any] = dict(update_rows=u, update_weight=ub, update_scale=2.0) if update else {}
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=k, config=config, **args, **extra)
        outs.append(out)
    want = 2.0 * torch.einsum("cr,cnr->cn", u.double(), ub.double()[ids.reshape(-1).long()])
    # (both outputs rounded to DTYPE: the difference carries their roundings, relative to the output's size)
    assert _rel(outs[1].double() - outs[0].double(), want) < 2e-2


@pytest.mark.parametrize("rank_split, layout, dtype", grid([(16, 1), (16, 2), (5, 1), (5, 2), (64, 1), (64, 2)],
                                                          LAYOUTS, FLOATS))
def test_a_stack_of_updates_reaches_each_copy_by_its_own(dtype: torch.dtype, layout: str,
                                                         rank_split: tuple[int, int]) -> None:
    # update_ids picks each copy's update out of update_weight [S, E, N_w, R]: one update no copy chose (3), tiles
    # whose rows chose some of the stack only (expert 0's copies all take update 2, so its tiles skip the others'
    # K-steps); a rank below the K-step's 16 and one above.
    # (every case on a GPU, a covering part under the interpreter: tests/grids.py)
    rank, split_k = rank_split
    tokens, k, experts, hidden, n_out, stack, scale = 11, 2, 5, 64, 24, 4, 0.75
    gen = torch.Generator().manual_seed(split_k)
    act: Optional[mf.ActivationConfig] = GATED.get(layout)
    n_w = 2 * n_out if act is not None else n_out
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    u = torch.randn(tokens * k, rank, generator=gen).to(DEVICE, dtype)
    ub = (torch.randn(stack, experts, n_w, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    chosen = torch.randint(0, stack - 1, (tokens * k,), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    ids = _routing(tokens, experts, k, gen)
    chosen[ids.reshape(-1) == 0] = 2
    assert (ids == 0).any()
    ids = ids.to(DEVICE)
    plan = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, n_out), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=k, config=SMALL, topk_weights=weights.reshape(-1),
                      act=act_code(act) if act is not None else 0, glu=act is not None,
                      interleaved=act is not None and act.gate_up is mf.GateUpLayout.INTERLEAVED, split_k=split_k,
                      update_rows=u, update_weight=ub, update_scale=scale, update_ids=chosen.to(DEVICE))
    flat = ids.reshape(-1).long()
    copies = torch.arange(tokens * k, device=DEVICE)
    pre = (torch.einsum("ch,cnh->cn", x.double()[copies // k], w.double()[flat])
           + scale * torch.einsum("cr,cnr->cn", u.double(), ub.double()[chosen.to(DEVICE).long(), flat]))
    ref = (apply_activation(pre, act) if act is not None else pre) * weights.double().reshape(-1, 1)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("layout", ["concatenated", "plain"])
def test_a_stack_of_more_than_32_updates_and_ids_outside_it(layout: str) -> None:
    # The kernel finds a tile's chosen updates 32 at a time (a bit each): ids on both sides of each 32-boundary, the
    # last of the stack, and ids outside [0, S) (-1, S, S + 5: no update, as for the rows of no copy).
    tokens, k, experts, hidden, n_out, stack, rank, scale = 16, 2, 3, 32, 16, 70, 16, 0.5
    gen = torch.Generator().manual_seed(7)
    act: Optional[mf.ActivationConfig] = GATED.get(layout)
    n_w = 2 * n_out if act is not None else n_out
    dtype = torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    u = torch.randn(tokens * k, rank, generator=gen).to(DEVICE, dtype)
    ub = (torch.randn(stack, experts, n_w, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    picks = torch.tensor([0, 1, 30, 31, 32, 33, 63, 64, 69, -1, stack, stack + 5], dtype=torch.int32)
    chosen = picks[torch.randint(0, len(picks), (tokens * k,), generator=gen)]
    chosen[:len(picks)] = picks
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, n_out), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=k, config=SMALL, act=act_code(act) if act is not None else 0,
                      glu=act is not None, update_rows=u, update_weight=ub, update_scale=scale,
                      update_ids=chosen.to(DEVICE))
    flat = ids.reshape(-1).long()
    copies = torch.arange(tokens * k, device=DEVICE)
    inside = ((chosen >= 0) & (chosen < stack)).to(DEVICE)
    update = torch.einsum("cr,cnr->cn", u.double(), ub.double()[chosen.clamp(0, stack - 1).to(DEVICE).long(), flat])
    pre = (torch.einsum("ch,cnh->cn", x.double()[copies // k], w.double()[flat])
           + scale * torch.where(inside[:, None], update, torch.zeros_like(update)))
    ref = apply_activation(pre, act) if act is not None else pre
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("fmt, swap", [("fp8-block", False), ("int4", False), ("int4", True)])
def test_every_adapters_columns_add_to_a_quantized_product(fmt: str, swap: bool) -> None:
    # The K-steps of every adapter's columns come after the base product's scales, as one update's K-step does: the
    # output with them less the output without them is the update (no activation), over 8-bit and 4-bit weights.
    tokens, k, experts, hidden, n_out, stack, rank = 7, 2, 4, 128, 32, 3, 16
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    args: dict[str, Any] = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    if fmt == "int4":
        args["swap"] = swap  # (the swapped product's accumulators transposed back before the update)
    u = torch.randn(tokens * k, rank, generator=gen).to(DEVICE, DTYPE)
    ub = (torch.randn(stack, experts, n_out, rank, generator=gen) * 0.25).to(DEVICE, DTYPE)
    chosen = torch.randint(-1, stack, (tokens * k,), generator=gen).to(DEVICE)
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, 16)
    config = GemmConfig(16, 32, 32, num_warps=4, num_stages=1)
    outs = []
    for extra in ({}, dict(update_rows=_wide_rows(u, chosen, stack, 2.0), update_weight=ub)):
        out = torch.full((tokens * k, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=k, config=config, **args, **extra)
        outs.append(out)
    update = 2.0 * torch.einsum("cr,cnr->cn", u.double(), ub.double()[chosen.clamp(min=0).long(),
                                                                       ids.reshape(-1).long()])
    want = torch.where((chosen >= 0)[:, None], update, torch.zeros_like(update))
    assert _rel(outs[1].double() - outs[0].double(), want) < 2e-2


@pytest.mark.parametrize("parts, split_k, id_dtype", [(1, 1, torch.int32), (3, 1, torch.int64), (5, 2, torch.int32)])
@pytest.mark.parametrize("layout", ["concatenated", "plain"])
def test_a_stacks_rows_in_parts_are_summed_and_weighed_by_their_ids(layout: str, parts: int, split_k: int,
                                                                    id_dtype: torch.dtype) -> None:
    # update_rows [P, C, R] fp32 (stack_shrink's ranges of K): the launch sums the parts and weighs each copy by its raw
    # id: the scale in [0, S), nothing for -1, NaN rows outside [-1, S) (ids S and -2).
    tokens, k, experts, hidden, n_out, stack, rank, scale = 9, 2, 4, 32, 24, 3, 16, 0.75
    gen = torch.Generator().manual_seed(parts)
    act: Optional[mf.ActivationConfig] = GATED.get(layout)
    n_w = 2 * n_out if act is not None else n_out
    dtype = torch.float16
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    u_parts = torch.randn(parts, tokens * k, rank, generator=gen).to(DEVICE)
    ub = (torch.randn(stack, experts, n_w, rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    raw = torch.randint(-1, stack, (tokens * k,), generator=gen)
    raw[3], raw[4] = stack, -2
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, n_out), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=k, config=SMALL, act=act_code(act) if act is not None else 0,
                      glu=act is not None, split_k=split_k, update_rows=u_parts, update_weight=ub, update_scale=scale,
                      update_ids=raw.to(DEVICE, id_dtype))
    flat = ids.reshape(-1).long()
    copies = torch.arange(tokens * k, device=DEVICE)
    inside = (raw >= 0) & (raw < stack)
    used = torch.where(inside, scale, 0.0).double().to(DEVICE)
    u = u_parts.double().sum(0).to(dtype).double()  # (the launch rounds the weighed sum to the weight's dtype)
    update = torch.einsum("cr,cnr->cn", u, ub.double()[raw.clamp(0, stack - 1).to(DEVICE).long(), flat])
    pre = torch.einsum("ch,cnh->cn", x.double()[copies // k], w.double()[flat]) + used[:, None] * update
    ref = apply_activation(pre, act) if act is not None else pre
    outside = ((raw < -1) | (raw >= stack)).to(DEVICE)
    assert out[outside].isnan().all()
    assert _rel(out[~outside], ref[~outside]) < TOL[dtype]


def test_rows_in_parts_are_refused_without_ids_or_in_a_float_dtype_but_fp32() -> None:
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.randn(3, 16, 32, device=DEVICE)
    out = torch.empty(8, 16, device=DEVICE)
    plan = align.align_block_size(torch.tensor([[0, 1]] * 4, dtype=torch.int32, device=DEVICE), 3, 16)
    parts, ub = torch.randn(2, 8, 4, device=DEVICE), torch.randn(2, 3, 16, 4, device=DEVICE)
    ids = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="parts"):
        moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=2, config=SMALL, update_rows=parts.half(), update_weight=ub,
                          update_ids=ids)
    with pytest.raises(ValueError, match="int32"):
        moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=2, config=SMALL, update_rows=parts[0], update_weight=ub,
                          update_ids=ids.long())
    with pytest.raises(ValueError, match="num_copies=8"):
        moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=2, config=SMALL, update_rows=parts[:, :5], update_weight=ub,
                          update_ids=ids)


def test_a_bad_update_is_refused_naming_what_does_not_fit() -> None:
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.randn(3, 16, 32, device=DEVICE)
    out = torch.empty(8, 16, device=DEVICE)
    plan = align.align_block_size(torch.tensor([[0, 1]] * 4, dtype=torch.int32, device=DEVICE), 3, 16)
    u, ub = torch.randn(8, 4, device=DEVICE), torch.randn(3, 16, 4, device=DEVICE)
    cases = [(dict(update_rows=u), "together"), (dict(update_rows=u[:5], update_weight=ub), "num_copies=8"),
             (dict(update_rows=u, update_weight=ub[:, :8]), r"\[E, N_w, R\]"),
             (dict(update_rows=u.t().contiguous().t(), update_weight=ub), "contiguous rows"),
             (dict(update_rows=u.half(), update_weight=ub), "one float dtype"),
             (dict(update_rows=u[:, :3], update_weight=ub[None]), "pass each copy's"),
             (dict(update_rows=torch.randn(8, 6, device=DEVICE), update_weight=torch.stack([ub, ub])), "S·R = 8"),
             (dict(update_rows=u, update_weight=ub[None], update_scale=0.5), "update_scale must be 1"),
             (dict(update_rows=u, update_weight=ub, update_ids=torch.zeros(8, dtype=torch.int32, device=DEVICE)),
              r"update_weight \[S, E, N_w, R\]"),
             (dict(update_rows=u, update_weight=ub[None], update_ids=torch.zeros(8, device=DEVICE)), "int32"),
             (dict(update_rows=u, update_weight=ub[None], update_ids=torch.zeros(7, dtype=torch.int32,
                                                                                  device=DEVICE)), "num_copies=8"),
             (dict(update_ids=torch.zeros(8, dtype=torch.int32, device=DEVICE)), "together")]
    for extra, words in cases:
        with pytest.raises(ValueError, match=words):
            moe_gemm.moe_gemm(x, w, out, *plan, rows_per_a=2, config=SMALL, **extra)


@pytest.mark.parametrize("weights_in_epilogue", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_the_update_differentiates_with_the_grouped_gemm(gated: bool, weights_in_epilogue: bool) -> None:
    # Through grouped_gemm (the op's backward): the rows, the weight, the update's rows and weight, against float64
    # autograd of the same formula; a gated activation or routing weights in the epilogue take the recomputed
    # pre-activation (with the update) and autograd over the epilogue.
    from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmUpdate, GemmWeight,
                                                    grouped_gemm)

    tokens, k, experts, hidden, n_out, rank, scale = 6, 2, 4, 32, 16, 8, 0.5
    gen = torch.Generator().manual_seed(7)
    act = GATED["concatenated"] if gated else None
    n_w = 2 * n_out if gated else n_out
    leaves = {"x": torch.randn(tokens, hidden, generator=gen),
              "w": torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5,
              "u": torch.randn(tokens * k, rank, generator=gen),
              "ub": torch.randn(experts, n_w, rank, generator=gen) * rank ** -0.5}
    weights = torch.rand(tokens * k, generator=gen).to(DEVICE) if weights_in_epilogue else None
    ids = _routing(tokens, experts, k, gen).to(DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, 16)
    got_leaves = {name: value.to(DEVICE).requires_grad_() for name, value in leaves.items()}
    out, _ = grouped_gemm(GemmRows(got_leaves["x"], rows_per_a=k), GemmWeight(got_leaves["w"]),
                          GemmRoute(sorted_ids, block_expert, num_padded, tokens * k),
                          GemmEpilogue(torch.float32, routing_weights=weights, act=act_code(act) if act else 0,
                                       glu=gated, alpha=act.alpha if act else 1.0, limit=act.limit if act else 0.0),
                          SMALL, GemmUpdate(got_leaves["u"], got_leaves["ub"], scale))
    upstream = torch.randn(out.shape, generator=gen).to(DEVICE)
    got = torch.autograd.grad(out, list(got_leaves.values()), upstream)
    ref_leaves = {name: value.double().to(DEVICE).requires_grad_() for name, value in leaves.items()}
    flat = ids.reshape(-1).long()
    copies = torch.arange(tokens * k, device=DEVICE)
    pre = (torch.einsum("ch,cnh->cn", ref_leaves["x"][copies // k], ref_leaves["w"][flat])
           + scale * torch.einsum("cr,cnr->cn", ref_leaves["u"], ref_leaves["ub"][flat]))
    ref = apply_activation(pre, act) if act is not None else pre
    if weights is not None:
        ref = ref * weights.double()[:, None]
    assert _rel(out, ref) < 1e-5
    want = torch.autograd.grad(ref, list(ref_leaves.values()), upstream.double())
    for name, g, w in zip(got_leaves, got, want):
        assert _rel(g, w) < 1e-5, name


@pytest.mark.parametrize("columns", ["each copy's adapter", "every adapter's"])
def test_a_stack_of_updates_has_no_backward(columns: str) -> None:
    # A stack (update_ids, or every adapter's columns) is the serving path: a gradient through it is refused, naming
    # the path that trains a stack.
    from moeforge.errors import InputError
    from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmUpdate, GemmWeight,
                                                    grouped_gemm)

    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(3, 16, 32, device=DEVICE)
    plan = align.align_block_size(torch.tensor([[0, 1]] * 4, dtype=torch.int32, device=DEVICE), 3, 16)
    update = (GemmUpdate(torch.randn(8, 4, device=DEVICE), torch.randn(2, 3, 16, 4, device=DEVICE), 1.0,
                         ids=torch.tensor([0, 1] * 4, dtype=torch.int32, device=DEVICE))
              if columns == "each copy's adapter" else
              GemmUpdate(torch.randn(8, 8, device=DEVICE), torch.randn(2, 3, 16, 4, device=DEVICE)))
    out, _ = grouped_gemm(GemmRows(x, rows_per_a=2), GemmWeight(w), GemmRoute(*plan, 8), GemmEpilogue(torch.float32),
                          SMALL, update)
    with pytest.raises(InputError, match="no backward"):
        out.sum().backward()
