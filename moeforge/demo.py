"""``python -m moeforge demo``: build a Mixtral-shaped layer, describe it, check it, time it."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from typing import Optional

import torch

from moeforge.errors import MoEForgeError
from moeforge.layer import MoELayer
from moeforge.reference import layer_reference

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
_PROG = "python -m moeforge demo"


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the option in its error message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _device(text: str) -> torch.device:
    """argparse type: a device this PyTorch can allocate on (checked now, not inside the layer)."""
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} ({error})") from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise argparse.ArgumentTypeError(
                f"this PyTorch ({torch.__version__}) is a CPU build without CUDA; use --device cpu, or install "
                "a CUDA build of PyTorch")
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("no CUDA device is available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: there are {torch.cuda.device_count()} CUDA device(s) (indices from 0)")
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError) as error:  # torch asserts for backends it was built without
            raise argparse.ArgumentTypeError(f"{text!r} is not usable here: {error}") from None
    return device


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options on ``parser`` (the ``demo`` sub-command of ``python -m moeforge``)."""
    parser.description = (
        "Build a Mixtral-shaped MoE layer (8 experts, top-2, SwiGLU; small sizes by default on CPU, "
        "Mixtral-8x7B sizes on a GPU), print its pipeline, check it against the dense float64 reference "
        "and time its forward. Exit status: 0 when the check passes, 1 when it does not, 2 for bad options.")
    sizes = parser.add_argument_group("layer")
    sizes.add_argument("--experts", type=_positive_int, default=8, metavar="E",
                       help="number of experts (default: %(default)s)")
    sizes.add_argument("--top-k", type=_positive_int, default=2, metavar="K",
                       help="experts per token, at most --experts (default: %(default)s)")
    sizes.add_argument("--hidden", type=_positive_int, default=None, metavar="H",
                       help="hidden size (default: 256 on CPU, 4096 on GPU)")
    sizes.add_argument("--intermediate", type=_positive_int, default=None, metavar="I",
                       help="one expert's intermediate size (default: 512 on CPU, 14336 on GPU)")
    sizes.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                       help="parameter and activation dtype (default: %(default)s)")
    sizes.add_argument("--dispatcher", choices=("auto", "sorted", "padded", "aligned"), default="auto",
                       help="how rows reach the experts: auto (expert-sorted on the torch backend, block-aligned "
                       "on triton), sorted, padded ([E, capacity, H]; torch backend) or aligned (triton backend) "
                       "(default: %(default)s)")
    sizes.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                       help="stage implementations: auto (triton on CUDA when Triton is installed, else torch), "
                       "torch or triton (CUDA only) (default: %(default)s)")
    sizes.add_argument("--device", type=_device, default=None,
                       help="device to run on, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--tokens", type=_positive_int, default=64, metavar="T",
                           help="tokens per forward (default: %(default)s)")
    run_group.add_argument("--repeats", type=_positive_int, default=10, metavar="N",
                           help="timed forwards, after 2 warm-up ones (default: %(default)s)")
    run_group.add_argument("--seed", type=int, default=0,
                           help="seed for the weights and the input (default: %(default)s)")
    return parser


def _parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=_PROG))


def _times_ms(layer: MoELayer, x: torch.Tensor, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` forwards in milliseconds (synchronised on GPU)."""
    cuda = x.device.type == "cuda"
    for _ in range(2):  # warm-up
        layer(x)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        layer(x)
        if cuda:
            torch.cuda.synchronize(x.device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); one value is its own percentile."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def timing_summary(times: Sequence[float]) -> str:
    """``median 1.23 ms, p25-p75 1.20-1.31 ms, min 1.10 ms, max 1.52 ms (N repeats)``."""
    return (f"median {statistics.median(times):.2f} ms, p25-p75 {_percentile(times, 0.25):.2f}-"
            f"{_percentile(times, 0.75):.2f} ms, min {min(times):.2f} ms, max {max(times):.2f} ms "
            f"({len(times)} repeat{'s' if len(times) != 1 else ''})")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the demo with parsed ``args``; option errors go through ``parser.error`` (exit status 2)."""
    if args.top_k > args.experts:
        parser.error(f"argument --top-k: {args.top_k} exceeds --experts {args.experts}")
    device: torch.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    hidden = args.hidden or (4096 if on_gpu else 256)
    intermediate = args.intermediate or (14336 if on_gpu else 512)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(args.seed)

    try:
        layer = MoELayer(args.experts, args.top_k, hidden, intermediate, dispatcher=args.dispatcher,
                         backend=args.backend, dtype=dtype, device=device)
    except MoEForgeError as refused:  # an option combination the layer refuses (e.g. --backend triton on CPU)
        parser.error(f"--backend {args.backend} with --dispatcher {args.dispatcher} on {device}: {refused}")
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
        times = _times_ms(layer, x, args.repeats)
    tokens = f"{args.tokens} token{'s' if args.tokens != 1 else ''}"
    print(f"forward time ({tokens}, {layer.backend.value} backend): {timing_summary(times)}")
    return 0 if verdict == "ok" else 1


def run(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moeforge demo`` with ``argv`` (the options after ``demo``)."""
    parser = _parser()
    return main(parser.parse_args(argv), parser)
