"""A fingerprint of the grouped GEMM's machine code, to show that a refactor of the kernel changes nothing it compiles.

    python benchmarks/sass_hashes.py [--wide] [--any-parameter-offsets] OUT.json  # at the change, then the parent:
    python benchmarks/sass_hashes.py --compare A.json B.json

It compiles ``moe_gemm_kernel`` for sm_90 (no GPU needed: ``sass_loop.compile_kernel``, the wheel's ptxas and
nvdisasm) over a grid of configurations — every weight format, gate/up and down, plain and shuffled 4-bit weights,
one program per tile and persistent, with and without half tiles — and writes one hash of each kernel's SASS (code
only: no addresses, no line information). Equal hashes at two commits mean the same instructions. A change that adds
a kernel argument moves the others in the parameter bank; ``--any-parameter-offsets`` hashes every ``c[0x0][...]``
operand as one, so equal hashes then mean the same instructions reading the parameters from their new places. Run it with each
Triton the package supports (``PYTHONPATH=DIR:.`` with another wheel unpacked in ``DIR``, see ``sass_loop.py``), and
each commit with a Triton cache of its own (``TRITON_CACHE_DIR``): two runs side by side on one cache once gave a
commit the other Triton's hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loop  # noqa: E402


FORMATS = ("float", "int4", "mxfp4", "nvfp4", "fp8-block")


def code(sass: str, any_parameter_offsets: bool = False) -> str:
    """The instructions of a disassembly, without addresses, comments or blank lines; with
    ``any_parameter_offsets``, every kernel-parameter operand (``c[0x0][0x...]``) written alike."""
    lines = (re.sub(r"/\*[0-9a-f]*\*/", "", line).strip() for line in sass.splitlines()
             if line.strip() and not line.strip().startswith("//"))
    if any_parameter_offsets:
        lines = (re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][parameter]", line) for line in lines)
    return "\n".join(lines)


def _hash(any_parameter_offsets: bool = False, **options: Any) -> str:
    kernel = sass_loop.compile_kernel(sass_loop.FORMATS[options.pop("weights")], dtype="bf16", ptx=True,
                                      prefetch=True, **options)
    sass, _ = sass_loop.disassemble(kernel)
    return hashlib.sha1(code(sass, any_parameter_offsets).encode()).hexdigest()[:12]


def fingerprints(wide: bool = False, any_parameter_offsets: bool = False) -> dict[str, str]:
    """The hash of each configuration's SASS: 64x64x64 tiles over formats, gate/up and down, shuffled 4-bit weights,
    grids and half tiles; ``wide``: also 128x128x64 and 16x64x128 tiles, swapped products, NVFP4 rows, the flattened
    grid and FP8 one-scale-per-tile blocks (112 more)."""
    found = {}
    for weights, glu, shuffled, persistent, half in itertools.product(
            FORMATS, (False, True), (False, True), (0, 1), (False, True)):
        if (shuffled and not sass_loop.FORMATS[weights].e2m1) or (half and persistent):
            continue
        key = f"{weights} glu={glu} shuffled={shuffled} persistent={persistent} half={half}"
        found[key] = _hash(any_parameter_offsets, weights=weights, glu=glu, block=(64, 64, 64), warps=4, stages=3,
                           swap=False,
                           persistent=persistent, shuffled=shuffled, half_tail=half, fold=weights == "mxfp4")
        print(key, found[key], flush=True)
    for weights, glu, swap, persistent, rows, tile, block in itertools.product(
            FORMATS, (False, True), (False, True), (0, 2), ("bf16", "nvfp4"), (False, True),
            ((128, 128, 64), (16, 64, 128))) if wide else ():
        if ((swap and not sass_loop.FORMATS[weights].packed) or (rows == "nvfp4" and weights in ("fp8-block", "int4"))
                or (tile and weights != "fp8-block")):
            continue
        key = f"{weights} glu={glu} swap={swap} grid={persistent} rows={rows} tile={tile} block={block}"
        found[key] = _hash(any_parameter_offsets, weights=weights, glu=glu, block=block,
                           warps=8 if block[0] == 128 else 4, stages=3,
                           swap=swap, persistent=persistent, nvfp4_rows=rows == "nvfp4", tile_scale=tile)
        print(key, found[key], flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="JSON file for the hashes")
    parser.add_argument("--wide", action="store_true", help="112 more configurations (see fingerprints)")
    parser.add_argument("--any-parameter-offsets", action="store_true",
                        help="hash every kernel-parameter operand alike (a change that adds an argument)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two hash files: the configurations that differ")
    args = parser.parse_args()
    if args.compare:
        first, second = (json.loads(Path(name).read_text()) for name in args.compare)
        differ = sorted(key for key in first.keys() | second.keys() if first.get(key) != second.get(key))
        print(f"{len(differ)} of {len(first.keys() | second.keys())} configurations differ" +
              "".join(f"\n  {key}" for key in differ))
        raise SystemExit(1 if differ else 0)
    found = fingerprints(args.wide, args.any_parameter_offsets)
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
