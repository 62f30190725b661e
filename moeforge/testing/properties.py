"""Reusable property checks of whole dispatch/combine round trips, layers and pipelines.

Each check raises ``AssertionError`` (via ``torch.testing.assert_close``) when the property fails;
call them from your own hypothesis tests with payloads from :mod:`moeforge.testing.strategies`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from moeforge.payloads import ExpertRows, MoEInput, RoutedTokens, TopKOutput
from moeforge.pipeline import Pipeline
from moeforge.reference import layer_reference
from moeforge.spec import DType, Layout, PayloadKind, RoutingWeights, Spec, accumulation_dtype
from moeforge.stage import Stage
from moeforge.stages.combine import Combine
from moeforge.testing.contracts import check_stage

Forward = Union[torch.nn.Module, Pipeline[Any, Any]]


def check_dispatch_combine_identity(
    dispatch_stage: Stage[RoutedTokens, Any],
    routed: RoutedTokens,
    num_experts: int,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """Dispatch, treat every expert as the identity, combine: each token must come back unchanged.

    The routing weights of ``routed`` are renormalised to sum to 1 per token first (that is what
    makes the round trip an identity). The combine applies them unless the dispatch declares it
    already did (``ON_INPUT``). Copies that the dispatch dropped (capacity) or that are not on this
    rank contribute nothing, so a token comes back scaled by the weight of its kept copies. The
    dispatch's own contract is checked on the way. Rows may be bf16, fp16, fp32 or float64 (compared in
    fp32, float64 rows in float64).
    """
    x = routed.x
    if x.scale is not None or x.data.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError("the identity round trip needs float (unquantized) routed tokens")
    # Compared in the dtype the combine sums in: fp32, or float64 for float64 rows (a float64 dispatcher
    # checked in fp32 would hide its rounding behind fp32's).
    dtype = accumulation_dtype(x.data.dtype)
    weights = routed.topk.weights
    weights = weights / weights.sum(-1, keepdim=True)
    routed = RoutedTokens(x, TopKOutput(weights=weights, ids=routed.topk.ids))
    spec = Spec(PayloadKind.ROUTED, Layout.TOKEN_MAJOR, DType.from_torch(x.data.dtype),
                int(x.data.shape[-1]), num_experts=num_experts, top_k=int(weights.shape[-1]))
    rows = check_stage(dispatch_stage, spec, routed)
    if not isinstance(rows, ExpertRows):
        raise TypeError(f"{dispatch_stage.name} produced {type(rows).__name__}, not expert-grouped rows")
    applied = dispatch_stage.output_spec(spec).routing_weights is RoutingWeights.ON_INPUT
    out = Combine(apply_routing_weights=not applied, out_dtype=DType.from_torch(dtype))(rows).hidden_states
    kept_weight = (weights * rows.plan.kept()).sum(-1, keepdim=True)
    expected = x.data.to(dtype) * kept_weight.to(dtype)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{dispatch_stage.name} dispatch -> combine is not the "
                               f"identity:\n{m}")


def _forward(model: Forward, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Pipeline):
        out: torch.Tensor = model(MoEInput(x, logits)).hidden_states
        return out
    result: torch.Tensor = model(x, logits)
    return result


def check_token_permutation_equivariance(
    layer_or_pipeline: Forward,
    x: torch.Tensor,
    logits: torch.Tensor,
    perm: torch.Tensor,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Permuting the tokens (hidden states and logits alike) permutes the output the same way.

    ``layer_or_pipeline`` is called as ``layer(x, logits)`` (an :class:`~moeforge.MoELayer`) or on
    ``MoEInput(x, logits)`` (a :class:`~moeforge.Pipeline`). The tolerance allows for GEMMs whose
    rounding depends on where a row sits in a batch.
    """
    with torch.no_grad():
        out = _forward(layer_or_pipeline, x, logits)
        permuted = _forward(layer_or_pipeline, x[perm], logits[perm])
    torch.testing.assert_close(permuted, out[perm], rtol=rtol, atol=atol,
                               msg=lambda m: f"permuting the tokens did not permute the output:\n{m}")


def check_matches_dense_reference(
    layer: torch.nn.Module,
    x: torch.Tensor,
    rtol: float = 1e-4,
    *,
    logits: Optional[torch.Tensor] = None,
    atol: Optional[float] = None,
) -> None:
    """The layer's output equals :func:`moeforge.reference.layer_reference` (float64, every expert on
    every token) within ``rtol``; ``atol`` defaults to ``rtol`` times the output's magnitude."""
    with torch.no_grad():
        out = layer(x, logits)
        reference = layer_reference(layer, x, logits)
    scale = float(reference.abs().max()) if reference.numel() else 1.0
    torch.testing.assert_close(out.double(), reference, rtol=rtol,
                               atol=atol if atol is not None else rtol * max(scale, 1.0),
                               msg=lambda m: f"the layer does not match the dense reference:\n{m}")
