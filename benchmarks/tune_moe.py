"""Tune the grouped-GEMM launch configurations for this GPU (CUDA only).

    python benchmarks/tune_moe.py --shapes qwen3,mixtral [--tokens 1,8,...] [--out FILE]

For each shape and token count it times both GEMMs of the triton path (the gate/up GEMM with the
fused SwiGLU, and the down GEMM) for every candidate configuration, as CUDA-graph replays with the
L2 flushed, on random bf16 data and random softmax routing. Both GEMMs must share ``block_m`` (the
alignment is computed once), so it keeps the ``block_m`` whose best pair is fastest. The result is
merged into ``moeforge/kernels/configs/<device>.json``, which ``MoELayer`` reads for that device;
to support a new GPU, run this script on it and commit the file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import FLUSH_BYTES, SHAPES, TOKENS, time_graph  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, moe_gemm  # noqa: E402
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.config import GemmConfig, device_key, fit_shared_memory, shape_key  # noqa: E402


def candidates(rows_per_expert: float) -> Iterator[GemmConfig]:
    """The search space, pruned by how many rows an expert gets on average."""
    if rows_per_expert <= 4:  # weight-streaming: many narrow tiles, deep pipelines
        space = dict(block_m=[16], block_n=[32, 64], block_k=[128, 256], group_m=[1], num_warps=[4],
                     num_stages=[4, 5])
    elif rows_per_expert <= 48:
        space = dict(block_m=[16, 32], block_n=[64, 128], block_k=[128], group_m=[8], num_warps=[4],
                     num_stages=[3, 4])
    elif rows_per_expert <= 256:
        space = dict(block_m=[64, 128], block_n=[128], block_k=[64], group_m=[8], num_warps=[4, 8],
                     num_stages=[3, 4])
    else:  # arithmetic-bound: big tiles
        space = dict(block_m=[128], block_n=[128, 256], block_k=[64], group_m=[8], num_warps=[8],
                     num_stages=[3, 4])
    for values in itertools.product(*space.values()):
        yield GemmConfig(**dict(zip(space.keys(), values)))


def tune_cell(shape: tuple[int, int, int, int], tokens: int, flush: torch.Tensor, reps: int) -> dict[str, Any]:
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    topk = mf.stages.select_experts(logits, top_k, mf.RoutingConfig())
    hidden_rows = torch.randn(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    out1 = torch.empty(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)
    out2 = torch.empty(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    best: dict[int, dict[str, tuple[float, GemmConfig]]] = {}
    seen: set[tuple[str, GemmConfig]] = set()
    for config in candidates(tokens * top_k / experts):
        plan = align.align_block_size(topk.ids, experts, config.block_m)
        for role, run in (
            ("gate_up", lambda c: moe_gemm.moe_gemm(
                x, w13, out1, *plan, rows_per_a=top_k, config=c, act=ACT_SILU, glu=True)),
            ("down", lambda c: moe_gemm.moe_gemm(
                hidden_rows, w2, out2, *plan, rows_per_a=1, config=c, topk_weights=topk.weights.view(-1))),
        ):
            fitted = fit_shared_memory(config, 2, 2 if role == "gate_up" else 1)
            if (role, fitted) in seen:
                continue
            seen.add((role, fitted))
            try:
                us = time_graph(lambda: run(fitted), reps, flush)
            except Exception as error:  # a configuration the compiler rejects is skipped
                print(f"  skip {role} {fitted}: {type(error).__name__}", flush=True)
                continue
            slot = best.setdefault(config.block_m, {})
            if role not in slot or us < slot[role][0]:
                slot[role] = (us, fitted)
    pairs = {m: v for m, v in best.items() if len(v) == 2}
    block_m = min(pairs, key=lambda m: pairs[m]["gate_up"][0] + pairs[m]["down"][0])
    chosen = pairs[block_m]
    total = chosen["gate_up"][0] + chosen["down"][0]
    print(f"  M={tokens:6d}: block_m={block_m} gate_up {chosen['gate_up'][0]:.1f} us {chosen['gate_up'][1]}, "
          f"down {chosen['down'][0]:.1f} us {chosen['down'][1]} (total {total:.1f} us)", flush=True)
    as_dict = lambda c: dict(block_m=c.block_m, block_n=c.block_n, block_k=c.block_k, group_m=c.group_m,  # noqa: E731
                             num_warps=c.num_warps, num_stages=c.num_stages)
    return dict(gate_up=as_dict(chosen["gate_up"][1]), down=as_dict(chosen["down"][1]), us=round(total, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="default: moeforge/kernels/configs/<device>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_moe.py needs a CUDA device")
    device = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parents[1] / "moeforge" / "kernels" / "configs" / f"{device_key(device)}.json")
    table = json.loads(out.read_text()) if out.exists() else {}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        key = shape_key(*shape, "bf16")
        print(f"{name} {key}", flush=True)
        entries = table.setdefault(key, {})
        for tokens in (int(t) for t in args.tokens.split(",")):
            entries[str(tokens)] = tune_cell(shape, tokens, flush, args.reps)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(table, indent=1, sort_keys=True))  # progress survives a time-out
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
