"""The routers: the top-k stage, by the Triton kernel where it computes the routing, else in torch."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from moeforge.backend import Backend
from moeforge.payloads import MoEInput, RoutedTokens
from moeforge.roles.base import LayerConfig, Router
from moeforge.stage import Stage
from moeforge.stages.topk import TopK
from moeforge.tensor_ref import ParamRef


def _selection_bias(layer: torch.nn.Module, config: LayerConfig) -> Optional[ParamRef]:
    return ParamRef(layer, "e_score_correction_bias") if config.routing.selection_bias else None


class TritonRouter(Router):
    """:class:`~moeforge.stages.triton.TritonTopK`: one kernel for scoring, grouping and selection."""

    backend: ClassVar[Backend] = Backend.TRITON

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        from moeforge.stages.triton import TritonTopK

        if not TritonTopK.supports(config.routing):
            return "the routing kernel does not compute sparsemixer routing"
        return config.triton_problem()

    @classmethod
    def stage(cls, layer: torch.nn.Module, config: LayerConfig) -> Stage[MoEInput, RoutedTokens]:
        from moeforge.stages.triton import TritonTopK

        return TritonTopK(config.num_experts, config.top_k, config.routing, _selection_bias(layer, config))


class TorchRouter(Router):
    """:class:`~moeforge.stages.topk.TopK`, the reference: every routing, any device."""

    backend: ClassVar[Backend] = Backend.TORCH

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        return None

    @classmethod
    def stage(cls, layer: torch.nn.Module, config: LayerConfig) -> Stage[MoEInput, RoutedTokens]:
        return TopK(config.num_experts, config.top_k, config.routing, _selection_bias(layer, config))
