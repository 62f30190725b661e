"""The 4-bit float formats in the one grouped GEMM (``moeforge.kernels.moe_gemm``): MXFP4 and NVFP4
weights, NVFP4 rows, against the float64 product of the torch dequantizers (``moeforge.quant.fp4``).

On CPU under Triton's interpreter at tiny shapes (fp16 / fp32 rows: the interpreter mis-computes bf16
dots); on a GPU the same tests run there, plus larger shapes and bf16. Outputs are poisoned with NaN,
so every element is proven written.

Tolerances (relative Frobenius error against float64): an e2m1 value times an E8M0 or e4m3 scale is
exact in fp16 / bf16 / fp32, so the only roundings are the accumulation's and the output's: fp32
output of fp32 operands 1e-5 (the GPU sums in a different order), fp16 output 2e-3, bf16 1e-2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.quant.fp4 import (  # noqa: E402
    dequantize_mxfp4,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import ACTIVATIONS, reference_gemm, rel, route  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FLOATS = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def mxfp4_weight(e: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed [E, N, K/2], E8M0 scales [E, N, K/32], float64 values)`` of random weights whose
    blocks span many binades (scales far from 127)."""
    w = torch.randn(e, n, k, generator=gen) * torch.logspace(-3, 2, k // 32).repeat_interleave(32) * k ** -0.5
    q = quantize_mxfp4(w)
    data = q.data.reshape(e, n, k // 2)
    return data.to(DEVICE), q.scale.to(DEVICE), dequantize_mxfp4(q.data, q.scale).double().to(DEVICE)


def nvfp4_weight(e: int, n: int, k: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, e4m3 scales [E, N, K/16], fp32 global scales [E], float64 values)``."""
    w = torch.randn(e, n, k, generator=gen) * (torch.arange(1, e + 1.0)[:, None, None] * k ** -0.5)
    q = quantize_nvfp4(w, nvfp4_global_scale(w, leading_dims=1))
    deq = dequantize_nvfp4(q.data, q.scale, q.global_scale).double()
    return q.data.to(DEVICE), q.scale.to(DEVICE), q.global_scale.to(DEVICE), deq.to(DEVICE)


def _plan(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return align.align_block_size(ids, experts, block_m)


CONFIGS = {  # (block_m, block_n, block_k): one K-step inside a group, and several groups per step
    "k32": GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2),
    "k64": GemmConfig(16, 64, 64, group_m=1, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("hidden", [96, 128])  # 96 with block_k 64: a partial last K-step
@pytest.mark.parametrize("swap", [False, True])  # rows @ W^T, or (W @ rows^T)^T
def test_mxfp4_first_gemm_with_gpt_oss_activation_bias_and_weights(dtype: torch.dtype, config: str,
                                                                   hidden: int, swap: bool) -> None:
    tokens, k, experts, inter = 7, 2, 4, 40  # N = 40: masked columns
    gen = torch.Generator().manual_seed(61)
    act = ACTIVATIONS["gpt-oss"]
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    packed, scales, deq = mxfp4_weight(experts, 2 * inter, hidden, gen)
    bias = torch.randn(experts, 2 * inter, generator=gen).to(DEVICE, dtype)
    ids = route(tokens, experts, k, gen)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    out = torch.full((tokens * k, inter), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(x, packed, out, *_plan(ids, experts, 16), rows_per_a=k, config=CONFIGS[config],
                      weight_format=WeightFormat.MXFP4, weight_scale=scales, bias=bias,
                      topk_weights=weights.reshape(-1), act=act_code(act), glu=True, interleaved=True,
                      alpha=act.alpha, limit=act.limit, swap=swap)
    ref = reference_gemm(x, k, ids, deq, bias, act, weights)
    assert rel(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", FLOATS)
def test_nvfp4_second_gemm_reads_copy_rows_and_applies_the_global_scales(dtype: torch.dtype) -> None:
    tokens, k, experts, hidden, inter = 6, 3, 4, 72, 80  # K = 80: five 16-blocks, a partial 32-step
    gen = torch.Generator().manual_seed(62)
    rows = torch.randn(tokens * k, inter, generator=gen).to(DEVICE, dtype)
    packed, scales, global_scale, deq = nvfp4_weight(experts, hidden, inter, gen)
    ids = route(tokens, experts, k, gen)
    for config in CONFIGS.values():
        out = torch.full((tokens * k, hidden), float("nan"), dtype=dtype, device=DEVICE)
        moe_gemm.moe_gemm(rows, packed, out, *_plan(ids, experts, 16), rows_per_a=1, config=config,
                          weight_format=WeightFormat.NVFP4, weight_scale=scales, weight_global=global_scale)
        assert rel(out, reference_gemm(rows, 1, ids, deq)) < TOLERANCE[dtype]


@pytest.mark.parametrize("out_dtype", FLOATS)
def test_nvfp4_rows_times_nvfp4_weights(out_dtype: torch.dtype) -> None:
    """NVFP4 rows (quantized with a static global scale) and NVFP4 weights, both dequantized in
    registers to the output dtype; both global scales multiply the accumulator."""
    tokens, k, experts, hidden, inter = 5, 2, 3, 64, 48
    gen = torch.Generator().manual_seed(63)
    x = torch.randn(tokens, hidden, generator=gen)
    a_global = float(x.abs().max()) / (6 * 448) * 1.5
    qx = quantize_nvfp4(x, a_global)
    x_deq = dequantize_nvfp4(qx.data, qx.scale, a_global).double().to(DEVICE)
    packed, scales, global_scale, deq = nvfp4_weight(experts, 2 * inter, hidden, gen)
    ids = route(tokens, experts, k, gen)
    act = ACTIVATIONS["swiglu"]
    out = torch.full((tokens * k, inter), float("nan"), dtype=out_dtype, device=DEVICE)
    moe_gemm.moe_gemm(qx.data.to(DEVICE), packed, out, *_plan(ids, experts, 16), rows_per_a=k,
                      config=CONFIGS["k32"], weight_format=WeightFormat.NVFP4, a_scale=qx.scale.to(DEVICE),
                      a_global=a_global, weight_scale=scales, weight_global=global_scale, act=act_code(act),
                      glu=True)
    assert rel(out, reference_gemm(x_deq, k, ids, deq, None, act)) < TOLERANCE[out_dtype]


def test_every_e2m1_code_and_scale_decodes_exactly() -> None:
    """One-hot fp32 rows read single weights: every e2m1 code under E8M0 scales from 2**-100 to 2**100
    (MXFP4) and every finite e4m3 scale code (NVFP4) comes out exactly the torch dequantizer's value."""
    n, kdim = 64, 256
    codes = torch.arange(n * kdim) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, n, kdim // 2)
    rows = torch.eye(kdim).to(DEVICE)
    ids = torch.zeros(kdim, 1, dtype=torch.int32, device=DEVICE)
    plan = _plan(ids, 1, 16)
    config = GemmConfig(16, 32, 64, group_m=1, num_warps=4, num_stages=2)
    e8m0 = (torch.arange(n * kdim // 32) * 37 % 201 + 27).to(torch.uint8).view(1, n, kdim // 32)
    e4m3 = (torch.arange(n * kdim // 16) % 127).to(torch.uint8).view(1, n, kdim // 16)  # 0x00..0x7E, no NaN
    cases = [(WeightFormat.MXFP4, e8m0, None, dequantize_mxfp4(packed, e8m0)),
             (WeightFormat.NVFP4, e4m3.view(torch.float8_e4m3fn), torch.ones(1),
              dequantize_nvfp4(packed, e4m3.view(torch.float8_e4m3fn), torch.ones(1)))]
    for fmt, scale, global_scale, want in cases:
        out = torch.full((kdim, n), float("nan"), device=DEVICE)
        moe_gemm.moe_gemm(rows, packed.to(DEVICE), out, *plan, rows_per_a=1, config=config, weight_format=fmt,
                          weight_scale=scale.to(DEVICE),
                          weight_global=global_scale.to(DEVICE) if global_scale is not None else None)
        torch.testing.assert_close(out.t().cpu(), want[0].float(), rtol=0, atol=0)


def test_nan_scales_reach_the_output() -> None:
    """An E8M0 code 255 or an e4m3 NaN scale makes its block NaN in the reference: the kernel too."""
    gen = torch.Generator().manual_seed(64)
    n, kdim = 32, 64
    rows = torch.randn(4, kdim, generator=gen).to(DEVICE)
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    packed = torch.randint(0, 256, (1, n, kdim // 2), generator=gen, dtype=torch.uint8)
    e8m0 = torch.full((1, n, kdim // 32), 127, dtype=torch.uint8)
    e8m0[0, 3, 1] = 255
    e4m3 = torch.full((1, n, kdim // 16), 0x38, dtype=torch.uint8)  # 1.0
    e4m3[0, 5, 2] = 0x7F
    for fmt, scale, global_scale, bad in ((WeightFormat.MXFP4, e8m0, None, 3),
                                          (WeightFormat.NVFP4, e4m3.view(torch.float8_e4m3fn), torch.ones(1), 5)):
        out = torch.zeros(4, n, device=DEVICE)
        moe_gemm.moe_gemm(rows, packed.to(DEVICE), out, *_plan(ids, 1, 16), rows_per_a=1, config=CONFIGS["k32"],
                          weight_format=fmt, weight_scale=scale.to(DEVICE),
                          weight_global=global_scale.to(DEVICE) if global_scale is not None else None)
        nan_columns = torch.isnan(out).all(0).nonzero().flatten().tolist()
        assert nan_columns == [bad] and not torch.isnan(out[:, [c for c in range(n) if c != bad]]).any()


def test_empty_batch_and_an_expert_with_every_token() -> None:
    gen = torch.Generator().manual_seed(65)
    packed, scales, deq = mxfp4_weight(4, 64, 64, gen)
    empty = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    out = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    ids = torch.empty(0, 1, dtype=torch.int32, device=DEVICE)
    moe_gemm.moe_gemm(empty, packed, out, *_plan(ids, 4, 16), rows_per_a=1, config=CONFIGS["k32"],
                      weight_format=WeightFormat.MXFP4, weight_scale=scales)
    x = torch.randn(9, 64, generator=gen).to(DEVICE, torch.float16)
    ids = torch.full((9, 1), 2, dtype=torch.int32, device=DEVICE)
    out = torch.full((9, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    moe_gemm.moe_gemm(x, packed, out, *_plan(ids, 4, 16), rows_per_a=1, config=CONFIGS["k64"],
                      weight_format=WeightFormat.MXFP4, weight_scale=scales)
    assert rel(out, reference_gemm(x, 1, ids, deq)) < 2e-3


def _unaligned_copy(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in rows one element wider than they are (a view): strides Triton cannot see 16-aligned."""
    wide = torch.zeros(*scales.shape[:-1], scales.shape[-1] + 1, dtype=scales.dtype, device=scales.device)
    wide[..., :-1] = scales
    return wide[..., :-1]


@pytest.mark.parametrize("fmt,block_k", [(WeightFormat.MXFP4, 128), (WeightFormat.NVFP4, 64),
                                         (WeightFormat.NVFP4, 128)])  # 4, 4, 8 groups per step
@pytest.mark.parametrize("swap", [False, True])  # swapped tiles load each step's scales one step ahead
def test_aligned_scale_rows_clamp_the_step_and_give_the_masked_result(fmt: WeightFormat, block_k: int,
                                                                      swap: bool) -> None:
    """With K a multiple of the step and scale rows 16-aligned, a step of 4 or more groups loads them with the
    step clamped (``group_scales``' ``CLAMP``, vectorized on the GPU), else group by group masked: the same
    output, bitwise, and the reference's."""
    tokens, k, experts, n, kdim = 5, 2, 3, 48, 512  # 16 or 32 groups per row: rows 16-aligned
    config = GemmConfig(16, 64, block_k, group_m=1, num_warps=4, num_stages=2)
    gen = torch.Generator().manual_seed(67)
    x = torch.randn(tokens, kdim, generator=gen).to(DEVICE, torch.float16)
    if fmt is WeightFormat.MXFP4:
        packed, scales, deq = mxfp4_weight(experts, n, kdim, gen)
        global_scale = None
    else:
        packed, scales, global_scale, deq = nvfp4_weight(experts, n, kdim, gen)
    ids = route(tokens, experts, k, gen)
    unaligned = _unaligned_copy(scales)
    assert launch_plan.vector_scales(scales, None) and not launch_plan.vector_scales(unaligned, None)
    outs = []
    for scale in (scales, unaligned):
        out = torch.full((tokens * k, n), float("nan"), dtype=torch.float16, device=DEVICE)
        moe_gemm.moe_gemm(x, packed, out, *_plan(ids, experts, 16), rows_per_a=k, config=config,
                          weight_format=fmt, weight_scale=scale, weight_global=global_scale, swap=swap)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel(outs[0], reference_gemm(x, k, ids, deq)) < TOLERANCE[torch.float16]


def test_vector_scales_needs_contiguous_groups_and_aligned_rows() -> None:
    scales = torch.zeros(2, 8, 32, dtype=torch.uint8)
    assert launch_plan.vector_scales(scales, None) and launch_plan.vector_scales(scales, scales)
    assert not launch_plan.vector_scales(None, None)
    assert not launch_plan.vector_scales(scales.transpose(1, 2), None)  # groups not contiguous
    assert launch_plan.vector_scales(scales[..., :24], None)  # rows of 32 (a view): aligned
    assert not launch_plan.vector_scales(torch.zeros(2, 8, 24, dtype=torch.uint8), None)  # rows of 24
    assert not launch_plan.vector_scales(scales.flatten()[1:].as_strided((2, 8, 16), (256, 32, 1)), None)  # start
    assert not launch_plan.vector_scales(scales, torch.zeros(2, 8, 24, dtype=torch.uint8))  # zero points unaligned


@pytest.mark.parametrize("change,match", [
    ({"weight_scale": None}, "need their scales"),
    ({"weight_global": "bad"}, "global scale"),
    ({"weight_format": WeightFormat.INT8}, "INT8 needs torch.int8 rows"),
    ({"scale_dtype": torch.float32}, "E8M0"),
])
def test_bad_fp4_arguments_are_value_errors(change: dict[str, object], match: str) -> None:
    gen = torch.Generator().manual_seed(66)
    packed, scales, _ = mxfp4_weight(2, 32, 64, gen)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.float16)
    out = torch.empty(3, 32, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)
    scale: Optional[torch.Tensor] = scales
    if "scale_dtype" in change:
        scale = scales.float()
    if change.get("weight_scale", 1) is None:
        scale = None
    kwargs: dict[str, object] = {"weight_format": change.get("weight_format", WeightFormat.MXFP4)}
    if "weight_global" in change:
        kwargs["weight_global"] = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        moe_gemm.moe_gemm(x, packed, out, *_plan(ids, 2, 16), rows_per_a=1, config=CONFIGS["k32"],
                          weight_scale=scale, **kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 64, 333])
def test_fp4_layers_at_scale_equal_the_emulation(fmt: str, tokens: int) -> None:
    """The layer users build (GPT-OSS-like: interleaved clamped SwiGLU, biases) on the triton backend
    equals its torch emulation at a realistic width, in bf16."""
    torch.manual_seed(0)
    method = mf.Mxfp4Method() if fmt == "mxfp4" else mf.Nvfp4Method()
    kwargs = dict(activation=mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
                  expert_bias=True, dtype=torch.bfloat16, device="cuda", environ={})
    fast = mf.MoELayer(32, 4, 1024, 512, quant=method, backend="triton", **kwargs)  # type: ignore[arg-type]
    slow = mf.MoELayer(32, 4, 1024, 512, quant=method, backend="torch", **kwargs)  # type: ignore[arg-type]
    slow.load_state_dict(fast.state_dict())
    assert "backend triton" in fast.describe()
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = fast(x), slow(x)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
