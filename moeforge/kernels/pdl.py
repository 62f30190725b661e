# Triton kernels (@triton.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""Programmatic dependent launch (Hopper and later): a kernel of the triton path is launched while the kernel before
it in the stream is still finishing, and waits (``griddepcontrol.wait``) before it touches memory, so the launch
latency of each step overlaps the tail of the one before. Every kernel that opts in waits first thing, so nothing it
reads or writes can race the kernel before it, whatever that kernel is (the wait returns once that kernel has
completed and its writes are visible, not when it signalled). The light kernels (routing, quantization, alignment,
split-K reduction, combine) then let their own dependents launch (``griddepcontrol.launch_dependents``): the next
kernel's programs are scheduled onto the SMs this one leaves idle and wait there, instead of being launched when this
one exits; the GEMMs do not (:func:`flag`). CUDA graphs keep the dependency as a programmatic edge."""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
try:  # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    GDC = True
except ImportError:  # pragma: no cover - a Triton without it: never launched as a dependent
    GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

# The kernels' PDL flag: launched as usual; as a dependent that waits; as one that also releases its dependents.
OFF = 0
WAIT = 1
WAIT_AND_RELEASE = 2


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


def flag(pdl: bool, release: bool = True) -> int:
    """The kernels' ``PDL`` flag for a launch with (``pdl``, :func:`applies`) or without programmatic dependent
    launch: :data:`WAIT_AND_RELEASE` (``release``) or :data:`WAIT`, else :data:`OFF`. The GEMMs do not release: their
    dependents' programs would wait on the SMs the GEMM's last programs still compute on (docs/notes/kernels-log.md,
    "Programmatic dependent launch")."""
    if not pdl:
        return OFF
    return WAIT_AND_RELEASE if release else WAIT


def launch_options(pdl: bool) -> dict[str, Any]:
    """The launch keyword of a kernel launched with (``pdl``) or without programmatic dependent launch."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """``PDL`` (:func:`flag`) :data:`WAIT` or more: block until the kernel before this one in the stream has finished
    and its writes are visible; :data:`WAIT_AND_RELEASE`: then let the kernels launched as this one's dependents be
    scheduled (they wait in turn for this one to finish)."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()
