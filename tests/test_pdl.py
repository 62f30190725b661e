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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper (or later) GPU")
def test_a_layer_gives_the_same_bits_with_and_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layer = mf.MoELayer(16, 4, 256, 128, dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(37, 256, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(37, 16, device="cuda")
    assert pdl.pdl_applies(x.device)
    with torch.no_grad():
        with_pdl = layer(x, logits)
        monkeypatch.setattr(pdl, "applies", lambda capability: False)  # every launcher's rule
        without = layer(x, logits)
    assert torch.equal(with_pdl, without)
