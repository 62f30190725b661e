"""Batch invariance: a token's output is bitwise the same whatever else is in the batch.

On CPU the triton expert stages run under the interpreter with the invariant launch table, at tiny
shapes (fp16 rows; bf16 dots are mis-computed by the interpreter). There the tile products are numpy
matmuls whose rounding may depend on a row's place in the tile and on the CPU's vector unit, so the CPU
checks the structure (one launch configuration) and agreement within rounding; bitwise invariance is the
GPU kernel's property and is asserted where the kernel runs compiled. On a GPU the layer users build
(``MoELayer(..., batch_invariant=True)``) is checked across M in {1, 7, 64, 513, 4096} with the token of
interest at different positions, bf16, with a router, shared experts and every weight format that has
triton experts.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import (INVARIANT_BLOCK_K, INVARIANT_CONFIG, in_family, invariant_table,  # noqa: E402
                                      linear)
from moeforge.kernels.config import TOKEN_BUCKETS, ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.kernels.launch_plan import fit_config  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_the_invariant_table_keeps_the_tuned_tiles_inside_the_family() -> None:
    tuned = ConfigTable(8, 2, tokens=(1, 64, 4096), configs=(
        MoEConfig(GemmConfig(16, 32, 256, 1, 4, 5), GemmConfig(16, 64, 128, 1, 4, 4)),
        MoEConfig(GemmConfig(32, 128, 128, 8, 4, 4), GemmConfig(32, 64, 128, 8, 4, 4)),
        MoEConfig(GemmConfig(128, 128, 64, 8, 8, 4, swap=True), GemmConfig(128, 256, 64, 8, 8, 3))))
    table = invariant_table(8, 2, tuned=tuned)
    entries = [table.lookup(m) for m in (1, 7, 64, 513, 4096, 10 ** 6)]
    for entry in entries:
        for config in (entry.gate_up, entry.down):
            assert in_family(config), config
            # the launcher never halves the K-step to fit shared memory (the fused gate/up GEMM: two B tiles)
            assert fit_config(config, 2, packed=False, per_k_scales=False, glu=True).block_k == INVARIANT_BLOCK_K
    # columns, warps and group order follow the tuned table; rows and K-step are the family's
    assert entries[0].gate_up == GemmConfig(64, 32, 64, 1, 4, 5, split_k=1, swap=False)
    assert entries[0].down == GemmConfig(64, 64, 64, 1, 4, 4, split_k=1, swap=False)
    # already in the family: the tuned tiles as they are, the K-loop never split, never swapped (a 4-bit
    # table's choice: one orientation for every token count)
    assert entries[-1] == MoEConfig(*(attrs.evolve(c, split_k=1, swap=False) for c in (
        tuned.lookup(4096).gate_up, tuned.lookup(4096).down)))
    assert table.batch_invariant and table.alignment() != invariant_table(8, 2).alignment()
    # no device table: the fallback rules' tiles, moved into the family, for every bucket
    fallback = invariant_table(8, 2, tuned=ConfigTable(8, 2))
    assert all(in_family(fallback.lookup(m).gate_up) for m in TOKEN_BUCKETS)
    assert {fallback.lookup(m).block_m for m in TOKEN_BUCKETS} == {64, 128}


def test_the_invariant_table_is_one_config_where_the_family_cannot_follow() -> None:
    tuned = ConfigTable(8, 2)
    for table in (invariant_table(8, 2), invariant_table(8, 2, tuned=tuned, element_bytes=4)):
        assert {table.lookup(m) for m in (1, 7, 64, 513, 4096, 10 ** 6)} == {INVARIANT_CONFIG}
    capped = invariant_table(8, 2, max_block_m=32, tuned=tuned)
    assert {capped.lookup(m).block_m for m in (1, 5, 4096)} == {32}
    assert len({capped.lookup(m) for m in (1, 5, 4096)}) == 1
    # W8A8's cap (64 rows): every entry aligns to 64 rows, so its GEMMs take one tile for every count
    w8a8 = invariant_table(8, 2, max_block_m=64, tuned=tuned)
    assert {w8a8.lookup(m).block_m for m in TOKEN_BUCKETS} == {64}


def assert_same_rows(part: torch.Tensor, whole: torch.Tensor) -> None:
    if CUDA:
        assert torch.equal(part, whole)
    else:
        torch.testing.assert_close(part, whole, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("tiles", ["one config", "family by token count"])
def test_triton_experts_with_the_invariant_table_are_batch_invariant(tiles: str) -> None:
    experts, k, hidden, inter = 4, 2, 64, 48
    gen = torch.Generator().manual_seed(71)
    dtype = torch.float16
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    small, large = GemmConfig(16, 32, 128, 1, 4, 3), GemmConfig(128, 64, 64, 8, 8, 2)
    tuned = ConfigTable(experts, k, (1, 64), (MoEConfig(small, small), MoEConfig(large, large)))
    table = invariant_table(experts, k, tuned=None if tiles == "one config" else tuned)
    if tiles != "one config":  # the slices below align to 64 and 128 rows
        assert {table.lookup(m).block_m for m in (1, 7, 65, 70)} == {64, 128}
    pipeline = mf.Pipeline([TritonTopK(experts, k, mf.RoutingConfig()), AlignDispatch(experts, table),
                            FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                            FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()],
                           mf.input_spec(hidden, dtype, experts))
    x = torch.randn(70, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(70, experts, generator=gen).to(DEVICE)
    whole = pipeline(mf.MoEInput(x, logits)).hidden_states
    for rows in (slice(0, 1), slice(3, 10), slice(69, 70), slice(5, 70)):  # 1, 7, 1, 65 tokens
        part = pipeline(mf.MoEInput(x[rows].contiguous(), logits[rows].contiguous())).hidden_states
        assert_same_rows(part, whole[rows])


def test_invariant_linear_is_a_linear_and_row_independent() -> None:
    gen = torch.Generator().manual_seed(72)
    x = torch.randn(20, 48, generator=gen).to(DEVICE)
    w = torch.randn(12, 48, generator=gen).to(DEVICE)
    b = torch.randn(12, generator=gen).to(DEVICE)
    out = linear(x, w, b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert_same_rows(linear(x[7:8], w, b), out[7:8])


def test_batch_invariance_needs_the_triton_backend() -> None:
    with pytest.raises(mf.InputError, match="batch_invariant=True needs the triton backend"):
        mf.MoELayer(4, 2, 64, 32, backend="torch", batch_invariant=True, device=DEVICE)
    with pytest.raises(mf.InputError, match="must be a bool"):
        mf.MoELayer(4, 2, 64, 32, batch_invariant=1, device=DEVICE)  # type: ignore[arg-type]
    if not CUDA:
        with pytest.raises(mf.BackendUnavailableError, match="batch_invariant=True needs the triton backend"):
            mf.MoELayer(4, 2, 64, 32, batch_invariant=True)


LAYERS: dict[str, Callable[[], dict[str, Any]]] = {
    "bf16 mixtral-like": lambda: dict(),
    "bf16 shared experts + sigmoid routing": lambda: dict(
        routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, renormalize=True),
        shared_experts=mf.SharedExpertsConfig(intermediate_size=256, gate=mf.SharedGate.SIGMOID)),
    "fp8 block/group": lambda: dict(quant=mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")),
    "w4a16": lambda: dict(quant=mf.W4A16Method(group_size=128)),
    "mxfp4": lambda: dict(quant=mf.Mxfp4Method()),
    "nvfp4": lambda: dict(quant=mf.Nvfp4Method()),
}


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_output_of_a_token_is_bitwise_the_same_in_every_batch(name: str) -> None:
    torch.manual_seed(0)
    hidden = 1024
    layer = mf.MoELayer(16, 4, hidden, 512, dtype=torch.bfloat16, device="cuda", batch_invariant=True,
                        **LAYERS[name]())
    assert "backend triton" in layer.describe()
    probe = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(probe)
        for m in (1, 7, 64, 513, 4096):
            for position in sorted({0, m // 2, m - 1}):
                batch = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
                batch[position] = probe[0]
                got = layer(batch)[position:position + 1]
                assert torch.equal(got, want), (m, position)


FAMILY = [GemmConfig(64, 32, 64, 1, 4, 5), GemmConfig(64, 128, 64, 8, 4, 3), GemmConfig(64, 128, 64, 8, 8, 3),
          GemmConfig(128, 64, 64, 8, 4, 3), GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 2)]


def with_tiles(layer: mf.MoELayer, config: GemmConfig) -> mf.Pipeline:
    """The layer's pipeline with every triton stage on one launch configuration, tiles included."""
    table = ConfigTable(layer.num_experts, layer.top_k, (1,), (MoEConfig(config, config),), batch_invariant=True)
    stages = []
    for stage in layer.pipeline.stages:
        if hasattr(stage, "configs"):
            stage = attrs.evolve(stage, configs=table)
        if hasattr(stage, "use_table_tiles"):
            stage = attrs.evolve(stage, use_table_tiles=True)
        stages.append(stage)
    return mf.Pipeline(stages, layer.pipeline.input_spec)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["bf16 mixtral-like", "fp16", "w4a16", "mxfp4", "nvfp4"])
def test_every_tile_of_the_family_gives_bitwise_the_same_rows(name: str) -> None:
    """What lets the invariant table pick tiles by token count: rows, columns, warps and pipeline depth
    change which elements a program computes, not the order in which it reduces them."""
    torch.manual_seed(1)
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    settings = LAYERS["bf16 mixtral-like" if name == "fp16" else name]()
    layer = mf.MoELayer(16, 4, 1024, 512, dtype=dtype, device="cuda", backend="triton", **settings)
    x = torch.randn(300, 1024, device="cuda", dtype=dtype)
    logits = torch.randn(300, 16, device="cuda")
    with torch.no_grad():
        outs = [with_tiles(layer, config)(mf.MoEInput(x, logits)).hidden_states for config in FAMILY]
    for config, out in zip(FAMILY[1:], outs[1:]):
        assert torch.equal(out, outs[0]), config


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 0)])
def test_the_tile_family_is_used_on_hopper_only(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
                                                ) -> None:
    """The family was checked on Hopper's warpgroup MMA: elsewhere the layer takes one configuration."""
    from moeforge.dispatch_dtype import DispatchDecision, DispatchRule
    from moeforge.roles.base import LayerConfig

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    config = LayerConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336,
                         routing=mf.RoutingConfig(), activation=mf.ActivationConfig(), quant=mf.UnquantizedMethod(),
                         dtype=torch.bfloat16, device=torch.device("cuda"),
                         dispatch=DispatchDecision(mf.DispatchDtype.BF16, DispatchRule.LIBRARY_DEFAULT),
                         batch_invariant=True)
    table = config.kernel_configs()
    entries = {table.lookup(m) for m in TOKEN_BUCKETS}
    assert table.batch_invariant
    if capability[0] == 9:  # the H100's Mixtral table, moved into the family: several tiles
        assert len(entries) > 1 and all(in_family(e.gate_up) and in_family(e.down) for e in entries)
    else:
        assert entries == {INVARIANT_CONFIG}
