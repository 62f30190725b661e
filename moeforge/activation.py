"""Expert activations as configuration and math: which activation (gated SwiGLU, GeGLU, GPT-OSS SwiGLU, clamped
SwiGLU, softcapped SwiGLU; plain SiLU, GELU, ReLU²; the identity), how gate and up sit in a row, and the reference computation in fp32.

A gated activation reads a ``2 * I`` wide row holding gate and up — either as two halves
(``CONCATENATED``: ``[gate | up]``, Mixtral/Qwen/DeepSeek) or alternating (``INTERLEAVED``:
``g0 u0 g1 u1 ...``, GPT-OSS) — and produces ``I`` values. The kernels (their activation codes) and the
stages (:class:`~moeforge.stages.activation.Activate`) both read this module.
"""

from __future__ import annotations

import enum
from typing import Union

import attrs
import torch
import torch.nn.functional as F

from moeforge.arguments import enum_member, positive_finite, real
from moeforge.errors import InputError


class ActivationKind(enum.Enum):
    SWIGLU = "swiglu"  # silu(gate) * up
    GEGLU = "geglu"  # gelu(gate) * up
    GPT_OSS_SWIGLU = "gpt_oss_swiglu"  # (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped above
    CLAMPED_SWIGLU = "clamped_swiglu"  # silu(g) * clamp(up), g = gate clamped above (DeepSeek-V4, HY-V4)
    SOFTCAPPED_SWIGLU = "softcapped_swiglu"  # cap_g(gate) * sigmoid(gate) * cap_u(up), cap(x) = c tanh(x / c) (Inkling2)
    SILU = "silu"
    GELU = "gelu"
    RELU2 = "relu2"  # relu(x) ** 2
    # No nonlinearity: experts that are two linear maps. The checker wants exactly one activation
    # between the expert GEMMs, so a model without one says so explicitly.
    IDENTITY = "identity"

    @property
    def gated(self) -> bool:
        return self in (ActivationKind.SWIGLU, ActivationKind.GEGLU, ActivationKind.GPT_OSS_SWIGLU,
                        ActivationKind.CLAMPED_SWIGLU, ActivationKind.SOFTCAPPED_SWIGLU)


class GateUpLayout(enum.Enum):
    CONCATENATED = "concatenated"  # [gate | up]
    INTERLEAVED = "interleaved"  # gate at even columns, up at odd columns


def _kind(value: Union[ActivationKind, str]) -> ActivationKind:
    return enum_member(ActivationKind, "ActivationConfig.kind", value)


def _gate_up(value: Union[GateUpLayout, str]) -> GateUpLayout:
    return enum_member(GateUpLayout, "ActivationConfig.gate_up", value)


@attrs.frozen
class ActivationConfig:
    """Which activation the experts use. ``alpha`` and ``limit`` are GPT-OSS's (1.702 and 7.0; the clamped
    SwiGLU reads ``limit``: gate clamped above at it, up to ``[-limit, limit]``); ``gelu_approximate`` is passed to
    ``torch.nn.functional.gelu`` ("none" or "tanh"); ``gate_softcap`` and ``up_softcap`` are the softcapped SwiGLU's
    (Inkling2's 4 and 25: ``c * tanh(x / c)`` bounds the gate's linear factor and up, the sigmoid sees the raw gate)."""

    kind: ActivationKind = attrs.field(default=ActivationKind.SWIGLU, converter=_kind)
    gate_up: GateUpLayout = attrs.field(default=GateUpLayout.CONCATENATED, converter=_gate_up)
    alpha: float = 1.702
    limit: float = 7.0
    gelu_approximate: str = "none"
    gate_softcap: float = 4.0
    up_softcap: float = 25.0

    def __attrs_post_init__(self) -> None:
        positive_finite("ActivationConfig.alpha", self.alpha)
        positive_finite("ActivationConfig.gate_softcap", self.gate_softcap)
        positive_finite("ActivationConfig.up_softcap", self.up_softcap)
        # limit=inf is a clamp that never bites; zero or a negative limit would clamp every gate to <= 0.
        if not real("ActivationConfig.limit", self.limit) > 0.0:
            raise InputError(f"ActivationConfig.limit must be > 0 (inf: no clamp), got {self.limit!r}")
        if self.gelu_approximate not in ("none", "tanh"):
            raise InputError(f"ActivationConfig.gelu_approximate must be 'none' or 'tanh', got "
                             f"{self.gelu_approximate!r}")

    @property
    def gated(self) -> bool:
        return self.kind.gated

    def summary(self) -> str:
        text = self.kind.value
        if self.gated:
            text += f", {self.gate_up.value}"
        if self.kind is ActivationKind.GPT_OSS_SWIGLU:
            text += f", alpha={self.alpha:g}, limit={self.limit:g}"
        if self.kind is ActivationKind.CLAMPED_SWIGLU:
            text += f", limit={self.limit:g}"
        if self.kind is ActivationKind.SOFTCAPPED_SWIGLU:
            text += f", softcaps gate={self.gate_softcap:g} up={self.up_softcap:g}"
        if self.kind in (ActivationKind.GEGLU, ActivationKind.GELU) and self.gelu_approximate != "none":
            text += f", gelu {self.gelu_approximate}"
        return text


def split_gate_up(x: torch.Tensor, layout: GateUpLayout) -> tuple[torch.Tensor, torch.Tensor]:
    if layout is GateUpLayout.INTERLEAVED:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def apply_activation(x: torch.Tensor, config: ActivationConfig) -> torch.Tensor:
    """The activation of ``x [..., W]`` in fp32, or fp64 for fp64 input (``W`` halves when gated)."""
    x = x if x.dtype == torch.float64 else x.float()
    kind = config.kind
    if kind is ActivationKind.IDENTITY:
        return x
    if kind is ActivationKind.SILU:
        return F.silu(x)
    if kind is ActivationKind.GELU:
        return F.gelu(x, approximate=config.gelu_approximate)
    if kind is ActivationKind.RELU2:
        return torch.relu(x).square()
    gate, up = split_gate_up(x, config.gate_up)
    if kind is ActivationKind.SWIGLU:
        return F.silu(gate) * up
    if kind is ActivationKind.GEGLU:
        return F.gelu(gate, approximate=config.gelu_approximate) * up
    if kind is ActivationKind.SOFTCAPPED_SWIGLU:
        capped_gate = torch.tanh(gate / config.gate_softcap) * config.gate_softcap
        return capped_gate * torch.sigmoid(gate) * (torch.tanh(up / config.up_softcap) * config.up_softcap)
    gate = gate.clamp(max=config.limit)
    up = up.clamp(min=-config.limit, max=config.limit)
    if kind is ActivationKind.CLAMPED_SWIGLU:
        return F.silu(gate) * up
    return (up + 1) * gate * torch.sigmoid(config.alpha * gate)
