"""Time layers under two launch tables in one process, in rounds of alternating order (CUDA only).

    python benchmarks/ab_tables.py BEFORE.json AFTER.json [--shapes mixtral,qwen3] [--formats bf16,w4a16,mxfp4]
                                   [--tokens 4096,16384] [--rounds 3] [--reps 20] [--out FILE]

BEFORE and AFTER are launch-table files in the format of ``moeforge/kernels/configs/<device>.json`` (e.g. the
committed file and an edited or re-tuned copy). Each layer (shape, format) is built once, so both tables run on
the same weights; for each token count the expert computation (top-k ids to the combined output, as
``bench_moe.py``'s ``experts``) runs under each table's entry on the same routing, as CUDA-graph replays with the
L2 flushed, in ``--rounds`` rounds of alternating order (before, after, after, before, ...) so that a steady drift
of the clocks falls on both alike (the second of two identical tables measured up to 7 % slower at Mixtral
M = 16384 on an H100 in before-after rounds). Consecutive processes with one table each (the A/Bs in
docs/notes/kernels-log.md before this script) moved some cells by a few per cent between runs of the same code.

It prints, per cell, each table's median over its rounds (of medians of ``--reps`` replays) and after / before,
and writes JSON (device, commit, date, records with both times, every round's and the ratio). A format whose
table is absent from a file runs that file's fallback, as the layer would on that device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import (  # noqa: E402
    DEFAULT_SHAPES, FLUSH_BYTES, QUANT_METHODS, build_layer, held_formats, launch_entry, random_batch, shape_of,
    time_graph)
from provenance import measured_commit  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.kernels.config import ConfigTable, device_key, device_tables  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402


def layer_table(layer: mf.MoELayer, tables: dict[str, Any]) -> ConfigTable:
    """The launch table ``layer`` would read if ``tables`` were its device's file (``LayerConfig.kernel_configs``)."""
    quant = layer.quant
    return ConfigTable.from_tables(tables, layer.num_experts, layer.top_k, layer.hidden_size, layer.intermediate_size,
                                   "bf16", max_block_m=quant.max_block_m, dequant_blocks=quant.dequant_blocks,
                                   weight_format=quant.table_key)


def experts_span(layer: mf.MoELayer, table: ConfigTable) -> mf.Pipeline:
    """The layer's pipeline after its top-k, every stage that reads a launch table reading ``table`` (the dispatch
    aligns by it and the GEMMs take their tiles from it: they must agree, which the pipeline checks)."""
    stages = [attrs.evolve(stage, configs=table) if hasattr(stage, "configs") else stage
              for stage in layer.pipeline.stages[1:]]
    return mf.Pipeline(stages, layer.pipeline.specs[0])


def own_table(layer: mf.MoELayer) -> ConfigTable:
    return next(stage.configs for stage in layer.pipeline.stages if hasattr(stage, "configs"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated: names of bench_moe.SHAPES, or a shape written out as ExkxHxI "
                             "(64x8x2048x1024)")
    parser.add_argument("--formats", default="bf16", help=f"comma-separated, of bf16, {', '.join(QUANT_METHODS)}")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--commit", default=None, help="the commit measured (default: HEAD's, "
                        "+changes when the tracked files differ from it: provenance.py)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/ab_tables-<device>-<date>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ab_tables.py needs a CUDA device")
    files = {"before": json.loads(args.before.read_text()), "after": json.loads(args.after.read_text())}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    device = torch.cuda.get_device_name()
    print(f"{device}: {args.before} (before) against {args.after} (after), {args.rounds} rounds", flush=True)
    records = []
    for name in args.shapes.split(","):
        shape = shape_of(name)
        experts, top_k, hidden, _ = shape
        for fmt in held_formats(name, args.formats.split(",")):
            torch.manual_seed(0)
            layer = build_layer(shape, fmt)
            torch.cuda.empty_cache()
            # On the committed file layer_table() must give the layer's own table (the same lookup arguments).
            if layer_table(layer, device_tables(device)) != own_table(layer):
                sys.exit(f"{name} {fmt}: layer_table() does not reproduce the layer's own launch table")
            launch = {side: layer_table(layer, tables) for side, tables in files.items()}
            spans = {side: experts_span(layer, table) for side, table in launch.items()}
            for tokens in (int(t) for t in args.tokens.split(",")):
                x, logits = random_batch(tokens, hidden, experts)
                topk = mf.stages.select_experts(logits, top_k, layer.routing)
                routed = RoutedTokens(Activations(x), TopKOutput(topk.weights, topk.ids))
                rounds: dict[str, list[float]] = {side: [] for side in spans}
                with torch.no_grad():
                    for index in range(args.rounds):  # before, after, after, before, ...: a steady drift cancels
                        for side, span in (spans.items() if index % 2 == 0 else reversed(spans.items())):
                            rounds[side].append(time_graph(lambda: span(routed), args.reps, flush))
                times = {side: statistics.median(values) for side, values in rounds.items()}
                ratio = times["after"] / times["before"]
                entries = {side: launch_entry(table, fmt, tokens) for side, table in launch.items()}
                records.append(dict(shape=name, M=tokens, format=fmt, before_us=round(times["before"], 2),
                                    after_us=round(times["after"], 2), ratio=round(ratio, 3),
                                    rounds_us={s: [round(v, 2) for v in r] for s, r in rounds.items()},
                                    entries=entries))
                print(f"{name:9s} {fmt:15s} M={tokens:6d} before {times['before']:10.1f} us  after "
                      f"{times['after']:10.1f} us  after/before {ratio:6.3f}", flush=True)
            del layer, spans, launch
            torch.cuda.empty_cache()
    result = dict(device=device, commit=args.commit or measured_commit(), date=datetime.date.today().isoformat(),
                  before=str(args.before), after=str(args.after), rounds=args.rounds, reps=args.reps, records=records)
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"ab_tables-{device_key(device)}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
