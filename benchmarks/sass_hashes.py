"""A fingerprint of the grouped GEMM's machine code, to show that a refactor of the kernel changes nothing it compiles.

    python benchmarks/sass_hashes.py OUT.json            # at the change, then at its parent:
    python benchmarks/sass_hashes.py --compare A.json B.json

It compiles ``moe_gemm_kernel`` for sm_90 (no GPU needed: ``sass_loop.compile_kernel``, the wheel's ptxas and
nvdisasm) over a grid of configurations — every weight format, gate/up and down, plain and shuffled 4-bit weights,
one program per tile and persistent, with and without half tiles — and writes one hash of each kernel's SASS (code
only: no addresses, no line information). Equal hashes at two commits mean the same instructions. Run it with each
Triton the package supports (``PYTHONPATH=DIR:.`` with another wheel unpacked in ``DIR``, see ``sass_loop.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loop  # noqa: E402


def fingerprints() -> dict[str, str]:
    """The hash of each configuration's SASS."""
    found = {}
    for weights, glu, shuffled, persistent, half in itertools.product(
            ("float", "int4", "mxfp4", "nvfp4", "fp8-block"), (False, True), (False, True), (0, 1), (False, True)):
        fmt = sass_loop.FORMATS[weights]
        if (shuffled and not fmt.e2m1) or (half and persistent):
            continue
        kernel = sass_loop.compile_kernel(fmt, glu=glu, block=(64, 64, 64), warps=4, stages=3, dtype="bf16",
                                          swap=False, ptx=True, prefetch=True, persistent=persistent,
                                          shuffled=shuffled, half_tail=half, fold=weights == "mxfp4")
        sass, _ = sass_loop.disassemble(kernel)
        code = "\n".join(re.sub(r"/\*[0-9a-f]*\*/", "", line).strip() for line in sass.splitlines()
                         if line.strip() and not line.strip().startswith("//"))
        key = f"{weights} glu={glu} shuffled={shuffled} persistent={persistent} half={half}"
        found[key] = hashlib.sha1(code.encode()).hexdigest()[:12]
        print(key, found[key], flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="JSON file for the hashes")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two hash files: the configurations that differ")
    args = parser.parse_args()
    if args.compare:
        first, second = (json.loads(Path(name).read_text()) for name in args.compare)
        differ = sorted(key for key in first.keys() | second.keys() if first.get(key) != second.get(key))
        print(f"{len(differ)} of {len(first.keys() | second.keys())} configurations differ" +
              "".join(f"\n  {key}" for key in differ))
        raise SystemExit(1 if differ else 0)
    found = fingerprints()
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
