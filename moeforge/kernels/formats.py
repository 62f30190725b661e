"""The operand formats of the grouped GEMM (:mod:`moeforge.kernels.moe_gemm`), importable without
Triton: the one vocabulary of weight formats that the quant methods declare (``QuantMethod.weight_format``),
the stages build their GEMMs for, the launcher checks and the kernels branch on (as the named constants of
:mod:`moeforge.kernels.format_codes`)."""

from __future__ import annotations

import enum
from typing import Optional

import attrs
import torch

from moeforge.spec import ScaleLayout

SCALE_BLOCK = 128  # the K (and N) extent of one FP8 group / block scale
MXFP4_GROUP = 32  # K-elements per E8M0 scale
NVFP4_GROUP = 16  # K-elements per e4m3 scale


class WeightFormat(enum.IntEnum):
    """A weight format: its element type, packing and scales (the value is the kernel's ``B_FMT`` code).

    ======  =====================  ==========================================  ===========================
    format  stored elements        scales                                      rows it meets
    ======  =====================  ==========================================  ===========================
    FLOAT   the rows' float dtype  none                                        float rows of its dtype
    FP8     float8_e4m3fn          fp32, per channel or per 128x128 block      fp8 rows (token/group/tensor)
    INT8    int8                   fp32, per channel or per 128x128 block      int8 rows (token/tensor)
    INT4    two per byte (uint8)   compute dtype per K-group, uint8 zero pts   float rows
    MXFP4   two e2m1 per byte      E8M0 (uint8) per 32                         float rows
    NVFP4   two e2m1 per byte      e4m3 per 16, fp32 global per expert         float or NVFP4 rows
    ======  =====================  ==========================================  ===========================
    """

    # The codes are grouped — float, 8-bit, packed integer, packed e2m1 — because the kernels test a group by a range
    # (kernels/format_codes.py: ``B_FMT >= W_FIRST_PACKED``, ``>= W_FIRST_E2M1``): a new format goes into its group
    # and the codes after it move up (tests/test_format_codes.py checks the ranges against ``packed`` and ``e2m1``).
    FLOAT = 0  # the rows' dtype
    FP8 = 1
    INT8 = 2
    INT4 = 3
    MXFP4 = 4
    NVFP4 = 5

    @property
    def packed(self) -> bool:
        """Two 4-bit values per byte along K (dequantized in registers)."""
        return self in (WeightFormat.INT4, WeightFormat.MXFP4, WeightFormat.NVFP4)

    @property
    def e2m1(self) -> bool:
        """Packed e2m1 codes (MXFP4, NVFP4): shuffled, their words' bits are rearranged too (kernels/shuffle.py)."""
        return self in (WeightFormat.MXFP4, WeightFormat.NVFP4)

    @property
    def eight_bit(self) -> bool:
        """FP8 or INT8 weights, which meet rows of their own dtype (W8A8: the kernel pairs no 8-bit weight with
        float rows yet; a W8A16 format would need that pairing, a code of its own and its own ``input_scales``)."""
        return self in (WeightFormat.FP8, WeightFormat.INT8)

    @property
    def label(self) -> str:
        """The format's name in descriptions (``describe()``, errors)."""
        return _LABELS[self]

    @property
    def storage_dtype(self) -> Optional[torch.dtype]:
        """The dtype the weight is stored in (``None``: the float rows' own)."""
        return {WeightFormat.FP8: torch.float8_e4m3fn, WeightFormat.INT8: torch.int8}.get(
            self, torch.uint8 if self.packed else None)

    @property
    def scale_group(self) -> Optional[int]:
        """K-elements per scale where the format fixes it (MXFP4 32, NVFP4 16); ``None``: per channel or block
        (8-bit) or chosen by the weights (INT4's group size)."""
        return {WeightFormat.MXFP4: MXFP4_GROUP, WeightFormat.NVFP4: NVFP4_GROUP}.get(self)

    @property
    def input_scales(self) -> frozenset[ScaleLayout]:
        """The row-scale layouts a GEMM of this weight format reads."""
        if self is WeightFormat.FP8:
            return frozenset({ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128, ScaleLayout.PER_TENSOR})
        if self is WeightFormat.INT8:
            return frozenset({ScaleLayout.PER_TOKEN, ScaleLayout.PER_TENSOR})
        if self is WeightFormat.NVFP4:
            return frozenset({ScaleLayout.NONE, ScaleLayout.NVFP4_BLOCK16})
        return frozenset({ScaleLayout.NONE})


_LABELS = {WeightFormat.FLOAT: "float", WeightFormat.FP8: "fp8_w8a8", WeightFormat.INT8: "int8_w8a8",
           WeightFormat.INT4: "w4a16", WeightFormat.MXFP4: "mxfp4", WeightFormat.NVFP4: "nvfp4"}


class RowFormat(enum.IntEnum):
    """The rows' format (a ``tl.constexpr`` of the kernel), known from their dtype."""

    FLOAT = 0
    FP8 = 1
    INT8 = 2
    NVFP4 = 3  # uint8 rows: packed e2m1

    @classmethod
    def of(cls, dtype: torch.dtype) -> RowFormat:
        formats = {torch.float8_e4m3fn: cls.FP8, torch.int8: cls.INT8, torch.uint8: cls.NVFP4}
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return cls.FLOAT
        if dtype not in formats:
            raise ValueError(f"rows must be bf16/fp16/fp32, float8_e4m3fn, int8 or uint8 (NVFP4), got {dtype}")
        return formats[dtype]


class RowScales(enum.IntEnum):
    """How the rows' scales are read (the kernel's ``A_SCALE``)."""

    NONE = 0  # float rows
    ROW = 1  # one scale per row (per token; per tensor: every row reads the one scale)
    GROUP = 2  # one per row and 128-wide K-group (FP8 per group)
    NVFP4 = 3  # NVFP4 rows' e4m3 scales per 16


class KTail(enum.IntEnum):
    """What the K-loop knows of its last step (the kernel's ``EVEN_K``)."""

    RAGGED = 0  # K is not a multiple of the step: the last one is masked
    EVEN = 1  # whole steps
    EVEN_VECTOR_SCALES = 2  # whole steps, and an e2m1 weight's scales of a multi-group step load as vectors


@attrs.frozen
class WeightOperand:
    """A checked weight operand: its K extent, scale group and the kernel's scale / zero-point strides."""

    k_dim: int
    group: int  # K-elements per scale of a 4-bit format (1 otherwise)
    blocked: bool  # 8-bit weights with 128x128 block scales
    scale_strides: tuple[int, int, int]
    zero_strides: tuple[int, int, int]


def _stride3(t: Optional[torch.Tensor]) -> tuple[int, int, int]:
    if t is None:
        return 0, 0, 0
    return t.stride(0), t.stride(1), t.stride(2) if t.dim() > 2 else 0


def weight_operand(fmt: WeightFormat, weight: torch.Tensor, scale: Optional[torch.Tensor],
                   zero: Optional[torch.Tensor], global_scale: Optional[torch.Tensor], *,
                   rows_dtype: torch.dtype, global_required: bool = True) -> WeightOperand:
    """Check a weight operand of the grouped GEMM (``rows_dtype``: the float rows' dtype, or the 8-bit
    rows' for FP8 / INT8) and describe it; raises ``ValueError`` saying what is wrong. The stages call it
    when they are built, the launcher on every call. ``global_scale``: NVFP4's per-expert global scales
    (``global_required``: NVFP4 needs them), or for float weights those of decoded NVFP4 weights."""
    if zero is not None and fmt is not WeightFormat.INT4:
        raise ValueError("zero points are for INT4 (W4A16) weights")
    if global_scale is not None and fmt not in (WeightFormat.NVFP4, WeightFormat.FLOAT):
        raise ValueError("weight_global is NVFP4's global scale (or float weights decoded from NVFP4)")
    if weight.dim() != 3:
        raise ValueError(f"weight must be [E, N, K] (or [E, N, K / 2] packed), got {tuple(weight.shape)}")
    experts, n_w = int(weight.shape[0]), int(weight.shape[1])
    if global_scale is not None and (global_scale.dtype != torch.float32 or tuple(global_scale.shape) != (experts,)):
        raise ValueError(f"weight_global must be fp32 [{experts}] (one per expert), got {global_scale.dtype} "
                         f"{tuple(global_scale.shape)}")
    if fmt is WeightFormat.FLOAT:
        if weight.dtype != rows_dtype:
            raise ValueError(f"float weights must be in the rows' dtype {rows_dtype}, got {weight.dtype}")
        return WeightOperand(int(weight.shape[2]), 1, False, (0, 0, 0), (0, 0, 0))
    if scale is None:
        raise ValueError(f"{fmt.name} weights need their scales")
    if fmt in (WeightFormat.FP8, WeightFormat.INT8):
        want = torch.float8_e4m3fn if fmt is WeightFormat.FP8 else torch.int8
        if weight.dtype != want or rows_dtype != want:
            raise ValueError(f"{fmt.name} needs {want} rows and weights, got {rows_dtype} and {weight.dtype}")
        k_dim = int(weight.shape[2])
        block = (experts, -(-n_w // SCALE_BLOCK), -(-k_dim // SCALE_BLOCK))
        if scale.dtype != torch.float32 or tuple(scale.shape) not in ((experts, n_w), block):
            raise ValueError(f"weight_scale must be fp32 [{experts}, {n_w}] (per channel) or {list(block)} "
                             f"(128x128 blocks), got {scale.dtype} {tuple(scale.shape)}")
        return WeightOperand(k_dim, 1, scale.dim() == 3, _stride3(scale), (0, 0, 0))
    if weight.dtype != torch.uint8:
        raise ValueError(f"{fmt.name} weights are packed uint8 [E, N, K / 2], got {weight.dtype}")
    k_dim = 2 * int(weight.shape[2])
    groups = int(scale.shape[2]) if scale.dim() == 3 else 0
    if scale.dim() != 3 or tuple(scale.shape[:2]) != (experts, n_w) or not groups or k_dim % groups:
        raise ValueError(f"weight_scale must be [{experts}, {n_w}, K / G] for K={k_dim}, got {tuple(scale.shape)}")
    group = k_dim // groups
    if fmt is WeightFormat.INT4:
        if group < 16 or group & (group - 1):
            raise ValueError(f"scales [E, N, K / G] must give a power-of-two group size G >= 16 for K={k_dim}, "
                             f"got {groups} groups")
        if scale.dtype != rows_dtype:
            raise ValueError(f"INT4 scales must be in the rows' dtype {rows_dtype}, got {scale.dtype}")
        if zero is not None and (zero.dtype != torch.uint8 or zero.shape != scale.shape):
            raise ValueError(f"zero points must be uint8 {tuple(scale.shape)}, got {zero.dtype} {tuple(zero.shape)}")
    elif fmt is WeightFormat.MXFP4:
        if group != MXFP4_GROUP or scale.dtype != torch.uint8:
            raise ValueError(f"MXFP4 scales must be uint8 E8M0 [E, N, K / 32], got {scale.dtype} "
                             f"{tuple(scale.shape)} for K={k_dim}")
    else:
        if group != NVFP4_GROUP or scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 scales must be float8_e4m3fn [E, N, K / 16], got {scale.dtype} "
                             f"{tuple(scale.shape)} for K={k_dim}")
        if global_scale is None and global_required:
            raise ValueError(f"NVFP4 weights need fp32 global scales [{experts}]")
    return WeightOperand(k_dim, group, False, _stride3(scale), _stride3(zero))
