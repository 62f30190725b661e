"""The persistent grids (``moe_gemm(..., grid="persistent")``: one program per SM, taking the tiles of the
aligned blocks that exist grid-stride; ``"flattened"``: the tile loop flattened with the K-loop) against
one program per tile, in every weight format: the same tiles reduce in the same order, so the outputs
are bitwise equal (on CPU under Triton's interpreter, on a GPU compiled). More programs than tiles (a
small batch) and fewer are both covered; outputs are poisoned with NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeforge.kernels import align, launch_plan, moe_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from test_triton_quant_gemm import rel  # noqa: E402
from grids import grid as covering  # noqa: E402
from test_weight_tma import DEVICE, FORMATS, HOPPER, run_both  # noqa: E402


@pytest.mark.parametrize("fmt, glu, tokens, grid", covering(
    FORMATS, [False, True], [1, 23], ["persistent", "flattened"],
    ids=[None, ["down", "gate_up"], ["fewer-tiles-than-programs", "more-tiles-than-programs"], None]))
def test_persistent_grid_is_bitwise_one_program_per_tile(fmt: str, glu: bool, tokens: int, grid: str) -> None:
    config = GemmConfig(16, 32, 64, group_m=2, num_warps=4, num_stages=2)
    # under the interpreter the grid has 4 programs: 1 token has 2 tiles, 23 tokens x 2 copies over 4
    # experts at least 8
    one_per_tile, persistent, ref = run_both(fmt, glu=glu, tokens=tokens, experts=4, top_k=2,
                                             hidden=160 if fmt != "fp8-block" else 256, n_out=40, config=config,
                                             option="grid", baseline="tiles", value=grid)
    assert not torch.isnan(persistent.float()).any()
    assert torch.equal(one_per_tile, persistent)
    assert rel(persistent, ref) < 0.2


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("grid", ["persistent", "flattened"])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("fmt", ["float", "fp8-block", "int4", "mxfp4"])
def test_persistent_grid_on_hopper_tiles(fmt: str, tma: bool, grid: str) -> None:
    config = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)
    one_per_tile, persistent, ref = run_both(fmt, glu=True, tokens=700, experts=8, top_k=2, hidden=1024,
                                             n_out=704, config=config, seed=5, option="grid", baseline="tiles",
                                             value=grid, tma=tma)
    assert not torch.isnan(persistent.float()).any()
    assert torch.equal(one_per_tile, persistent)
    assert rel(persistent, ref) < 0.2



def test_default_grid() -> None:
    hopper = (9, 0)
    glu_tile, down_tile = GemmConfig(128, 128, 64, num_warps=8), GemmConfig(128, 256, 64, num_warps=8)
    many = 256.0  # rows per expert: two 128-row blocks
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, glu_tile, True, many, 2) == "persistent"
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, down_tile, False, many, 2) == "flattened"
    # fp32 outputs (the backward's): the flattened loop's staged output tile does not fit beside the ring
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, down_tile, False, many, 4) == "persistent"
    # about one block per expert: one program per tile
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, glu_tile, True, 200.0, 2) == "tiles"
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, down_tile, False, 128.0, 2) == "tiles"
    # two programs fit on an SM: one per tile
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, glu_tile, False, many, 2) == "tiles"
    assert launch_plan.default_grid(hopper, WeightFormat.FLOAT, GemmConfig(64, 128, 64), True, many, 2) == "tiles"
    for fmt in (WeightFormat.FP8, WeightFormat.INT8, WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4):
        assert launch_plan.default_grid(hopper, fmt, glu_tile, True, many, 2) == "tiles"
    assert launch_plan.default_grid((10, 0), WeightFormat.FLOAT, glu_tile, True, many, 2) == "tiles"
    assert launch_plan.default_grid(None, WeightFormat.FLOAT, glu_tile, True, many, 2) == "tiles"
    # a shuffled 4-bit weight's tiles of 128 rows or more: persistent on Hopper (whatever the rows per expert)
    for fmt in (WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4):
        assert launch_plan.default_grid(hopper, fmt, GemmConfig(128, 64, 64), True, 1.0, 2, shuffled=True) == "persistent"
        assert launch_plan.default_grid(hopper, fmt, GemmConfig(64, 128, 64), True, many, 2, shuffled=True) == "tiles"
        assert launch_plan.default_grid((10, 0), fmt, GemmConfig(128, 64, 64), True, many, 2, shuffled=True) == "tiles"


def test_each_k_step_waits_for_its_register_operand_mmas_where_triton_needs_it() -> None:
    """``drain_mma``: on Hopper with a Triton before 3.9, the swapped 4-bit product (any tile) and NVFP4 rows on
    wgmma tiles (64 rows or more); never off Hopper, never for operands that the MMA reads from shared memory."""
    from moeforge.kernels.formats import RowFormat

    hopper, tile, small = (9, 0), GemmConfig(128, 64, 64), GemmConfig(32, 64, 64)
    for race in (True, False):
        assert launch_plan.drain_mma(hopper, True, RowFormat.FLOAT, small, race) is race
        assert launch_plan.drain_mma(hopper, False, RowFormat.NVFP4, tile, race) is race
        assert launch_plan.drain_mma(hopper, False, RowFormat.NVFP4, small, race) is False  # mma.sync
        assert launch_plan.drain_mma(hopper, False, RowFormat.FLOAT, tile, race) is False
        for capability in ((8, 0), (10, 0), None):
            assert launch_plan.drain_mma(capability, True, RowFormat.NVFP4, tile, race) is False
    assert launch_plan.RS_WGMMA_RACE is (launch_plan._version(triton.__version__) < (3, 9))


def test_unknown_grid_is_refused() -> None:
    a = torch.randn(1, 32, dtype=torch.float16, device=DEVICE)
    plan = align.align_block_size(torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), 2, 16)
    with pytest.raises(ValueError, match="grid must be one of"):
        moe_gemm.moe_gemm(a, torch.randn(2, 16, 32, dtype=torch.float16, device=DEVICE),
                          torch.empty(1, 16, dtype=torch.float16, device=DEVICE), *plan, rows_per_a=1,
                          config=GemmConfig(16, 32, 32), grid="stream-k")
