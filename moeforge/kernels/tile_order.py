# Triton kernels (``@triton.jit`` bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The order a grouped GEMM's programs take their tiles in (``@triton.jit``), shared by its grids: one program per
tile and the persistent grids that stride over the tiles."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of tile ``tile`` in grouped order: neighbouring tiles share weight tiles in L2."""
    group = tile // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_pid_n)) % group_size
    pid_n = (tile % (GROUP_M * num_pid_n)) // group_size
    return pid_m, pid_n
