"""The unquantized method: bf16 / fp16 / fp32 expert weights and activations (and float64 on the torch
backend: the reference, for gradcheck). The one method that trains: its torch experts differentiate."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.kernels.config import ConfigTable
from moeforge.kernels.formats import WeightFormat
from moeforge.roles.base import FloatRows, TorchExperts, TritonExperts
from moeforge.spec import REFERENCE_FLOAT_DTYPES, DType, ScaleLayout
from moeforge.stage import Stage
from moeforge.stages.activation import Activate, ActivationConfig
from moeforge.stages.gemm import GemmRole, GroupedGemm
from moeforge.quant.base import QuantMethod, expert_shapes, register_expert_biases
from moeforge.expert_weights import ExpertWeights

W13, W2, B13, B2 = "w13_weight", "w2_weight", "w13_bias", "w2_bias"
FLOAT_TORCH = (torch.bfloat16, torch.float16, torch.float32)


class UnquantizedMethod(QuantMethod):
    """Expert weights ``w13_weight [E, 2I, H]`` (gate rows then up rows, or ``[E, I, H]`` when the
    activation is not gated) and ``w2_weight [E, H, I]``; optional ``w13_bias [E, 2I]`` and
    ``w2_bias [E, H]``. Consumes float activations only: FP8/INT8 dispatch into it is a
    ``ContractError`` at build time. Float64 rows only on the torch backend (the triton experts say they
    cannot serve them). Differentiable: its torch stages pass gradients to the rows, the weights, the
    biases and the routing weights."""

    accepts: ClassVar[frozenset[DType]] = REFERENCE_FLOAT_DTYPES
    differentiable: ClassVar[bool] = True
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE})
    expert_parameters: ClassVar[tuple[str, ...]] = (W13, W2, B13, B2)
    compute_dtype_parameters: ClassVar[tuple[str, ...]] = (W13, W2, B13, B2)
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.FLOAT

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`TorchUnquantizedExperts`: the method's reference computation."""
        return TorchUnquantizedExperts

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
            # drawn in fp32 one expert at a time: a DeepSeek-V3-size layer's fp32 copy would take 45 GB at once
            weight = torch.empty(shape, dtype=dtype, device=device)
            for expert in range(shape[0]):
                weight[expert] = torch.empty(shape[1:], dtype=torch.float32, device=device).normal_(
                    std=shape[-1] ** -0.5)
            layer.register_parameter(name, torch.nn.Parameter(weight))
        register_expert_biases(layer, shapes, bias, dtype, device)

    def compute_dtype(self, holder: torch.nn.Module) -> DType:
        """The float weights' own dtype (float64 for the reference)."""
        weight = getattr(holder, W13, None)
        if isinstance(weight, torch.Tensor) and weight.dtype in (torch.float64, *FLOAT_TORCH):
            return DType.from_torch(weight.dtype)
        return super().compute_dtype(holder)

# -- its experts -------------------------------------------------------------------------------------



class TritonUnquantizedExperts(TritonExperts):
    """The fused triton GEMMs on block-aligned rows: gate/up with the activation in its epilogue, down
    with the routing weights in its epilogue when the router puts them there."""

    method: ClassVar[type[Any]] = UnquantizedMethod
    float_rows: ClassVar[FloatRows] = FloatRows.LAYER_DTYPE  # the GEMMs read rows in the weights' dtype

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        from moeforge.stages.triton import FusedGroupedGemm

        configs = cls.launch_table(configs)
        up, down = weights.gate_up, weights.down
        return [
            FusedGroupedGemm(GemmRole.GATE_UP, up.weight, configs, up.bias, activation),
            FusedGroupedGemm(GemmRole.DOWN, down.weight, configs, down.bias,
                             apply_routing_weights=routing_weights_in_epilogue),
        ]


class TorchUnquantizedExperts(TorchExperts):
    """The torch reference: grouped GEMM, activation, grouped GEMM, on either expert-grouped layout."""

    method: ClassVar[type[Any]] = UnquantizedMethod

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        dtypes, scales = UnquantizedMethod.accepts, UnquantizedMethod.accepts_scales
        up, down = weights.gate_up, weights.down
        return [
            GroupedGemm(GemmRole.GATE_UP, up.weight, up.bias, dtypes, scales),
            Activate(activation),
            GroupedGemm(GemmRole.DOWN, down.weight, down.bias, dtypes, scales,
                        apply_routing_weights=routing_weights_in_epilogue),
        ]
