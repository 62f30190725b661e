"""Top-k routing: from router logits to expert ids and weights.

One configurable stage covers the routing math of the common families: softmax or sigmoid scoring,
scoring before or after the selection, renormalisation, a per-expert bias used for selection only,
grouped top-k, PhiMoE's sparsemixer, and the routed scaling factor. Routing runs in fp32 (in fp64 for a
float64 layer, whose hidden states are float64), and ties go to the lower expert index (so results do not
depend on the sort algorithm of the device).

The routing weights are differentiable functions of the router logits (autograd, in every routing
here): the selection itself (which experts, which groups, the selection-only bias) is piecewise
constant and passes no gradient, as in every MoE implementation.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional, Union

import attrs
import torch

from moeforge.arguments import positive_int
from moeforge.errors import InputError
from moeforge.payloads import Activations, MoEInput, RoutedTokens, TopKOutput
from moeforge.routing import GroupScore, RoutingConfig, ScoreOrder, Scoring, parse_apply_weights, parse_scaling_factor
from moeforge.spec import Accepts, PayloadKind, RoutingWeights, ScalingFactor, Spec, accumulation_dtype
from moeforge.stage import Stage, StageKind
from moeforge.tensor_ref import TensorSource, resolve

__all__ = ["CustomTopK", "GroupScore", "RoutingConfig", "ScoreOrder", "Scoring", "TopK", "select_experts",
           "topk_lowest_index"]


def topk_lowest_index(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values per row; among equal values the lower index wins."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    config: RoutingConfig,
    selection_bias: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> TopKOutput:
    """The routing math, in ``dtype`` (fp32; fp64 for a float64 layer): returns weights ``[T, k]`` (in
    ``dtype``) and ids ``[T, k]`` (int32).

    Raises :class:`~moeforge.InputError` when ``top_k`` or the grouping does not fit the number of
    experts (``router_logits.shape[-1]``): without the check, a too-large ``top_k`` would silently
    return fewer columns, or pick experts from groups that were masked out.
    """
    _check_sizes(int(router_logits.shape[-1]), top_k, config)
    return _route(router_logits, top_k, config, selection_bias, dtype)


def _route(
    router_logits: torch.Tensor,
    top_k: int,
    config: RoutingConfig,
    selection_bias: Optional[torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> TopKOutput:
    """:func:`select_experts` without the size checks (the stages check once, when built)."""
    logits = router_logits.to(dtype)
    if config.sparsemixer_eps is not None:
        weights, ids = _sparsemixer(logits, top_k, config.sparsemixer_eps)
        if config.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    elif config.order is ScoreOrder.SELECT_THEN_SCORE:
        choice = logits if selection_bias is None else logits + selection_bias.to(dtype)
        ids = topk_lowest_index(choice, top_k)
        chosen = logits.gather(-1, ids)
        weights = chosen.softmax(-1) if config.scoring is Scoring.SOFTMAX else chosen.sigmoid()
        if config.renormalize and config.scoring is Scoring.SIGMOID:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(-1) if config.scoring is Scoring.SOFTMAX else logits.sigmoid()
        choice = scores if selection_bias is None else scores + selection_bias.to(dtype)
        if config.n_group is not None and config.topk_group is not None:
            choice = _mask_unselected_groups(choice, config.n_group, config.topk_group, config.group_score,
                                             config.group_mask_value)
        ids = topk_lowest_index(choice, top_k)
        weights = scores.gather(-1, ids)
        if config.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0 and config.scaling_in_weights:
        weights = weights * config.routed_scaling_factor
    return TopKOutput(weights=weights.to(dtype).contiguous(), ids=ids.to(torch.int32).contiguous())


def _mask_unselected_groups(
    choice: torch.Tensor, n_group: int, topk_group: int, group_score: GroupScore, fill: float
) -> torch.Tensor:
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, n_group, num_experts // n_group)
    if group_score is GroupScore.SUM_TOP2:
        scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    else:
        scores = grouped.max(-1).values
    keep_groups = topk_lowest_index(scores, topk_group)
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, keep_groups, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    return choice.masked_fill(~keep, fill)


def _sparsemixer(logits: torch.Tensor, top_k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's sparsemixer in eval mode, generalised from its two rounds to ``top_k``: returns fp32
    weights and int64 ids ``[T, k]``. ``max`` returns the first (lowest) index among equal values."""
    remaining = logits
    weights, ids = [], []
    for _ in range(top_k):
        best, pick = remaining.max(-1, keepdim=True)
        # The threshold compares every expert's *original* logit with the current best, as in HF.
        factor = logits.abs().clamp(min=best)
        too_far = (best - logits) / factor > 2 * eps
        weights.append(remaining.masked_fill(too_far, float("-inf")).softmax(-1).gather(-1, pick))
        ids.append(pick)
        remaining = remaining.scatter(-1, pick, float("-inf"))
    return torch.cat(weights, -1), torch.cat(ids, -1)


def _check_sizes(num_experts: int, top_k: int, config: RoutingConfig) -> None:
    positive_int("num_experts", num_experts)
    positive_int("top_k", top_k)
    if not 1 <= top_k <= num_experts:
        raise InputError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if config.n_group is not None and config.topk_group is not None:
        if num_experts % config.n_group:
            raise InputError(f"num_experts={num_experts} is not divisible by n_group={config.n_group}")
        if config.topk_group > config.n_group:
            raise InputError(f"topk_group={config.topk_group} exceeds n_group={config.n_group}")
        if top_k > config.topk_group * (num_experts // config.n_group):
            raise InputError(
                f"top_k={top_k} exceeds the experts in topk_group={config.topk_group} groups of "
                f"{num_experts // config.n_group}"
            )


class _RoutingStage(Stage[MoEInput, RoutedTokens]):
    """Shared contract of the routing stages: tokens in, routed tokens out."""

    kinds: ClassVar = (StageKind.TOPK,)
    num_experts: int
    top_k: int

    def accepts(self) -> Accepts:
        return Accepts(kind=PayloadKind.TOKENS, num_experts=self.num_experts)

    def _scaling(self) -> tuple[ScalingFactor, Optional[float]]:
        """The scaling-factor state of the weights, and the factor's value when it is left pending."""
        return ScalingFactor.NONE, None

    def _weights_at(self) -> RoutingWeights:
        return RoutingWeights.IN_COMBINE

    def output_spec(self, spec: Spec) -> Spec:
        scaling, pending = self._scaling()
        return spec.evolve(
            kind=PayloadKind.ROUTED,
            top_k=self.top_k,
            routing_weights=RoutingWeights.PENDING,
            weights_at=self._weights_at(),
            scaling_factor=scaling,
            pending_scale=pending,
        )


@attrs.frozen(eq=False)
class TopK(_RoutingStage):
    """The built-in routing stage (see :class:`RoutingConfig`)."""

    num_experts: int
    top_k: int
    config: RoutingConfig = RoutingConfig()
    selection_bias: Optional[TensorSource] = None

    def __attrs_post_init__(self) -> None:
        _check_sizes(self.num_experts, self.top_k, self.config)
        if self.config.selection_bias and self.selection_bias is None:
            raise InputError("RoutingConfig.selection_bias is set but no selection_bias tensor was given")

    def summary(self) -> str:
        c = self.config
        if c.sparsemixer_eps is not None:
            parts = [f"TopK(k={self.top_k}", f"sparsemixer eps={c.sparsemixer_eps:g}"]
        else:
            parts = [f"TopK(k={self.top_k}", c.scoring.value, c.order.value]
        if c.renormalize:
            parts.append("renormalize")
        if self.selection_bias is not None:
            parts.append("selection bias")
        if c.n_group is not None:
            parts.append(f"groups {c.topk_group}/{c.n_group} by {c.group_score.value}")
            if c.group_mask_value != float("-inf"):
                parts.append(f"dropped groups -> {c.group_mask_value:g}")
        if c.routed_scaling_factor != 1.0:
            parts.append(f"x{c.routed_scaling_factor:g}")
        return ", ".join(parts) + ")"

    def _scaling(self) -> tuple[ScalingFactor, Optional[float]]:
        scaling = self.config.scaling_spec
        return scaling, self.config.routed_scaling_factor if scaling is ScalingFactor.PENDING else None

    def _weights_at(self) -> RoutingWeights:
        return self.config.apply_weights

    def __call__(self, x: MoEInput) -> RoutedTokens:
        bias = resolve(self.selection_bias) if self.selection_bias is not None else None
        topk = _route(x.router_logits, self.top_k, self.config, bias, accumulation_dtype(x.hidden_states.dtype))
        return RoutedTokens(x=Activations(x.hidden_states), topk=topk, adapter_ids=x.adapter_ids)


RoutingFunction = Callable[[torch.Tensor, torch.Tensor, int], "tuple[torch.Tensor, torch.Tensor]"]


@attrs.frozen(eq=False)
class CustomTopK(_RoutingStage):
    """Routing by a user function ``fn(hidden_states, router_logits, top_k) -> (weights, ids)``.

    The function returns float weights and integer ids of shape ``[T, top_k]``; they are converted to
    fp32 (fp64 in a float64 layer) / int32. ``apply_weights`` declares where the weights are to be applied (as
    :attr:`RoutingConfig.apply_weights`; the combine by default). ``scaling_factor`` declares whether
    the function already folded a routed scaling factor into its weights (``IN_WEIGHTS``), or leaves
    the factor ``routed_scaling_factor`` to a later stage (``PENDING``).

    The function's output is user code, so every call checks it (shapes, dtypes, device, and the
    ids' values, which needs one host sync) and raises :class:`~moeforge.InputError`: an id out of
    ``[0, num_experts)`` would otherwise index the expert weights out of bounds, or crash the dispatch,
    and a token routed to the same expert twice would be summed twice by one dispatcher and overflow
    another's capacity. Every routing stage routes a token to ``top_k`` *distinct* experts; the
    built-in ones do so by construction.
    """

    num_experts: int
    top_k: int
    fn: RoutingFunction
    label: str = "custom"
    scaling_factor: ScalingFactor = attrs.field(default=ScalingFactor.NONE, converter=parse_scaling_factor)
    apply_weights: RoutingWeights = attrs.field(default=RoutingWeights.IN_COMBINE, converter=parse_apply_weights)
    routed_scaling_factor: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        _check_sizes(self.num_experts, self.top_k, RoutingConfig())
        if self.apply_weights is RoutingWeights.PENDING:
            raise InputError("CustomTopK apply_weights must say where the weights are applied, not PENDING")
        pending = self.scaling_factor is ScalingFactor.PENDING
        if pending != (self.routed_scaling_factor is not None):
            raise InputError("CustomTopK: give routed_scaling_factor exactly when scaling_factor=ScalingFactor.PENDING "
                             "(the value the stage that applies it must use)")
        if not callable(self.fn):
            raise InputError(f"CustomTopK fn must be a callable fn(hidden_states, router_logits, top_k) -> "
                             f"(weights, ids), got {type(self.fn).__name__}")

    def summary(self) -> str:
        return f"CustomTopK({self.label}, k={self.top_k})"

    def _scaling(self) -> tuple[ScalingFactor, Optional[float]]:
        return self.scaling_factor, self.routed_scaling_factor

    def _weights_at(self) -> RoutingWeights:
        return self.apply_weights

    def __call__(self, x: MoEInput) -> RoutedTokens:
        result: object = self.fn(x.hidden_states, x.router_logits, self.top_k)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            got = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else type(result).__name__
            raise InputError(f"{self.summary()}: the routing function returned {got}; it must return a "
                             "(weights, ids) pair of tensors")
        weights, ids = result
        self._check_output(weights, ids, x.router_logits)
        dtype = accumulation_dtype(x.hidden_states.dtype)
        topk = TopKOutput(weights=weights.to(dtype).contiguous(), ids=ids.to(torch.int32).contiguous())
        return RoutedTokens(x=Activations(x.hidden_states), topk=topk, adapter_ids=x.adapter_ids)

    def _check_output(self, weights: object, ids: object, logits: torch.Tensor) -> None:
        where = f"{self.summary()}: the routing function returned"
        if not isinstance(weights, torch.Tensor) or not isinstance(ids, torch.Tensor):
            raise InputError(f"{where} {type(weights).__name__} weights and {type(ids).__name__} ids; "
                             "it must return (weights, ids) tensors")
        want = (int(logits.shape[0]), self.top_k)
        for name, tensor in (("weights", weights), ("ids", ids)):
            if tuple(tensor.shape) != want:
                raise InputError(f"{where} {name} of shape {tuple(tensor.shape)}; expected {want} "
                                 "(tokens x top_k)")
            if tensor.device != logits.device:
                raise InputError(f"{where} {name} on {tensor.device}; expected {logits.device}")
        if not weights.is_floating_point():
            raise InputError(f"{where} weights of dtype {weights.dtype}; expected a float dtype")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InputError(f"{where} ids of dtype {ids.dtype}; expected an integer dtype")
        if ids.numel():
            ordered = torch.sort(ids, dim=-1).values
            repeated = (ordered[:, 1:] == ordered[:, :-1]).any()
            # One host synchronisation for the three facts.
            low, high, twice = torch.stack([ids.min().long(), ids.max().long(), repeated.long()]).tolist()
            if low < 0 or high >= self.num_experts:
                raise InputError(f"{where} expert ids in [{low}, {high}]; ids must be in "
                                 f"[0, num_experts={self.num_experts})")
            if twice:
                raise InputError(f"{where} a token routed to the same expert more than once; each token's "
                                 f"top_k={self.top_k} ids must be distinct experts")


RoutingStage = Union[TopK, CustomTopK]
