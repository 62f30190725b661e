"""FP8 W8A8: FP8-e4m3 expert weights (per-channel or 128x128-block scales) and FP8 activations
(per-token or per-128-group scales), as DeepSeek-V3 and vLLM / compressed-tensors FP8 checkpoints
store them. The shared machinery is in :mod:`moeforge.quant.w8a8`."""

from __future__ import annotations

import enum
from typing import ClassVar, Optional, Union

import attrs

from moeforge.arguments import enum_member
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.kernels.formats import WeightFormat
from moeforge.quant.w8a8 import W8A8Method
from moeforge.spec import FLOAT_DTYPES, DType, ScaleLayout
from moeforge.stages.quantize import PerGroupQuantizer, PerTokenQuantizer, Quantizer


class WeightScales(enum.Enum):
    CHANNEL = "channel"  # one fp32 scale per output channel: [E, N]
    BLOCK = "block"  # one fp32 scale per 128 x 128 block: [E, ceil(N/128), ceil(K/128)] (DeepSeek-V3)


class ActivationScales(enum.Enum):
    TOKEN = "token"  # one fp32 scale per row: [R, 1]
    GROUP = "group"  # one fp32 scale per 128 elements of a row: [R, K // 128] (DeepSeek-V3)


def _weight_scales(value: Union[WeightScales, str]) -> WeightScales:
    return enum_member(WeightScales, "weight_scales", value)


def _activation_scales(value: Union[ActivationScales, str]) -> ActivationScales:
    return enum_member(ActivationScales, "activation_scales", value)


@attrs.frozen
class Fp8W8A8Method(W8A8Method):
    """FP8 weights and activations; see :class:`~moeforge.quant.w8a8.W8A8Method` for the parameters.

    Args:
        weight_scales: ``"channel"`` (``w13_weight_scale [E, 2I]``, ``w2_weight_scale [E, H]``) or
            ``"block"`` (128 x 128 blocks; with a gated activation ``intermediate_size`` must be a
            multiple of 128).
        activation_scales: ``"token"`` (``[R, 1]``) or ``"group"`` (``[R, K // 128]``; ``hidden_size``
            and ``intermediate_size`` must be multiples of 128).

    The experts accept FP8 rows with the configured scale layout (dispatch FP8: quantize before the
    dispatch) or float rows (the method quantizes after the dispatch); by default (rule 6) the
    dispatch is FP8.
    """

    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES | {DType.FP8_E4M3}
    # Both scale layouts a configuration may use; each instance's GEMMs accept exactly its own.
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset(
        {ScaleLayout.NONE, ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128})
    prefers: ClassVar[Optional[DispatchDtype]] = DispatchDtype.FP8
    weight_dtype: ClassVar[DType] = DType.FP8_E4M3
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.FP8

    weight_scales: WeightScales = attrs.field(default=WeightScales.CHANNEL,
                                              converter=_weight_scales)
    activation_scales: ActivationScales = attrs.field(default=ActivationScales.TOKEN,
                                                      converter=_activation_scales)

    @property
    def name(self) -> str:
        return f"Fp8W8A8Method(weights={self.weight_scales.value}, activations={self.activation_scales.value})"

    @property
    def table_key(self) -> str:
        return f"fp8-{self.weight_scales.value}-{self.activation_scales.value}"

    @property
    def block_weights(self) -> bool:
        return self.weight_scales is WeightScales.BLOCK

    @property
    def activation_quantizer(self) -> Quantizer:
        if self.activation_scales is ActivationScales.GROUP:
            return PerGroupQuantizer()
        return PerTokenQuantizer(DType.FP8_E4M3)
