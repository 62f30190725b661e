"""Plot % of the roofline against the token count M, one line per shape and format, from
``benchmarks/bench_moe.py`` results (the README's performance figure).

    python benchmarks/plot_roofline.py [RESULTS.json ...] [--out docs/roofline.png]

Only the read-bandwidth roofline is plotted (max(flops / matmul peak, bytes / HBM read bandwidth), both
measured in the run): files written before bench_moe.py dropped the copy-bandwidth roofline give their
``pct_roofline_read``; series with no read-bandwidth figure are left out. Needs matplotlib (the ``plot``
extra); :func:`series` (the data) does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# The current H100 results: every format of each shape at one commit (7c50a09), and the batch-invariant mode's
# bf16 cells (b17c440). Earlier runs are in git history (benchmarks/results/INDEX.md); where several files are
# given, later files win.
DEFAULT_FILES = (
    RESULTS / "bench_moe_invariant-nvidia_h100_80gb_hbm3-2026-11-24-b17c440.json",
    *(RESULTS / f"bench_moe_all_formats_{shape}-nvidia_h100_80gb_hbm3-2026-11-27-7c50a09.json"
      for shape in ("mixtral", "qwen3", "deepseek", "gptoss")),
)
FORMATS = {"experts": "bf16", "experts_batch_invariant": "bf16 batch-invariant"}


def _read_pct(result: dict[str, Any], record: dict[str, Any]) -> float | None:
    """The record's % of the read-bandwidth roofline, or ``None`` when the file has none."""
    if "pct_roofline_read" in record:
        return float(record["pct_roofline_read"])
    if "bandwidth_tbps" in result:  # an older file: its pct_roofline is against the copy bandwidth
        return None
    return float(record["pct_roofline"]) if "pct_roofline" in record else None


def series(paths: list[Path]) -> dict[str, list[tuple[int, float]]]:
    """``{"<shape> <format> (<dates>)": [(M, % of the read roofline), ...]}`` sorted by M; where two files
    measured the same shape, format and M, the later file's figure is kept."""
    found: dict[tuple[str, str], dict[int, tuple[float, str]]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        for record in result["records"]:
            what = record["what"]
            if what in ("layer", "by_hand") or what.startswith("baseline"):
                continue
            pct = _read_pct(result, record)
            if pct is None:
                continue
            fmt = FORMATS.get(what, what.removeprefix("experts_"))
            found.setdefault((record["shape"], fmt), {})[int(record["M"])] = (pct, result.get("date", "?"))
    data = {}
    for (shape, fmt), points in sorted(found.items()):
        dates = ", ".join(sorted({date for _, date in points.values()}))
        data[f"{shape} {fmt} ({dates})"] = [(m, pct) for m, (pct, _) in sorted(points.items())]
    return data


def plot(data: dict[str, list[tuple[int, float]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 8.5), dpi=100)
    styles: dict[str, Any] = {"bf16": "-", "bf16 batch-invariant": ":", "mxfp4": "--", "nvfp4": "-.",
                              "w4a16": (0, (5, 1, 1, 1, 1, 1)), "fp8": (0, (8, 2, 2, 2)), "fp8-channel": (0, (1, 2)),
                              "int8": (0, (3, 3)), "mxfp4-shuffled": (0, (6, 2)), "nvfp4-shuffled": (0, (6, 2, 1, 2))}
    colours: dict[str, Any] = {}
    for label, points in data.items():
        shape, fmt = label.split(" ", 1)[0], label.split(" ", 1)[1].rsplit(" (", 1)[0]
        colour = colours.setdefault(shape, f"C{len(colours)}")
        axes.plot([m for m, _ in points], [p for _, p in points], linestyle=styles.get(fmt, "-"), marker="o", markersize=3,
                  color=colour, label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens M")
    axes.set_ylabel("% of roofline (matmul peak, HBM read bandwidth)")
    axes.axhline(100, color="grey", linewidth=0.5)
    axes.set_title(title)
    figure.legend(fontsize=7, ncol=3, loc="lower center")
    figure.tight_layout(rect=(0, 0.24, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", type=Path, default=list(DEFAULT_FILES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "docs" / "roofline.png")
    args = parser.parse_args()
    devices = {json.loads(p.read_text())["device"] for p in args.results}
    plot(series(args.results), args.out, f"moeforge expert computation, {', '.join(sorted(devices))}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
