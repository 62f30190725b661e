"""The selector on configurations it cannot build here: which implementations a layer on a CUDA device
gets, and why the others were skipped. ``select`` is a pure function of the :class:`LayerConfig`, so a
CUDA layer's choice can be asked on any machine (no kernel or tensor is made)."""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import pytest
import torch

import moeforge as mf
from moeforge.dispatch_dtype import DispatchDecision, DispatchRule
from moeforge.roles.base import LayerConfig
from moeforge.selector import select

pytest.importorskip("triton")  # the triton roles say "not installed" without it

E, K, H, I = 4, 2, 128, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# A float dispatch dtype other than the layer's own: the six pairs of the three float dtypes.
OTHER_FLOAT = [(dtype, wire) for dtype, wire in itertools.product(DTYPES, DTYPES) if dtype != wire]
# The methods whose triton GEMMs read rows in the layer's dtype, and their experts.
LAYER_DTYPE_ROWS: dict[str, tuple[Callable[[], mf.QuantMethod], str, str]] = {
    "unquantized": (mf.UnquantizedMethod, "TritonUnquantizedExperts", "TorchUnquantizedExperts"),
    "mxfp4": (mf.Mxfp4Method, "TritonMxfp4Experts", "EmulatedMxfp4Experts"),
    "nvfp4": (mf.Nvfp4Method, "TritonNvfp4Experts", "EmulatedNvfp4Experts"),
    "w4a16": (lambda: mf.W4A16Method(group_size=64), "TritonW4A16Experts", "TorchW4A16Experts"),
}


def cuda_config(dtype: str, wire: str, method: mf.QuantMethod, backend: Optional[mf.Backend] = None,
                batch_invariant: bool = False) -> LayerConfig:
    """The configuration ``MoELayer(E, K, H, I, dtype=dtype, dispatch_dtype=wire, device="cuda", ...)``
    gives the selector (dispatch dtype by rule 1: the explicit setting)."""
    decision = DispatchDecision(mf.DispatchDtype.parse(wire), DispatchRule.EXPLICIT)
    return LayerConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, routing=mf.RoutingConfig(),
                       activation=mf.ActivationConfig(), quant=method, dtype=DTYPES[dtype],
                       device=torch.device("cuda"), dispatch=decision, backend=backend,
                       batch_invariant=batch_invariant)


@pytest.mark.parametrize("method", list(LAYER_DTYPE_ROWS))
@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
def test_auto_skips_triton_experts_that_cannot_read_the_dispatched_rows(dtype: str, wire: str, method: str) -> None:
    make, triton, torch_experts = LAYER_DTYPE_ROWS[method]
    selection = select(cuda_config(dtype, wire, make()))
    assert selection.experts is not None and selection.experts.name() == torch_experts
    reasons = dict(selection.skipped)
    assert f"read {dtype} rows (the layer's dtype), not {wire}" in reasons[triton]
    assert f"dispatch_dtype={dtype!r}" in reasons[triton]
    assert reasons[triton] in "\n".join(selection.describe())


@pytest.mark.parametrize("method", list(LAYER_DTYPE_ROWS))
@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
@pytest.mark.parametrize("asked", ["backend='triton'", "batch_invariant=True"])
def test_the_triton_backend_refuses_rows_its_gemms_cannot_read(dtype: str, wire: str, method: str,
                                                               asked: str) -> None:
    make, triton, _ = LAYER_DTYPE_ROWS[method]
    # batch_invariant=True asks the layer for the triton backend (MoELayer._backend_preference)
    config = cuda_config(dtype, wire, make(), backend=mf.Backend.TRITON,
                         batch_invariant=asked == "batch_invariant=True")
    with pytest.raises(mf.InputError) as info:
        select(config)
    message = str(info.value)
    assert f"{triton}: its GEMMs read {dtype} rows" in message and f"dispatch_dtype={dtype!r}" in message
    assert f"dispatch {wire} (rule 1: explicit setting)" in message
    if asked == "batch_invariant=True":  # not backend='triton': the user did not set it
        assert "backend='triton'" not in message and "batch_invariant=True runs on the triton backend" in message


@pytest.mark.parametrize("dtype, wire", OTHER_FLOAT)
@pytest.mark.parametrize("method", [mf.Fp8W8A8Method, mf.Int8W8A8Method])
def test_w8a8_triton_experts_quantize_any_float_rows(dtype: str, wire: str,
                                                     method: Callable[[], mf.QuantMethod]) -> None:
    # They quantize the float rows after the dispatch (QuantizeAligned reads every float dtype): they stay.
    selection = select(cuda_config(dtype, wire, method()))
    assert selection.experts is not None and selection.experts.name() == "TritonW8A8Experts"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_in_the_layers_dtype_keep_the_triton_experts(dtype: str) -> None:
    selection = select(cuda_config(dtype, dtype, mf.UnquantizedMethod()))
    assert selection.experts is not None and selection.experts.name() == "TritonUnquantizedExperts"
