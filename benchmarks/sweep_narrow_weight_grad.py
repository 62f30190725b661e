"""Time an adapter's four weight gradients with the narrow kernel's candidate tiles (CUDA only).

    python benchmarks/sweep_narrow_weight_grad.py [--cells qwen3:4096,qwen3:1024,mixtral:4096] [--rank 16] [--out FILE]

A rank-``r`` adapter on gate/up and down gives four weight gradients narrow on one side: ``B`` of the gate/up
(``d_pre [C, 2I]`` against the low-rank rows ``[C, r]``), ``A`` of the gate/up (the low-rank gradient ``[C, r]``
against the tokens' rows ``[M, H]``, ``top_k`` copies a row), ``B`` and ``A`` of the down (``[C, H]`` against
``[C, r]``, ``[C, r]`` against ``h [C, I]``). For each, on random (never zero) bf16 data and a random routing aligned
in blocks of 128 as the training step aligns it: the Gluon weight-gradient kernel loading rows by index with its
``expert_runs`` launch (what ran before :mod:`moeforge.kernels.narrow_weight_grad`), the narrow kernel with every
candidate :class:`NarrowTiles`, and its default tiles — CUDA-graph replays taken in turns with the L2 flushed
(medians), each result checked against the Gluon one's. Prints the best candidates per cell and writes JSON
(device, commit, date, records).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeforge.kernels import align, weight_grad  # noqa: E402
from moeforge.kernels.narrow_weight_grad import NarrowTiles, narrow_weight_grad  # noqa: E402
from bench_moe import FLUSH_BYTES, SHAPES, time_graphs_interleaved  # noqa: E402
from provenance import write_results  # noqa: E402

GLUON = "gluon by index + runs"
DEFAULT = "narrow, default tiles"
BLOCK = 128  # the alignment's block (the training tables' at these shapes)


def candidates() -> dict[str, NarrowTiles]:
    return {f"w{w} m{m} {nw}w {st}s": NarrowTiles(w, m, nw, st)
            for w, m, nw, st in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="qwen3:4096,qwen3:1024,mixtral:4096", help="shape:tokens, comma-separated")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").random_()
    bf16, r = torch.bfloat16, args.rank
    records: list[dict[str, Any]] = []
    for cell in args.cells.split(","):
        shape, tokens_text = cell.split(":")
        tokens = int(tokens_text)
        experts, top_k, hidden, inter = SHAPES[shape]
        copies = tokens * top_k
        torch.manual_seed(0)
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
        plan = align.align_block_size(ids, experts, BLOCK)

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, device="cuda", dtype=bf16)

        ops = {"B of gate/up": (rand(copies, 2 * inter), rand(copies, r), 1),
               "A of gate/up": (rand(copies, r), rand(tokens, hidden), top_k),
               "B of down": (rand(copies, hidden), rand(copies, r), 1),
               "A of down": (rand(copies, r), rand(copies, inter), 1)}
        for name, (dy, x, rows_per_x) in ops.items():
            n, k = dy.shape[1], x.shape[1]
            gluon_tiles = weight_grad.weight_grad_tiles(n, k, bf16, BLOCK, dy.device, copies / experts)

            def gluon(dy: torch.Tensor = dy, x: torch.Tensor = x, rows_per_x: int = rows_per_x) -> Any:
                return weight_grad.expert_weight_grad(dy, x, rows_per_x, *plan, experts, BLOCK, False, bf16,
                                                      tiles=gluon_tiles)[0]

            def narrow(tiles: NarrowTiles | None, dy: torch.Tensor = dy, x: torch.Tensor = x,
                       rows_per_x: int = rows_per_x) -> Callable[[], Any]:
                return lambda: narrow_weight_grad(dy, x, rows_per_x, *plan, experts, BLOCK, bf16, tiles)

            want = gluon().float()
            fns: dict[str, Callable[[], Any]] = {GLUON: gluon, DEFAULT: narrow(None)}
            errors: dict[str, Any] = {}
            for label, tiles in candidates().items():
                try:
                    got = narrow(tiles)().float()
                except Exception as error:  # (tiles that do not fit the shared memory)
                    errors[label] = repr(error)[:120]
                    continue
                errors[label] = ((got - want).abs().max() / want.abs().max()).item()
                fns[label] = narrow(tiles)
            times = time_graphs_interleaved(fns, args.reps, flush)
            best = sorted(((label, t) for label, t in times.items() if label not in (GLUON, DEFAULT)),
                          key=lambda item: item[1])[:5]
            print(f"{shape} M={tokens} {name} [{n} x {k}]: gluon {times[GLUON]:.1f} us, default {times[DEFAULT]:.1f}; "
                  "best " + ", ".join(f"{label} {t:.1f}" for label, t in best), flush=True)
            records.append(dict(shape=shape, M=tokens, gradient=name, n=n, k=k, times_us=times, errors=errors))
    write_results("sweep_narrow_weight_grad", torch.cuda.get_device_name(), records, args.out, rank=args.rank,
                  block=BLOCK)


if __name__ == "__main__":
    main()
