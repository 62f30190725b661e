"""``stack_shrink``: each copy's ``x Aᵀ`` by its own adapter of a stack, copy by copy (the served stack's first product
at few copies), against a float64 reference: K split in ranges or not, one ``A`` per adapter for every expert, rows
shared by a token's copies, ids of no adapter and outside the stack, no copies; under the interpreter on the CPU,
compiled on a GPU (at real widths there too)."""

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


def reference(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor, rows_per_a: int,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, chosen)`` in float64 by the module's definition (one copy at a time)."""
    stack = a.shape[0]
    low = torch.empty(ids.numel(), a.shape[2], dtype=torch.float64)
    chosen = torch.empty(ids.numel(), dtype=torch.int32)
    for copy, (adapter, expert) in enumerate(zip(ids.tolist(), experts.tolist())):
        inside = -1 <= adapter < stack
        chosen[copy] = max(adapter, 0) if inside else 0
        used = (scale if adapter >= 0 else 0.0) if inside else float("nan")
        matrix = a[int(chosen[copy]), expert if a.shape[1] > 1 else 0].double().cpu()
        low[copy] = used * (rows[copy // rows_per_a].double().cpu() @ matrix.t())
    return low, chosen


def case(stack: int, experts: int, rank: int, k_dim: int, copies: int, rows_per_a: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(-(-copies // rows_per_a), k_dim, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(stack, experts, rank, k_dim, generator=gen) / k_dim ** 0.5).to(DEVICE, dtype)
    ids = torch.randint(-1, stack, (copies,), generator=gen)
    if copies > 2:
        ids[1], ids[2] = stack, -2  # outside the stack: NaN rows
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
    low, chosen = shrink.stack_shrink(rows, a, ids, copy_experts, rows_per_a, 0.5, torch.float32, splits)
    want_low, want_chosen = reference(rows, a, ids, copy_experts, rows_per_a, 0.5)
    assert torch.equal(chosen.cpu(), want_chosen)
    torch.testing.assert_close(low.cpu().double(), want_low, rtol=1e-4, atol=1e-4, equal_nan=True)
    outside = (ids < -1) | (ids >= stack)
    assert low[outside].isnan().all() and not low[~outside].isnan().any()
    assert (low[ids == -1] == 0).all()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stack=st.integers(1, 6), shared=st.booleans(), rank=st.integers(1, 33), k_dim=st.integers(1, 400),
       copies=st.integers(0, 11), rows_per_a=st.integers(1, 4), splits=st.integers(1, 5), seed=st.integers(0, 999))
def test_random_stacks_against_the_reference(stack: int, shared: bool, rank: int, k_dim: int, copies: int,
                                             rows_per_a: int, splits: int, seed: int) -> None:
    rows, a, ids, experts = case(stack, 1 if shared else 8, rank, k_dim, copies, rows_per_a, torch.float32, seed)
    low, chosen = shrink.stack_shrink(rows, a, ids, experts, rows_per_a, 1.5, torch.float32, splits)
    want_low, want_chosen = reference(rows, a, ids, experts, rows_per_a, 1.5)
    assert torch.equal(chosen.cpu(), want_chosen)
    torch.testing.assert_close(low.cpu().double(), want_low, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_the_ranges_sum_in_one_order_and_the_output_takes_the_asked_dtype() -> None:
    rows, a, ids, experts = case(3, 8, 16, 520, 6, 2, torch.bfloat16, seed=4)
    first = shrink.stack_shrink(rows, a, ids, experts, 2, 2.0, torch.bfloat16, 3)
    again = shrink.stack_shrink(rows, a, ids, experts, 2, 2.0, torch.bfloat16, 3)
    assert first[0].dtype == torch.bfloat16
    assert torch.equal(first[0].nan_to_num(), again[0].nan_to_num()) and torch.equal(first[1], again[1])
    want, _ = reference(rows, a, ids, experts, 2, 2.0)
    torch.testing.assert_close(first[0].cpu().double(), want, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_operands_of_any_strides() -> None:
    # rows and A as views (a transposed copy's, every other element's): the products of contiguous operands (compiled
    # for other strides, the kernel may add a step's products in another order: equal up to fp32 rounding)
    rows, a, ids, experts = case(3, 8, 16, 200, 6, 1, torch.float32, seed=7)
    rows_t = rows.t().contiguous().t()
    a_wide = torch.zeros(*a.shape[:3], 2 * a.shape[3], dtype=a.dtype, device=a.device)
    a_wide[..., ::2] = a
    got = shrink.stack_shrink(rows_t, a_wide[..., ::2], ids, experts, 1, 1.0, torch.float32, 2)
    want = shrink.stack_shrink(rows, a, ids, experts, 1, 1.0, torch.float32, 2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].cpu().double(), reference(rows, a, ids, experts, 1, 1.0)[0], rtol=1e-4,
                               atol=1e-4, equal_nan=True)


def test_no_copies_and_bad_operands() -> None:
    rows, a, ids, experts = case(2, 8, 4, 64, 0, 1, torch.float32, seed=1)
    low, chosen = shrink.stack_shrink(rows, a, ids, experts, 1, 1.0, torch.float32)
    assert low.shape == (0, 4) and chosen.shape == (0,)
    rows, a, ids, experts = case(2, 8, 4, 64, 5, 1, torch.float32, seed=1)
    with pytest.raises(ValueError, match="of one K"):
        shrink.stack_shrink(rows[:, :32], a, ids, experts, 1, 1.0, torch.float32)
    with pytest.raises(ValueError, match="need an expert each"):
        shrink.stack_shrink(rows, a, ids, experts[:3], 1, 1.0, torch.float32)
    with pytest.raises(ValueError, match="need an expert each"):
        shrink.stack_shrink(rows[:2], a, ids, experts, 1, 1.0, torch.float32)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("k_dim, copies", [(14336, 2), (4096, 16), (2048, 8), (768, 512)])
def test_at_the_serving_widths_compiled(k_dim: int, copies: int) -> None:
    """Mixtral's and Qwen3's widths at decode batches (the default ranges of K), bf16."""
    rows, a, ids, experts = case(8, 8, 16, k_dim, copies, 1, torch.bfloat16, seed=k_dim + copies)
    assert shrink.shrink_splits(copies, k_dim, rows.device) >= 1
    low, chosen = shrink.stack_shrink(rows, a, ids, experts, 1, 2.0, torch.bfloat16)
    want, want_chosen = reference(rows, a, ids, experts, 1, 2.0)
    assert torch.equal(chosen.cpu(), want_chosen)
    torch.testing.assert_close(low.cpu().double(), want, rtol=2e-2, atol=2e-2, equal_nan=True)
    assert torch.equal(low.nan_to_num(), shrink.stack_shrink(rows, a, ids, experts, 1, 2.0, torch.bfloat16)[0]
                       .nan_to_num())  # the same bits every run
