"""Compare two or more ``bench_moe.py`` results files cell by cell: each cell's time in every file and its ratio to
the first (the A/B tables docs/notes/kernels-log.md quotes).

    python benchmarks/compare_results.py BEFORE.json AFTER.json [MORE.json ...] [--what experts_nvfp4-shuffled,...]
                                         [--ratio NUMERATOR,DENOMINATOR]

A cell is (shape, M, what, batch-invariant); only cells present in every file are compared. ``--ratio
experts_nvfp4-shuffled,experts_mxfp4-shuffled`` also prints, per file, one cell kind's time over another's on the
same shape and M (e.g. NVFP4 against MXFP4). The files should come from one machine session (consecutive processes,
same tables unless the tables are what is compared): ratios across machines mix in their differences.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

Cell = tuple[str, int, str, bool]


def cells(result: dict[str, Any]) -> dict[Cell, float]:
    """``{(shape, M, what, batch_invariant): median µs}`` of a results file's records."""
    return {(r["shape"], int(r["M"]), r["what"], bool(r.get("batch_invariant", False))): float(r["median_us"])
            for r in result["records"]}


def compare(results: list[dict[str, Any]], what: Optional[set[str]] = None) -> list[str]:
    """The lines of the cell-by-cell table: the cells every file has (of ``what``, if given), times and ratios
    to the first file."""
    tables = [cells(r) for r in results]
    common = sorted(set.intersection(*(set(t) for t in tables)))
    header = f"{'shape':10s} {'M':>6s} {'what':26s}" + "".join(f"{r.get('commit', '?')[:16]:>18s}" for r in results) \
        + "".join(f"{f'ratio {i + 1}/1':>14s}" for i in range(1, len(results)))
    lines = [header]
    for cell in common:
        if what and cell[2] not in what:
            continue
        shape, m, kind, invariant = cell
        times = [t[cell] for t in tables]
        name = kind + (" (invariant)" if invariant else "")
        lines.append(f"{shape:10s} {m:6d} {name:26s}" + "".join(f"{v:15.1f} us" for v in times)
                     + "".join(f"{v / times[0]:14.3f}" for v in times[1:]))
    return lines


def ratios(results: list[dict[str, Any]], numerator: str, denominator: str) -> list[str]:
    """Per file, ``numerator``'s time over ``denominator``'s on each shape and M both have."""
    lines = [f"{numerator} / {denominator}"]
    for result in results:
        table = cells(result)
        pairs = sorted((s, m) for (s, m, w, inv) in table if w == numerator and not inv
                       and (s, m, denominator, False) in table)
        lines.append(f"  {result.get('commit', '?')}: " + ", ".join(
            f"{s} M={m} {table[(s, m, numerator, False)] / table[(s, m, denominator, False)]:.2f}" for s, m in pairs))
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--what", default=None, help="comma-separated cell kinds (experts, experts_<quant>)")
    parser.add_argument("--ratio", default=None, help="NUMERATOR,DENOMINATOR cell kinds, per file")
    args = parser.parse_args(argv)
    results = [json.loads(path.read_text()) for path in args.files]
    devices = {r.get("device") for r in results}
    if len(devices) > 1:
        print(f"note: the files come from different devices: {sorted(map(str, devices))}", file=sys.stderr)
    print("\n".join(compare(results, set(args.what.split(",")) if args.what else None)))
    if args.ratio:
        numerator, _, denominator = args.ratio.partition(",")
        if not denominator:
            parser.error("--ratio takes NUMERATOR,DENOMINATOR")
        print("\n".join(ratios(results, numerator, denominator)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
