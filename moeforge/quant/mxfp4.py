"""MXFP4 experts in GPT-OSS's checkpoint format: e2m1 weights in 32-element blocks with E8M0
power-of-two scales (OCP MX, see :mod:`moeforge.quant.fp4`), float activations (W4A16-style).

**On CUDA** the triton experts (:class:`TritonMxfp4Experts`) run the one grouped-GEMM kernel
(:mod:`moeforge.kernels.moe_gemm`): the e2m1 codes and E8M0 scales are dequantized in registers (exactly,
to the activations' dtype) and meet the bf16/fp16 rows in the tensor cores (Hopper has no FP4 math).
**Elsewhere** the torch reference dequantizes the weights to fp32 at call time and multiplies in fp32
(the result cast to the activations' dtype), on any device: the oracle of the kernel, not a fast path.

Weights (``E`` experts, ``H`` hidden, ``I`` intermediate, ``N13 = 2I`` gated or ``I``; ``H % 32 == 0``
and ``I % 32 == 0``), exactly as GPT-OSS stores them, so checkpoint tensors copy in unchanged:

* ``w13_blocks`` uint8 ``[E, N13, H // 32, 16]`` (two e2m1 codes per byte, element ``2j`` of a block in
  the low nibble) and ``w13_scales`` uint8 ``[E, N13, H // 32]`` (E8M0: ``2**(s - 127)``); ``w2_blocks``
  ``[E, H, I // 32, 16]``, ``w2_scales`` ``[E, H, I // 32]``. Rows are GEMM outputs (``[out, in]``, the
  orientation moeforge's ``[E, N, K]`` weights use); GPT-OSS interleaves gate and up rows
  (``ActivationConfig(gate_up=GateUpLayout.INTERLEAVED)``, as the ``gpt_oss`` preset sets).
* optional float biases ``w13_bias [E, N13]``, ``w2_bias [E, H]`` (GPT-OSS has both).

:meth:`Mxfp4Method.load_checkpoint_experts` reads GPT-OSS's ``experts.gate_up_proj_blocks`` /
``_scales`` / ``_bias`` and ``experts.down_proj_blocks`` / ``_scales`` / ``_bias``.

``Mxfp4Method(shuffled=True)`` holds the blocks in the pre-shuffled layout of the triton GEMMs
(:mod:`moeforge.kernels.shuffle`: each thread's bytes of a swapped tile next to each other; interleaved gate/up
rows paired, their scales' rows too), prepared as the weights are written (initialised, quantized, read from a
checkpoint or a state dict), so the GEMMs run swapped tiles with fewer instructions (docs/kernels.md, "The
pre-shuffled 4-bit layout"; measured in docs/notes/kernels-log.md). ``state_dict()``
still gives (and ``load_state_dict`` takes) the plain layout, so checkpoints are GPT-OSS's either way; the
parameters themselves hold the shuffled bytes. Its tuned tables are its own (``table_key`` ``"mxfp4-shuffled"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Optional, Union

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import CheckpointError, InputError
from moeforge.kernels.config import ConfigTable
from moeforge.expert_checkpoint import held_experts
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionWeights
from moeforge.kernels.formats import WeightFormat
from moeforge.quant.base import (
    FOUR_BIT_BLOCKS,
    QuantMethod,
    expert_shapes,
    register_expert_biases,
)
from moeforge.quant.fp4 import MXFP4_BLOCK, MxScaleRounding, dequantize_mxfp4, quantize_mxfp4
from moeforge.quant.nvfp4 import EmulatedGroupedGemm
from moeforge.quant import stored_layout as layouts
from moeforge.roles.base import FloatRows, TorchExperts, TritonExperts
from moeforge.spec import FLOAT_DTYPES, DType, ScaleLayout
from moeforge.stage import Stage
from moeforge.stages.activation import Activate, ActivationConfig
from moeforge.stages.gemm import GemmRole

W13_BLOCKS, W13_SCALES, W2_BLOCKS, W2_SCALES = "w13_blocks", "w13_scales", "w2_blocks", "w2_scales"
B13, B2 = "w13_bias", "w2_bias"
BYTES_PER_BLOCK = MXFP4_BLOCK // 2  # 16

# GPT-OSS checkpoint names (relative to the MoE block) -> the layer's tensors.
CHECKPOINT_KEYS: dict[str, str] = {
    "experts.gate_up_proj_blocks": W13_BLOCKS,
    "experts.gate_up_proj_scales": W13_SCALES,
    "experts.gate_up_proj_bias": B13,
    "experts.down_proj_blocks": W2_BLOCKS,
    "experts.down_proj_scales": W2_SCALES,
    "experts.down_proj_bias": B2,
}


MXFP4_NAMES = layouts.PackedNames("{}_blocks", "{}_scales")


@attrs.frozen(eq=False)
class Mxfp4WeightRef:
    """An MXFP4 projection of an :class:`~moeforge.expert_weights.ExpertWeights` record (blocks and scales, as
    its holder keeps them: read at call time, the layout undone by :meth:`tensors`)."""

    projection: ProjectionWeights
    format: str = "mxfp4"

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks and scales in the plain layout."""
        blocks, scales = self.projection.plain()
        if scales is None:
            raise InputError("MXFP4 expert weights need their scales")
        return blocks, scales

    @property
    def shape(self) -> tuple[int, int, int]:
        blocks = self.tensors()[0]
        return int(blocks.shape[0]), int(blocks.shape[1]), int(blocks.shape[2]) * MXFP4_BLOCK

    def dequantize(self) -> torch.Tensor:
        blocks, scales = self.tensors()
        experts, rows, groups, width = blocks.shape
        return dequantize_mxfp4(blocks.reshape(experts, rows, groups * width), scales)


class Mxfp4Method(QuantMethod):
    """MXFP4 expert weights (GPT-OSS's format, see the module docstring), float activations only.
    Triton experts on CUDA (:class:`TritonMxfp4Experts`), the emulated torch reference elsewhere.
    ``shuffled``: the layers hold the blocks in the triton GEMMs' pre-shuffled layout (module docstring)."""

    row_gradients: ClassVar[bool] = True  # its torch GEMMs decode the weights: rows differentiate (adapters)
    accepts: ClassVar[frozenset[DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[ScaleLayout]] = frozenset({ScaleLayout.NONE})
    dequant_blocks: ClassVar[tuple[tuple[float, int], ...]] = FOUR_BIT_BLOCKS
    expert_parameters: ClassVar[tuple[str, ...]] = (W13_BLOCKS, W13_SCALES, W2_BLOCKS, W2_SCALES, B13, B2)
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_blocks", scale="{}_scales")
    weight_format: ClassVar[Optional[WeightFormat]] = WeightFormat.MXFP4

    def reference_experts(self) -> Optional[type[Any]]:
        """:class:`EmulatedMxfp4Experts`: the method's reference computation."""
        return EmulatedMxfp4Experts

    def __init__(self, *, shuffled: bool = False) -> None:
        self.shuffled = shuffled

    def __repr__(self) -> str:
        return "Mxfp4Method(shuffled=True)" if self.shuffled else "Mxfp4Method()"

    @property
    def table_key(self) -> str:
        return "mxfp4-shuffled" if self.shuffled else "mxfp4"

    # -- weights ------------------------------------------------------------------------------------------

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
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size % MXFP4_BLOCK:
                raise InputError(f"Mxfp4Method needs {name} divisible by {MXFP4_BLOCK} (its block size), "
                                 f"got {size}")
        shapes = expert_shapes(num_experts, hidden_size, intermediate_size, gated)
        layouts.record_layout(layer, MXFP4_NAMES, shuffled=self.shuffled, gated=gated)
        for prefix, (experts, rows, width) in shapes.items():
            groups = width // MXFP4_BLOCK
            for name, shape in ((f"{prefix}_blocks", (experts, rows, groups, BYTES_PER_BLOCK)),
                                (f"{prefix}_scales", (experts, rows, groups))):
                tensor = torch.zeros(shape, dtype=torch.uint8, device=device)
                layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        register_expert_biases(layer, shapes, bias, dtype, device)
        # Usable before loading: random N(0, 1/fan_in) weights, quantized. One expert at a time: the float
        # weights of a DeepSeek-V3-size layer would take 45 GB in fp32, and the quantizer's temporaries more.
        for prefix, (experts, rows, width) in shapes.items():
            for expert in range(experts):
                weight = torch.empty((rows, width), device=device).normal_(std=width ** -0.5)
                self._quantize_expert(layer, prefix, expert, weight, MxScaleRounding.FLOOR)

    def quantize_weights(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor, *,
                         rounding: Union[MxScaleRounding, str] = MxScaleRounding.FLOOR) -> None:
        """Fill ``layer``'s MXFP4 weights from float ``w13 [E, N13, H]`` and ``w2 [E, H, I]``
        (``rounding``: the shared-exponent rule, OCP's ``FLOOR`` by default), one expert at a time."""
        for prefix, weight in (("w13", w13), ("w2", w2)):
            target = getattr(layer, f"{prefix}_blocks", None)
            if not isinstance(target, torch.Tensor):
                raise InputError(f"the layer has no {prefix}_blocks: call create_weights first")
            experts, rows, groups, _ = target.shape
            want = (experts, rows, groups * MXFP4_BLOCK)
            if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != want:
                have = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
                raise InputError(f"{prefix} must be a float tensor of shape {list(want)}, got {have}")
            for expert in range(experts):
                self._quantize_expert(layer, prefix, expert, weight[expert], rounding)

    @staticmethod
    def _quantize_expert(layer: torch.nn.Module, prefix: str, expert: int, weight: torch.Tensor,
                         rounding: Union[MxScaleRounding, str]) -> None:
        """Quantize one expert's float ``weight [N, K]`` into ``{prefix}_blocks`` / ``{prefix}_scales`` (in the
        layer's layout)."""
        q = quantize_mxfp4(weight, rounding)
        layouts.store_expert(layer, MXFP4_NAMES, prefix, expert, q.data, q.scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the loaded tensors (the stored layout is the one the emulated GEMMs read)."""
        for blocks_name, scales_name in ((W13_BLOCKS, W13_SCALES), (W2_BLOCKS, W2_SCALES)):
            blocks, scales = getattr(layer, blocks_name, None), getattr(layer, scales_name, None)
            if (not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 4
                    or blocks.shape[-1] != BYTES_PER_BLOCK):
                have = (tuple(blocks.shape), blocks.dtype) if isinstance(blocks, torch.Tensor) else blocks
                raise CheckpointError(f"{blocks_name} must be uint8 [E, N, K // 32, 16], got {have}")
            want = tuple(blocks.shape[:3])
            if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != want:
                have = (tuple(scales.shape), scales.dtype) if isinstance(scales, torch.Tensor) else scales
                raise CheckpointError(f"{scales_name} must be uint8 {list(want)}, got {have}")

    def load_checkpoint_experts(
        self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """GPT-OSS's MXFP4 expert tensors (``experts.gate_up_proj_blocks`` ...; biases are cast to
        the layer's dtype). The checkpoint holds every expert (``[E, ...]``); an expert-parallel layer
        takes the rows of its ``expert_range``. Raises :class:`CheckpointError` naming the key of a
        missing, misshapen or mistyped tensor."""
        found: dict[str, torch.Tensor] = {}
        blocks = getattr(layer, W13_BLOCKS)
        experts = held_experts(layer, int(blocks.shape[0]))
        total = int(getattr(layer, "num_experts", blocks.shape[0]))
        for key, name in CHECKPOINT_KEYS.items():
            target = getattr(layer, name, None)
            if not isinstance(target, torch.Tensor):  # e.g. the layer has no expert biases
                continue
            if key not in tensors:
                raise CheckpointError(f"checkpoint tensor '{key}' is missing (it fills {name})")
            value = tensors[key]
            want = [total, *target.shape[1:]]
            if list(value.shape) != want:
                raise CheckpointError(f"checkpoint tensor '{key}' has shape {list(value.shape)}; {name} needs "
                                      f"{want} (all {total} experts)")
            value = value[experts.start:experts.stop]
            if target.dtype == torch.uint8:
                if value.dtype != torch.uint8:
                    raise CheckpointError(f"checkpoint tensor '{key}' is {value.dtype}; MXFP4 blocks and scales "
                                          "are uint8")
            elif not value.dtype.is_floating_point:
                raise CheckpointError(f"checkpoint tensor '{key}' is {value.dtype}; a bias must be float")
            found[name] = value.to(device=target.device, dtype=target.dtype)
        layout = layouts.stored_layout(layer)
        for prefix, (blocks, scales) in (("w13", (W13_BLOCKS, W13_SCALES)), ("w2", (W2_BLOCKS, W2_SCALES))):
            if blocks in found and scales in found:
                found[blocks], found[scales] = layout.of(prefix).stored(found[blocks], found[scales])
        return found


# -- its experts --------------------------------------------------------------------------------------


class EmulatedMxfp4Experts(TorchExperts):
    """MXFP4 weights dequantized to fp32 in torch (float rows), the math of an MXFP4 kernel."""

    method: ClassVar[type[Any]] = Mxfp4Method

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        return [
            EmulatedGroupedGemm(GemmRole.GATE_UP, Mxfp4WeightRef(weights.gate_up), weights.gate_up.bias),
            Activate(activation),
            EmulatedGroupedGemm(GemmRole.DOWN, Mxfp4WeightRef(weights.down), weights.down.bias,
                                apply_routing_weights=routing_weights_in_epilogue),
        ]


class TritonMxfp4Experts(TritonExperts):
    """The one grouped-GEMM kernel on the stored MXFP4 blocks (read as ``[E, N, K / 2]`` bytes): weights
    dequantized in registers, the activation in the gate/up GEMM's epilogue, the routing weights in the
    down GEMM's."""

    method: ClassVar[type[Any]] = Mxfp4Method
    float_rows: ClassVar[FloatRows] = FloatRows.LAYER_DTYPE  # float rows in the compute dtype (out_dtype)

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        from moeforge.stages.triton_quant import FusedQuantGroupedGemm

        configs = cls.launch_table(configs)
        layouts.check_gate_up_rows(weights.gate_up.layout, activation, "MXFP4")
        return [
            FusedQuantGroupedGemm.of(GemmRole.GATE_UP, WeightFormat.MXFP4, weights.gate_up, configs,
                                     activation=activation, out_dtype=weights.dtype),
            FusedQuantGroupedGemm.of(GemmRole.DOWN, WeightFormat.MXFP4, weights.down, configs,
                                     apply_routing_weights=routing_weights_in_epilogue, out_dtype=weights.dtype),
        ]
