"""The dense oracle: every expert applied to every token, masked by the routing, in float64.

It shares only the routing math (:func:`~moeforge.stages.topk.select_experts`) and the activation
formula with the pipeline; no dispatch, no grouped GEMM, no combine. Tests compare pipelines with it,
forward and backward: it is differentiable (autograd) in the hidden states, the router logits and every
weight, so a layer's gradients can be checked against its gradients.
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.spec import RoutingWeights, accumulation_dtype
from moeforge.stage import StageKind
from moeforge.stages.activation import ActivationConfig, apply_activation
from moeforge.stages.topk import RoutingConfig, select_experts


def dense_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    *,
    top_k: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    routing: RoutingConfig = RoutingConfig(),
    activation: ActivationConfig = ActivationConfig(),
    selection_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The routed-experts output ``[T, H]`` in float64 (no shared experts)."""
    x = hidden_states.double()
    tokens = x.shape[0]
    num_experts = w13.shape[0]
    # Routes as the layer does: in fp32, or fp64 for a float64 layer.
    topk = select_experts(router_logits, top_k, routing, selection_bias, accumulation_dtype(hidden_states.dtype))
    ids = topk.ids.long()
    gates = torch.zeros(tokens, num_experts, dtype=torch.float64, device=x.device)
    gates.scatter_(1, ids, topk.weights.double())
    chosen = torch.zeros(tokens, num_experts, dtype=torch.bool, device=x.device)
    chosen.scatter_(1, ids, True)
    on_input = routing.apply_weights is RoutingWeights.ON_INPUT
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        gate = gates[:, expert : expert + 1]
        inputs = x * gate if on_input else x
        hidden = inputs @ w13[expert].double().t()
        if w13_bias is not None:
            hidden = hidden + w13_bias[expert].double()
        y = apply_activation(hidden, activation) @ w2[expert].double().t()
        if w2_bias is not None:
            y = y + w2_bias[expert].double()
        out += torch.where(chosen[:, expert : expert + 1], y if on_input else y * gate, 0.0)
    if routing.routed_scaling_factor != 1.0 and not routing.scaling_in_weights:
        out = out * routing.routed_scaling_factor
    return out


def layer_reference(
    layer: torch.nn.Module, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The float64 output of an unquantized :class:`~moeforge.MoELayer`, shared experts included."""
    from moeforge.layer import MoELayer
    from moeforge.quant.unquantized import UnquantizedMethod

    if not isinstance(layer, MoELayer) or not isinstance(layer.quant, UnquantizedMethod):
        raise TypeError("layer_reference needs an MoELayer with the unquantized method")
    # A replaced dispatch or quantize stage moves or rounds rows without changing the math; any other
    # replacement (routing, GEMM, activation, combine) would make this reference wrong.
    neutral = {StageKind.DISPATCH, StageKind.QUANTIZE}
    if any(set(replaced.stage.kinds) - neutral for replaced in layer.replaced_stages):
        raise TypeError("layer_reference computes the built-in stages' math; this layer has custom stages "
                        "(replace_stage), so it would give a wrong reference")
    x = hidden_states.reshape(-1, layer.hidden_size)
    if router_logits is None:
        router_logits = layer.router_logits(x)
    routed = dense_moe(
        x,
        router_logits.reshape(x.shape[0], layer.num_experts),
        top_k=layer.top_k,
        w13=_tensor(layer, "w13_weight"),
        w2=_tensor(layer, "w2_weight"),
        w13_bias=_optional_tensor(layer, "w13_bias"),
        w2_bias=_optional_tensor(layer, "w2_bias"),
        routing=layer.routing,
        activation=layer.activation,
        selection_bias=getattr(layer, "e_score_correction_bias", None),
    )
    shared = layer.shared_experts
    if shared is not None:
        xd = x.double()
        hidden = xd @ shared.gate_up_proj.weight.double().t()
        if shared.gate_up_proj.bias is not None:
            hidden = hidden + shared.gate_up_proj.bias.double()
        y = apply_activation(hidden, shared.config.activation) @ shared.down_proj.weight.double().t()
        if shared.down_proj.bias is not None:
            y = y + shared.down_proj.bias.double()
        if shared.gate is not None:
            y = y * torch.sigmoid(xd @ shared.gate.weight.double().t())
        routed = routed + y
    return routed.reshape(*hidden_states.shape[:-1], layer.hidden_size)


def _optional_tensor(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    value = _optional_tensor(module, name)
    if value is None:
        raise TypeError(f"{type(module).__name__} has no tensor {name!r}")
    return value
