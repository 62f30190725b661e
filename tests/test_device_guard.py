"""A layer on a CUDA device other than the current one launches its kernels on its own device.

Triton launches on the current device; a model spread over GPUs (``device_map``) calls a layer on ``cuda:1`` while
``cuda:0`` is current. The layer's forward and a pipeline's run make the tensors' device current for the call.
"""

from __future__ import annotations

import pytest
import torch

import moeforge as mf
from moeforge.device_guard import on_device_of


def test_the_guard_does_nothing_off_cuda() -> None:
    with on_device_of(torch.zeros(2)):
        pass
    with on_device_of(None):
        pass


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_layer_on_the_second_device_runs_there(backend: str) -> None:
    torch.manual_seed(0)
    first = mf.MoELayer(8, 2, 64, 32, dtype=torch.bfloat16, device="cuda:0", backend=backend)
    second = mf.MoELayer(8, 2, 64, 32, dtype=torch.bfloat16, device="cuda:1", backend=backend)
    second.load_state_dict(first.state_dict())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.cuda.set_device(0)
    with torch.no_grad():
        want = first(x.to("cuda:0"))
        got = second(x.to("cuda:1"))
        pipeline_got = second.pipeline.run(mf.MoEInput(x.to("cuda:1"), second.router_logits(x.to("cuda:1"))))
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0 and got.device == torch.device("cuda:1")
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(pipeline_got.hidden_states.cpu(), want.cpu())
    out = second(x.to("cuda:1").requires_grad_())  # and its backward
    out.float().sum().backward()
    assert second.w13_weight.grad is not None and second.w13_weight.grad.device == torch.device("cuda:1")
