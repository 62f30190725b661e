"""The format codes of :mod:`moeforge.kernels.formats` as names a ``@triton.jit`` body can read.

Triton kernels read module globals only as ``tl.constexpr`` values; these wrap the enums' integers, so the
kernels branch on ``B_FMT == W_NVFP4`` rather than on a bare ``5``, and a code changes in one place.
"""

from __future__ import annotations

import triton.language as tl

from moeforge.kernels.formats import KTail, RowFormat, RowScales, WeightFormat

# The weight's format (B_FMT). Codes from W_INT4 up are packed 4-bit; from W_MXFP4 up, packed e2m1.
W_FLOAT = tl.constexpr(int(WeightFormat.FLOAT))
W_FP8 = tl.constexpr(int(WeightFormat.FP8))
W_INT8 = tl.constexpr(int(WeightFormat.INT8))
W_INT4 = tl.constexpr(int(WeightFormat.INT4))
W_MXFP4 = tl.constexpr(int(WeightFormat.MXFP4))
W_NVFP4 = tl.constexpr(int(WeightFormat.NVFP4))
W_FIRST_PACKED = W_INT4
W_FIRST_E2M1 = W_MXFP4

# The rows' format (A_FMT).
ROWS_FLOAT = tl.constexpr(int(RowFormat.FLOAT))
ROWS_FP8 = tl.constexpr(int(RowFormat.FP8))
ROWS_INT8 = tl.constexpr(int(RowFormat.INT8))
ROWS_NVFP4 = tl.constexpr(int(RowFormat.NVFP4))

# The rows' scales (A_SCALE).
SCALES_NONE = tl.constexpr(int(RowScales.NONE))
SCALES_ROW = tl.constexpr(int(RowScales.ROW))
SCALES_GROUP = tl.constexpr(int(RowScales.GROUP))
SCALES_NVFP4 = tl.constexpr(int(RowScales.NVFP4))

# The K-loop's last step (EVEN_K).
K_RAGGED = tl.constexpr(int(KTail.RAGGED))
K_EVEN = tl.constexpr(int(KTail.EVEN))
K_EVEN_VECTOR_SCALES = tl.constexpr(int(KTail.EVEN_VECTOR_SCALES))
