"""Activation quantization: quantizers, and the stages that apply them before or after dispatch.

A :class:`Quantizer` turns a float tensor into :class:`~moeforge.payloads.Activations` (data +
scales). :class:`QuantizeTokens` applies one to token-major activations before the dispatch (the
wire carries the quantized format); :class:`QuantizeRows` applies one to expert-grouped rows after
the dispatch or between the activation and the second GEMM.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Optional

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.payloads import GROUP_SIZE, Activations, ExpertRows, PaddedRows, RoutedTokens
from moeforge.spec import REFERENCE_FLOAT_DTYPES, Accepts, DType, PayloadKind, ScaleLayout, Spec
from moeforge.stage import Mismatch, Stage, StageKind

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
_TINY = 1e-12  # keeps the scale of an all-zero row finite


class Quantizer(abc.ABC):
    """Turns float activations ``[..., W]`` into a quantized (or cast) :class:`Activations`."""

    dtype: DType
    scale_layout: ScaleLayout
    global_scale: Optional[float] = None  # a static scale that stays with the quantizer (NVFP4)
    # Whether each row's result depends on that row alone. A quantizer that reads the whole tensor (one scale for
    # all rows) must not see the unused slots of padded rows: they hold whatever the buffer held (an exchange
    # leaves them unwritten), so :func:`quantize_rows` zeroes them first for such a quantizer — and for one that
    # does not say (a user's), to be safe.
    row_local: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor) -> Activations:
        """Quantize ``x`` (any float dtype)."""

    def output_spec(self, spec: Spec) -> Spec:
        """``spec`` in this quantizer's format."""
        return spec.evolve(dtype=self.dtype, scale_layout=self.scale_layout, global_scale=self.global_scale)

    def check_width(self, width: int) -> Optional[str]:
        """Why this quantizer cannot take rows of ``width`` elements, or ``None``."""
        return None

    def summary(self) -> str:
        if self.scale_layout is ScaleLayout.NONE:
            return self.dtype.value
        return f"{self.dtype.value}/{self.scale_layout.value}"


@attrs.frozen
class Cast(Quantizer):
    """No quantization: a cast to another float dtype (e.g. fp32 activations dispatched as bf16)."""

    row_local: ClassVar[bool] = True
    dtype: DType
    scale_layout: ScaleLayout = attrs.field(default=ScaleLayout.NONE, init=False)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in REFERENCE_FLOAT_DTYPES:
            raise ValueError(f"Cast needs a float dtype, got {self.dtype.value}")

    def __call__(self, x: torch.Tensor) -> Activations:
        return Activations(x.to(self.dtype.torch_dtype))


def _symmetric(x: torch.Tensor, qmax: float, dtype: DType) -> Activations:
    """Quantize the last dimension of ``x`` with one scale per row (per ``x``'s last axis)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / qmax
    scaled = (x / scale).clamp(-qmax, qmax)
    if dtype is DType.INT8:
        data = scaled.round().to(torch.int8)
    else:
        data = scaled.to(torch.float8_e4m3fn)
    return Activations(data, scale)


@attrs.frozen
class PerTokenQuantizer(Quantizer):
    """Symmetric dynamic quantization, one fp32 scale per row: FP8-e4m3 or INT8."""

    dtype: DType = DType.FP8_E4M3
    scale_layout: ScaleLayout = attrs.field(default=ScaleLayout.PER_TOKEN, init=False)
    row_local: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        if self.dtype not in (DType.FP8_E4M3, DType.INT8):
            raise ValueError(f"per-token quantization supports fp8_e4m3 and int8, got {self.dtype.value}")

    def __call__(self, x: torch.Tensor) -> Activations:
        return _symmetric(x, FP8_MAX if self.dtype is DType.FP8_E4M3 else INT8_MAX, self.dtype)


@attrs.frozen
class PerTensorQuantizer(Quantizer):
    """Symmetric dynamic quantization with one fp32 scale for the whole tensor: FP8-e4m3 or INT8."""

    dtype: DType = DType.FP8_E4M3
    scale_layout: ScaleLayout = attrs.field(default=ScaleLayout.PER_TENSOR, init=False)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in (DType.FP8_E4M3, DType.INT8):
            raise ValueError(f"per-tensor quantization supports fp8_e4m3 and int8, got {self.dtype.value}")

    def __call__(self, x: torch.Tensor) -> Activations:
        qmax = FP8_MAX if self.dtype is DType.FP8_E4M3 else INT8_MAX
        x = x.float()
        amax = x.abs().amax() if x.numel() else x.new_zeros(())  # an empty batch still gets a scale
        scale = (amax.clamp(min=_TINY) / qmax).reshape(1)
        scaled = (x / scale).clamp(-qmax, qmax)
        data = scaled.round().to(torch.int8) if self.dtype is DType.INT8 else scaled.to(torch.float8_e4m3fn)
        return Activations(data, scale)


@attrs.frozen
class PerGroupQuantizer(Quantizer):
    """FP8-e4m3 with one fp32 scale per 128 consecutive elements of a row (DeepSeek-V3 style)."""

    dtype: DType = attrs.field(default=DType.FP8_E4M3, init=False)
    scale_layout: ScaleLayout = attrs.field(default=ScaleLayout.PER_GROUP_128, init=False)
    row_local: ClassVar[bool] = True

    def check_width(self, width: int) -> Optional[str]:
        if width % GROUP_SIZE:
            return f"per-128-group quantization needs a width divisible by {GROUP_SIZE}, got {width}"
        return None

    def __call__(self, x: torch.Tensor) -> Activations:
        lead, width = x.shape[:-1], x.shape[-1]
        grouped = _symmetric(x.reshape(*lead, width // GROUP_SIZE, GROUP_SIZE), FP8_MAX, self.dtype)
        assert grouped.scale is not None
        # An explicit group count (not -1): an empty batch has nothing to infer -1 from.
        scale = grouped.scale.reshape(*lead, width // GROUP_SIZE)
        return Activations(grouped.data.reshape(*lead, width), scale)


def dequantize(x: Activations, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float value of quantized activations (any scale layout but NVFP4)."""
    data = x.data
    if x.scale is None:
        return data.to(dtype)
    values = data.float()
    scale = x.scale.float()
    if scale.shape[-1] not in (1, values.shape[-1]) and scale.dim() == values.dim():
        groups = scale.shape[-1]
        # An explicit group size (not -1): an empty batch has nothing to infer -1 from.
        values = values.reshape(*values.shape[:-1], groups, values.shape[-1] // groups)
        values = values * scale.unsqueeze(-1)
        return values.reshape(data.shape).to(dtype)
    return (values * scale).to(dtype)


def quantizer_for(dispatch: DispatchDtype, compute: DType, *, per_group: bool = False) -> Optional[Quantizer]:
    """The quantizer that produces ``dispatch`` from activations in ``compute``; ``None`` if no-op."""
    target = dispatch.activation_dtype
    if target is compute:
        return None
    if target in REFERENCE_FLOAT_DTYPES:
        return Cast(target)
    if target is DType.FP8_E4M3:
        return PerGroupQuantizer() if per_group else PerTokenQuantizer(DType.FP8_E4M3)
    if target is DType.INT8:
        return PerTokenQuantizer(DType.INT8)
    raise NotImplementedError(f"no {target.value} activation quantizer yet")


def quantize_rows(quantizer: Quantizer, rows: ExpertRows, data: torch.Tensor) -> Activations:
    """``quantizer(data)`` for the rows ``data`` of ``rows``' layout. Padded rows' unused slots (past ``masked_m``)
    hold what their buffer last held — an exchange leaves them unwritten, and they may be any bits, NaN included —
    so a quantizer that reads across rows (:attr:`Quantizer.row_local` false: one scale for the tensor) gets them as
    zeros, which leave its scale that of the used rows."""
    if isinstance(rows, PaddedRows) and not quantizer.row_local and data.dim() == 3:
        data = data.masked_fill(~rows.used_slots().unsqueeze(-1), 0)
    return quantizer(data)


class _QuantizeStage:
    quantizer: Quantizer

    def _width_mismatches(self, spec: Spec) -> list[Mismatch]:
        problem = self.quantizer.check_width(spec.width)
        return [Mismatch("width", spec.width, "a multiple of 128", problem)] if problem else []

    def _quantized(self, spec: Spec) -> Spec:
        return self.quantizer.output_spec(spec)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "these activations are already quantized: quantize once, from float activations"
        return None


@attrs.frozen(eq=False)
class QuantizeTokens(_QuantizeStage, Stage[RoutedTokens, RoutedTokens]):
    """Quantize token-major activations before the dispatch."""

    kinds: ClassVar = (StageKind.QUANTIZE,)
    quantizer: Quantizer

    def summary(self) -> str:
        return f"QuantizeTokens({self.quantizer.summary()})"

    def accepts(self) -> Accepts:
        return Accepts(kind=PayloadKind.ROUTED, dtype=REFERENCE_FLOAT_DTYPES, scale_layout=ScaleLayout.NONE)

    def check(self, spec: Spec) -> list[Mismatch]:
        return Stage.check(self, spec) + self._width_mismatches(spec)

    def output_spec(self, spec: Spec) -> Spec:
        return self._quantized(spec)

    def __call__(self, x: RoutedTokens) -> RoutedTokens:
        return x.with_x(self.quantizer(x.x.data))


@attrs.frozen(eq=False)
class QuantizeRows(_QuantizeStage, Stage[ExpertRows, ExpertRows]):
    """Quantize expert-grouped rows: after the dispatch, or before the second GEMM."""

    kinds: ClassVar = (StageKind.QUANTIZE,)
    quantizer: Quantizer

    def summary(self) -> str:
        return f"QuantizeRows({self.quantizer.summary()})"

    def accepts(self) -> Accepts:
        return Accepts(
            kind={PayloadKind.DISPATCHED, PayloadKind.EXPERT_HIDDEN},
            dtype=REFERENCE_FLOAT_DTYPES,
            scale_layout=ScaleLayout.NONE,
        )

    def check(self, spec: Spec) -> list[Mismatch]:
        return Stage.check(self, spec) + self._width_mismatches(spec)

    def output_spec(self, spec: Spec) -> Spec:
        return self._quantized(spec)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        return x.with_x(quantize_rows(self.quantizer, x, x.x.data))
