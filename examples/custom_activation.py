"""A custom activation stage: SwiGLU with a learned per-expert scale, swapped into a layer.

``y = scale[e] * silu(gate) * up`` for rows of expert ``e``. The scale is a parameter the layer
owns; the stage refers to it by name (``ParamRef``), so ``layer.to(...)`` or
``load_state_dict`` are seen by the next call. The stage works on both expert-grouped layouts, and in
every float dtype a layer computes in — float64 included, so that ``torch.autograd.gradcheck`` can check
a float64 layer that uses it: it accepts ``REFERENCE_FLOAT_DTYPES`` (``FLOAT_DTYPES`` would refuse a
float64 layer) and computes in ``accumulation_dtype`` of its input (``.float()`` would round a float64
layer's rows to fp32, and gradcheck would fail).

Run it: ``python examples/custom_activation.py``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

import moeforge as mf
from moeforge.spec import REFERENCE_FLOAT_DTYPES, Accepts, PayloadKind, ScaleLayout, Spec, accumulation_dtype
from moeforge.stages import (
    Activations,
    ExpertRows,
    Mismatch,
    ParamRef,
    SortedRows,
    Stage,
    StageKind,
    select_experts,
)
from moeforge.testing import assert_stage_honours_contract


class ScaledSwiGLU(Stage[ExpertRows, ExpertRows]):
    """``[R, 2I]`` gate|up rows -> ``[R, I]``, each row scaled by its expert's learned scale."""

    kinds: ClassVar = (StageKind.ACTIVATION,)

    def __init__(self, scale: ParamRef) -> None:
        self.scale = scale

    def accepts(self) -> Accepts:
        # After the first GEMM, unquantized (bf16, fp16, fp32, or float64 in a float64 layer), for exactly
        # as many experts as we have scales.
        return Accepts(kind=PayloadKind.EXPERT_HIDDEN, dtype=REFERENCE_FLOAT_DTYPES,
                          scale_layout=ScaleLayout.NONE, num_experts=self.scale.get().shape[0])

    def check(self, spec: Spec) -> list[Mismatch]:
        # A constraint that a set of allowed values cannot say: the width must split into gate | up.
        found = super().check(spec)
        if spec.width % 2:
            found.append(Mismatch("width", spec.width, "an even width",
                                     "the first GEMM must produce 2 * intermediate (gate and up)"))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        return spec.evolve(width=spec.width // 2)  # same kind, layout and dtype, half the width

    def __call__(self, x: ExpertRows) -> ExpertRows:
        # fp32 for bf16 / fp16 / fp32 rows, float64 for float64 rows (not .float(): see the module docstring).
        dtype = accumulation_dtype(x.x.data.dtype)
        data = x.x.data.to(dtype)
        gate, up = data.chunk(2, dim=-1)
        scale = self.scale.get().to(dtype)
        if isinstance(x, SortedRows):  # rows grouped by expert: repeat each scale per row
            row_scale = scale.repeat_interleave(x.counts(), output_size=data.shape[0])[:, None]
        else:  # padded [E, C, W]: one scale per expert buffer
            row_scale = scale[:, None, None]
        y = F.silu(gate) * up * row_scale
        return x.with_x(Activations(y.to(x.x.data.dtype)))


def reference(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The same layer written by hand, densely, in float64."""
    topk = select_experts(logits, layer.top_k, layer.routing)
    w13 = layer.get_parameter("w13_weight").double()  # [E, 2I, H]: gate rows, then up rows
    w2 = layer.get_parameter("w2_weight").double()  # [E, H, I]
    scale = layer.get_parameter("act_scale").double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(topk.weights[t].tolist(), topk.ids[t].tolist()):
            gate, up = (x[t].double() @ w13[e].t()).chunk(2)
            hidden = scale[e] * F.silu(gate) * up
            out[t] += weight * (hidden @ w2[e].t())
    return out


def main() -> None:
    torch.manual_seed(0)
    num_experts, top_k, hidden, intermediate = 4, 2, 16, 32
    for dispatcher in ("sorted", "padded"):
        layer = mf.MoELayer(num_experts, top_k, hidden, intermediate, dispatcher=dispatcher,
                            dtype=torch.float32, environ={})
        # The learned scale: one per expert, owned (and saved, and moved) by the layer.
        layer.register_parameter("act_scale", torch.nn.Parameter(torch.rand(num_experts) + 0.5))
        activation = ScaledSwiGLU(ParamRef(layer, "act_scale"))

        # Replace the built-in activation by name; the pipeline is validated again.
        layer.replace_stage("Activate", activation)
        print(next(line for line in layer.describe().splitlines() if "ScaledSwiGLU" in line))

        # Property-test the stage on the spec it sees in this pipeline (the GEMM's output spec).
        index = layer.pipeline.index("ScaledSwiGLU")
        assert_stage_honours_contract(activation, layer.pipeline.specs[index - 1], max_examples=20)

        x = torch.randn(7, hidden)
        logits = layer.router_logits(x)
        with torch.no_grad():
            out = layer(x, logits)
            expected = reference(layer, x, logits)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        print(f"{dispatcher}: matches the hand-written reference "
              f"(max error {(out.double() - expected).abs().max():.1e})")

    # In a float64 layer the stage computes in float64, so autograd's numerical check holds for the layer.
    layer64 = mf.MoELayer(num_experts, top_k, 8, 6, dtype=torch.float64, environ={})
    layer64.register_parameter("act_scale", torch.nn.Parameter(torch.rand(num_experts, dtype=torch.float64) + 0.5))
    layer64.replace_stage("Activate", ScaledSwiGLU(ParamRef(layer64, "act_scale")))
    x64 = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer64, (x64,))
    print("float64: torch.autograd.gradcheck passes")

    # A mismatch is caught when the stage is plugged in, not at the first forward call: a plain
    # (ungated) layer's first GEMM produces I values, not 2 * I, and I is odd here.
    plain = mf.MoELayer(num_experts, top_k, hidden, 5, dtype=torch.float32, environ={},
                        activation=mf.ActivationConfig(mf.ActivationKind.RELU2))
    plain.register_parameter("act_scale", torch.nn.Parameter(torch.ones(num_experts)))
    try:
        plain.replace_stage("Activate", ScaledSwiGLU(ParamRef(plain, "act_scale")))
    except mf.ContractError as error:
        print(f"\nrejected at build time:\n{error}")
    else:
        raise AssertionError("an odd width should not have been accepted")


if __name__ == "__main__":
    main()
