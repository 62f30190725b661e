"""The pre-shuffled layout of packed 4-bit weights: each thread's bytes of a weight tile next to each other.

A packed weight ``[..., N, K / 2]`` (INT4, MXFP4, NVFP4: byte ``j`` of a row holds elements ``2j`` and ``2j + 1``)
is stored in blocks of 16 rows by 16 bytes (32 K-elements). Hopper's MMA with the decoded weight as its register
operand (``moe_gemm(swap=True)``: ``W @ rows^T``) gives the thread with lane ``4 g + t`` of a 16-row slab the
bytes ``t, t + 4, t + 8, t + 12`` of rows ``g`` and ``g + 8``. In K order those are 1-byte loads from shared memory
and byte permutes to pack them for the decoding; shuffled, they are the 8 bytes ``8 (t % 2) ..`` of stored row
``2 g + t // 2`` of the block, in the order the registers hold them (row ``g``, row ``g + 8``, then the next
4 bytes along K):

    stored[16 a + 2 g + th, 16 c + 8 tl + 2 jh + jl] = logical[16 a + 8 jl + g, 16 c + 4 jh + 2 th + tl]

for ``g < 8`` and ``th, tl, jl < 2``, ``jh < 4``. The GEMM reads the stored tile and undoes the permutation with a
reshape and a transpose (:func:`moeforge.kernels.dequant.unshuffle`), which the compiler turns into the loads'
register layout, no arithmetic. Compiled for sm_90, the swapped K-loops hold 13-24 % fewer instructions
(docs/kernels.md, "The pre-shuffled 4-bit layout"). Blocks stay inside a row and a K-range of 16 bytes, so
the scales, the experts, the tiles' rows and K-steps index a shuffled weight as they index the plain one;
``N`` and ``K / 2`` must be multiples of 16 and a tile's ``block_n`` of 16 and ``block_k`` of 32.
"""

from __future__ import annotations

import torch

from moeforge.kernels.config import GemmConfig

BLOCK = 16  # rows, and bytes along K, of one shuffled block


def check_shape(weight: torch.Tensor) -> None:
    """Raise ValueError unless ``weight`` is packed uint8 ``[..., N, K / 2]`` with ``N`` and ``K / 2`` multiples
    of 16 (whole shuffled blocks)."""
    if weight.dtype != torch.uint8 or weight.dim() < 2:
        raise ValueError(f"the shuffled layout holds packed uint8 weights [..., N, K / 2], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    rows, width = weight.shape[-2], weight.shape[-1]
    if rows % BLOCK or width % BLOCK:
        raise ValueError(f"the shuffled layout stores blocks of {BLOCK} rows by {BLOCK} bytes: N and K / 2 must be "
                         f"multiples of {BLOCK}, got N={rows}, K/2={width}")


def check_tile(config: GemmConfig) -> None:
    """Raise ValueError unless a tile of ``config`` covers whole shuffled blocks (``block_n`` a multiple of 16,
    ``block_k`` of 32)."""
    if config.block_n % BLOCK or config.block_k % (2 * BLOCK):
        raise ValueError(f"a shuffled weight's tiles take whole blocks of {BLOCK} rows by {2 * BLOCK} K-elements: "
                         f"block_n must be a multiple of {BLOCK} and block_k of {2 * BLOCK}, got "
                         f"{config.block_n} x {config.block_k}")


def shuffle(weight: torch.Tensor) -> torch.Tensor:
    """``weight [..., N, K / 2]`` (packed, in K order) in the shuffled layout: a new contiguous tensor."""
    check_shape(weight)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 2, 8, width // BLOCK, 4, 2, 2)  # a, jl, g, c, jh, th, tl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 2, 5, 3, 6, 4, 1))]  # a, g, th, c, tl, jh, jl
    return blocks.permute(order).reshape(weight.shape).contiguous()


def unshuffle(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`shuffle`: a shuffled ``weight`` back in K order (a new contiguous tensor)."""
    check_shape(weight)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 8, 2, width // BLOCK, 2, 4, 2)  # a, g, th, c, tl, jh, jl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 6, 1, 3, 5, 2, 4))]  # a, jl, g, c, jh, th, tl
    return blocks.permute(order).reshape(weight.shape).contiguous()
