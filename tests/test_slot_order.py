"""Rows in slot order (``moeforge/stages/slot_order.py``, ``moeforge/kernels/slot_rows.py``): the block-aligned
dispatch of a training step gathers the token rows into expert order, each expert's copies one run of one row per
copy, the GEMMs read and write them there, the weight gradients read them in place, the first GEMM
sums their gradient into the token rows and the combine reads each copy at its row.

On CPU through Triton's interpreter at tiny shapes; the gradients of the layouts against each other
(``tests/test_triton_backward.py`` runs its float64 checks in both layouts, and on a GPU a bf16 layer at a token count
the rule takes slot order at against the torch backend).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, combine, slot_rows, weight_grad  # noqa: E402
from moeforge.kernels.config import ConfigTable  # noqa: E402
from moeforge.payloads import Activations, MoEInput, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages import slot_order  # noqa: E402
from moeforge.stages.triton import AlignDispatch, kernel_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routed(tokens: int, experts: int, k: int, hidden: int, seed: int, ids: Any = None,
            dtype: torch.dtype = torch.float32) -> RoutedTokens:
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    return RoutedTokens(x=Activations(x.to(DEVICE, dtype)),
                        topk=TopKOutput(weights=weights.to(DEVICE), ids=ids.to(DEVICE, torch.int32)))


CASES = {  # tokens, experts, top_k, every token's experts (None: drawn)
    "spread": (13, 5, 2, None),
    "one token": (1, 4, 3, None),
    "every token on experts 0 and 1": (9, 4, 2, torch.tensor([[0, 1]] * 9)),
    "top_k = experts": (6, 3, 3, None),
    "an idle expert": (10, 6, 1, torch.tensor([[e % 5] for e in range(10)])),
}


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gather_puts_each_experts_copies_in_one_run(case: str, block_m: int) -> None:
    tokens, experts, k, ids = CASES[case]
    _check_gather(_routed(tokens, experts, k, 24, 1, ids), experts, k, block_m)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 90), experts=st.integers(1, 9), k=st.integers(1, 4),
       block_m=st.sampled_from([16, 32, 64, 128]), on_few=st.booleans(), seed=st.integers(0, 2**16))
def test_the_gather_keeps_its_layout_for_any_routing_and_block(tokens: int, experts: int, k: int, block_m: int,
                                                               on_few: bool, seed: int) -> None:
    k = min(k, experts)
    ids = torch.tensor([list(range(k))] * tokens) if on_few else None  # every token on the first k experts
    _check_gather(_routed(tokens, experts, k, 8, seed, ids), experts, k, block_m)


def _check_gather(routed: RoutedTokens, experts: int, k: int, block_m: int) -> None:
    """:func:`slot_rows.gather_slots` of ``routed`` aligned in blocks of ``block_m``: each expert's copies one run from
    ``runs[1, e]`` in slot order, one row per copy; each copy's row and weight; each slot's row (none for the
    alignment's padding slots)."""
    tokens, width = routed.x.data.shape
    kernel_ops()
    sorted_ids, block_expert, num_padded = align.align_block_size(routed.topk.ids, experts, block_m)
    flat_weights = routed.topk.weights.reshape(-1)
    xs, row_weights, slot_of, row_of_slot, runs = slot_rows.gather_slots(
        routed.x.data, flat_weights, sorted_ids, block_expert, num_padded, k, experts, block_m)
    copies = tokens * k
    assert xs.shape == (copies, width) and row_weights.shape == (copies,) and row_of_slot.shape == sorted_ids.shape
    counts = torch.bincount(routed.topk.ids.reshape(-1).long(), minlength=experts)
    assert torch.equal(runs[2, :experts].long(), counts)
    assert torch.equal(runs[1, :experts].long(), torch.cumsum(counts, 0) - counts)
    assert int(runs[1, experts]) == copies
    # each copy's row: its token's row and weight, inside its expert's run, the expert's copies in slot order
    expert_of = routed.topk.ids.reshape(-1).long()
    place = slot_of.long() - runs[1, expert_of].long()
    assert bool(((place >= 0) & (place < counts[expert_of])).all())
    assert sorted(slot_of.tolist()) == list(range(copies))
    assert torch.equal(xs[slot_of.long()], routed.x.data[torch.arange(copies, device=DEVICE) // k])
    assert torch.equal(row_weights[slot_of.long()], flat_weights)
    used = int(num_padded)
    holds = sorted_ids[:used].long() < copies
    assert torch.equal(row_of_slot[:used][holds].long(), slot_of[sorted_ids[:used][holds].long()].long())
    slot_expert = block_expert.long().repeat_interleave(block_m)[:sorted_ids.numel()]
    for e in range(experts):  # the expert's slots, in order, its rows in order; its padding slots none
        lo, count = int(runs[1, e]), int(counts[e])
        slots_of_e = (torch.arange(sorted_ids.numel(), device=DEVICE) < used) & (slot_expert == e)
        got = [int(r) for r in row_of_slot[slots_of_e] if int(r) < copies]
        assert got == list(range(lo, lo + count))
    assert bool((row_of_slot[~torch.isin(row_of_slot, slot_of)] == copies).all())
    assert bool((row_of_slot[used:] == copies).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 60), experts=st.integers(1, 8), k=st.integers(1, 4),
       block_m=st.sampled_from([16, 32, 64]), step=st.sampled_from([16, 32]), narrow_dy=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_weight_gradient_of_rows_in_slot_order_has_copy_orders_bits(tokens: int, experts: int, k: int,
                                                                         block_m: int, step: int, narrow_dy: bool,
                                                                         bias: bool, seed: int) -> None:
    # The Triton weight gradient on rows in slot order (one row per copy) gathers the narrower operand with each run
    # rounded up to its step and reads the other in place: each expert's rows summed in the same steps as copy
    # order's gathered operands, so the same bits, bias included.
    k, step = min(k, experts), min(step, block_m)
    n, width = (8, 24) if narrow_dy else (24, 8)
    routed = _routed(tokens, experts, k, width, seed)
    d_rows = torch.randn(tokens * k, n, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    kernel_ops()
    plan = align.align_block_size(routed.topk.ids, experts, block_m)
    xs, _, slot_of, row_of_slot, runs = slot_rows.gather_slots(routed.x.data, None, *plan, k, experts, block_m)
    d_xs = torch.empty_like(d_rows)
    d_xs[slot_of.long()] = d_rows
    tiles = weight_grad.WeightGradTiles(16, 16, step, 4, 2, False)
    got = weight_grad.expert_weight_grad(d_xs, xs, 1, row_of_slot, plan[1], plan[2], experts, block_m, bias,
                                         tiles=tiles, slot_copies=tokens * k, slot_runs=runs)
    want = weight_grad.expert_weight_grad(d_rows, routed.x.data, k, *plan, experts, block_m, bias, tiles=tiles)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None and want[1] is None) if not bias else torch.equal(got[1], want[1])


def test_an_empty_batch_gathers_nothing() -> None:
    kernel_ops()
    ids = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 4, 16)
    xs, slot_weights, slot_of, positions, _ = slot_rows.gather_slots(torch.zeros(0, 8, device=DEVICE), None,
                                                                     sorted_ids, block_expert, num_padded, 2, 4, 16)
    assert xs.shape[1] == 8 and slot_weights.numel() == 0 and slot_of.numel() == 0
    assert positions.numel() == sorted_ids.numel() and xs.shape[0] == 0


def test_the_gather_refuses_weights_it_cannot_carry() -> None:
    kernel_ops()
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 4, 16)
    with pytest.raises(ValueError, match="fp32"):
        slot_rows.gather_slots(torch.zeros(3, 8, device=DEVICE), torch.zeros(6, dtype=torch.float16, device=DEVICE),
                               sorted_ids, block_expert, num_padded, 2, 4, 16)


def test_the_combine_by_index_and_its_backward() -> None:
    # rows read by no copy get a zero gradient; an absent copy (-1) adds nothing and its weight's gradient is zero
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 16, generator=gen).to(DEVICE).requires_grad_()
    weights = torch.rand(3, 2, generator=gen).to(DEVICE).requires_grad_()
    index = torch.tensor([[4, 0], [7, -1], [2, 8]], dtype=torch.int32, device=DEVICE)
    kernel_ops()
    out = combine.COMBINE(rows, weights, 2, 1.5, torch.float32, index)
    present = (index >= 0).float()
    want = 1.5 * (rows[index.clamp(min=0).long()] * (weights * present)[..., None]).sum(1)
    torch.testing.assert_close(out, want)
    grad = torch.randn(3, 16, generator=gen).to(DEVICE)
    got = torch.autograd.grad(out, [rows, weights], grad)
    expected = torch.autograd.grad(want, [rows, weights], grad)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert not got[0][[1, 3, 5, 6]].any() and float(got[1][1, 1]) == 0.0


def test_the_rule_takes_slot_order_wherever_there_are_copies() -> None:
    assert slot_order.slot_rows_pay(1) and slot_order.slot_rows_pay(16384 * 8)
    assert not slot_order.slot_rows_pay(0)


def test_the_dispatch_takes_slot_order_only_where_a_training_step_can_use_it() -> None:
    table = ConfigTable(2, 2)
    routed = _routed(1024, 2, 2, 8, 5)
    kernel_ops()
    trained = AlignDispatch(2, table)(routed)
    assert trained.alignment.slot_copies == 2048 and trained.x.data.shape[0] == 2048
    with torch.no_grad():  # inference moves no rows
        served = AlignDispatch(2, table)(routed)
    assert served.alignment.slot_copies == 0 and served.x.data is routed.x.data
    assert AlignDispatch(2, table, slot_rows=False)(routed).alignment.slot_copies == 0
    assert "slot order where a training step pays" in AlignDispatch(2, table).summary()
    assert "slot order" not in AlignDispatch(2, table, slot_rows=False).summary()
    small = _routed(5, 2, 2, 8, 6)  # 10 copies: one row each in slot order too
    assert AlignDispatch(2, table)(small).alignment.slot_copies == 10
    assert AlignDispatch(2, table, slot_rows=False)(small).alignment.slot_copies == 0
    scaled = RoutedTokens(x=Activations(routed.x.data, torch.ones(1024, 1, device=DEVICE)), topk=routed.topk)
    assert slot_order.slot_rows_apply(scaled) is not None
    assert AlignDispatch(2, table, slot_rows=True)(scaled).alignment.slot_copies == 0


def _grads(run: Any, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    out = run()
    return [out.detach(), *torch.autograd.grad(out, inputs, grad)]


def _counting(run: Any) -> tuple[Any, int, int]:
    """``run()`` with the weight gradient's gathers into expert order and its computations of the experts' runs
    counted."""
    gathers: list[int] = []
    runs: list[int] = []
    gather, expert_runs = weight_grad.gather_expert_rows, weight_grad.expert_runs
    try:
        weight_grad.gather_expert_rows = lambda *a, **k: gathers.append(1) or gather(*a, **k)  # type: ignore
        weight_grad.expert_runs = lambda *a, **k: runs.append(1) or expert_runs(*a, **k)  # type: ignore
        return run(), len(gathers), len(runs)
    finally:
        weight_grad.gather_expert_rows, weight_grad.expert_runs = gather, expert_runs  # type: ignore


# (the table's block; tokens): the CPU default's 16-row blocks; 64-row blocks at about ten copies an expert; 128-row
# blocks at about 40 — each expert's run ends inside its last block, and inside the weight gradient's last step
BLOCKS = {"16-row blocks": (None, 21), "64-row blocks": (64, 21), "128-row blocks": (128, 80)}


@pytest.mark.parametrize("blocks", sorted(BLOCKS))
@pytest.mark.parametrize("act", ["swiglu", "gpt-oss"])
def test_the_stages_train_the_same_in_both_layouts_and_the_same_bits_twice(act: str, blocks: str) -> None:
    # gpt-oss: the clamped SwiGLU on interleaved rows; both with expert biases
    from test_triton_backward import ACTIVATIONS, _pipeline, _tensors

    block_m, tokens = BLOCKS[blocks]
    gen = torch.Generator().manual_seed(7)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    x = torch.randn(tokens, 32, generator=gen).to(DEVICE).requires_grad_()
    logits = torch.randn(tokens, 4, generator=gen).to(DEVICE).requires_grad_()
    grad = torch.randn(tokens, 32, generator=gen).to(DEVICE)
    inputs = [x, logits, *t.values()]

    def run(slot_rows: bool) -> list[torch.Tensor]:
        pipeline = _pipeline(4, 2, 32, t, ACTIVATIONS[act], mf.RoutingConfig(), torch.float32, slot_rows, block_m)
        return _grads(lambda: pipeline(MoEInput(x, logits)).hidden_states, inputs, grad)

    copy_order, gathered, copy_runs = _counting(lambda: run(False))
    first, in_place, slot_runs = _counting(lambda: run(True))
    # the Triton weight gradient (fp32 rows: the Gluon one takes 16-bit ones, both in place) sums whole steps: in copy
    # order both operands of each weight gradient gathered, in slot order the narrower one, its runs rounded up
    assert gathered == 4 and in_place == 2
    assert copy_runs == 2 and slot_runs == 3  # each weight gradient's; the dispatch's, and each one's rounded up
    for name, a, b in zip(["out", "x", "logits", *t], first, copy_order):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(first, run(True)))


def test_an_adapted_layer_keeps_its_rows_in_copy_order() -> None:
    # An adapter's shared A multiplies every dispatched row with a torch GEMM: rows in slot order are not written past
    # the used slots, and that GEMM's weight gradient would sum them.
    from moeforge.adapters import ExpertAdapter, adapt
    from moeforge.stages.triton import FusedGroupedGemm

    table = ConfigTable(4, 2)
    gen = torch.Generator().manual_seed(9)
    holder = torch.nn.Module()
    w13 = torch.nn.Parameter(torch.randn(4, 96, 32, generator=gen).to(DEVICE))
    w2 = torch.nn.Parameter(torch.randn(4, 32, 48, generator=gen).to(DEVICE))
    holder.w13_lora_a = torch.nn.Parameter(torch.randn(1, 4, 32, generator=gen).to(DEVICE))
    holder.w13_lora_b = torch.nn.Parameter(torch.zeros(4, 96, 4, device=DEVICE))
    stages = [AlignDispatch(4, table, slot_rows=True),
              FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
              FusedGroupedGemm(mf.GemmRole.DOWN, w2, table)]
    adapted = adapt(stages, holder, ExpertAdapter(rank=4, targets=("gate_up",), shared_a=True))
    assert isinstance(adapted[0], AlignDispatch) and adapted[0].slot_rows is False


def test_the_weight_gradient_of_slot_rows_needs_their_runs() -> None:
    kernel_ops()
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 2, 16)
    rows = torch.zeros(sorted_ids.numel(), 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_runs"):
        weight_grad.expert_weight_grad(rows, rows, 1, sorted_ids, block_expert, num_padded, 2, 16, False,
                                       slot_copies=4)
    with pytest.raises(ValueError, match="rows_per_a"):
        weight_grad.expert_weight_grad(rows, rows, 2, sorted_ids, block_expert, num_padded, 2, 16, False,
                                       slot_copies=4, slot_runs=torch.zeros(4, 3, dtype=torch.int32, device=DEVICE))


class _EveryRowStage(mf.Stage[Any, Any]):
    """A user's stage between the GEMMs that reads every row (here: centres the rows by their mean over all of them),
    declaring nothing about slot order."""

    kinds = (mf.StageKind.ACTIVATION,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: Any) -> Any:
        half = x.x.data.shape[1] // 2
        rows = x.x.data[:, :half] * x.x.data[:, half:]
        return x.with_x(Activations(rows - rows.mean(dim=0)))


def _stages(dispatch: AlignDispatch, middle: Any, table: ConfigTable) -> list[Any]:
    from moeforge.stages import Combine, FusedGroupedGemm, TritonTopK

    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(4, 16, 8, generator=gen).to(DEVICE)
    w2 = torch.randn(4, 8, 8, generator=gen).to(DEVICE)
    return [TritonTopK(4, 2, mf.RoutingConfig()), dispatch, FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table),
            middle, FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine(apply_routing_weights=True)]


def test_a_stage_that_reads_every_row_refuses_a_dispatch_that_may_give_slot_order() -> None:
    # Row r of rows in slot order is not copy r: a stage reducing over all rows sums them in another order (one pairing
    # rows with tokens would pair them wrongly). The pipeline refuses it when built, naming the field and the way
    # out, and builds with the dispatch in copy order.
    table = ConfigTable(4, 2)
    spec = mf.input_spec(8, torch.float32, 4)
    for may_give_slots in (None, True):
        with pytest.raises(mf.ContractError, match="slot_rows=False") as error:
            mf.Pipeline(_stages(AlignDispatch(4, table, may_give_slots), _EveryRowStage(), table), spec)
        assert error.value.field == "slot_order"
    pipeline = mf.Pipeline(_stages(AlignDispatch(4, table, slot_rows=False), _EveryRowStage(), table), spec)
    assert "slots" not in pipeline.describe()
    # moeforge's own stages between the dispatch and the combine read the used rows alone (the torch activation row
    # by row): they take slot order, and describe() shows where it may come
    activated = mf.Pipeline(_stages(AlignDispatch(4, table), mf.stages.Activate(mf.ActivationConfig()), table), spec)
    assert "slots" in activated.describe()


def test_an_adapted_gemm_refuses_rows_in_slot_order() -> None:
    from moeforge.adapters import ExpertAdapter, adapt

    table = ConfigTable(4, 2)
    holder = torch.nn.Module()
    holder.w13_lora_a = torch.nn.Parameter(torch.randn(1, 4, 8).to(DEVICE))
    holder.w13_lora_b = torch.nn.Parameter(torch.zeros(4, 16, 4, device=DEVICE))
    stages = _stages(AlignDispatch(4, table, slot_rows=True), mf.stages.Activate(mf.ActivationConfig()), table)
    adapted = adapt(stages, holder, ExpertAdapter(rank=4, targets=("gate_up",), shared_a=True))
    spec = mf.input_spec(8, torch.float32, 4)
    mf.Pipeline(adapted, spec)  # adapt() builds the dispatch in copy order
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([stages[1] if isinstance(stage, AlignDispatch) else stage for stage in adapted], spec)
    assert error.value.field == "slot_order"


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_anomaly_detection_trains_a_step_in_slot_order() -> None:
    # Anomaly detection checks every row of every gradient for NaN: rows in slot order are one per copy, each written
    # (the rows once rounded up to whole steps held unwritten ones past the last run, and anomaly detection then
    # kept copy order)
    table = ConfigTable(4, 2)
    spec = mf.input_spec(8, torch.float32, 4)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(37, 8, generator=gen).to(DEVICE).requires_grad_()
    logits = torch.randn(37, 4, generator=gen).to(DEVICE)
    grad = torch.randn(37, 8, generator=gen).to(DEVICE)
    kernel_ops()
    grads = []
    for slot_rows in (True, False):
        pipeline = mf.Pipeline(_stages(AlignDispatch(4, table, slot_rows), mf.stages.Activate(mf.ActivationConfig()),
                                       table), spec)
        with torch.autograd.detect_anomaly():
            grads.append(torch.autograd.grad(pipeline(MoEInput(x, logits)).hidden_states, x, grad)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


class _ScaledRows(mf.Stage[Any, Any]):
    """A user's stage between the dispatch and the first GEMM that doubles every row, row by row (it takes rows in
    slot order)."""

    kinds = (mf.StageKind.QUANTIZE,)

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.DISPATCHED, slot_order=frozenset({False, True}))

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec

    def __call__(self, x: Any) -> Any:
        return x.with_x(Activations(x.x.data * 2.0))


@pytest.mark.parametrize("middle", ["none", "a stage doubling the rows", "weights on the input"])
def test_the_first_gemm_sums_the_slot_rows_gradient_into_the_tokens_itself(middle: str) -> None:
    # Rows straight from the dispatch's gather: the first GEMM's backward sums their gradient into the token rows' by
    # the gather's index, before its weight gradient, and the gather's backward gets none (so the rows' gradient is not
    # held through the weight gradient). Rows a stage replaced, or scaled by the routing weights, take the gather's
    # backward as before. The gradients are the same as in copy order either way.
    from moeforge.stages import Combine, FusedGroupedGemm, TritonTopK
    from test_triton_backward import _table

    table = _table(4, 2, 64)
    gen = torch.Generator().manual_seed(11)
    w13 = torch.nn.Parameter(torch.randn(4, 32, 16, generator=gen).to(DEVICE) * 0.25)
    w2 = torch.nn.Parameter(torch.randn(4, 16, 16, generator=gen).to(DEVICE) * 0.25)
    on_input = middle == "weights on the input"
    routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT) if on_input else mf.RoutingConfig()
    x = torch.randn(37, 16, generator=gen).to(DEVICE).requires_grad_()
    logits = torch.randn(37, 4, generator=gen).to(DEVICE).requires_grad_()
    grad = torch.randn(37, 16, generator=gen).to(DEVICE)

    def run(slot: bool) -> tuple[list[torch.Tensor], int]:
        stages = [TritonTopK(4, 2, routing), AlignDispatch(4, table, slot, apply_routing_weights=on_input),
                  *([_ScaledRows()] if middle == "a stage doubling the rows" else []),
                  FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                  FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine(apply_routing_weights=not on_input)]
        pipeline = mf.Pipeline(stages, mf.input_spec(16, torch.float32, 4))
        calls: list[int] = []
        original = slot_rows.gather_slots_backward
        try:
            slot_rows.gather_slots_backward = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore
            grads = _grads(lambda: pipeline(MoEInput(x, logits)).hidden_states, [x, logits, w13, w2], grad)
        finally:
            slot_rows.gather_slots_backward = original  # type: ignore
        return grads, len(calls)

    (copy_order, _), (slot, gather_backwards) = run(False), run(True)
    assert gather_backwards == (0 if middle == "none" else 1)
    for name, a, b in zip(["out", "x", "logits", "w13", "w2"], slot, copy_order):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=name)
