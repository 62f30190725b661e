"""The quant-method interface: a quant method owns the expert weights' format and contributes stages.

Instead of overriding the forward, a method supplies the pieces that depend on its format: the
weights (:meth:`QuantMethod.create_weights`, :meth:`QuantMethod.process_weights_after_loading`), the
activation quantizer that runs before the dispatch, the expert stages (GEMM, activation, GEMM), and
:meth:`QuantMethod.apply_without_routing_weights`, the expert computation on already-dispatched,
expert-grouped rows that NPU-style and fused-EP backends call directly. What it accepts after
dispatch is data on the class (``accepts``, ``accepts_scales``), read by the dispatch-dtype resolver
and the contract checker.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional, Union

import torch

from moeforge.backend import Backend
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import RoutedTokens
from moeforge.spec import DType, GroupListType, ScaleLayout
from moeforge.stage import Stage
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.quantize import QuantizeTokens, quantizer_for


class QuantMethod(abc.ABC):
    """Base class of the quant methods.

    Class attributes: ``accepts`` — activation dtypes the expert stages consume after dispatch;
    ``accepts_scales`` — their scale layouts.
    """

    accepts: ClassVar[frozenset[DType]]
    accepts_scales: ClassVar[frozenset[ScaleLayout]]

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def create_weights(
        self,
        layer: torch.nn.Module,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gated: bool,
        bias: bool,
        dtype: torch.dtype,
        device: Union[torch.device, str, None],
    ) -> None:
        """Register the expert parameters on ``layer`` (initialised, never left uninitialised)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert the loaded weights (e.g. into a kernel's layout). Default: nothing."""

    def required_dispatch_dtype(self) -> Optional[DispatchDtype]:
        """The dispatch dtype this method's configuration requires (rule 3), if any."""
        return None

    def quantize_stage(
        self, dispatch: DispatchDtype, compute: DType
    ) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        """The stage that turns ``compute`` activations into the ``dispatch`` format before the
        dispatch; ``None`` when they already match."""
        quantizer = quantizer_for(dispatch, compute)
        return QuantizeTokens(quantizer) if quantizer is not None else None

    @abc.abstractmethod
    def expert_stages(
        self,
        layer: torch.nn.Module,
        *,
        activation: ActivationConfig,
        routing_weights_in_epilogue: bool,
        backend: Backend = Backend.TORCH,
        configs: Optional[ConfigTable] = None,
    ) -> list[Stage[Any, Any]]:
        """The stages from dispatched rows to expert outputs (typically GEMM, activation, GEMM) for
        ``backend``; ``configs`` are the triton launch configurations shared with the dispatch.
        A method without stages for ``backend`` raises :class:`BackendUnavailableError`."""

    @abc.abstractmethod
    def apply_without_routing_weights(
        self,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        hidden_states_scale: Optional[torch.Tensor],
        group_list_type: Union[GroupListType, int],
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """GEMM -> activation -> GEMM on expert-grouped rows, leaving routing weights and
        un-permutation to the caller's combine.

        ``hidden_states`` is ``[R, H]`` with rows grouped by local expert and ``group_list`` (length
        E) in the ``group_list_type`` convention (0 = cumsum, 1 = counts); or ``[E, C, H]`` (padded)
        with ``group_list`` = valid rows per expert (``group_list_type`` must be 1). Returns
        ``[R, H]`` (or ``[E, C, H]``) in ``output_dtype``.
        """
