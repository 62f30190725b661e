"""Quantized methods are inference-only, and say so when asked for gradients.

``loss.backward()`` through a layer with any quant method raises ``InferenceOnlyError`` naming the method
— whether the hidden states or only the layer's own parameters (its router) require grad, and also
where the quantized computation detached its output (INT8 rows cannot carry a gradient) — before any
gradient is written. The forward is unchanged, and inference (``torch.no_grad()``, frozen parameters with
plain inputs) records nothing. A hand-built pipeline that quantizes its activations is inference-only
the same way, and a method written outside moeforge is until it declares ``differentiable = True``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import pytest
import torch

import moeforge as mf
from moeforge.errors import InferenceOnlyError
from moeforge.spec import FLOAT_DTYPES

E, K, H, I, T = 4, 2, 128, 128, 6

# (quant method, extra MoELayer arguments): every method, the dispatch formats it takes, both local dispatchers
LAYERS: dict[str, tuple[Callable[[], mf.QuantMethod], dict[str, Any]]] = {
    "fp8": (mf.Fp8W8A8Method, {}),
    "fp8-block-group-padded": (lambda: mf.Fp8W8A8Method("block", "group"), dict(dispatcher="padded")),
    "fp8-float-dispatch": (mf.Fp8W8A8Method, dict(dispatch_dtype="fp32")),  # quantizes after the dispatch
    "int8": (mf.Int8W8A8Method, {}),
    "w4a16": (lambda: mf.W4A16Method(group_size=32), {}),
    "w4a16-padded": (lambda: mf.W4A16Method(group_size=64, zero_points=False), dict(dispatcher="padded")),
    "mxfp4": (mf.Mxfp4Method, {}),
    "nvfp4": (mf.Nvfp4Method, {}),
    "nvfp4-on-the-wire": (lambda: mf.Nvfp4Method(input_global_scale=1.0), {}),
    "w4a4-npu": (mf.W4A4NpuMethod, dict(dtype=torch.bfloat16)),
    "w4a4-npu-fused-ep": (mf.W4A4NpuMethod, dict(dtype=torch.bfloat16, dispatcher="fused_ep")),
}


def make_layer(name: str, **extra: Any) -> mf.MoELayer:
    method, kwargs = LAYERS[name]
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, quant=method(), environ={}, **{"dtype": torch.float32, **kwargs, **extra})


def _tokens(layer: mf.MoELayer, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(layer.dtype)
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("wants_grad", ["hidden-states", "router-only"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_backward_through_a_quantized_layer_names_its_method(name: str, wants_grad: str) -> None:
    layer = make_layer(name)
    x = _tokens(layer, requires_grad=wants_grad == "hidden-states")
    out = layer(x)
    assert out.requires_grad
    with pytest.raises(InferenceOnlyError, match=rf"{type(layer.quant).__name__}.* is inference-only") as info:
        out.square().sum().backward()
    assert "UnquantizedMethod" in str(info.value) and "torch.no_grad()" in str(info.value)
    # The error comes first: no gradient at all was written, so none can be mistaken for a real one.
    assert x.grad is None and all(param.grad is None for param in layer.parameters())


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_forward_is_unchanged_and_inference_records_nothing(name: str) -> None:
    layer = make_layer(name)
    x = _tokens(layer, requires_grad=True)
    recorded = layer(x)
    with torch.no_grad():
        plain = layer(x)
    assert plain.grad_fn is None
    assert torch.equal(recorded.detach(), plain)
    with torch.inference_mode():
        assert not layer(x.detach()).requires_grad
    layer.requires_grad_(False)
    frozen = layer(x.detach())  # nothing requires grad: nothing to refuse, nothing attached
    assert frozen.grad_fn is None and torch.equal(frozen, plain)


def test_an_output_the_quantized_path_detached_still_refuses() -> None:
    # INT8 rows carry no gradient: with given logits and frozen weights, the output of the quantized experts
    # would not depend on the hidden states at all (no grad_fn), and a loss adding the hidden states would
    # train as if the experts were constant. The output is tied to the hidden states and refuses instead.
    layer = make_layer("int8", router=False)
    layer.requires_grad_(False)
    x = _tokens(layer, requires_grad=True)
    out = layer(x, torch.randn(T, E))
    assert out.grad_fn is not None
    with pytest.raises(InferenceOnlyError, match="Int8W8A8Method"):
        (out.sum() + x.sum()).backward()


def test_describe_says_why_a_layer_has_no_backward() -> None:
    assert "no backward: Int8W8A8Method" in make_layer("int8").describe()
    unquantized = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={})
    assert unquantized.pipeline.no_backward is None and "no backward" not in unquantized.describe()


@pytest.mark.parametrize("name", ["fp8", "w4a16", "w4a4-npu"])
def test_apply_without_routing_weights_is_inference_only(name: str) -> None:
    layer = make_layer(name)
    rows = torch.randn(7, H, dtype=layer.dtype, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 0])
    out = layer.quant.apply_without_routing_weights(layer, rows, None, 1, counts, layer.dtype)
    with pytest.raises(InferenceOnlyError, match=type(layer.quant).__name__):
        out.sum().backward()
    assert rows.grad is None


def _hand_built(quantizer: mf.stages.Quantizer, w13: torch.Tensor, w2: torch.Tensor) -> mf.Pipeline[Any, Any]:
    accepts = frozenset({mf.DType.FP32, quantizer.dtype})
    scales = frozenset({mf.ScaleLayout.NONE, quantizer.scale_layout})
    return mf.Pipeline([
        mf.TopK(E, K), mf.QuantizeTokens(quantizer), mf.SortedDispatch(E),
        mf.GroupedGemm(mf.GemmRole.GATE_UP, w13, accepts_dtypes=accepts, accepts_scales=scales,
                       out_dtype=mf.DType.FP32),
        mf.Activate(), mf.GroupedGemm(mf.GemmRole.DOWN, w2), mf.Combine(),
    ], mf.input_spec(H, torch.float32, E))


@pytest.mark.parametrize("dtype", [mf.DType.FP8_E4M3, mf.DType.INT8], ids=["fp8", "int8"])
def test_a_pipeline_that_quantizes_its_activations_has_no_backward(dtype: mf.DType) -> None:
    w13 = torch.randn(E, 2 * I, H, requires_grad=True)
    w2 = torch.randn(E, H, I, requires_grad=True)
    pipeline = _hand_built(mf.stages.PerTokenQuantizer(dtype), w13, w2)
    assert pipeline.no_backward is not None and "stage 1 (QuantizeTokens)" in pipeline.no_backward
    assert "no backward: stage 1 (QuantizeTokens)" in pipeline.describe()
    logits = torch.randn(T, E, requires_grad=True)
    out = pipeline(mf.MoEInput(torch.randn(T, H, requires_grad=True), logits)).hidden_states
    with pytest.raises(InferenceOnlyError, match=f"quantizes the activations to {dtype.value}"):
        out.sum().backward()
    assert logits.grad is None and w13.grad is None and w2.grad is None
    # replace() keeps the verdict; a float pipeline has a backward
    assert pipeline.replace(0, mf.TopK(E, K)).no_backward == pipeline.no_backward
    floats = _hand_built(mf.stages.Cast(mf.DType.BF16), w13, w2)
    assert floats.no_backward is None


class OutsideFloatMethod(mf.QuantMethod):
    """A method written outside moeforge: float weights, its own torch stages."""

    accepts: ClassVar[frozenset[mf.DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[mf.ScaleLayout]] = frozenset({mf.ScaleLayout.NONE})

    def create_weights(self, layer: torch.nn.Module, *, num_experts: int, hidden_size: int,
                       intermediate_size: int, gated: bool, bias: bool, dtype: torch.dtype, device: Any) -> None:
        layer.register_parameter("gate_up", torch.nn.Parameter(
            torch.randn(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype) / hidden_size ** 0.5))
        layer.register_parameter("down", torch.nn.Parameter(
            torch.randn(num_experts, hidden_size, intermediate_size, dtype=dtype) / intermediate_size ** 0.5))

    def expert_stages(self, layer: torch.nn.Module, *, activation: mf.ActivationConfig,
                      routing_weights_in_epilogue: bool, **kwargs: Any) -> list[mf.Stage[Any, Any]]:
        from moeforge.tensor_ref import ParamRef

        return [mf.GroupedGemm(mf.GemmRole.GATE_UP, ParamRef(layer, "gate_up")), mf.Activate(activation),
                mf.GroupedGemm(mf.GemmRole.DOWN, ParamRef(layer, "down"),
                               apply_routing_weights=routing_weights_in_epilogue)]


class DifferentiableOutsideMethod(OutsideFloatMethod):
    differentiable: ClassVar[bool] = True


def test_a_method_from_outside_moeforge_trains_only_when_it_says_so() -> None:
    torch.manual_seed(0)
    x = torch.randn(T, 32)
    refused = mf.MoELayer(E, K, 32, 16, quant=OutsideFloatMethod(), dtype=torch.float32, environ={})
    with pytest.raises(InferenceOnlyError, match="OutsideFloatMethod"):
        refused(x).sum().backward()
    trained = mf.MoELayer(E, K, 32, 16, quant=DifferentiableOutsideMethod(), dtype=torch.float32, environ={})
    trained(x).square().sum().backward()
    assert all(param.grad is not None for param in trained.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fp8", "int8", "w4a16"])
def test_a_quantized_triton_layer_refuses_backward(name: str) -> None:
    method, kwargs = LAYERS[name]
    torch.manual_seed(0)
    layer = mf.MoELayer(E, K, H, I, quant=method(), environ={}, dtype=torch.bfloat16, device="cuda", **kwargs)
    assert layer.backend is mf.Backend.TRITON
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(InferenceOnlyError, match=type(layer.quant).__name__):
        layer(x).float().square().sum().backward()
