"""``python -m moeforge demo``: build a Mixtral-shaped layer, describe it, check it, time it."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Optional

import torch

from moeforge.layer import MoELayer
from moeforge.reference import layer_reference

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moeforge demo",
        description="Build a Mixtral-shaped MoE layer (8 experts, top-2, SwiGLU; small sizes by default "
        "on CPU), print its pipeline, check it against the dense float64 reference and time it.",
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None, help="default 256 on CPU, 4096 on GPU")
    parser.add_argument("--intermediate", type=int, default=None, help="default 512 on CPU, 14336 on GPU")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dispatcher", choices=("sorted", "padded"), default="sorted")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _time_forward(layer: MoELayer, x: torch.Tensor, repeats: int) -> float:
    """Median wall time of one forward in milliseconds (synchronised on GPU)."""
    cuda = x.device.type == "cuda"
    for _ in range(2):  # warm-up
        layer(x)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    hidden = args.hidden or (4096 if on_gpu else 256)
    intermediate = args.intermediate or (14336 if on_gpu else 512)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(args.seed)

    layer = MoELayer(args.experts, args.top_k, hidden, intermediate, dispatcher=args.dispatcher,
                     dtype=dtype, device=device)
    print(f"MoELayer: {args.experts} experts, top-{args.top_k}, hidden {hidden}, intermediate "
          f"{intermediate}, {args.dtype} on {device}\n")
    print(layer.describe())

    x = torch.randn(args.tokens, hidden, dtype=dtype, device=device)
    with torch.no_grad():
        out = layer(x)
        reference = layer_reference(layer, x)
    error = float((out.double() - reference).norm() / reference.norm().clamp(min=1e-30))
    tolerance = _TOLERANCE[dtype]
    verdict = "ok" if error <= tolerance else "MISMATCH"
    print(f"\ncheck vs dense float64 reference: relative L2 error {error:.2e} "
          f"(tolerance {tolerance:.0e}): {verdict}")
    with torch.no_grad():
        ms = _time_forward(layer, x, args.repeats)
    print(f"forward time ({args.tokens} tokens, torch backend, median of {args.repeats}): {ms:.2f} ms")
    return 0 if verdict == "ok" else 1
