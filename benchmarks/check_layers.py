"""Check triton layers at real shapes against the torch backend, as their launch tables run them (CUDA only).

    python benchmarks/check_layers.py --shapes gptoss,mixtral --formats mxfp4-shuffled,w4a16 --tokens 1,8,4096
                                      [--tolerance 0.01]

The GPU tests check every kernel at small shapes; the tables in ``moeforge/kernels/configs`` pick other tiles,
splits and paths (decoding first, swapped products) at the real shapes and token counts. For each shape and
format this builds the triton layer (bf16, this device's table) and a torch-backend layer of the same format
holding the same state (for ``*-shuffled`` formats the torch layer holds the plain layout: the state dict is
the plain bytes; ``--reference triton``: a triton layer of the plain layout), runs both on random tokens, and
prints ‖triton − torch‖ / ‖torch‖ for each token count, with the entry the table chose; a non-finite output or an
error above the tolerance fails the run (exit code 1). The tolerance is the GPU tests' (``tests/test_quant_methods_gpu.py``): 6e-2 for FP8 and 3e-2 for INT8 (the two backends
quantize the activations, each with its own roundings), 1e-2 for the weight-only formats, unless ``--tolerance`` sets
one for all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import DEFAULT_SHAPES, QUANT_METHODS, build_layer, held_formats, launch_entry, shape_of  # noqa: E402



def reference_format(fmt: str) -> str:
    """The format of the torch layer: the plain layout for a shuffled one (the torch backend emulates either)."""
    return fmt.removesuffix("-shuffled")


def tolerance(fmt: str) -> float:
    """The GPU tests' tolerance for ``fmt`` against the torch backend (``tests/test_quant_methods_gpu.py``)."""
    return {"fp8": 6e-2, "fp8-channel": 6e-2, "int8": 3e-2}.get(fmt, 1e-2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated: names of bench_moe.SHAPES, or a shape written out as ExkxHxI "
                             "(64x8x2048x1024)")
    parser.add_argument("--formats", default="bf16", help=f"comma-separated, of bf16, {', '.join(QUANT_METHODS)}")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="the largest relative error passed (default: 6e-2 FP8, 3e-2 INT8, 1e-2 others)")
    parser.add_argument("--reference", choices=("torch", "triton"), default="torch",
                        help="the backend of the reference layer; 'triton' (the plain layout's GEMMs, tested against "
                             "torch at small shapes) where the torch emulation does not fit beside the layer "
                             "(DeepSeek-V3's 4-bit weights decoded whole: 28 GiB more on an 80 GB H100)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_layers.py needs a CUDA device")
    failed = 0
    for name in args.shapes.split(","):
        shape = shape_of(name)
        for fmt in held_formats(name, args.formats.split(",")):
            torch.manual_seed(0)
            fast = build_layer(shape, fmt)
            slow = build_layer(shape, reference_format(fmt), args.reference)
            slow.load_state_dict(fast.state_dict())
            table = next(stage.configs for stage in fast.pipeline.stages if hasattr(stage, "configs"))
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, shape[2], device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    got, want = fast(x).float(), slow(x).float()
                finite = bool(torch.isfinite(got).all())
                error = float((got - want).norm() / want.norm().clamp(min=1e-30)) if finite else float("inf")
                ok = finite and error < (args.tolerance or tolerance(fmt))
                failed += not ok
                print(f"{name:9s} {fmt:15s} M={tokens:6d} rel {error:.2e} {'ok' if ok else 'FAIL'}  "
                      f"{launch_entry(table, fmt, tokens)}", flush=True)
            del fast, slow
            torch.cuda.empty_cache()
    print(f"{failed} failed" if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
