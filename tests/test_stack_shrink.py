"""``stack_shrink``: each copy's ``x Aᵀ`` by its own adapter of a stack, copy by copy, over ranges of K (the served
stack's first product at few copies; the base GEMM sums the ranges, ``tests/test_gemm_update.py``), against a float64
reference: K split in ranges or not, one ``A`` per adapter for every expert, rows shared by a token's copies, ids of no
adapter and outside the stack (adapter 0's product, which the consumer weighs by 0 or NaN), no copies; under the
interpreter on the CPU, compiled on a GPU (at real widths there too)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from moeforge.kernels import stack_shrink as shrink  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def reference(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor,
              rows_per_a: int) -> torch.Tensor:
    """Each copy's product in float64 by the module's definition (one copy at a time): adapter 0's for an id of none
    or outside the stack."""
    stack = a.shape[0]
    low = torch.empty(ids.numel(), a.shape[2], dtype=torch.float64)
    for copy, (adapter, expert) in enumerate(zip(ids.tolist(), experts.tolist())):
        chosen = adapter if 0 <= adapter < stack else 0
        matrix = a[chosen, expert if a.shape[1] > 1 else 0].double().cpu()
        low[copy] = rows[copy // rows_per_a].double().cpu() @ matrix.t()
    return low


def summed(parts: torch.Tensor) -> torch.Tensor:
    return parts.cpu().double().sum(0)


def case(stack: int, experts: int, rank: int, k_dim: int, copies: int, rows_per_a: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(-(-copies // rows_per_a), k_dim, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(stack, experts, rank, k_dim, generator=gen) / k_dim ** 0.5).to(DEVICE, dtype)
    ids = torch.randint(-1, stack, (copies,), generator=gen)
    if copies > 2:
        ids[1], ids[2] = stack, -2  # outside the stack (its rows NaN in the consumer)
    return rows, a, ids.to(DEVICE), torch.randint(0, 8, (copies,), generator=gen).to(DEVICE)


@pytest.mark.parametrize("splits", [1, 2, 3, None])
@pytest.mark.parametrize("shape", [
    (3, 8, 16, 300, 7, 1),   # uneven K (not a multiple of the K-step), copy rows
    (4, 1, 5, 129, 9, 3),    # one A an adapter for every expert, a token's 3 copies on one row, a rank of 5
    (2, 8, 17, 64, 1, 1),    # one copy, one K-step, a rank above a power of two
])
def test_each_copys_product_by_its_own_adapter(shape: tuple[int, ...], splits: Optional[int]) -> None:
    stack, experts, rank, k_dim, copies, rows_per_a = shape
    rows, a, ids, copy_experts = case(stack, experts if experts > 1 else 1, rank, k_dim, copies, rows_per_a,
                                      torch.float16, seed=sum(shape))
    copy_experts = copy_experts if experts > 1 else copy_experts % 8  # (any expert: one A serves them all)
    parts = shrink.stack_shrink(rows, a, ids, copy_experts, rows_per_a, splits)
    ranges, _ = shrink.shrink_ranges(ids.numel(), k_dim, rows.device, splits)
    assert parts.shape == (ranges, copies, rank) and parts.dtype == torch.float32
    if splits is not None:
        assert ranges == min(splits, -(-k_dim // 128))  # (whole 128-element steps a range)
    torch.testing.assert_close(summed(parts), reference(rows, a, ids, copy_experts, rows_per_a), rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stack=st.integers(1, 6), shared=st.booleans(), rank=st.integers(1, 33), k_dim=st.integers(1, 400),
       copies=st.integers(0, 11), rows_per_a=st.integers(1, 4), splits=st.integers(1, 5), seed=st.integers(0, 999))
def test_random_stacks_against_the_reference(stack: int, shared: bool, rank: int, k_dim: int, copies: int,
                                             rows_per_a: int, splits: int, seed: int) -> None:
    rows, a, ids, experts = case(stack, 1 if shared else 8, rank, k_dim, copies, rows_per_a, torch.float32, seed)
    parts = shrink.stack_shrink(rows, a, ids, experts, rows_per_a, splits)
    torch.testing.assert_close(summed(parts), reference(rows, a, ids, experts, rows_per_a), rtol=1e-4, atol=1e-4)


def test_each_range_holds_its_own_share_of_k_and_runs_give_the_same_bits() -> None:
    rows, a, ids, experts = case(3, 8, 16, 520, 6, 2, torch.bfloat16, seed=4)
    first = shrink.stack_shrink(rows, a, ids, experts, 2, 3)
    assert torch.equal(first, shrink.stack_shrink(rows, a, ids, experts, 2, 3))
    assert first.shape[0] == 3  # 520 = 5 steps of 128: ranges of 256, 256, 8 elements
    for part, (start, end) in zip(first, ((0, 256), (256, 512), (512, 520))):
        want = reference(rows[:, start:end], a[..., start:end], ids, experts, 2)
        torch.testing.assert_close(part.cpu().double(), want, rtol=2e-3, atol=2e-3)


def test_operands_of_any_strides() -> None:
    # rows and A as views (a transposed copy's, every other element's): the products of contiguous operands (compiled
    # for other strides, the kernel may add a step's products in another order: equal up to fp32 rounding)
    rows, a, ids, experts = case(3, 8, 16, 200, 6, 1, torch.float32, seed=7)
    rows_t = rows.t().contiguous().t()
    a_wide = torch.zeros(*a.shape[:3], 2 * a.shape[3], dtype=a.dtype, device=a.device)
    a_wide[..., ::2] = a
    got = shrink.stack_shrink(rows_t, a_wide[..., ::2], ids, experts, 1, 2)
    want = shrink.stack_shrink(rows, a, ids, experts, 1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed(got), reference(rows, a, ids, experts, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_parts_summed_by_a_launch_of_their_own_weighed_by_their_ids(splits: int) -> None:
    # reduce_parts (a long K-loop's): the parts summed in one order, weighed by each copy's id (the scale in the stack,
    # 0 for -1, NaN outside [-1, S)), each copy's adapter clamped into the stack
    rows, a, ids, experts = case(3, 8, 16, 520, 9, 2, torch.float32, seed=splits)
    parts = shrink.stack_shrink(rows, a, ids, experts, 2, splits)
    low, chosen = shrink.reduce_parts(parts, ids, 3, 0.5, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and chosen.dtype == torch.int32
    inside = (ids >= -1) & (ids < 3)
    assert torch.equal(chosen.cpu(), torch.where(inside & (ids >= 0), ids, 0).int().cpu())
    used = torch.where(inside, (ids >= 0).double() * 0.5, float("nan")).cpu()
    want = used[:, None] * reference(rows, a, ids, experts, 2)
    torch.testing.assert_close(low.cpu().double(), want, rtol=2e-2, atol=2e-2, equal_nan=True)
    assert low[~inside].isnan().all() and (low[ids == -1] == 0).all()
    again = shrink.reduce_parts(parts, ids, 3, 0.5, torch.bfloat16)
    assert torch.equal(low.nan_to_num(), again[0].nan_to_num())
    with pytest.raises(ValueError, match="fp32 parts"):
        shrink.reduce_parts(parts.half(), ids, 3, 0.5, torch.float32)


def test_no_copies_and_bad_operands() -> None:
    rows, a, ids, experts = case(2, 8, 4, 64, 0, 1, torch.float32, seed=1)
    parts = shrink.stack_shrink(rows, a, ids, experts, 1)
    assert parts.shape == (1, 0, 4)
    rows, a, ids, experts = case(2, 8, 4, 64, 5, 1, torch.float32, seed=1)
    with pytest.raises(ValueError, match="of one K"):
        shrink.stack_shrink(rows[:, :32], a, ids, experts, 1)
    with pytest.raises(ValueError, match="need an expert each"):
        shrink.stack_shrink(rows, a, ids, experts[:3], 1)
    with pytest.raises(ValueError, match="need an expert each"):
        shrink.stack_shrink(rows[:2], a, ids, experts, 1)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("k_dim, copies", [(14336, 2), (4096, 16), (2048, 8), (768, 512)])
def test_at_the_serving_widths_compiled(k_dim: int, copies: int) -> None:
    """Mixtral's and Qwen3's widths at decode batches (the default ranges of K), bf16."""
    rows, a, ids, experts = case(8, 8, 16, k_dim, copies, 1, torch.bfloat16, seed=k_dim + copies)
    assert shrink.shrink_splits(copies, k_dim, rows.device) >= 1
    parts = shrink.stack_shrink(rows, a, ids, experts, 1)
    assert parts.shape[0] == shrink.shrink_ranges(copies, k_dim, rows.device)[0]
    torch.testing.assert_close(summed(parts), reference(rows, a, ids, experts, 1), rtol=2e-2, atol=2e-2)
    assert torch.equal(parts, shrink.stack_shrink(rows, a, ids, experts, 1))  # the same bits every run
