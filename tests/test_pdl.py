"""Programmatic dependent launch (``moeforge.kernels.pdl``): only on NVIDIA GPUs of compute capability 9.0 or more;
elsewhere (the CPU interpreter, older GPUs) the kernels compile without the wait and launch as before; on a GPU the
layer's output is bitwise the same with and without it."""

from __future__ import annotations

import pytest
import torch

import moeforge as mf
from moeforge.kernels import pdl


def test_not_on_the_cpu_and_no_launch_keyword_without_it() -> None:
    assert not pdl.pdl_applies(torch.device("cpu"))
    assert not pdl.applies(None) and not pdl.applies((8, 9))
    assert pdl.applies((9, 0)) == pdl.applies((10, 0)) == pdl.GDC
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
    assert pdl.flag(True) == pdl.WAIT_AND_RELEASE and pdl.flag(False) == pdl.OFF
    assert pdl.flag(True, release=False) == pdl.WAIT and pdl.flag(False, release=False) == pdl.OFF


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("quant", [None, "fp8-block"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_a_layer_gives_the_same_bits_with_and_without_it(monkeypatch: pytest.MonkeyPatch, quant: str,
                                                         tokens: int) -> None:
    """Launched as dependents that release their own dependents early (the default for all but the GEMMs), as
    dependents that only wait, and as plain launches: the same bits (the routing, FP8 quantization, alignment, GEMM
    and combine kernels)."""
    torch.manual_seed(0)
    method = mf.Fp8W8A8Method(weight_scales="block", activation_scales="group") if quant else None
    layer = mf.MoELayer(16, 4, 256, 128, quant=method, dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(tokens, 256, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(tokens, 16, device="cuda")
    assert pdl.pdl_applies(x.device)
    with torch.no_grad():
        released = layer(x, logits)
        monkeypatch.setattr(pdl, "flag", lambda applies, release=True: pdl.WAIT if applies else pdl.OFF)
        waited = layer(x, logits)
        monkeypatch.setattr(pdl, "applies", lambda capability: False)  # every launcher's rule
        plain = layer(x, logits)
    assert torch.equal(released, waited) and torch.equal(released, plain)
