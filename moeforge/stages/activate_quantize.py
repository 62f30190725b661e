"""The expert activation fused with the quantization of its output (for a quantized second GEMM).

A W8A8 method's second GEMM consumes FP8 / INT8 rows, so the activation between the GEMMs is followed
by a quantizer. Fusing the two is what the fast kernels do (the activation's fp32 result is
quantized in registers, never written in the float dtype); the torch reference mirrors that: it
quantizes the fp32 output of :func:`~moeforge.stages.activation.apply_activation` directly, without
rounding it to the float dtype first.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs

from moeforge.payloads import ExpertRows
from moeforge.spec import FLOAT_DTYPES, Accepts, PayloadKind, ScaleLayout, Spec
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages.activation import ActivationConfig, apply_activation
from moeforge.stages.quantize import Quantizer, quantize_rows


@attrs.frozen(eq=False)
class ActivateQuantize(Stage[ExpertRows, ExpertRows]):
    """``quantizer(activation(x))`` on expert-grouped float rows (either layout): rows of width
    ``2 * I`` (gated) or ``I`` become quantized rows of width ``I`` in the quantizer's dtype and
    scale layout."""

    kinds: ClassVar = (StageKind.ACTIVATION, StageKind.QUANTIZE)
    config: ActivationConfig
    quantizer: Quantizer

    def summary(self) -> str:
        return f"ActivateQuantize({self.config.summary()} -> {self.quantizer.summary()})"

    def accepts(self) -> Accepts:
        return Accepts(kind=PayloadKind.EXPERT_HIDDEN, dtype=FLOAT_DTYPES, scale_layout=ScaleLayout.NONE)

    def _out_width(self, width: int) -> int:
        return width // 2 if self.config.gated else width

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if self.config.gated and spec.width % 2:
            found.append(Mismatch("width", spec.width, "an even width (gate and up)",
                                  "a gated activation needs the first GEMM to produce 2 * intermediate"))
            return found
        problem = self.quantizer.check_width(self._out_width(spec.width))
        if problem is not None:
            found.append(Mismatch("width", spec.width, "an activation output width the quantizer takes",
                                  f"{problem} (the activation's output is what gets quantized)"))
        return found

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "the activation reads the first GEMM's float output: that GEMM must produce float rows"
        return None

    def output_spec(self, spec: Spec) -> Spec:
        return self.quantizer.output_spec(spec.evolve(width=self._out_width(spec.width)))

    def __call__(self, x: ExpertRows) -> ExpertRows:
        return x.with_x(quantize_rows(self.quantizer, x, apply_activation(x.x.data, self.config)))
