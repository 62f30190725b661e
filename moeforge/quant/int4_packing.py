"""Int4 weight layouts: moeforge's own, and the GPTQ / AWQ checkpoint packings converted into it.

moeforge's layout (what :class:`~moeforge.quant.w4a16.W4A16Method` and the W4A16 kernels read), for
weights ``[..., N, K]`` (``N`` outputs, ``K`` inputs, like ``nn.Linear``) quantized in groups of ``G``
consecutive inputs:

* ``qweight`` uint8 ``[..., N, K // 2]``: input ``k`` of a row is in byte ``k // 2``, even ``k`` in the
  low nibble, odd ``k`` in the high nibble; values 0..15;
* ``scales`` ``[..., N, K // G]`` (float, the layer's dtype);
* ``qzeros`` uint8 ``[..., N, K // G]`` holding 0..15 unpacked, or ``None`` (symmetric: zero point 8);
* ``w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``.

Checkpoints pack eight 4-bit values per int32, nibble ``i`` at bits ``4i .. 4i + 3``, and store each
linear layer transposed (``[K, N]``, inputs first):

* GPTQ (AutoGPTQ / GPTQModel, exllama-compatible): ``qweight`` int32 ``[K // 8, N]`` packed along
  ``K`` in natural order; ``qzeros`` int32 ``[K // G, N // 8]`` packed along ``N``; ``scales``
  ``[K // G, N]``; optional ``g_idx`` int32 ``[K]`` (the group of each input). The classic "v1"
  format (``checkpoint_format="gptq"`` in the Hugging Face quantization config; AutoGPTQ's packer)
  stores ``zero - 1``, the kernels add the 1 back; "v2" (GPTQModel's ``gptq_v2``) stores the zero
  itself. Symmetric checkpoints (``sym=True``) have zero 8 everywhere (stored 7 in v1).
* AWQ (AutoAWQ's GEMM version): ``qweight`` int32 ``[K, N // 8]`` and ``qzeros`` int32
  ``[K // G, N // 8]``, both packed along ``N`` with the interleaved order :data:`AWQ_PACK_ORDER`
  (nibble ``i`` of a word holds element ``AWQ_PACK_ORDER[i]`` of its 8 outputs); ``scales``
  ``[K // G, N]``; zero points stored as they are.

The converters check every shape and dtype and raise :class:`~moeforge.errors.CheckpointError` naming
the tensor (``where`` + ``"qweight"``, ...); the functions on moeforge's own layout raise
:class:`~moeforge.errors.InputError`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Optional, Union

import torch

from moeforge.arguments import enum_member
from moeforge.errors import CheckpointError, InputError

NIBBLES = 8  # 4-bit values per int32
NATURAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
# AutoAWQ's GEMM packer puts element AWQ_PACK_ORDER[i] of each run of 8 outputs in nibble i (a layout
# its CUDA kernel dequantizes with fewer instructions); unpacking needs the inverse permutation.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SYMMETRIC_ZERO = 8  # the zero point of symmetric int4 (unsigned 0..15 around 8)


class CheckpointFormat(enum.Enum):
    """How a checkpoint packs its int4 linear layers."""

    GPTQ = "gptq"  # v1: stored zero = zero - 1 (AutoGPTQ; the common format)
    GPTQ_V2 = "gptq_v2"  # stored zero = zero (GPTQModel's internal format)
    AWQ = "awq"  # AutoAWQ GEMM: [K, N // 8], interleaved nibbles, zero stored as is

    @classmethod
    def parse(cls, value: Union[CheckpointFormat, str]) -> CheckpointFormat:
        return enum_member(cls, "checkpoint_format", value)


# -- moeforge's layout --------------------------------------------------------------------------------


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """``values [..., K]`` (integers 0..15, ``K`` even) -> uint8 ``[..., K // 2]``, even ``k`` in the low
    nibble."""
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise InputError(f"pack_int4 needs integer values, got {values.dtype}")
    if values.dim() == 0 or values.shape[-1] % 2:
        raise InputError(f"pack_int4 needs an even last dimension (two values per byte), got shape "
                         f"{tuple(values.shape)}")
    if values.dtype != torch.uint8:
        if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
            raise InputError(f"pack_int4 needs values in 0..15, got {int(values.min())}..{int(values.max())}")
        values = values.to(torch.uint8)
    elif values.numel() and int(values.max()) > 15:
        raise InputError(f"pack_int4 needs values in 0..15, got up to {int(values.max())}")
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K // 2]`` -> uint8 ``[..., K]`` (values 0..15); the inverse of :func:`pack_int4`."""
    if packed.dtype != torch.uint8:
        raise InputError(f"unpack_int4 needs uint8 bytes, got {packed.dtype}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The float weights ``[..., N, K]`` of moeforge's layout: ``(q - z) * s`` per group of inputs,
    computed in fp32 (exact for bf16/fp16 scales) and returned in ``dtype``; ``qzeros=None`` means
    the symmetric zero point 8."""
    q = unpack_int4(qweight).float()
    groups = scales.shape[-1]
    if groups == 0 or q.shape[-1] % groups:
        raise InputError(f"scales {tuple(scales.shape)} do not split the {q.shape[-1]} inputs of qweight "
                         f"{tuple(qweight.shape)} into equal groups")
    grouped = q.reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    zero = qzeros.float().unsqueeze(-1) if qzeros is not None else SYMMETRIC_ZERO
    values = (grouped - zero) * scales.float().unsqueeze(-1)
    return values.reshape(q.shape).to(dtype)


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class Int4Weight:
    """Int4 weights in moeforge's layout (see the module notes), any leading dimensions."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        q, s, z = self.qweight, self.scales, self.qzeros
        if q.dtype != torch.uint8 or q.dim() < 2:
            raise InputError(f"qweight must be uint8 [..., N, K // 2], got {q.dtype} {tuple(q.shape)}")
        if not s.dtype.is_floating_point or s.shape[:-1] != q.shape[:-1] or s.shape[-1] == 0 \
                or (2 * q.shape[-1]) % s.shape[-1]:
            raise InputError(f"scales must be float [..., N, K // G] = {tuple(q.shape[:-1])} + (groups,) with "
                             f"groups dividing K = {2 * q.shape[-1]}, got {s.dtype} {tuple(s.shape)}")
        if z is not None and (z.dtype != torch.uint8 or z.shape != s.shape):
            raise InputError(f"qzeros must be uint8 with the shape of scales {tuple(s.shape)}, got "
                             f"{z.dtype} {tuple(z.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[-2])

    @property
    def in_features(self) -> int:
        return 2 * int(self.qweight.shape[-1])

    @property
    def group_size(self) -> int:
        return self.in_features // int(self.scales.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.qzeros, dtype)


# -- int32 packing (checkpoints) ------------------------------------------------------------------------


def _inverse(order: Sequence[int]) -> list[int]:
    if sorted(order) != list(range(NIBBLES)):
        raise InputError(f"a nibble order must be a permutation of 0..7, got {tuple(order)}")
    inverse = [0] * NIBBLES
    for nibble, element in enumerate(order):
        inverse[element] = nibble
    return inverse


def pack_int32(values: torch.Tensor, dim: int, order: Sequence[int] = NATURAL_ORDER) -> torch.Tensor:
    """Pack 4-bit ``values`` (integers 0..15) eight per int32 along ``dim``: nibble ``i`` (bits
    ``4i .. 4i + 3``) of each word holds element ``order[i]`` of its run of 8. Words are int32 (bit 31
    is the sign bit, as checkpoints store them)."""
    _inverse(order)
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise InputError(f"pack_int32 needs integer values, got {values.dtype}")
    moved = values.movedim(dim, -1).long()
    if moved.shape[-1] % NIBBLES:
        raise InputError(f"pack_int32 needs dimension {dim} divisible by 8, got shape {tuple(values.shape)}")
    if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) > 15):
        raise InputError(f"pack_int32 needs values in 0..15, got {int(moved.min())}..{int(moved.max())}")
    runs = moved.reshape(*moved.shape[:-1], -1, NIBBLES)[..., list(order)]
    shifts = torch.arange(0, 4 * NIBBLES, 4, device=values.device)
    words = (runs << shifts).sum(dim=-1)  # 0 .. 2**32 - 1 in int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same bits as int32
    return words.to(torch.int32).movedim(-1, dim)


def unpack_int32(packed: torch.Tensor, dim: int, order: Sequence[int] = NATURAL_ORDER) -> torch.Tensor:
    """The inverse of :func:`pack_int32`: int32 words -> uint8 values 0..15, eight per word along
    ``dim``."""
    inverse = _inverse(order)
    if packed.dtype != torch.int32:
        raise InputError(f"unpack_int32 needs int32 words, got {packed.dtype}")
    moved = packed.movedim(dim, -1).long()
    shifts = torch.arange(0, 4 * NIBBLES, 4, device=packed.device)
    nibbles = (moved.unsqueeze(-1) >> shifts) & 0x0F  # [..., words, 8] in nibble order
    values = nibbles[..., inverse].flatten(-2)
    return values.to(torch.uint8).movedim(-1, dim)


# -- checkpoint -> moeforge -----------------------------------------------------------------------------


def _check(tensor: torch.Tensor, key: str, shape: tuple[int, ...], kind: str, other: str = "") -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"tensor '{key}' has shape {tuple(tensor.shape)}, expected {shape}{other}")
    if kind == "int32" and tensor.dtype != torch.int32:
        raise CheckpointError(f"tensor '{key}' is {tensor.dtype}, expected int32 (eight packed 4-bit values "
                              "per word)")
    if kind == "float" and not tensor.dtype.is_floating_point:
        raise CheckpointError(f"tensor '{key}' is {tensor.dtype}, expected float scales")


def _check_sizes(out_features: int, in_features: int, group_size: int) -> None:
    for name, value in (("out_features", out_features), ("in_features", in_features)):
        if value < NIBBLES or value % NIBBLES:
            raise InputError(f"{name}={value}: int4 checkpoints pack 8 values per int32, so it must be a "
                             "positive multiple of 8")
    if group_size < 1 or in_features % group_size:
        raise InputError(f"in_features={in_features} is not divisible by group_size={group_size}")


def _group_hint(scales: torch.Tensor, in_features: int, group_size: int) -> str:
    groups = int(scales.shape[0]) if scales.dim() == 2 else 0
    if groups and in_features % groups == 0 and in_features // groups != group_size:
        return (f" (the checkpoint's group size looks like {in_features // groups}, not {group_size}: "
                "build the method with that group_size)")
    return ""


def _zeros_from_stored(stored: torch.Tensor, add_one: bool, key: str) -> torch.Tensor:
    """Stored zero nibbles ``[groups, N]`` -> real zero points (uint8 0..15)."""
    if not add_one:
        return stored
    if stored.numel() and int(stored.max()) == 15:
        raise CheckpointError(
            f"tensor '{key}' stores 15 in GPTQ v1 format, i.e. a zero point of 16, which 4 bits cannot hold "
            "(AutoGPTQ's v1 packer wraps a zero point of 0 to 15 and corrupts the neighbouring nibbles): "
            "re-export the checkpoint in v2 format, or load it with checkpoint_format='gptq_v2' if its zeros "
            "are stored unshifted")
    return stored + 1


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    *,
    out_features: int,
    in_features: int,
    group_size: int,
    v1_zeros: bool = True,
    dtype: torch.dtype = torch.float16,
    where: str = "",
) -> Int4Weight:
    """One GPTQ-packed linear layer ``[N out, K in]`` -> moeforge's layout (``scales`` in ``dtype``).

    ``v1_zeros=True`` (the common v1 format) adds 1 to the stored zero points; ``False`` reads them as
    they are (v2). ``qzeros=None`` gives symmetric weights (zero point 8). ``g_idx`` must be the
    trivial ``k // group_size``: an act-order (``desc_act=True``) checkpoint assigns inputs to groups
    out of order, which moeforge's contiguous groups cannot express without permuting the activations
    of every expert differently, so it is a :class:`CheckpointError`. ``where`` prefixes the tensor
    names in error messages (e.g. ``"experts.3.gate_proj."``).
    """
    n, k, g = out_features, in_features, group_size
    _check_sizes(n, k, g)
    awq_like = " (that is AWQ's [K, N // 8] packing: use checkpoint_format='awq')" \
        if tuple(qweight.shape) == (k, n // NIBBLES) else ""
    _check(qweight, where + "qweight", (k // NIBBLES, n), "int32", awq_like)
    _check(scales, where + "scales", (k // g, n), "float", _group_hint(scales, k, g))
    if qzeros is not None:
        _check(qzeros, where + "qzeros", (k // g, n // NIBBLES), "int32")
    if g_idx is not None:
        _check_g_idx(g_idx, where + "g_idx", k, g)
    q = unpack_int32(qweight, dim=0).t()  # [N, K]
    zeros = None
    if qzeros is not None:
        zeros = _zeros_from_stored(unpack_int32(qzeros, dim=1), v1_zeros, where + "qzeros").t()
    return Int4Weight(pack_int4(q), scales.t().to(dtype).contiguous(),
                      zeros.contiguous() if zeros is not None else None)


def _check_g_idx(g_idx: torch.Tensor, key: str, in_features: int, group_size: int) -> None:
    if tuple(g_idx.shape) != (in_features,) or g_idx.dtype.is_floating_point:
        raise CheckpointError(f"tensor '{key}' is {g_idx.dtype} {tuple(g_idx.shape)}, expected integer "
                              f"[{in_features}]")
    trivial = torch.arange(in_features, device=g_idx.device) // group_size
    if not bool((g_idx.long() == trivial).all()):
        raise CheckpointError(
            f"tensor '{key}' assigns inputs to groups out of order (an act-order / desc_act=True GPTQ "
            f"checkpoint): moeforge's int4 layout needs input k in group k // {group_size}. Re-quantize "
            "with desc_act=False, or convert the checkpoint to a static group order first")


def awq_to_int4(
    qweight: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    scales: torch.Tensor,
    *,
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype = torch.float16,
    where: str = "",
) -> Int4Weight:
    """One AWQ (GEMM version) linear layer ``[N out, K in]`` -> moeforge's layout. Zero points are
    stored as they are; ``qzeros=None`` gives symmetric weights (zero point 8)."""
    n, k, g = out_features, in_features, group_size
    _check_sizes(n, k, g)
    gptq_like = " (that is GPTQ's [K // 8, N] packing: use checkpoint_format='gptq' or 'gptq_v2')" \
        if tuple(qweight.shape) == (k // NIBBLES, n) else ""
    _check(qweight, where + "qweight", (k, n // NIBBLES), "int32", gptq_like)
    _check(scales, where + "scales", (k // g, n), "float", _group_hint(scales, k, g))
    if qzeros is not None:
        _check(qzeros, where + "qzeros", (k // g, n // NIBBLES), "int32")
    q = unpack_int32(qweight, dim=1, order=AWQ_PACK_ORDER).t()  # [N, K]
    zeros = unpack_int32(qzeros, dim=1, order=AWQ_PACK_ORDER).t().contiguous() if qzeros is not None else None
    return Int4Weight(pack_int4(q), scales.t().to(dtype).contiguous(), zeros)


# -- moeforge -> checkpoint (tests, exporting) ----------------------------------------------------------


def _zeros_or_symmetric(weight: Int4Weight) -> torch.Tensor:
    if weight.qzeros is not None:
        return weight.qzeros
    return torch.full(weight.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8, device=weight.scales.device)


def _check_2d(weight: Int4Weight) -> None:
    if weight.qweight.dim() != 2:
        raise InputError(f"checkpoints store one linear layer [N, K // 2] at a time, got qweight "
                         f"{tuple(weight.qweight.shape)}")


def int4_to_gptq(weight: Int4Weight, *, v1_zeros: bool = True,
                 dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One linear layer in moeforge's layout -> GPTQ ``qweight``, ``qzeros``, ``scales`` (``dtype``)
    and the trivial ``g_idx``. Symmetric weights get zero point 8 (stored 7 in v1). v1 cannot store a
    zero point of 0 (it would be -1): :class:`InputError`."""
    _check_2d(weight)
    zeros = _zeros_or_symmetric(weight).t().long()  # [groups, N]
    if v1_zeros:
        if zeros.numel() and int(zeros.min()) == 0:
            raise InputError("GPTQ v1 stores zero - 1 and cannot hold a zero point of 0: use v1_zeros=False")
        zeros = zeros - 1
    k = weight.in_features
    return {
        "qweight": pack_int32(unpack_int4(weight.qweight).t(), dim=0),
        "qzeros": pack_int32(zeros, dim=1),
        "scales": weight.scales.t().to(dtype).contiguous(),
        "g_idx": (torch.arange(k, device=weight.qweight.device) // weight.group_size).to(torch.int32),
    }


def int4_to_awq(weight: Int4Weight, *, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One linear layer in moeforge's layout -> AWQ (GEMM) ``qweight``, ``qzeros``, ``scales``."""
    _check_2d(weight)
    return {
        "qweight": pack_int32(unpack_int4(weight.qweight).t(), dim=1, order=AWQ_PACK_ORDER),
        "qzeros": pack_int32(_zeros_or_symmetric(weight).t(), dim=1, order=AWQ_PACK_ORDER),
        "scales": weight.scales.t().to(dtype).contiguous(),
    }
