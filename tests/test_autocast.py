"""``torch.autocast`` around a model holding a ``MoELayer``: the layer computes in its own dtype (the
hidden states cast to it, autocast off inside), on the CPU and on a GPU (triton backend), forward and
training; outside autocast a hidden-states dtype other than the layer's is still an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import moeforge as mf

H = 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device: str, layer_dtype: torch.dtype = torch.float32, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    layer = mf.MoELayer(8, 2, H, 16, dtype=layer_dtype, device=device,
                        shared_experts=mf.SharedExpertsConfig(16), **kwargs)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
    return nn.Sequential(nn.Linear(H, H, device=device), layer, nn.Linear(H, H, device=device))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("device", DEVICES)
def test_an_fp32_layer_trains_between_autocast_layers(device: str) -> None:
    model = _model(device)
    first, moe, last = model
    x = torch.randn(2, 5, H, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(x)
        assert out.dtype == torch.bfloat16  # the last Linear is autocast's
        assert moe(first(x)).dtype == torch.float32  # the layer computes in its own dtype
    out.float().square().mean().backward()
    got = _grads(model)
    model.zero_grad()
    # What it computes: the autocast Linears around the fp32 layer fed with their bf16 output, cast.
    with torch.autocast(device, dtype=torch.bfloat16):
        hidden = first(x)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=False):
        middle = moe(hidden.float())
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = last(middle)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    expected.float().square().mean().backward()
    for traced, eager in zip(got, _grads(model)):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in got)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_layer_under_autocast_computes_as_without_it(device: str) -> None:
    layer = _model(device, torch.bfloat16)[1]
    x = torch.randn(7, H, device=device, dtype=torch.bfloat16)
    expected = layer(x)
    with torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16):
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(layer(x.float()), expected, rtol=0, atol=0)  # cast to the layer's dtype


def test_outside_autocast_another_dtype_is_still_refused() -> None:
    layer = _model("cpu")[1]
    with pytest.raises(mf.InputError, match="hidden_states must have the layer's dtype"):
        layer(torch.randn(3, H, dtype=torch.bfloat16))
