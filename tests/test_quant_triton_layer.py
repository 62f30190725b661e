"""Quantized layers on the triton backend equal the same layers on the torch backend.

Built the way users build them (``MoELayer(..., quant=..., backend="triton")``), with the weights of
a torch-backend twin; under the interpreter on CPU (fp16: the interpreter mis-computes bf16 dots),
on the GPU at the test's device. Both quantize-before-dispatch (the method's preferred FP8/INT8
dispatch) and quantize-after-dispatch (``dispatch_dtype="fp16"``) are covered.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages

pytest.importorskip("triton")

E, K, H, I = 4, 2, 128, 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

METHODS: dict[str, Callable[[], mf.QuantMethod]] = {
    "fp8 block/group": lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),
    "fp8 channel/token": lambda: mf.Fp8W8A8Method(weight_scales="channel", activation_scales="token"),
    "int8": lambda: mf.Int8W8A8Method(),
    "w4a16 g32 zeros": lambda: mf.W4A16Method(group_size=32, zero_points=True),
    "w4a16 g128 symmetric": lambda: mf.W4A16Method(group_size=128, zero_points=False),
    "mxfp4": lambda: mf.Mxfp4Method(),
    "nvfp4": lambda: mf.Nvfp4Method(),
    "nvfp4 rows": lambda: mf.Nvfp4Method(input_global_scale=4.0 / (6 * 448)),
}
# Methods whose rows travel in the layer's dtype (or in the one format the method requires) either way.
FIXED_DISPATCH = ("w4a16", "mxfp4", "nvfp4")


def _reference(make: Callable[[], mf.QuantMethod], dispatch: str, hidden: int = H, inter: int = I) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(E, K, hidden, inter, quant=make(), backend="torch", dtype=torch.float16, device=DEVICE,
                       environ={}, dispatch_dtype=dispatch)


def _triton_pipeline(layer: mf.MoELayer, table: Any = None) -> mf.Pipeline:  # type: ignore[type-arg]
    """The triton pipeline MoELayer builds, from ``layer``'s method and weights: the method's
    quantizer (by the kernel), the block-aligned dispatch, its triton expert stages, the combine;
    ``table``: their launch table (by default the fallback rules')."""
    from moeforge.kernels.config import ConfigTable
    from moeforge.stages.combine import Combine
    from moeforge.stages.triton import AlignDispatch
    from moeforge.stages.triton_quant import TritonQuantizeTokens

    table = ConfigTable(E, K) if table is None else table
    dispatch = layer.dispatch_decision.dtype
    stages: list[mf.Stage[Any, Any]] = [mf.TopK(E, K, layer.routing)]
    quantize = layer.quant.quantize_stage(dispatch, mf.DType.FP16)
    if isinstance(quantize, mf.QuantizeTokens) and TritonQuantizeTokens.supports(quantize.quantizer):
        quantize = TritonQuantizeTokens(quantize.quantizer)
    stages += [quantize] if quantize is not None else []
    stages.append(AlignDispatch(E, table))
    stages += selected_stages(layer.quant, layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                        backend=mf.Backend.TRITON, configs=table, dispatch=dispatch)
    stages.append(Combine(apply_routing_weights=True, out_dtype=mf.DType.FP16))
    return mf.Pipeline(stages, mf.input_spec(layer.hidden_size, torch.float16, E), debug=True)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("dispatch", ["auto", "fp16"])
def test_quantized_triton_stages_equal_the_torch_layer(name: str, dispatch: str) -> None:
    if dispatch == "fp16" and name.startswith(FIXED_DISPATCH):
        pytest.skip(f"{name} dispatches in one dtype either way")
    reference = _reference(METHODS[name], dispatch)
    pipeline = _triton_pipeline(reference)
    x = torch.randn(5, H, device=DEVICE, dtype=torch.float16)
    skewed = torch.full((5, E), -5.0, device=DEVICE)
    skewed[:, 0], skewed[:, 1] = 5.0, 4.0  # every token on experts 0 and 1, the others idle
    with torch.no_grad():
        # Same quantized operands; an fp32 sum may round differently before the re-quantization
        # between the GEMMs, hence 1e-2 (measured ~1e-3).
        for tokens, logits in ((x, None), (x[:1], None), (x, skewed)):
            logits = reference.router_logits(tokens) if logits is None else logits
            got = pipeline(mf.MoEInput(tokens, logits)).hidden_states
            assert _rel(got, reference(tokens, logits)) < 1e-2
        empty = x[:0]
        assert pipeline(mf.MoEInput(empty, reference.router_logits(empty))).hidden_states.shape == (0, H)
        if DEVICE == "cuda":  # and the layer that MoELayer builds itself
            fast = mf.MoELayer(E, K, H, I, quant=METHODS[name](), backend="triton", dtype=torch.float16,
                               device=DEVICE, environ={}, dispatch_dtype=dispatch)
            fast.load_state_dict(reference.state_dict())
            fast.process_weights_after_loading()
            assert "backend triton" in fast.describe()
            assert _rel(fast(x), reference(x)) < 1e-2


@pytest.mark.parametrize("name", ["fp8 block/group", "int8", "w4a16 g32 zeros", "mxfp4", "nvfp4 rows"])
def test_quantized_triton_stages_with_split_k_loops_equal_the_torch_layer(name: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Both expert GEMMs with their K-loops split in two (``launch_plan.default_split_k`` forced: on a GPU it splits
    only long decode K-loops), through the stages, the custom ops and the FP8 re-quantization between the GEMMs."""
    from moeforge.kernels import launch_plan, moe_gemm

    reductions = []
    real = moe_gemm.moe_gemm_reduce_kernel

    class Counted:
        def __getitem__(self, grid: Any) -> Any:
            reductions.append(grid)
            return real[grid]

    monkeypatch.setattr(launch_plan, "default_split_k", lambda *args: 2)
    monkeypatch.setattr(moe_gemm, "moe_gemm_reduce_kernel", Counted())
    reference = _reference(METHODS[name], "auto", hidden=256, inter=256)  # K-loops of at least two steps
    pipeline = _triton_pipeline(reference)
    x = torch.randn(5, 256, device=DEVICE, dtype=torch.float16)
    with torch.no_grad():
        for tokens in (x, x[:1]):
            got = pipeline(mf.MoEInput(tokens, reference.router_logits(tokens))).hidden_states
            assert _rel(got, reference(tokens)) < 1e-2
    assert len(reductions) == 4  # both GEMMs, both batches


def test_auto_backend_picks_triton_for_quant_methods_with_kernels_and_torch_otherwise() -> None:
    cases = ((METHODS["fp8 block/group"], mf.Backend.TRITON), (METHODS["mxfp4"], mf.Backend.TRITON),
             (METHODS["nvfp4 rows"], mf.Backend.TRITON), (lambda: mf.W4A4NpuMethod(), mf.Backend.TORCH))
    for make, want in cases:
        layer = mf.MoELayer(E, K, H, I, quant=make(), dtype=torch.float16, device=DEVICE, environ={})
        if DEVICE == "cuda":
            assert layer.backend is want
            if want is mf.Backend.TORCH:  # no triton experts compute W4A4: its torch experts run
                assert "experts W4A4NpuExperts" in layer.describe()
        else:
            assert layer.backend is mf.Backend.TORCH
