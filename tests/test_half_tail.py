"""Half-height tiles for the experts' last blocks (``GemmConfig.half_tail``, ``moe_gemm(..., half_tail=True)``).

A row block whose second half is only padding (an expert's last block, at most ``block_m / 2`` rows) runs as a
``block_m / 2``-row tile. Its rows are computed by the same MMA instructions when both tiles use the same kind
(``mma.sync`` for 32 and 16 rows, Hopper's wgmma for 128 and 64), so on the GPU the outputs are then bitwise those
of the full blocks; a 64-row block's 32-row half moves from wgmma to ``mma.sync`` and rounds its sums differently
(compared closely). Under Triton's interpreter on CPU (numpy products of other shapes) they are compared closely.
Every format and epilogue, the swapped 4-bit product, split K-loops, rows aligned by a larger block, FP8 output
quantized per 128-group, the tables' wgmma tiles on a Hopper GPU, the tuner, the backward, and a whole layer from a
table whose entries ask for it; both persistent grids when asked for (on a Hopper GPU with NVFP4 rows too). The routing
gives experts a last block above half (full tile), at most half (half tile: 8, 16 and 1 rows) and no rows. Outputs are
poisoned with NaN: every element is proven written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import family_member, in_family  # noqa: E402
from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.kernels.grouped_gemm_call import decode_config, encode_config  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import (  # noqa: E402
    ACTIVATIONS,
    quantize_activations,
    quantize_weight_w8,
    reference_gemm,
    rel,
)
from test_weight_tma import CUDA, DEVICE, DTYPE, FORMATS, HOPPER, operands  # noqa: E402

# rows per expert: 40 (a full block of 32, then 8: a half tile), 20 (one block above half: a full tile),
# 16 (exactly half: a half tile), none, 1 (a half tile)
COUNTS = (40, 20, 16, 0, 1)


def _ids(counts: tuple[int, ...] = COUNTS, seed: int = 0) -> torch.Tensor:
    """``[tokens, 1]`` expert ids with ``counts[e]`` rows on expert ``e``, in a shuffled order."""
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))][:, None]


def _same(full: torch.Tensor, half: torch.Tensor, bitwise: bool = CUDA) -> None:
    assert not torch.isnan(full.float()).any() and not torch.isnan(half.float()).any()
    if bitwise:
        assert torch.equal(full, half)
    elif CUDA:  # wgmma (full) and mma.sync (half) sum in other orders: bf16 outputs a rounding apart
        assert rel(half, full) < 1e-2
    else:  # numpy's products of 16 and 32 rows may sum in other orders (fp32)
        assert rel(half, full) < 1e-4


def _run(fmt: str, *, glu: bool, config: GemmConfig, hidden: int = 64, n_out: int = 40, aligned: int | None = None,
         seed: int = 0, counts: tuple[int, ...] = COUNTS, **options: Any
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output with full tiles, with half tails, float64 reference of the float operands)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = _ids(counts, seed=seed).to(DEVICE)
    tokens, experts = ids.shape[0], len(counts)
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, 2 * n_out if glu else n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    plan = align.align_block_size(ids, experts, aligned or config.block_m)
    act = ACTIVATIONS["swiglu"] if glu else None
    args = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    outs = []
    for half_tail in (False, True):
        out = torch.full((tokens, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, act=act_code(act) if act else 0,
                          glu=glu, half_tail=half_tail, aligned_block_m=aligned, **options, **args)
        outs.append(out)
    return outs[0], outs[1], reference_gemm(rows, 1, ids, w, None, act)


@pytest.mark.parametrize("glu", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_half_tiles_compute_the_rows_of_full_blocks(fmt: str, glu: bool) -> None:
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    full, half, ref = _run(fmt, glu=glu, config=config, hidden=64 if fmt != "fp8-block" else 256)
    _same(full, half)
    assert rel(half, ref) < 0.5  # loose: 4-bit quantization errors reach 0.2; a wrong expert or row is near 1


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma tiles)")
@pytest.mark.parametrize("swap", [False, True], ids=["rows@W", "W@rows"])
@pytest.mark.parametrize("fmt", ["float", "fp8-block", "int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("block", [(128, 128, 64, 8), (64, 64, 64, 4)], ids=["128-rows", "64-rows"])
def test_half_tiles_on_hopper_tiles(block: tuple[int, int, int, int], fmt: str, swap: bool) -> None:
    """The tables' wgmma tiles at a real width: 128-row blocks' 64-row halves bitwise (wgmma both), 64-row blocks'
    32-row halves close (mma.sync). Rows per expert 300 (two blocks and a half tail), 200 (a full last block), 64,
    none, 1."""
    if swap and fmt in ("float", "fp8-block"):
        pytest.skip("the swapped product is for 4-bit weights")
    block_m, block_n, block_k, warps = block
    config = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=3, swap=swap)
    full, half, ref = _run(fmt, glu=True, config=config, hidden=1024, n_out=704, seed=3, counts=(300, 200, 64, 0, 1))
    _same(full, half, bitwise=block_m == 128)
    assert rel(half, ref) < 0.5


@pytest.mark.skipif(not HOPPER, reason="the wgmma tiles take the decoded NVFP4 rows from registers on Hopper")
@pytest.mark.parametrize("grid", ["persistent", "flattened"])
@pytest.mark.parametrize("tile", [(64, 128, 64, 4, True), (128, 256, 64, 8, False)], ids=["gate_up-64", "down-128"])
def test_nvfp4_rows_with_half_tiles_on_the_persistent_grids(tile: tuple[int, int, int, int, bool], grid: str) -> None:
    """NVFP4 rows against bf16 weights (the GEMMs of decoding the weights first) with half tiles on a persistent grid,
    three runs, each element against the same GEMM on the decoded rows (bf16, exact: a power-of-two global scale) on
    one program per tile. Before each K-step waited for its MMAs on Triton before 3.9 (``launch_plan.drain_mma``), the
    next step's decoding could overwrite registers those MMAs still read: this schedule wrote a few rows of about
    4e38 or NaN."""
    from moeforge.quant.fp4 import dequantize_nvfp4, quantize_nvfp4

    block_m, block_n, block_k, warps, glu = tile
    config = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=3, half_tail=True)
    gen = torch.Generator().manual_seed(11)
    counts = (300, 200, 40, 0, 1, 160, 97, 33)  # last blocks above and below half of both tile heights
    ids = _ids(counts, seed=11).to(DEVICE)
    hidden, n_out = 2048, 1024
    n_w = 2 * n_out if glu else n_out
    x = torch.randn(ids.shape[0], hidden, generator=gen).to(DEVICE)
    weight = (torch.randn(len(counts), n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, DTYPE)
    a_global = 2.0 ** -9  # a power of two: the decoded rows times it are exact in bf16
    q = quantize_nvfp4(x, a_global)
    decoded = dequantize_nvfp4(q.data, q.scale, a_global, DTYPE)
    plan = align.align_block_size(ids, len(counts), block_m)
    act = act_code(ACTIVATIONS["swiglu"]) if glu else 0
    want = torch.full((ids.shape[0], n_out), float("nan"), device=DEVICE, dtype=DTYPE)
    moe_gemm.moe_gemm(decoded, weight, want, *plan, rows_per_a=1, config=config, glu=glu, act=act, grid="tiles",
                      half_tail=False)
    for _ in range(3):
        out = torch.full_like(want, float("nan"))
        moe_gemm.moe_gemm(q.data, weight, out, *plan, rows_per_a=1, config=config, glu=glu, act=act, grid=grid,
                          a_scale=q.scale, a_global=a_global)
        assert torch.isfinite(out.float()).all()
        diff = (out.float() - want.float()).abs()
        bound = 0.02 * want.float().abs() + 0.02 * want.float().pow(2).mean().sqrt()
        assert int((diff > bound).sum()) == 0, f"{int((diff > bound).sum())} elements off by up to {float(diff.max())}"


@pytest.mark.parametrize("fmt", ["int4-zeros", "mxfp4", "nvfp4"])
def test_half_tiles_with_the_swapped_4bit_product(fmt: str) -> None:
    config = GemmConfig(32, 32, 32, group_m=1, num_warps=4, num_stages=2, swap=True)
    full, half, ref = _run(fmt, glu=True, config=config)
    _same(full, half)
    assert rel(half, ref) < 0.5


@pytest.mark.parametrize("schedule", ["split_k", "aligned by 64", "tma"])
def test_half_tiles_with_the_other_schedules(schedule: str) -> None:
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    options: dict[str, Any] = {"split_k": dict(split_k=2), "aligned by 64": dict(aligned=64),
                               "tma": dict(tma=True)}[schedule]
    for fmt in ("float", "mxfp4"):
        full, half, ref = _run(fmt, glu=True, config=config, **options)
        _same(full, half)
        assert rel(half, ref) < 0.5


def test_half_tiles_with_fp8_output_quantized_in_the_epilogue() -> None:
    gen = torch.Generator().manual_seed(3)
    ids = _ids(seed=3).to(DEVICE)
    tokens, experts, hidden, n_out = ids.shape[0], len(COUNTS), 256, 128
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, 2 * n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    x = quantize_activations(rows, torch.float8_e4m3fn, "group")
    q, scale, _ = quantize_weight_w8(w, torch.float8_e4m3fn, True)
    plan = align.align_block_size(ids, experts, 32)
    config = GemmConfig(32, 128, 64, group_m=1, num_warps=4, num_stages=2)
    outs = []
    for half_tail in (False, True):
        out = torch.empty(tokens, n_out, dtype=torch.float8_e4m3fn, device=DEVICE)
        out_scale = torch.full((tokens, 1), float("nan"), device=DEVICE)
        moe_gemm.moe_gemm(x.data, q, out, *plan, rows_per_a=1, config=config, a_scale=x.scale, weight_scale=scale,
                          weight_format=WeightFormat.FP8, act=act_code(mf.ActivationConfig()), glu=True,
                          out_scale=out_scale, half_tail=half_tail)
        outs.append(out.float() * out_scale)
    _same(outs[0], outs[1])


def test_the_configuration_carries_half_tail_and_refuses_small_blocks() -> None:
    config = GemmConfig(64, 128, 64, half_tail=True)
    assert decode_config(encode_config(config)) == config
    with pytest.raises(ValueError, match="half_tail needs block_m >= 32"):
        GemmConfig(16, 32, 64, half_tail=True)
    # a block lowered below 32 (a table's cap, a decode level) drops it; 32 keeps it
    assert not config.with_block_m(16).half_tail and config.with_block_m(32).half_tail
    capped = ConfigTable(4, 2, (1,), (MoEConfig(config, config),), max_block_m=16)
    assert capped.lookup(1) == MoEConfig(GemmConfig(16, 128, 64), GemmConfig(16, 128, 64))
    # the batch-invariant family has no half tiles (not probed for invariance)
    assert not in_family(attrs.evolve(config, block_k=64, split_k=1))
    assert not family_member(config, 2, 2).half_tail


def test_half_tail_errors_and_the_grids() -> None:
    ids = _ids().to(DEVICE)
    tokens, experts = ids.shape[0], len(COUNTS)
    x = torch.randn(tokens, 64, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(experts, 48, 64, device=DEVICE, dtype=DTYPE) / 8
    plan = align.align_block_size(ids, experts, 32)
    out = torch.full((tokens, 48), float("nan"), device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="half_tail needs block_m >= 32"):
        small = align.align_block_size(ids, experts, 16)
        moe_gemm.moe_gemm(x, weight, out, *small, rows_per_a=1, config=GemmConfig(16, 16, 32), half_tail=True)
    config = GemmConfig(32, 16, 32, num_warps=4, num_stages=2, half_tail=True)
    full = torch.full_like(out, float("nan"))
    moe_gemm.moe_gemm(x, weight, full, *plan, rows_per_a=1, config=config, half_tail=False)
    for grid in ("persistent", "flattened"):  # asked for, the persistent grids take half tiles too
        half = torch.full_like(out, float("nan"))
        moe_gemm.moe_gemm(x, weight, half, *plan, rows_per_a=1, config=config, grid=grid)
        _same(full, half)
    # a default grid that would be flattened (or persistent) runs one program per tile instead
    grids: list[int] = []
    real = moe_gemm.moe_gemm_kernel

    class Spy:
        def __getitem__(self, launch: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                grids.append(kwargs["PERSISTENT"])
                return real[launch](*args, **kwargs)
            return run

    with mock.patch.object(moe_gemm, "default_grid", return_value="flattened"), \
            mock.patch.object(moe_gemm, "moe_gemm_kernel", Spy()):
        moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=1, config=config)
    assert grids == [launch_plan.GRIDS.index("tiles")]
    want = torch.einsum("ck,cnk->cn", x.double(), weight.double()[ids[:, 0].long()])
    assert rel(out, want) < 1e-2
    # the call's choice wins over the configuration's
    again = torch.full_like(out, float("nan"))
    moe_gemm.moe_gemm(x, weight, again, *plan, rows_per_a=1, config=config, half_tail=False)
    _same(again, out)


def test_a_layer_whose_table_asks_for_half_tiles_equals_the_reference() -> None:
    """The float pipeline with a table whose entries ask for half tiles: empty batch, one token, an idle
    expert, every token on one expert, top-k = number of experts; against the dense torch reference."""
    from moeforge.reference import dense_moe
    from moeforge.stages.combine import Combine
    from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK

    gen = torch.Generator().manual_seed(5)
    hidden, inter = 48, 40
    dtype = torch.float16 if not CUDA else torch.bfloat16
    for experts, k in ((6, 2), (4, 4)):
        gemm = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2, half_tail=True)
        table = ConfigTable(experts, k, (1,), (MoEConfig(gemm, attrs.evolve(gemm, block_n=16)),))
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
        stages = [TritonTopK(experts, k), AlignDispatch(experts, table),
                  FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                  FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()]
        pipeline = mf.Pipeline(stages, mf.input_spec(hidden, dtype, experts), debug=True)
        one_expert = torch.full((37, experts), -5.0)
        one_expert[:, 3] = 5.0
        for tokens, logits in ((0, None), (1, None), (37, None), (37, one_expert)):
            x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
            logits = (torch.randn(tokens, experts, generator=gen) if logits is None else logits).to(DEVICE)
            out = pipeline(mf.MoEInput(x, logits)).hidden_states
            assert out.shape == (tokens, hidden)
            if tokens:
                assert not torch.isnan(out.float()).any()
                assert rel(out, dense_moe(x, logits, top_k=k, w13=w13, w2=w2)) < 1e-2, (experts, k, tokens)


def test_the_tuner_times_half_tiles_and_writes_the_choice(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_moe.tune_cell(..., half_tail=True)`` on a small triton pipeline (the GEMMs run, under the
    interpreter on CPU) with made-up times: each candidate of at least 32 rows is timed with and without half
    tiles, the 16-row one only without; the faster choice is written and read back."""
    from test_mixed_row_blocks import tuned_with_a_flag, tuner_on_a_small_pipeline  # (puts benchmarks/ on the path)

    tune_moe, layer = tuner_on_a_small_pipeline(monkeypatch, 4, 2, seed=4)
    # gate/up: 32 rows with half tiles fastest; down: 32 rows without
    launched = tuned_with_a_flag(monkeypatch, capsys, tune_moe, layer, "half_tail", 32)
    assert ("gate_up", 16, True) not in launched and ("down", 32, True) in launched


def test_the_backward_through_half_tiles_equals_full_blocks() -> None:
    """Training through a table that asks for half tiles: the backward recomputes the forward's GEMMs with the
    same configuration, so every gradient (rows, router logits, both weights) equals the full blocks' one."""
    from test_mixed_row_blocks import _float_pipeline

    gen = torch.Generator().manual_seed(11)
    experts, k = 4, 2
    full = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    tables = [ConfigTable(experts, k, (1,), (MoEConfig(c, attrs.evolve(c, block_n=16)),))
              for c in (full, attrs.evolve(full, half_tail=True))]
    pipeline, _ = _float_pipeline(tables[0], experts, k, torch.float32, gen)
    twin = mf.Pipeline([attrs.evolve(stage, configs=tables[1]) if hasattr(stage, "configs") else stage
                        for stage in pipeline.stages], mf.input_spec(48, torch.float32, experts))
    x = torch.randn(27, 48, generator=gen).to(DEVICE)  # about 14 rows per expert: most blocks at most half full
    logits = torch.randn(27, experts, generator=gen).to(DEVICE)
    grads = []
    for run in (pipeline, twin):
        leaves = [x.clone().requires_grad_(), logits.clone().requires_grad_()]
        params = [s.weight for s in run.stages if hasattr(s, "weight")]
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        run(mf.MoEInput(*leaves)).hidden_states.square().sum().backward()
        grads.append([leaf.grad.clone() for leaf in leaves] + [p.grad.clone() for p in params])
    assert len(grads[0]) == 4
    for got, want in zip(*grads):
        assert not torch.isnan(got).any()
        assert rel(got, want) < 1e-5
