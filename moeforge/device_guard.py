"""Run on the CUDA device the tensors are on.

Triton launches a kernel on the *current* CUDA device, not on its tensors' device (``torch``'s own ops set a device
guard; a ``torch.library`` custom op and a Triton launcher do not). A layer on ``cuda:1`` called while ``cuda:0`` is
current — a model spread over GPUs with ``device_map``, which moves the hidden states but not the current device —
would launch its kernels on device 0 with device 1's pointers (an illegal memory access where the two devices have
no peer access). The layer's forward and a pipeline's run make the tensors' device current for the call when it is
another (a check of the device index otherwise; the autograd engine already runs each backward node on its device).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch


def several_devices() -> bool:
    """Whether this process sees more than one CUDA device (else no tensor can be on another than the current one:
    callers skip finding the tensor to guard); ``False`` under ``torch.compile``, which guards the device itself (and
    cannot trace ``torch.cuda.device_count``)."""
    return not torch.compiler.is_compiling() and torch.cuda.device_count() > 1


def on_device_of(tensor: Optional[torch.Tensor]) -> ContextManager[object]:
    """``torch.cuda.device(tensor.device)`` when ``tensor`` is on a CUDA device other than the current one, else a
    context that does nothing (also under ``torch.compile``, whose generated code guards the device itself)."""
    if tensor is not None and tensor.is_cuda and not torch.compiler.is_compiling() \
            and tensor.get_device() != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
