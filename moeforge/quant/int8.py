"""INT8 W8A8: INT8 expert weights with one fp32 scale per output channel, INT8 activations with one
fp32 scale per token (symmetric, round to nearest, ``qmax = 127``). The shared machinery is in
:mod:`moeforge.quant.w8a8`."""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.kernels.formats import WeightFormat
from moeforge.quant.w8a8 import W8A8Method
from moeforge.spec import FLOAT_DTYPES, DType, ScaleLayout
from moeforge.stages.quantize import PerTokenQuantizer, Quantizer


@attrs.frozen
class Int8W8A8Method(W8A8Method):
    """INT8 weights (``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]`` int8; ``w13_weight_scale
    [E, 2I]``, ``w2_weight_scale [E, H]`` fp32) and per-token INT8 activations. The experts accept
    INT8 rows (dispatch INT8, the default by rule 6) or float rows (quantized after the dispatch)."""

    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES | {DType.INT8}
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE, ScaleLayout.PER_TOKEN})
    prefers: ClassVar[Optional[DispatchDtype]] = DispatchDtype.INT8
    weight_dtype: ClassVar[DType] = DType.INT8
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.INT8

    @property
    def table_key(self) -> str:
        return "int8-channel-token"

    @property
    def block_weights(self) -> bool:
        return False

    @property
    def activation_quantizer(self) -> Quantizer:
        return PerTokenQuantizer(DType.INT8)
