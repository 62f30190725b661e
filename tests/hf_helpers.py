"""Helpers shared by the Hugging Face family tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import moeforge as mf
from moeforge.families import family_of_block
from moeforge.hf import HFMoEBlock, from_hf


def tokens_of(hidden: int, batch: int, seq: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, hidden, generator=gen).to(dtype)


def converted_call(block: nn.Module, x: torch.Tensor) -> tuple[mf.MoELayer, Any]:
    """``moeforge.hf.from_hf(block)`` run as the drop-in replacement runs it (full return value)."""
    layer = from_hf(block)
    module = family_of_block(block)
    assert module is not None
    return layer, HFMoEBlock(layer, module, block)(x)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def randomise_weights(model: nn.Module, seed: int) -> None:
    """Every parameter of a ``transformers`` model drawn at random (its expert weights are left uninitialised), and
    DeepSeek-style routers' ``e_score_correction_bias`` buffers too, from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
