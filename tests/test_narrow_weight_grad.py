"""The narrow weight gradient (``moeforge/kernels/narrow_weight_grad.py``): an adapter's ``A [E, r, K]`` or
``B [E, N, r]`` gradient, rows read by index from the alignment and each expert's blocks found by a binary search
over the block table, against a float64 sum per expert — on the CPU under Triton's interpreter, on the GPU compiled.

The alignments are what users' batches give: idle experts (first, last, in the middle: the search must skip
them), every copy on one expert, one token, no tokens, top-k = experts, more copies than the one-program alignment
takes (the scatter's block table), steps smaller than the alignment's block; narrow sides of 1 to 64 columns, on
either side, rows shared by ``top_k`` copies and not, rows with a stride wider than their width.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from test_weight_grad import _ids, _reference  # noqa: E402

from moeforge.kernels import align, weight_grad  # noqa: E402
from moeforge.kernels.narrow_weight_grad import (  # noqa: E402
    NARROW,
    NarrowTiles,
    default_tiles,
    narrow_problem,
    narrow_weight_grad,
    update_grads,
    update_grads_problem,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # (bf16 dots: not the interpreter's)

CASES = {  # (tokens, top_k, experts, N, K, rows per x, only, idle)
    "B: narrow K, idle experts first, middle and last": (13, 2, 7, 40, 4, 1, None, (0, 3, 6)),
    "A: narrow N, rows shared by top_k copies": (11, 3, 5, 16, 72, 3, None, (2,)),
    "every copy on one expert": (9, 2, 4, 24, 16, 2, 3, ()),
    "one token, rank 1": (1, 2, 4, 1, 40, 2, None, ()),
    "top_k = experts, rank 64": (6, 3, 3, 64, 48, 3, None, ()),
    "rank 12 (not a power of two)": (10, 2, 6, 12, 33, 1, None, (5,)),
}


def _operands(case: str, dtype: torch.dtype, block: int, seed: int = 7, strided: bool = False):
    tokens, k, experts, n, kdim, r, only, idle = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    ids = _ids(tokens, k, experts, gen, only, idle)
    rows = torch.randn(tokens * k // r, kdim + (8 if strided else 0), generator=gen).to(DEVICE, dtype)[:, :kdim]
    d_rows = torch.randn(tokens * k, n, generator=gen).to(DEVICE, dtype)
    plan = align.align_block_size(ids.to(DEVICE), experts, block)
    return ids, rows, d_rows, plan, experts, r


@pytest.mark.parametrize("block, tiles", [(16, None), (32, NarrowTiles(32, 16, 4, 2))],
                         ids=["block 16, default tiles", "block 32, half-block steps"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).split(".")[1] for d in DTYPES])
def test_the_narrow_gradient_equals_a_float64_sum_per_expert(case: str, dtype: torch.dtype, block: int,
                                                             tiles: NarrowTiles) -> None:
    ids, rows, d_rows, plan, experts, r = _operands(case, dtype, block, strided=case.startswith("A"))
    assert narrow_problem(d_rows, rows, False, 0) is None
    dw = narrow_weight_grad(d_rows, rows, r, *plan, experts, block, torch.float32, tiles)
    want = _reference(d_rows, rows, ids, experts, r)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(dw.cpu().double(), want, rtol=tol, atol=tol)
    for e in CASES[case][7]:
        assert not dw[e].any()


def test_the_weight_gradient_takes_the_narrow_kernel_for_an_adapters_sides_and_the_same_bits_each_run() -> None:
    ids, rows, d_rows, plan, experts, r = _operands("A: narrow N, rows shared by top_k copies", torch.float32, 16)
    dw, db = weight_grad.expert_weight_grad(d_rows, rows, r, *plan, experts, 16, False)
    assert db is None
    assert torch.equal(dw, narrow_weight_grad(d_rows, rows, r, *plan, experts, 16, torch.float32))
    assert torch.equal(dw, weight_grad.expert_weight_grad(d_rows, rows, r, *plan, experts, 16, False)[0])


def test_many_copies_read_the_scatters_block_table() -> None:
    # more copies than one program aligns: the block table written by the scatter's programs, still ascending
    tokens, k, experts, n, kdim = align.IN_ORDER_COPIES // 2 + 7, 2, 9, 24, 8
    gen = torch.Generator().manual_seed(3)
    ids = _ids(tokens, k, experts, gen, idle=(0, 4))
    rows = torch.randn(tokens, kdim, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * k, n, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids.to(DEVICE), experts, 16, ordered=True)
    dw = narrow_weight_grad(d_rows, rows, k, *plan, experts, 16, torch.float32)
    torch.testing.assert_close(dw.cpu().double(), _reference(d_rows, rows, ids, experts, k)[0], rtol=1e-5, atol=1e-5)


def test_no_copies_give_a_zero_gradient() -> None:
    plan = align.align_block_size(torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), 3, 16)
    dw = narrow_weight_grad(torch.zeros(0, 4, device=DEVICE), torch.zeros(0, 24, device=DEVICE), 2, *plan, 3, 16,
                            torch.float16)
    assert dw.shape == (3, 4, 24) and dw.dtype == torch.float16 and not dw.any()


def test_what_the_narrow_kernel_does_not_take_is_named() -> None:
    wide, narrow = torch.zeros(4, NARROW + 1), torch.zeros(4, 16)
    assert narrow_problem(narrow, wide, False, 0) is None
    assert "no bias" in str(narrow_problem(narrow, wide, True, 0))
    assert "slot order" in str(narrow_problem(narrow, wide, False, 4))
    assert "at most 64" in str(narrow_problem(wide, wide, False, 0))
    assert "one dtype" in str(narrow_problem(narrow, wide.half(), False, 0))
    assert "contiguous" in str(narrow_problem(narrow, torch.zeros(16, 4).T, False, 0))
    plan = align.align_block_size(torch.zeros(4, 1, dtype=torch.int32, device=DEVICE), 1, 16)
    with pytest.raises(ValueError, match="must divide"):
        narrow_weight_grad(narrow.to(DEVICE), wide.to(DEVICE), 1, *plan, 1, 16, torch.float32, NarrowTiles(block_m=32))


def test_few_programs_take_longer_steps_on_a_gpu() -> None:
    gpu = torch.device("cuda")
    with unittest.mock.patch("moeforge.kernels.narrow_weight_grad.multiprocessors", return_value=132):
        assert default_tiles(gpu, 128, 8 * 32) == NarrowTiles(128, 128, 4, 2)  # Mixtral's A of the gate/up
        assert default_tiles(gpu, 128, 128 * 12) == NarrowTiles(128, 64, 4, 2)  # Qwen3's B of the gate/up
        assert default_tiles(gpu, 32, 8).block_m == 32  # (never past the alignment's block)
    assert default_tiles(torch.device("cpu"), 16, 1) == NarrowTiles(32, 16, 4, 2)


def test_the_scale_multiplies_both_kernels_gradients() -> None:
    # an adapter's alpha / r: inside the narrow kernel (before the cast), after the k-grouped one (the bias's too)
    ids, rows, d_rows, plan, experts, r = _operands("B: narrow K, idle experts first, middle and last", torch.float32,
                                                     16)
    want_w, want_b = (t * 0.25 for t in _reference(d_rows, rows, ids, experts, r))
    narrow, _ = weight_grad.expert_weight_grad(d_rows, rows, r, *plan, experts, 16, False, scale=0.25)
    k_grouped, db = weight_grad.expert_weight_grad(d_rows, rows, r, *plan, experts, 16, True, scale=0.25,
                                                   tiles=weight_grad.WeightGradTiles(32, 16, 16, 4, 2, False))
    for got, want in ((narrow, want_w), (k_grouped, want_w), (db, want_b)):
        assert got is not None
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)


@st.composite
def _narrow_cases(draw: st.DrawFn) -> tuple[int, int, int, int, int, int, int, int, int, bool]:
    experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, experts))
    tokens = draw(st.sampled_from([0, 1, 2, 5, 17, 40]))
    narrow = draw(st.integers(1, NARROW))
    wide = draw(st.integers(1, 96))
    block = draw(st.sampled_from([16, 32, 64]))
    step = draw(st.sampled_from([step for step in (16, 32, 64) if block % step == 0]))
    rows_per_x = draw(st.sampled_from([1, top_k]))
    seed = draw(st.integers(0, 2**16))
    return experts, top_k, tokens, narrow, wide, block, step, rows_per_x, seed, draw(st.booleans())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_narrow_cases())
def test_a_random_narrow_gradient_equals_a_float64_sum_per_expert(
        case: tuple[int, int, int, int, int, int, int, int, int, bool]) -> None:
    # Random experts, top-k, batches (none and one token included), narrow and wide widths (either side narrow),
    # alignment blocks and steps, rows shared by the copies or not: what the narrow kernel takes, it sums right.
    experts, top_k, tokens, narrow, wide, block, step, rows_per_x, seed, narrow_first = case
    gen = torch.Generator().manual_seed(seed)
    ids = _ids(tokens, top_k, experts, gen) if tokens else torch.zeros(0, top_k, dtype=torch.int32)
    n, k = (narrow, max(narrow, wide)) if narrow_first else (max(narrow, wide), narrow)
    rows = torch.randn(tokens * top_k // rows_per_x, k, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * top_k, n, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids.to(DEVICE), experts, block)
    dw = narrow_weight_grad(d_rows, rows, rows_per_x, *plan, experts, block, torch.float32,
                            NarrowTiles(32, step, 4, 2), scale=0.5)
    want = 0.5 * _reference(d_rows, rows, ids, experts, rows_per_x)[0]
    torch.testing.assert_close(dw.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["B: narrow K, idle experts first, middle and last", "every copy on one expert",
                                  "one token, rank 1", "top_k = experts, rank 64", "rank 12 (not a power of two)"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).split(".")[1] for d in DTYPES])
def test_an_updates_two_gradients_from_one_pass_equal_float64(case: str, dtype: torch.dtype) -> None:
    # scale * d_pre[c] @ B[e] for each copy and scale * sum_c d_pre[c]^T u[c] for each expert, from one read of d_pre
    tokens, k, experts, n, rank, _, only, idle = CASES[case]
    rank, n = min(n, rank), max(n, rank)  # (the update's rank the narrow side, d_pre's width the wide one)
    gen = torch.Generator().manual_seed(11)
    ids = _ids(tokens, k, experts, gen, only, idle)
    d_pre = torch.randn(tokens * k, n, generator=gen).to(DEVICE, dtype)
    u = torch.randn(tokens * k, rank, generator=gen).to(DEVICE, dtype)
    b = torch.randn(experts, n, rank, generator=gen).to(DEVICE, dtype)
    plan = align.align_block_size(ids.to(DEVICE), experts, 16)
    assert update_grads_problem(d_pre, u, b, 0) is None
    d_low, db = update_grads(d_pre, u, b, *plan, 16, 0.5, NarrowTiles(32, 16, 4, 2))
    owner = ids.reshape(-1).long()
    want_low = 0.5 * torch.einsum("cn,cnr->cr", d_pre.cpu().double(), b.cpu().double()[owner])
    want_db = 0.5 * _reference(d_pre, u, ids, experts, 1)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert d_low.dtype == dtype and db.dtype == dtype
    torch.testing.assert_close(d_low.cpu().double(), want_low, rtol=tol, atol=tol)
    torch.testing.assert_close(db.cpu().double(), want_db, rtol=tol, atol=tol)
    again = update_grads(d_pre, u, b, *plan, 16, 0.5, NarrowTiles(32, 16, 4, 2))
    assert torch.equal(again[0], d_low) and torch.equal(again[1], db)


def test_an_updates_gradients_without_copies_are_zero_and_bad_operands_are_named() -> None:
    plan = align.align_block_size(torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), 3, 16)
    d_low, db = update_grads(torch.zeros(0, 40, device=DEVICE), torch.zeros(0, 4, device=DEVICE),
                             torch.randn(3, 40, 4, device=DEVICE), *plan, 16, 2.0)
    assert d_low.shape == (0, 4) and db.shape == (3, 40, 4) and not db.any()
    d_pre, u, b = torch.zeros(4, 40), torch.zeros(4, 4), torch.zeros(3, 40, 4)
    assert "slot order" in str(update_grads_problem(d_pre, u, b, 4))
    assert "rank at most" in str(update_grads_problem(d_pre, u, torch.zeros(3, 40, 5), 0))
    assert "one dtype" in str(update_grads_problem(d_pre, u.half(), b, 0))
    with pytest.raises(ValueError, match="rank at most"):
        update_grads(d_pre, torch.zeros(4, 65), torch.zeros(3, 40, 65), *plan, 16, 1.0)
