"""Plot the training step of the experts from ``benchmarks/bench_train.py`` results (the README's training figure):
per shape, the share of the same run's bf16 matmul peak that moeforge's step and ``torch._grouped_mm`` + autograd's
reach against the token count M, and moeforge's speed-up on it.

    python benchmarks/plot_train.py [RESULTS.json] [--out docs/training.png]

Needs matplotlib (the ``plot`` extra); :func:`series` (the data) does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
DEFAULT_FILE = RESULTS / "bench_train_slot_rows-nvidia_h200-2026-11-30-7315de1.json"  # the README's table
# (moeforge_slot_order: a --slot-rows both run's slot-order step, the layout the rule takes at every cell since 7315de1)
PATHS = {"moeforge": "moeforge", "moeforge_slot_order": "moeforge", "torch_grouped_mm": "torch._grouped_mm + autograd"}
SPEEDUP_TARGET = 1.5  # issue 39's bar (or 80 % of the peak, whichever is lower for a cell)


def series(result: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{shape: {"moeforge" | "torch._grouped_mm + autograd": [(M, % of peak)], "speed-up": [(M, x)]}}`` from one
    ``bench_train.py`` result, each sorted by M: the timed steps' records (not the memory or kernel listings, nor
    SonicMoE's cell); the speed-up is torch's time over moeforge's, at the M where both ran."""
    found: dict[str, dict[str, dict[int, float]]] = {}
    times: dict[str, dict[str, dict[int, float]]] = {}
    for record in result["records"]:
        path = PATHS.get(record.get("what", ""))
        if path is None or "median_us" not in record:
            continue
        shape, tokens = record["shape"], int(record["M"])
        found.setdefault(shape, {}).setdefault(path, {})[tokens] = float(record["pct_peak"])
        times.setdefault(shape, {}).setdefault(path, {})[tokens] = float(record["median_us"])
    data: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for shape in found:
        data[shape] = {path: sorted(points.items()) for path, points in found[shape].items()}
        ours, theirs = times[shape].get(PATHS["moeforge"], {}), times[shape].get(PATHS["torch_grouped_mm"], {})
        data[shape]["speed-up"] = [(m, theirs[m] / ours[m]) for m in sorted(ours) if m in theirs]
    return data


def plot(data: dict[str, dict[str, list[tuple[int, float]]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (share, speedup) = plt.subplots(1, 2, figsize=(12, 5), dpi=100)
    for index, (shape, lines) in enumerate(data.items()):
        colour = f"C{index}"
        for path, style in ((PATHS["moeforge"], "-"), (PATHS["torch_grouped_mm"], "--")):
            points = lines.get(path, [])
            share.plot([m for m, _ in points], [p for _, p in points], linestyle=style, marker="o", markersize=3,
                       color=colour, label=f"{shape}, {path}")
        points = lines["speed-up"]
        speedup.plot([m for m, _ in points], [x for _, x in points], marker="o", markersize=3, color=colour,
                     label=shape)
    for axes in (share, speedup):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("tokens M")
    share.set_ylabel("% of the run's bf16 matmul peak")
    share.set_title("solid: moeforge, dashed: torch._grouped_mm + autograd", fontsize=8)
    share.set_ylim(0, 100)
    speedup.set_ylabel("speed-up on torch._grouped_mm + autograd")
    speedup.set_title(f"dotted: {SPEEDUP_TARGET}x", fontsize=8)
    speedup.axhline(SPEEDUP_TARGET, color="grey", linewidth=0.7, linestyle=":")
    speedup.axhline(1, color="grey", linewidth=0.5)
    speedup.set_ylim(0, max([2.0] + [x for lines in data.values() for _, x in lines["speed-up"]]) * 1.1)
    share.legend(fontsize=6, ncol=2, loc="lower right")
    speedup.legend(fontsize=7, loc="lower right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_FILE)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "docs" / "training.png")
    args = parser.parse_args()
    result = json.loads(args.results.read_text())
    title = (f"Training step of the experts, {result['device']}, {result['commit']}, {result['date']} "
             f"(CUDA-graph replays in turns; step flops: 3x the forward's)")
    plot(series(result), args.out, title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
