"""Integer arithmetic of launch sizes on the host, and the device's multiprocessors they are sized for.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions from Triton 3.9 on: a host call
goes through their wrapper (unwrapping each argument), an order of magnitude slower than these. The launchers compute a dozen such sizes per forward; inside ``@triton.jit`` code use ``tl.cdiv``.
"""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SMs of ``device`` (asked of the driver once per device; 4 off CUDA, where Triton's interpreter runs a
    persistent grid of 4 programs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
