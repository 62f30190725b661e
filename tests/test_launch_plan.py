"""The launch plan is a pure function of plain facts: the GPU rules run here, on any machine, for a Hopper GPU that
is not here, and each choice says what decided it."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")

from moeforge.kernels import launch_plan  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import KTail, RowFormat, RowScales, WeightFormat  # noqa: E402
from moeforge.kernels.launch_plan import LaunchFacts, explain_launch, plan_launch  # noqa: E402

HOPPER = (9, 0)


def facts(**changes: Any) -> LaunchFacts:
    """A Mixtral-like down GEMM of 256 tokens (top-2) on an H100, bf16 weights, 128x128x64 tiles."""
    base = LaunchFacts(
        weight_format=WeightFormat.FLOAT, row_format=RowFormat.FLOAT, row_scales=RowScales.NONE,
        compute_dtype=torch.bfloat16, out_bytes=2, experts=8, n_out=4096, k_dim=14336, copies=512,
        padded_rows=512 + 8 * 128, glu=False, interleaved=False, shuffled=False, blocked_scales=False,
        capability=HOPPER, multiprocessors=132, packed_decoding=True, tma_applies=True, vector_scales=True,
        weight_scale_max=None, config=GemmConfig(128, 128, 64, num_warps=8, num_stages=4))
    return attrs.evolve(base, **changes)


def test_a_plan_says_what_decided_each_choice() -> None:
    plan = plan_launch(facts())
    assert plan.tma and plan.grid == "tiles" and plan.splits == 1 and not plan.swap
    assert plan.explain() == ""  # the launcher's plans record no reasons (no text made on every call)
    text = explain_launch(facts())
    assert "tma=True (weight_tma_pays, where it applies)" in text
    assert "split K-loop: 1 (default_split_k)" in text and "(default_grid)" in text
    asked = plan_launch(facts(tma=False, grid="persistent"), explain=True)
    assert not asked.tma and asked.grid == "persistent" and asked.programs == (132,)
    assert "tma=False (asked)" in asked.explain() and "grid persistent, (132,) programs (asked)" in asked.explain()
    table = plan_launch(facts(config=GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=False)), explain=True)
    assert not table.tma and "tma=False (the table's entry)" in table.explain()
    for planned in (facts(), facts(tma=False, grid="persistent"), facts(split_k=2)):
        assert plan_launch(planned, explain=True) == plan_launch(planned)  # the same plan, explained or not


def test_the_programs_cover_the_tiles() -> None:
    plan = plan_launch(facts())
    blocks = (512 + 8 * 128) // 128
    assert plan.programs == (blocks * 4096 // 128,)
    assert plan_launch(facts(grid="persistent")).programs == (132,)
    few = plan_launch(facts(padded_rows=128, copies=2, grid="persistent"))
    assert few.programs == (4096 // 128,)  # fewer tiles than SMs: one program each


def test_decode_tiles_of_4bit_weights_split_their_k_loop_on_hopper_only() -> None:
    decode = dict(weight_format=WeightFormat.MXFP4, config=GemmConfig(16, 64, 128, num_warps=4, num_stages=3),
                  copies=2, padded_rows=2 * 16)
    plan = plan_launch(facts(**decode))
    assert plan.splits == 4 and plan.grid == "tiles" and len(plan.programs) == 2
    assert plan.steps_per_split * plan.splits >= 14336 // 128
    assert plan_launch(facts(**decode, capability=None)).splits == 1  # off Hopper's rules: no split
    assert plan_launch(facts(**decode, grid="persistent")).splits == 1  # a persistent grid runs whole K-loops
    with pytest.raises(ValueError, match="split K-loop runs one program per tile"):
        plan_launch(facts(**decode, grid="persistent", split_k=2))


def test_rank_wide_float_products_split_their_k_loop_where_few_blocks_hold_rows() -> None:
    """An adapter's ``x Aᵀ`` (16 columns, one column tile): its time is one K-loop's latency when few row blocks hold
    rows, so below one program per SM the loop is split (Hopper only), whatever the table says of wide GEMMs."""
    a_gemm = dict(n_out=16, k_dim=14336, config=GemmConfig(16, 16, 64, num_warps=4, num_stages=3))
    # an 8-adapter stack at one token (Mixtral's down GEMM): 2 copies over 64 (adapter, expert) pairs
    decode = plan_launch(facts(**a_gemm, experts=64, copies=2, padded_rows=2 + 64 * 15), explain=True)
    assert decode.splits == launch_plan.NARROW_MOST_SPLITS and decode.grid == "tiles"
    assert "(narrow_split_k)" in decode.explain()
    assert decode.steps_per_split * decode.splits >= 14336 // 64
    # Qwen3's gate/up at one token: 8 copies, a K-loop of 32 steps -> ranges of 4 steps at least
    assert plan_launch(facts(**dict(a_gemm, k_dim=2048), experts=1024, copies=8, padded_rows=8 * 16)).splits == 8
    # a block per SM or more: the loop as it is
    assert plan_launch(facts(**a_gemm, experts=8, copies=8192, padded_rows=8192 + 8 * 15)).splits == 1
    assert plan_launch(facts(**a_gemm, experts=64, copies=2, padded_rows=32, capability=None)).splits == 1
    assert plan_launch(facts(**a_gemm, experts=64, copies=2, padded_rows=32, split_k=1)).splits == 1  # asked
    # a short K-loop, or a wide GEMM, or 4-bit weights: not this rule
    assert plan_launch(facts(**dict(a_gemm, k_dim=192), experts=64, copies=2, padded_rows=32)).splits == 1
    assert "(default_split_k)" in explain_launch(facts(copies=2, padded_rows=256))
    assert "(default_split_k)" in explain_launch(facts(**a_gemm, weight_format=WeightFormat.MXFP4, copies=2,
                                                       padded_rows=32))


def test_the_narrow_rule_counts_the_blocks_that_hold_rows() -> None:
    rule, programs = launch_plan.narrow_split_k, launch_plan.narrow_programs
    assert programs(padded_rows=2 + 64 * 15, block_m=16, copies=2, experts=64) == 2
    assert programs(padded_rows=1024 * 16, block_m=16, copies=512, experts=1024) == 512 + 32
    assert programs(padded_rows=64, block_m=16, copies=512, experts=1024) == 4  # the alignment's bound
    assert rule(HOPPER, 2, 224, 132) == launch_plan.NARROW_MOST_SPLITS
    assert rule(HOPPER, 72, 224, 132) == 8  # about 4 programs per SM
    assert rule(HOPPER, 8, 12, 132) == 3  # at least 4 K-steps a range
    assert rule(HOPPER, 132, 224, 132) == 1 and rule(HOPPER, 0, 224, 132) == 1 and rule(None, 2, 224, 132) == 1


def test_a_shuffled_weights_large_tiles_run_persistent_and_wait_for_their_mmas() -> None:
    shuffled = facts(weight_format=WeightFormat.MXFP4, shuffled=True, weight_scale_max=128,
                     config=GemmConfig(128, 128, 64, num_warps=8, num_stages=3, swap=True))
    plan = plan_launch(shuffled)
    assert plan.grid == "persistent" and plan.swap and plan.ptx and plan.scale_fold
    assert plan.drain is launch_plan.RS_WGMMA_RACE  # Triton < 3.9 only
    assert plan.k_tail is KTail.EVEN_VECTOR_SCALES
    assert not plan_launch(attrs.evolve(shuffled, vector_scales=False)).k_tail is KTail.EVEN_VECTOR_SCALES
    assert plan_launch(attrs.evolve(shuffled, k_dim=14336 + 32)).k_tail is KTail.RAGGED


def test_what_cannot_be_launched_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be copied by TMA"):
        plan_launch(facts(tma=True, tma_applies=False))
    with pytest.raises(ValueError, match="packed 4-bit decoding"):
        plan_launch(facts(weight_format=WeightFormat.MXFP4, ptx=True, packed_decoding=False))
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        plan_launch(facts(split_k=0))


def test_fp32_outputs_and_tiles_too_large_for_the_shared_memory_are_fitted() -> None:
    big = facts(compute_dtype=torch.float32, out_bytes=4, config=GemmConfig(128, 256, 64, num_warps=8, num_stages=4))
    plan = plan_launch(big, explain=True)
    assert plan.config != big.config and "fitted to the shared memory" in plan.explain()
    assert plan.grid != "flattened" and plan.precision == "ieee"


def test_facts_are_hashable_so_a_plan_can_be_kept_per_bucket() -> None:
    assert hash(facts()) == hash(facts()) and {facts(): 1}[facts()] == 1


def test_the_unfused_gate_up_tile_reads_the_fused_tiles_weight_rows_and_stays_launchable() -> None:
    # A training forward runs the gate/up GEMM without its gated activation: one tile of 2 * block_n weight rows,
    # what the fused tile read as block_n gate and block_n up rows; never past a TMA box's 256, nor for the
    # small-batch launches (swapped, split K) whose tiles were tuned as they are.
    from moeforge.kernels.config import GemmConfig

    assert GemmConfig(128, 128, 64).unfused_gate_up() == GemmConfig(128, 256, 64)
    assert GemmConfig(64, 64, 128, num_warps=4).unfused_gate_up().block_n == 128
    for kept in (GemmConfig(128, 256, 64), GemmConfig(16, 64, 256, swap=True), GemmConfig(16, 64, 256, split_k=4)):
        assert kept.unfused_gate_up() == kept


def test_a_launch_with_one_update_takes_the_persistent_grid_where_the_flattened_one_would_spill() -> None:
    # Qwen3's training down GEMM at M = 4096: 128x256 tiles, 8 warps, 128 accumulators a thread, a plain output
    down = facts(experts=128, n_out=2048, k_dim=768, copies=32768, padded_rows=32768 + 128 * 64,
                 config=GemmConfig(128, 256, 64, num_warps=8, num_stages=4))
    assert plan_launch(down).grid == "flattened"
    assert plan_launch(attrs.evolve(down, one_update=True)).grid == "persistent"
    assert "persistent for a launch with one update" in explain_launch(attrs.evolve(down, one_update=True))
    assert plan_launch(attrs.evolve(down, one_update=True, grid="flattened")).grid == "flattened"  # (asked: kept)
