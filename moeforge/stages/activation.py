"""The activation stage between the expert GEMMs (the activations themselves: :mod:`moeforge.activation`, whose
names this module also gives)."""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs

from moeforge.activation import ActivationConfig, ActivationKind, GateUpLayout, apply_activation, split_gate_up
from moeforge.payloads import Activations, ExpertRows
from moeforge.spec import REFERENCE_FLOAT_DTYPES, Accepts, DType, PayloadKind, ScaleLayout, Spec
from moeforge.stage import Mismatch, Stage, StageKind

__all__ = ["Activate", "ActivationConfig", "ActivationKind", "GateUpLayout", "apply_activation", "split_gate_up"]


@attrs.frozen(eq=False)
class Activate(Stage[ExpertRows, ExpertRows]):
    """The expert activation between the two GEMMs, on either expert-grouped layout."""

    kinds: ClassVar = (StageKind.ACTIVATION,)
    config: ActivationConfig = ActivationConfig()
    out_dtype: Optional[DType] = None  # None: the input's dtype

    def summary(self) -> str:
        return f"Activate({self.config.summary()})"

    def accepts(self) -> Accepts:
        # Row by row: rows in slot order too (those past the last run activate to values no stage reads).
        return Accepts(kind=PayloadKind.EXPERT_HIDDEN, dtype=REFERENCE_FLOAT_DTYPES, scale_layout=ScaleLayout.NONE,
                       slot_order={False, True})

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if self.config.gated and spec.width % 2:
            found.append(Mismatch("width", spec.width, "an even width (gate and up)",
                                  "a gated activation needs the first GEMM to produce 2 * intermediate"))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        width = spec.width // 2 if self.config.gated else spec.width
        return spec.evolve(width=width, dtype=self.out_dtype or spec.dtype)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        dtype = self.out_dtype.torch_dtype if self.out_dtype is not None else x.x.data.dtype
        return x.with_x(Activations(apply_activation(x.x.data, self.config).to(dtype)))
