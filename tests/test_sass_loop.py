"""``benchmarks/sass_loop.py`` (a development tool) compiles the grouped GEMM for sm_90 without a GPU and
counts its K-loop: the packed 4-bit decoding shows up as byte permutes and half2 multiplies beside the
MMAs, the portable one has neither, and neither spills. (Run as a program: the tests' interpreter mode
would replace the kernel it compiles.)"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _sass_loop_module() -> Any:
    """``benchmarks/sass_loop.py`` as a module (for its pure functions; nothing is compiled in this process)."""
    spec = importlib.util.spec_from_file_location("sass_loop", ROOT / "benchmarks" / "sass_loop.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_register_hazards_are_writes_under_an_mma_in_flight() -> None:
    """The analysis on a hand-written loop of two MMAs, each followed by ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one group
    left in flight): the second one's left operand R12..R15 is still in flight when the next round writes R13 first
    thing; waits of ``0x0`` retire every group, and an operand from shared memory (``gdesc``) has no registers to
    overwrite."""
    sass_loop = _sass_loop_module()

    def loop(wait: int, operand: str = "R12") -> str:
        body = ["LOP3.LUT R13, R2, 0x81c081c0, RZ, 0xc0, !PT",
                "HGMMA.64x128x16.F32.BF16 R24, R8, gdesc[UR4], R24, gsb0",
                f"WARPGROUP.DEPBAR.LE gsb0, 0x{wait:x}",
                "IADD3 R2, R2, 0x1, RZ",
                f"HGMMA.64x128x16.F32.BF16 R56, {operand}, gdesc[UR8], R56, gsb0",
                f"WARPGROUP.DEPBAR.LE gsb0, 0x{wait:x}",
                "@P0 BRA `(.L_x_1)"]
        return ".L_x_1:\n" + "\n".join(f"        /*{16 * i:04x}*/    {ins} ;" for i, ins in enumerate(body))

    hazards = sass_loop.register_hazards(loop(1))
    assert len(hazards) == 1 and hazards[0].startswith("R13: ") and "LOP3" in hazards[0]
    assert sass_loop.register_hazards(loop(0)) == []
    assert sass_loop.register_hazards(loop(1, "gdesc[UR12]")) == []


# Tiles whose warpgroup MMA takes its left operand from registers decoded in the K-loop: the swapped product on a
# shuffled weight (Mixtral's 128-row gate/up and down tiles, on one program per tile and persistent, and a 16-row decode
# tile), the same 128-row gate/up tile on a plain weight, NVFP4 rows against float weights with half tiles on a
# persistent grid.
REGISTER_OPERAND_TILES = {
    "shuffled-gate_up-128": ("--weights", "mxfp4", "--glu", "--block", "128,64,64", "--swap", "--shuffled", "--fold",
                             "--prefetch"),
    "shuffled-down-128-persistent": ("--weights", "mxfp4", "--block", "128,128,64", "--warps", "8", "--swap",
                                     "--shuffled", "--fold", "--prefetch", "--grid", "1"),
    "shuffled-gate_up-16": ("--weights", "mxfp4", "--glu", "--block", "16,64,128", "--swap", "--shuffled", "--fold",
                            "--prefetch"),
    "plain-gate_up-128": ("--weights", "mxfp4", "--glu", "--block", "128,64,64", "--swap", "--fold", "--prefetch"),
    "nvfp4-rows-half-tail-persistent": ("--weights", "float", "--rows", "nvfp4", "--glu", "--block", "64,128,64",
                                        "--grid", "1", "--half-tail"),
}


def _hazards(*options: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_loop.py"), *options, "--hazards"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    return int(re.search(r"^hazards: (\d+)$", out, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.skipif(not (TOOLS / "nvdisasm").exists(), reason="this triton wheel ships no nvdisasm")
@pytest.mark.parametrize("stack", ["4", "1"], ids=["rows in parts", "rows as given"])
def test_a_stacks_update_of_each_copys_adapter_compiles_without_spills(stack: str) -> None:
    # a served stack at few copies: each copy's own adapter's K-step after the loop (UPDATE_STACK, UPDATE_PARTS)
    usage, total, counts = _k_loop("--weights", "float", "--block", "16,64,128", "--stages", "4", "--update", "16",
                                   "--stack", stack)
    assert "LOCAL:0" in usage and "STACK:0" in usage
    assert total > 0 and counts.get("HMMA", 0) > 0


@pytest.mark.skipif(not (TOOLS / "nvdisasm").exists(), reason="this triton wheel ships no nvdisasm")
@pytest.mark.parametrize("tile", sorted(REGISTER_OPERAND_TILES))
def test_no_register_is_written_under_an_mma_in_flight(tile: str) -> None:
    """Compiled for sm_90 as the launcher launches it on Hopper with this Triton (``launch_plan.drain_mma`` decides the
    wait after each K-step): no instruction of a K-loop writes a register that a warpgroup MMA still in flight reads.
    With Triton before 3.9 and without the wait, every one of these tiles has such writes (asserted too): the next
    K-step's decoding, scale loads and addresses land in the registers of the step's last MMAs, which on an H200
    wrote inf, NaN and wrong values."""
    assert _hazards(*REGISTER_OPERAND_TILES[tile]) == 0
    from moeforge.kernels import launch_plan

    if launch_plan.RS_WGMMA_RACE:
        assert _hazards(*REGISTER_OPERAND_TILES[tile], "--drain", "0") > 0


def test_sass_hashes_compare_names_the_configurations_that_differ(tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"mxfp4 glu=True": "aa", "int4 glu=False": "bb"}))
    second.write_text(json.dumps({"mxfp4 glu=True": "aa", "int4 glu=False": "cc"}))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "sass_hashes.py"
    same = subprocess.run([sys.executable, str(script), "--compare", str(first), str(first)], capture_output=True,
                          text=True)
    assert same.returncode == 0 and "0 of 2 configurations differ" in same.stdout
    changed = subprocess.run([sys.executable, str(script), "--compare", str(first), str(second)], capture_output=True,
                             text=True)
    assert changed.returncode == 1 and "1 of 2 configurations differ\n  int4 glu=False" in changed.stdout


def test_sass_hashes_can_hash_the_parameters_wherever_they_sit() -> None:
    # A change that adds a kernel argument moves the others in the parameter bank: --any-parameter-offsets hashes
    # the same instructions alike, and still tells a different instruction or register apart.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sass_hashes

    before = "/*0010*/  LDC R1, c[0x0][0x28] ;\n  // a comment\n/*0020*/  EXIT ;"
    after = "/*0010*/  LDC R1, c[0x0][0x30] ;\n/*0020*/  EXIT ;"
    other = "/*0010*/  LDC R2, c[0x0][0x30] ;\n/*0020*/  EXIT ;"
    assert sass_hashes.code(before) != sass_hashes.code(after)
    assert sass_hashes.code(before, True) == sass_hashes.code(after, True) != sass_hashes.code(other, True)
