"""Hypothesis over the one grouped GEMM (``moeforge.kernels.moe_gemm``): every weight format with random
sizes (K and N not multiples of the tile), routing (empty experts, repeated experts across tokens, zero
tokens), launch tiles (on rows aligned by their block or by a multiple of it), scale layouts, activations,
bias and routing-weight epilogue, against the float64 product of the dequantized operands. Under Triton's interpreter on CPU (fp16 / fp32 rows), on a GPU
compiled. Outputs are poisoned with NaN: every element is proven written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import attrs
import pytest
import torch

pytest.importorskip("triton")
hypothesis = pytest.importorskip("hypothesis")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.quant.fp4 import dequantize_mxfp4, dequantize_nvfp4, nvfp4_global_scale, quantize_mxfp4, quantize_nvfp4  # noqa: E402
from moeforge.stages.quantize import dequantize  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import (  # noqa: E402
    ACTIVATIONS,
    pack_int4,
    quantize_activations,
    quantize_weight_w8,
    reference_gemm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["float", "fp8", "int8", "int4", "mxfp4", "nvfp4", "nvfp4-rows"]


def _operands(fmt: str, rows: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, draw: Any
              ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(kernel arguments, rows as float64 values, weight as float64 values)``."""
    if fmt == "float":
        return dict(a=rows.to(dtype), weight=w.to(dtype)), rows.to(dtype).double(), w.to(dtype).double()
    if fmt in ("fp8", "int8"):
        qdtype = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
        grouped = fmt == "fp8" and rows.shape[1] % 128 == 0  # per-128-group rows need whole groups
        scales = draw(st.sampled_from(["token", "group", "tensor"] if grouped else ["token", "tensor"]))
        x = quantize_activations(rows, qdtype, scales)
        q, s, deq = quantize_weight_w8(w, qdtype, draw(st.booleans()) if fmt == "fp8" else False)
        fmt_enum = WeightFormat.FP8 if fmt == "fp8" else WeightFormat.INT8
        return (dict(a=x.data, a_scale=x.scale, weight=q, weight_scale=s, weight_format=fmt_enum),
                dequantize(x).double(), deq)
    if fmt == "int4":
        group = draw(st.sampled_from([g for g in (16, 32, 64) if w.shape[2] % g == 0]))
        packed, s, z, deq = pack_int4(w, group, draw(st.booleans()), dtype)
        return (dict(a=rows.to(dtype), weight=packed, weight_scale=s, weight_zero=z, weight_format=WeightFormat.INT4),
                rows.to(dtype).double(), deq)
    if fmt == "mxfp4":
        q = quantize_mxfp4(w)
        deq = dequantize_mxfp4(q.data, q.scale).double()
        return (dict(a=rows.to(dtype), weight=q.data.reshape(w.shape[0], w.shape[1], -1), weight_scale=q.scale,
                     weight_format=WeightFormat.MXFP4), rows.to(dtype).double(), deq)
    q = quantize_nvfp4(w, nvfp4_global_scale(w, leading_dims=1))
    deq = dequantize_nvfp4(q.data, q.scale, q.global_scale).double()
    args: dict[str, Any] = dict(weight=q.data, weight_scale=q.scale, weight_global=q.global_scale,
                                weight_format=WeightFormat.NVFP4)
    if fmt == "nvfp4":
        return dict(a=rows.to(dtype), **args), rows.to(dtype).double(), deq
    a_global = max(float(rows.abs().amax()) if rows.numel() else 0.0, 1e-3) / (6 * 448)
    qa = quantize_nvfp4(rows, a_global)
    return (dict(a=qa.data, a_scale=qa.scale, a_global=a_global, **args),
            dequantize_nvfp4(qa.data, qa.scale, a_global).double(), deq)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_format_against_the_dequantized_product(data: Any) -> None:
    draw = data.draw
    fmt = draw(st.sampled_from(FORMATS), label="format")
    dtype = draw(st.sampled_from([torch.float16, torch.float32]), label="dtype")
    experts = draw(st.integers(1, 5), label="experts")
    top_k = draw(st.integers(1, experts), label="top_k")
    tokens = draw(st.integers(0, 9), label="tokens")
    step = 32 if fmt in ("mxfp4", "int4") else 16
    if fmt in ("fp8", "int8"):
        step = 128 if draw(st.booleans()) else 16  # whole 128-groups, or one partial group
    k_dim = step * draw(st.integers(1, 5 if step < 128 else 2), label="K / step")
    first = draw(st.booleans(), label="gate/up GEMM (else down)")
    act = ACTIVATIONS[draw(st.sampled_from(sorted(ACTIVATIONS)), label="activation")] if first else None
    n_out = draw(st.integers(1, 40), label="N")
    n_w = 2 * n_out if act is not None and act.gated else n_out
    block_m = draw(st.sampled_from([16, 32]), label="block_m")
    config = GemmConfig(block_m, draw(st.sampled_from([16, 32, 64]), label="block_n"),
                        draw(st.sampled_from([32, 64, 128]), label="block_k"), draw(st.sampled_from([1, 4])), 4, 2)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16), label="seed"))
    rows_per_a = top_k if first else 1
    rows = torch.randn(tokens * (1 if first else top_k), k_dim, generator=gen)
    w = torch.randn(experts, n_w, k_dim, generator=gen) * k_dim ** -0.5
    kwargs, rows_deq, w_deq = _operands(fmt, rows, w, dtype, draw)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32) \
        if tokens else torch.empty(0, top_k, dtype=torch.int32)
    # rows aligned by the tile's block_m, or by a multiple of it (the other GEMM's larger block: MoEConfig)
    aligned = block_m * draw(st.sampled_from([1, 1, 2, 4]), label="alignment block / block_m")
    plan = align.align_block_size(ids.to(DEVICE), experts, aligned)
    bias = torch.randn(experts, n_w, generator=gen).to(DEVICE, dtype) if draw(st.booleans(), label="bias") else None
    weights = torch.rand(tokens * top_k, generator=gen).to(DEVICE) if draw(st.booleans(), label="weights") else None
    out_dtype = dtype
    out = torch.full((tokens * top_k, n_out), float("nan"), dtype=out_dtype, device=DEVICE)
    moved = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    a = moved.pop("a")
    weight = moved.pop("weight")
    swap: Optional[bool] = draw(st.sampled_from([None, False, True]), label="swap")
    if draw(st.booleans(), label="swap in the configuration"):  # as a tuned table entry gives it
        config, swap = attrs.evolve(config, swap=bool(swap)), None
    # every grid (a persistent or flattened one runs unsplit K-loops)
    grid: Optional[str] = draw(st.sampled_from([None, "tiles", "persistent", "flattened"]), label="grid")
    glu = act is not None and act.gated
    interleaved = act is not None and act.gate_up is mf.GateUpLayout.INTERLEAVED
    # the weight tiles by TMA descriptor where they can be (a request that cannot be met is refused)
    tma = draw(st.booleans(), label="tma") and launch_plan.weight_tma_applies(weight, config, glu, interleaved)
    moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=rows_per_a, config=config, bias=bias, topk_weights=weights,
                      act=act_code(act) if act is not None else 0, glu=glu, interleaved=interleaved,
                      alpha=act.alpha if act is not None else 1.702, limit=act.limit if act is not None else 7.0,
                      swap=swap, tma=tma or None, grid=grid, split_k=1 if grid in ("persistent", "flattened") else None,
                      aligned_block_m=aligned, **moved)
    if tokens == 0:
        return
    ref = reference_gemm(rows_deq.to(DEVICE), rows_per_a, ids.to(DEVICE), w_deq.to(DEVICE), bias, act, weights)
    assert not torch.isnan(out.float()).any(), "an output element was not written"
    err = float((out.double() - ref).norm() / ref.norm().clamp(min=1e-12))
    # fp32: the operands' products are exact or rounded once (4-bit to the compute dtype); fp16 rounds the
    # rows (and a dequantized weight) once and the output once.
    assert err < (2e-5 if dtype == torch.float32 else 4e-3), (fmt, err)
