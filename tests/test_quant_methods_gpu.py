"""Every quant method on the GPU: the same layer on CUDA equals it on the CPU.

Each method's layer is built on the CPU (torch backend, fp32 for a tight comparison, and bf16), its
state copied into the same layer on CUDA — the torch stages for every method, and the triton kernels
for those that have them — and both run the same tokens (random routing, one token, every token on
one expert, an empty batch). NVFP4 also dispatches in NVFP4 (``input_global_scale``, rule 3),
emulated on GPUs without FP4 math; W4A4 also runs its fused dispatch -> combine stage.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import moeforge as mf
from moeforge.selector import backends_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, K, H, I = 8, 2, 256, 128

METHODS: dict[str, Callable[[], mf.QuantMethod]] = {
    "fp8 block/group": lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),
    "fp8 channel/token": lambda: mf.Fp8W8A8Method(weight_scales="channel", activation_scales="token"),
    "int8": lambda: mf.Int8W8A8Method(),
    "w4a16 g64 zeros": lambda: mf.W4A16Method(group_size=64),
    "w4a16 g128 symmetric": lambda: mf.W4A16Method(group_size=128, zero_points=False),
    "nvfp4": lambda: mf.Nvfp4Method(),
    "nvfp4 dispatch": lambda: mf.Nvfp4Method(input_global_scale=4.0 / (6 * 448)),
    "mxfp4": lambda: mf.Mxfp4Method(),
    "w4a4 npu": lambda: mf.W4A4NpuMethod(),
}


BF16_TOLERANCE = {"fp8": 6e-2, "int8": 3e-2, "w4a4": 1e-1}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float().cpu()).norm() / want.float().norm().clamp(min=1e-12))


def _layer(make: Callable[[], mf.QuantMethod], device: str, backend: str, dtype: torch.dtype,
           **kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, quant=make(), backend=backend, dtype=dtype, device=device, environ={}, **kwargs)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_method_on_the_gpu_equals_the_cpu(name: str, dtype: torch.dtype) -> None:
    make = METHODS[name]
    if name.startswith("w4a4") and dtype is torch.float32:
        pytest.skip("W4A4NpuMethod takes bf16 activations only")
    cpu = _layer(make, "cpu", "torch", dtype)
    backends = ["torch"]
    if mf.Backend.TRITON in backends_of(cpu.quant) and dtype is torch.bfloat16:
        backends.append("triton")
    x = torch.randn(33, H, dtype=dtype)
    skewed = torch.full((33, E), -5.0)
    skewed[:, 3], skewed[:, 5] = 5.0, 4.0
    with torch.no_grad():
        cases = [(x, cpu.router_logits(x)), (x[:1], cpu.router_logits(x[:1])), (x, skewed)]
        wants = [cpu(tokens, logits) for tokens, logits in cases]
        for backend in backends:
            gpu = _layer(make, "cuda", backend, dtype)
            gpu.load_state_dict(cpu.state_dict())
            gpu.process_weights_after_loading()
            assert gpu.backend.value == backend
            # fp32: the same quantized operands, sums in another order: measured <= 6e-7. bf16: the
            # quantization between the GEMMs sees inputs one bf16 rounding apart (the torch stages round
            # the gate/up output to bf16, the triton epilogue quantizes from fp32; GPU and CPU matmuls
            # round differently), so an element can land one fp8 step (6-12 %) or int4 step (14 %)
            # apart. Measured on an H100 (33 tokens / 1 token / skewed): fp8 <= 3.6e-2, int8 1.1e-2,
            # w4a4 5.6e-2, weight-only methods <= 6.2e-3.
            tol = 2e-3 if dtype is torch.float32 else BF16_TOLERANCE.get(name.split()[0], 2e-2)
            for (tokens, logits), want in zip(cases, wants):
                got = gpu(tokens.cuda(), logits.cuda())
                assert torch.isfinite(got).all()
                assert _rel(got, want) < tol, (backend, tokens.shape[0])
            assert gpu(x[:0].cuda()).shape == (0, H)
            if name == "nvfp4 dispatch":
                assert "dispatch nvfp4 (rule 3" in gpu.describe()


def test_w4a4_fused_dispatch_to_combine_on_the_gpu() -> None:
    unfused = _layer(METHODS["w4a4 npu"], "cuda", "torch", torch.bfloat16)
    fused = _layer(METHODS["w4a4 npu"], "cuda", "torch", torch.bfloat16, dispatcher="fused_ep")
    fused.load_state_dict(unfused.state_dict())
    x = torch.randn(17, H, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert torch.equal(fused(x), unfused(x))
