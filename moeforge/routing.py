"""Routing as configuration: how router logits become expert ids and weights (:class:`RoutingConfig`: scoring,
order, renormalisation, selection bias, groups, sparsemixer, scaling factor, where the weights are applied). The
routing kernel and the top-k stages (:mod:`moeforge.stages.topk`) both read it."""

from __future__ import annotations

import enum
from typing import Optional, Union

import attrs

from moeforge.arguments import enum_member, flag, positive_finite, positive_int, real
from moeforge.errors import InputError
from moeforge.spec import RoutingWeights, ScalingFactor


class Scoring(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class ScoreOrder(enum.Enum):
    SCORE_THEN_SELECT = "score_then_select"  # Mixtral, Qwen, DeepSeek: score all experts, keep top-k
    SELECT_THEN_SCORE = "select_then_score"  # GPT-OSS, Llama-4, Granite: top-k logits, score those k


class GroupScore(enum.Enum):
    SUM_TOP2 = "sum_top2"  # DeepSeek-V3: a group's score is the sum of its two best experts
    MAX = "max"  # DeepSeek-V2: a group's score is its best expert


def _scoring(value: Union[Scoring, str]) -> Scoring:
    return enum_member(Scoring, "RoutingConfig.scoring", value)


def _order(value: Union[ScoreOrder, str]) -> ScoreOrder:
    return enum_member(ScoreOrder, "RoutingConfig.order", value)


def _group_score(value: Union[GroupScore, str]) -> GroupScore:
    return enum_member(GroupScore, "RoutingConfig.group_score", value)


def parse_apply_weights(value: Union[RoutingWeights, str]) -> RoutingWeights:
    return enum_member(RoutingWeights, "apply_weights", value)


def parse_scaling_factor(value: Union[ScalingFactor, str]) -> ScalingFactor:
    return enum_member(ScalingFactor, "scaling_factor", value)


def _positive(_: object, attribute: "attrs.Attribute[Optional[int]]", value: Optional[int]) -> None:
    if value is not None:
        positive_int(f"RoutingConfig.{attribute.name}", value)


@attrs.frozen
class RoutingConfig:
    """How router logits become routing weights.

    ``apply_weights`` says where the weights are applied (the combine by default; ``ON_INPUT`` scales
    the dispatched rows as Llama-4 does; ``IN_GEMM_EPILOGUE`` scales the second GEMM's output).
    ``routed_scaling_factor`` is folded into the weights by the top-k when ``scaling_in_weights``,
    else the combine applies it. ``selection_bias`` means the layer owns a per-expert bias
    (DeepSeek's ``e_score_correction_bias``) added to the scores for selection only.

    ``group_mask_value`` is what grouped top-k writes over the experts of the groups it drops before
    picking the top-k: ``-inf`` (DeepSeek's reference code, recent ``transformers``) never picks them;
    ``0.0`` (``transformers`` 4.x and 5.0) lets a dropped expert win over kept experts whose biased
    score is negative.

    ``sparsemixer_eps`` selects PhiMoE's sparsemixer routing (eval mode) instead of scoring + top-k:
    ``top_k`` rounds, each picking the best remaining logit ``m`` and weighting it by the softmax over
    the remaining experts whose logit ``s`` has ``(m - s) / max(|s|, m) <= 2 * eps`` (``eps`` is the
    model's ``router_jitter_noise``, used as a threshold, not as noise). ``scoring`` must be softmax;
    ``renormalize`` and the scaling factor apply to its weights as usual.
    """

    scoring: Scoring = attrs.field(default=Scoring.SOFTMAX, converter=_scoring)
    order: ScoreOrder = attrs.field(default=ScoreOrder.SCORE_THEN_SELECT, converter=_order)
    renormalize: bool = True
    selection_bias: bool = False
    n_group: Optional[int] = attrs.field(default=None, validator=_positive)  # type: ignore[misc]
    topk_group: Optional[int] = attrs.field(default=None, validator=_positive)  # type: ignore[misc]
    group_score: GroupScore = attrs.field(default=GroupScore.SUM_TOP2, converter=_group_score)
    routed_scaling_factor: float = 1.0
    scaling_in_weights: bool = True
    apply_weights: RoutingWeights = attrs.field(default=RoutingWeights.IN_COMBINE, converter=parse_apply_weights)
    router_bias: bool = False
    router_in_fp32: bool = False
    group_mask_value: float = float("-inf")
    sparsemixer_eps: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        for name in ("renormalize", "selection_bias", "scaling_in_weights", "router_bias", "router_in_fp32"):
            flag(f"RoutingConfig.{name}", getattr(self, name))
        # 1.0 is "no factor"; zero, a negative or a non-finite factor would zero, flip or poison every output.
        positive_finite("RoutingConfig.routed_scaling_factor", self.routed_scaling_factor)
        if (self.n_group is None) != (self.topk_group is None):
            raise InputError("n_group and topk_group must be given together")
        if self.n_group is not None and self.order is ScoreOrder.SELECT_THEN_SCORE:
            raise InputError("grouped top-k needs order=SCORE_THEN_SELECT")
        if self.apply_weights is RoutingWeights.PENDING:
            raise InputError("apply_weights must say where the weights are applied, not PENDING")
        if real("RoutingConfig.group_mask_value", self.group_mask_value) == float("inf"):
            raise InputError(f"RoutingConfig.group_mask_value must be -inf or finite, got {self.group_mask_value}")
        if self.sparsemixer_eps is not None:
            if not 0.0 <= real("RoutingConfig.sparsemixer_eps", self.sparsemixer_eps) < float("inf"):
                raise InputError(f"RoutingConfig.sparsemixer_eps must be finite and >= 0, got {self.sparsemixer_eps}")
            if (self.scoring is not Scoring.SOFTMAX or self.order is not ScoreOrder.SCORE_THEN_SELECT
                    or self.n_group is not None or self.selection_bias):
                raise InputError("sparsemixer routing replaces scoring and selection: it takes "
                                 "scoring=SOFTMAX, the default order, no groups and no selection bias")

    @property
    def scaling_spec(self) -> ScalingFactor:
        if self.routed_scaling_factor == 1.0:
            return ScalingFactor.NONE
        return ScalingFactor.IN_WEIGHTS if self.scaling_in_weights else ScalingFactor.PENDING
