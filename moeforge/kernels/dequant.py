# Triton kernels (@triton.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""4-bit operands (INT4, e2m1) decoded in registers to the 16-bit dtype of the MMA.

Two decodings of the same values, chosen by a compile-time flag of the GEMM:

* **portable** (every backend, and Triton's CPU interpreter): each nibble is widened to 32 bits and
  placed in an fp32 bit pattern, then multiplied by its scale in fp32 and rounded once to the compute
  dtype. About a dozen 32-bit instructions per element; on an H100 this, not HBM, bounds the FP4
  GEMMs (``docs/kernels.md``).
* **packed** (NVIDIA, ``tl.inline_asm_elementwise``): one instruction sequence turns a 32-bit word of
  8 nibbles into 8 values held as four ``bf16x2`` / ``f16x2`` registers. Each 16-bit lane receives one
  byte (``prmt``); the nibble's bits are moved to their place in the 16-bit pattern with a mask, one
  integer multiply (two non-overlapping shifts added) and a mask, and the scale is applied with
  packed half-precision FMAs. About 2.75 instructions per element for e2m1, 2 for INT4.

Both are exact where the portable one is: an e2m1 value times an E8M0 scale (bf16) or an e4m3 scale
(bf16 or fp16) is representable, so the only rounding is the MMA's accumulation; an INT4 ``(q - z)``
is a small integer, times a scale in the compute dtype rounded once. The packed e2m1 decoding
writes the bit pattern of ``value * 2**-126`` (bf16) or ``value * 2**-14`` (fp16) and multiplies by
the power of two exactly (subnormal halves included), as the portable one does in fp32. MXFP4 with
an fp16 compute dtype stays portable: E8M0 scales span beyond fp16's range.

Elements: byte ``j`` of a packed row holds element ``2j`` in its low nibble and ``2j + 1`` in its
high nibble. The packed decoders return the low-nibble and high-nibble values as two tensors of the
packed shape; :func:`interleave` puts them back in K order.
"""

from __future__ import annotations

import triton
import triton.language as tl

# -- portable decoding -----------------------------------------------------------------------------


@triton.jit
def nibbles(packed, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 4-bit codes ``[ROWS, BLOCK_K]`` of ``packed [ROWS, BLOCK_K // 2]`` (join on a new last
    axis, flatten into K)."""
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), (ROWS, BLOCK_K))


@triton.jit
def interleave(lo, hi, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[ROWS, BLOCK_K]`` in K order from the values of the low and the high nibbles
    ``[ROWS, BLOCK_K // 2]``."""
    return tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K))


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


@triton.jit
def e8m0_bf16(s):
    """E8M0 codes as bf16 (exact: a bf16 has fp32's exponent): code ``s`` is the pattern ``s << 7``,
    code 0 the subnormal ``0x0040``, 255 NaN."""
    e = s.to(tl.uint16)
    bits = tl.where(e == 0, e + 0x0040, e << 7)
    bits = tl.where(e == 255, e * 0 + 0x7FC0, bits)
    return bits.to(tl.bfloat16, bitcast=True)


# -- packed decoding (inline PTX) ------------------------------------------------------------------
#
# Operands of one invocation (pack=4): $4 holds 4 packed bytes b0..b3; $5, $6 the scales of bytes
# (0, 1) and (2, 3) as half2; INT4 also $7, $8 the offsets -(128 + z) or -(1024 + z) the same way.
# Results: $0, $1 the low nibbles' values of bytes (0, 1), (2, 3); $2, $3 the high nibbles'.
# prmt 0x4140 / 0x4342 put bytes (0, 1) / (2, 3) into the low byte of each 16-bit lane.

_SPREAD = """
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
"""

# e2m1 to bf16: the low nibble's magnitude bits 0-2 go to bits 6-8 and its sign bit 3 to bit 15, i.e.
# (u << 6) + (u << 12) masked (the two shifted copies do not overlap); the high nibble (bits 4-7) the
# same with shifts 2 and 8. The pattern is value * 2**-126: times 2**126 (0x7E80), then the scale.
_E2M1_BF16 = "{\n.reg .b32 t0, t1, u, x, k, nz;\nmov.b32 k, 0x7E807E80;\nmov.b32 nz, 0x80008000;\n" + _SPREAD + "".join(
    f"""
and.b32 u, {t}, {mask};
mul.lo.u32 x, u, {mul};
and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, k, nz;
fma.rn.bf16x2 {out}, x, {scale}, nz;
""" for out, t, mask, mul, scale in (("$0", "t0", "0x000F000F", "0x1040", "$5"), ("$1", "t1", "0x000F000F", "0x1040", "$6"),
                                     ("$2", "t0", "0x00F000F0", "0x104", "$5"), ("$3", "t1", "0x00F000F0", "0x104", "$6"))
) + "}"

# e2m1 to fp16: magnitude to bits 9-11, sign to bit 15 (shifts 9 and 12 overlap at bit 12, so
# (a | b) & mask, one lop3); the pattern is value * 2**-14: times 2**14 (0x7400), then the scale.
_E2M1_F16 = "{\n.reg .b32 t0, t1, u, a, b, x, k, nz;\nmov.b32 k, 0x74007400;\nmov.b32 nz, 0x80008000;\n" + _SPREAD + "".join(
    f"""
and.b32 u, {t}, {mask};
shl.b32 a, u, {sa};
shl.b32 b, u, {sb};
or.b32 x, a, b;
and.b32 x, x, 0x8E008E00;
fma.rn.f16x2 x, x, k, nz;
fma.rn.f16x2 {out}, x, {scale}, nz;
""" for out, t, mask, sa, sb, scale in (("$0", "t0", "0x000F000F", 9, 12, "$5"), ("$1", "t1", "0x000F000F", 9, 12, "$6"),
                                        ("$2", "t0", "0x00F000F0", 5, 8, "$5"), ("$3", "t1", "0x00F000F0", 5, 8, "$6"))
) + "}"


def _int4(bias: str, one: str, kind: str) -> str:
    """INT4 to bf16 / fp16: the nibble ORed into the mantissa of ``bias`` (128.0 in bf16, 1024.0 in
    fp16) is ``bias + q`` exactly; plus the offset ``-(bias + z)`` (exact), times the scale."""
    return "{\n.reg .b32 t0, t1, x, k, nz;\n" + f"mov.b32 k, {one};\nmov.b32 nz, 0x80008000;\n" + _SPREAD + "".join(
        f"""
{pre}
and.b32 x, {src}, 0x000F000F;
or.b32 x, x, {bias};
fma.rn.{kind} x, x, k, {off};
fma.rn.{kind} {out}, x, {scale}, nz;
""" for out, pre, src, off, scale in (("$0", "", "t0", "$7", "$5"), ("$1", "", "t1", "$8", "$6"),
                                      ("$2", "shr.u32 x, t0, 4;", "x", "$7", "$5"),
                                      ("$3", "shr.u32 x, t1, 4;", "x", "$8", "$6"))
    ) + "}"


# (tl.constexpr: the only kind of global a jitted function may read)
E2M1_BF16 = tl.constexpr(_E2M1_BF16)
E2M1_F16 = tl.constexpr(_E2M1_F16)
INT4_BF16 = tl.constexpr(_int4("0x43004300", "0x3F803F80", "bf16x2"))
INT4_F16 = tl.constexpr(_int4("0x64006400", "0x3C003C00", "f16x2"))


@triton.jit
def e2m1_packed(packed, scale, DTYPE: tl.constexpr):
    """``(lo, hi)``: the values of the low and high nibbles of ``packed`` (uint8) times ``scale``
    (``DTYPE``, broadcast to ``packed``'s shape: one scale per byte), in ``DTYPE`` (bf16 / fp16)."""
    if DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(E2M1_BF16, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(E2M1_F16, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def int4_packed(packed, scale, offset, DTYPE: tl.constexpr):
    """``(lo, hi)``: ``(q - z) * scale`` of the low and high nibbles of ``packed`` (uint8), in ``DTYPE``
    (bf16 / fp16); ``offset`` is ``-(INT4_BIAS + z)`` in ``DTYPE`` (see :func:`int4_offset`), ``scale``
    and ``offset`` broadcast to ``packed``'s shape."""
    if DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(INT4_BF16, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale, offset],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(INT4_F16, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale, offset],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def int4_offset(z, DTYPE: tl.constexpr):
    """The offset :func:`int4_packed` adds for zero points ``z`` (any int dtype): ``-(128 + z)`` in
    bf16, ``-(1024 + z)`` in fp16 (exact)."""
    if DTYPE == tl.bfloat16:
        return -(z.to(DTYPE) + 128.0)
    else:
        return -(z.to(DTYPE) + 1024.0)
