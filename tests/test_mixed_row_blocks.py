"""The two expert GEMMs with different row blocks on one alignment (``MoEConfig``).

The rows are aligned once, by the larger ``block_m``; the GEMM of the smaller block reads its expert at
``block // ratio`` and skips its blocks of padding rows only. Checked against the torch reference: the
kernel on every grid and with a split K-loop, the float and the quantized pipelines (empty batch, one
token, idle experts, every token on one expert, top-k = number of experts), the backward, the tables'
capping, and the tuner's pairing. Under the interpreter on CPU; compiled on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, moe_gemm  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.reference import dense_moe  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402
from test_quant_triton_layer import METHODS, _reference, _triton_pipeline  # noqa: E402
from grids import grid  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out.float()).any(), "an output element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def test_one_block_must_divide_the_other_and_the_larger_aligns() -> None:
    small, large = GemmConfig(16, 32, 32), GemmConfig(64, 32, 32)
    assert MoEConfig(small, large).block_m == MoEConfig(large, small).block_m == 64
    with pytest.raises(ValueError, match="must divide"):
        MoEConfig(GemmConfig(32, 32, 32), GemmConfig(48, 32, 32))
    # a cap on the alignment block caps each GEMM's block, keeping a smaller one
    capped = ConfigTable(4, 2, (1,), (MoEConfig(GemmConfig(16, 32, 32), GemmConfig(128, 32, 32)),), max_block_m=64)
    assert capped.lookup(1) == MoEConfig(GemmConfig(16, 32, 32), GemmConfig(64, 32, 32))
    # and the tables' alignment follows the larger block: tables alike in it align alike
    other = ConfigTable(4, 2, (1,), (MoEConfig(GemmConfig(64, 32, 32), GemmConfig(32, 32, 32)),), max_block_m=64)
    assert capped.alignment() == other.alignment()


@pytest.mark.parametrize("grid,split_k", [("tiles", None), ("tiles", 2), ("persistent", 1), ("flattened", 1)])
@pytest.mark.parametrize("aligned,block_m", [(32, 16), (64, 16), (64, 32)])
def test_the_kernel_reads_rows_aligned_by_a_larger_block(grid: str, split_k: int, aligned: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(aligned + block_m)
    experts, tokens = 5, 40
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32)
    ids[:30, 0] = 1  # expert 1 gets more than one aligned block; expert 4 none; the others a few rows
    x = torch.randn(tokens, 64, generator=gen).to(DEVICE)
    weight = torch.randn(experts, 24, 64, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids.to(DEVICE), experts, aligned)
    out = torch.full((2 * tokens, 24), float("nan"), device=DEVICE)
    config = GemmConfig(block_m, 16, 32, group_m=2, num_warps=4, num_stages=2)
    moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=2, config=config, aligned_block_m=aligned, grid=grid,
                      split_k=split_k)
    want = torch.einsum("ck,cnk->cn", x.repeat_interleave(2, 0), weight[ids.reshape(-1).long().to(DEVICE)])
    assert _rel(out, want) < 1e-5


def test_an_alignment_block_that_the_tile_does_not_divide_or_the_plan_does_not_have_is_an_error() -> None:
    ids = torch.randint(0, 4, (9, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = torch.randn(9, 32, device=DEVICE)
    weight = torch.randn(4, 16, 32, device=DEVICE)
    out = torch.empty(18, 16, device=DEVICE)
    plan = align.align_block_size(ids, 4, 32)
    with pytest.raises(ValueError, match="must divide the alignment's block"):
        moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=2, config=GemmConfig(64, 16, 32), aligned_block_m=32)
    with pytest.raises(ValueError, match="pass the block the rows were aligned with"):
        moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=2, config=GemmConfig(16, 16, 32), aligned_block_m=64)


def _float_pipeline(table: ConfigTable, experts: int, k: int, dtype: torch.dtype, gen: torch.Generator
                    ) -> tuple[mf.Pipeline, dict[str, torch.Tensor]]:  # type: ignore[type-arg]
    hidden, inter = 48, 40
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    stages = [TritonTopK(experts, k), AlignDispatch(experts, table),
              FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
              FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()]
    return mf.Pipeline(stages, mf.input_spec(hidden, dtype, experts), debug=True), dict(w13=w13, w2=w2)


PAIRS = {"gate/up 16, down 32": (16, 32), "gate/up 64, down 16": (64, 16)}


@pytest.mark.parametrize(("dtype", "pair"), grid([torch.float32, torch.float16], sorted(PAIRS),
                                                ids=[["fp32", "fp16"], None]))
def test_a_float_pipeline_with_two_row_blocks_equals_the_reference(pair: str, dtype: torch.dtype) -> None:
    gate_up_m, down_m = PAIRS[pair]
    gen = torch.Generator().manual_seed(gate_up_m * down_m)
    for experts, k in ((6, 2), (4, 4)):  # top-k = number of experts
        table = ConfigTable(experts, k, (1,), (MoEConfig(GemmConfig(gate_up_m, 32, 32), GemmConfig(down_m, 16, 32)),))
        pipeline, weights = _float_pipeline(table, experts, k, dtype, gen)
        one_expert = torch.full((21, experts), -5.0)
        one_expert[:, 3] = 5.0
        for tokens, logits in ((0, None), (1, None), (21, None), (21, one_expert)):
            x = torch.randn(tokens, 48, generator=gen).to(DEVICE, dtype)
            logits = (torch.randn(tokens, experts, generator=gen) if logits is None else logits).to(DEVICE)
            out = pipeline(mf.MoEInput(x, logits)).hidden_states
            assert out.shape == (tokens, 48)
            if tokens:
                ref = dense_moe(x, logits, top_k=k, **weights)
                assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 4e-3), (experts, k, tokens)


def test_the_backward_through_two_row_blocks_equals_one_block() -> None:
    """The backward recomputes the forward's GEMM on the same alignment and sums each expert's weight
    gradient over the aligned blocks: two row blocks give the gradients of one."""
    gen = torch.Generator().manual_seed(9)
    experts, k = 4, 2
    mixed = ConfigTable(experts, k, (1,), (MoEConfig(GemmConfig(16, 32, 32), GemmConfig(32, 16, 32)),))
    same = ConfigTable(experts, k, (1,), (MoEConfig(GemmConfig(32, 32, 32), GemmConfig(32, 16, 32)),))
    pipeline, weights = _float_pipeline(mixed, experts, k, torch.float32, gen)
    twin = mf.Pipeline([attrs.evolve(stage, configs=same) if hasattr(stage, "configs") else stage
                        for stage in pipeline.stages], mf.input_spec(48, torch.float32, experts))
    x = torch.randn(11, 48, generator=gen).to(DEVICE)
    logits = torch.randn(11, experts, generator=gen).to(DEVICE)
    grads = []
    for run in (pipeline, twin):
        leaves = [x.clone().requires_grad_(), logits.clone().requires_grad_()]
        params = [s.weight for s in run.stages if isinstance(s, FusedGroupedGemm)]
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        run(mf.MoEInput(*leaves)).hidden_states.square().sum().backward()
        grads.append([leaf.grad.clone() for leaf in leaves] + [p.grad.clone() for p in params])
    for got, want in zip(*grads):
        assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["w4a16 g32 zeros", "mxfp4", "fp8 block/group"])
def test_a_quantized_pipeline_with_two_row_blocks_equals_the_torch_layer(name: str) -> None:
    """A table tuned for the format (its tiles taken as they are), gate/up and down on different blocks."""
    reference = _reference(METHODS[name], "auto")
    experts, k = reference.num_experts, reference.top_k
    for gate_up_m, down_m in ((16, 64), (32, 16)):
        entry = MoEConfig(GemmConfig(gate_up_m, 32, 64), GemmConfig(down_m, 64, 64))
        table = ConfigTable(experts, k, (1,), (entry,), weight_format=reference.quant.table_key)
        pipeline = _triton_pipeline(reference, table)
        x = torch.randn(7, reference.hidden_size, device=DEVICE, dtype=torch.float16)
        skewed = torch.full((7, experts), -5.0, device=DEVICE)
        skewed[:, 0], skewed[:, 1] = 5.0, 4.0
        with torch.no_grad():
            for tokens, logits in ((x, None), (x[:1], None), (x, skewed), (x[:0], None)):
                logits = reference.router_logits(tokens) if logits is None else logits
                got = pipeline(mf.MoEInput(tokens, logits)).hidden_states
                if tokens.shape[0]:
                    assert _rel(got, reference(tokens, logits)) < 1e-2, (gate_up_m, down_m)


def test_the_tuner_pairs_blocks_that_divide_and_times_the_smaller_on_the_larger_alignment() -> None:
    import tune_moe

    c = {m: GemmConfig(m, 64, 64) for m in (16, 24, 64)}
    best = {16: {"gate_up": (10.0, c[16]), "down": (50.0, c[16])},
            64: {"gate_up": (40.0, c[64]), "down": (20.0, c[64])},
            24: {"gate_up": (5.0, c[24])}}  # 24 divides no other block, nor another it, and has no down GEMM
    assert sorted(tune_moe.mixed_pairs(best)) == [(16, 64), (64, 16)]
    # gate/up on 16-row blocks again on the 64-row alignment: 12 us; with the 64-row down, 32 in all
    on_larger = {(16, 64): (12.0, c[16]), (64, 16): (45.0, c[16])}
    assert tune_moe.best_pair(best, on_larger) == ((12.0, c[16]), (20.0, c[64]))
    # where the re-timing is slow, a shared block wins (16 + 16: 60 us; 64 + 64: 60 us -> the first found)
    slow = {(16, 64): (45.0, c[16]), (64, 16): (45.0, c[16])}
    assert sum(t for t, _ in tune_moe.best_pair(best, slow)) == 60.0


def tuner_on_a_small_pipeline(monkeypatch: pytest.MonkeyPatch, experts: int, k: int, seed: int) -> tuple[Any, Any]:
    """``(tune_moe, layer)``: the tuner module with its random batches drawn from a seeded generator and its
    candidates two 16- and 32-row tiles, and a stand-in layer around a small float triton pipeline
    (:func:`_float_pipeline`, hidden size 48)."""
    import types

    import tune_moe

    gen = torch.Generator().manual_seed(seed)
    pipeline, _ = _float_pipeline(ConfigTable(experts, k), experts, k, torch.float16, gen)
    layer = types.SimpleNamespace(pipeline=pipeline, num_experts=experts, top_k=k, routing=mf.RoutingConfig(),
                                  quant=types.SimpleNamespace(table_key=None))
    monkeypatch.setattr(tune_moe, "random_batch", lambda tokens, h, e, seed=0: (
        torch.randn(tokens, h, generator=gen).to(DEVICE, torch.float16),
        torch.randn(tokens, e, generator=gen).to(DEVICE)))
    tiles = [GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(32, 32, 32, 1, 4, 2)]
    monkeypatch.setattr(tune_moe, "candidates", lambda fmt, rows: iter(tiles))
    return tune_moe, layer


def made_up_times(monkeypatch: pytest.MonkeyPatch, tune_moe: Any, key: Callable[[Any, str, GemmConfig], Any],
                  times: dict[Any, float]) -> list[Any]:
    """Time ``tune_moe``'s launches by ``times[key(rows, role, config)]`` of the launch being timed (it still runs,
    and its outputs must be finite); returns the list of the keys launched, in order."""
    launched: list[Any] = []
    real_retiled = tune_moe.retiled

    def retiled(x: Any, role: str, config: GemmConfig) -> Any:
        launched.append(key(x, role, config))
        return real_retiled(x, role, config)

    def time_graph(fn: Any, reps: int, flush: Any) -> float:
        outputs = fn()  # the GEMM runs, on the rows it was given
        assert all(torch.isfinite(out.x.data.float()).all() for out in outputs)
        return times[launched[-1]] * tune_moe.ROUTINGS

    monkeypatch.setattr(tune_moe, "retiled", retiled)
    monkeypatch.setattr(tune_moe, "time_graph", time_graph)
    return launched


def tuned_with_a_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tune_moe: Any,
                      layer: Any, flag: str, block_m: int) -> list[Any]:
    """``tune_moe.tune_cell(..., <flag>=True)`` (a ``GemmConfig`` flag its option times both ways) with made-up
    times — gate/up fastest on ``block_m`` rows with the flag, down on ``block_m`` rows without, 16 rows slower, and
    so the layer's own fallback tiles at this cell (32 rows), which the tuner times too, unless ``block_m`` is 32 — and
    the choice written and read back; returns the ``(role, block_m, flag)`` launches, in order."""
    experts, k = layer.num_experts, layer.top_k
    times = {(role, rows, False): 30.0 for role in ("gate_up", "down") for rows in (16, 32)}
    times.update({("gate_up", block_m, False): 20.0, ("gate_up", block_m, True): 15.0,
                  ("down", block_m, False): 10.0, ("down", block_m, True): 11.0})
    launched = made_up_times(monkeypatch, tune_moe, lambda x, role, c: (role, c.block_m, getattr(c, flag)), times)
    entry = tune_moe.tune_cell(layer, (experts, k, 48, 40), "bf16", 20, flush=None, reps=1, **{flag: True})
    assert "skip" not in capsys.readouterr().out
    assert entry["gate_up"][flag] is True and flag not in entry["down"]
    loaded = ConfigTable.from_json(experts, k, {"20": entry}).lookup(20)
    assert getattr(loaded.gate_up, flag) and not getattr(loaded.down, flag)
    return launched


def test_the_tuner_times_a_cell_and_keeps_a_pair_of_two_blocks(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_moe.tune_cell`` end to end on a small triton pipeline (the GEMMs run, under the interpreter on
    CPU), with made-up times: the gate/up GEMM fastest on 16-row blocks, the down GEMM on 32; the gate/up
    GEMM is timed again on rows aligned by 32, runs there, and the pair of two blocks is written."""
    experts, k, hidden = 4, 2, 48  # _float_pipeline's hidden size
    tune_moe, layer = tuner_on_a_small_pipeline(monkeypatch, experts, k, seed=3)
    times = {("gate_up", 16, 16): 10.0, ("gate_up", 16, 32): 12.0, ("gate_up", 32, 32): 30.0,
             ("down", 16, 16): 50.0, ("down", 32, 32): 20.0, ("down", 16, 32): 55.0}
    # (role, block_m, the alignment's block) of the launch being timed
    launched = made_up_times(monkeypatch, tune_moe, lambda x, role, c: (role, c.block_m, x.alignment.block_m), times)
    entry = tune_moe.tune_cell(layer, (experts, k, hidden, 40), "bf16", 20,  # type: ignore[arg-type]
                               flush=None, reps=1)
    assert "skip" not in capsys.readouterr().out  # every launch ran, the re-timed one on the larger alignment
    assert ("gate_up", 16, 32) in launched
    assert (entry["gate_up"]["block_m"], entry["down"]["block_m"], entry["us"]) == (16, 32, 32.0)
    loaded = ConfigTable.from_json(experts, k, {"20": entry})
    assert loaded.lookup(20).block_m == 32


def test_the_batch_invariant_table_keeps_a_pair_of_two_blocks() -> None:
    """A 64/128-row pair of the family stays a pair (the row block does not change the reduction order)."""
    from moeforge.batch_invariant import in_family, invariant_table

    tuned = ConfigTable(8, 2, (1,), (MoEConfig(GemmConfig(128, 128, 64, num_warps=8), GemmConfig(64, 128, 64)),))
    entry = invariant_table(8, 2, tuned=tuned).lookup(1)
    assert (entry.gate_up.block_m, entry.down.block_m, entry.block_m) == (128, 64, 128)
    assert in_family(entry.gate_up) and in_family(entry.down)
