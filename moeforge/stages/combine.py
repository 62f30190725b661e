"""Combine: return expert outputs to their tokens and sum the top-k copies.

The way back is the rows' :class:`~moeforge.payloads.Plan`, made by their dispatcher: the one
:class:`Combine` stage takes the rows of every dispatcher. The sum runs in fp32 over
``k = 0 .. top_k - 1`` in that fixed order, by gathering (no atomics), so the result is bit-for-bit
deterministic (:func:`combine_rows`). Copies that are not on this rank or were dropped by a capacity
limit contribute nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import torch

from moeforge.payloads import ExpertRows, MoEOutput
from moeforge.spec import (
    REFERENCE_FLOAT_DTYPES,
    Accepts,
    DType,
    Exchange,
    ExpertIds,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    ScalingFactor,
    Spec,
    accumulation_dtype,
)
from moeforge.stage import Stage, StageKind


def combine_rows(
    rows: torch.Tensor,
    token_rows: torch.Tensor,
    row_weight: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    scaling_factor: Optional[float] = None,
    *,
    copy_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t] = sum_k rows[token_rows[t, k]] * row_weight[token_rows[t, k]]`` in fp32 (fp64 for float64
    rows), k in order.

    ``rows`` is ``[R, H]``; ``token_rows [T, K]`` holds -1 for copies that contribute nothing;
    ``row_weight=None`` sums unweighted; ``copy_weight [T, K]``, when given, is each copy's weight
    directly (instead of ``row_weight`` looked up by row).
    """
    tokens, top_k = token_rows.shape
    accumulate = accumulation_dtype(rows.dtype)
    out = torch.zeros(tokens, rows.shape[-1], dtype=accumulate, device=rows.device)
    if rows.shape[0] == 0:  # no rows (no tokens here): nothing to gather
        # Zeros made from the (empty) rows and weights — sums over nothing — so that a backward still reaches
        # what made them: an expert-parallel rank without tokens must join the backward's exchanges like every
        # other rank, and a layer's parameters get zero gradients, not none.
        empty = rows.sum(0).to(accumulate)
        for given in (copy_weight, row_weight):
            if given is not None:
                empty = empty + given.reshape(-1)[:0].sum().to(accumulate)
        return (out + empty).to(out_dtype)
    present = token_rows >= 0
    index = token_rows.clamp(min=0)
    # Gather in the rows' own dtype (one pass over the copies, not a float copy of every row); each
    # copy is widened to fp32 as it is added.
    gathered = rows[index.reshape(-1)].view(tokens, top_k, rows.shape[-1])
    # An absent copy gathered row 0 as a placeholder: zero it rather than multiply it by 0, so an
    # inf or NaN in that unrelated row cannot leak into this token as NaN.
    gathered.masked_fill_(~present.unsqueeze(-1), 0.0)
    weight = copy_weight.to(accumulate) if copy_weight is not None else (
        row_weight.to(accumulate)[index] if row_weight is not None else None)
    for k in range(top_k):
        copy = gathered[:, k].to(accumulate)
        out += copy if weight is None else copy * weight[:, k, None]
    if scaling_factor is not None:
        out *= scaling_factor
    return out.to(out_dtype)


@attrs.frozen(eq=False)
class Combine(Stage[ExpertRows, MoEOutput]):
    """Weighted (or plain) sum of each token's expert outputs, back in token order.

    ``apply_routing_weights=False`` when an earlier stage already applied them (input scaling or the
    GEMM epilogue). ``routed_scaling_factor`` multiplies the output when the top-k left the factor
    pending. ``out_dtype=None`` keeps the expert outputs' dtype.
    """

    kinds: ClassVar = (StageKind.COMBINE,)
    # The rows' plan does the un-permutation (a local one, or the exchange back to the other expert-
    # parallel ranks), so one combine takes every dispatcher's rows; a subclass may narrow the layouts.
    layouts: ClassVar[frozenset[Layout]] = frozenset(Layout) - {Layout.TOKEN_MAJOR}
    apply_routing_weights: bool = True
    routed_scaling_factor: Optional[float] = None
    out_dtype: Optional[DType] = None

    def summary(self) -> str:
        parts = ["weighted" if self.apply_routing_weights else "unweighted", "fp32 fixed order"]
        if self.routed_scaling_factor is not None:
            parts.append(f"x{self.routed_scaling_factor:g}")
        return f"{self.name}({', '.join(parts)})"

    def accepts(self) -> Accepts:
        return Accepts(
            kind=PayloadKind.EXPERT_OUTPUT,
            layout=self.layouts,
            dtype=REFERENCE_FLOAT_DTYPES,
            scale_layout=ScaleLayout.NONE,
            slot_order={False, True},  # the plan reads each copy where it lies (AlignedPlan: by its slot)
            **combine_accepts(self.apply_routing_weights, self.routed_scaling_factor),
        )

    def hint(self, field: str, have: object) -> Optional[str]:
        return combine_hint(self.name, field, have)

    def output_spec(self, spec: Spec) -> Spec:
        return combine_output_spec(spec, self.apply_routing_weights, self.routed_scaling_factor, self.out_dtype)

    def __call__(self, x: ExpertRows) -> MoEOutput:
        if not isinstance(x, ExpertRows):
            raise TypeError(f"{self.name} cannot consume {type(x).__name__}")
        out_dtype = self.out_dtype.torch_dtype if self.out_dtype is not None else x.x.data.dtype
        return MoEOutput(x.plan.combine(x.x.data, self.apply_routing_weights, self.routed_scaling_factor, out_dtype))


def combine_accepts(apply_routing_weights: bool, routed_scaling_factor: Optional[float]) -> dict[str, Any]:
    """The routing fields a combine accepts: pending weights the router left to the combine when it
    applies them (else weights already applied), and the pending factor of its own value when it
    applies one."""
    fields: dict[str, Any] = {}
    if apply_routing_weights:
        fields.update(routing_weights=RoutingWeights.PENDING, weights_at={RoutingWeights.IN_COMBINE, None})
    else:
        fields.update(routing_weights={RoutingWeights.ON_INPUT, RoutingWeights.IN_GEMM_EPILOGUE})
    if routed_scaling_factor is not None:
        # None: a user-written routing stage that left a factor pending without saying which.
        fields.update(scaling_factor=ScalingFactor.PENDING, pending_scale={routed_scaling_factor, None})
    return fields


def combine_output_spec(spec: Spec, apply_routing_weights: bool, routed_scaling_factor: Optional[float],
                        out_dtype: Optional[DType]) -> Spec:
    """The output spec of a combine (see :func:`combine_accepts`)."""
    applies_factor = routed_scaling_factor is not None
    return spec.evolve(
        kind=PayloadKind.OUTPUT,
        layout=Layout.TOKEN_MAJOR,
        dtype=out_dtype or spec.dtype,
        group_list_type=None,
        expert_ids=ExpertIds.GLOBAL,  # back on the tokens (and on their own rank)
        exchange=Exchange.NONE,
        alignment=None,
        slot_order=False,
        routing_weights=RoutingWeights.IN_COMBINE if apply_routing_weights else spec.routing_weights,
        scaling_factor=ScalingFactor.APPLIED if applies_factor else spec.scaling_factor,
        pending_scale=None if applies_factor else spec.pending_scale,
    )


def combine_hint(stage: str, field: str, have: object) -> Optional[str]:
    """Hints for the routing fields of a combine named ``stage``."""
    if field == "routing_weights" and have is RoutingWeights.PENDING:
        return ("this combine does not apply the routing weights and no earlier stage did: use "
                f"{stage}(apply_routing_weights=True)")
    if field == "routing_weights":
        return (f"the routing weights were already applied ({getattr(have, 'value', have)}): use "
                f"{stage}(apply_routing_weights=False)")
    if field == "weights_at":
        return (f"the router applies its weights {getattr(have, 'value', have)}, not in the combine: use "
                f"{stage}(apply_routing_weights=False) and apply them there")
    if field == "scaling_factor":
        return (f"the routed scaling factor is {getattr(have, 'value', have)}, not pending: drop "
                "routed_scaling_factor from the combine")
    if field == "pending_scale":
        return (f"the top-k left the routed scaling factor {have} pending: use routed_scaling_factor={have} "
                "on the combine")
    return None
