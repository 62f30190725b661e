"""The operand formats of the grouped GEMM (:mod:`moeforge.kernels.moe_gemm`), importable without
Triton: the stages name them when they are built."""

from __future__ import annotations

import enum

import torch

SCALE_BLOCK = 128  # the K (and N) extent of one FP8 group / block scale
MXFP4_GROUP = 32  # K-elements per E8M0 scale
NVFP4_GROUP = 16  # K-elements per e4m3 scale


class WeightFormat(enum.IntEnum):
    """The weight operand's format (a ``tl.constexpr`` of the kernel)."""

    FLOAT = 0  # the rows' dtype
    FP8 = 1
    INT8 = 2
    INT4 = 3
    MXFP4 = 4
    NVFP4 = 5

    @property
    def packed(self) -> bool:
        """Two 4-bit values per byte along K (dequantized in registers)."""
        return self >= WeightFormat.INT4


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
