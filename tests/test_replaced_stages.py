"""Stages swapped into a layer with ``replace_stage`` when the layer's pipeline is rebuilt for new settings
(hardening issue, item 10): ``quantize_layer``'s quant method, a new dtype. A replaced stage is put back at
the same place of the forward — by what it reads and produces and the kind of work it replaced, not by the
index or name it had — where the contract checker accepts it; where it cannot fit, the rebuild raises a
:class:`~moeforge.errors.ReplacedStageError` naming the custom stage and what to do."""

from __future__ import annotations

from typing import Any, ClassVar, Union

import attrs
import pytest
import torch
import torch.nn.functional as F

import moeforge as mf
from moeforge.errors import ReplacedStageError
from moeforge.payloads import ExpertRows
from moeforge.quant.w8a8 import quantize_layer
from moeforge.spec import FLOAT_DTYPES

E, K, H, I = 4, 2, 128, 128


@attrs.frozen(eq=False)
class MyCombine(mf.Combine):
    """A user's combine (the built-in math, under its own name)."""


@attrs.frozen(eq=False)
class ClampedSwiGLU(mf.Stage[ExpertRows, ExpertRows]):
    """A user activation: SwiGLU with the gate clamped (float rows in, float rows out)."""

    kinds: ClassVar = (mf.StageKind.ACTIVATION,)
    limit: float = 1e9
    dtypes: frozenset[mf.DType] = FLOAT_DTYPES

    def accepts(self) -> mf.Accepts:
        return mf.Accepts(kind=mf.PayloadKind.EXPERT_HIDDEN, dtype=self.dtypes)

    def output_spec(self, spec: mf.Spec) -> mf.Spec:
        return spec.evolve(width=spec.width // 2)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        gate, up = x.x.data.float().chunk(2, dim=-1)
        return x.with_x(mf.Activations((F.silu(gate.clamp(max=self.limit)) * up).to(x.x.data.dtype)))


def _softmax_topk(hidden: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().softmax(-1).topk(k, dim=-1)
    return values / values.sum(-1, keepdim=True), ids


def _float_layer(**kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={}, **kwargs)


def _run(layer: mf.MoELayer) -> torch.Tensor:
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return layer(x, layer.router_logits(x))


# The float layer's pipeline: TopK, SortedDispatch, GroupedGemm, Activate, GroupedGemm, Combine; the
# quantized one's: TopK, QuantizeTokens, SortedDispatch, W8A8GroupedGemm, ActivateQuantize,
# W8A8GroupedGemm, Combine.
FITTING: dict[str, tuple[Union[int, str], Union[int, str]]] = {"routing": ("TopK", 0), "combine": ("Combine", 5)}


@pytest.mark.parametrize("style", ["by name", "by index"])
@pytest.mark.parametrize("place", list(FITTING))
def test_quantize_layer_keeps_a_custom_stage_that_fits(place: str, style: str) -> None:
    layer = _float_layer()
    which = FITTING[place][0 if style == "by name" else 1]
    custom: mf.Stage[Any, Any] = (mf.CustomTopK(E, K, _softmax_topk, label="softmax") if place == "routing"
                                  else MyCombine(out_dtype=mf.DType.FP32))  # the same math as the built-in ones
    layer.replace_stage(which, custom)
    quantized = quantize_layer(layer, mf.Fp8W8A8Method())  # a deep copy: the stage's copy is in it
    names = [stage.name for stage in quantized.pipeline.stages]
    assert names.index(custom.name) == (0 if place == "routing" else 6) and names.count(custom.name) == 1
    torch.testing.assert_close(_run(quantized), _run(quantize_layer(_float_layer(), mf.Fp8W8A8Method())))


@pytest.mark.parametrize("which", ["ClampedSwiGLU", "Activate", 3, -3])
def test_quantize_layer_refuses_a_custom_stage_that_cannot_fit(which: Union[int, str]) -> None:
    layer = _float_layer()
    layer.replace_stage("Activate" if which == "ClampedSwiGLU" else which, ClampedSwiGLU())
    if which == "ClampedSwiGLU":  # replaced again, by the custom stage's own name: the latest one counts
        layer.replace_stage(which, ClampedSwiGLU(limit=7.0))
    pipeline = layer.pipeline
    with pytest.raises(ReplacedStageError) as info:
        quantize_layer(layer, mf.Fp8W8A8Method())
    error = info.value
    assert isinstance(error, mf.ContractError) and error.field == "kinds"
    message = str(error)
    # says it is about a custom stage, which one, how it was swapped in, and what to do
    assert message.startswith("this layer has a custom stage")
    assert "ClampedSwiGLU" in message and f"replace_stage({which!r}" in message
    assert "ActivateQuantize" in message and "Fp8W8A8Method" in message
    assert "replaced_stages" in message and "replace_stage" in error.hint
    assert layer.pipeline is pipeline and isinstance(layer.quant, mf.UnquantizedMethod)  # left as it was


def test_a_replacement_by_index_follows_its_stage_when_the_stages_move() -> None:
    # fp32 rows sent in fp16: a QuantizeTokens before the dispatch puts the activation at index 4. In
    # fp16 the rows need no conversion, the QuantizeTokens goes, and index 4 is the down GEMM.
    layer = _float_layer(dispatch_dtype="fp16")
    names = [stage.name for stage in layer.pipeline.stages]
    assert names.index("QuantizeTokens") == 1 and names.index("Activate") == 4
    clamped = ClampedSwiGLU()
    layer.replace_stage(4, clamped)
    layer.half()
    assert [stage.name for stage in layer.pipeline.stages].count("QuantizeTokens") == 0
    assert layer.pipeline.stages[3] is clamped
    assert _run(layer.float()).shape == (5, H) and layer.pipeline.stages[4] is clamped


def test_a_custom_stage_that_breaks_a_boundary_names_it() -> None:
    # A custom activation written for fp32 rows, in a layer converted to fp16: it is still the
    # activation's place, but the rows it would read are fp16.
    layer = _float_layer()
    layer.replace_stage("Activate", ClampedSwiGLU(dtypes=frozenset({mf.DType.FP32})))
    with pytest.raises(ReplacedStageError) as info:
        layer.half()
    error = info.value
    assert error.field == "dtype" and error.have is mf.DType.FP16
    assert str(error).startswith("this layer has a custom stage") and "ClampedSwiGLU" in str(error)
    assert "stage 2 (GroupedGemm) -> stage 3 (ClampedSwiGLU)" in str(error)
