"""A victim under the fuzzer's load: does a triton layer give the same bits every call while other processes load
the GPU with many different kernels? Written for a report (docs/kernels.md, "The warp-specialised kernel's wrong
rows under load": two wrong results on Mixtral-8x7B's shape at M >= 1024 while eight fuzzer processes shared one H200,
neither reproduced alone).

``--load`` processes run the fuzzer's cases (``tests/fuzz_layers.py``'s workers, from seed ``--first`` on: varied
layers, training and inference, some near the GPU's memory limit), while two victim processes call the same layers
over and over — Mixtral-8x7B's shape at 1024 and 2048 tokens, bf16, random weights — one with the warp-specialised
Gluon gate/up GEMM wherever it takes the tile (:func:`force_warp_specialized`: not only the table's entries), the
other with it refused (``warp_specialized.problem`` patched: ``moe_gemm`` serves). Each victim call compares,
bit for bit with the victim's first call of that layer:

* the router's logits (``layer.router_logits(x)``: a cuBLAS GEMM);
* the experts alone, on the first call's logits (``layer(x, logits)``);
* the whole layer (``layer(x)``);
* the same layer built with decode graphs, on the first call's logits (its first call eager, then replays).

Writes ``victim_<with|without>_warp_specialized.json`` (counts, the first mismatches with the rows they touch and
whether they are finite) and the load's fuzzer records into ``--out``, and prints a summary.

    PYTHONPATH=. python3 benchmarks/victim_under_load.py --out DIR --seconds 300 --load 6
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/victim_under_load.py --out DIR --seconds 60 --load 1 --cpu
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MIXTRAL = dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)


def _layers(cpu: bool) -> list[tuple[str, dict[str, Any], int]]:
    if cpu:  # (the interpreter: tiny shapes, fp32)
        return [("tiny-5", dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=48), 5)]
    return [("mixtral-1024", MIXTRAL, 1024), ("mixtral-2048", MIXTRAL, 2048)]


def mismatch(got: Any, want: Any, **where: Any) -> dict[str, Any]:
    """A record of a call whose bits differ from the first call's: ``where`` it happened, the rows (first dimension)
    that differ, the first eight of them, and whether the output is finite."""
    import torch

    bad = (got.float() != want.float()).reshape(want.shape[0], -1).any(-1)
    return dict(**where, rows=int(bad.sum()), first_rows=bad.nonzero().flatten()[:8].tolist(),
                finite=bool(torch.isfinite(got.float()).all()))


def force_warp_specialized() -> None:
    """In this process, every layer's gate/up launch configuration that the warp-specialised Gluon GEMM takes marked
    ``warp_specialized`` (the shipped tables mark the large-batch entries only): a patch of
    :meth:`moeforge.kernels.config.ConfigTable.lookup`."""
    import attrs

    from moeforge.kernels import gluon_grouped_gemm
    from moeforge.kernels.config import ConfigTable

    lookup = ConfigTable.lookup

    def marked(table: ConfigTable, num_tokens: int) -> Any:
        config = lookup(table, num_tokens)
        if gluon_grouped_gemm.tile_problem(config.gate_up, glu=True) is None:
            config = attrs.evolve(config, gate_up=attrs.evolve(config.gate_up, warp_specialized=True))
        return config

    ConfigTable.lookup = marked  # type: ignore[method-assign]


def victim(warp_specialized: bool, seconds: float, out_dir: str, cpu: bool) -> None:
    import torch

    import fuzz_layers as fz
    from moeforge.decode_graphs import DecodeGraphSettings
    from moeforge.kernels import warp_specialized as ws

    if warp_specialized:
        force_warp_specialized()
    else:
        ws.problem = lambda *args, **kwargs: "refused for this experiment"  # type: ignore[assignment]
    device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    made = []
    for name, sizes, tokens in _layers(cpu):
        case = dict(seed=11, family=None if cpu else "mixtral", sizes=sizes, tokens=tokens, dtype=dtype, train=False,
                    quant=None, options=dict(dtype=dtype, environ={}), skew=None, decode_graphs=None)
        layer = fz.triton_layer(case, device)
        graphed = fz.triton_layer(case, device, decode_graphs=DecodeGraphSettings(max_tokens=tokens, max_graphs=1))
        x = torch.randn(tokens, sizes["hidden_size"], device=device, dtype=dtype)
        with torch.no_grad():
            logits = layer.router_logits(x)
            first = dict(router=logits, experts=layer(x, logits), layer=layer(x, None))
        made.append((name, layer, graphed, x, first))
    parts = ("router", "experts", "layer", "decode graphs")
    counts = {name: {part: [0, 0] for part in parts} for name, *_ in made}  # [calls, mismatches]
    mismatches: list[dict[str, Any]] = []
    deadline = time.time() + seconds
    while time.time() < deadline:
        for name, layer, graphed, x, first in made:
            with torch.no_grad():
                got = dict(router=layer.router_logits(x), experts=layer(x, first["router"]), layer=layer(x, None))
                got["decode graphs"] = graphed(x, first["router"])
            for part in parts:
                want = first["experts" if part == "decode graphs" else part]
                counts[name][part][0] += 1
                if not torch.equal(fz._bits(got[part]), fz._bits(want)):
                    counts[name][part][1] += 1
                    if len(mismatches) < 20:
                        mismatches.append(mismatch(got[part], want, layer=name, part=part,
                                                   at=round(time.time() - deadline + seconds, 1)))
    label = "with" if warp_specialized else "without"
    result = dict(warp_specialized=warp_specialized, seconds=seconds, counts=counts, mismatches=mismatches,
                  refusals={name: graphed.decode_graphs.refusals() for name, _, graphed, *_ in made})
    with open(f"{out_dir}/victim_{label}_warp_specialized.json", "w") as f:
        json.dump(result, f, indent=1)


class Load:
    """``count`` fuzzer processes (``tests/fuzz_layers.py``'s workers, seeds from ``first`` on, their records into
    ``out``), started at once, none starting a case after ``seconds``."""

    def __init__(self, context: Any, count: int, first: int, seconds: float, out: str, cpu: bool) -> None:
        import fuzz_layers as fz

        # (held here until the workers end: a queue freed in this process takes its semaphores with it)
        self.seeds = context.Queue()
        for seed in range(first, first + 100000):
            self.seeds.put(seed)
        self.seeds.cancel_join_thread()  # (the seeds left in the queue must not hold this process's exit)
        self.deadline = time.time() + seconds
        self.processes = [context.Process(target=fz._worker, args=(slot, self.seeds, self.deadline,
                                                                   f"{out}/load.json", cpu), daemon=True)
                          for slot in range(count)]
        for process in self.processes:
            process.start()

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The options of a script that runs under this load: ``--out``, ``--load``, ``--first``, ``--cpu``."""
        parser.add_argument("--out", required=True, help="a directory for the results")
        parser.add_argument("--load", type=int, default=6, help="fuzzer processes")
        parser.add_argument("--first", type=int, default=20000, help="the load's first fuzzer seed")
        parser.add_argument("--cpu", action="store_true",
                            help="tiny shapes on CPU (set TRITON_INTERPRET=1): a dry run")

    def stop(self, grace: float) -> None:
        """Wait for the workers until ``grace`` seconds past the deadline, then kill those still running."""
        for process in self.processes:
            process.join(max(0.0, self.deadline + grace - time.time()))
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    Load.add_arguments(parser)
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    victims = [context.Process(target=victim, args=(flag, args.seconds, args.out, args.cpu)) for flag in (True, False)]
    for process in victims:
        process.start()
    load = Load(context, args.load, args.first, args.seconds, args.out, args.cpu)
    for process in victims:
        process.join(args.seconds + 300)
    load.stop(120)
    for flag in ("with", "without"):
        try:
            with open(f"{args.out}/victim_{flag}_warp_specialized.json") as f:
                result = json.load(f)
        except FileNotFoundError:
            print(f"{flag} the warp-specialised kernel: no result")
            continue
        print(f"{flag} the warp-specialised kernel: {result['counts']}")
        for record in result["mismatches"][:5]:
            print("  ", record)
    outcomes: dict[str, int] = {}
    for slot in range(args.load):
        try:
            with open(f"{args.out}/load.json.w{slot}.jsonl") as log:
                for line in log:
                    outcome = json.loads(line)["outcome"]
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
        except FileNotFoundError:
            pass
    print("the load's cases:", outcomes)


if __name__ == "__main__":
    main()
