"""A split K-loop (``moe_gemm(..., split_k=S)``: ``S`` ranges of whole K-steps writing fp32 partial sums, added
in a fixed order by ``moe_gemm_reduce_kernel`` before the epilogue) against one K-loop, in every weight format
and epilogue: the fused gated activation, bias (added once), routing weights, FP8 output quantized per
128-group. The rounding differs from one K-loop (the partial sums are rounded separately), so the outputs are
compared closely, not bitwise; a split is deterministic (the same call twice is bitwise equal). On CPU under
Triton's interpreter, on a GPU compiled. Outputs are poisoned with NaN: every element is proven written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import INVARIANT_GEMM, family_member, in_family  # noqa: E402
from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.kernels.grouped_gemm_call import decode_config, encode_config  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import quantize_activations, quantize_weight_w8, rel  # noqa: E402
from grids import grid as covering  # noqa: E402
from test_weight_tma import CUDA, DEVICE, DTYPE, FORMATS, run_both  # noqa: E402


def _close(split: torch.Tensor, whole: torch.Tensor, ref: torch.Tensor, fmt: str) -> None:
    assert not torch.isnan(split.float()).any()
    # one K-loop and a split one differ by the rounding of their partial sums (fp32): far below a wrong range
    # (a missed or doubled K-step moves the result by about 1 / steps)
    assert rel(split, whole) < (0.02 if fmt in ("int4", "int4-zeros", "mxfp4", "nvfp4", "nvfp4-rows") else 0.01)
    assert rel(split, ref) < 0.5


@pytest.mark.parametrize("fmt, glu, splits", covering(FORMATS, [False, True], [2, 3, 7],
                                                 ids=[None, ["down", "gate_up"], ["2", "3-uneven", "more-than-steps"]]))
def test_split_k_matches_one_k_loop(fmt: str, glu: bool, splits: int) -> None:
    # K = 160 (fp8-block 256): 5 (8) K-steps of 32 with a partial last one elsewhere; 3 splits of 5 steps
    # are 2 + 2 + 1, 7 splits are capped at one per step. The last expert has no rows.
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    whole, split, ref = run_both(fmt, glu=glu, tokens=5, experts=4, top_k=2, hidden=160 if fmt != "fp8-block" else 256,
                                 n_out=40, config=config, option="split_k", baseline=1, value=splits)
    _close(split, whole, ref, fmt)


@pytest.mark.parametrize("fmt", ["int4-zeros", "mxfp4", "nvfp4"])
def test_split_k_with_the_swapped_4bit_product(fmt: str) -> None:
    """``swap=True`` (``W @ rows^T``): the partial sums are stored after the accumulator's transpose."""
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    whole, split, ref = run_both(fmt, glu=True, tokens=4, experts=3, top_k=2, hidden=128, n_out=40, config=config,
                                 option="split_k", baseline=1, value=3, swap=True)
    _close(split, whole, ref, fmt)


@pytest.mark.parametrize("fmt", ["float", "int4", "mxfp4"])
def test_split_k_interleaved_gate_up_and_tma(fmt: str) -> None:
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    whole, split, ref = run_both(fmt, glu=True, interleaved=True, tokens=3, experts=3, top_k=2, hidden=128, n_out=48,
                                 config=config, option="split_k", baseline=1, value=4, tma=True)
    _close(split, whole, ref, fmt)


def _plan(tokens: int, experts: int, top_k: int, block_m: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    return (ids.to(DEVICE),) + tuple(align.align_block_size(ids.to(DEVICE), experts, block_m))


def test_split_k_bias_routing_weights_and_activation() -> None:
    """The bias is added by the first range only; the routing weight and a non-gated activation (relu²) after
    the sum."""
    gen = torch.Generator().manual_seed(1)
    tokens, experts, top_k, hidden, n_out = 6, 4, 2, 192, 48
    ids, *plan = _plan(tokens, experts, top_k, 16)
    a = torch.randn(tokens * top_k, hidden, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(experts, n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, DTYPE)
    bias = torch.randn(experts, n_out, generator=gen).to(DEVICE, DTYPE)
    weights = torch.rand(tokens * top_k, generator=gen).to(DEVICE)
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    relu2 = act_code(mf.ActivationConfig(kind=mf.ActivationKind.RELU2))
    outs = []
    for splits in (1, 3, 3):
        out = torch.full((tokens * top_k, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=config, bias=bias, topk_weights=weights, act=relu2,
                          split_k=splits)
        outs.append(out)
    expert = ids.reshape(-1).long()
    ref = torch.relu(torch.einsum("ck,cnk->cn", a.double(), w.double()[expert]) + bias.double()[expert]) ** 2
    ref = ref * weights.double()[:, None]
    assert rel(outs[0], ref) < 0.01 and rel(outs[1], ref) < 0.01
    assert rel(outs[1], outs[0]) < 0.01
    assert torch.equal(outs[1], outs[2])  # deterministic


@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block"])
def test_split_k_with_fp8_output_quantized_in_the_epilogue(fmt: str) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, experts, top_k, hidden, n_out = 5, 3, 2, 256, 256
    ids, *plan = _plan(tokens, experts, top_k, 16, seed=2)
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, 2 * n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    x = quantize_activations(rows, torch.float8_e4m3fn, "group" if fmt == "fp8-block" else "token")
    q, scale, _ = quantize_weight_w8(w, torch.float8_e4m3fn, fmt == "fp8-block")
    config = GemmConfig(16, 128, 64, group_m=1, num_warps=4, num_stages=2)
    outs = []
    for splits in (1, 2):
        out = torch.empty(tokens * top_k, n_out, dtype=torch.float8_e4m3fn, device=DEVICE)
        out_scale = torch.full((tokens * top_k, n_out // 128), float("nan"), device=DEVICE)
        moe_gemm.moe_gemm(x.data, q, out, *plan, rows_per_a=top_k, config=config, a_scale=x.scale, weight_scale=scale,
                          weight_format=WeightFormat.FP8, act=act_code(mf.ActivationConfig()), glu=True,
                          out_scale=out_scale, split_k=splits)
        assert not torch.isnan(out_scale).any()
        outs.append(out.float() * out_scale.repeat_interleave(128, dim=1))
    assert rel(outs[1], outs[0]) < 0.05  # FP8 rounding of slightly different values


def test_split_k_from_the_configuration_and_its_errors() -> None:
    assert decode_config(encode_config(GemmConfig(16, 32, 64, split_k=3))).split_k == 3
    assert decode_config(encode_config(GemmConfig(16, 32, 64))).split_k is None
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(16, 32, 64, split_k=0)
    ids, *plan = _plan(2, 3, 1, 16)
    a = torch.randn(2, 64, dtype=DTYPE, device=DEVICE)
    w = torch.randn(3, 32, 64, dtype=DTYPE, device=DEVICE)
    out = torch.empty(2, 32, dtype=DTYPE, device=DEVICE)
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="split_k"):
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=config, split_k=0)
    with pytest.raises(ValueError, match="one program per tile"):
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=config, split_k=2, grid="persistent")
    with pytest.raises(ValueError, match="one program per tile"):
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=attrs.evolve(config, split_k=2), grid="flattened")
    # the configuration's choice is taken when the call makes none
    made: list[Any] = []
    real = moe_gemm.moe_gemm_reduce_kernel

    class Spy:
        def __getitem__(self, launch: Any) -> Any:
            made.append(launch)
            return real[launch]

    original = moe_gemm.moe_gemm_reduce_kernel
    moe_gemm.moe_gemm_reduce_kernel = Spy()  # type: ignore[assignment]
    try:
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=attrs.evolve(config, split_k=2))
        moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=attrs.evolve(config, split_k=2), split_k=1)
    finally:
        moe_gemm.moe_gemm_reduce_kernel = original  # type: ignore[assignment]
    assert len(made) == 1


def test_batch_invariant_configurations_never_split() -> None:
    assert INVARIANT_GEMM.split_k == 1
    member = family_member(GemmConfig(16, 64, 128, split_k=4), 2, 2)
    assert member.split_k == 1 and in_family(member)
    assert not in_family(attrs.evolve(member, split_k=None)) and not in_family(attrs.evolve(member, split_k=2))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["float", "fp8-block", "int8", "int4-zeros", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("block", [(16, 64, 128, 4), (16, 32, 256, 4), (64, 64, 64, 4)])
def test_split_k_on_the_gpu_tiles(fmt: str, block: tuple[int, int, int, int]) -> None:
    """The decode tiles of the tuned tables, at a real width, compiled."""
    block_m, block_n, block_k, warps = block
    config = GemmConfig(block_m, block_n, block_k, group_m=1, num_warps=warps, num_stages=3)
    for glu in (False, True):
        whole, split, ref = run_both(fmt, glu=glu, tokens=9, experts=16, top_k=4, hidden=2048, n_out=704,
                                     config=config, seed=3, option="split_k", baseline=1, value=4)
        _close(split, whole, ref, fmt)


def test_default_split_k_only_for_few_long_quantized_programs() -> None:
    hopper, sms = (9, 0), 132
    config = GemmConfig(16, 64, 128)
    rule = launch_plan.default_split_k
    # Mixtral's MXFP4 down GEMM at M = 1: 128 programs of 112 K-steps -> 4 ranges; W4A16's 256 -> 3
    assert rule(hopper, WeightFormat.MXFP4, config, 128, 112, sms) == 4
    assert rule(hopper, WeightFormat.INT4, config, 256, 112, sms) == 3
    # 8-bit weights: at most 2; Qwen3's MXFP4 gate/up (16 steps): 2 ranges of 8
    assert rule(hopper, WeightFormat.FP8, config, 256, 112, sms) == 2
    assert rule(hopper, WeightFormat.INT8, config, 256, 56, sms) == 1  # 8-bit: only K-loops of >= 96 steps
    assert rule(hopper, WeightFormat.MXFP4, config, 192, 16, sms) == 2
    # enough programs, short K-loops, float weights, no GPU: no split
    assert rule(hopper, WeightFormat.MXFP4, config, 360, 23, sms) == 1
    assert rule(hopper, WeightFormat.MXFP4, config, 128, 15, sms) == 1
    assert rule(hopper, WeightFormat.FLOAT, config, 96, 112, sms) == 1
    assert rule(None, WeightFormat.MXFP4, config, 128, 112, sms) == 1
    assert rule(hopper, WeightFormat.MXFP4, config, 0, 112, sms) == 1
    assert rule(hopper, WeightFormat.MXFP4, GemmConfig(64, 64, 128), 128, 112, sms) == 1  # beyond decode tiles


def test_a_tuned_tables_split_choice_is_read() -> None:
    from moeforge.kernels.config import ConfigTable

    entry = dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    table = ConfigTable.from_json(8, 2, {"1": dict(gate_up=entry, down=dict(entry, split_k=4))})
    assert table.lookup(1).down.split_k == 4 and table.lookup(1).gate_up.split_k is None


def test_the_rule_gives_way_to_an_explicit_persistent_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default split is the rule's; asking for a persistent grid (which cannot split) takes precedence."""
    asked: list[Any] = []
    monkeypatch.setattr(launch_plan, "default_split_k", lambda *args: asked.append(args) or 3)
    ids, *plan = _plan(4, 3, 1, 16)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4, 96, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(3, 96, 96, generator=gen) * 0.1).to(DEVICE, DTYPE)  # (wider than a rank: not the narrow rule)
    config = GemmConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=2)
    outs = {}
    for grid in ("tiles", "persistent"):
        out = torch.full((4, 96), float("nan"), dtype=DTYPE, device=DEVICE)
        outs[grid] = moe_gemm.moe_gemm(a, w, out, *plan, rows_per_a=1, config=config, grid=grid)
    assert len(asked) == 1  # only the one-program-per-tile launch asked the rule (and split 3 ways)
    assert not torch.isnan(outs["persistent"].float()).any()
    assert rel(outs["persistent"], outs["tiles"]) < 0.01
