"""The dispatchers: each builds its dispatch stage and the combine that takes its rows home.

A dispatcher is asked for by name (``MoELayer(dispatcher="sorted")``), chosen under ``"auto"``
(``automatic``), or given as a dispatch stage the user built (:class:`GivenDispatcher`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from moeforge.backend import Backend
from moeforge.kernels.config import ConfigTable
from moeforge.roles.base import Dispatcher, LayerConfig
from moeforge.spec import Layout
from moeforge.stage import Stage
from moeforge.stages.combine import Combine
from moeforge.stages.dispatch import PaddedDispatch, SortedDispatch


def combine_for(config: LayerConfig) -> Combine:
    """The combine of any dispatcher's rows: their plan does the un-permutation."""
    return Combine(**config.combine_options())


class _Local(Dispatcher):
    """A dispatcher of this process's own tokens (no expert parallelism)."""

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        if config.expert_parallel is not None:
            return "it does not exchange rows between expert-parallel ranks"
        return None


class AlignedDispatcher(_Local):
    """:class:`~moeforge.stages.triton.AlignDispatch`: a block-aligned plan on the device (rows moved only for a
    training step's slot order or for routing weights on the input)."""

    backend: ClassVar[Backend] = Backend.TRITON
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.BLOCK_ALIGNED})
    keyword: ClassVar[Optional[str]] = "aligned"

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        return super().supports(config) or config.triton_problem()

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        from moeforge.stages.triton import AlignDispatch

        assert configs is not None, "block-aligned rows are aligned by the experts' launch table"
        return (AlignDispatch(config.num_experts, configs, apply_routing_weights=config.weights_on_input),
                combine_for(config))


class _TorchLocal(_Local):
    """A torch dispatch stage of the local tokens (its class: ``stage``) and the combine."""

    backend: ClassVar[Backend] = Backend.TORCH
    stage: ClassVar[type[Any]]

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        dispatch: Stage[Any, Any] = cls.stage(config.num_experts, apply_routing_weights=config.weights_on_input)
        return dispatch, combine_for(config)


class SortedDispatcher(_TorchLocal):
    """:class:`~moeforge.stages.dispatch.SortedDispatch`: rows sorted by expert, the torch reference."""

    stage: ClassVar[type[Any]] = SortedDispatch
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.EXPERT_SORTED})
    keyword: ClassVar[Optional[str]] = "sorted"


class PaddedDispatcher(_TorchLocal):
    """:class:`~moeforge.stages.dispatch.PaddedDispatch`: ``[E, capacity, H]`` buffers; on request only."""

    stage: ClassVar[type[Any]] = PaddedDispatch
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.EXPERT_PADDED})
    keyword: ClassVar[Optional[str]] = "padded"
    automatic: ClassVar[bool] = False


class AllToAllDispatcher(Dispatcher):
    """:class:`~moeforge.distributed.AllToAllDispatch`: rows exchanged with the other expert-parallel
    ranks, arriving expert-sorted, or block-aligned for the triton GEMMs."""

    backend: ClassVar[Backend] = Backend.TORCH
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.BLOCK_ALIGNED, Layout.EXPERT_SORTED})
    keyword: ClassVar[Optional[str]] = "all_to_all"

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        if config.expert_parallel is None:
            return "it exchanges rows between expert-parallel ranks: build the layer with expert_parallel=..."
        return None

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        from moeforge.distributed.all_to_all import AllToAllDispatch

        assert config.expert_parallel is not None
        dispatch = AllToAllDispatch(config.expert_parallel, apply_routing_weights=config.weights_on_input,
                                    configs=configs if layout is Layout.BLOCK_ALIGNED else None)
        return dispatch, combine_for(config)


class FusedEpDispatcher(Dispatcher):
    """The quant method's own stage spanning dispatch -> combine (``dispatcher="fused_ep"``); a method
    without one is a :class:`~moeforge.ContractError` when the layer is built, never a silent fallback."""

    backend: ClassVar[Backend] = Backend.TORCH
    layouts: ClassVar[frozenset[Layout]] = frozenset()
    keyword: ClassVar[Optional[str]] = "fused_ep"
    automatic: ClassVar[bool] = False
    spans_experts: ClassVar[bool] = True

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        return None  # a method without one says so itself, as a ContractError (fused_ep_stage)

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        options = config.combine_options()
        stage = config.quant.fused_ep_stage(
            layer, activation=config.activation, apply_routing_weights=options["apply_routing_weights"],
            routed_scaling_factor=options["routed_scaling_factor"], out_dtype=config.compute_dtype,
            dispatch=config.dispatch.dtype)
        config.quant.prepare_fused_ep_weights(layer)
        return stage, None


class GivenDispatcher(Dispatcher):
    """A dispatch stage the user built (``MoELayer(dispatcher=LowLatencyDispatch(ep, max_tokens=...))``):
    its own layout, and the combine for it."""

    backend: ClassVar[Backend] = Backend.TORCH
    layouts: ClassVar[frozenset[Layout]] = frozenset(Layout)

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        from moeforge.distributed.exchange import ExchangeDispatch

        given, ep = config.dispatcher, config.expert_parallel
        if not isinstance(given, Stage):
            return "no dispatch stage was given"
        exchanges = isinstance(given, ExchangeDispatch)
        if ep is not None and not exchanges:
            return (f"an expert-parallel layer needs an expert-parallel dispatcher (AllToAllDispatch, "
                    f"LowLatencyDispatch or SymmetricDispatch), got {given.name}")
        if ep is None and exchanges:
            return (f"{given.name} exchanges rows between ranks: build the layer with "
                    "expert_parallel=ExpertParallel(num_experts, group)")
        if isinstance(given, ExchangeDispatch) and given.ep is not ep:
            return "the dispatcher's ExpertParallel differs from the layer's expert_parallel: pass the same one"
        return None

    @classmethod
    def layout_problem(cls, config: LayerConfig, layout: Layout) -> Optional[str]:
        delivered = cls._layout(config)
        if layout is Layout.BLOCK_ALIGNED and cls._aligns(config):
            return None
        if layout is not delivered:
            return f"{cls._stage(config).name} delivers {delivered.value} rows"
        return None

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        import attrs

        from moeforge.distributed.low_latency import LowLatencyDispatch
        from moeforge.distributed.symmetric import SymmetricDispatch

        stage = cls._stage(config)
        if layout is Layout.BLOCK_ALIGNED and isinstance(stage, (LowLatencyDispatch, SymmetricDispatch)) \
                and stage.configs is None:
            assert configs is not None, "block-aligned rows are aligned by the experts' launch table"
            aligned: Stage[Any, Any] = attrs.evolve(stage, configs=configs)
            return aligned, combine_for(config)
        return stage, combine_for(config)

    @staticmethod
    def _aligns(config: LayerConfig) -> bool:
        """Whether the given stage can also deliver ``BLOCK_ALIGNED`` rows for the triton GEMMs, given their launch
        table (the fixed-capacity dispatchers' ``configs``)."""
        from moeforge.distributed.low_latency import LowLatencyDispatch
        from moeforge.distributed.symmetric import SymmetricDispatch

        return isinstance(config.dispatcher, (LowLatencyDispatch, SymmetricDispatch))

    @staticmethod
    def _stage(config: LayerConfig) -> Stage[Any, Any]:
        assert isinstance(config.dispatcher, Stage)
        return config.dispatcher

    @classmethod
    def _layout(cls, config: LayerConfig) -> Layout:
        from moeforge.spec import input_spec
        from moeforge.stages.topk import RoutingConfig, TopK

        # What the given stage makes of routed tokens: asked of the stage itself, through its spec.
        routing = RoutingConfig(apply_weights=config.routing.apply_weights)
        routed = TopK(config.num_experts, config.top_k, routing).output_spec(
            input_spec(config.hidden_size, config.dtype, config.num_experts))
        return cls._stage(config).output_spec(routed).layout
