"""Where does the warp-specialised gate/up GEMM's wrong result under a loaded GPU enter? Written for the report in
docs/kernels.md, "The warp-specialised kernel's wrong rows under load", which says what it found (the kernel right
after the alignment that made its plan, or queued behind another call; the fix, 95ae274, and this script's run after
it); kept as the check of any change to that kernel's barriers or shared memory.

One process calls, in turns, each of these parts on Mixtral-8x7B's shape (bf16, ``--tokens`` tokens, random weights,
the warp-specialised kernel forced on for every gate/up tile it takes) and compares each call's bits with the part's
first call — first ``--alone`` seconds alone, then ``--loaded`` seconds beside ``--load`` fuzzer processes
(``tests/fuzz_layers.py``'s workers):

* ``kernel``: the gate/up GEMM alone on a plan made once (the probe's case);
* ``plan+kernel``: the alignment (unordered, as inference makes it) from the same top-k ids, then the GEMM, each call;
* ``experts after sync`` / ``experts queued``: the layer on given router logits, after ``torch.cuda.synchronize()``
  or right behind the part before it in the stream;
* ``layer after sync`` / ``layer queued``: the whole layer (its router's GEMM and top-k included), the same two ways;
* ``training step``: the gradients of the tokens and both expert weights on given logits (the warp-specialised Gluon
  weight gradient where the device runs it; the gate/up GEMM runs unfused there, on ``moe_gemm``).

``--no-pdl`` runs every kernel without programmatic dependent launch (``moeforge.kernels.pdl.applies`` patched in the
process). Writes ``bisect.json`` into ``--out`` (each part's [calls, mismatches] by phase, the first mismatches: rows,
whether finite, the time) and prints a summary.

    PYTHONPATH=. python3 benchmarks/bisect_ws_under_load.py --out DIR --alone 30 --loaded 150 --load 6 [--no-pdl]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/bisect_ws_under_load.py --out DIR --alone 5 --loaded 5 \
        --load 1 --cpu
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from victim_under_load import MIXTRAL, Load, force_warp_specialized, mismatch  # noqa: E402


def parts(tokens: int, cpu: bool) -> dict[str, Callable[[], Any]]:
    """Each part's call, on one layer and one batch."""
    import torch

    import fuzz_layers as fz
    from moeforge.kernels import ops
    from moeforge.kernels import gluon_grouped_gemm as gluon_gemm
    from moeforge.kernels.activations import ACT_SILU
    from moeforge.kernels.grouped_gemm_call import GemmEpilogue, GemmRoute, GemmRows, GemmWeight, grouped_gemm

    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    sizes = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=48) if cpu else MIXTRAL
    case = dict(seed=11, family=None if cpu else "mixtral", sizes=sizes, tokens=tokens, dtype=dtype, train=False,
                quant=None, options=dict(dtype=dtype, environ={}), skew=None, decode_graphs=None)
    layer = fz.triton_layer(case, device)
    x = torch.randn(tokens, sizes["hidden_size"], device=device, dtype=dtype)
    with torch.no_grad():
        logits = layer.router_logits(x)
    ids = torch.topk(logits, sizes["top_k"], dim=-1).indices.to(torch.int32)
    config = layer.pipeline.stages[1].configs.lookup(tokens).gate_up
    fixed = ops.align_block_size(ids, sizes["num_experts"], config.block_m, False)
    w13 = layer.w13_weight.detach()
    copies = tokens * sizes["top_k"]

    def gate_up(plan: tuple[torch.Tensor, ...]) -> torch.Tensor:
        route = GemmRoute(*plan, copies, aligned_block_m=config.block_m)
        return grouped_gemm(GemmRows(x, rows_per_a=sizes["top_k"]), GemmWeight(w13), route,
                            GemmEpilogue(dtype, act=ACT_SILU, glu=True), config)[0]

    def synced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            if not cpu:
                torch.cuda.synchronize()
            return fn()
        return call

    upstream = torch.randn_like(x)

    def training_step() -> torch.Tensor:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            out = layer(leaf, logits)
            grads = torch.autograd.grad(out, (leaf, layer.w13_weight, layer.w2_weight), upstream)
        return torch.cat([g.reshape(-1) for g in grads])

    if not cpu and gluon_gemm.device_problem(x.device) is not None:
        raise SystemExit(gluon_gemm.device_problem(x.device))
    return {
        "kernel": lambda: gate_up(fixed),
        "plan+kernel": lambda: gate_up(ops.align_block_size(ids, sizes["num_experts"], config.block_m, False)),
        "experts after sync": synced(lambda: layer(x, logits)),
        "experts queued": lambda: layer(x, logits),
        "layer after sync": synced(lambda: layer(x, None)),
        "layer queued": lambda: layer(x, None),
        "training step": training_step,
    }


def bisect(out_dir: str, tokens: int, alone: float, loaded: float, no_pdl: bool, cpu: bool, started: Any) -> None:
    import torch

    import fuzz_layers as fz
    from moeforge.kernels import pdl

    force_warp_specialized()
    if no_pdl:
        pdl.applies = lambda *args, **kwargs: False  # type: ignore[assignment]
    with torch.no_grad():
        calls = parts(tokens, cpu)
        first = {name: call().clone() for name, call in calls.items()}
    counts = {name: {"alone": [0, 0], "loaded": [0, 0]} for name in calls}
    mismatches: list[dict[str, Any]] = []
    begun = time.time()
    while time.time() < begun + alone + loaded:
        phase = "alone" if time.time() < begun + alone else "loaded"
        if phase == "loaded":
            started.set()
        with torch.no_grad():
            got = {name: call() for name, call in calls.items()}
        for name, value in got.items():
            counts[name][phase][0] += 1
            if torch.equal(fz._bits(value), fz._bits(first[name])):
                continue
            counts[name][phase][1] += 1
            if len(mismatches) < 40:
                mismatches.append(mismatch(value, first[name], part=name, phase=phase,
                                           at=round(time.time() - begun, 1)))
    Path(out_dir, "bisect.json").write_text(json.dumps(dict(tokens=tokens, alone=alone, loaded=loaded, no_pdl=no_pdl,
                                                            counts=counts, mismatches=mismatches), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    Load.add_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--alone", type=float, default=30.0, help="seconds before the load starts")
    parser.add_argument("--loaded", type=float, default=150.0, help="seconds beside the load")
    parser.add_argument("--no-pdl", action="store_true", help="every kernel without programmatic dependent launch")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    prober = context.Process(target=bisect, args=(args.out, 16 if args.cpu else args.tokens, args.alone,
                                                  args.loaded, args.no_pdl, args.cpu, started))
    prober.start()
    while not started.is_set() and prober.is_alive():
        time.sleep(0.2)
    load = Load(context, args.load, args.first, args.loaded, args.out, args.cpu)
    prober.join(args.loaded + 300)
    load.stop(60)
    try:
        result = json.loads(Path(args.out, "bisect.json").read_text())
    except FileNotFoundError:
        raise SystemExit("the probing process wrote no result")
    for name, phases in result["counts"].items():
        print(f"{name:20s} " + "  ".join(f"{phase} {calls} calls, {bad} mismatches" for phase, (calls, bad)
                                          in phases.items()))
    for record in result["mismatches"][:10]:
        print("  ", record)


if __name__ == "__main__":
    main()
