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
