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

A fused gate/up weight of interleaved rows (``g0 u0 g1 u1 ...``, GPT-OSS) is shuffled **paired**: each chunk of 32
rows first reordered to its 16 gate rows, then their 16 up rows (:func:`pair_rows`), so that a tile's gate rows are
whole 16-row blocks again (output column ``n``'s gate row is ``32 (n // 16) + n % 16``, its up row 16 further). The
weight's scales and zero points take the paired row order too (:func:`pair_rows`, without the byte shuffle); the
bias keeps its interleaved rows.
"""

from __future__ import annotations

import torch

from moeforge.kernels.config import GemmConfig

BLOCK = 16  # rows, and bytes along K, of one shuffled block
PAIRED = 2 * BLOCK  # rows of one chunk of paired gate/up rows


def check_shape(weight: torch.Tensor, *, paired: bool = False) -> None:
    """Raise ValueError unless ``weight`` is packed uint8 ``[..., N, K / 2]`` with ``N`` and ``K / 2`` multiples
    of 16 (whole shuffled blocks; ``paired``: ``N`` a multiple of 32, whole chunks of paired rows)."""
    if weight.dtype != torch.uint8 or weight.dim() < 2:
        raise ValueError(f"the shuffled layout holds packed uint8 weights [..., N, K / 2], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    rows, width = weight.shape[-2], weight.shape[-1]
    if rows % (PAIRED if paired else BLOCK) or width % BLOCK:
        raise ValueError(f"the shuffled layout stores blocks of {BLOCK} rows by {BLOCK} bytes"
                         + (f" in chunks of {PAIRED} paired gate/up rows" if paired else "")
                         + f": N must be a multiple of {PAIRED if paired else BLOCK} and K / 2 of {BLOCK}, got "
                         f"N={rows}, K/2={width}")


def pair_rows(rows: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up rows ``[..., N, X]`` (``g0 u0 g1 u1 ...``, ``N`` a multiple of 32) as paired rows: each
    chunk of 32 rows holds its 16 gate rows, then their 16 up rows (a new contiguous tensor). A fused gate/up weight
    of interleaved rows is shuffled paired (:func:`shuffle`), and its scales and zero points take this order too."""
    *lead, n, width = rows.shape
    if n % PAIRED:
        raise ValueError(f"paired gate/up rows come in chunks of {PAIRED}: N must be a multiple of {PAIRED}, got {n}")
    return rows.reshape(*lead, n // PAIRED, BLOCK, 2, width).transpose(-3, -2).reshape(rows.shape).contiguous()


def unpair_rows(rows: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pair_rows`: paired rows back interleaved."""
    *lead, n, width = rows.shape
    if n % PAIRED:
        raise ValueError(f"paired gate/up rows come in chunks of {PAIRED}: N must be a multiple of {PAIRED}, got {n}")
    return rows.reshape(*lead, n // PAIRED, 2, BLOCK, width).transpose(-3, -2).reshape(rows.shape).contiguous()


def check_tile(config: GemmConfig) -> None:
    """Raise ValueError unless a tile of ``config`` covers whole shuffled blocks (``block_n`` a multiple of 16,
    ``block_k`` of 32)."""
    if config.block_n % BLOCK or config.block_k % (2 * BLOCK):
        raise ValueError(f"a shuffled weight's tiles take whole blocks of {BLOCK} rows by {2 * BLOCK} K-elements: "
                         f"block_n must be a multiple of {BLOCK} and block_k of {2 * BLOCK}, got "
                         f"{config.block_n} x {config.block_k}")


def shuffle(weight: torch.Tensor, *, paired: bool = False) -> torch.Tensor:
    """``weight [..., N, K / 2]`` (packed, in K order) in the shuffled layout: a new contiguous tensor. ``paired``: a
    fused gate/up weight of interleaved rows, whose rows are paired first (:func:`pair_rows`)."""
    check_shape(weight, paired=paired)
    if paired:
        weight = pair_rows(weight)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 2, 8, width // BLOCK, 4, 2, 2)  # a, jl, g, c, jh, th, tl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 2, 5, 3, 6, 4, 1))]  # a, g, th, c, tl, jh, jl
    return blocks.permute(order).reshape(weight.shape).contiguous()


def unshuffle(weight: torch.Tensor, *, paired: bool = False) -> torch.Tensor:
    """The inverse of :func:`shuffle`: a shuffled ``weight`` back in K order (a new contiguous tensor; ``paired``:
    its rows interleaved again)."""
    check_shape(weight, paired=paired)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 8, 2, width // BLOCK, 2, 4, 2)  # a, g, th, c, tl, jh, jl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 6, 1, 3, 5, 2, 4))]  # a, jl, g, c, jh, th, tl
    plain = blocks.permute(order).reshape(weight.shape).contiguous()
    return unpair_rows(plain) if paired else plain
