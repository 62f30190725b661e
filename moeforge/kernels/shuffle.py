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
register layout, no arithmetic: the swapped K-loops hold fewer instructions (docs/notes/kernels-log.md, "The
pre-shuffled 4-bit layout"). Blocks stay inside a row and a K-range of 16 bytes, so
the scales, the experts, the tiles' rows and K-steps index a shuffled weight as they index the plain one;
``N`` and ``K / 2`` must be multiples of 16 and a tile's ``block_n`` of 16 and ``block_k`` of 32.

A fused gate/up weight of interleaved rows (``g0 u0 g1 u1 ...``, GPT-OSS) is shuffled **paired**: each chunk of 32
rows first reordered to its 16 gate rows, then their 16 up rows (:func:`pair_rows`), so that a tile's gate rows are
whole 16-row blocks again (output column ``n``'s gate row is ``32 (n // 16) + n % 16``, its up row 16 further). The
weight's scales and zero points take the paired row order too (:func:`pair_rows`, without the byte shuffle); the
bias keeps its interleaved rows.

An **e2m1** weight (MXFP4, NVFP4: ``e2m1=True``) also has the bits of each stored 32-bit word (4 bytes, 8 values, one
thread's register of 4 MMA pairs) rearranged for the decoding: the kernel takes the word apart into the bf16 bit
patterns of its four pairs with 8 integer instructions (:data:`E2M1_ROTATIONS`, :data:`E2M1_SPREAD`: two masks, two
rotations, one multiply) instead of 15 for bytes in K order. Word byte ``j``'s two nibbles become pair ``j``: the
bf16 patterns of ``value * 2**-126`` with the code's bits ``s e e m`` at bits 15, 8, 7, 6 of each half
(:func:`e2m1_pattern_pairs`, the decoding's model; :data:`E2M1_BIT_MOVES`, the rearrangement it implies). INT4 keeps
its bits (``e2m1=False``).
"""

from __future__ import annotations

import torch

from moeforge.kernels.config import GemmConfig

BLOCK = 16  # rows, and bytes along K, of one shuffled block
PAIRED = 2 * BLOCK  # rows of one chunk of paired gate/up rows

# -- the bits of an e2m1 word ----------------------------------------------------------------------
#
# The decoding (moeforge.kernels.dequant) turns a stored word w into four bf16x2 bit patterns: pairs 0-2 are w rotated
# left by E2M1_ROTATIONS[j] and masked with E2M1_PATTERN_MASK, pair 3 is ((w & mask) * factor) masked (E2M1_SPREAD:
# the factor 2**2 + 2**7 + 2**12 adds three shifted copies of the masked bits, which never overlap, so nothing
# carries). The 32 positions these operations read are all distinct: the layout puts each nibble bit there.
E2M1_PATTERN_MASK = 0x81C081C0  # bits 6-8 and 15 of each bf16 half: the magnitude and sign of value * 2**-126
E2M1_ROTATIONS = (0, 10, 13)
E2M1_SPREAD = (0x001B001B, 4228)  # (mask, factor)
_E2M1_CODE_BITS = (6, 7, 8, 15)  # where a pattern half holds the code's bits m, e, e, s (bit 0 .. 3)


def e2m1_pattern_pairs(word: int) -> tuple[int, int, int, int]:
    """The four bf16x2 bit patterns the kernel's decoding makes of the 32-bit ``word`` (a Python model of it)."""
    def rotate(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x

    mask, factor = E2M1_SPREAD
    first = tuple(rotate(word, r) & E2M1_PATTERN_MASK for r in E2M1_ROTATIONS)
    return (*first, ((word & mask) * factor) & 0xFFFFFFFF & E2M1_PATTERN_MASK)  # type: ignore[return-value]


def _bit_moves() -> tuple[tuple[int, int], ...]:
    """``(source mask, shift)`` pairs that move the bits of a word of bytes in K order (byte ``j``: bits ``8 j ..
    8 j + 7``, low nibble first) to the positions :func:`e2m1_pattern_pairs` reads them from (one pair per
    distinct shift, left for positive)."""
    moves: dict[int, int] = {}
    for position in range(32):
        patterns = e2m1_pattern_pairs(1 << position)
        (pair, bit), = [(j, b) for j, p in enumerate(patterns) for b in range(32) if p >> b & 1]
        half, code_bit = divmod(bit, 16)
        source = 8 * pair + 4 * half + _E2M1_CODE_BITS.index(code_bit)
        moves[position - source] = moves.get(position - source, 0) | 1 << source
    return tuple(sorted((mask, shift) for shift, mask in moves.items()))


E2M1_BIT_MOVES = _bit_moves()
_E2M1_BIT_MOVES_BACK = tuple((mask << shift if shift >= 0 else mask >> -shift, -shift)
                             for mask, shift in E2M1_BIT_MOVES)  # (unshuffle's)


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


def check_words(weight: torch.Tensor, name: str) -> None:
    """Raise ValueError unless the kernels can read the shuffled e2m1 ``weight [E, N, K / 2]`` (``name``: its format)
    as 32-bit words: bytes contiguous along K, rows, experts and the start 4-byte aligned."""
    if weight.stride(-1) != 1 or any(stride % 4 for stride in weight.stride()[:-1]) or weight.data_ptr() % 4:
        raise ValueError(f"a shuffled {name} weight is read as 32-bit words: its bytes must be contiguous along K and "
                         f"its rows and experts 4-byte aligned, got strides {weight.stride()}")


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


def _signed(value: int) -> int:
    """A 32-bit pattern as the int32 of the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


_CHUNK_WORDS = 1 << 22  # words moved at once (bounds the temporaries of a large weight)


def _rearrange_e2m1_words(weight: torch.Tensor, moves: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Contiguous packed ``weight [..., N, K / 2]`` (``K / 2`` a multiple of 4) with the bits of every 4-byte word
    (little-endian) moved: ``sum((word & mask) << shift)`` over ``moves`` (right for a negative shift). A new
    tensor."""
    words = weight.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        moved = torch.zeros_like(chunk)
        for mask, shift in moves:
            bits = chunk & _signed(mask)
            if shift >= 0:
                moved |= bits << shift
            else:  # (an arithmetic shift: the bits it fills in are masked off)
                moved |= (bits >> -shift) & _signed(mask >> -shift)
        out[start:start + _CHUNK_WORDS] = moved
    return out.view(torch.uint8).reshape(weight.shape)


def shuffle(weight: torch.Tensor, *, e2m1: bool, paired: bool = False) -> torch.Tensor:
    """``weight [..., N, K / 2]`` (packed, in K order) in the shuffled layout: a new contiguous tensor. ``e2m1``:
    MXFP4 / NVFP4 codes, whose words' bits are rearranged too (see the module's docstring); ``paired``: a fused
    gate/up weight of interleaved rows, whose rows are paired first (:func:`pair_rows`)."""
    check_shape(weight, paired=paired)
    if paired:
        weight = pair_rows(weight)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 2, 8, width // BLOCK, 4, 2, 2)  # a, jl, g, c, jh, th, tl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 2, 5, 3, 6, 4, 1))]  # a, g, th, c, tl, jh, jl
    stored = blocks.permute(order).reshape(weight.shape).contiguous()
    return _rearrange_e2m1_words(stored, E2M1_BIT_MOVES) if e2m1 else stored


def unshuffle(weight: torch.Tensor, *, e2m1: bool, paired: bool = False) -> torch.Tensor:
    """The inverse of :func:`shuffle`: a shuffled ``weight`` back in K order (a new contiguous tensor; ``paired``:
    its rows interleaved again)."""
    check_shape(weight, paired=paired)
    if e2m1:
        weight = _rearrange_e2m1_words(weight, _E2M1_BIT_MOVES_BACK)
    *lead, rows, width = weight.shape
    blocks = weight.reshape(*lead, rows // BLOCK, 8, 2, width // BLOCK, 2, 4, 2)  # a, g, th, c, tl, jh, jl
    n = len(lead)
    order = [*range(n), *(n + i for i in (0, 6, 1, 3, 5, 2, 4))]  # a, jl, g, c, jh, th, tl
    plain = blocks.permute(order).reshape(weight.shape).contiguous()
    return unpair_rows(plain) if paired else plain
