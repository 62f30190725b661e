"""The experts' weight and bias gradients (``moeforge/kernels/weight_grad.py``): the rows gathered into expert
order (no padding), then a k-grouped GEMM per expert, by pointer loads and by TMA descriptors (on CPU Triton's interpreter
emulates the descriptors' loads, zero fill past the edges included), against a float64 sum per expert.

The shapes cover what users' batches give: idle experts, every copy on one expert, one token, no tokens, widths
past the last full tile, steps smaller and larger than the alignment's block, runs that are not a whole number of
steps, rows shared by ``top_k`` copies and not.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

pytest.importorskip("triton")

from moeforge.kernels import align, gluon_weight_grad, weight_grad  # noqa: E402
from moeforge.kernels.weight_grad import (  # noqa: E402
    WeightGradTiles,
    expert_bias_grad,
    expert_runs,
    expert_weight_grad,
    gather_expert_rows,
    weight_grad_tiles,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL = {  # (launch, alignment block): pointer loads and TMA, a step of the whole block and of half of it
    "pointer": (WeightGradTiles(32, 16, 16, 4, 2, False), 16),
    "tma": (WeightGradTiles(16, 32, 16, 4, 2, True), 16),
    "tma, half-block steps": (WeightGradTiles(32, 32, 16, 4, 2, True), 32),
    "tma, stored by tma": (WeightGradTiles(16, 32, 16, 4, 2, True, tma_store=True), 16),
    "pointer, half-block steps": (WeightGradTiles(16, 16, 16, 4, 2, False), 32),
    "tma, half-block steps, narrow tiles": (WeightGradTiles(16, 16, 16, 4, 2, True), 32),
}


def _ids(tokens: int, k: int, experts: int, gen: torch.Generator, only: Optional[int] = None,
         idle: tuple[int, ...] = ()) -> torch.Tensor:
    if only is not None:
        return torch.full((tokens, k), only, dtype=torch.int32)
    active = [e for e in range(experts) if e not in idle]
    choice = torch.stack([torch.randperm(len(active), generator=gen)[:k] for _ in range(tokens)])
    return torch.tensor(active)[choice].to(torch.int32).reshape(tokens, k)


def _reference(d_rows: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, experts: int, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    flat = ids.reshape(-1).long().cpu()
    dw = torch.zeros(experts, d_rows.shape[1], rows.shape[1], dtype=torch.float64)
    db = torch.zeros(experts, d_rows.shape[1], dtype=torch.float64)
    for e in range(experts):
        chosen = (flat == e).nonzero().flatten()
        dw[e] = d_rows.cpu()[chosen].double().T @ rows.cpu()[chosen // k].double()
        db[e] = d_rows.cpu()[chosen].double().sum(0)
    return dw, db


CASES = {  # (tokens, top_k, experts, N, K, rows per A, only, idle)
    "spread, idle expert": (13, 2, 5, 40, 24, 2, None, (3,)),
    "every copy on one expert": (9, 1, 4, 24, 40, 1, 2, ()),
    "one token": (1, 2, 4, 33, 17, 2, None, ()),
    "top_k = experts": (6, 3, 3, 16, 16, 3, None, ()),
}


@pytest.mark.parametrize("tiles", list(SMALL), ids=list(SMALL))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_weight_and_bias_gradients_equal_a_float64_sum_per_expert(case: str, tiles: str,
                                                                      dtype: torch.dtype) -> None:
    tokens, k, experts, n, kdim, r, only, idle = CASES[case]
    gen = torch.Generator().manual_seed(7)
    ids = _ids(tokens, k, experts, gen, only, idle)
    rows = torch.randn(tokens * k // r, kdim, generator=gen).to(DEVICE, dtype)
    d_rows = torch.randn(tokens * k, n, generator=gen).to(DEVICE, dtype)
    launch, block = SMALL[tiles]
    sorted_ids, block_expert, num_padded = align.align_block_size(ids.to(DEVICE), experts, block)
    dw, db = expert_weight_grad(d_rows, rows, r, sorted_ids, block_expert, num_padded, experts, block, True,
                                tiles=launch)
    want_w, want_b = _reference(d_rows, rows, ids, experts, r)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert db is not None and dw.dtype == torch.float32
    torch.testing.assert_close(dw.cpu().double(), want_w, rtol=tol, atol=tol)
    torch.testing.assert_close(db.cpu().double(), want_b, rtol=tol, atol=tol)
    for e in idle:
        assert not dw[e].any() and not db[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_bias_gradient_of_its_own_launch_sums_each_run_alone(dtype: torch.dtype) -> None:
    # expert_bias_grad (beside the Gluon weight gradient, which sums no bias): runs of uneven lengths (not whole
    # steps, one longer than two steps), an idle expert, rows before, between and after the runs holding large values
    # that must not reach any sum; the same bits on a second launch.
    gen = torch.Generator().manual_seed(3)
    counts, n, gap = [5, 0, 37, 16, 1], 40, 3
    firsts, row = [], 2
    for count in counts:
        firsts.append(row)
        row += count + gap
    dy = torch.full((row, n), 3e4)
    for first, count in zip(firsts, counts):
        dy[first:first + count] = torch.randn(count, n, generator=gen)
    dy = dy.to(DEVICE, dtype)
    first = torch.tensor(firsts, dtype=torch.int32, device=DEVICE)
    count = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    db = expert_bias_grad(dy, first, count, torch.empty(len(counts), n, dtype=dtype, device=DEVICE))
    want = torch.stack([dy.cpu()[f:f + c].double().sum(0) for f, c in zip(firsts, counts)])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(db.cpu().double(), want, rtol=tol, atol=tol)
    assert not db[1].any()
    again = expert_bias_grad(dy, first, count, torch.empty_like(db))
    assert torch.equal(again, db)


@pytest.mark.parametrize("layout", ["copy order, compact operands", "copy order, one operand padded", "slot order"])
def test_a_bias_gradient_beside_the_gluon_kernel_is_a_launch_of_its_own(monkeypatch: pytest.MonkeyPatch,
                                                                        layout: str) -> None:
    # A layer with expert biases takes the Gluon weight gradient (sm_90; stood in for here by a float64 sum over the
    # runs it is given): its bias gradient comes from expert_bias_grad over the same runs of dy rows, in each branch
    # of the weight gradient that launches the Gluon kernel.
    def gluon_stand_in(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, dy_first: torch.Tensor,
                       x_first: torch.Tensor, counts: torch.Tensor, **launch: object) -> torch.Tensor:
        for e in range(dw.shape[0]):
            c, a, b = int(counts[e]), int(dy_first[e]), int(x_first[e])
            dw[e] = (dy[a:a + c].double().T @ x[b:b + c].double()).to(dw.dtype)
        return dw

    monkeypatch.setattr(gluon_weight_grad, "operand_problem", lambda *args: None)
    monkeypatch.setattr(gluon_weight_grad, "launch_checked", gluon_stand_in)
    if layout == "copy order, one operand padded":
        monkeypatch.setattr(weight_grad, "COMPACT_UNTIL", 0)
    tiles = WeightGradTiles(128, 128, 16, 4, 4, True, warp_specialized=True, pingpong=True)
    tokens, k, experts, n, kdim, block = 23, 2, 5, 24, 40, 32
    gen = torch.Generator().manual_seed(11)
    ids = _ids(tokens, k, experts, gen, idle=(1,))
    rows = torch.randn(tokens, kdim, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * k, n, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids.to(DEVICE), experts, block)
    if layout == "slot order":
        from moeforge.kernels import slot_rows

        xs, _, slot_of, row_of_slot, runs = slot_rows.gather_slots(rows, None, *plan, k, experts, block)
        d_xs = torch.empty_like(d_rows)
        d_xs[slot_of.long()] = d_rows
        dw, db = expert_weight_grad(d_xs, xs, 1, row_of_slot, plan[1], plan[2], experts, block, True, tiles=tiles,
                                    slot_copies=tokens * k, slot_runs=runs)
    else:
        dw, db = expert_weight_grad(d_rows, rows, k, *plan, experts, block, True, tiles=tiles)
    want_w, want_b = _reference(d_rows, rows, ids, experts, k)
    assert db is not None
    torch.testing.assert_close(dw.cpu().double(), want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.cpu().double(), want_b, rtol=1e-5, atol=1e-5)
    assert not db[1].any()


def test_no_copies_give_zero_gradients() -> None:
    ids = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 3, 16)
    dw, db = expert_weight_grad(torch.zeros(0, 24, device=DEVICE), torch.zeros(0, 8, device=DEVICE), 2, sorted_ids,
                                block_expert, num_padded, 3, 16, True)
    assert dw.shape == (3, 24, 8) and not dw.any() and db is not None and not db.any()


def test_the_gradient_is_written_in_the_asked_dtype_without_bias() -> None:
    gen = torch.Generator().manual_seed(9)
    ids = _ids(8, 2, 4, gen)
    rows = torch.randn(8, 16, generator=gen).to(DEVICE)
    d_rows = torch.randn(16, 32, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids.to(DEVICE), 4, 16)
    dw, db = expert_weight_grad(d_rows, rows, 2, *plan, 4, 16, False, torch.float16)
    assert db is None and dw.dtype == torch.float16
    torch.testing.assert_close(dw.cpu().double(), _reference(d_rows, rows, ids, 4, 2)[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("step", [32, 8], ids=["not dividing", "below the MMA's 16"])
def test_a_step_the_kernel_cannot_take_is_refused(step: int) -> None:
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    plan = align.align_block_size(ids, 1, 16)
    with pytest.raises(ValueError, match="must divide"):
        expert_weight_grad(torch.zeros(4, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE), 1, *plan, 1, 16,
                           False, tiles=WeightGradTiles(16, 16, step, 4, 2, False))


@pytest.mark.parametrize("padded_step", [0, 16, 32], ids=["compact", "padded to 16", "padded to 32"])
@pytest.mark.parametrize("tokens,block", [(7, 32), (300, 32)], ids=["one program aligns", "the three-launch plan"])
def test_gathered_rows_are_the_copies_in_slot_order_each_run_padded_or_not(tokens: int, block: int,
                                                                          padded_step: int) -> None:
    # The copies the slots hold, in slot order, the alignment's padding left out: each expert's run from runs[1, e]
    # (compact) or runs[3, e] (rounded up to whole steps with zero rows), its copies in ascending order.
    gen = torch.Generator().manual_seed(11)
    experts, k = 5, 2
    ids = _ids(tokens, k, experts, gen, idle=(1,))
    src = torch.randn(tokens, 20, generator=gen).to(DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids.to(DEVICE), experts, block)
    runs = expert_runs(block_expert, sorted_ids, num_padded, block, experts, tokens * k, padded_step or 16)
    out = gather_expert_rows(src, sorted_ids, block_expert, runs, num_padded, tokens * k, k, block, padded_step)
    flat = ids.reshape(-1)
    row = 0
    for e in range(experts):
        mine = torch.nonzero(flat == e).flatten().tolist()
        first = int(runs[3 if padded_step else 1, e])
        assert first == row
        assert torch.equal(out[first:first + len(mine)], src[torch.tensor(mine, dtype=torch.long, device=DEVICE) // k])
        whole = -(-len(mine) // padded_step) * padded_step if padded_step else len(mine)
        assert not out[first + len(mine):first + whole].any()
        row += whole
    assert out.shape[0] == (tokens * k + min(experts, tokens * k) * (padded_step - 1) if padded_step else tokens * k)
    assert int(runs[3 if padded_step else 1, experts]) == row


def test_a_padded_step_that_does_not_divide_the_block_is_refused() -> None:
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 1, 16)
    runs = expert_runs(block_expert, sorted_ids, num_padded, 16, 1, 4, 16)
    with pytest.raises(ValueError, match="must divide"):
        gather_expert_rows(torch.zeros(4, 8, device=DEVICE), sorted_ids, block_expert, runs, num_padded, 4, 1, 16, 32)


@pytest.mark.parametrize("tokens", [40, 300])  # 160 copies: one program sorts them; 1200: the two-kernel plan
def test_each_expert_sums_its_copies_in_ascending_order(tokens: int) -> None:
    # The alignment places each expert's copies in ascending order (align_block_size, both paths), the order the
    # gradient sums them in: the sum equals the one over the copies in that order, bit for bit in fp32 accumulation
    # of fp32 operands against the float64 reference's rounding, and the same bits from run to run.
    gen = torch.Generator().manual_seed(13)
    k, experts, block = 4, 5, 16
    ids = _ids(tokens, k, experts, gen)
    rows = torch.randn(tokens, 24, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * k, 40, generator=gen).to(DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids.to(DEVICE), experts, block)
    used = int(num_padded)
    owner = block_expert.long().repeat_interleave(block)[:used].cpu()
    placed = sorted_ids[:used].cpu()
    flat = ids.reshape(-1).long()
    for e in range(experts):
        mine = placed[(owner == e) & (placed < tokens * k)]
        assert mine.tolist() == torch.nonzero(flat == e).flatten().tolist()  # ascending copy order
    loads = {(tiles.tma, tiles.tma_store): tiles for tiles, _ in SMALL.values()}  # (pointer, TMA, TMA store)
    for tiles in loads.values():
        tiles = WeightGradTiles(tiles.block_n, tiles.block_k, 16, 4, 2, tiles.tma, tiles.tma_store)
        first = expert_weight_grad(d_rows, rows, k, sorted_ids, block_expert, num_padded, experts, block, True,
                                   tiles=tiles)
        again_plan = align.align_block_size(ids.to(DEVICE), experts, block)
        again = expert_weight_grad(d_rows, rows, k, *again_plan, experts, block, True, tiles=tiles)
        assert torch.equal(first[0], again[0]) and first[1] is not None and again[1] is not None
        assert torch.equal(first[1], again[1])


def test_a_training_forward_aligns_in_order_and_an_inference_forward_need_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # The triton dispatch asks for the ordered alignment exactly where a backward can follow (grad mode on): the
    # weight gradient's order. Under no_grad the cheaper scatter with atomics may serve.
    from moeforge.kernels import ops
    from moeforge.kernels.config import ConfigTable
    from moeforge.payloads import Activations, RoutedTokens, TopKOutput
    from moeforge.stages.triton import AlignDispatch

    asked: list[bool] = []
    real = ops.align_block_size
    monkeypatch.setattr(ops, "align_block_size", lambda ids, experts, block_m, ordered: asked.append(ordered) or real(
        ids, experts, block_m, ordered))
    stage = AlignDispatch(8, ConfigTable(8, 2))
    gen = torch.Generator().manual_seed(5)
    tokens = TopKOutput(torch.rand(600, 2, generator=gen).to(DEVICE), _ids(600, 2, 8, gen).to(DEVICE))
    routed = RoutedTokens(Activations(torch.randn(600, 16, generator=gen).to(DEVICE)), tokens)
    stage(routed)
    with torch.no_grad():
        stage(routed)
    assert asked == [True, False]


@pytest.mark.parametrize("tokens,k,experts,block,only,idle", [
    (0, 2, 4, 16, None, ()), (1, 1, 4, 16, None, ()), (40, 2, 5, 16, None, (0, 4)), (300, 3, 5, 32, None, (2,)),
    (50, 2, 6, 16, 5, ()), (200, 8, 128, 16, None, ()), (700, 2, 3, 64, None, (2,)), (64, 2, 4, 16, 1, ()),
    (900, 4, 300, 256, None, (7, 299))])
@pytest.mark.parametrize("step", [16, 64])
def test_each_experts_run_is_read_off_the_alignment(step: int, tokens: int, k: int, experts: int, block: int,
                                                    only: Optional[int], idle: tuple[int, ...]) -> None:
    # One launch finds each expert's first block, first row in expert order and copies; against the alignment read
    # on the host. Idle experts (first and last ones too), every copy on one expert (a run of whole blocks too: no
    # padding), no tokens, both alignment paths, more experts than one chunk of the copies' pass.
    ids = (_ids(tokens, k, experts, torch.Generator().manual_seed(tokens + experts), only=only, idle=idle) if tokens
           else torch.empty(0, k, dtype=torch.int32))
    sorted_ids, block_expert, num_padded = align.align_block_size(ids.to(DEVICE), experts, block)
    used = int(num_padded) // block
    owners = block_expert[:used].long().cpu()
    copies = torch.bincount(ids.reshape(-1).long(), minlength=experts)[:experts].tolist()
    firsts = [sum(copies[:e]) for e in range(experts)]
    whole = [-(-c // step) * step for c in copies]
    want = [[int((owners < e).sum()) for e in range(experts)] + [used], firsts + [tokens * k],
            copies + [tokens * k], [sum(whole[:e]) for e in range(experts)] + [sum(whole)]]
    assert expert_runs(block_expert, sorted_ids, num_padded, block, experts, tokens * k, step).cpu().tolist() == want


def test_the_default_tiles_divide_every_alignment_block() -> None:
    for block in (16, 32, 64, 128, 256):
        for n, kdim in ((28672, 4096), (4096, 14336), (96, 64)):
            for rows_per_expert in (8.0, 4096.0):
                tiles = weight_grad_tiles(n, kdim, torch.bfloat16, block, torch.device("cpu"), rows_per_expert)
                assert block % tiles.block_m == 0 and tiles.block_m >= 16


def test_the_gluon_ping_pong_takes_16_bit_launches_up_to_its_rows_per_expert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the rule on an sm_90 GPU that runs Gluon (both stand-ins here: the rule reads no other device property)
    monkeypatch.setattr(weight_grad, "capability_has_tma", lambda device: True)
    monkeypatch.setattr(gluon_weight_grad, "device_problem", lambda device: None)
    gpu = torch.device("cuda", 0)
    for rows_per_expert, step in ((8.0, 32), (512.0, 64), (4095.0, 64)):
        tiles = weight_grad_tiles(4096, 7168, torch.bfloat16, 128, gpu, rows_per_expert)
        # 64-row steps store their tiles by TMA, 32-row steps from registers (faster there)
        assert tiles == WeightGradTiles(128, 128, step, 4, 4, True, warp_specialized=True, pingpong=True,
                                        tma_store=step == 64)
        narrow = weight_grad_tiles(4096, 7168, torch.float16, 16, gpu, rows_per_expert)
        assert narrow.block_m == 16 and not narrow.tma_store
    long = weight_grad_tiles(4096, 7168, torch.bfloat16, 128, gpu, float(weight_grad.PINGPONG_UNTIL))
    assert long == WeightGradTiles(128, 256, 64, 8, 3, True)
    other = weight_grad_tiles(4096, 7168, torch.float32, 128, gpu, 512.0)
    assert not other.warp_specialized and not other.pingpong
    monkeypatch.setattr(gluon_weight_grad, "device_problem", lambda device: "sm_80")
    assert not weight_grad_tiles(4096, 7168, torch.bfloat16, 128, gpu, 512.0).warp_specialized


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("widths", [(392, 328), (328, 392)], ids=["rows padded", "gradient rows padded"])
@pytest.mark.parametrize("tokens", [700, 6000], ids=["short reductions", "long reductions"])
@pytest.mark.parametrize("block", [16, 64, 128])
def test_the_gpu_launch_equals_a_float64_sum_in_bf16(block: int, tokens: int, widths: tuple[int, int],
                                                     with_bias: bool) -> None:
    # The default launches on the device (TMA on Hopper; the short reductions' tiles stored by TMA; without a bias
    # on sm_90 the Gluon ping-pong): bf16 operands, experts of uneven sizes, one idle, N and K past the last full
    # tile; the narrower operand padded to whole steps (the rows, or the gradient rows, whose compact other operand
    # the bias sum then masks or not).
    gen = torch.Generator().manual_seed(17)
    k, experts = 2, 6
    n, kdim = widths
    ids = _ids(tokens, k, experts, gen, idle=(4,))
    rows = torch.randn(tokens, kdim, generator=gen).to("cuda", torch.bfloat16)
    d_rows = torch.randn(tokens * k, n, generator=gen).to("cuda", torch.bfloat16)
    plan = align.align_block_size(ids.to("cuda"), experts, block)
    dw, db = expert_weight_grad(d_rows, rows, k, *plan, experts, block, with_bias, torch.bfloat16)
    want_w, want_b = _reference(d_rows, rows, ids, experts, k)
    torch.testing.assert_close(dw.cpu().double(), want_w, rtol=2e-2, atol=0.3)
    if with_bias:
        assert db is not None
        torch.testing.assert_close(db.cpu().double(), want_b, rtol=2e-2, atol=0.3)
    else:
        assert db is None
    assert not dw[4].any()
