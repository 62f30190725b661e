"""FP4 formats: e2m1 elements, NVFP4 (16-element blocks, e4m3 block scales, fp32 global scale) and
MXFP4 (32-element blocks, E8M0 power-of-two scales, OCP Microscaling spec). Pure functions and small
frozen records; torch reference code that runs on any device.

**e2m1** (1 sign, 2 exponent, 1 mantissa bit) holds the 16 values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; code
``c`` (0..15) is ``sign = c >> 3`` and magnitude ``E2M1_VALUES[c & 7]``. Encoding rounds to the nearest
value, ties to the code whose mantissa bit is 0 ("even"): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Magnitudes above 6 (and ±inf) saturate to ±6: e2m1 has no
infinity. NaN has no encoding either; the quantizers below never let it reach the elements silently
(its block scale becomes NaN, see below). The sign is kept for values that round to zero (-0.1 -> -0).

**Packing**: two codes per ``uint8``, element ``2j`` in the low nibble and ``2j + 1`` in the high
nibble (GPT-OSS's and ModelOpt's order).

**NVFP4**: ``value = e2m1 * block_scale * global_scale``; ``block_scale`` is float8_e4m3fn, one per 16
consecutive elements of the last dimension; ``global_scale`` is fp32 (one per tensor, or one per
leading index, e.g. per expert). The global scale is chosen so that the block scales fit e4m3, as in
NVIDIA's recipe (Transformer Engine, ModelOpt): ``global_scale = amax / (6 * 448)`` (this is the
*decode* scale: the recipe's "encode" scale ``448 * 6 / amax`` is its reciprocal, and ModelOpt's
``weight_scale_2`` / ``input_scale`` hold this decode form). Then ``block_scale = block_amax / 6 /
global_scale``, rounded to e4m3 (round-to-nearest-even by the cast), clamped to 448 when a static
global scale is too small (the block's elements then saturate at ±6), and the elements are
``x / (e4m3(block_scale) * global_scale)`` (divided by the *rounded* scale, so decoding reproduces the
quantizer's grid), rounded to e2m1. A block whose scale rounds to 0 (amax below ``global * 6 * 2**-10``)
decodes to zeros. A block holding a NaN or ±inf gets a NaN block scale (e4m3 0x7F), so it decodes to
NaN instead of a finite value; a computed global scale is 1 for an all-zero, empty or non-finite
tensor.

**MXFP4** (OCP MX v1.0): ``value = e2m1 * 2**(scale - 127)``, one ``uint8`` E8M0 scale per 32
elements; E8M0 code 255 is NaN. The shared exponent is ``floor(log2(block_amax)) - 2`` (2 = e2m1's
largest exponent), computed exactly with ``frexp``, clamped to [-127, 127]; with this rounding
(``MxScaleRounding.FLOOR``, the spec's) the scaled block maximum lies in [4, 8), so elements in (6, 8)
saturate to 6. ``MxScaleRounding.CEIL`` picks the smallest exponent with ``block_amax <= 6 * 2**e``
instead (no saturation, a coarser grid). An all-zero block gets code 0 (2**-127); a block holding a NaN
or ±inf gets code 255 (NaN).
"""

from __future__ import annotations

import enum
from typing import Union

import attrs
import torch

from moeforge.arguments import enum_member
from moeforge.errors import InputError

E2M1_MAX = 6.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
NVFP4_GLOBAL_DENOMINATOR = E2M1_MAX * E4M3_MAX  # 2688: global_scale = amax / 2688

# Code -> value; codes 8..15 are the negatives of 0..7 (8 is -0).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Midpoints between neighbouring magnitudes, and whether a value exactly on one rounds up: it does
# when the upper neighbour has the even (mantissa 0) code: 1.0, 2.0 and 4.0.
_E2M1_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

GlobalScale = Union[torch.Tensor, float, None]


# -- e2m1 elements and packing ---------------------------------------------------------------------------


def _check_float(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise InputError(f"{name} must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (``uint8`` 0..15, same shape) nearest to each element of ``x``: ties to even,
    saturating at ±6; NaN encodes as ±0 (the quantizers keep NaN in the block scale instead)."""
    _check_float(x, "x")
    magnitude = x.float().abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        index += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return index | sign


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of e2m1 ``codes`` (``uint8`` 0..15; the high nibble must be 0)."""
    if codes.dtype != torch.uint8:
        raise InputError(f"e2m1 codes must be uint8, got {codes.dtype}")
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes (``uint8`` 0..15) -> ``[..., K // 2]`` bytes, element ``2j`` in the low nibble."""
    if codes.dtype != torch.uint8:
        raise InputError(f"fp4 codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise InputError(f"packing two fp4 values per byte needs an even last dimension, got shape "
                         f"{tuple(codes.shape)}")
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K // 2]`` bytes -> ``[..., K]`` codes (``uint8`` 0..15): the inverse of :func:`pack_fp4`."""
    if packed.dtype != torch.uint8:
        raise InputError(f"packed fp4 data must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise InputError("packed fp4 data needs at least one dimension")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blocks(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """``x [..., K]`` as fp32 ``[..., K // block, block]``."""
    _check_float(x, name)
    if x.dim() == 0 or x.shape[-1] % block:
        raise InputError(f"{name} must have a last dimension divisible by {block}, got shape {tuple(x.shape)}")
    # explicit sizes (no -1): an empty leading dimension has nothing to infer -1 from
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


# -- NVFP4 -----------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Nvfp4Tensor:
    """NVFP4 data: ``data`` uint8 ``[..., K // 2]`` (packed e2m1), ``scale`` float8_e4m3fn
    ``[..., K // 16]``, ``global_scale`` fp32 with a shape that is a prefix of ``data.shape[:-1]``
    (``[]`` for one per tensor, ``[E]`` for one per expert)."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.data, self.scale, self.global_scale, dtype)


def nvfp4_global_scale(x: torch.Tensor, leading_dims: int = 0) -> torch.Tensor:
    """``amax / (6 * 448)`` over all but the first ``leading_dims`` dimensions of ``x`` (fp32, shape
    ``x.shape[:leading_dims]``); 1 where the amax is 0 (nothing to scale) or not finite (the
    non-finite blocks get NaN block scales from :func:`quantize_nvfp4`; the others stay usable)."""
    _check_float(x, "x")
    if not 0 <= leading_dims < max(x.dim(), 1):
        raise InputError(f"leading_dims must be in [0, {x.dim() - 1}] for a tensor of shape "
                         f"{tuple(x.shape)}, got {leading_dims}")
    if x.numel() == 0:
        return torch.ones(x.shape[:leading_dims], dtype=torch.float32, device=x.device)
    amax = x.float().abs().amax(dim=tuple(range(leading_dims, x.dim())))
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, amax / NVFP4_GLOBAL_DENOMINATOR, torch.ones_like(amax))


def _global_scale(global_scale: GlobalScale, x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """The fp32 global scale as a tensor whose shape is a prefix of ``lead``; checked."""
    if global_scale is None:
        return nvfp4_global_scale(x)
    if not isinstance(global_scale, torch.Tensor):
        value = float(global_scale)
        if not (value > 0 and value != float("inf")):
            raise InputError(f"global_scale must be a positive finite number, got {global_scale!r}")
        return torch.tensor(value, dtype=torch.float32, device=x.device)
    shape = tuple(global_scale.shape)
    if shape != lead[: len(shape)] or len(shape) > len(lead):
        raise InputError(f"global_scale must have a shape that is a prefix of {lead} (e.g. [] or "
                         f"{list(lead[:1])}), got {list(shape)}")
    scale = global_scale.float()
    if scale.numel() and not bool(((scale > 0) & torch.isfinite(scale)).all()):  # a host sync, on purpose
        raise InputError("global_scale must be positive and finite everywhere")
    return scale


def _expand(scale: torch.Tensor, dims: int) -> torch.Tensor:
    """``scale`` with trailing singleton dimensions up to ``dims`` dimensions (for broadcasting)."""
    return scale.reshape(tuple(scale.shape) + (1,) * (dims - scale.dim()))


def quantize_nvfp4(x: torch.Tensor, global_scale: GlobalScale = None) -> Nvfp4Tensor:
    """NVFP4 of ``x [..., K]`` (``K % 16 == 0``). ``global_scale``: ``None`` computes one for the
    whole tensor (``amax / 2688``); a number, or a tensor shaped like a prefix of ``x.shape[:-1]``
    (e.g. ``[E]`` for per-expert weights), is used as given (a static scale, e.g. an activation
    scale from calibration). Rounding: see the module docstring."""
    blocks = _blocks(x, NVFP4_BLOCK, "x")
    lead = tuple(x.shape[:-1])
    scale_global = _global_scale(global_scale, x, lead)
    amax = blocks.abs().amax(dim=-1)  # [..., K // 16]
    g = _expand(scale_global, amax.dim())
    block_scale = (amax / (E2M1_MAX * g)).clamp(max=E4M3_MAX)
    # A non-finite block keeps a NaN scale: its decoded values are NaN, never a saturated number.
    block_scale = torch.where(torch.isfinite(amax), block_scale, torch.full_like(block_scale, float("nan")))
    scale_q = block_scale.to(torch.float8_e4m3fn)
    step = (scale_q.float() * g).unsqueeze(-1)
    scaled = torch.where(step > 0, blocks / step, torch.zeros_like(blocks))
    codes = e2m1_encode(scaled).reshape(x.shape)
    return Nvfp4Tensor(pack_fp4(codes), scale_q, scale_global)


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, global_scale: Union[torch.Tensor, float],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of NVFP4 ``data [..., K // 2]`` with ``scale [..., K // 16]`` (e4m3) and
    ``global_scale`` (a number or a tensor shaped like a prefix of the leading dimensions)."""
    values = e2m1_decode(unpack_fp4(data))
    width = values.shape[-1]
    lead = tuple(values.shape[:-1])
    if width % NVFP4_BLOCK or tuple(scale.shape) != lead + (width // NVFP4_BLOCK,):
        raise InputError(f"NVFP4 scale must be {list(lead + (width // NVFP4_BLOCK,))} for data of shape "
                         f"{list(data.shape)}, got {list(scale.shape)}")
    blocks = values.reshape(*lead, width // NVFP4_BLOCK, NVFP4_BLOCK)
    g = global_scale.float() if isinstance(global_scale, torch.Tensor) else torch.tensor(
        float(global_scale), device=data.device)
    if tuple(g.shape) != lead[: g.dim()] or g.dim() > len(lead):
        raise InputError(f"global_scale must have a shape that is a prefix of {lead}, got {list(g.shape)}")
    out = blocks * scale.float().unsqueeze(-1) * _expand(g, blocks.dim())
    return out.reshape(*lead, width).to(dtype)


# -- MXFP4 -----------------------------------------------------------------------------------------------


class MxScaleRounding(enum.Enum):
    FLOOR = "floor"  # OCP MX spec: floor(log2(amax)) - 2; the block maximum may saturate at 6
    CEIL = "ceil"  # smallest e with amax <= 6 * 2**e: no saturation, a coarser grid


@attrs.frozen(eq=False)
class Mxfp4Tensor:
    """MXFP4 data: ``data`` uint8 ``[..., K // 2]`` (packed e2m1), ``scale`` uint8 E8M0
    ``[..., K // 32]`` (``2**(scale - 127)``; 255 is NaN)."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.data, self.scale, dtype)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(scale - 127)`` of E8M0 codes (uint8); NaN for code 255."""
    if scale.dtype != torch.uint8:
        raise InputError(f"E8M0 scales must be uint8, got {scale.dtype}")
    value = torch.exp2(scale.float() - E8M0_BIAS)
    return torch.where(scale == E8M0_NAN, torch.full_like(value, float("nan")), value)


def quantize_mxfp4(x: torch.Tensor, rounding: Union[MxScaleRounding, str] = MxScaleRounding.FLOOR) -> Mxfp4Tensor:
    """MXFP4 of ``x [..., K]`` (``K % 32 == 0``). Rounding (a :class:`MxScaleRounding` or its value): see the
    module docstring."""
    rounding = enum_member(MxScaleRounding, "rounding", rounding)
    blocks = _blocks(x, MXFP4_BLOCK, "x")
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    shared = exponent.long() - 1 - 2
    if rounding is MxScaleRounding.CEIL:
        shared = shared + (amax > E2M1_MAX * torch.exp2(shared.float())).long()
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    code = (shared + E8M0_BIAS).to(torch.uint8)
    code = torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN))
    # A NaN scale (code 255) makes the elements NaN, which encode as 0; the scale keeps the NaN.
    scaled = blocks / torch.exp2(shared.float()).unsqueeze(-1)
    codes = e2m1_encode(scaled).reshape(x.shape)
    return Mxfp4Tensor(pack_fp4(codes), code)


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of MXFP4 ``data [..., K // 2]`` with E8M0 ``scale [..., K // 32]``."""
    values = e2m1_decode(unpack_fp4(data))
    width = values.shape[-1]
    lead = tuple(values.shape[:-1])
    if width % MXFP4_BLOCK or tuple(scale.shape) != lead + (width // MXFP4_BLOCK,):
        raise InputError(f"MXFP4 scale must be {list(lead + (width // MXFP4_BLOCK,))} for data of shape "
                         f"{list(data.shape)}, got {list(scale.shape)}")
    blocks = values.reshape(*lead, width // MXFP4_BLOCK, MXFP4_BLOCK)
    out = blocks * e8m0_decode(scale).unsqueeze(-1)
    return out.reshape(*lead, width).to(dtype)


def fp4_storage(shape: tuple[int, ...], block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the packed data and the block scales for a logical ``shape [..., K]``."""
    *lead, width = shape
    return tuple(lead) + (width // 2,), tuple(lead) + (width // block,)


__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "E8M0_BIAS", "E8M0_NAN", "MXFP4_BLOCK", "NVFP4_BLOCK",
    "NVFP4_GLOBAL_DENOMINATOR", "MxScaleRounding", "Mxfp4Tensor", "Nvfp4Tensor", "dequantize_mxfp4",
    "dequantize_nvfp4", "e2m1_decode", "e2m1_encode", "e8m0_decode", "fp4_storage", "nvfp4_global_scale",
    "pack_fp4", "quantize_mxfp4", "quantize_nvfp4", "unpack_fp4",
]
