"""``benchmarks/sass_loop.py`` (a development tool) compiles the grouped GEMM for sm_90 without a GPU and
counts its K-loop: the packed 4-bit decoding shows up as byte permutes and half2 multiplies beside the
MMAs, the portable one has neither, and neither spills. (Run as a program: the tests' interpreter mode
would replace the kernel it compiles.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _k_loop(*options: str) -> tuple[str, int, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the child compiles for sm_90
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_loop.py"), *options], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout.splitlines()
    total = int(re.fullmatch(r"K-loop: (\d+) instructions", out[1]).group(1))  # type: ignore[union-attr]
    counts = {op: int(n) for op, n in (item.rsplit(" ", 1) for item in out[2].split(", "))}
    return out[0], total, counts


@pytest.mark.skipif(not (TOOLS / "nvdisasm").exists(), reason="this triton wheel ships no nvdisasm")
def test_the_k_loop_of_a_packed_and_a_portable_mxfp4_tile() -> None:
    common = ("--weights", "mxfp4", "--glu", "--block", "16,64,64")
    usage, packed_total, packed = _k_loop(*common)
    assert "LOCAL:0" in usage
    usage, portable_total, portable = _k_loop(*common, "--portable")
    assert "LOCAL:0" in usage
    for counts in (packed, portable):
        assert counts.get("HMMA", 0) + counts.get("HGMMA", 0) > 0 and counts["BRA"] == 1
        assert sum(counts.values()) > 0
    assert packed.get("HMUL2", 0) > 0 and packed.get("PRMT", 0) > 0 and portable.get("HMUL2", 0) == 0
    assert packed_total < portable_total  # the point of the packed decoding


@pytest.mark.skipif(not (TOOLS / "nvdisasm").exists(), reason="this triton wheel ships no nvdisasm")
def test_fp8_block_scales_one_per_tile_promote_with_one_multiply_add_per_element() -> None:
    """The 128 x 64 gate/up tile on 8 warps (two accumulators of 32 elements per thread each): with one
    weight scale per tile and step the promotion is one FFMA per accumulator element and no FMUL per
    element; with a scale per column it also multiplies each element."""
    common = ("--weights", "fp8-block", "--glu", "--block", "128,64,128", "--warps", "8")
    usage, tile_total, tile = _k_loop(*common, "--tile-scale")
    assert "LOCAL:0" in usage
    _, column_total, column = _k_loop(*common)
    assert tile["QGMMA"] == column["QGMMA"] == 8  # 2 dots x 4 K-steps of 32 per warpgroup
    assert tile["FFMA"] == 64 and tile.get("FMUL", 0) < 16
    assert column.get("FMUL", 0) >= 64
    assert tile_total < column_total
