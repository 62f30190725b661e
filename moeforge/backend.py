"""Backend selection: which implementation of the stages a layer uses."""

from __future__ import annotations

import enum
import importlib.util
from typing import Union

import torch

from moeforge.errors import BackendUnavailableError


class Backend(enum.Enum):
    TORCH = "torch"  # pure PyTorch reference stages; any device
    TRITON = "triton"  # Triton kernels; CUDA devices


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(requested: Union[Backend, str], device: torch.device) -> Backend:
    """``"auto"`` picks triton on a CUDA device when Triton is installed, else torch. An explicit
    backend that cannot run on ``device`` raises :class:`BackendUnavailableError` saying why."""
    if isinstance(requested, Backend):
        choice = requested
    elif not isinstance(requested, str):
        raise BackendUnavailableError(f"backend must be a Backend or 'auto', 'torch' or 'triton', got "
                                      f"{type(requested).__name__} {requested!r}")
    elif requested.lower() == "auto":
        return Backend.TRITON if device.type == "cuda" and triton_installed() else Backend.TORCH
    else:
        try:
            choice = Backend(requested.lower())
        except ValueError:
            raise BackendUnavailableError(
                f"unknown backend {requested!r}; expected 'auto', 'torch' or 'triton'") from None
    if choice is Backend.TRITON:
        if device.type != "cuda":
            raise BackendUnavailableError(
                f"backend='triton' needs a CUDA device, but the layer is on {device}; use "
                "backend='torch' or 'auto'")
        if not triton_installed():
            raise BackendUnavailableError("backend='triton' needs the 'triton' package (pip install triton)")
    return choice
