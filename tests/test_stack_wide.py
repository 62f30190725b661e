"""``stack_wide``: each copy's ``x Aᵀ`` by every adapter of a stack on the base GEMM's alignment, kept in its own
adapter's columns and weighed by its id (the served stack's first product at many copies; the base GEMM adds ``· Bᵀ``
of every adapter's columns, ``tests/test_gemm_update.py``), against a float64 reference: uneven K, one ``A`` per
adapter for every expert, rows shared by a token's copies, ids of no adapter (zero) and outside the stack (NaN in
adapter 0's columns), alignment blocks larger than a program's, no copies, bad operands; under the interpreter on the
CPU, compiled on a GPU (at Qwen3's and Mixtral's widths there)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moeforge.kernels import align  # noqa: E402
from moeforge.kernels import stack_wide as wide  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def reference(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor, rows_per_a: int,
              scale: float) -> torch.Tensor:
    """Each copy's row by the module's definition, in float64, one copy at a time."""
    stack, _, rank, _ = a.shape
    out = torch.zeros(ids.numel(), stack * rank, dtype=torch.float64)
    for copy, (adapter, expert) in enumerate(zip(ids.tolist(), experts.tolist())):
        inside = -1 <= adapter < stack
        chosen = max(adapter, 0) if inside else 0
        weight = (scale if adapter >= 0 else 0.0) if inside else float("nan")
        matrix = a[chosen, expert if a.shape[1] > 1 else 0].double().cpu()
        out[copy, chosen * rank:(chosen + 1) * rank] = (rows[copy // rows_per_a].double().cpu() @ matrix.t()) * weight
    return out


def case(stack: int, experts: int, rank: int, k_dim: int, tokens: int, top_k: int, shared: bool, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, k_dim, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(stack, 1 if shared else experts, rank, k_dim, generator=gen) / k_dim ** 0.5).to(DEVICE, dtype)
    ids = torch.randint(-1, stack, (tokens * top_k,), generator=gen)
    if ids.numel() > 2:
        ids[1], ids[2] = stack, -2  # outside the stack: NaN in adapter 0's columns
    route = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    return rows, a, ids.to(DEVICE), route.to(DEVICE)


def run(rows: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, route: torch.Tensor, experts: int, block_m: int,
        scale: float, dtype: torch.dtype) -> torch.Tensor:
    plan = align.align_block_size(route, experts, block_m)
    return wide.stack_wide(rows, a, ids, *plan, block_m, ids.numel(), route.shape[1], scale, dtype)


@pytest.mark.parametrize("stack, experts, rank, k_dim, tokens, top_k, shared, block_m", [
    (3, 6, 5, 100, 9, 2, False, 16),    # uneven K, a rank of 5 (the columns cross adapters inside a 16-wide tile)
    (4, 5, 16, 64, 7, 3, True, 32),     # one A an adapter for every expert, a token's 3 copies on one row
    (2, 4, 3, 48, 1, 1, False, 256),    # one copy; an alignment block above the program's 128 rows
    (9, 3, 16, 32, 5, 2, False, 16),    # 144 columns: two column tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_copys_columns_by_its_own_adapter(stack: int, experts: int, rank: int, k_dim: int, tokens: int,
                                               top_k: int, shared: bool, block_m: int, dtype: torch.dtype) -> None:
    rows, a, ids, route = case(stack, experts, rank, k_dim, tokens, top_k, shared, dtype, seed=stack + rank)
    out = run(rows, a, ids, route, experts, block_m, 0.75, dtype)
    want = reference(rows, a, ids, route.reshape(-1), top_k, 0.75)
    assert out.shape == (tokens * top_k, stack * rank) and out.dtype == dtype
    got = out.cpu().double()
    assert torch.equal(got.isnan(), want.isnan())  # the ids outside the stack, in adapter 0's columns only
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), rtol=tol, atol=tol)
    again = run(rows, a, ids, route, experts, block_m, 0.75, dtype)
    torch.testing.assert_close(again, out, rtol=0, atol=0, equal_nan=True)  # the same bits every run


def test_no_copies_and_bad_operands() -> None:
    rows, a, ids, route = case(2, 4, 4, 32, 3, 2, False, torch.float32, seed=1)
    empty = align.align_block_size(route[:0], 4, 16)
    assert wide.stack_wide(rows[:0], a, ids[:0], *empty, 16, 0, 2, 1.0, torch.float32).shape == (0, 8)
    plan = align.align_block_size(route, 4, 16)
    with pytest.raises(ValueError, match="of one K and dtype"):
        wide.stack_wide(rows[:, :16], a, ids, *plan, 16, 6, 2, 1.0, torch.float32)
    with pytest.raises(ValueError, match="of one K and dtype"):
        wide.stack_wide(rows.half(), a, ids, *plan, 16, 6, 2, 1.0, torch.float32)
    with pytest.raises(ValueError, match="need an id each"):
        wide.stack_wide(rows, a, ids[:5], *plan, 16, 6, 2, 1.0, torch.float32)
    with pytest.raises(ValueError, match="an expert per block"):
        wide.stack_wide(rows, a, ids, *plan, 32, 6, 2, 1.0, torch.float32)  # aligned by 16, read as 32


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("experts, top_k, k_dim, tokens, block_m", [(128, 8, 2048, 512, 64), (128, 8, 768, 64, 16),
                                                                    (8, 2, 4096, 300, 128)])
def test_at_the_serving_widths_compiled(experts: int, top_k: int, k_dim: int, tokens: int, block_m: int) -> None:
    """Qwen3's (both GEMMs' K) and Mixtral's widths, 8 adapters of rank 16, bf16."""
    rows, a, ids, route = case(8, experts, 16, k_dim, tokens, top_k, False, torch.bfloat16, seed=k_dim)
    out = run(rows, a, ids, route, experts, block_m, 2.0, torch.bfloat16)
    want = reference(rows, a, ids, route.reshape(-1), top_k, 2.0)
    got = out.cpu().double()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(run(rows, a, ids, route, experts, block_m, 2.0, torch.bfloat16), out, rtol=0, atol=0,
                               equal_nan=True)
