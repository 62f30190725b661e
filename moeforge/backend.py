"""Backend selection: which implementation of the stages a layer uses."""

from __future__ import annotations

import enum
from typing import Union

import torch

from moeforge.errors import BackendUnavailableError


class Backend(enum.Enum):
    TORCH = "torch"  # pure PyTorch reference stages; any device
    TRITON = "triton"  # Triton kernels; CUDA devices


def resolve_backend(requested: Union[Backend, str], device: torch.device) -> Backend:
    """``"auto"`` picks the fastest backend available for ``device``; an explicit backend that cannot
    run there raises :class:`BackendUnavailableError` naming the reason."""
    if isinstance(requested, Backend):
        choice = requested
    elif requested == "auto":
        return Backend.TORCH
    else:
        try:
            choice = Backend(requested)
        except ValueError:
            raise BackendUnavailableError(
                f"unknown backend {requested!r}; expected 'auto', 'torch' or 'triton'") from None
    if choice is Backend.TRITON:
        if device.type != "cuda":
            raise BackendUnavailableError(
                f"backend='triton' needs a CUDA device, but the layer is on {device}; use "
                "backend='torch' or 'auto'")
        raise BackendUnavailableError("the triton backend is not part of this moeforge version yet; "
                                      "use backend='torch' or 'auto'")
    return choice
