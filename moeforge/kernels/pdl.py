# Triton kernels (@triton.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Programmatic dependent launch (Hopper and later): a kernel of the triton path is launched while the kernel before
it in the stream is still finishing, and waits (``griddepcontrol.wait``) before it touches memory, so the launch
latency of each step overlaps the tail of the one before. Every kernel that opts in waits first thing, so nothing it
reads or writes can race the kernel before it, whatever that kernel is; none signals its dependents early (they
start when it has exited). CUDA graphs keep the dependency as a programmatic edge."""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
try:  # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_wait

    GDC = True
except ImportError:  # pragma: no cover - a Triton without it: never launched as a dependent
    GDC = False

    @triton.jit
    def gdc_wait():
        pass


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """``device``'s compute capability, or None off NVIDIA GPUs (ROCm, Triton's interpreter on the CPU): a launcher
    asks once per launch and hands it to its rules (:func:`applies`, and the GEMM's TMA, grid and split rules)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


def applies(capability: Optional[tuple[int, int]]) -> bool:
    """Whether launches on a device of ``capability`` (:func:`device_capability`) use programmatic dependent launch:
    NVIDIA GPUs of compute capability 9.0 or more, with a Triton that has it."""
    return GDC and capability is not None and capability[0] >= 9


def pdl_applies(device: torch.device) -> bool:
    """:func:`applies` to ``device``."""
    return applies(device_capability(device))


def launch_options(pdl: bool) -> dict[str, Any]:
    """The launch keyword of a kernel launched with (``pdl``) or without programmatic dependent launch."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """With ``PDL``: block until the kernel before this one in the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()
