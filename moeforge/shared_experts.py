"""Shared experts: a dense MLP every token passes through, added to the routed output.

Ungated (DeepSeek-V3, Llama-4) or scaled by ``sigmoid(gate(x))`` per token (Qwen2-MoE).
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Union

import attrs
import torch
from torch import nn

from moeforge.arguments import enum_member, flag, instance_of, positive_int
from moeforge.stages.activation import ActivationConfig, apply_activation

Linear = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class SharedGate(enum.Enum):
    NONE = "none"
    SIGMOID = "sigmoid"  # output * sigmoid(x @ gate_weight.T), one scalar per token


def _gate(value: Union[SharedGate, str]) -> SharedGate:
    return enum_member(SharedGate, "SharedExpertsConfig.gate", value)


@attrs.frozen
class SharedExpertsConfig:
    """``intermediate_size`` is the shared MLP's total width (all shared experts fused into one)."""

    intermediate_size: int
    gate: SharedGate = attrs.field(default=SharedGate.NONE, converter=_gate)
    activation: ActivationConfig = ActivationConfig()
    bias: bool = False

    def __attrs_post_init__(self) -> None:
        positive_int("SharedExpertsConfig.intermediate_size", self.intermediate_size)
        flag("SharedExpertsConfig.bias", self.bias)
        instance_of("SharedExpertsConfig.activation", self.activation, ActivationConfig, "ActivationConfig('swiglu')")


class SharedExperts(nn.Module):
    """``down_proj(act(gate_up_proj(x)))``, optionally times ``sigmoid(gate(x))``.

    ``gate_up_proj.weight`` is ``[2I, H]`` (gate rows then up rows, or interleaved, as the activation
    config says) or ``[I, H]`` for a plain activation.
    """

    def __init__(
        self,
        hidden_size: int,
        config: SharedExpertsConfig,
        *,
        dtype: torch.dtype,
        device: Union[torch.device, str, None] = None,
    ) -> None:
        super().__init__()
        self.config = config
        width = config.intermediate_size * (2 if config.activation.gated else 1)
        kwargs = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Linear(hidden_size, width, bias=config.bias, **kwargs)  # type: ignore[arg-type]
        self.down_proj = nn.Linear(config.intermediate_size, hidden_size, bias=config.bias,
                                   **kwargs)  # type: ignore[arg-type]
        self.gate: Optional[nn.Linear] = None
        if config.gate is SharedGate.SIGMOID:
            self.gate = nn.Linear(hidden_size, 1, bias=False, **kwargs)  # type: ignore[arg-type]

    def summary(self) -> str:
        config = self.config
        text = f"SharedExperts(I={config.intermediate_size}, {config.activation.summary()}"
        if config.bias:
            text += ", bias"
        if config.gate is SharedGate.SIGMOID:
            text += ", x sigmoid(gate(x))"
        return text + ")"

    def forward(self, x: torch.Tensor, linear: Linear = nn.functional.linear) -> torch.Tensor:
        """``linear``: how the projections multiply (``moeforge.batch_invariant.linear`` for a
        batch-invariant layer)."""
        def project(module: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
            return linear(rows, module.weight, module.bias)

        hidden = apply_activation(project(self.gate_up_proj, x), self.config.activation).to(x.dtype)
        out = project(self.down_proj, hidden)
        if self.gate is not None:
            out = out * torch.sigmoid(project(self.gate, x))
        return out
