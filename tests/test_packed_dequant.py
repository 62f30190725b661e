"""The packed inline-PTX decoding of 4-bit operands (``moeforge.kernels.dequant``) against the
portable decoding and the torch dequantizers.

On a CUDA GPU: every e2m1 code under every E8M0 scale that does not overflow (MXFP4, bf16) and every
finite e4m3 scale (NVFP4, bf16 and fp16) decodes exactly; every INT4 code with and without zero
points too; and whole GEMMs (both orientations, narrow and 64-row tiles, partial K-steps, NVFP4 rows)
are bitwise equal with the packed and the portable decoding, which compute the same weights; all of it also from
weights in the pre-shuffled layout (MXFP4 / NVFP4: 32-bit words, NVFP4 in bf16 folded). On CPU:
the packed decoding is refused with a clear error, and the rule that picks it is checked.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import attrs
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, moe_gemm, shuffle  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.quant.fp4 import dequantize_mxfp4, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import ACTIVATIONS, pack_int4, route  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

TILES = {  # narrow (mma.sync, weights as registers) and 64-row (wgmma) programs, 32 and 64-deep K-steps
    "16x32x64": GemmConfig(16, 32, 64, group_m=1, num_warps=4, num_stages=2),
    "16x64x32": GemmConfig(16, 64, 32, group_m=1, num_warps=4, num_stages=3),
    "64x64x64": GemmConfig(64, 64, 64, group_m=4, num_warps=4, num_stages=3),
}


def _one_hot_decode(fmt: WeightFormat, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    config: GemmConfig, swap: bool, zero: Optional[torch.Tensor] = None,
                    global_scale: Optional[torch.Tensor] = None, scale_max: Optional[int] = None,
                    shuffled: bool = False) -> torch.Tensor:
    """The weight ``[N, K]`` as the kernel decodes it: one-hot rows in ``dtype`` read single weights
    (one product per output, exact in the fp32 accumulator), written as fp32. ``shuffled``: from the weight in the
    pre-shuffled layout (e2m1: 32-bit words, NVFP4 in bf16 with its folded scales)."""
    n, kdim = packed.shape[1], packed.shape[2] * 2
    if shuffled:
        packed = shuffle.shuffle(packed, e2m1=fmt in (WeightFormat.MXFP4, WeightFormat.NVFP4))
    rows = torch.eye(kdim, device="cuda", dtype=dtype)
    ids = torch.zeros(kdim, 1, dtype=torch.int32, device="cuda")
    out = torch.full((kdim, n), float("nan"), device="cuda")
    moe_gemm.moe_gemm(rows, packed, out, *align.align_block_size(ids, 1, config.block_m), rows_per_a=1,
                      config=config, weight_format=fmt, weight_scale=scale, weight_zero=zero,
                      weight_global=global_scale, swap=swap, ptx=True, weight_scale_max=scale_max,
                      weight_shuffled=shuffled)
    return out.t()


def _every_e2m1_code(n: int, kdim: int) -> torch.Tensor:
    """Packed ``[1, n, kdim / 2]`` bytes cycling through the 16 codes along each row."""
    codes = torch.arange(n * kdim) % 16
    return (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, n, kdim // 2)


@gpu
@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("shuffled", [False, True])
def test_every_e2m1_code_under_every_e8m0_scale(tile: str, swap: bool, folded: bool, shuffled: bool) -> None:
    """Every E8M0 code from 0 (2**-127, a subnormal product) to 252 (6 * 2**126 is bf16's largest) decodes
    exactly; ``folded``: with a bound of 128 the x 2**126 is folded into the scales, every code 0..128."""
    n, kdim = 64, 512
    packed = _every_e2m1_code(n, kdim)
    largest = 128 if folded else 252
    e8m0 = (torch.arange(n * kdim // 32) % (largest + 1)).to(torch.uint8).view(1, n, kdim // 32)
    got = _one_hot_decode(WeightFormat.MXFP4, packed.cuda(), e8m0.cuda(), torch.bfloat16, TILES[tile], swap,
                          scale_max=largest if folded else None, shuffled=shuffled)
    torch.testing.assert_close(got.cpu(), dequantize_mxfp4(packed, e8m0)[0].float(), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("swap", [False, True])
def test_a_code_above_a_wrong_bound_decodes_as_inf_never_finite(swap: bool) -> None:
    """A caller that claims every code is at most 128 when one is not gets inf weights in that code's groups:
    every output of the weight rows that hold one is inf / NaN (a loud failure; in this one-hot product the
    zeros times inf make NaN of the whole row), the other rows are exact."""
    n, kdim = 64, 256
    packed = _every_e2m1_code(n, kdim)
    e8m0 = torch.full((1, n, kdim // 32), 127, dtype=torch.uint8)
    e8m0[0, 3, 1], e8m0[0, 10, 0], e8m0[0, 40, 7] = 129, 200, 255
    got = _one_hot_decode(WeightFormat.MXFP4, packed.cuda(), e8m0.cuda(), torch.bfloat16, TILES["16x32x64"], swap,
                          scale_max=128).cpu()
    bad = (e8m0 > 128)[0].any(-1)
    assert bad.sum() == 3 and not torch.isfinite(got[bad]).any()
    torch.testing.assert_close(got[~bad], dequantize_mxfp4(packed, e8m0)[0].float()[~bad], rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("shuffled", [False, True])
def test_every_e2m1_code_under_every_e4m3_scale(dtype: torch.dtype, swap: bool, shuffled: bool) -> None:
    n, kdim = 64, 256
    packed = _every_e2m1_code(n, kdim)
    e4m3 = ((torch.arange(n * kdim // 16) % 127) | ((torch.arange(n * kdim // 16) // 127 % 2) << 7))
    e4m3 = e4m3.to(torch.uint8).view(1, n, kdim // 16).view(torch.float8_e4m3fn)  # both signs, no NaN
    ones = torch.ones(1)
    got = _one_hot_decode(WeightFormat.NVFP4, packed.cuda(), e4m3.cuda(), dtype, TILES["16x32x64"], swap,
                          global_scale=ones.cuda(), shuffled=shuffled)
    torch.testing.assert_close(got.cpu(), dequantize_nvfp4(packed, e4m3, ones)[0].float(), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_points", [False, True])
def test_every_int4_code_and_zero_point(dtype: torch.dtype, zero_points: bool) -> None:
    n, kdim, group = 64, 256, 32
    packed = _every_e2m1_code(n, kdim)  # (every INT4 code)
    codes = torch.arange(n * kdim) % 16
    scale = (torch.rand(1, n, kdim // group, generator=torch.Generator().manual_seed(5)) + 0.1).to(dtype)
    zero = (torch.arange(n * kdim // group) * 7 % 16).to(torch.uint8).view(1, n, kdim // group)
    got = _one_hot_decode(WeightFormat.INT4, packed.cuda(), scale.cuda(), dtype, TILES["16x64x32"], False,
                          zero=zero.cuda() if zero_points else None)
    q = codes.view(1, n, kdim).float()
    z = zero.float().repeat_interleave(group, -1) if zero_points else torch.full_like(q, 8.0)
    want = ((q - z) * scale.float().repeat_interleave(group, -1)).to(dtype).float()  # one rounding, in dtype
    torch.testing.assert_close(got.cpu(), want[0], rtol=0, atol=0)


def _gemm(fmt: WeightFormat, dtype: torch.dtype, config: GemmConfig, swap: bool, glu: bool, ptx: bool,
          gen_seed: int, scale_max: Optional[int] = None, fold: bool = False, shuffled: bool = False) -> torch.Tensor:
    """``scale_max``: MXFP4 E8M0 codes up to it (else up to 134); ``fold``: the launcher told so; ``shuffled``: the
    weight in the pre-shuffled layout."""
    gen = torch.Generator().manual_seed(gen_seed)
    tokens, k, experts, hidden, inter = 37, 2, 4, 224, 96  # K = 224: a partial 64-step
    n_w = 2 * inter if glu else inter
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    w = torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5
    kwargs: dict[str, object] = {}
    if fmt is WeightFormat.MXFP4:
        packed = torch.randint(0, 256, (experts, n_w, hidden // 2), generator=gen, dtype=torch.uint8)
        high = 135 if scale_max is None else scale_max + 1
        kwargs["weight_scale"] = torch.randint(110, high, (experts, n_w, hidden // 32), generator=gen,
                                               dtype=torch.uint8).cuda()
        kwargs["weight_scale_max"] = scale_max if fold else None
    elif fmt is WeightFormat.NVFP4:
        q = quantize_nvfp4(w, nvfp4_global_scale(w, leading_dims=1))
        packed = q.data
        kwargs.update(weight_scale=q.scale.cuda(), weight_global=q.global_scale.cuda())
    else:
        packed, scales, zeros, _ = pack_int4(w, 32, True, dtype)
        kwargs.update(weight_scale=scales.cuda(), weight_zero=zeros.cuda() if zeros is not None else None)
    ids = route(tokens, experts, k, gen, device="cuda")
    out = torch.full((tokens * k, inter), float("nan"), dtype=dtype, device="cuda")
    act = ACTIVATIONS["swiglu"] if glu else None
    if shuffled:
        packed = shuffle.shuffle(packed, e2m1=fmt in (WeightFormat.MXFP4, WeightFormat.NVFP4))
    moe_gemm.moe_gemm(x, packed.cuda(), out, *align.align_block_size(ids, experts, config.block_m), rows_per_a=k,
                      config=config, weight_format=fmt, glu=glu, act=act_code(act) if act else 0, swap=swap,
                      ptx=ptx, weight_shuffled=shuffled, **kwargs)  # type: ignore[arg-type]
    assert not torch.isnan(out).any()
    return out


@gpu
@pytest.mark.parametrize("fmt", [WeightFormat.MXFP4, WeightFormat.NVFP4, WeightFormat.INT4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("swap,glu", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("shuffled", [False, True])
def test_packed_and_portable_decodings_give_bitwise_equal_gemms(fmt: WeightFormat, dtype: torch.dtype, tile: str,
                                                                swap: bool, glu: bool, shuffled: bool) -> None:
    """(Shuffled NVFP4 in bf16: the packed decoding folded, 2**7 of the scales restored in the epilogue.)"""
    if fmt is WeightFormat.MXFP4 and dtype == torch.float16:
        pytest.skip("MXFP4 in fp16 keeps the portable decoding")
    fast = _gemm(fmt, dtype, TILES[tile], swap, glu, True, 7, shuffled=shuffled)
    slow = _gemm(fmt, dtype, TILES[tile], swap, glu, False, 7, shuffled=shuffled)
    assert torch.equal(fast, slow)


@gpu
@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("swap,glu", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("shuffled", [False, True])
def test_folded_mxfp4_gemms_equal_the_unfolded_and_portable_ones(tile: str, swap: bool, glu: bool,
                                                                 shuffled: bool) -> None:
    config, bf16 = TILES[tile], torch.bfloat16
    folded = _gemm(WeightFormat.MXFP4, bf16, config, swap, glu, True, 11, 128, fold=True, shuffled=shuffled)
    unfolded = _gemm(WeightFormat.MXFP4, bf16, config, swap, glu, True, 11, 128, shuffled=shuffled)
    portable = _gemm(WeightFormat.MXFP4, bf16, config, swap, glu, False, 11, 128, fold=True, shuffled=shuffled)
    assert torch.equal(folded, unfolded) and torch.equal(folded, portable)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_rows_decode_the_same_both_ways(out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    tokens, k, experts, hidden, inter = 21, 2, 3, 128, 64
    x = torch.randn(tokens, hidden, generator=gen)
    a_global = float(x.abs().max()) / (6 * 448) * 1.5
    qx = quantize_nvfp4(x, a_global)
    w = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    qw = quantize_nvfp4(w, nvfp4_global_scale(w, leading_dims=1))
    ids = route(tokens, experts, k, gen, device="cuda")
    outs = []
    for ptx in (True, False):
        out = torch.full((tokens * k, inter), float("nan"), dtype=out_dtype, device="cuda")
        moe_gemm.moe_gemm(qx.data.cuda(), qw.data.cuda(), out, *align.align_block_size(ids, experts, 16),
                          rows_per_a=k, config=TILES["16x32x64"], weight_format=WeightFormat.NVFP4,
                          a_scale=qx.scale.cuda(), a_global=a_global, weight_scale=qw.scale.cuda(),
                          weight_global=qw.global_scale.cuda(), act=act_code(ACTIVATIONS["swiglu"]), glu=True,
                          ptx=ptx)
        outs.append(out)
    assert torch.equal(*outs)


# -- CPU: the rule and the error -------------------------------------------------------------------

def test_packed_decoding_rule() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not moe_gemm.packed_decoding(cpu, torch.bfloat16, WeightFormat.MXFP4)
    if torch.version.hip is None:
        assert moe_gemm.packed_decoding(cuda, torch.bfloat16, WeightFormat.MXFP4)
        assert moe_gemm.packed_decoding(cuda, torch.float16, WeightFormat.NVFP4)
        assert moe_gemm.packed_decoding(cuda, torch.float16, WeightFormat.INT4)
    assert not moe_gemm.packed_decoding(cuda, torch.float16, WeightFormat.MXFP4)  # E8M0 beyond fp16's range
    assert not moe_gemm.packed_decoding(cuda, torch.float32, WeightFormat.INT4)


@pytest.mark.skipif(CUDA, reason="the refusal is for devices without the packed decoding")
def test_asking_for_the_packed_decoding_where_it_cannot_run_is_a_value_error() -> None:
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 32, 32), generator=gen, dtype=torch.uint8)
    scales = torch.full((2, 32, 2), 127, dtype=torch.uint8)
    x = torch.randn(3, 64, generator=gen).to(torch.float16)
    out = torch.empty(3, 32, dtype=torch.float16)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="packed 4-bit decoding"):
        moe_gemm.moe_gemm(x, packed, out, *align.align_block_size(ids, 2, 16), rows_per_a=1,
                          config=TILES["16x32x64"], weight_format=WeightFormat.MXFP4, weight_scale=scales, ptx=True)


def test_four_bit_methods_align_by_rows_per_expert() -> None:
    """``ConfigTable.dequant_blocks``: 64-row blocks from 32 rows per expert and 128-row blocks from 256,
    whatever the (bf16-tuned or default) table says; smaller batches keep the table's blocks; a batch-invariant
    table never changes; the alignment key tells the rule apart."""
    steps = ((32.0, 64), (256.0, 128))
    table = ConfigTable(128, 4, dequant_blocks=steps)
    assert table.lookup(1).block_m == 16 and table.lookup(1000).block_m == 32  # 31 rows per expert
    assert table.lookup(1024).block_m == 64 and table.lookup(4096).block_m == 64
    assert table.lookup(8192).block_m == 128
    assert ConfigTable(128, 4).lookup(1024).block_m == 32
    assert table.alignment() != ConfigTable(128, 4).alignment()
    entry = {"gate_up": dict(block_m=128, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4),
             "down": dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)}
    tuned = attrs.evolve(ConfigTable.from_json(128, 4, {"4096": entry}), dequant_blocks=steps)
    assert tuned.lookup(4096).down.block_m == 64 and tuned.lookup(4096).down.block_n == 128  # tiles kept
    assert tuned.lookup(16).block_m == 128  # few rows: the table's
    assert attrs.evolve(tuned, batch_invariant=True).lookup(4096).block_m == 128
    for method in (mf.Mxfp4Method, mf.Nvfp4Method, mf.W4A16Method):
        assert method.dequant_blocks == steps
