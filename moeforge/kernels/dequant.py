# Triton kernels (@triton.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""4-bit operands (INT4, e2m1) decoded in registers to the 16-bit dtype of the MMA.

Two decodings of the same values, chosen by a compile-time flag of the GEMM:

* **portable** (every backend, and Triton's CPU interpreter): each nibble is widened to 32 bits and
  placed in an fp32 bit pattern, then multiplied by its scale in fp32 and rounded once to the compute
  dtype. About a dozen 32-bit instructions per element, which would bound the FP4 GEMMs instead of HBM
  (``docs/notes/kernels-log.md``).
* **packed** (NVIDIA, ``tl.inline_asm_elementwise``): one instruction sequence turns a 32-bit word of
  8 nibbles into 8 values held as four ``bf16x2`` / ``f16x2`` registers, each the pair of K-adjacent
  elements of one byte (the pairing of the MMA's operand registers). The low and high nibbles are
  split with two masks and a shift, each byte's two nibbles go to the two 16-bit lanes with one
  ``prmt``, their bits move to their place in the 16-bit pattern with one integer multiply (two
  non-overlapping shifts added) and a mask, and the scale is applied with packed half-precision FMAs.
  About 2.9 instructions per e2m1 element, 2.1 per INT4 element. A shuffled e2m1 weight has the bits of each
  32-bit word placed for its decoding (:mod:`moeforge.kernels.shuffle`): 8 integer instructions per word of 8
  values, plus the scales' multiplies (:func:`e2m1_word_tile`).

Both are exact where the portable one is: an e2m1 value times an E8M0 scale (bf16) or an e4m3 scale
(bf16 or fp16) is representable, so the only rounding is the MMA's accumulation; an INT4 ``(q - z)``
is a small integer, times a scale in the compute dtype rounded once. The packed e2m1 decoding
writes the bit pattern of ``value * 2**-126`` (bf16) or ``value * 2**-14`` (fp16) and multiplies by
the power of two exactly (subnormal halves included), as the portable one does in fp32; where every E8M0
code of an MXFP4 weight is at most 128 (``FOLDED``, known from the weight), that power of two is folded
into the scale instead, one multiply per pair fewer, same values. Scales are
decoded once per group, then broadcast. MXFP4 with
an fp16 compute dtype stays portable: E8M0 scales span beyond fp16's range.

Elements: byte ``j`` of a packed row holds element ``2j`` in its low nibble and ``2j + 1`` in its
high nibble. The packed decoders return one int32 pair per byte; :func:`unpair` splits them in K
order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeforge.kernels.format_codes import W_FIRST_E2M1, W_INT4, W_MXFP4
from moeforge.kernels.formats import WeightFormat

from moeforge.kernels.shuffle import E2M1_PATTERN_MASK, E2M1_ROTATIONS, E2M1_SPREAD


def packed_decoding(device: torch.device, compute_dtype: torch.dtype, weight_format: WeightFormat) -> bool:
    """Whether 4-bit operands computed in ``compute_dtype`` on ``device`` can use the packed inline-PTX
    decoding: NVIDIA GPUs, bf16 or fp16 (MXFP4's E8M0 scales need bf16's range). The GEMM
    (:mod:`moeforge.kernels.moe_gemm`) and the decoding first (:mod:`moeforge.kernels.decode_first`) ask it."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if compute_dtype == torch.bfloat16:
        return True
    return compute_dtype == torch.float16 and weight_format is not WeightFormat.MXFP4


# -- portable decoding -----------------------------------------------------------------------------


@triton.jit
def nibbles(packed, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 4-bit codes ``[ROWS, BLOCK_K]`` of ``packed [ROWS, BLOCK_K // 2]`` (join on a new last
    axis, flatten into K)."""
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, BLOCK_K))


@triton.jit
def e2m1_codes(codes):
    """e2m1 codes (any int dtype, 0..15) as fp32 values. Code bits ``s e e m`` placed at fp32 bits 31
    and 24..22 give ``value * 2**-126`` for normal and subnormal codes alike (e2m1's exponent bias is
    1, fp32's 127); one exact multiplication by ``2**126`` restores it."""
    c = codes.to(tl.uint32)
    bits = ((c & 8) << 28) | ((c & 7) << 22)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def e2m1(packed, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The e2m1 values (fp32 ``[ROWS, BLOCK_K]``) of ``packed [ROWS, BLOCK_K // 2]``."""
    return e2m1_codes(nibbles(packed, ROWS, BLOCK_K))


@triton.jit
def e8m0(s):
    """E8M0 codes as fp32 powers of two ``2**(s - 127)``; code 0 is the subnormal ``2**-127``, 255 NaN."""
    e = s.to(tl.uint32)
    bits = tl.where(e == 0, e + 0x00400000, e << 23)
    bits = tl.where(e == 255, e * 0 + 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3(s):
    """float8_e4m3fn codes (read as uint8) as fp32: bits ``s eeee mmm`` placed at fp32 bits 31 and
    26..20 give ``value * 2**-120`` for normal and subnormal codes alike (bias 7 against 127); one
    exact multiplication restores it; ``0x7F`` / ``0xFF`` are NaN. (Decoded by hand: one code path on
    the GPU and in the interpreter, which cannot load fp8 with a masked default.)"""
    e = s.to(tl.uint32)
    bits = ((e & 0x80) << 24) | ((e & 0x7F) << 20)
    value = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36
    return tl.where((e & 0x7F) == 0x7F, float("nan"), value)


# -- packed decoding (inline PTX) ------------------------------------------------------------------
#
# One invocation (pack=4) reads 4 packed bytes b0..b3 in $4 and writes, for each byte j, the half2 pair
# (value of its low nibble, value of its high nibble) in $j: the two elements 2j, 2j + 1 in K order, as
# one 32-bit register -- the pairing the MMA's operand registers hold. $5..$8 are the bytes' scales as
# half2 pairs (s, s); INT4 also $9..$12 its offsets -(bias + z) the same way.
# a = the low nibbles (bytes' bits 0-3), b = the high nibbles moved there; prmt with selector
# (0x8480 | j * 0x0101) puts a's byte j in the low lane and b's byte j in the high lane (selector 8
# copies the sign of a's byte 0, which is 0: a zero byte).

_SPLIT = """
and.b32 a, $4, 0x0F0F0F0F;
shr.u32 b, $4, 4;
and.b32 b, b, 0x0F0F0F0F;
"""


def _per_byte(body: str) -> str:
    """``body`` for each of the 4 bytes, with ``{sel}``, ``{out}``, ``{scale}``, ``{offset}`` filled in."""
    return "".join(body.format(sel=hex(0x8480 + j * 0x0101), out=f"$${j}", scale=f"$${5 + j}",
                               offset=f"$${9 + j}").replace("$$", "$") for j in range(4))


# e2m1 to bf16: the magnitude bits 0-2 of each lane go to bits 6-8 and the sign bit 3 to bit 15, i.e.
# (x << 6) + (x << 12) masked (the two shifted copies do not overlap): the pattern of value * 2**-126;
# times 2**126 (0x7E80), then the scale.
_E2M1_BF16 = "{\n.reg .b32 a, b, x, k, nz;\nmov.b32 k, 0x7E807E80;\nmov.b32 nz, 0x80008000;\n" + _SPLIT + _per_byte("""
prmt.b32 x, a, b, {sel};
mul.lo.u32 x, x, 0x1040;
and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, k, nz;
fma.rn.bf16x2 {out}, x, {scale}, nz;
""") + "}"

# The same with the x 2**126 folded into the scale (the caller's scale pairs are 2**126 times larger: see
# E8M0_BF16_FOLDED): one packed multiply per pair fewer.
_E2M1_BF16_FOLDED = _E2M1_BF16.replace("fma.rn.bf16x2 x, x, k, nz;\n", "").replace("mov.b32 k, 0x7E807E80;\n", "")

# e2m1 to fp16: magnitude to bits 9-11, sign to bit 15 (shifts 9 and 12 overlap at bit 12, so
# (x << 9 | x << 12) & mask); the pattern of value * 2**-14: times 2**14 (0x7400), then the scale.
_E2M1_F16 = "{\n.reg .b32 a, b, x, y, k, nz;\nmov.b32 k, 0x74007400;\nmov.b32 nz, 0x80008000;\n" + _SPLIT + _per_byte("""
prmt.b32 x, a, b, {sel};
shl.b32 y, x, 12;
shl.b32 x, x, 9;
or.b32 x, x, y;
and.b32 x, x, 0x8E008E00;
fma.rn.f16x2 x, x, k, nz;
fma.rn.f16x2 {out}, x, {scale}, nz;
""") + "}"


def _int4(bias: str, one: str, kind: str, offset: str = "") -> str:
    """INT4 to bf16 / fp16: the nibble ORed into the mantissa of ``bias`` (128.0 in bf16, 1024.0 in
    fp16) is ``bias + q`` exactly; plus the offset ``-(bias + z)`` (exact), times the scale. ``offset``: the
    pair ``-(bias + 8)`` for every byte (no zero points: one operand per byte fewer), else the operands."""
    registers = "{\n.reg .b32 a, b, x, k, nz, off;\n" + f"mov.b32 k, {one};\nmov.b32 nz, 0x80008000;\n"
    if offset:
        registers += f"mov.b32 off, {offset};\n"
    return (registers + _SPLIT + _per_byte(f"""
prmt.b32 x, a, b, {{sel}};
or.b32 x, x, {bias};
fma.rn.{kind} x, x, k, {"off" if offset else "{offset}"};
fma.rn.{kind} {{out}}, x, {{scale}}, nz;
""") + "}")


# An e4m3 scale (the low byte of $1) to the pair (s, s): the byte doubled into two e4m3 codes, which one
# hardware conversion (sm_89+) turns into f16x2; bf16 through fp32. Every e4m3 value is exact in fp16,
# fp32 and bf16; NaN codes stay NaN.
_E4M3_F16 = """{
.reg .b32 d;
.reg .b16 lo, hi;
prmt.b32 d, $1, 0, 0x0000;
mov.b32 {lo, hi}, d;
cvt.rn.f16x2.e4m3x2 $0, lo;
}"""
_E4M3_BF16 = """{
.reg .b32 d;
.reg .b16 lo, hi;
.reg .f32 f;
prmt.b32 d, $1, 0, 0x0000;
mov.b32 {lo, hi}, d;
cvt.rn.f16x2.e4m3x2 d, lo;
mov.b32 {lo, hi}, d;
cvt.f32.f16 f, lo;
cvt.rn.bf16x2.f32 $0, f, f;
}"""


# NVFP4's fold (bf16, the shuffled words' decoding): the e4m3 scales times 2**119 (in fp32, one multiply per scale;
# at most 448 * 2**119 < 2**128: finite; NaN stays NaN), so E2M1_WORDS_BF16_FOLDED gives value * scale * 2**-7
# exactly (at least 2**-17 in magnitude: never subnormal); the GEMM multiplies its fp32 sums by the remaining 2**7
# (NVFP4_FOLD_REST) with the global scale: bitwise the unfolded result (powers of two; the sums never near fp32's
# smallest normal in practice).
_TIMES_2_119 = "mul.f32 f, f, 0f7B000000;\n"
_E4M3_BF16_FOLDED = _E4M3_BF16.replace("cvt.f32.f16 f, lo;\n", "cvt.f32.f16 f, lo;\n" + _TIMES_2_119)
E4M3_FOLD = tl.constexpr(2.0 ** 119)  # the e4m3 scales' factor in the folded decoding
NVFP4_FOLD_REST = tl.constexpr(2.0 ** 7)  # 2**126 / E4M3_FOLD, applied to the fp32 sums


# Four e4m3 scales (the bytes of $4, in order) to four pairs (s, s) in $0..$3: one hardware conversion per
# two scales (bytes 0-1, then 2-3; the low byte to the low half), then each half doubled (f16: one prmt;
# bf16: through fp32).
def _e4m3_by_four(regs: str, double: str) -> str:
    """Four e4m3 scales to four pairs: ``double`` turns the f16 pair ``p`` = (s_a, s_b) of one conversion
    into the pairs ``{a}`` = (s_a, s_a) and ``{b}`` = (s_b, s_b)."""
    body = "".join(f"cvt.rn.f16x2.e4m3x2 p, {half};\n" + double.format(a=f"${2 * i}", b=f"${2 * i + 1}")
                   for i, half in enumerate(("lo", "hi")))
    return "{\n" + regs + "mov.b32 {lo, hi}, $4;\n" + body + "}"


_E4M3X4_F16 = _e4m3_by_four(".reg .b32 p;\n.reg .b16 lo, hi;\n",
                            "prmt.b32 {a}, p, 0, 0x1010;\nprmt.b32 {b}, p, 0, 0x3232;\n")
_E4M3X4_BF16 = _e4m3_by_four(".reg .b32 p;\n.reg .b16 lo, hi, h0, h1;\n.reg .f32 f;\n",
                             "mov.b32 {{h0, h1}}, p;\ncvt.f32.f16 f, h0;\ncvt.rn.bf16x2.f32 {a}, f, f;\n"
                             "cvt.f32.f16 f, h1;\ncvt.rn.bf16x2.f32 {b}, f, f;\n")
_E4M3X4_BF16_FOLDED = _E4M3X4_BF16.replace("cvt.f32.f16 f, h0;\n", "cvt.f32.f16 f, h0;\n" + _TIMES_2_119).replace(
    "cvt.f32.f16 f, h1;\n", "cvt.f32.f16 f, h1;\n" + _TIMES_2_119)

# E8M0 scales (the low byte of $1) to the bf16 pair (s, s): the code times 0x00800080 puts it at bits 7-14
# of both lanes, the pattern of 2**(s - 127) for codes 1..254; code 0 gives +0, raised to 2**-127 by a
# max; code 255 gives +inf, turned into NaN by x * 0 + x (exactly x for every finite x >= 0). Three
# instructions against six for integer compares and selects.
_E8M0_BF16 = """{
.reg .b32 p, tiny, zero;
mov.b32 tiny, 0x00400040;
mov.b32 zero, 0;
mul.lo.u32 p, $1, 0x00800080;
max.bf16x2 p, p, tiny;
fma.rn.bf16x2 $0, p, zero, p;
}"""

# E8M0 scales times 2**126 for E2M1_BF16_FOLDED: 2**(s - 1), the bf16 pattern (s + 126) << 7 in both lanes, one
# multiply-add. Exact and finite for codes 0..128 (0 -> 2**-1, 128 -> 2**127); the caller must know that every code
# is at most 128. A larger code is clamped to 129, whose pattern is +inf: the products come out inf / NaN, never a
# finite wrong value.
_E8M0_BF16_FOLDED = """{
.reg .b32 p;
min.u32 p, $1, 129;
mad.lo.u32 $0, p, 0x00800080, 0x3F003F00;
}"""
FOLDED_SCALE_MAX = 128  # the largest E8M0 code the folded decoding takes

# A shuffled e2m1 weight's 32-bit word (the word's bits placed by kernels/shuffle.py; $4) to its four pairs $0..$3, the
# bf16 patterns of value * 2**-126 taken out of it by masks, rotations and one multiply (e2m1_pattern_pairs there),
# then scaled: pairs 0 and 2 hold row g's values ($5: their scale pair), pairs 1 and 3 row g + 8's ($6). Eight integer
# instructions per word against 15 for bytes in K order. FOLDED: the scale pairs carry the x 2**126 (as above).
# fp16: each pattern's magnitude bits move up by 3 (x * 9 adds the copy shifted by 3, which overlaps no set bit;
# masked) into the fp16 pattern of value * 2**-14.
def _e2m1_words(kind: str) -> str:
    mask = hex(E2M1_PATTERN_MASK)
    spread_mask, factor = E2M1_SPREAD
    take = [f"and.b32 x, $4, {mask};\n"]
    take += [f"shf.l.wrap.b32 x, $4, $4, {r};\nand.b32 x, x, {mask};\n" for r in E2M1_ROTATIONS[1:]]
    take += [f"and.b32 x, $4, {hex(spread_mask)};\nmul.lo.u32 x, x, {factor};\nand.b32 x, x, {mask};\n"]
    assert len(take) == 4
    if kind == "bf16-folded":
        head, scale = "", "fma.rn.bf16x2 $$0, x, {s}, nz;\n"
    elif kind == "bf16":
        head, scale = "mov.b32 k, 0x7E807E80;\n", "fma.rn.bf16x2 x, x, k, nz;\nfma.rn.bf16x2 $$0, x, {s}, nz;\n"
    else:
        head = "mov.b32 k, 0x74007400;\n"
        scale = ("mul.lo.u32 x, x, 9;\nand.b32 x, x, 0x8E008E00;\nfma.rn.f16x2 x, x, k, nz;\n"
                 "fma.rn.f16x2 $$0, x, {s}, nz;\n")
    body = "".join(t + scale.format(s="$6" if j % 2 else "$5").replace("$$0", f"${j}") for j, t in enumerate(take))
    return "{\n.reg .b32 x, k, nz;\nmov.b32 nz, 0x80008000;\n" + head + body + "}"


# (tl.constexpr: the only kind of global a jitted function may read)
E2M1_BF16 = tl.constexpr(_E2M1_BF16)
E2M1_F16 = tl.constexpr(_E2M1_F16)
INT4_BF16 = tl.constexpr(_int4("0x43004300", "0x3F803F80", "bf16x2"))
INT4_F16 = tl.constexpr(_int4("0x64006400", "0x3C003C00", "f16x2"))
# without zero points (z = 8): -136.0 in bf16, -1032.0 in fp16, in both lanes
INT4_BF16_Z8 = tl.constexpr(_int4("0x43004300", "0x3F803F80", "bf16x2", "0xC308C308"))
INT4_F16_Z8 = tl.constexpr(_int4("0x64006400", "0x3C003C00", "f16x2", "0xE408E408"))
E4M3_F16 = tl.constexpr(_E4M3_F16)
E4M3_BF16 = tl.constexpr(_E4M3_BF16)
E8M0_BF16 = tl.constexpr(_E8M0_BF16)
E2M1_BF16_FOLDED = tl.constexpr(_E2M1_BF16_FOLDED)
E8M0_BF16_FOLDED = tl.constexpr(_E8M0_BF16_FOLDED)
E4M3X4_F16 = tl.constexpr(_E4M3X4_F16)
E4M3X4_BF16 = tl.constexpr(_E4M3X4_BF16)
E4M3_BF16_FOLDED = tl.constexpr(_E4M3_BF16_FOLDED)
E4M3X4_BF16_FOLDED = tl.constexpr(_E4M3X4_BF16_FOLDED)
E2M1_WORDS_BF16_FOLDED = tl.constexpr(_e2m1_words("bf16-folded"))
E2M1_WORDS_BF16 = tl.constexpr(_e2m1_words("bf16"))
E2M1_WORDS_F16 = tl.constexpr(_e2m1_words("f16"))
WORD_MASK = tl.constexpr(E2M1_PATTERN_MASK)
WORD_ROTATIONS = tl.constexpr(E2M1_ROTATIONS)
WORD_SPREAD_MASK = tl.constexpr(E2M1_SPREAD[0])
WORD_SPREAD_FACTOR = tl.constexpr(E2M1_SPREAD[1])


@triton.jit
def half_pairs(x):
    """16-bit values ``x`` as int32 pairs ``(x, x)``: the scale and offset operands of the decoders."""
    bits = x.to(tl.uint16, bitcast=True).to(tl.uint32)
    return (bits | (bits << 16)).to(tl.int32, bitcast=True)


@triton.jit
def e8m0_pairs(s, FOLDED: tl.constexpr = False):
    """E8M0 scale codes ``s`` (uint8) as int32 bf16 pairs ``(2**(s - 127), 2**(s - 127))`` by the packed
    decoding (NVIDIA, sm_80+: bf16x2 arithmetic): exact, code 0 the subnormal ``2**-127``, 255 NaN (the
    values of :func:`e8m0`, all representable in bf16). ``FOLDED``: ``2**(s - 1)``, the scale times
    ``2**126`` for :func:`e2m1_pairs`'s folded decoding, for codes up to ``FOLDED_SCALE_MAX`` (128;
    a larger one gives +inf)."""
    if FOLDED:
        return tl.inline_asm_elementwise(E8M0_BF16_FOLDED, "=r,r", [s.to(tl.uint32)], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(E8M0_BF16, "=r,r", [s.to(tl.uint32)], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def e4m3_pairs(s, DTYPE: tl.constexpr, CVT: tl.constexpr, BY_FOUR: tl.constexpr = False,
               FOLDED: tl.constexpr = False):
    """float8_e4m3fn scales ``s`` (read as uint8) as int32 pairs ``(s, s)`` of ``DTYPE`` (bf16 / fp16):
    by the hardware conversion where ``CVT`` (sm_89+: a few instructions per scale; ``BY_FOUR``: two
    conversions per four scales adjacent along the last axis, which must hold a multiple of four), else
    decoded by hand (:func:`e4m3`); the same values either way. ``FOLDED`` (bf16): ``s * 2**119``, for the folded
    decoding of shuffled NVFP4 words (``E4M3_FOLD``)."""
    if FOLDED:
        if CVT and BY_FOUR:
            return tl.inline_asm_elementwise(E4M3X4_BF16_FOLDED, "=r,=r,=r,=r,r", [s], dtype=tl.int32, is_pure=True,
                                             pack=4)
        elif CVT:
            return tl.inline_asm_elementwise(E4M3_BF16_FOLDED, "=r,r", [s.to(tl.uint32)], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return half_pairs((e4m3(s) * E4M3_FOLD).to(tl.bfloat16))
    elif CVT and BY_FOUR:
        if DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(E4M3X4_BF16, "=r,=r,=r,=r,r", [s], dtype=tl.int32, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(E4M3X4_F16, "=r,=r,=r,=r,r", [s], dtype=tl.int32, is_pure=True, pack=4)
    elif CVT:
        if DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(E4M3_BF16, "=r,r", [s.to(tl.uint32)], dtype=tl.int32, is_pure=True,
                                             pack=1)
        else:
            return tl.inline_asm_elementwise(E4M3_F16, "=r,r", [s.to(tl.uint32)], dtype=tl.int32, is_pure=True,
                                             pack=1)
    else:
        return half_pairs(e4m3(s).to(DTYPE))


@triton.jit
def _scaled_bytes(ASM: tl.constexpr, packed, scale_pairs):
    """One of the packed decodings ``ASM`` taking each byte of ``packed`` (uint8) and its scale pair: int32 pairs."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale_pairs], dtype=tl.int32, is_pure=True,
                                     pack=4)


@triton.jit
def e2m1_pairs(packed, scale_pairs, DTYPE: tl.constexpr, FOLDED: tl.constexpr = False):
    """int32 ``[R, KB]``: for each byte of ``packed [R, KB]`` (uint8) the ``DTYPE`` (bf16 / fp16) pair
    of its low and high nibbles' e2m1 values times the byte's scale (``scale_pairs``: :func:`half_pairs`
    of ``DTYPE`` scales, broadcast to ``packed``'s shape). ``FOLDED`` (bf16): ``scale_pairs`` are the scales
    times ``2**126`` (``e8m0_pairs(s, FOLDED=True)``), which saves the multiplication by ``2**126``; the
    values are the same."""
    if DTYPE == tl.bfloat16 and FOLDED:
        return _scaled_bytes(E2M1_BF16_FOLDED, packed, scale_pairs)
    elif DTYPE == tl.bfloat16:
        return _scaled_bytes(E2M1_BF16, packed, scale_pairs)
    else:
        return _scaled_bytes(E2M1_F16, packed, scale_pairs)


@triton.jit
def int4_pairs(packed, scale_pairs, offset_pairs, DTYPE: tl.constexpr):
    """int32 ``[R, KB]``: for each byte the ``DTYPE`` pair of ``(q - z) * scale`` of its two nibbles;
    ``offset_pairs`` are :func:`half_pairs` of :func:`int4_offset`, or None for zero points of 8 (no zero
    points: the offset is an immediate of the decoding)."""
    if offset_pairs is None:
        if DTYPE == tl.bfloat16:
            return _scaled_bytes(INT4_BF16_Z8, packed, scale_pairs)
        else:
            return _scaled_bytes(INT4_F16_Z8, packed, scale_pairs)
    elif DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(INT4_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                         [packed, scale_pairs, offset_pairs], dtype=tl.int32, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(INT4_F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                         [packed, scale_pairs, offset_pairs], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit
def unpair(pairs, DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[ROWS, BLOCK_K]`` ``DTYPE`` values in K order from the pairs ``[ROWS, BLOCK_K // 2]`` (low
    half first)."""
    bits = pairs.to(tl.uint32, bitcast=True)
    lo = (bits & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True)
    hi = (bits >> 16).to(tl.uint16).to(DTYPE, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K))


@triton.jit
def int4_offset(z, DTYPE: tl.constexpr):
    """The offset :func:`int4_pairs` adds for zero points ``z`` (any int dtype): ``-(128 + z)`` in
    bf16, ``-(1024 + z)`` in fp16 (exact)."""
    if DTYPE == tl.bfloat16:
        return -(z.to(DTYPE) + 128.0)
    else:
        return -(z.to(DTYPE) + 1024.0)


# -- a weight tile ------------------------------------------------------------------------------------


@triton.jit
def group_scales(s_ptrs, ok, k, K, stride_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 CLAMP: tl.constexpr = False):
    """The raw scales of K-step ``k`` for the rows whose scale pointers are ``s_ptrs`` (``ok``: the rows
    that exist): ``[ROWS, 1]`` when the step lies within one group (``GROUP`` a multiple of
    ``BLOCK_K``), else ``[ROWS, BLOCK_K // GROUP]`` (see :func:`spread`); past the last step, the last group's or
    zeros (the K-loop loads each step's scales one step ahead, the last one unused). ``CLAMP`` (``K`` a multiple
    of ``BLOCK_K``, the rows 16-aligned; the GEMM asks for it for e2m1 weights): a step of at least 4 groups is
    read with the step clamped to the last one instead of masked group by group, so that its groups load as vectors
    (NVFP4's 8 scales of a 128-wide step in 32-bit loads instead of byte loads). Not for 2 groups (16-bit loads),
    which were slower than the masked bytes (docs/notes/kernels-log.md, "A step's scales loaded as vectors")."""
    if BLOCK_K <= GROUP:
        g = tl.minimum((k * BLOCK_K) // GROUP, tl.cdiv(K, GROUP) - 1)
        return tl.load(s_ptrs + g * stride_sg, mask=ok, other=0)[:, None]
    elif CLAMP and BLOCK_K // GROUP >= 4:
        g = tl.minimum(k, K // BLOCK_K - 1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        return tl.load(s_ptrs[:, None] + g[None, :] * stride_sg, mask=ok[:, None], other=0)
    else:
        g = k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        return tl.load(s_ptrs[:, None] + g[None, :] * stride_sg, mask=ok[:, None] & (g < K // GROUP)[None, :],
                       other=0)


@triton.jit
def spread(s, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-group values ``s`` (decoded once per group) for every element of a ``[ROWS, BLOCK_K]`` step:
    ``[ROWS, 1]`` (a step within one group) stays (it broadcasts), ``[ROWS, BLOCK_K // GROUP]`` repeats each
    ``GROUP`` times."""
    if BLOCK_K <= GROUP:
        return s
    else:
        return tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, BLOCK_K // GROUP, GROUP)), (ROWS, BLOCK_K))


@triton.jit
def unshuffle(stored, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """The bytes ``[ROWS, BYTES]`` of a weight tile in K order, from ``stored`` (the same tile of a weight in the
    pre-shuffled layout of :mod:`moeforge.kernels.shuffle`; ``ROWS`` and ``BYTES`` multiples of 16). A reshape and a
    permutation, no arithmetic: the compiler lays the loaded bytes out so that each thread reads its own."""
    x = tl.reshape(stored, (ROWS // 16, 8, 2, BYTES // 16, 2, 4, 2))
    x = tl.permute(x, (0, 6, 1, 3, 5, 2, 4))
    return tl.reshape(x, (ROWS, BYTES))


@triton.jit
def _rotate_left(x, R: tl.constexpr):
    if R == 0:
        return x
    else:
        return (x << R) | (x >> (32 - R))


@triton.jit
def _word_patterns(words):
    """The four bf16x2 patterns (uint32) of shuffled e2m1 ``words`` (the portable form of ``E2M1_WORDS_*``)."""
    w = words.to(tl.uint32, bitcast=True)
    return (_rotate_left(w, WORD_ROTATIONS[0]) & WORD_MASK, _rotate_left(w, WORD_ROTATIONS[1]) & WORD_MASK,
            _rotate_left(w, WORD_ROTATIONS[2]) & WORD_MASK, ((w & WORD_SPREAD_MASK) * WORD_SPREAD_FACTOR) & WORD_MASK)


@triton.jit
def _word_grid(x, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """Per-word values ``[ROWS, BYTES // 4]`` (a shuffled tile's words as stored) on the grid ``(a, g, th, c, tl, jh // 2)``
    of :mod:`moeforge.kernels.shuffle`'s formula."""
    return tl.reshape(x, (ROWS // 16, 8, 2, BYTES // 16, 2, 2))


@triton.jit
def _word_scales(chunks, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """``(row g's, row g + 8's)`` values of ``chunks [ROWS, BYTES // 8]`` (one per row and 8 bytes: a word's bytes lie
    in one such chunk of each of its two rows) for every word of the grid of :func:`_word_grid`."""
    x = tl.permute(tl.reshape(chunks, (ROWS // 16, 2, 8, BYTES // 16, 2)), (0, 2, 3, 4, 1))  # a, g, c, jh // 2, jl
    first, second = tl.split(x)
    first = tl.broadcast_to(tl.reshape(first, (ROWS // 16, 8, 1, BYTES // 16, 1, 2)), (ROWS // 16, 8, 2, BYTES // 16, 2, 2))
    second = tl.broadcast_to(tl.reshape(second, (ROWS // 16, 8, 1, BYTES // 16, 1, 2)),
                             (ROWS // 16, 8, 2, BYTES // 16, 2, 2))
    return first, second


@triton.jit
def _pairs_in_k_order(p0, p1, p2, p3, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """The pairs ``[ROWS, BYTES]`` in K order (one per logical byte) from the four pairs of each word on the grid of
    :func:`_word_grid` (pair ``j``: the word's byte ``j = 2 (jh % 2) + jl``)."""
    x = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # a, g, th, c, tl, jh // 2, jl, jh % 2
    return tl.reshape(tl.permute(x, (0, 6, 1, 3, 5, 7, 2, 4)), (ROWS, BYTES))


@triton.jit
def _decode_words(ASM: tl.constexpr, words, first, second):
    """One of the ``E2M1_WORDS_*`` decodings: the four scaled pairs of each word."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r", [words, first, second],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def e2m1_word_tile(words, s, DTYPE: tl.constexpr, MX: tl.constexpr, GROUP: tl.constexpr, PTX: tl.constexpr,
                   FP8_CVT: tl.constexpr, CVT_BY_FOUR: tl.constexpr, SCALE_FOLD: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The ``[ROWS, BLOCK_K]`` tile (``DTYPE``) of a K-step of a shuffled e2m1 weight (``MX``: MXFP4, else NVFP4
    without its global scale) from its stored 32-bit ``words [ROWS, BLOCK_K // 8]`` and raw scales ``s`` (as
    :func:`weight_tile` takes them). ``PTX``: the packed decoding (``E2M1_WORDS_*``), else the same operations in
    plain Triton (any backend, the interpreter), the values in fp32 times the scales; the same values either way.
    ``SCALE_FOLD`` (bf16, packed): the ``x 2**126`` folded into the scales, all of it for MXFP4 (E8M0 codes at most
    128), ``2**119`` of it for NVFP4, whose tile then holds ``2**-7`` times its values (``NVFP4_FOLD_REST``: the
    caller's to restore)."""
    BYTES: tl.constexpr = BLOCK_K // 2
    if PTX:
        if MX:
            pairs = e8m0_pairs(s, SCALE_FOLD)
        else:
            pairs = e4m3_pairs(s, DTYPE, FP8_CVT, CVT_BY_FOUR and BLOCK_K // GROUP >= 4,
                               SCALE_FOLD and DTYPE == tl.bfloat16)
        chunks = tl.broadcast_to(spread(pairs, GROUP // 16, ROWS, BLOCK_K // 16), (ROWS, BLOCK_K // 16))
        first, second = _word_scales(chunks, ROWS, BYTES)
        grid = _word_grid(words, ROWS, BYTES)
        if DTYPE == tl.bfloat16 and SCALE_FOLD:
            p0, p1, p2, p3 = _decode_words(E2M1_WORDS_BF16_FOLDED, grid, first, second)
        elif DTYPE == tl.bfloat16:
            p0, p1, p2, p3 = _decode_words(E2M1_WORDS_BF16, grid, first, second)
        else:
            p0, p1, p2, p3 = _decode_words(E2M1_WORDS_F16, grid, first, second)
        return unpair(_pairs_in_k_order(p0, p1, p2, p3, ROWS, BYTES), DTYPE, ROWS, BLOCK_K)
    else:
        p0, p1, p2, p3 = _word_patterns(_word_grid(words, ROWS, BYTES))
        patterns = _pairs_in_k_order(p0, p1, p2, p3, ROWS, BYTES)
        # each half, a bf16 pattern, is the fp32 pattern of the same value in the upper 16 bits
        low = (patterns << 16).to(tl.float32, bitcast=True)
        high = (patterns & 0xFFFF0000).to(tl.float32, bitcast=True)
        values = tl.reshape(tl.join(low, high), (ROWS, BLOCK_K)) * 8.507059173023462e37
        if MX:
            scales = e8m0(s)
        else:
            scales = e4m3(s)
        return (values * spread(scales, GROUP, ROWS, BLOCK_K)).to(DTYPE)


@triton.jit
def weight_tile(packed, s, z, DTYPE: tl.constexpr, B_FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                PTX: tl.constexpr, FP8_CVT: tl.constexpr, CVT_BY_FOUR: tl.constexpr, SCALE_FOLD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHUFFLED: tl.constexpr = False):
    """The ``[BLOCK_N, BLOCK_K]`` tile of a K-step of a 4-bit weight, dequantized to ``DTYPE``
    (``PTX``: the packed decoding, ``FP8_CVT``: with e4m3 scales
    converted by the hardware; ``SCALE_FOLD``: MXFP4 in bf16 whose E8M0 codes are all at most 128, the
    e2m1 decoding's ``x 2**126`` folded into the scale).

    ``packed [BLOCK_N, BLOCK_K // 2]`` are the step's bytes (K contiguous; ``SHUFFLED``: as the pre-shuffled
    layout stores them, see :func:`unshuffle`; a shuffled e2m1 weight's are its 32-bit words ``[BLOCK_N, BLOCK_K // 8]``,
    see :func:`e2m1_word_tile`); ``s`` / ``z`` its raw scales / zero points: ``[BLOCK_N, 1]``
    when the step lies in one group, else ``[BLOCK_N, BLOCK_K // GROUP]``."""
    if SHUFFLED and B_FMT >= W_FIRST_E2M1:  # e2m1 (MXFP4, NVFP4): 32-bit words
        return e2m1_word_tile(packed, s, DTYPE, B_FMT == W_MXFP4, GROUP, PTX, FP8_CVT, CVT_BY_FOUR, SCALE_FOLD, BLOCK_N,
                              BLOCK_K)
    else:
        return _byte_tile(packed, s, z, DTYPE, B_FMT, GROUP, HAS_ZEROS, PTX, FP8_CVT, CVT_BY_FOUR, SCALE_FOLD,
                          BLOCK_N, BLOCK_K, SHUFFLED)


@triton.jit
def _byte_tile(packed, s, z, DTYPE: tl.constexpr, B_FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
               PTX: tl.constexpr, FP8_CVT: tl.constexpr, CVT_BY_FOUR: tl.constexpr, SCALE_FOLD: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHUFFLED: tl.constexpr):
    """:func:`weight_tile` from bytes (every 4-bit weight but a shuffled e2m1 one)."""
    if SHUFFLED:
        packed = unshuffle(packed, BLOCK_N, BLOCK_K // 2)
    if PTX:
        # one scale (and offset) pair per byte: the groups counted in bytes
        if B_FMT == W_INT4:
            # Without zero points, a shuffled tile takes the decoding with the offset as an immediate: with an
            # operand of constants the compiler does not lay the loaded bytes out in the MMA's register order
            # (the shuffle's gain). On plain tiles that decoding is no faster (docs/notes/kernels-log.md, "The
            # pre-shuffled 4-bit layout"), so they keep the operand.
            if HAS_ZEROS or not SHUFFLED:
                if not HAS_ZEROS:
                    z = tl.full([BLOCK_N, 1], 8, tl.uint8)
                offsets = spread(half_pairs(int4_offset(z, DTYPE)), GROUP // 2, BLOCK_N, BLOCK_K // 2)
            else:
                offsets = None
            pairs = int4_pairs(packed, spread(half_pairs(s), GROUP // 2, BLOCK_N, BLOCK_K // 2), offsets, DTYPE)
        elif B_FMT == W_MXFP4:
            pairs = e2m1_pairs(packed, spread(e8m0_pairs(s, SCALE_FOLD), GROUP // 2, BLOCK_N, BLOCK_K // 2), DTYPE,
                               SCALE_FOLD)
        else:
            scales = e4m3_pairs(s, DTYPE, FP8_CVT, CVT_BY_FOUR and BLOCK_K // GROUP >= 4)
            pairs = e2m1_pairs(packed, spread(scales, GROUP // 2, BLOCK_N, BLOCK_K // 2), DTYPE)
        return unpair(pairs, DTYPE, BLOCK_N, BLOCK_K)
    if B_FMT == W_INT4:
        # INT4: (q - z) is an integer in [-15, 15], exact in every float dtype; one rounding in the
        # product with the scale (stored in the rows' dtype).
        q = nibbles(packed, BLOCK_N, BLOCK_K).to(s.dtype)
        if HAS_ZEROS:
            q = q - spread(z.to(s.dtype), GROUP, BLOCK_N, BLOCK_K)
        else:
            q = q - 8.0
        w = q * spread(s, GROUP, BLOCK_N, BLOCK_K)
    elif B_FMT == W_MXFP4:
        w = (e2m1(packed, BLOCK_N, BLOCK_K) * spread(e8m0(s), GROUP, BLOCK_N, BLOCK_K)).to(DTYPE)
    else:
        w = (e2m1(packed, BLOCK_N, BLOCK_K) * spread(e4m3(s), GROUP, BLOCK_N, BLOCK_K)).to(DTYPE)
    return w
