"""A float dispatch dtype other than the layer's own on a GPU (hardening issue, item 13).

``MoELayer(4, 2, 32, 16, dtype=torch.float16, dispatch_dtype="fp32", device="cuda")`` used to end in a
``ContractError`` between the block-aligned dispatch and the triton GEMM, which reads rows in its weights'
dtype. The layers, for each layer dtype and another float dispatch dtype (the six pairs of bf16, fp16 and
fp32), unquantized and with the methods whose triton GEMMs read the layer's dtype (MXFP4, NVFP4):

* ``backend="auto"`` builds on the torch experts (the selector says why the triton ones were skipped)
  and equals the same layer on the CPU;
* ``backend="triton"`` and ``batch_invariant=True`` are refused when built, naming ``dispatch_dtype``
  and the dtype the triton experts read;

and the W8A8 triton experts, which quantize float rows of any dtype after the dispatch, still serve.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import pytest
import torch

import moeforge as mf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OTHER_FLOAT = [(dtype, wire) for dtype, wire in itertools.product(DTYPES, DTYPES) if dtype != wire]
# name: (method, sizes E, K, H, I: the for the unquantized layer, 128 / 64 for the 4-bit blocks)
LAYER_DTYPE_ROWS: dict[str, tuple[Callable[[], mf.QuantMethod], tuple[int, int, int, int]]] = {
    "unquantized": (mf.UnquantizedMethod, (4, 2, 32, 16)),
    "mxfp4": (mf.Mxfp4Method, (4, 2, 128, 64)),
    "nvfp4": (mf.Nvfp4Method, (4, 2, 128, 64)),
    "w4a16": (lambda: mf.W4A16Method(group_size=64), (4, 2, 128, 64)),
}
QUANTIZING: dict[str, Callable[[], mf.QuantMethod]] = {"fp8": mf.Fp8W8A8Method, "int8": mf.Int8W8A8Method}


def _layer(make: Callable[[], mf.QuantMethod], sizes: tuple[int, int, int, int], dtype: str, wire: str,
           device: str, **kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(*sizes, quant=make(), dtype=DTYPES[dtype], dispatch_dtype=wire, device=device,
                       environ={}, **kwargs)


def _matches_the_cpu(gpu: mf.MoELayer, make: Callable[[], mf.QuantMethod], sizes: tuple[int, int, int, int],
                     dtype: str, wire: str, tolerance: float) -> None:
    cpu = _layer(make, sizes, dtype, wire, "cpu", backend="torch")
    gpu.load_state_dict(cpu.state_dict())
    gpu.process_weights_after_loading()
    x = torch.randn(9, sizes[2], dtype=DTYPES[dtype])
    with torch.no_grad():
        logits = cpu.router_logits(x)
        want = cpu(x, logits).float()
        got = gpu(x.cuda(), logits.cuda()).float().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < tolerance


@pytest.mark.parametrize("method", list(LAYER_DTYPE_ROWS))
@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
def test_auto_runs_the_torch_experts_and_says_why(dtype: str, wire: str, method: str) -> None:
    make, sizes = LAYER_DTYPE_ROWS[method]
    layer = _layer(make, sizes, dtype, wire, "cuda")
    assert layer.backend is mf.Backend.TORCH and layer.dispatch_decision.dtype.value == wire
    assert f"its GEMMs read {dtype} rows (the layer's dtype), not {wire}" in layer.describe()
    # The same torch experts as on the CPU (the router may be the triton kernel): GPU and CPU matmuls
    # round apart, bf16 rows most (one bf16 step, 8e-3 relative).
    _matches_the_cpu(layer, make, sizes, dtype, wire, tolerance=2e-2)


@pytest.mark.parametrize("method", list(LAYER_DTYPE_ROWS))
@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
@pytest.mark.parametrize("setting", [{"backend": "triton"}, {"batch_invariant": True}], ids=["triton", "invariant"])
def test_the_triton_backend_is_refused_naming_dispatch_dtype(dtype: str, wire: str, method: str,
                                                             setting: dict[str, object]) -> None:
    make, sizes = LAYER_DTYPE_ROWS[method]
    with pytest.raises(mf.InputError) as info:
        _layer(make, sizes, dtype, wire, "cuda", **setting)
    assert f"its GEMMs read {dtype} rows" in str(info.value) and f"dispatch_dtype={dtype!r}" in str(info.value)


@pytest.mark.parametrize("method", list(QUANTIZING))
@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
def test_w8a8_triton_experts_still_serve_other_float_rows(dtype: str, wire: str, method: str) -> None:
    make, sizes = QUANTIZING[method], (4, 2, 128, 64)
    for setting in ({"backend": "triton"}, {"batch_invariant": True}):
        assert _layer(make, sizes, dtype, wire, "cuda", **setting).backend is mf.Backend.TRITON
    layer = _layer(make, sizes, dtype, wire, "cuda")
    assert layer.backend is mf.Backend.TRITON
    # FP8 / INT8 rows quantized from rows one float rounding apart can land one step apart (the
    # tolerances of tests/test_quant_methods_gpu.py).
    _matches_the_cpu(layer, make, sizes, dtype, wire, tolerance=6e-2 if method == "fp8" else 3e-2)
