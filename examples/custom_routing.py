"""A user-written routing stage: hash routing, plugged into a layer and property-tested.

Hash routing (as in "Hash Layers for Large Sparse Models") sends each token to experts chosen by a
hash instead of a learned router. Here the hash is of the token's *content* (its bytes), so the
routing needs no parameters and a token always meets the same experts, wherever it sits in the batch.

Run it: ``python examples/custom_routing.py``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

import moeforge as mf
from moeforge.reference import layer_reference
from moeforge.spec import Accepts, PayloadKind, ScalingFactor, Spec
from moeforge.stages import Activations, RoutedTokens, Stage, StageKind, TopKOutput
from moeforge.stages.activation import apply_activation
from moeforge.testing import assert_stage_honours_contract, check_token_permutation_equivariance


class HashRouting(Stage[mf.MoEInput, RoutedTokens]):
    """Token ``t`` goes to experts ``h(t), h(t) + 1, ..., h(t) + k - 1`` (mod E), each with weight 1/k.

    A stage declares three things: what it accepts, what it produces, and how to run.
    """

    kinds: ClassVar = (StageKind.TOPK,)

    def __init__(self, num_experts: int, top_k: int) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k

    def summary(self) -> str:  # shown by describe()
        return f"HashRouting(k={self.top_k})"

    # 1. What it accepts: the pipeline input, for our number of experts. The pipeline compares this
    #    with what the previous stage produces when it is *built*.
    def accepts(self) -> Accepts:
        return Accepts(kind=PayloadKind.TOKENS, num_experts=self.num_experts)

    # 2. What it produces: routed tokens with k experts each; the weights are not applied yet (the
    #    combine applies them) and there is no routed scaling factor.
    def output_spec(self, spec: Spec) -> Spec:
        return spec.evolve(kind=PayloadKind.ROUTED, top_k=self.top_k,
                           routing_weights=mf.RoutingWeights.PENDING,
                           scaling_factor=ScalingFactor.NONE)

    # 3. How to run: fp32 weights [T, k] and int32 ids [T, k], distinct per token.
    def __call__(self, x: mf.MoEInput) -> RoutedTokens:
        ids = self.expert_ids(x.hidden_states)
        weights = torch.full(ids.shape, 1.0 / self.top_k, dtype=torch.float32, device=ids.device)
        return RoutedTokens(x=Activations(x.hidden_states), topk=TopKOutput(weights, ids))

    def expert_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # A multiplicative hash of the token's bytes (any dtype). Viewing [T, H] as bytes gives
        # [T, H * itemsize]; no reshape(T, -1), which an empty batch cannot infer (the property
        # test below finds that on its first examples).
        data = hidden_states.contiguous().view(torch.uint8).long()
        multipliers = torch.arange(1, data.shape[1] + 1, device=data.device) * 2654435761
        first = (data * multipliers).sum(-1) % self.num_experts
        offsets = torch.arange(self.top_k, device=data.device)
        return ((first[:, None] + offsets) % self.num_experts).to(torch.int32)  # k distinct experts


def dense_hash_moe(layer: mf.MoELayer, routing: HashRouting, x: torch.Tensor) -> torch.Tensor:
    """What the layer should compute, written densely: every token through its k experts, averaged."""
    w13 = layer.get_parameter("w13_weight").double()  # [E, 2I, H]
    w2 = layer.get_parameter("w2_weight").double()  # [E, H, I]
    ids = routing.expert_ids(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e in ids[t].tolist():
            hidden = apply_activation(x[t].double() @ w13[e].t(), layer.activation)
            out[t] += (hidden @ w2[e].t()) / routing.top_k
    return out


def main() -> None:
    torch.manual_seed(0)
    num_experts, top_k, hidden = 8, 2, 32
    routing = HashRouting(num_experts, top_k)

    # Property test the stage on its own: hypothesis draws inputs matching the spec (empty and
    # one-token batches, tied and skewed logits) and checks every output against output_spec().
    spec = mf.input_spec(hidden, torch.float32, num_experts)
    assert_stage_honours_contract(routing, spec, max_examples=30)
    print("HashRouting honours its contract")

    # Plug it into a layer: stage 0 is the built-in TopK. The pipeline is validated again.
    layer = mf.MoELayer(num_experts, top_k, hidden, 64, dtype=torch.float32, environ={})
    layer.replace_stage(0, routing)
    print(layer.describe())

    x = torch.randn(10, hidden)
    with torch.no_grad():
        out = layer(x)
        expected = dense_hash_moe(layer, routing, x)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The library's reference knows only the built-in stages, so it refuses a customised layer
    # rather than returning a wrong answer.
    try:
        layer_reference(layer, x)
    except TypeError as error:
        print(f"layer_reference refuses: {error}")
    else:
        raise AssertionError("layer_reference should refuse a layer with a custom routing stage")
    print(f"matches the dense computation (max error {(out.double() - expected).abs().max():.1e})")

    # Content hashing does not depend on a token's position: permuting the batch permutes the output.
    check_token_permutation_equivariance(layer, x, layer.router_logits(x), torch.randperm(10))
    print("token-permutation equivariant")


if __name__ == "__main__":
    main()
