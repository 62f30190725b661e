"""The weight tiles copied by the tensor memory accelerator (``moe_gemm(..., tma=True)``, a descriptor
over the weight viewed as ``[E * N_w, K]`` rows) against the pointer loads, in every weight format.

Both read the same values and run the same K-loop, so the outputs are bitwise equal: on CPU under
Triton's interpreter (which emulates the descriptor's loads, zero fill past K included), on a Hopper GPU
compiled. The shapes have K past the last full K-step, N past the last full tile (a tile's rows past N
read the next expert's rows through the descriptor: they must never reach a stored column), experts
without rows and the fused gate/up GEMM. Outputs are poisoned with NaN: every element is proven written.
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
from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.quant.fp4 import nvfp4_global_scale, quantize_mxfp4, quantize_nvfp4  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import (  # noqa: E402
    ACTIVATIONS,
    pack_int4,
    quantize_activations,
    quantize_weight_w8,
    reference_gemm,
    rel,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
# Under the interpreter: fp16 rows (it mis-computes tl.dot on bf16); compiled: the deployed bf16.
DTYPE = torch.bfloat16 if CUDA else torch.float16
FORMATS = ["float", "fp8-channel", "fp8-block", "int8", "int4", "int4-zeros", "mxfp4", "nvfp4", "nvfp4-rows"]


def operands(fmt: str, rows: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    """The kernel's operand arguments (``a``, ``weight``, scales, format) of ``rows`` and ``w [E, N_w, K]``."""
    if fmt == "float":
        return dict(a=rows.to(DTYPE), weight=w.to(DTYPE))
    if fmt in ("fp8-channel", "fp8-block", "int8"):
        qdtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
        x = quantize_activations(rows, qdtype, "group" if fmt == "fp8-block" else "token")
        q, scale, _ = quantize_weight_w8(w, qdtype, fmt == "fp8-block")
        return dict(a=x.data, a_scale=x.scale, weight=q, weight_scale=scale,
                    weight_format=WeightFormat.INT8 if fmt == "int8" else WeightFormat.FP8)
    if fmt.startswith("int4"):
        packed, scale, zeros, _ = pack_int4(w, 32, fmt == "int4-zeros", DTYPE)
        return dict(a=rows.to(DTYPE), weight=packed, weight_scale=scale, weight_zero=zeros,
                    weight_format=WeightFormat.INT4)
    if fmt == "mxfp4":
        q = quantize_mxfp4(w)
        return dict(a=rows.to(DTYPE), weight=q.data.reshape(w.shape[0], w.shape[1], -1), weight_scale=q.scale,
                    weight_format=WeightFormat.MXFP4)
    q = quantize_nvfp4(w, nvfp4_global_scale(w, leading_dims=1))
    args: dict[str, Any] = dict(weight=q.data, weight_scale=q.scale, weight_global=q.global_scale,
                                weight_format=WeightFormat.NVFP4)
    if fmt == "nvfp4":
        return dict(a=rows.to(DTYPE), **args)
    a_global = float(rows.abs().amax()) / (6 * 448)
    qa = quantize_nvfp4(rows, a_global)
    return dict(a=qa.data, a_scale=qa.scale, a_global=a_global, **args)


def run_both(fmt: str, *, glu: bool, tokens: int, interleaved: bool = False, experts: int, top_k: int, hidden: int, n_out: int,
             config: GemmConfig, seed: int = 0, option: str = "tma", baseline: Any = False, value: Any = True,
             **options: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output with option=baseline, with option=value, float64 reference of the float operands)``:
    ``option`` one of ``moe_gemm``'s schedule keywords (``tma``, ``grid``), ``options`` the others."""
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n_out if glu else n_out
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    # routing that leaves the last expert without rows (its weight rows are only read past N)
    ids = torch.stack([torch.randperm(max(experts - 1, 1), generator=gen)[:top_k] for _ in range(tokens)]
                      ).to(torch.int32).to(DEVICE)
    plan = align.align_block_size(ids, experts, config.block_m)
    act = (ACTIVATIONS["swiglu-interleaved"] if interleaved else ACTIVATIONS["swiglu"]) if glu else None
    args = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    outs = []
    for choice in (baseline, value):
        out = torch.full((tokens * top_k, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=top_k, config=config, act=act_code(act) if act else 0,
                          glu=glu, interleaved=interleaved, **{option: choice}, **options, **args)
        outs.append(out)
    return outs[0], outs[1], reference_gemm(rows, top_k, ids, w, None, act)


@pytest.mark.skipif(CUDA and not HOPPER, reason="the TMA path is built for Hopper (compute capability 9.x)")
@pytest.mark.parametrize("layout", ["down", "gate_up", "gate_up_interleaved"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tma_weight_tiles_are_bitwise_the_pointer_loads(fmt: str, layout: str) -> None:
    # K = 160: two full 64-wide steps and a partial one (NVFP4: 80 bytes, 16-byte rows); N = 40 of 32-wide
    # tiles; 4 experts, the last one without rows.
    config = GemmConfig(16, 32, 64, group_m=1, num_warps=4, num_stages=2)
    pointer, tma, ref = run_both(fmt, glu=layout != "down", interleaved=layout == "gate_up_interleaved", tokens=5,
                                 experts=4, top_k=2, hidden=160 if fmt != "fp8-block" else 256, n_out=40, config=config)
    assert not torch.isnan(pointer.float()).any() and not torch.isnan(tma.float()).any()
    assert torch.equal(pointer, tma)
    # and both are the product (loose: 4-bit quantization errors reach 0.2; a zero-filled or misplaced tile is near 1)
    assert rel(tma, ref) < 0.5


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
@pytest.mark.parametrize("fmt", ["float", "fp8-block", "int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("block", [(64, 128, 64, 4), (128, 128, 64, 8), (64, 64, 128, 4)])
def test_tma_on_hopper_tiles(fmt: str, block: tuple[int, int, int, int], interleaved: bool) -> None:
    """The wgmma tiles of the tuned tables, at a real width, on a Hopper GPU."""
    block_m, block_n, block_k, warps = block
    config = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=3)
    pointer, tma, ref = run_both(fmt, glu=True, interleaved=interleaved, tokens=300, experts=8, top_k=2, hidden=1024,
                                 n_out=704, config=config, seed=3)
    assert not torch.isnan(tma.float()).any()
    assert torch.equal(pointer, tma)
    assert rel(tma, ref) < 0.5


@pytest.mark.skipif(CUDA and not HOPPER, reason="the TMA path is built for Hopper (compute capability 9.x)")
@pytest.mark.parametrize("shape", [(72, 40, GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)),
                                   (1000, 520, GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3))],
                         ids=["interpreter-sized", "wgmma tiles"])
def test_tma_tiles_of_a_transposed_weight_are_bitwise_the_pointer_loads(shape: tuple[int, int, GemmConfig]) -> None:
    # The backward's row gradient: out[c] = rows[c] @ W[e] with the weight passed as W.transpose(1, 2), W [E, N, K];
    # the reduction runs over W's N (72: a partial step, whose box is clipped at the expert's edge instead of reading
    # the next expert's rows) and the output over its K (40: a partial tile); 4 experts, the last without rows.
    n_red, n_out, config = shape
    if n_red > 100 and not HOPPER:
        pytest.skip("the wgmma-sized case runs on a Hopper GPU")
    gen = torch.Generator().manual_seed(29)
    experts, copies = 4, 24 if n_red < 100 else 600
    w = (torch.randn(experts, n_red, n_out, generator=gen) * n_red ** -0.5).to(DEVICE, DTYPE)
    rows = torch.randn(copies, n_red, generator=gen).to(DEVICE, DTYPE)
    ids = torch.randint(0, experts - 1, (copies, 1), generator=gen).to(torch.int32).to(DEVICE)
    plan = align.align_block_size(ids, experts, config.block_m)
    weight = w.transpose(1, 2)
    assert launch_plan.transposed_weight(weight)
    outs = []
    for tma in (False, True):
        out = torch.full((copies, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(rows, weight, out, *plan, rows_per_a=1, config=config, tma=tma)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = torch.stack([rows[c].double() @ w[int(ids[c, 0])].double() for c in range(copies)])
    assert rel(outs[1], want) < 1e-2


def test_tma_refuses_what_it_cannot_copy() -> None:
    config = GemmConfig(16, 32, 64, group_m=1, num_warps=4, num_stages=2)
    w = torch.randn(3, 64, 96, dtype=torch.float16, device=DEVICE)
    assert launch_plan.weight_tma_applies(w, config, glu=True, interleaved=False)
    assert launch_plan.weight_tma_applies(w, config, glu=True, interleaved=True)  # viewed as [E * N, 2, K]
    # N contiguous (the row gradient's transposed weight): described as the [E, K, N_w] tensor it views, not for pairs
    assert launch_plan.weight_tma_applies(w.transpose(1, 2), config, glu=False, interleaved=False)
    assert not launch_plan.weight_tma_applies(w.transpose(1, 2), config, glu=True, interleaved=False)
    assert not launch_plan.weight_tma_applies(w[:, :, 1:].transpose(1, 2), config, glu=False, interleaved=False)
    assert launch_plan.weight_tma_applies(w[:, :, :90], config, glu=False, interleaved=False)  # K cut: rows still
    assert not launch_plan.weight_tma_applies(w[:, :32], config, glu=False, interleaved=False)  # experts not [E * N_w]
    assert not launch_plan.weight_tma_applies(w[:, :, 1:], config, glu=False, interleaved=False)  # base not aligned
    assert not launch_plan.weight_tma_applies(torch.randn(3, 64, 36, dtype=torch.float16, device=DEVICE), config,
                                           glu=False, interleaved=False)  # 72-byte rows
    packed = torch.zeros(3, 64, 16, dtype=torch.uint8, device=DEVICE)  # K = 32
    assert launch_plan.weight_tma_applies(packed, GemmConfig(16, 32, 32), glu=False, interleaved=False)
    assert not launch_plan.weight_tma_applies(packed, GemmConfig(16, 32, 16), glu=False, interleaved=False)  # 8 bytes
    # an explicit request that cannot be met is an error, not a silent fallback
    ids = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    plan = align.align_block_size(ids, 3, 16)
    a = torch.randn(2, 96, dtype=torch.float16, device=DEVICE)
    out = torch.empty(2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="TMA"):
        moe_gemm.moe_gemm(a, w.transpose(1, 2).contiguous().transpose(1, 2), out, *plan, rows_per_a=1, config=config,
                          glu=True, act=act_code(mf.ActivationConfig()), tma=True)


def test_tma_is_the_default_for_hopper_wgmma_tiles_only() -> None:
    hopper = (9, 0)
    wide, mid, narrow = GemmConfig(128, 128, 64), GemmConfig(64, 128, 64), GemmConfig(16, 64, 128)
    for fmt in (WeightFormat.FLOAT, WeightFormat.FP8, WeightFormat.INT8):
        assert launch_plan.weight_tma_pays(hopper, fmt, wide) and launch_plan.weight_tma_pays(hopper, fmt, mid)
        assert not launch_plan.weight_tma_pays(hopper, fmt, narrow)
    assert launch_plan.weight_tma_pays(hopper, WeightFormat.FLOAT, GemmConfig(128, 64, 64))
    for fmt in (WeightFormat.FP8, WeightFormat.INT8):  # 8-bit: not the 64-column tiles
        assert not launch_plan.weight_tma_pays(hopper, fmt, GemmConfig(128, 64, 128))
    for fmt in (WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4):
        assert launch_plan.weight_tma_pays(hopper, fmt, wide)
        assert not launch_plan.weight_tma_pays(hopper, fmt, mid) and not launch_plan.weight_tma_pays(hopper, fmt, narrow)
    # interleaved gate/up rows: float and 8-bit weights as before, 4-bit ones by pointer
    assert launch_plan.weight_tma_pays(hopper, WeightFormat.FLOAT, wide, interleaved=True)
    for fmt in (WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4):
        assert not launch_plan.weight_tma_pays(hopper, fmt, wide, interleaved=True)
    for capability in ((8, 0), (8, 9), (10, 0)):
        assert not launch_plan.weight_tma_pays(capability, WeightFormat.FLOAT, wide)
    assert not launch_plan.weight_tma_pays(None, WeightFormat.FLOAT, wide)


def test_device_capability_is_none_off_nvidia_gpus() -> None:
    assert moe_gemm.device_capability(torch.device("cpu")) is None
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        assert moe_gemm.device_capability(torch.device("cuda")) == (9, 0)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), mock.patch("torch.version.hip", "6.0"):
        assert moe_gemm.device_capability(torch.device("cuda")) is None


def test_a_configuration_choice_is_taken_where_tma_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GemmConfig.tma`` (a tuned table's choice) decides when the call does not; where TMA cannot copy the
    weight, a configuration's True falls back to pointer loads (it is a hint, not a request)."""
    made = []
    real = moe_gemm._weight_descriptor
    monkeypatch.setattr(moe_gemm, "_weight_descriptor", lambda *args: made.append(args) or real(*args))
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3, 96, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(4, 48, 96, generator=gen) * 0.1).to(DEVICE, torch.float16)
    plan = align.align_block_size(torch.tensor([[0], [2], [2]], dtype=torch.int32, device=DEVICE), 4, 16)

    def run(weight: torch.Tensor, config: GemmConfig, **kwargs: Any) -> torch.Tensor:
        out = torch.full((3, 48), float("nan"), dtype=torch.float16, device=DEVICE)
        return moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, **kwargs)

    base = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    pointer = run(w, attrs.evolve(base, tma=False))
    assert not made
    assert torch.equal(run(w, attrs.evolve(base, tma=True)), pointer) and len(made) == 1
    run(w, attrs.evolve(base, tma=True), tma=False)  # the call's choice wins
    assert len(made) == 1
    padded = torch.zeros(4, 48, 100, dtype=torch.float16, device=DEVICE)
    padded[:, :, :96] = w
    strided = padded[:, :, :96]  # rows 200 bytes apart: TMA cannot copy them
    assert torch.equal(run(strided, attrs.evolve(base, tma=True)), pointer) and len(made) == 1
    n_contiguous = w.transpose(1, 2).contiguous().transpose(1, 2)  # the row gradient's layout: described transposed
    assert torch.equal(run(n_contiguous, attrs.evolve(base, tma=True)), pointer) and len(made) == 2
