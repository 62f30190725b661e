"""Packed 4-bit weights in the pre-shuffled layout (:mod:`moeforge.kernels.shuffle`,
``moe_gemm(weight_shuffled=True)``).

The layout is a permutation of the bytes inside blocks of 16 rows by 16 bytes (for e2m1 codes, MXFP4 and NVFP4, also
of the bits inside each 32-bit word, placed where the decoding reads them); the kernel reads the stored tile and
undoes it with a reshape and a transpose (e2m1: with its decoding of each word). So the GEMM on a shuffled weight computes with the same values in the same
K order as on the plain one: bitwise equal under the interpreter (CPU), and on a GPU equal to the plain weight's
output too where both compile the same MMA operand order (the test allows the last bits to differ there: the
register layouts of the two compilations may split K differently). Every 4-bit format (INT4 with and without zero
points, MXFP4, NVFP4 with float and NVFP4 rows), down and fused gate/up, both operand orders, TMA copies, a split
K-loop, the persistent grids, decoding first; routings with an idle expert, one row, an empty batch. Outputs are
poisoned with NaN: every element is proven written. The layout itself: the formula in the module's docstring, the
round trip, the errors.
"""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeforge.kernels import align, decode_first, moe_gemm, shuffle  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import ACTIVATIONS, reference_gemm, rel  # noqa: E402
from test_weight_tma import CUDA, DEVICE, DTYPE, HOPPER, operands  # noqa: E402
from grids import grid  # noqa: E402

FOUR_BIT = ["int4", "int4-zeros", "mxfp4", "nvfp4", "nvfp4-rows"]


# -- the layout -------------------------------------------------------------------------------------


def test_the_stored_bytes_follow_the_documented_formula() -> None:
    logical = torch.randint(0, 256, (2, 32, 48), dtype=torch.uint8)
    stored = shuffle.shuffle(logical, e2m1=False)
    for a in range(2):
        for g in range(8):
            for th in range(2):
                for c in range(3):
                    for tl in range(2):
                        for jh in range(4):
                            for jl in range(2):
                                row, col = 16 * a + 2 * g + th, 16 * c + 8 * tl + 2 * jh + jl
                                want = logical[:, 16 * a + 8 * jl + g, 16 * c + 4 * jh + 2 * th + tl]
                                assert torch.equal(stored[:, row, col], want)


def test_each_threads_bytes_are_eight_consecutive_stored_bytes() -> None:
    """Lane ``4 g + t`` of a 16-row slab holds bytes ``t + 4 i`` of rows ``g`` and ``g + 8`` (the swapped MMA's
    register operand): stored, 8 consecutive bytes of one row, in register order (row g, row g + 8, next 4 bytes)."""
    logical = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)  # entry = 16 * row + byte
    stored = shuffle.shuffle(logical, e2m1=False)[0].to(torch.int32)
    for g in range(8):
        for t in range(4):
            want = [16 * (g + 8 * (i % 2)) + t + 4 * (i // 2) for i in range(8)]
            assert stored[2 * g + t // 2, 8 * (t % 2): 8 * (t % 2) + 8].tolist() == want


def test_e2m1_words_hold_the_bits_where_the_decoding_reads_them() -> None:
    """Each stored word of a shuffled e2m1 weight, taken apart as the kernel does (``e2m1_pattern_pairs``), gives for
    its byte ``j`` (of the byte-shuffled layout) the bf16 patterns of ``value * 2**-126`` of the byte's two codes."""
    logical = torch.randint(0, 256, (2, 32, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    plain_words = shuffle.shuffle(logical, e2m1=False).view(torch.int32).flatten().tolist()
    e2m1_words = shuffle.shuffle(logical, e2m1=True).view(torch.int32).flatten().tolist()
    for plain, word in zip(plain_words, e2m1_words):
        patterns = shuffle.e2m1_pattern_pairs(word & 0xFFFFFFFF)
        for j in range(4):
            byte = (plain >> (8 * j)) & 0xFF
            for half in range(2):
                code = (byte >> (4 * half)) & 0xF
                assert (patterns[j] >> (16 * half)) & 0xFFFF == ((code & 8) << 12) | ((code & 7) << 6)


def test_the_bit_moves_cover_every_bit_once() -> None:
    masks = [mask for mask, _ in shuffle.E2M1_BIT_MOVES]
    assert sum(bin(m).count("1") for m in masks) == 32 and functools.reduce(operator.or_, masks) == 0xFFFFFFFF
    targets = [mask << shift if shift >= 0 else mask >> -shift for mask, shift in shuffle.E2M1_BIT_MOVES]
    assert functools.reduce(operator.or_, targets) == 0xFFFFFFFF and sum(bin(t).count("1") for t in targets) == 32


def test_shuffled_e2m1_weights_must_be_readable_as_words() -> None:
    weight = shuffle.shuffle(torch.zeros(2, 32, 64, dtype=torch.uint8), e2m1=True)
    shuffle.check_words(weight, "MXFP4")
    with pytest.raises(ValueError, match="32-bit words"):
        shuffle.check_words(weight.transpose(1, 2), "MXFP4")
    with pytest.raises(ValueError, match="32-bit words"):
        shuffle.check_words(torch.zeros(2 * 32 * 64 + 1, dtype=torch.uint8)[1:].view(2, 32, 64), "NVFP4")


@pytest.mark.parametrize("shape", [(32, 16), (3, 48, 64), (2, 2, 16, 32)])
def test_shuffle_and_unshuffle_are_inverse(shape: tuple[int, ...]) -> None:
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    for e2m1 in (False, True):
        stored = shuffle.shuffle(x, e2m1=e2m1)
        assert stored.shape == x.shape and stored.is_contiguous()
        assert not torch.equal(stored, x)
        assert torch.equal(shuffle.unshuffle(stored, e2m1=e2m1), x)
        assert torch.equal(shuffle.shuffle(shuffle.unshuffle(x, e2m1=e2m1), e2m1=e2m1), x)


def test_paired_rows_put_each_chunks_gate_rows_first() -> None:
    rows = torch.arange(2 * 64 * 3).reshape(2, 64, 3)
    paired = shuffle.pair_rows(rows)
    for chunk in range(2):
        for i in range(16):
            assert torch.equal(paired[:, 32 * chunk + i], rows[:, 32 * chunk + 2 * i])  # gate row 16 chunk + i
            assert torch.equal(paired[:, 32 * chunk + 16 + i], rows[:, 32 * chunk + 2 * i + 1])  # its up row
    assert torch.equal(shuffle.unpair_rows(paired), rows)
    weight = torch.randint(0, 256, (3, 64, 32), dtype=torch.uint8)
    for e2m1 in (False, True):
        stored = shuffle.shuffle(weight, e2m1=e2m1, paired=True)
        assert torch.equal(stored, shuffle.shuffle(shuffle.pair_rows(weight), e2m1=e2m1))
        assert torch.equal(shuffle.unshuffle(stored, e2m1=e2m1, paired=True), weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        shuffle.pair_rows(torch.zeros(48, 4))
    with pytest.raises(ValueError, match="multiple of 32"):
        shuffle.shuffle(torch.zeros(2, 48, 32, dtype=torch.uint8), e2m1=True, paired=True)


@pytest.mark.parametrize("shape,dtype", [((2, 24, 32), torch.uint8), ((2, 32, 40), torch.uint8),
                                         ((2, 32, 32), torch.int8), ((16,), torch.uint8)])
def test_shapes_that_are_not_whole_blocks_are_refused(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    for e2m1 in (False, True):
        with pytest.raises(ValueError, match="shuffled layout"):
            shuffle.shuffle(torch.zeros(shape, dtype=dtype), e2m1=e2m1)
        with pytest.raises(ValueError, match="shuffled layout"):
            shuffle.unshuffle(torch.zeros(shape, dtype=dtype), e2m1=e2m1)


# -- the GEMM ---------------------------------------------------------------------------------------


def _run(fmt: str, *, glu: bool, config: GemmConfig, counts: tuple[int, ...], hidden: int = 64, n_out: int = 48,
         seed: int = 0, interleaved: bool = False, bias: bool = False, shuffled_swap: Any = None, **options: Any
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output on the plain weight, on the shuffled weight, float64 reference)`` of one routing: ``counts[e]``
    rows on expert ``e``. ``interleaved`` (with ``glu``): gate/up rows ``g0 u0 g1 u1 ...``, shuffled paired with the
    scales' and zero points' rows paired; ``bias``: a bias (interleaved like the rows, never paired);
    ``shuffled_swap``: the shuffled weight's ``swap`` where it differs from the plain one's (``options``)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:, None].to(DEVICE)
    tokens, experts = ids.shape[0], len(counts)
    n_w = 2 * n_out if glu else n_out
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    b = torch.randn(experts, n_w, generator=gen).to(DEVICE) if bias else None
    plan = align.align_block_size(ids, experts, config.block_m)
    act = ACTIVATIONS["swiglu-interleaved" if interleaved else "swiglu"] if glu else None
    args = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    paired = glu and interleaved
    outs = []
    for shuffled in (False, True):
        run_args = dict(args)
        if shuffled and paired:
            for key in ("weight_scale", "weight_zero"):
                if run_args.get(key) is not None:
                    run_args[key] = shuffle.pair_rows(run_args[key])
        out = torch.full((tokens, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        stored = shuffle.shuffle(weight, e2m1=fmt.startswith(("mxfp4", "nvfp4")), paired=paired)
        moe_gemm.moe_gemm(a, stored if shuffled else weight, out, *plan,
                          rows_per_a=1, config=config, act=act_code(act) if act else 0, glu=glu,
                          interleaved=interleaved, bias=b.to(DTYPE) if b is not None else None,
                          weight_shuffled=shuffled,
                          **dict(options, **({"swap": shuffled_swap} if shuffled and shuffled_swap is not None
                                             else {})), **run_args)
        outs.append(out)
    return outs[0], outs[1], reference_gemm(rows, 1, ids, w, b.to(DTYPE) if b is not None else None, act)


def _check(plain: torch.Tensor, shuffled: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(shuffled).any()
    if CUDA:
        assert rel(shuffled, plain) < 2e-3
    else:
        assert torch.equal(shuffled, plain)
    assert rel(shuffled, ref) < 0.25  # the 4-bit quantization's own error


# rows per expert: 40 (a full block of 32 and 8 more), 20, none, 1
COUNTS = (40, 20, 0, 1)


@pytest.mark.parametrize("fmt", FOUR_BIT)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_a_shuffled_weight_gives_the_plain_weights_output(fmt: str, glu: bool, swap: bool) -> None:
    config = GemmConfig(32, 32, 32, num_warps=4, num_stages=2)
    _check(*_run(fmt, glu=glu, config=config, counts=COUNTS, swap=swap))


@pytest.mark.parametrize(("swap", "fmt"), grid([False, True], FOUR_BIT))
def test_interleaved_gate_up_rows_shuffled_paired(fmt: str, swap: bool) -> None:
    """GPT-OSS's row order: the weight shuffled paired, its scales' rows paired, the bias interleaved."""
    config = GemmConfig(32, 32, 32, num_warps=4, num_stages=2)
    _check(*_run(fmt, glu=True, config=config, counts=COUNTS, interleaved=True, bias=True, swap=swap))
    _check(*_run(fmt, glu=True, config=GemmConfig(16, 16, 64, num_warps=4, num_stages=2), counts=COUNTS,
                 interleaved=True, bias=True, hidden=128, swap=swap, split_k=2))


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("options", [dict(tma=True), dict(split_k=2), dict(grid="persistent"),
                                     dict(grid="flattened"), dict(ptx=False)],
                         ids=["tma", "split", "persistent", "flattened", "portable"])
def test_schedules_read_the_shuffled_weight(fmt: str, options: dict[str, Any]) -> None:
    if options.get("ptx") is False and not CUDA:
        pytest.skip("the interpreter decodes portably anyway")
    config = GemmConfig(16, 32, 64, num_warps=4, num_stages=2)
    _check(*_run(fmt, glu=True, config=config, counts=COUNTS, hidden=128, **options))


@pytest.mark.parametrize("fmt", ["int4-zeros", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_decoding_first_reads_the_shuffled_weight(fmt: str, interleaved: bool) -> None:
    config = GemmConfig(32, 32, 32, num_warps=4, num_stages=2)
    _check(*_run(fmt, glu=True, config=config, counts=COUNTS, decode_chunk=2, grid="persistent",
                 interleaved=interleaved, bias=interleaved))


@pytest.mark.parametrize(("schedule", "fmt"), grid(
    [dict(grid="tiles"), dict(grid="persistent"), dict(split_k=2), dict(half_tail=True)], ["int4", "mxfp4", "nvfp4"],
    ids=[["tiles", "persistent", "split", "half-tail"], None]))
def test_tiles_of_128_rows_on_every_schedule(fmt: str, schedule: dict[str, Any]) -> None:
    config = GemmConfig(128, 32, 32, num_warps=4, num_stages=2)
    for glu in (False, True):
        _check(*_run(fmt, glu=glu, config=config, counts=(130, 0, 5, 128), swap=True, **schedule))


def _close_everywhere(out: torch.Tensor, base: torch.Tensor) -> None:
    """Every element of ``out`` finite and within 2 % of ``base``'s (plus 2 % of its RMS): a few wrong elements among
    many right ones fail, which a relative norm of the whole output could miss."""
    assert torch.isfinite(out.float()).all()
    diff = (out.float() - base.float()).abs()
    bound = 0.02 * base.float().abs() + 0.02 * base.float().pow(2).mean().sqrt()
    bad = int((diff > bound).sum())
    assert bad == 0, f"{bad} of {out.numel()} elements off by up to {float(diff.max()):.3g}"


@pytest.mark.skipif(not HOPPER, reason="the swapped product's wgmma takes the weight tile from registers on Hopper")
@pytest.mark.parametrize("grid", ["tiles", "persistent"])
@pytest.mark.parametrize("tile", [(128, 64, 64, 4), (128, 128, 64, 8), (256, 128, 64, 8)])
def test_long_k_loops_of_wide_swapped_tiles_repeatably(tile: tuple[int, int, int, int], grid: str) -> None:
    """Mixtral-like K (4096) and many column tiles with the 128- and 256-row tiles the tables take, three runs, each
    element against the plain weight's ``rows @ W^T`` product (its MMA reads both operands from shared memory).
    (The race of the swapped product's register operand, ``launch_plan.drain_mma``, shows at Mixtral's full sizes:
    ``tests/test_mma_drain_gpu.py``; these sizes did not show it.)"""
    block_m, block_n, block_k, warps = tile
    config = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=3)
    for glu in (True, False):
        base = None
        for _ in range(3):
            plain, shuffled, _ = _run("mxfp4", glu=glu, config=config, counts=(300, 70, 0, 129, 256, 520),
                                      hidden=4096, n_out=4096, weight_scale_max=128, swap=None, grid=grid,
                                      shuffled_swap=True)
            base = plain if base is None else base
            _close_everywhere(shuffled, base)


@pytest.mark.parametrize("counts", [(1,), (0, 0, 3), (0, 0)], ids=["one-row", "one-expert", "empty"])
def test_edge_routings(counts: tuple[int, ...]) -> None:
    config = GemmConfig(16, 32, 32, num_warps=4, num_stages=2)
    plain, shuffled, ref = _run("mxfp4", glu=True, config=config, counts=counts, swap=True)
    if ref.numel():
        _check(plain, shuffled, ref)


def test_decode_weights_of_a_shuffled_weight_are_the_plain_ones() -> None:
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(2, 64, 1024, generator=gen) * 0.03).to(DEVICE)
    for fmt in ("int4", "int4-zeros", "mxfp4", "nvfp4"):
        args = operands(fmt, w[0], w)
        zero = args.get("weight_zero")
        for paired in (False, True):
            outs = []
            for shuffled in (False, True):
                out = torch.full((2, 64, 1024), float("nan"), dtype=DTYPE, device=DEVICE)
                weight, scale = args["weight"], args["weight_scale"]
                if shuffled:
                    weight = shuffle.shuffle(weight, e2m1=fmt in ("mxfp4", "nvfp4"), paired=paired)
                    scale, z = (shuffle.pair_rows(scale), shuffle.pair_rows(zero) if zero is not None else None) \
                        if paired else (scale, zero)
                else:
                    z = zero
                decode_first.decode_weights(weight, args["weight_format"], scale, z, out=out, shuffled=shuffled,
                                            paired_rows=paired and shuffled)
                outs.append(out)
            assert torch.equal(outs[0], outs[1])


def test_refusals() -> None:
    config = GemmConfig(16, 32, 32, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="by pointer"):
        _run("mxfp4", glu=True, config=config, counts=(3, 1), interleaved=True, tma=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        _run("mxfp4", glu=True, config=config, counts=(3, 1), interleaved=True, n_out=24)
    with pytest.raises(ValueError, match="block_n must be a multiple of 16"):
        _run("mxfp4", glu=False, config=GemmConfig(16, 8, 32, num_warps=4, num_stages=2), counts=(3, 1))
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        _run("mxfp4", glu=False, config=config, counts=(3, 1), n_out=40)
    with pytest.raises(ValueError, match="packed 4-bit"):
        rows = torch.randn(4, 64, device=DEVICE, dtype=DTYPE)
        ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
        plan = align.align_block_size(ids, 1, 16)
        moe_gemm.moe_gemm(rows, torch.zeros(1, 32, 64, dtype=DTYPE, device=DEVICE),
                          torch.empty(4, 32, dtype=DTYPE, device=DEVICE), *plan, rows_per_a=1, config=config,
                          weight_format=WeightFormat.FLOAT, weight_shuffled=True)


@pytest.mark.skipif(not HOPPER, reason="the wgmma tiles the layout is for (Hopper)")
@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("tile", [(16, 64, 128, 4), (64, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8)])
def test_hopper_tiles(fmt: str, tile: tuple[int, int, int, int]) -> None:
    block_m, block_n, block_k, warps = tile
    config = GemmConfig(block_m, block_n, block_k, num_warps=warps, num_stages=3)
    for glu, interleaved in ((False, False), (True, False), (True, True)):
        _check(*_run(fmt, glu=glu, config=config, counts=(300, 0, 17, 129), hidden=512, n_out=512, swap=True,
                     interleaved=interleaved, bias=interleaved))
