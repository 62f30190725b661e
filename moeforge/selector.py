"""The selector: the implementation of each role for a layer, by one pure function.

The candidates are listed here, explicitly, fastest first; adding an implementation is one module
(its class) plus one line below. :func:`select` walks the lists for a :class:`LayerConfig` and returns
the first router, and the first experts + dispatcher pair that can serve it (a dispatcher must
deliver a row layout the experts read), with the reason each candidate before them was skipped —
what :meth:`Selection.describe` shows and an error lists when nothing fits.

``backend="torch"`` / ``"triton"`` narrows the experts (and so the dispatcher) to that backend; the
router follows when it can (a routing the triton kernel does not compute uses the torch router,
whose output feeds any dispatcher). ``dispatcher=`` narrows the dispatchers to the one named, or to
the stage the user built.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from moeforge.backend import Backend
from moeforge.errors import BackendUnavailableError, InputError
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.expert_weights import ExpertNames, ExpertWeights
from moeforge.kernels.config import ConfigTable
from moeforge.stages.activation import ActivationConfig
from moeforge.quant.mxfp4 import EmulatedMxfp4Experts, TritonMxfp4Experts
from moeforge.quant.nvfp4 import EmulatedNvfp4Experts, TritonNvfp4Experts
from moeforge.quant.unquantized import TorchUnquantizedExperts, TritonUnquantizedExperts
from moeforge.quant.w4a4_npu import W4A4NpuExperts
from moeforge.quant.w4a16 import TorchW4A16Experts, TritonW4A16Experts
from moeforge.quant.w8a8 import TorchW8A8Experts, TritonW8A8Experts
from moeforge.roles.base import Dispatcher, Experts, LayerConfig, MethodOwnExperts, Router
from moeforge.roles.dispatchers import (
    AlignedDispatcher,
    AllToAllDispatcher,
    FusedEpDispatcher,
    GivenDispatcher,
    PaddedDispatcher,
    SortedDispatcher,
)
from moeforge.roles.routers import TorchRouter, TritonRouter
from moeforge.spec import Layout
from moeforge.stage import Stage

ROUTERS: tuple[type[Router], ...] = (TritonRouter, TorchRouter)

EXPERTS: tuple[type[Experts], ...] = (
    TritonUnquantizedExperts,
    TritonW8A8Experts,
    TritonW4A16Experts,
    TritonMxfp4Experts,
    TritonNvfp4Experts,
    TorchUnquantizedExperts,
    TorchW8A8Experts,
    TorchW4A16Experts,
    EmulatedMxfp4Experts,
    EmulatedNvfp4Experts,
    W4A4NpuExperts,
    MethodOwnExperts,  # a quant method from outside moeforge that overrides expert_stages
)

DISPATCHERS: tuple[type[Dispatcher], ...] = (
    GivenDispatcher,
    FusedEpDispatcher,
    AllToAllDispatcher,
    AlignedDispatcher,
    SortedDispatcher,
    PaddedDispatcher,
)

KEYWORDS = ("auto",) + tuple(d.keyword for d in DISPATCHERS if d.keyword is not None)


@attrs.frozen
class Selection:
    """The implementation of each role for one layer (``experts`` is ``None`` under a dispatcher that
    spans the experts), the layout of the rows between them, and why each candidate tried before the
    chosen ones was skipped."""

    router: type[Router]
    dispatcher: type[Dispatcher]
    experts: Optional[type[Experts]]
    layout: Optional[Layout]
    skipped: tuple[tuple[str, str], ...] = ()  # (candidate, reason)

    @property
    def backend(self) -> Backend:
        """The backend of the expert computation (what ``MoELayer.backend`` reports)."""
        return self.experts.backend if self.experts is not None else self.dispatcher.backend

    def stages(self, layer: torch.nn.Module, config: LayerConfig) -> list[Stage[Any, Any]]:
        """A layer's stages: route, then :meth:`routed_stages` on the expert tensors its quant method reads."""
        return [self.router.stage(layer, config)] + self.routed_stages(layer, config)

    def routed_stages(self, layer: torch.nn.Module, config: LayerConfig,
                      weights: Optional[ExpertWeights] = None) -> list[Stage[Any, Any]]:
        """The stages from routed tokens to the output: quantize (if the format needs it), dispatch, experts,
        combine. The experts are built from ``weights`` (default: what ``config.quant`` reads from ``layer``,
        :meth:`~moeforge.QuantMethod.expert_weights`); ``layer`` is what the dispatcher and a fused stage read."""
        stages: list[Stage[Any, Any]] = []
        quantize = self.experts.quantize_stage(config) if self.experts is not None else \
            config.quant.quantize_stage(config.dispatch.dtype, config.compute_dtype)
        if quantize is not None:
            stages.append(quantize)
        configs = config.kernel_configs() if self.layout is Layout.BLOCK_ALIGNED else None
        dispatch, combine = self.dispatcher.stages(layer, config, self.layout or Layout.TOKEN_MAJOR, configs)
        stages.append(dispatch)
        if self.experts is not None:
            stages += self.experts.stages_for(config.quant, layer, weights, activation=config.activation,
                                              routing_weights_in_epilogue=config.weights_in_epilogue,
                                              configs=configs, dispatch=config.dispatch.dtype)
        if combine is not None:
            stages.append(combine)
        return stages

    def describe(self) -> list[str]:
        """Lines for ``describe()``: what was chosen, and what was skipped and why."""
        experts = f", experts {self.experts.name()}" if self.experts is not None else ""
        lines = [f"roles: router {self.router.name()}, dispatcher {self.dispatcher.name()}{experts}"]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return lines


def select(config: LayerConfig) -> Selection:
    """The implementations for ``config`` (see the module docstring). Raises :class:`InputError`
    naming every candidate and why it could not serve, when no combination can."""
    skipped: list[tuple[str, str]] = []
    router = _router(config, skipped)
    dispatchers = _asked_dispatchers(config)
    if dispatchers and dispatchers[0].spans_experts:
        spanning = dispatchers[0]
        reason = _backend_problem(spanning.backend, config)
        if reason is None:
            return Selection(router, spanning, None, None, tuple(skipped))
        skipped.append((spanning.name(), reason))
        dispatchers = []
    outside = not any(isinstance(config.quant, experts.method) for experts in EXPERTS
                      if experts is not MethodOwnExperts)  # a method only MethodOwnExperts can compute
    problems: list[tuple[str, str]] = []
    for experts in EXPERTS if dispatchers else ():
        reason = _experts_problem(experts, config)
        if reason is not None:
            if isinstance(config.quant, experts.method) and (experts is not MethodOwnExperts or outside):
                skipped.append((experts.name(), reason))  # the other formats' experts are no news
            continue
        found = _dispatcher_for(experts, dispatchers, config, problems)
        if found is not None:
            dispatcher, layout = found
            return Selection(router, dispatcher, experts, layout, tuple(skipped))
        skipped.append((experts.name(), "no dispatcher delivers its rows: " + "; ".join(
            f"{name}: {reason}" for name, reason in problems)))
        problems.clear()
    backend = config.backend.value if config.backend else "auto"
    if config.batch_invariant:
        backend += " (batch_invariant=True runs on the triton backend)"
    raise InputError(f"no implementation can run this layer ({config.quant.name}, backend={backend}, "
                     f"dispatcher={_asked(config)!r} on {config.device}):\n"
                     + "\n".join(f"  {name}: {reason}" for name, reason in skipped))


def experts_for(method: Any, backend: Backend, layout: Optional[Layout] = None,
                weights: Optional[ExpertWeights] = None) -> type[Experts]:
    """The first Experts candidate that computes ``method`` (a quant method) on ``backend``, reads ``layout`` rows
    (``None``: any) and can compute ``weights`` (``Experts.weights_problem``; ``None``: not checked). Raises
    :class:`BackendUnavailableError` when none does."""
    found = [experts for experts in EXPERTS if experts is not MethodOwnExperts and isinstance(method, experts.method)]
    for experts in found:
        if experts.backend is backend and (layout is None or layout in experts.layouts) and (
                weights is None or experts.weights_problem(weights) is None):
            return experts
    runs = sorted({f"backend={e.backend.value!r} ({', '.join(sorted(x.value for x in e.layouts))} rows)"
                   for e in found})
    rows = f" on {layout.value} rows" if layout is not None else ""
    raise BackendUnavailableError(f"{type(method).__name__} has no {backend.value} experts{rows}: "
                                  + (f"use {' or '.join(runs)}" if runs else "no experts moeforge ships compute it"))


def expert_stages(method: Any, holder: torch.nn.Module, *, backend: Backend, activation: ActivationConfig,
                  routing_weights_in_epilogue: bool, layout: Optional[Layout] = None,
                  configs: Optional[ConfigTable] = None, dispatch: Optional[DispatchDtype] = None,
                  names: Optional[ExpertNames] = None) -> list[Stage[Any, Any]]:
    """The stages from dispatched rows to expert outputs of ``method``'s experts on ``backend`` (and ``layout``
    rows: ``None``, any) for the expert tensors ``holder`` keeps (by ``names``, default the method's own), outside a
    layer: what a hand-built pipeline or a test composes (``configs``: the launch table the triton experts share
    with the block-aligned dispatch)."""
    weights = method.expert_weights(holder, names)
    experts = experts_for(method, backend, layout, weights)
    return experts.stages(method, weights, activation=activation,
                          routing_weights_in_epilogue=routing_weights_in_epilogue, configs=configs, dispatch=dispatch)


def backends_of(method: Any) -> frozenset[Backend]:
    """The backends some Experts candidate computes ``method`` on."""
    return frozenset(experts.backend for experts in EXPERTS
                     if experts is not MethodOwnExperts and isinstance(method, experts.method))


def _router(config: LayerConfig, skipped: list[tuple[str, str]]) -> type[Router]:
    for router in ROUTERS:
        reason = router.supports(config)
        if reason is None and config.backend is Backend.TORCH and router.backend is not Backend.TORCH:
            reason = "backend='torch' was asked for"
        if reason is None:
            return router
        if router.backend is not Backend.TORCH and config.device.type == "cuda":
            skipped.append((router.name(), reason))
    raise AssertionError("TorchRouter serves every layer")


def _experts_problem(experts: type[Experts], config: LayerConfig) -> Optional[str]:
    reason = experts.supports(config)
    return reason if reason is not None else _backend_problem(experts.backend, config)


def _backend_problem(backend: Backend, config: LayerConfig) -> Optional[str]:
    """Why an implementation on ``backend`` is not what the layer asked for (``None``: it is)."""
    if config.batch_invariant and backend is not Backend.TRITON:
        return "batch_invariant=True runs on the triton backend"
    if config.backend is not None and backend is not config.backend:
        return f"backend={config.backend.value!r} was asked for"
    return None


def _asked(config: LayerConfig) -> str:
    asked = config.dispatcher
    return asked.name if isinstance(asked, Stage) else repr(asked) if isinstance(asked, Dispatcher) else str(asked)


def _asked_dispatchers(config: LayerConfig) -> list[type[Dispatcher]]:
    """The dispatchers the ``dispatcher=`` setting allows, in preference order."""
    asked = config.dispatcher
    if isinstance(asked, Stage):
        return [GivenDispatcher]
    if isinstance(asked, Dispatcher):
        return [type(asked)]  # its class, whose stages read the instance's settings
    if not isinstance(asked, str) or asked not in KEYWORDS:
        raise InputError(f"dispatcher must be one of {', '.join(repr(k) for k in KEYWORDS)}, a dispatch Stage or "
                         f"a Dispatcher instance, got {asked!r}")
    if asked == "auto":
        return [d for d in DISPATCHERS if d.automatic and d.keyword is not None]
    return [d for d in DISPATCHERS if d.keyword == asked]


def _dispatcher_for(experts: type[Experts], dispatchers: list[type[Dispatcher]], config: LayerConfig,
                    problems: list[tuple[str, str]]) -> Optional[tuple[type[Dispatcher], Layout]]:
    """The first dispatcher (and layout) that delivers rows ``experts`` reads; else ``None``, with the
    reasons in ``problems``."""
    for dispatcher in dispatchers:
        reason = dispatcher.supports(config)
        if reason is None:
            layouts = sorted(experts.layouts, key=lambda item: item.value)
            for layout in layouts:
                if dispatcher.layout_problem(config, layout) is None:
                    return dispatcher, layout
            reason = "; ".join(dict.fromkeys(filter(None, (dispatcher.layout_problem(config, layout)
                                                           for layout in layouts))))
            reason += f" ({experts.name()} reads {', '.join(layout.value for layout in layouts)} rows"
            reason += ": use dispatcher='auto' or another backend)" if config.dispatcher != "auto" else ")"
        problems.append((dispatcher.name(), reason))
    return None

