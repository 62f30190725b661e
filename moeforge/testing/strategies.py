"""Hypothesis strategies for moeforge payloads, specs and layer configurations.

Structure (sizes, routing shapes, skew, layouts) is drawn by hypothesis so that it shrinks to the
simplest failing case; tensor *values* come from a ``torch.Generator`` seeded by a drawn integer, which
keeps the tensors cheap while staying reproducible. Token counts always include 0 and 1, and routing
includes the skewed cases (all tokens on one expert, experts with no tokens). Tensors are tiny.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import attrs
import torch
from hypothesis import strategies as st

from moeforge.layer import MoELayer
from moeforge.payloads import (
    Activations,
    ExpertRows,
    MoEInput,
    MoEOutput,
    RoutedTokens,
    TopKOutput,
)
from moeforge.shared_experts import SharedExpertsConfig, SharedGate
from moeforge.spec import (
    DType,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
)
from moeforge.stages.activation import ActivationConfig, ActivationKind, GateUpLayout
from moeforge.stages.dispatch import Overflow, PaddedDispatch, SortedDispatch
from moeforge.stages.quantize import PerGroupQuantizer, PerTensorQuantizer, PerTokenQuantizer
from moeforge.stages.topk import GroupScore, RoutingConfig, ScoreOrder, Scoring

MAX_TOKENS = 6

Payload = Union[MoEInput, RoutedTokens, ExpertRows, MoEOutput]


def seeds() -> st.SearchStrategy[int]:
    return st.integers(min_value=0, max_value=2**31 - 1)


def token_counts(max_tokens: int = MAX_TOKENS) -> st.SearchStrategy[int]:
    """0 and 1 first (hypothesis shrinks towards them), then small batches."""
    return st.one_of(st.sampled_from([0, 1]), st.integers(min_value=0, max_value=max_tokens))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed)).to(dtype)


# -- activations in any format --------------------------------------------------------------------


def quantizer_for_spec(dtype: DType, scale_layout: ScaleLayout) -> Callable[[torch.Tensor], Activations]:
    """A function turning float values into :class:`Activations` of ``dtype`` / ``scale_layout``,
    through the library's quantizers where one exists."""
    if scale_layout is ScaleLayout.NONE:
        if dtype.is_quantized:
            raise ValueError(f"{dtype.value} activations need a scale layout")
        return lambda x: Activations(x.to(dtype.torch_dtype))
    if dtype not in (DType.FP8_E4M3, DType.INT8):
        raise NotImplementedError(f"no test quantizer for {dtype.value}/{scale_layout.value}")
    if scale_layout is ScaleLayout.PER_TOKEN:
        return PerTokenQuantizer(dtype)
    if scale_layout is ScaleLayout.PER_GROUP_128 and dtype is DType.FP8_E4M3:
        return PerGroupQuantizer()
    if scale_layout is ScaleLayout.PER_TENSOR:
        return PerTensorQuantizer(dtype)
    raise NotImplementedError(f"no test quantizer for {dtype.value}/{scale_layout.value}")


def activations_like(values: torch.Tensor, spec: Spec) -> Activations:
    """``values`` (float) in the element format and scale layout ``spec`` declares."""
    return quantizer_for_spec(spec.dtype, spec.scale_layout)(values)


# -- routing ------------------------------------------------------------------------------------------


SKEWS = ("random", "one_expert", "few_experts")


@st.composite
def topk_outputs(
    draw: st.DrawFn, num_tokens: int, num_experts: int, top_k: int, *, normalized: bool = True,
    dtype: torch.dtype = torch.float32,
) -> TopKOutput:
    """A routing decision: distinct int32 ids per token and positive weights in ``dtype`` (fp32; float64
    as a float64 layer's top-k gives them), summing to 1 per token when ``normalized``.

    Skew is drawn: ``random`` (each token an independent random choice), ``one_expert`` (every token
    picks the same first expert; with top_k=1 all tokens land on one expert) and ``few_experts``
    (every token picks among the same ``top_k`` experts, so the others receive nothing).
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    skew = draw(st.sampled_from(SKEWS))
    seed = draw(seeds())
    gen = _generator(seed)
    if skew == "random":
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    else:
        favourite = draw(st.integers(0, num_experts - 1))
        others = [e for e in range(num_experts) if e != favourite]
        if skew == "one_expert":
            rest = torch.rand(num_tokens, num_experts - 1, generator=gen).argsort(-1)[:, : top_k - 1]
            ids = torch.cat([torch.full((num_tokens, 1), favourite), torch.tensor(others)[rest]], dim=1)
        else:
            chosen = torch.tensor([favourite] + others[: top_k - 1])
            ids = chosen[torch.rand(num_tokens, top_k, generator=gen).argsort(-1)]
    uniform = draw(st.booleans())
    if uniform:
        weights = torch.full((num_tokens, top_k), 1.0 / top_k)
    else:
        weights = torch.rand(num_tokens, top_k, generator=gen) + 0.05
        if normalized:
            weights = weights / weights.sum(-1, keepdim=True)
    return TopKOutput(weights=weights.to(dtype).contiguous(), ids=ids.to(torch.int32).contiguous())


@st.composite
def router_logits(draw: st.DrawFn, num_tokens: int, num_experts: int) -> torch.Tensor:
    """fp32 logits ``[T, E]``: random, all equal (every choice a tie), or one expert far ahead of the
    rest (all tokens routed to it first)."""
    kind = draw(st.sampled_from(("random", "ties", "one_expert")))
    logits = _randn((num_tokens, num_experts), draw(seeds()))
    if kind == "ties":
        return torch.zeros(num_tokens, num_experts)
    if kind == "one_expert":
        logits[:, draw(st.integers(0, num_experts - 1))] += 20.0
    return logits


# -- payloads for a spec ------------------------------------------------------------------------------


def _tokens_arg(num_tokens: Optional[int]) -> st.SearchStrategy[int]:
    return st.just(num_tokens) if num_tokens is not None else token_counts()


@st.composite
def moe_inputs(draw: st.DrawFn, spec: Spec, num_tokens: Optional[int] = None) -> MoEInput:
    """A pipeline input (``TOKENS`` spec): hidden states in the spec's dtype, fp32 router logits."""
    if spec.num_experts is None:
        raise ValueError("a TOKENS spec needs num_experts")
    tokens = draw(_tokens_arg(num_tokens))
    hidden = _randn((tokens, spec.width), draw(seeds()), spec.dtype.torch_dtype)
    return MoEInput(hidden, draw(router_logits(tokens, spec.num_experts)))


@st.composite
def routed_tokens(draw: st.DrawFn, spec: Spec, num_tokens: Optional[int] = None) -> RoutedTokens:
    """Routed tokens matching a ``ROUTED`` spec: float, or quantized by the library's quantizers; with
    the routing weights in the dtype the top-k computes for such tokens (fp32, float64 for float64)."""
    if spec.num_experts is None or spec.top_k is None:
        raise ValueError("a ROUTED spec needs num_experts and top_k")
    tokens = draw(_tokens_arg(num_tokens))
    x = activations_like(_randn((tokens, spec.width), draw(seeds())), spec)
    weights_dtype = torch.float64 if spec.dtype is DType.FP64 else torch.float32
    return RoutedTokens(x=x, topk=draw(topk_outputs(tokens, spec.num_experts, spec.top_k, dtype=weights_dtype)))


@st.composite
def dispatch_outputs(draw: st.DrawFn, spec: Spec, num_tokens: Optional[int] = None) -> ExpertRows:
    """Expert-grouped rows matching ``spec`` (``DISPATCHED``, ``EXPERT_HIDDEN`` or ``EXPERT_OUTPUT``
    in the ``EXPERT_SORTED`` or ``EXPERT_PADDED`` layout), built by the library's dispatch stages.

    The rows are dispatched in fp32, float64 for a float64 spec (scaled by their weights when the spec says
    ``ON_INPUT``), then converted to the spec's format. A padded dispatch sometimes gets a small capacity that drops
    copies, as a capacity-bounded low-latency buffer would.
    """
    if spec.num_experts is None:
        raise ValueError("an expert-grouped spec needs num_experts")
    num_experts = spec.num_experts
    top_k = spec.top_k if spec.top_k is not None else draw(st.integers(1, num_experts))
    float_spec = Spec(PayloadKind.ROUTED, Layout.TOKEN_MAJOR, DType.FP64 if spec.dtype is DType.FP64 else DType.FP32,
                      spec.width, num_experts=num_experts, top_k=top_k)
    routed = draw(routed_tokens(float_spec, num_tokens))
    on_input = spec.routing_weights is RoutingWeights.ON_INPUT
    rows: ExpertRows
    if spec.layout is Layout.EXPERT_SORTED:
        group_list_type = spec.group_list_type if spec.group_list_type is not None else GroupListType.COUNT
        rows = SortedDispatch(num_experts, group_list_type, apply_routing_weights=on_input)(routed)
    elif spec.layout is Layout.EXPERT_PADDED:
        capacity = draw(st.one_of(st.none(), st.integers(1, 3)))
        rows = PaddedDispatch(num_experts, capacity, Overflow.DROP, apply_routing_weights=on_input)(routed)
    else:
        raise NotImplementedError(f"no test payloads for layout {spec.layout.value}")
    return rows.with_x(activations_like(rows.x.data, spec))


@st.composite
def moe_outputs(draw: st.DrawFn, spec: Spec, num_tokens: Optional[int] = None) -> MoEOutput:
    tokens = draw(_tokens_arg(num_tokens))
    return MoEOutput(_randn((tokens, spec.width), draw(seeds()), spec.dtype.torch_dtype))


def payload_for(spec: Spec, num_tokens: Optional[int] = None) -> st.SearchStrategy[Payload]:
    """Random payloads matching any spec a stage may consume (``TOKENS``, ``ROUTED``, the
    expert-grouped kinds in both layouts, ``OUTPUT``)."""
    kind = spec.kind
    if kind is PayloadKind.TOKENS:
        return moe_inputs(spec, num_tokens)
    if kind is PayloadKind.ROUTED:
        return routed_tokens(spec, num_tokens)
    if kind is PayloadKind.OUTPUT:
        return moe_outputs(spec, num_tokens)
    return dispatch_outputs(spec, num_tokens)


# -- layer configurations -----------------------------------------------------------------------------


@attrs.frozen
class LayerConfig:
    """Everything needed to build a small :class:`~moeforge.MoELayer`; drawn by :func:`layer_configs`."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    routing: RoutingConfig
    activation: ActivationConfig
    dispatcher: str
    shared_experts: Optional[SharedExpertsConfig]
    expert_bias: bool
    dtype: torch.dtype
    seed: int

    def build(self) -> MoELayer:
        """The layer, with seeded random weights (biases and the selection bias too, so they matter).
        ``environ={}`` keeps a process-wide ``MOEFORGE_DISPATCH_DTYPE`` out of the tests. Vary a
        config with ``attrs.evolve(config, dispatcher="padded")``."""
        torch.manual_seed(self.seed)
        layer = MoELayer(
            self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
            routing=self.routing, activation=self.activation, dispatcher=self.dispatcher,
            shared_experts=self.shared_experts, expert_bias=self.expert_bias, dtype=self.dtype,
            environ={},
        )
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("bias"):
                    param.normal_(std=0.1)
            if self.routing.selection_bias:
                getattr(layer, "e_score_correction_bias").normal_(std=0.1)
        return layer

    def inputs(self, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states ``[T, H]`` and fp32 router logits ``[T, E]`` for this layer."""
        gen = _generator(seed)
        x = torch.randn(num_tokens, self.hidden_size, generator=gen).to(self.dtype)
        return x, torch.randn(num_tokens, self.num_experts, generator=gen)


@st.composite
def routing_configs(draw: st.DrawFn, num_experts: int, top_k: int) -> RoutingConfig:
    """Routing variants: softmax/sigmoid, either order, renormalisation, selection bias, grouped
    top-k (with a valid ``n_group`` / ``topk_group``), routed scaling factor folded or not, and the
    three places the weights can be applied."""
    group_choices = [
        (n_group, topk_group)
        for n_group in range(2, num_experts + 1) if num_experts % n_group == 0
        for topk_group in range(1, n_group + 1) if top_k <= topk_group * (num_experts // n_group)
    ]
    grouped = draw(st.sampled_from([None] + group_choices)) if group_choices else None
    order = ScoreOrder.SCORE_THEN_SELECT if grouped else draw(st.sampled_from(ScoreOrder))
    return RoutingConfig(
        scoring=draw(st.sampled_from(Scoring)),
        order=order,
        renormalize=draw(st.booleans()),
        selection_bias=draw(st.booleans()),
        n_group=grouped[0] if grouped else None,
        topk_group=grouped[1] if grouped else None,
        group_score=draw(st.sampled_from(GroupScore)),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        scaling_in_weights=draw(st.booleans()),
        apply_weights=draw(st.sampled_from(
            [RoutingWeights.IN_COMBINE, RoutingWeights.ON_INPUT, RoutingWeights.IN_GEMM_EPILOGUE])),
        router_bias=draw(st.booleans()),
        router_in_fp32=draw(st.booleans()),
    )


def activation_configs() -> st.SearchStrategy[ActivationConfig]:
    return st.builds(
        ActivationConfig,
        kind=st.sampled_from(ActivationKind),
        gate_up=st.sampled_from(GateUpLayout),
        gelu_approximate=st.sampled_from(["none", "tanh"]),
    )


@st.composite
def layer_configs(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> LayerConfig:
    """Small layer configurations covering sizes, routing variants, every activation kind, both
    dispatchers and shared experts (gated or not). ``dtypes`` defaults to fp32 only, so that
    comparisons with the float64 reference can use tight tolerances."""
    num_experts = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, num_experts))
    shared = draw(st.one_of(st.none(), st.builds(
        SharedExpertsConfig,
        intermediate_size=st.integers(1, 8),
        gate=st.sampled_from(SharedGate),
        activation=activation_configs(),
        bias=st.booleans(),
    )))
    return LayerConfig(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=draw(st.sampled_from([4, 8, 16])),
        intermediate_size=draw(st.integers(1, 8)),
        routing=draw(routing_configs(num_experts, top_k)),
        activation=draw(activation_configs()),
        dispatcher=draw(st.sampled_from(["sorted", "padded"])),
        shared_experts=shared,
        expert_bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(seeds()),
    )


__all__ = [
    "LayerConfig", "MAX_TOKENS", "Payload", "activation_configs", "activations_like",
    "dispatch_outputs", "layer_configs", "moe_inputs", "moe_outputs", "payload_for",
    "quantizer_for_spec", "routed_tokens", "router_logits", "routing_configs", "seeds",
    "token_counts", "topk_outputs",
]
