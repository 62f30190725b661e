"""``MoELayer`` behaves like any ``torch.nn.Module``: constructor defaults as in ``torch.nn``, it follows
``.to()`` / ``.half()`` / ``.to_empty()`` (quantized weights keep their format), it is freed as soon as
it is dropped, and ``describe()`` shows every part of it."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

import moeforge as mf
from moeforge.reference import layer_reference

E, K, H, I = 8, 2, 128, 128


@pytest.fixture
def default_dtype() -> Iterator[Callable[[torch.dtype], None]]:
    before = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(before)


# -- constructor defaults -----------------------------------------------------------------------------


def test_dtype_defaults_to_torch_default_dtype_like_nn_linear(
        default_dtype: Callable[[torch.dtype], None]) -> None:
    layer = mf.MoELayer(8, 2, 64, 96)
    assert layer.dtype == torch.float32 and layer.device == torch.device("cpu")
    assert layer(torch.randn(5, 64)).shape == (5, 64)  # the example: it failed with bf16 weights
    default_dtype(torch.float16)
    half = mf.MoELayer(8, 2, 64, 96)
    assert half.dtype == torch.float16 and half.w13_weight.dtype == torch.float16
    assert half.router is not None and half.router.weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int8, torch.float8_e4m3fn])
def test_an_unsupported_dtype_is_named(dtype: torch.dtype) -> None:
    with pytest.raises(mf.InputError, match="dtype must be torch.bfloat16, torch.float16 or torch.float32"):
        mf.MoELayer(8, 2, 64, 96, dtype=dtype)


# -- following .to() ------------------------------------------------------------------------------------


@pytest.mark.parametrize("convert", ["to", "half", "bfloat16", "float"])
def test_the_layer_follows_a_dtype_conversion(convert: str) -> None:
    start = torch.float32 if convert != "float" else torch.bfloat16
    layer = mf.MoELayer(E, K, H, I, dtype=start, shared_experts=mf.SharedExpertsConfig(32),
                        routing=mf.RoutingConfig(selection_bias=True))
    target = {"to": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32}[convert]
    returned = layer.to(target) if convert == "to" else getattr(layer, convert)()
    assert returned is layer and layer.dtype == target
    assert layer.w13_weight.dtype == target and layer.router is not None and layer.router.weight.dtype == target
    assert layer.e_score_correction_bias.dtype == torch.float32  # routing runs in fp32: stays
    assert layer.pipeline.input_spec.dtype is mf.DType.from_torch(target)
    assert f"dispatch {mf.DType.from_torch(target).value}" in layer.describe()
    x = torch.randn(4, H, dtype=target)
    out = layer(x)
    assert out.dtype == target
    reference = layer_reference(layer, x)
    assert float((out.double() - reference).norm() / reference.norm()) < 2e-2


def test_after_a_conversion_the_old_dtype_is_refused_naming_the_new_one() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.bfloat16).to(torch.float16)
    with pytest.raises(mf.InputError, match="layer's dtype torch.float16, got torch.bfloat16"):
        layer(torch.randn(3, H, dtype=torch.bfloat16))
    assert layer(torch.randn(3, H, dtype=torch.float16)).dtype == torch.float16


def test_a_conversion_to_an_unsupported_dtype_is_refused_and_changes_nothing() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32)
    with pytest.raises(mf.InputError, match="new dtype"):
        layer.to(torch.float8_e4m3fn)
    assert layer.dtype == torch.float32 and layer.w13_weight.dtype == torch.float32
    layer(torch.randn(2, H))


QUANTIZED: dict[str, Callable[[], mf.QuantMethod]] = {
    "fp8": mf.Fp8W8A8Method,
    "fp8-block": lambda: mf.Fp8W8A8Method("block", "group"),
    "int8": mf.Int8W8A8Method,
    "w4a16": lambda: mf.W4A16Method(group_size=32),
    "mxfp4": mf.Mxfp4Method,
    "nvfp4": mf.Nvfp4Method,
    "w4a4-npu": mf.W4A4NpuMethod,
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_weights_keep_their_format_under_a_dtype_conversion(name: str) -> None:
    torch.manual_seed(0)
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, quant=QUANTIZED[name](), expert_bias=True)
    before = {tensor_name: tensor.dtype for tensor_name, tensor in layer.named_tensors_with_fixed_dtype()}
    assert before, "a quantized method has tensors whose dtype is its format"
    x = torch.randn(5, H)
    out32 = layer(x)
    layer.to(torch.bfloat16)
    after = {tensor_name: getattr(layer, tensor_name).dtype for tensor_name in before}
    assert after == before
    assert layer.w13_bias.dtype == torch.bfloat16  # a bias is in the compute dtype and follows
    if name == "w4a16":
        assert layer.w13_scales.dtype == torch.bfloat16  # W4A16 scales are in the compute dtype
    out16 = layer(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    assert float((out16.double() - out32.double()).norm() / out32.double().norm()) < 0.05


def test_to_empty_materialises_a_meta_layer_and_rebuilds_it() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, device="meta")
    assert layer.device == torch.device("meta") and layer.w13_weight.is_meta
    layer.to_empty(device="cpu")
    assert layer.device == torch.device("cpu") and not layer.w13_weight.is_meta
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.05)
    assert layer(torch.randn(3, H)).shape == (3, H)


def test_a_replaced_stage_survives_a_conversion() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32)
    layer.replace_stage("Activate", mf.Activate(mf.ActivationConfig(mf.ActivationKind.SWIGLU)))
    layer.half()
    assert len(layer.replaced_stages) == 1 and layer.pipeline.stages[3].name == "Activate"
    assert layer(torch.randn(2, H, dtype=torch.float16)).dtype == torch.float16


# -- memory: no reference cycles -------------------------------------------------------------------


LAYERS: dict[str, dict[str, Any]] = {
    "sorted": {}, "padded": dict(dispatcher="padded"),
    "shared + selection bias": dict(shared_experts=mf.SharedExpertsConfig(32),
                                    routing=mf.RoutingConfig(selection_bias=True)),
    **{name: dict(quant=make()) for name, make in QUANTIZED.items()},
    "w4a4 fused ep": dict(quant=mf.W4A4NpuMethod(), dispatcher="fused_ep"),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_dropped_layer_is_freed_at_once(name: str) -> None:
    # Without the garbage collector: a reference cycle (layer -> pipeline -> stage -> layer) would keep
    # a deleted layer's weights (on the GPU) alive until gc happened to run.
    gc.collect()
    gc.disable()
    try:
        layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, **LAYERS[name])
        layer(torch.randn(3, H))
        layer_ref, weight_ref = weakref.ref(layer), weakref.ref(next(layer.parameters()))
        del layer
        assert layer_ref() is None and weight_ref() is None
    finally:
        gc.enable()


def test_a_pipeline_taken_from_a_layer_outlives_it() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32)
    x = mf.MoEInput(torch.randn(3, H), torch.randn(3, E))
    expected = layer.pipeline(x).hidden_states
    pipeline = layer.pipeline
    del layer
    gc.collect()
    torch.testing.assert_close(pipeline(x).hidden_states, expected)


def _saved_and_loaded(layer: mf.MoELayer) -> mf.MoELayer:
    # torch.save, not pickle.dumps: plain pickle cannot carry float8 tensors (a torch limitation).
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded: mf.MoELayer = torch.load(buffer, weights_only=False)
    return loaded


@pytest.mark.parametrize("quant", [None, mf.Fp8W8A8Method()], ids=["float", "fp8"])
def test_a_layer_can_be_copied_and_saved(quant: Any) -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, quant=quant)
    x = torch.randn(3, H)
    copies = [copy.deepcopy(layer), _saved_and_loaded(layer)]
    if quant is None:
        copies.append(pickle.loads(pickle.dumps(layer)))
    for other in copies:
        torch.testing.assert_close(other(x), layer(x))
        with torch.no_grad():
            # The copy's stages read the copy's expert weights, not the original's.
            getattr(other, "w13_weight_scale" if quant is not None else "w13_weight").mul_(2)
        assert not torch.equal(other(x), layer(x))


# -- describe() ----------------------------------------------------------------------------------------


def test_describe_shows_the_router_and_the_shared_experts() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, routing=mf.RoutingConfig(router_bias=True, router_in_fp32=True),
                        shared_experts=mf.SharedExpertsConfig(32, gate=mf.SharedGate.SIGMOID))
    text = layer.describe()
    assert text.splitlines()[0] == f"router: Linear({H} -> {E}, bias, logits in fp32)"
    assert text.splitlines()[-1] == ("shared experts: SharedExperts(I=32, swiglu, concatenated, x sigmoid(gate(x))), "
                                     "added to the output")
    assert layer.pipeline.describe() in text
    bare = mf.MoELayer(E, K, H, I, dtype=torch.bfloat16, router=False).describe()
    assert bare.splitlines()[0] == "router: none (forward() takes router_logits)" and "shared experts" not in bare


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_moves_the_layer_and_auto_picks_the_triton_backend() -> None:
    torch.manual_seed(0)
    layer = mf.MoELayer(E, K, H, I, dtype=torch.bfloat16)
    x = torch.randn(9, H, dtype=torch.bfloat16)
    on_cpu = layer(x)
    assert layer.backend is mf.Backend.TORCH
    layer.cuda()
    assert layer.device.type == "cuda" and layer.backend is mf.Backend.TRITON
    assert "AlignDispatch" in layer.describe()
    on_gpu = layer(x.cuda()).cpu()
    assert float((on_gpu.double() - on_cpu.double()).norm() / on_cpu.double().norm()) < 2e-2
    layer.cpu()
    assert layer.backend is mf.Backend.TORCH
    torch.testing.assert_close(layer(x), on_cpu)
