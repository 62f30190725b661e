"""The quantized Triton kernels (FP8 / INT8 W8A8, W4A16 grouped GEMMs; activation quantization) and
their stages, against an independent float64 dequantize-then-matmul reference.

Without a GPU they run in Triton's interpreter at tiny shapes. The interpreter computes ``tl.dot`` on
fp8 and int8 operands exactly (it widens them), so the FP8 kernel runs its real code path here; W4A16
uses fp16 activations (the interpreter mis-computes ``tl.dot`` on bf16). Outputs are poisoned with
NaN first, so every element is proven written. ``tests/test_triton_quant_gemm_gpu.py`` repeats the
checks at realistic shapes on a GPU.

Tolerances (relative Frobenius error against the float64 reference of the *dequantized* operands):
the W8A8 products of 8-bit values are exact in fp32 and summed in fp32, so an fp32 output is within
1e-5 and an fp16 output within its rounding (2e-3); W4A16 rounds each dequantized weight to the
activation dtype once (fp16: 2^-11 relative), 2e-3. Quantized activations are compared bit for bit
with the torch quantizers; after an activation (computed by the kernel's formulas) within one fp8
step where a value lies on a rounding boundary.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, launch_plan, moe_gemm, quantize  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig  # noqa: E402
from moeforge.kernels.grouped_gemm_call import encode_config  # noqa: E402
from moeforge.payloads import Activations  # noqa: E402
from moeforge.spec import DType  # noqa: E402
from moeforge.stages.activation import apply_activation  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, TritonTopK, act_code  # noqa: E402
from moeforge.stages.triton_quant import (  # noqa: E402
    ActivateQuantizeAligned,
    FusedQuantGroupedGemm,
    QuantizeAligned,
    TritonQuantizeTokens,
)
from moeforge.stages.quantize import PerGroupQuantizer, PerTensorQuantizer, PerTokenQuantizer, dequantize  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
TILE = GemmConfig(16, 64, 128, group_m=2, num_warps=4, num_stages=2)


# -- helpers (also used by the GPU tests) -------------------------------------------------------------

def route(tokens: int, experts: int, k: int, gen: torch.Generator, device: str = DEVICE) -> torch.Tensor:
    """Random distinct expert ids ``[tokens, k]`` (int32)."""
    if tokens == 0:
        return torch.empty(0, k, dtype=torch.int32, device=device)
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32).to(device)


def w8a8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              out: torch.Tensor, *plan: torch.Tensor, **options: object) -> torch.Tensor:
    """The one grouped GEMM on FP8 / INT8 rows and weights."""
    fmt = WeightFormat.INT8 if weight.dtype == torch.int8 else WeightFormat.FP8
    return moe_gemm.moe_gemm(a, weight, out, *plan, weight_format=fmt, a_scale=a_scale,  # type: ignore[misc]
                             weight_scale=weight_scale, **options)


def w4a16_gemm(a: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               *plan: torch.Tensor, zeros: Optional[torch.Tensor] = None, **options: object) -> torch.Tensor:
    """The one grouped GEMM on float rows and packed int4 weights."""
    return moe_gemm.moe_gemm(a, packed, out, *plan, weight_format=WeightFormat.INT4,  # type: ignore[misc]
                             weight_scale=scales, weight_zero=zeros, **options)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out.float()).any(), "an output element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[E, ceil(n/128), ceil(k/128)]`` block scales repeated to ``[E, n, k]``."""
    return scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]


def quantize_weight_w8(w: torch.Tensor, dtype: torch.dtype, block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, dequantized)`` of ``w [E, N, K]``: per channel, or per 128x128 block (fp8)."""
    qmax = 448.0 if dtype == FP8 else 127.0
    w = w.float()
    if block:
        e, n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        padded = torch.zeros(e, nb * 128, kb * 128, device=w.device)
        padded[:, :n, :k] = w
        amax = padded.abs().view(e, nb, 128, kb, 128).amax(dim=(2, 4))
        scale = amax.clamp(min=1e-12) / qmax
        full = expand_blocks(scale, n, k)
    else:
        scale = w.abs().amax(-1).clamp(min=1e-12) / qmax
        full = scale[..., None]
    scaled = (w / full).clamp(-qmax, qmax)
    q = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(FP8)
    return q, scale, q.double() * full.double()


def pack_int4(w: torch.Tensor, group: int, zero_points: bool, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(qweight [E, N, K/2] uint8, scales [E, N, K/G], zeros or None, dequantized)`` of ``w``."""
    e, n, k = w.shape
    grouped = w.float().view(e, n, k // group, group)
    if zero_points:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-6).to(dtype)
        zeros = (-low / scales.float()).round().clamp(0, 15).to(torch.uint8)
    else:
        scales = (grouped.abs().amax(-1) / 7).clamp(min=1e-6).to(dtype)
        zeros = torch.full_like(scales, 8, dtype=torch.uint8)
    q = (grouped / scales.float()[..., None]).round() + zeros.float()[..., None]
    q = q.clamp(0, 15).to(torch.uint8).view(e, n, k)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    deq = (q.double().view(e, n, k // group, group) - zeros.double()[..., None]) * scales.double()[..., None]
    return packed.contiguous(), scales, zeros if zero_points else None, deq.view(e, n, k)


def reference_gemm(
    x: torch.Tensor, rows_per_a: int, ids: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    act: Optional[mf.ActivationConfig] = None, weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float64 ``[copies, N]``: copy ``c`` reads row ``c // rows_per_a`` of ``x`` (float values) and
    multiplies by its expert's ``w [N_w, K]`` (float values), then bias, activation, weight."""
    flat = ids.reshape(-1).long()
    rows = x.double()[torch.arange(flat.numel(), device=x.device) // rows_per_a]
    out = torch.zeros(flat.numel(), w.shape[1], dtype=torch.float64, device=x.device)
    for expert in flat.unique().tolist():  # a loop over experts: no [copies, N, K] temporary
        chosen = (flat == expert).nonzero().squeeze(1)
        out[chosen] = rows[chosen] @ w[expert].double().t()
    if bias is not None:
        out += bias.double()[flat]
    if act is not None:
        out = apply_activation(out, act)
    if weights is not None:
        out *= weights.double().reshape(-1, 1)
    return out


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance, in representable steps, between two fp8 e4m3 tensors of the same sign
    pattern (0 when bit-identical)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.uint8).long()
        magnitude = bits & 0x7F
        return torch.where(bits >= 0x80, -magnitude, magnitude)
    return int((ordinal(a) - ordinal(b)).abs().max()) if a.numel() else 0


def assert_same_quantization(got: Activations, want: Activations) -> None:
    """``got`` (a kernel) equals ``want`` (a torch quantizer) bit for bit on the CPU. On CUDA, torch
    computes ``amax / qmax`` (a CPU-scalar divisor) as ``amax * (1 / qmax)``, which can be one fp32
    ulp off the IEEE quotient the kernels compute; a value on an fp8/int8 rounding boundary may then
    round the other way: scales within 1 ulp, data within one step on at most 1% of the elements
    (measured on an H100: 0.08% for per-128-group fp8 of 333 x 2048 random rows)."""
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    assert got.scale is not None and want.scale is not None
    if got.data.device.type == "cpu":
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
        return
    torch.testing.assert_close(got.scale, want.scale, rtol=2 ** -23, atol=0)
    if got.data.dtype == torch.int8:
        assert bool(((got.data.long() - want.data.long()).abs() <= 1).all())
    else:
        assert fp8_steps_apart(got.data, want.data) <= 1
    differing = int((got.data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
    assert differing <= max(1, got.data.numel() // 100)


def quantizers() -> dict[str, Callable[[], mf.stages.Quantizer]]:
    return {"token-fp8": lambda: PerTokenQuantizer(DType.FP8_E4M3),
            "token-int8": lambda: PerTokenQuantizer(DType.INT8), "group-fp8": PerGroupQuantizer}


def kernel_quantize(x: torch.Tensor, quantizer: mf.stages.Quantizer) -> Activations:
    dtype = quantizer.dtype.torch_dtype
    q, scale = quantize.quantize_tokens(x, dtype, isinstance(quantizer, PerGroupQuantizer))
    return Activations(q, scale)


# -- activation quantization ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(quantizers()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_kernel_is_bit_identical_to_the_torch_quantizer(name: str, dtype: torch.dtype) -> None:
    quantizer = quantizers()[name]()
    gen = torch.Generator().manual_seed(11)
    widths = [256, 384] if name == "group-fp8" else [200, 256, 4100]  # 4100: two chunks per row
    for rows in (0, 1, 6):
        for width in widths:
            x = torch.randn(rows, width, generator=gen) * torch.logspace(-4, 4, max(rows, 1))[:rows, None]
            if rows > 2:
                x[2] = 0.0  # an all-zero row keeps a finite scale
                x[1, :7] = torch.tensor([448.0, -448.0, 1e-9, -0.0, 17.0, 240.0, 232.0])
            x = x.to(DEVICE, dtype)
            assert_same_quantization(kernel_quantize(x, quantizer), quantizer(x))


ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "swiglu-interleaved": mf.ActivationConfig(gate_up=mf.GateUpLayout.INTERLEAVED),
    "gpt-oss": mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    "geglu-tanh": mf.ActivationConfig(mf.ActivationKind.GEGLU, gelu_approximate="tanh"),
    "relu2": mf.ActivationConfig(mf.ActivationKind.RELU2),
}


@pytest.mark.parametrize("act_name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("name", sorted(quantizers()))
def test_activation_quantize_kernel_matches_quantizer_of_activation(act_name: str, name: str) -> None:
    act, quantizer = ACTIVATIONS[act_name], quantizers()[name]()
    gen = torch.Generator().manual_seed(12)
    width = 256
    x = (torch.randn(5, 2 * width if act.gated else width, generator=gen) * 3).to(DEVICE, torch.float16)
    dtype = quantizer.dtype.torch_dtype
    per_group = isinstance(quantizer, PerGroupQuantizer)
    q = torch.empty(5, width, dtype=dtype, device=DEVICE)
    scale = torch.empty(5, width // 128 if per_group else 1, device=DEVICE)
    quantize.quantize_rows(x, q, scale, per_group=per_group, act=act_code(act), glu=act.gated,
                           interleaved=act.gate_up is mf.GateUpLayout.INTERLEAVED, alpha=act.alpha, limit=act.limit)
    want = quantizer(apply_activation(x, act))
    assert want.scale is not None
    torch.testing.assert_close(scale, want.scale, rtol=2e-6, atol=0)  # sigmoid/erf differ in the last bit
    if dtype == torch.int8:
        assert int((q.long() - want.data.long()).abs().max()) <= 1
    else:
        assert fp8_steps_apart(q, want.data) <= 1


# -- W8A8 grouped GEMM ---------------------------------------------------------------------------------

# (activation dtype, activation scales, weight scales): every combination the kernel reads.
W8A8_CASES = {
    "fp8 token/channel": (FP8, "token", False),
    "fp8 group/block": (FP8, "group", True),
    "fp8 token/block": (FP8, "token", True),
    "fp8 group/channel": (FP8, "group", False),
    "fp8 tensor/channel": (FP8, "tensor", False),
    "int8 token/channel": (torch.int8, "token", False),
}
# The output dtype of each case in the first-GEMM test (one each keeps the interpreter run short).
W8A8_OUT = {"fp8 token/channel": torch.float16, "fp8 group/block": torch.float32, "fp8 token/block": torch.float16,
            "fp8 group/channel": torch.float32, "fp8 tensor/channel": torch.float16, "int8 token/channel": torch.float32}


def quantize_activations(x: torch.Tensor, dtype: torch.dtype, scales: str) -> Activations:
    if scales == "group":
        return PerGroupQuantizer()(x)
    if scales == "tensor":
        return PerTensorQuantizer(DType.from_torch(dtype))(x)
    return PerTokenQuantizer(DType.from_torch(dtype))(x)


@pytest.mark.parametrize("case", sorted(W8A8_CASES))
def test_w8a8_first_gemm_with_activation_bias_and_weights(case: str) -> None:
    dtype, scales, block = W8A8_CASES[case]
    out_dtype = W8A8_OUT[case]
    tokens, k, experts, hidden, inter = 7, 2, 4, 256, 80  # N = 80: masked columns, a partial block
    gen = torch.Generator().manual_seed(21)
    act = ACTIVATIONS["swiglu"]
    x = quantize_activations(torch.randn(tokens, hidden, generator=gen).to(DEVICE), dtype, scales)
    w13, w13_scale, w13_deq = quantize_weight_w8(torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE)
                                                 * hidden ** -0.5, dtype, block)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(DEVICE)
    ids = route(tokens, experts, k, gen)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, TILE.block_m)
    out = torch.full((tokens * k, inter), float("nan"), dtype=out_dtype, device=DEVICE)
    assert x.scale is not None
    w8a8_gemm(x.data, x.scale, w13, w13_scale, out, *plan, rows_per_a=k, config=TILE, bias=b13,
                             topk_weights=weights.reshape(-1), act=act_code(act), glu=True)
    ref = reference_gemm(dequantize(x), k, ids, w13_deq, b13, act, weights)
    assert rel(out, ref) < (1e-5 if out_dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("scales", ["group", "token"])
@pytest.mark.parametrize("layout", ["concatenated", "interleaved"])
@pytest.mark.parametrize("block_n", [32, 256])
def test_fp8_block_scales_one_per_tile_or_per_column(scales: str, layout: str, block_n: int) -> None:
    """Where a tile's gate rows (and its up rows) lie in one 128-row scale block, the step's weight scale is
    one load per tile (``B_TILE_SCALE``); else one per column. Both against the dequantized reference,
    gate/up concatenated and interleaved, I = 192 (up rows start mid-block when concatenated)."""
    tokens, k, experts, hidden, inter = 9, 2, 4, 256, 192
    interleaved = layout == "interleaved"
    gate_stride, up_offset = launch_plan.glu_strides(True, interleaved, inter)
    assert launch_plan.tile_in_one_scale_block(block_n, gate_stride, up_offset, True) == (block_n == 32)
    gen = torch.Generator().manual_seed(27)
    act = ACTIVATIONS["swiglu-interleaved" if interleaved else "swiglu"]
    x = quantize_activations(torch.randn(tokens, hidden, generator=gen).to(DEVICE), FP8, scales)
    w13, w13_scale, w13_deq = quantize_weight_w8(torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE)
                                                 * hidden ** -0.5 * torch.logspace(-2, 2, 2 * inter)[None, :, None]
                                                 .to(DEVICE), FP8, True)  # scale blocks 4 decades apart
    ids = route(tokens, experts, k, gen)
    config = GemmConfig(16, block_n, 128, group_m=2, num_warps=4, num_stages=2)
    plan = align.align_block_size(ids, experts, config.block_m)
    out = torch.full((tokens * k, inter), float("nan"), dtype=torch.float32, device=DEVICE)
    assert x.scale is not None
    w8a8_gemm(x.data, x.scale, w13, w13_scale, out, *plan, rows_per_a=k, config=config, act=act_code(act), glu=True,
              interleaved=interleaved)
    ref = reference_gemm(dequantize(x), k, ids, w13_deq, None, act, None)
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("case", ["fp8 group/block", "fp8 token/channel", "int8 token/channel"])
@pytest.mark.parametrize("block_k", [32, 128])
def test_w8a8_second_gemm_reads_copy_rows(case: str, block_k: int) -> None:
    dtype, scales, block = W8A8_CASES[case]
    tokens, k, experts, hidden, inter = 6, 3, 4, 72, 256  # block_k 32: four K-steps per scale group
    gen = torch.Generator().manual_seed(22)
    rows = quantize_activations(torch.randn(tokens * k, inter, generator=gen).to(DEVICE), dtype, scales)
    w2, w2_scale, w2_deq = quantize_weight_w8(torch.randn(experts, hidden, inter, generator=gen).to(DEVICE),
                                              dtype, block)
    ids = route(tokens, experts, k, gen)
    plan = align.align_block_size(ids, experts, TILE.block_m)
    out = torch.full((tokens * k, hidden), float("nan"), device=DEVICE)
    assert rows.scale is not None
    config = GemmConfig(16, 32, block_k, group_m=1, num_warps=4, num_stages=2)
    w8a8_gemm(rows.data, rows.scale, w2, w2_scale, out, *plan, rows_per_a=1, config=config)
    assert rel(out, reference_gemm(dequantize(rows), 1, ids, w2_deq)) < 1e-5


@pytest.mark.parametrize("act_name", ["swiglu", "gpt-oss"])
def test_w8a8_epilogue_quantizes_its_output_like_the_group_quantizer(act_name: str) -> None:
    """The FP8 per-128-group output of the epilogue equals PerGroupQuantizer applied to the same
    kernel's fp32 output (bit for bit here; within one fp8 step on a GPU, where two compiled kernels
    may contract the epilogue's arithmetic differently)."""
    act = ACTIVATIONS[act_name]
    tokens, k, experts, hidden, inter = 5, 2, 3, 128, 256
    gen = torch.Generator().manual_seed(23)
    x = PerGroupQuantizer()(torch.randn(tokens, hidden, generator=gen).to(DEVICE))
    w13, w13_scale, _ = quantize_weight_w8(torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE),
                                           FP8, True)
    ids = route(tokens, experts, k, gen)
    plan = align.align_block_size(ids, experts, 16)
    config = GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=2)
    flags = dict(rows_per_a=k, config=config, act=act_code(act), glu=True, interleaved=True,
                 alpha=act.alpha, limit=act.limit)
    assert x.scale is not None
    floats = torch.empty(tokens * k, inter, device=DEVICE)
    w8a8_gemm(x.data, x.scale, w13, w13_scale, floats, *plan, **flags)  # type: ignore[arg-type]
    q = torch.empty(tokens * k, inter, dtype=FP8, device=DEVICE)
    scale = torch.full((tokens * k, inter // 128), float("nan"), device=DEVICE)
    w8a8_gemm(x.data, x.scale, w13, w13_scale, q, *plan, out_scale=scale, **flags)  # type: ignore[arg-type]
    want = PerGroupQuantizer()(floats)
    assert want.scale is not None
    assert fp8_steps_apart(q, want.data) <= (1 if CUDA else 0)
    torch.testing.assert_close(scale, want.scale, rtol=0 if not CUDA else 1e-6, atol=0)


# -- W4A16 grouped GEMM --------------------------------------------------------------------------------

@pytest.mark.parametrize("group,block_k,zero_points", [
    (32, 128, True), (32, 64, False), (64, 32, True), (128, 128, False), (128, 64, True)])
def test_w4a16_first_gemm(group: int, block_k: int, zero_points: bool) -> None:
    act = ACTIVATIONS["swiglu-interleaved"] if zero_points else ACTIVATIONS["swiglu"]
    tokens, k, experts, inter = 6, 2, 4, 40
    hidden = 160 if group == 32 else 256  # 160 with block_k 64/128: a partial last K-step
    gen = torch.Generator().manual_seed(31)
    dtype = torch.float16
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    packed, scales, zeros, deq = pack_int4(torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE)
                                           * hidden ** -0.5, group, zero_points, dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(DEVICE, dtype)
    ids = route(tokens, experts, k, gen)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, 16)
    out = torch.full((tokens * k, inter), float("nan"), dtype=dtype, device=DEVICE)
    config = GemmConfig(16, 32, block_k, group_m=2, num_warps=4, num_stages=2)
    w4a16_gemm(x, packed, scales, out, *plan, rows_per_a=k, config=config, zeros=zeros, bias=b13,
                              topk_weights=weights.reshape(-1), act=act_code(act), glu=True,
                              interleaved=act.gate_up is mf.GateUpLayout.INTERLEAVED)
    ref = reference_gemm(x, k, ids, deq, b13, act, weights)
    assert rel(out, ref) < 2e-3


def test_w4a16_second_gemm_in_fp32() -> None:
    tokens, k, experts, hidden, inter = 5, 2, 3, 48, 128
    gen = torch.Generator().manual_seed(32)
    rows = torch.randn(tokens * k, inter, generator=gen).to(DEVICE)
    packed, scales, zeros, deq = pack_int4(torch.randn(experts, hidden, inter, generator=gen).to(DEVICE), 64,
                                           True, torch.float32)
    ids = route(tokens, experts, k, gen)
    plan = align.align_block_size(ids, experts, 16)
    out = torch.full((tokens * k, hidden), float("nan"), device=DEVICE)
    w4a16_gemm(rows, packed, scales, out, *plan, rows_per_a=1, config=TILE, zeros=zeros)
    assert rel(out, reference_gemm(rows, 1, ids, deq)) < 1e-5


# -- the stages in a whole triton pipeline ---------------------------------------------------------------

def build_quant_experts(
    scheme: WeightFormat, experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator,
    *, block: bool = False, group: int = 64, zero_points: bool = False, bias: bool = False,
    device: str = DEVICE,
) -> dict[str, Optional[torch.Tensor]]:
    """Quantized expert tensors in the agreed layouts plus their dequantized float64 values."""
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(device) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen).to(device) * inter ** -0.5
    found: dict[str, Optional[torch.Tensor]] = {}
    for name, w in (("w13", w13), ("w2", w2)):
        if scheme is WeightFormat.INT4:
            q, s, z, deq = pack_int4(w, group, zero_points, dtype)
            found.update({name: q, f"{name}_scale": s, f"{name}_zero": z, f"{name}_deq": deq})
        else:
            q, s, deq = quantize_weight_w8(w, scheme.storage_dtype, block)
            found.update({name: q, f"{name}_scale": s, f"{name}_zero": None, f"{name}_deq": deq})
    found["w13_bias"] = torch.randn(experts, 2 * inter, generator=gen).to(device, dtype) if bias else None
    found["w2_bias"] = torch.randn(experts, hidden, generator=gen).to(device, dtype) if bias else None
    return found


def quant_pipeline(
    scheme: WeightFormat, tensors: dict[str, Optional[torch.Tensor]], experts: int, k: int, hidden: int,
    dtype: torch.dtype, act: mf.ActivationConfig, quantizer: Optional[mf.stages.Quantizer], *,
    quantize_before_dispatch: bool = False, weights_in_epilogue: bool = False, mid_quantizer_fused: bool = True,
    debug: bool = True,
) -> mf.Pipeline:  # type: ignore[type-arg]
    """TopK -> [quantize] -> dispatch -> [quantize] -> gate/up GEMM (+act, +quantize) -> down GEMM
    -> combine, the way a quant method's ``expert_stages(backend=TRITON)`` builds it."""
    table = ConfigTable(experts, k)
    where = mf.RoutingWeights.IN_GEMM_EPILOGUE if weights_in_epilogue else mf.RoutingWeights.IN_COMBINE
    stages: list[mf.Stage] = [TritonTopK(experts, k, mf.RoutingConfig(apply_weights=where))]  # type: ignore[type-arg]
    if quantizer is not None and quantize_before_dispatch:
        stages += [TritonQuantizeTokens(quantizer), AlignDispatch(experts, table)]
    else:
        stages.append(AlignDispatch(experts, table))
        if quantizer is not None:
            stages.append(QuantizeAligned(quantizer))
    out = DType.from_torch(dtype)
    t = tensors
    assert t["w13"] is not None and t["w13_scale"] is not None and t["w2"] is not None and t["w2_scale"] is not None
    if mid_quantizer_fused or quantizer is None:
        stages.append(FusedQuantGroupedGemm(mf.GemmRole.GATE_UP, scheme, t["w13"], t["w13_scale"], table,
                                            t["w13_zero"], t["w13_bias"], act, out_dtype=out,
                                            output_quantizer=quantizer))
    else:
        stages += [FusedQuantGroupedGemm(mf.GemmRole.GATE_UP, scheme, t["w13"], t["w13_scale"], table,
                                         bias=t["w13_bias"], out_dtype=out),
                   ActivateQuantizeAligned(act, quantizer)]
    stages += [
        FusedQuantGroupedGemm(mf.GemmRole.DOWN, scheme, t["w2"], t["w2_scale"], table, t["w2_zero"], t["w2_bias"],
                              apply_routing_weights=weights_in_epilogue, out_dtype=out),
        Combine(apply_routing_weights=not weights_in_epilogue),
    ]
    return mf.Pipeline(stages, mf.input_spec(hidden, dtype, experts), debug=debug)


def reference_moe(x: torch.Tensor, logits: torch.Tensor, k: int, tensors: dict[str, Optional[torch.Tensor]],
                  act: mf.ActivationConfig, quantizer: Optional[mf.stages.Quantizer]) -> torch.Tensor:
    """float64: the torch quantizer on the input and on the activated rows (from fp32), the
    dequantized weights, the routing of ``select_experts``."""
    topk = mf.stages.select_experts(logits, k, mf.RoutingConfig())
    xq = dequantize(quantizer(x)) if quantizer is not None else x
    w13, w2 = tensors["w13_deq"], tensors["w2_deq"]
    assert w13 is not None and w2 is not None
    hidden = reference_gemm(xq, k, topk.ids, w13, tensors["w13_bias"], act)
    if quantizer is not None:
        hidden = dequantize(quantizer(hidden.float()))
    out = reference_gemm(hidden, 1, topk.ids, w2, tensors["w2_bias"], None, topk.weights)
    return out.view(x.shape[0], k, -1).sum(1)


PIPELINES = {
    # name: (scheme, activation dtype, quantizer, weight blocks, quantize before dispatch, fused mid quantization)
    "fp8 group/block": (WeightFormat.FP8, torch.float16, PerGroupQuantizer(), True, False, True),
    "fp8 token/channel, before dispatch": (WeightFormat.FP8, torch.float32, PerTokenQuantizer(), False, True, True),
    "fp8 group, activate-quantize stage": (WeightFormat.FP8, torch.float16, PerGroupQuantizer(), True, True,
                                           False),
    "int8 token/channel": (WeightFormat.INT8, torch.float16, PerTokenQuantizer(DType.INT8), False, False, True),
    "w4a16": (WeightFormat.INT4, torch.float16, None, False, False, True),
}


@pytest.mark.parametrize("name,tokens", [(name, 9) for name in sorted(PIPELINES)] + [
    ("fp8 group/block", 0), ("fp8 group/block", 1), ("int8 token/channel", 0), ("w4a16", 1)])
def test_quantized_triton_pipeline_matches_the_dequantized_reference(name: str, tokens: int) -> None:
    """Tolerance 1e-2 (measured up to 3e-3): besides the float rounding, an fp8 / int8 value of the intermediate rows that
    lies on a rounding boundary may round the other way in the kernel (its activation arithmetic
    and its rounding of gate/up differ slightly from the reference's): one quantization step on a
    few elements."""
    scheme, dtype, quantizer, block, before, fused = PIPELINES[name]
    experts, k, hidden, inter = 4, 2, 128, 128
    gen = torch.Generator().manual_seed(41)
    act = ACTIVATIONS["swiglu"]
    tensors = build_quant_experts(scheme, experts, hidden, inter, dtype, gen, block=block, zero_points=True,
                                  bias=scheme is WeightFormat.INT8)
    pipeline = quant_pipeline(scheme, tensors, experts, k, hidden, dtype, act, quantizer,
                              quantize_before_dispatch=before, mid_quantizer_fused=fused)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    if tokens:
        ref = reference_moe(x, logits, k, tensors, act, quantizer)
        assert rel(out, ref) < (1e-2 if quantizer is not None else 3e-3)


def test_quantized_pipeline_with_every_token_on_one_expert_and_weights_in_epilogue() -> None:
    """Three of four experts get no token; the routing weights are applied by the down GEMM."""
    experts, k, hidden, inter, tokens = 4, 1, 128, 128, 20
    gen = torch.Generator().manual_seed(42)
    act = ACTIVATIONS["swiglu"]
    tensors = build_quant_experts(WeightFormat.FP8, experts, hidden, inter, torch.float16, gen, block=True)
    pipeline = quant_pipeline(WeightFormat.FP8, tensors, experts, k, hidden, torch.float16, act,
                              PerGroupQuantizer(), weights_in_epilogue=True)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.float16)
    logits = torch.full((tokens, experts), -4.0, device=DEVICE)
    logits[:, 2] = 4.0
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert rel(out, reference_moe(x, logits, k, tensors, act, PerGroupQuantizer())) < 1e-2


def test_quantized_pipeline_with_top_k_equal_to_experts() -> None:
    experts = k = 3
    hidden, inter, tokens = 128, 128, 4
    gen = torch.Generator().manual_seed(43)
    act = ACTIVATIONS["swiglu"]
    tensors = build_quant_experts(WeightFormat.INT8, experts, hidden, inter, torch.float32, gen)
    quantizer = PerTokenQuantizer(DType.INT8)
    pipeline = quant_pipeline(WeightFormat.INT8, tensors, experts, k, hidden, torch.float32, act, quantizer,
                              quantize_before_dispatch=True)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert rel(out, reference_moe(x, logits, k, tensors, act, quantizer)) < 1e-2


# -- contracts and arguments -------------------------------------------------------------------------------

def _fp8_tensors(experts: int = 4, hidden: int = 128, inter: int = 128) -> dict[str, Optional[torch.Tensor]]:
    return build_quant_experts(WeightFormat.FP8, experts, hidden, inter, torch.float16,
                               torch.Generator().manual_seed(0), block=True)


def test_fp8_gemm_rejects_float_rows_at_build_time() -> None:
    t = _fp8_tensors()
    table = ConfigTable(4, 2)
    assert t["w13"] is not None and t["w13_scale"] is not None
    gemm = FusedQuantGroupedGemm(mf.GemmRole.GATE_UP, WeightFormat.FP8, t["w13"], t["w13_scale"], table,
                                 activation=mf.ActivationConfig(), out_dtype=DType.FP16)
    with pytest.raises(mf.ContractError, match="dtype") as error:
        mf.Pipeline([TritonTopK(4, 2), AlignDispatch(4, table), gemm], mf.input_spec(128, torch.float16, 4))
    assert "QuantizeAligned" in str(error.value)


def test_align_dispatch_passes_quantized_tokens_and_the_bf16_gemm_refuses_them() -> None:
    table = ConfigTable(4, 2)
    spec = mf.input_spec(128, torch.float16, 4)
    pipeline = mf.Pipeline([TritonTopK(4, 2), TritonQuantizeTokens(PerGroupQuantizer()), AlignDispatch(4, table)], spec)
    assert pipeline.specs[-1].dtype is DType.FP8_E4M3 and pipeline.specs[-1].scale_layout is mf.ScaleLayout.PER_GROUP_128
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.randn(4, 64, 128, dtype=torch.float16))
    bf16_gemm = mf.FusedGroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(holder, "w"), table, None, mf.ActivationConfig())
    with pytest.raises(mf.ContractError, match="dtype"):
        mf.Pipeline(list(pipeline.stages) + [bf16_gemm], spec)


def test_down_gemm_rejects_rows_with_the_wrong_scale_layout() -> None:
    t = _fp8_tensors()
    table = ConfigTable(4, 2)
    assert t["w13"] is not None and t["w13_scale"] is not None and t["w2"] is not None and t["w2_scale"] is not None
    with pytest.raises(mf.ContractError, match="dtype"):  # int8 rows into an fp8 GEMM
        mf.Pipeline([TritonTopK(4, 2), AlignDispatch(4, table), QuantizeAligned(PerTokenQuantizer(DType.INT8)),
                     FusedQuantGroupedGemm(mf.GemmRole.GATE_UP, WeightFormat.FP8, t["w13"], t["w13_scale"],
                                           table, activation=mf.ActivationConfig(), out_dtype=DType.FP16)],
                    mf.input_spec(128, torch.float16, 4))


@pytest.mark.parametrize("change,match", [
    (dict(weight_scale=torch.ones(4, 2, 2)), "weight_scale"),
    (dict(out_dtype=DType.FP8_E4M3), "out_dtype"),
    (dict(output_quantizer=PerGroupQuantizer(), activation=None), "fused activation"),
    (dict(output_quantizer=PerTensorQuantizer()), "PerTokenQuantizer"),
    (dict(weight=torch.zeros(4, 256, 128, dtype=torch.int8)), "float8"),
    (dict(bias=torch.zeros(4, 7)), "bias"),
    (dict(weight_zero=torch.zeros(4, 256, 1, dtype=torch.uint8)), "W4A16"),
])
def test_bad_gemm_arguments_are_input_errors(change: dict[str, object], match: str) -> None:
    t = _fp8_tensors()
    args: dict[str, object] = dict(role=mf.GemmRole.GATE_UP, weight_format=WeightFormat.FP8, weight=t["w13"],
                                   weight_scale=t["w13_scale"], configs=ConfigTable(4, 2),
                                   activation=mf.ActivationConfig(), out_dtype=DType.FP16)
    args.update(change)
    with pytest.raises(mf.InputError, match=match):
        FusedQuantGroupedGemm(**args)  # type: ignore[arg-type]


def test_w4a16_group_size_must_be_a_power_of_two() -> None:
    packed = torch.zeros(2, 8, 48, dtype=torch.uint8)
    with pytest.raises(mf.InputError, match="group size"):
        FusedQuantGroupedGemm(mf.GemmRole.DOWN, WeightFormat.INT4, packed, torch.ones(2, 8, 2, dtype=torch.float16),
                              ConfigTable(2, 1), out_dtype=DType.FP16)  # K = 96, G = 48


def test_stage_kinds_and_description() -> None:
    t = _fp8_tensors()
    assert t["w13"] is not None and t["w13_scale"] is not None
    gemm = FusedQuantGroupedGemm(mf.GemmRole.GATE_UP, WeightFormat.FP8, t["w13"], t["w13_scale"],
                                 ConfigTable(4, 2), activation=mf.ActivationConfig(), out_dtype=DType.FP16,
                                 output_quantizer=PerGroupQuantizer())
    assert gemm.kinds == (mf.StageKind.GEMM, mf.StageKind.ACTIVATION, mf.StageKind.QUANTIZE)
    assert "block scales" in gemm.summary() and "fp8_e4m3/per_group_128" in gemm.summary()
    with pytest.raises(mf.InputError, match="PerTokenQuantizer"):
        QuantizeAligned(PerTensorQuantizer())
    assert TritonQuantizeTokens.supports(PerGroupQuantizer()) and TritonQuantizeTokens.supports(PerTokenQuantizer())
    assert not TritonQuantizeTokens.supports(PerTensorQuantizer())
    assert not TritonQuantizeTokens.supports(mf.stages.Cast(DType.BF16))


def test_custom_ops_have_fake_implementations() -> None:
    """Shapes and dtypes from the fake (meta) kernels equal the real ones: torch.compile and CUDA
    graphs rely on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = _fp8_tensors(experts=2, hidden=128, inter=128)
    gen = torch.Generator().manual_seed(5)
    x = PerGroupQuantizer()(torch.randn(3, 128, generator=gen).to(DEVICE))
    ids = route(3, 2, 2, gen)
    plan = align.align_block_size(ids, 2, 16)
    ops = torch.ops.moeforge
    assert x.scale is not None
    args = (x.data, x.scale, t["w13"], t["w13_scale"], None, None, None, None, *plan, 6, 2, int(WeightFormat.FP8),
            1.0, 1, True, False, 1.0, 0.0, encode_config(GemmConfig(16, 128, 128, 1, 4, 2)))
    calls = {
        "gemm": lambda *a: ops.moe_gemm(*a, torch.float16, False),
        "fp8_out": lambda *a: ops.moe_gemm(*a, torch.float16, True),
        "quantize": lambda *a: ops.quantize_rows(a[0].float(), FP8, True, 0, False, False, 1.0, 0.0),
    }
    for name, call in calls.items():
        real = call(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fake = call(*fake_args)
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (r.shape, r.dtype) == (f.shape, f.dtype), name
