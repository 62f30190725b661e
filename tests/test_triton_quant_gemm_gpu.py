"""The quantized Triton kernels at realistic shapes on a GPU (skipped without CUDA).

The same float64 dequantize-then-matmul reference as ``tests/test_triton_quant_gemm.py`` (whose
helpers this file reuses), on random data with E = 8 experts, H = 1024..4096, I = 512..1536,
1..2048 tokens, top-k 2..8, bf16 activations and outputs.

Tolerances (relative Frobenius error): GEMMs with a bf16 output 1e-2 — the output rounding is
2^-9 relative per element, and Hopper's FP8 tensor cores accumulate a K-step with a reduced-precision
adder (per-token/per-channel scales keep it across K; group/block scales promote to fp32 every 128);
W4A16 also rounds each dequantized weight to bf16 once. Whole pipelines 2e-2: the intermediate rows
are quantized again (one fp8/int8 step on elements at a rounding boundary may differ from the
reference). Quantized activations: the kernels' scales are the IEEE quotients ``amax / qmax``, torch's
on CUDA ``amax * (1 / qmax)`` (one fp32 ulp apart at times): scales within 1 ulp, data within one
fp8/int8 step on at most 1e-4 of the elements (bit-identical in the CPU tests, where torch divides).

``python tests/test_triton_quant_gemm_gpu.py`` prints a small timing table (:func:`time_quant_experts`).
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
from moeforge.kernels import align  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, default_config  # noqa: E402
from moeforge.spec import DType  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK, act_code  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.stages.triton_quant import default_quant_config  # noqa: E402
from moeforge.stages.quantize import PerGroupQuantizer, PerTokenQuantizer, dequantize  # noqa: E402
from test_triton_quant_gemm import (  # noqa: E402
    ACTIVATIONS,
    W8A8_CASES,
    assert_same_quantization,
    build_quant_experts,
    fp8_steps_apart,
    kernel_quantize,
    pack_int4,
    quant_pipeline,
    quantize_activations,
    quantize_weight_w8,
    w4a16_gemm,
    w8a8_gemm,
    quantizers,
    reference_gemm,
    reference_moe,
    rel,
    route,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"
BF16 = torch.bfloat16
GEMM_TOL = 1e-2
PIPELINE_TOL = 2e-2
# (tokens, experts, top_k, hidden, intermediate)
SHAPES = [(1, 8, 2, 4096, 1536), (333, 8, 8, 2048, 768), (2048, 8, 4, 1024, 512)]
PIPELINE_SHAPE = (8, 2048, 768)  # experts, hidden, intermediate
EDGE_SHAPE = (8, 1024, 512, 1000)  # experts, hidden, intermediate, tokens


def _plan(ids: torch.Tensor, experts: int, tokens: int, k: int) -> tuple[int, tuple[torch.Tensor, ...]]:
    block_m = default_config(tokens, experts, k).block_m
    return block_m, align.align_block_size(ids, experts, block_m)


# -- activation quantization -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(quantizers()))
@pytest.mark.parametrize("rows,width", [(1, 7168), (333, 2048), (4096, 1536), (17, 4224)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_quantize_kernels_are_bit_identical_at_scale(name: str, rows: int, width: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    quantizer = quantizers()[name]()
    x = (torch.randn(rows, width, device=DEVICE) * torch.logspace(-3, 3, rows, device=DEVICE)[:, None]).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 448.0, -1e-8])
    assert_same_quantization(kernel_quantize(x, quantizer), quantizer(x))


# -- the GEMMs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(W8A8_CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
def test_w8a8_gemms_at_scale(case: str, shape: tuple[int, int, int, int, int]) -> None:
    dtype, scales, block = W8A8_CASES[case]
    tokens, experts, k, hidden, inter = shape
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    act = ACTIVATIONS["swiglu"]
    x = quantize_activations(torch.randn(tokens, hidden, device=DEVICE), dtype, scales)
    w13, s13, w13_deq = quantize_weight_w8(torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden ** -0.5,
                                           dtype, block)
    w2, s2, w2_deq = quantize_weight_w8(torch.randn(experts, hidden, inter, device=DEVICE) * inter ** -0.5, dtype, block)
    b13 = torch.randn(experts, 2 * inter, device=DEVICE, dtype=BF16)
    ids = route(tokens, experts, k, gen, DEVICE)
    weights = torch.rand(tokens, k, device=DEVICE)
    block_m, plan = _plan(ids, experts, tokens, k)
    scheme = WeightFormat.FP8 if dtype == torch.float8_e4m3fn else WeightFormat.INT8
    config = default_quant_config(scheme, block_m)
    assert x.scale is not None
    hidden_rows = torch.full((tokens * k, inter), float("nan"), device=DEVICE, dtype=BF16)
    w8a8_gemm(x.data, x.scale, w13, s13, hidden_rows, *plan, rows_per_a=k, config=config, bias=b13,
                             topk_weights=weights.reshape(-1), act=act_code(act), glu=True)
    assert rel(hidden_rows, reference_gemm(dequantize(x), k, ids, w13_deq, b13, act, weights)) < GEMM_TOL
    rows = quantize_activations(torch.randn(tokens * k, inter, device=DEVICE), dtype, scales)
    assert rows.scale is not None
    out = torch.full((tokens * k, hidden), float("nan"), device=DEVICE, dtype=BF16)
    w8a8_gemm(rows.data, rows.scale, w2, s2, out, *plan, rows_per_a=1, config=config)
    assert rel(out, reference_gemm(dequantize(rows), 1, ids, w2_deq)) < GEMM_TOL


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
def test_w4a16_gemms_at_scale(group: int, zero_points: bool, shape: tuple[int, int, int, int, int]) -> None:
    tokens, experts, k, hidden, inter = shape
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    act = ACTIVATIONS["swiglu-interleaved"]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=BF16)
    w13, s13, z13, w13_deq = pack_int4(torch.randn(experts, 2 * inter, hidden, device=DEVICE), group, zero_points, BF16)
    w2, s2, z2, w2_deq = pack_int4(torch.randn(experts, hidden, inter, device=DEVICE), group, zero_points, BF16)
    ids = route(tokens, experts, k, gen, DEVICE)
    weights = torch.rand(tokens, k, device=DEVICE)
    block_m, plan = _plan(ids, experts, tokens, k)
    config = default_quant_config(WeightFormat.INT4, block_m)
    hidden_rows = torch.full((tokens * k, inter), float("nan"), device=DEVICE, dtype=BF16)
    w4a16_gemm(x, w13, s13, hidden_rows, *plan, rows_per_a=k, config=config, zeros=z13,
                              topk_weights=weights.reshape(-1), act=act_code(act), glu=True, interleaved=True)
    assert rel(hidden_rows, reference_gemm(x, k, ids, w13_deq, None, act, weights)) < GEMM_TOL
    rows = torch.randn(tokens * k, inter, device=DEVICE, dtype=BF16)
    out = torch.full((tokens * k, hidden), float("nan"), device=DEVICE, dtype=BF16)
    w4a16_gemm(rows, w2, s2, out, *plan, rows_per_a=1, config=config, zeros=z2)
    assert rel(out, reference_gemm(rows, 1, ids, w2_deq)) < GEMM_TOL


@pytest.mark.parametrize("block_n", [128, 256])
def test_fp8_epilogue_quantization_at_scale(block_n: int) -> None:
    """Within one fp8 step of PerGroupQuantizer applied to the same kernel's fp32 output."""
    tokens, experts, k, hidden, inter = 512, 8, 4, 2048, 1536
    torch.manual_seed(2)
    x = PerGroupQuantizer()(torch.randn(tokens, hidden, device=DEVICE))
    w13, s13, _ = quantize_weight_w8(torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden ** -0.5,
                                     torch.float8_e4m3fn, True)
    ids = route(tokens, experts, k, torch.Generator().manual_seed(2), DEVICE)
    plan = align.align_block_size(ids, experts, 64)
    config = GemmConfig(64, block_n, 128, group_m=8, num_warps=4 if block_n == 128 else 8, num_stages=3)
    assert x.scale is not None
    floats = torch.empty(tokens * k, inter, device=DEVICE)
    w8a8_gemm(x.data, x.scale, w13, s13, floats, *plan, rows_per_a=k, config=config, act=1, glu=True)
    q = torch.empty(tokens * k, inter, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.full((tokens * k, inter // 128), float("nan"), device=DEVICE)
    w8a8_gemm(x.data, x.scale, w13, s13, q, *plan, rows_per_a=k, config=config, act=1, glu=True,
                             out_scale=scale)
    want = PerGroupQuantizer()(floats)
    assert want.scale is not None
    assert fp8_steps_apart(q, want.data) <= 1
    torch.testing.assert_close(scale, want.scale, rtol=1e-6, atol=0)


# -- whole pipelines ---------------------------------------------------------------------------------------

GPU_PIPELINES = {
    "fp8 group/block": (WeightFormat.FP8, PerGroupQuantizer(), True, False, True),
    "fp8 token/channel, before dispatch": (WeightFormat.FP8, PerTokenQuantizer(), False, True, True),
    "fp8 group, activate-quantize stage": (WeightFormat.FP8, PerGroupQuantizer(), True, True, False),
    "int8 token/channel": (WeightFormat.INT8, PerTokenQuantizer(DType.INT8), False, False, True),
    "w4a16": (WeightFormat.INT4, None, False, False, True),
}


def _pipeline_case(name: str, experts: int, k: int, hidden: int, inter: int, debug: bool = True
                   ) -> tuple[mf.Pipeline, dict[str, Optional[torch.Tensor]], Optional[mf.stages.Quantizer]]:  # type: ignore[type-arg]
    scheme, quantizer, block, before, fused = GPU_PIPELINES[name]
    tensors = build_quant_experts(scheme, experts, hidden, inter, BF16, torch.Generator().manual_seed(3),
                                  block=block, group=128, zero_points=True, bias=True, device=DEVICE)
    pipeline = quant_pipeline(scheme, tensors, experts, k, hidden, BF16, ACTIVATIONS["swiglu"], quantizer,
                              quantize_before_dispatch=before, mid_quantizer_fused=fused, debug=debug)
    return pipeline, tensors, quantizer


@pytest.mark.parametrize("name", sorted(GPU_PIPELINES))
@pytest.mark.parametrize("tokens,k", [(0, 2), (1, 8), (64, 2), (2048, 8)])
def test_quantized_pipelines_at_scale(name: str, tokens: int, k: int) -> None:
    experts, hidden, inter = PIPELINE_SHAPE
    pipeline, tensors, quantizer = _pipeline_case(name, experts, k, hidden, inter)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=BF16)
    logits = torch.randn(tokens, experts, device=DEVICE)
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert out.shape == x.shape and out.dtype == BF16
    if tokens:
        assert rel(out, reference_moe(x, logits, k, tensors, ACTIVATIONS["swiglu"], quantizer)) < PIPELINE_TOL


@pytest.mark.parametrize("name", ["fp8 group/block", "int8 token/channel", "w4a16"])
@pytest.mark.parametrize("chosen", [(3,), (0, 5)], ids=["all-on-one-expert", "six-experts-empty"])
def test_quantized_pipelines_with_empty_experts(name: str, chosen: tuple[int, ...]) -> None:
    experts, hidden, inter, tokens = EDGE_SHAPE
    k = len(chosen)
    pipeline, tensors, quantizer = _pipeline_case(name, experts, k, hidden, inter)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=BF16)
    logits = torch.full((tokens, experts), -5.0, device=DEVICE)
    logits[:, list(chosen)] = torch.randn(tokens, k, device=DEVICE) + 5.0
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert rel(out, reference_moe(x, logits, k, tensors, ACTIVATIONS["swiglu"], quantizer)) < PIPELINE_TOL


@pytest.mark.parametrize("name", ["fp8 group/block", "w4a16"])
def test_quantized_pipeline_cuda_graph_and_compile(name: str) -> None:
    pipeline, _, _ = _pipeline_case(name, 8, 2, 1024, 512, debug=False)
    x = torch.randn(48, 1024, device=DEVICE, dtype=BF16)
    logits = torch.randn(48, 8, device=DEVICE)

    def run() -> torch.Tensor:
        return pipeline(mf.MoEInput(x, logits)).hidden_states

    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run()) and not torch.equal(out, eager)
    torch.testing.assert_close(torch.compile(run, fullgraph=True)(), run(), rtol=0, atol=0)


# -- timing (not a test) -------------------------------------------------------------------------------------

def time_quant_experts(
    scheme: WeightFormat = WeightFormat.FP8, tokens: int = 64, experts: int = 8, top_k: int = 2,
    hidden: int = 4096, inter: int = 1536, *, block: bool = True, group: int = 128, iters: int = 50,
) -> dict[str, float]:
    """Microseconds per forward of the quantized triton pipeline (routing, plan, quantization, both
    GEMMs, combine) and of the bf16 pipeline of the same shape, as CUDA-graph replays (warm L2: a
    lower bound at small batches), plus the weight bytes each reads per call."""
    gen = torch.Generator().manual_seed(0)
    quantizer: Optional[mf.stages.Quantizer]
    if scheme is WeightFormat.INT4:
        quantizer = None
    elif scheme is WeightFormat.INT8:
        quantizer = PerTokenQuantizer(DType.INT8)
    else:
        quantizer = PerGroupQuantizer() if block else PerTokenQuantizer()
    tensors = build_quant_experts(scheme, experts, hidden, inter, BF16, gen, block=block, group=group,
                                  device=DEVICE)
    quant = quant_pipeline(scheme, tensors, experts, top_k, hidden, BF16, ACTIVATIONS["swiglu"], quantizer,
                           debug=False)
    table = ConfigTable(experts, top_k)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden ** -0.5).to(BF16)
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * inter ** -0.5).to(BF16)
    dense = mf.Pipeline([TritonTopK(experts, top_k), AlignDispatch(experts, table),
                         FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=ACTIVATIONS["swiglu"]),
                         FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()],
                        mf.input_spec(hidden, BF16, experts))
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=BF16)
    logits = torch.randn(tokens, experts, device=DEVICE)
    result: dict[str, float] = {}
    for label, pipeline in (("quantized_us", quant), ("bf16_us", dense)):
        def call(p: mf.Pipeline = pipeline) -> None:  # type: ignore[type-arg]
            p(mf.MoEInput(x, logits))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        result[label] = start.elapsed_time(end) * 1000 / iters
    used = min(experts, tokens * top_k)
    bits = 4 if scheme is WeightFormat.INT4 else 8
    result["quantized_weight_mb"] = used * 3 * hidden * inter * bits / 8 / 1e6
    result["bf16_weight_mb"] = used * 3 * hidden * inter * 2 / 1e6
    return result


if __name__ == "__main__":
    print(f"{'scheme':10} {'tokens':>6} {'quantized us':>13} {'bf16 us':>9} {'speed-up':>8}")
    for scheme in (WeightFormat.FP8, WeightFormat.INT8, WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4):
        for tokens in (1, 16, 256, 2048):
            r = time_quant_experts(scheme, tokens)
            print(f"{scheme.label:10} {tokens:6d} {r['quantized_us']:13.1f} {r['bf16_us']:9.1f} "
                  f"{r['bf16_us'] / r['quantized_us']:8.2f}")
