"""The row gradient of rows an activation made, with the activation's derivative in the GEMM's epilogue
(``moe_gemm(..., activation_grad=ActivationGrad(pre, ...))``): ``d_pre = activation'(pre) * (d_out @ W)``, the same
bits as the row gradient written out and ``activate_rows_backward`` after it (the epilogue rounds the product to the
rows' dtype first, as that hand-over does), for every activation, both gate/up layouts, tiles whose epilogue runs in
one, two or four column ranges, one program per tile and the persistent grids, with a low-rank update. And in a
training step: a down GEMM reading the rows the activation op returned takes this path (the activation's own
backward never runs), one reading anything else (rows a stage replaced, or changed in place) does not, and the
gradients are the reference's either way. On CPU under Triton's interpreter, on a GPU compiled.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.kernels import activation_rows, align, moe_gemm, ops  # noqa: E402,F401  (ops: the ops registered)
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.moe_gemm import ActivationGrad, activation_grad_parts  # noqa: E402
from moeforge.payloads import Activations, MoEInput  # noqa: E402
from moeforge.stages.triton import activation_args  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])

ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "swiglu interleaved": mf.ActivationConfig(gate_up=mf.GateUpLayout.INTERLEAVED),
    "gpt-oss": mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    "clamped swiglu": mf.ActivationConfig(mf.ActivationKind.CLAMPED_SWIGLU, limit=1.5),
    "softcapped swiglu": mf.ActivationConfig(mf.ActivationKind.SOFTCAPPED_SWIGLU, gate_softcap=2.0, up_softcap=3.0),
    "geglu tanh": mf.ActivationConfig(mf.ActivationKind.GEGLU, gelu_approximate="tanh"),
    "gelu": mf.ActivationConfig(mf.ActivationKind.GELU),
    "relu2": mf.ActivationConfig(mf.ActivationKind.RELU2),
    "silu": mf.ActivationConfig(mf.ActivationKind.SILU),
}


def _codes(config: mf.ActivationConfig) -> tuple[int, bool, bool, float, float]:
    codes: tuple[int, bool, bool, float, float] = activation_args(config)
    return codes


def _problem(tokens: int, experts: int, k: int, hidden: int, inter: int, gated: bool, dtype: torch.dtype,
             block_m: int, seed: int = 3) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32) \
        if tokens else torch.empty(0, k, dtype=torch.int32)
    plan = align.align_block_size(ids.to(DEVICE), experts, block_m)
    copies = tokens * k
    width = 2 * inter if gated else inter
    return dict(
        plan=plan, copies=copies,
        d_out=torch.randn(copies, hidden, generator=gen).to(DEVICE, dtype),
        w2=(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype),
        pre=(torch.randn(copies, width, generator=gen) * 2).to(DEVICE, dtype))


def _row_gradient(p: dict[str, Any], config: GemmConfig, grid: Optional[str], codes: tuple[Any, ...],
                  fused: bool, update: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    w_t = p["w2"].transpose(1, 2)  # the transposed view the backward launches on
    extra: dict[str, Any] = dict(rows_per_a=1, config=config, grid=grid)
    if update is not None:
        extra.update(update_rows=update[0], update_weight=update[1], update_scale=0.5)
    if fused:
        out = torch.full(p["pre"].shape, float("nan"), dtype=p["pre"].dtype, device=DEVICE)
        return moe_gemm.moe_gemm(p["d_out"], w_t, out, *p["plan"], activation_grad=ActivationGrad(p["pre"], *codes),
                                 **extra)
    d_act = torch.full((p["copies"], w_t.shape[1]), float("nan"), dtype=p["pre"].dtype, device=DEVICE)
    moe_gemm.moe_gemm(p["d_out"], w_t, d_act, *p["plan"], **extra)
    return activation_rows.activate_rows_backward(p["pre"], d_act, *codes)


# (tiles whose epilogue runs in one, two and four column ranges: activation_grad_parts)
TILES = [GemmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1), GemmConfig(16, 64, 16, num_warps=2),
         GemmConfig(16, 128, 32, num_warps=4, num_stages=2)]


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_epilogue_gives_the_bits_of_the_activations_own_backward(activation: str, dtype: torch.dtype) -> None:
    config = ACTIVATIONS[activation]
    p = _problem(9, 5, 2, 32, 48 if config.gated else 40, config.gated, dtype, 16)
    codes = _codes(config)
    want = _row_gradient(p, TILES[0], None, codes, fused=False)
    got = _row_gradient(p, TILES[0], None, codes, fused=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tile", range(len(TILES)))
@pytest.mark.parametrize("grid", [None, "persistent", "flattened"])
def test_every_tile_width_and_grid(tile: int, grid: Optional[str]) -> None:
    config = TILES[tile]
    assert activation_grad_parts(config) == [1, 2, 4][tile]
    # I = 150: ragged column tiles of every width; the gate/up layouts both
    for activation in ("swiglu", "gpt-oss"):
        p = _problem(11, 6, 3, 48, 150, True, torch.float32, 16, seed=tile)
        codes = _codes(ACTIVATIONS[activation])
        assert torch.equal(_row_gradient(p, config, grid, codes, fused=True),
                           _row_gradient(p, config, grid, codes, fused=False))


def test_with_a_low_rank_update() -> None:
    # (the row gradient of an adapted GEMM carries d_low @ A as its update: the derivative applies to the sum)
    p = _problem(7, 4, 2, 32, 48, True, torch.float32, 16)
    gen = torch.Generator().manual_seed(5)
    rank = 8
    update = (torch.randn(p["copies"], rank, generator=gen).to(DEVICE),
              torch.randn(4, 48, rank, generator=gen).to(DEVICE))
    codes = _codes(ACTIVATIONS["swiglu"])
    assert torch.equal(_row_gradient(p, TILES[1], None, codes, fused=True, update=update),
                       _row_gradient(p, TILES[1], None, codes, fused=False, update=update))


def test_an_empty_batch() -> None:
    p = _problem(0, 4, 2, 32, 48, True, torch.float32, 16)
    assert _row_gradient(p, TILES[0], None, _codes(ACTIVATIONS["swiglu"]), fused=True).shape == (0, 96)


def test_what_the_epilogue_refuses() -> None:
    p = _problem(5, 4, 2, 32, 48, True, torch.float32, 16)
    w_t = p["w2"].transpose(1, 2)
    grad = ActivationGrad(p["pre"], *_codes(ACTIVATIONS["swiglu"]))
    out = torch.empty_like(p["pre"])

    def launch(**changes: Any) -> None:
        args: dict[str, Any] = dict(rows_per_a=1, config=TILES[0], activation_grad=grad)
        args.update(changes)
        target = args.pop("out", out)
        moe_gemm.moe_gemm(p["d_out"], w_t, target, *p["plan"], **args)

    with pytest.raises(ValueError, match="no split"):
        launch(split_k=2)
    with pytest.raises(ValueError, match="epilogue: no activation"):
        launch(act=1)
    with pytest.raises(ValueError, match="must be"):
        launch(out=torch.empty(p["copies"], 48, device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        launch(activation_grad=ActivationGrad(p["pre"][:, :48], *_codes(ACTIVATIONS["swiglu"])))
    with pytest.raises(ValueError, match="code"):
        launch(activation_grad=ActivationGrad(p["pre"], 5, False, False, 1.0, 1.0))  # GPT-OSS's, ungated


# -- in a training step -----------------------------------------------------------------------------------------


def _layer(act: mf.ActivationConfig, dtype: torch.dtype, slot_rows: bool) -> tuple[mf.Pipeline, dict[str, Any]]:
    import test_triton_backward as backward

    gen = torch.Generator().manual_seed(13)
    tensors = backward._tensors(6, 32, 48, act.gated, dtype, gen)
    return backward._pipeline(6, 2, 32, tensors, act, mf.RoutingConfig(), dtype, slot_rows), tensors


def _step(pipeline: mf.Pipeline, tensors: dict[str, torch.Tensor], dtype: torch.dtype, between: Any = None
          ) -> tuple[list[torch.Tensor], int]:
    """Every gradient of a training step through ``pipeline`` (``between``: done to the rows between the gate/up and
    the down stage), and how many times the activation's own backward ran."""
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(9, 32, generator=gen).to(DEVICE, dtype).requires_grad_()
    logits = torch.randn(9, 6, generator=gen).to(DEVICE).requires_grad_()
    stages = pipeline.stages
    calls = [0]
    impl = activation_rows.ACTIVATE_ROWS_BACKWARD.impl

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return impl(*args)

    activation_rows.ACTIVATE_ROWS_BACKWARD.impl = counted
    try:
        payload: Any = MoEInput(x, logits)
        for index, stage in enumerate(stages):
            payload = stage(payload)
            if index == 2 and between is not None:  # (after the gate/up stage)
                payload = between(payload)
        grad = torch.randn(payload.hidden_states.shape, generator=gen).to(DEVICE, dtype)
        grads = torch.autograd.grad(payload.hidden_states, [x, logits, *tensors.values()], grad)
    finally:
        activation_rows.ACTIVATE_ROWS_BACKWARD.impl = impl
    return list(grads), calls[0]


@pytest.mark.parametrize("slot_rows", [False, True], ids=["copy order", "slot order"])
@pytest.mark.parametrize("activation", ["swiglu", "gpt-oss", "gelu"])
def test_a_training_step_goes_around_the_activations_backward(activation: str, slot_rows: bool) -> None:
    act = ACTIVATIONS[activation]
    pipeline, tensors = _layer(act, torch.float32, slot_rows)
    fused, calls = _step(pipeline, tensors, torch.float32)
    assert calls == 0
    # the same step with the activation's own backward (the down GEMM told nothing of where its rows came from)
    apart, calls = _step(pipeline, tensors, torch.float32,
                         between=lambda rows: dataclasses.replace(rows, activation=None))
    assert calls == 1
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)


def test_rows_replaced_or_changed_in_place_keep_the_activations_backward() -> None:
    act = ACTIVATIONS["swiglu"]
    pipeline, tensors = _layer(act, torch.float32, False)
    replaced, calls = _step(pipeline, tensors, torch.float32,
                            between=lambda rows: dataclasses.replace(rows, x=Activations(rows.x.data * 2.0)))
    assert calls == 1

    def in_place(rows: Any) -> Any:
        rows.x.data.mul_(2.0)  # (the same tensor, a new version: the record no longer describes it)
        return rows

    changed, calls = _step(pipeline, tensors, torch.float32, between=in_place)
    assert calls == 1
    for a, b in zip(replaced, changed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unscaled, _ = _step(pipeline, tensors, torch.float32)
    # (doubling the activated rows doubles the down GEMM's output: the weight gradient of the down GEMM doubles)
    torch.testing.assert_close(replaced[3], 2 * unscaled[3], rtol=1e-5, atol=1e-6)  # w2's
