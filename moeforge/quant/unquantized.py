"""The unquantized method: bf16 / fp16 / fp32 expert weights and activations."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import torch

from moeforge.backend import Backend
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations
from moeforge.spec import FLOAT_DTYPES, DType, GroupListType, ScaleLayout
from moeforge.stage import Stage
from moeforge.stages.activation import Activate, ActivationConfig, apply_activation
from moeforge.stages.gemm import GemmRole, GroupedGemm, grouped_gemm_padded, grouped_gemm_sorted
from moeforge.quant.base import QuantMethod, check_expert_groups, check_float_hidden_states, expert_shapes, register_expert_biases
from moeforge.tensor_ref import ParamRef

W13, W2, B13, B2 = "w13_weight", "w2_weight", "w13_bias", "w2_bias"


class UnquantizedMethod(QuantMethod):
    """Expert weights ``w13_weight [E, 2I, H]`` (gate rows then up rows, or ``[E, I, H]`` when the
    activation is not gated) and ``w2_weight [E, H, I]``; optional ``w13_bias [E, 2I]`` and
    ``w2_bias [E, H]``. Consumes float activations only: FP8/INT8 dispatch into it is a
    ``ContractError`` at build time."""

    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE})
    expert_parameters: ClassVar[tuple[str, ...]] = (W13, W2, B13, B2)
    compute_dtype_parameters: ClassVar[tuple[str, ...]] = (W13, W2, B13, B2)
    backends: ClassVar[frozenset[Backend]] = frozenset({Backend.TORCH, Backend.TRITON})

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
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        for name, shape in zip((W13, W2), shapes.values()):  # weights ~ N(0, 1/fan_in): usable before loading
            weight = torch.empty(shape, dtype=torch.float32, device=device).normal_(std=shape[-1] ** -0.5)
            layer.register_parameter(name, torch.nn.Parameter(weight.to(dtype)))
        register_expert_biases(layer, shapes, bias, dtype, device)

    def expert_stages(
        self,
        layer: torch.nn.Module,
        *,
        activation: ActivationConfig,
        routing_weights_in_epilogue: bool,
        backend: Backend = Backend.TORCH,
        configs: Optional[ConfigTable] = None,
        dispatch: Optional[DispatchDtype] = None,
    ) -> list[Stage[Any, Any]]:
        def bias(name: str) -> Optional[ParamRef]:
            return ParamRef(layer, name) if getattr(layer, name, None) is not None else None

        if backend is Backend.TRITON:
            from moeforge.stages.triton import FusedGroupedGemm

            if configs is None:
                raise ValueError("the triton expert stages need the ConfigTable of the dispatch")
            return [
                FusedGroupedGemm(GemmRole.GATE_UP, ParamRef(layer, W13), configs, bias(B13), activation),
                FusedGroupedGemm(GemmRole.DOWN, ParamRef(layer, W2), configs, bias(B2),
                                 apply_routing_weights=routing_weights_in_epilogue),
            ]
        return [
            GroupedGemm(GemmRole.GATE_UP, ParamRef(layer, W13), bias(B13),
                        accepts_dtypes=self.accepts, accepts_scales=self.accepts_scales),
            Activate(activation),
            GroupedGemm(GemmRole.DOWN, ParamRef(layer, W2), bias(B2),
                        accepts_dtypes=self.accepts, accepts_scales=self.accepts_scales,
                        apply_routing_weights=routing_weights_in_epilogue),
        ]

    def apply_without_routing_weights(
        self,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        hidden_states_scale: Optional[torch.Tensor],
        group_list_type: Union[GroupListType, int],
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        check_float_hidden_states("UnquantizedMethod", hidden_states, hidden_states_scale)
        w13, w2 = getattr(layer, W13), getattr(layer, W2)
        b13, b2 = getattr(layer, B13, None), getattr(layer, B2, None)
        counts = check_expert_groups(hidden_states, group_list_type, group_list, w13.shape[0], w13.shape[2])
        config: ActivationConfig = getattr(layer, "activation")
        # Intermediates are rounded to the activations' dtype, as the pipeline's stages do.
        if counts is None:
            hidden = grouped_gemm_padded(Activations(hidden_states), w13, b13, None, hidden_states.dtype)
            activated = apply_activation(hidden, config).to(hidden_states.dtype)
            return grouped_gemm_padded(Activations(activated), w2, b2, None, output_dtype)
        hidden = grouped_gemm_sorted(Activations(hidden_states), counts, w13, b13, None, hidden_states.dtype)
        activated = apply_activation(hidden, config).to(hidden_states.dtype)
        return grouped_gemm_sorted(Activations(activated), counts, w2, b2, None, output_dtype)
