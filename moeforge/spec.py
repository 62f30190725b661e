"""Specs: the build-time description of what crosses a stage boundary.

A :class:`Spec` is what the contract checker compares. It describes a payload without holding a
tensor, so a whole pipeline can be checked before the first forward call. A stage declares what it
:class:`Accepts` (a set of allowed values per field) and how it transforms the spec it receives.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import attrs
import torch

from moeforge.arguments import positive_int
from moeforge.errors import InputError


__all__ = [
    "Accepts", "DType", "Exchange", "ExpertIds", "FLOAT_DTYPES", "GroupListType", "Layout", "PayloadKind",
    "REFERENCE_FLOAT_DTYPES", "RoutingWeights", "SCALES_OF", "ScaleLayout", "ScalingFactor", "Spec",
    "accumulation_dtype", "input_spec",
]


class PayloadKind(enum.Enum):
    """What a payload is, in the order the forward produces them."""

    TOKENS = "tokens"  # hidden states + router logits, token-major, nothing routed yet
    ROUTED = "routed"  # tokens with their top-k expert ids and weights
    DISPATCHED = "dispatched"  # rows grouped by expert, width = hidden
    EXPERT_HIDDEN = "expert_hidden"  # after the first GEMM (2*I) or the activation (I)
    EXPERT_OUTPUT = "expert_output"  # after the second GEMM, width = hidden
    OUTPUT = "output"  # combined back to tokens


class Layout(enum.Enum):
    TOKEN_MAJOR = "token_major"  # [T, W], one row per token
    EXPERT_SORTED = "expert_sorted"  # [R, W], rows grouped by expert + group_list
    # [E, capacity, W] + masked_m; the slots past masked_m hold any bits (an exchange never writes them): no stage
    # may let them reach a used slot's result (moeforge.testing.assert_stage_ignores_unused_slots)
    EXPERT_PADDED = "expert_padded"
    BLOCK_ALIGNED = "block_aligned"  # sorted ids padded per block (Triton fused-MoE style)


class DType(enum.Enum):
    """Element format of an activation tensor (the scale layout is a separate field)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP64 = "fp64"  # the torch reference only: float64 layers, for gradcheck and oracles
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"
    NVFP4 = "nvfp4"  # two e2m1 values per uint8, 16-element blocks with fp8 scales

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @property
    def is_quantized(self) -> bool:
        return self in (DType.FP8_E4M3, DType.INT8, DType.NVFP4)

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for member, torch_dtype in _TORCH_DTYPES.items():
            if torch_dtype == dtype and member is not DType.NVFP4:
                return member
        raise ValueError(f"no moeforge DType for torch dtype {dtype}")


_TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP32: torch.float32,
    DType.FP64: torch.float64,
    DType.FP8_E4M3: torch.float8_e4m3fn,
    DType.INT8: torch.int8,
    DType.NVFP4: torch.uint8,
}

# The float formats every backend computes in (the triton kernels, the wire of expert parallelism).
FLOAT_DTYPES = frozenset({DType.BF16, DType.FP16, DType.FP32})
# The torch reference stages also compute float64 end to end (routing, GEMMs, activation, combine), so that
# a float64 layer can be checked with torch.autograd.gradcheck; the stages that cannot accept only
# FLOAT_DTYPES, and the contract checker refuses float64 there.
REFERENCE_FLOAT_DTYPES = FLOAT_DTYPES | {DType.FP64}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch reference computes in for tensors of ``dtype``: float32 (the accumulation of
    bf16 / fp16 / fp32 activations, and of dequantized FP8 / INT8 ones), float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ScaleLayout(enum.Enum):
    NONE = "none"
    PER_TOKEN = "per_token"  # one fp32 scale per row: [R, 1]
    PER_GROUP_128 = "per_group_128"  # one fp32 scale per 128 elements of a row: [R, W // 128]
    PER_TENSOR = "per_tensor"  # one fp32 scale: [1]
    NVFP4_BLOCK16 = "nvfp4_block16"  # fp8 scale per 16 elements + fp32 global scale


# The scale layouts each element format travels with: a quantized dtype without its scales would be
# read as the integers it stores, and a float dtype with scales means something else.
SCALES_OF: dict[DType, frozenset[ScaleLayout]] = {
    **{dtype: frozenset({ScaleLayout.NONE}) for dtype in REFERENCE_FLOAT_DTYPES},
    DType.FP8_E4M3: frozenset({ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128, ScaleLayout.PER_TENSOR}),
    DType.INT8: frozenset({ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128, ScaleLayout.PER_TENSOR}),
    DType.NVFP4: frozenset({ScaleLayout.NVFP4_BLOCK16}),
}


class GroupListType(enum.IntEnum):
    """How expert-sorted rows say where each expert's rows end (the grouped-matmul convention)."""

    CUMSUM = 0  # group_list[e] = rows of experts 0..e
    COUNT = 1  # group_list[e] = rows of expert e

    @classmethod
    def parse(cls, value: object) -> GroupListType:
        """A ``GroupListType`` or its int convention (0 = cumsum, 1 = counts); ``ValueError`` else."""
        if isinstance(value, GroupListType):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        raise ValueError(f"group_list_type must be 0 (cumsum) or 1 (counts), got {value!r}")


class RoutingWeights(enum.Enum):
    """Where the routing weights are applied. They must be applied exactly once, at the place the
    router declared (``Spec.weights_at``): the three places give three different functions as soon as
    the experts are nonlinear or have biases, so none may stand in for another."""

    PENDING = "pending"
    ON_INPUT = "on_input"  # dispatched rows were scaled before the experts (Llama-4)
    IN_GEMM_EPILOGUE = "in_gemm_epilogue"  # the second (down) GEMM scaled its output rows, after its bias
    IN_COMBINE = "in_combine"  # the weighted sum of the combine


class ScalingFactor(enum.Enum):
    """Whether the routed scaling factor (DeepSeek's ``routed_scaling_factor``) is applied."""

    NONE = "none"  # there is no factor (or it is 1)
    PENDING = "pending"  # a factor exists and a later stage must apply it
    IN_WEIGHTS = "in_weights"  # folded into the routing weights; applied with them
    APPLIED = "applied"  # multiplied onto the output


class ExpertIds(enum.Enum):
    GLOBAL = "global"
    LOCAL = "local"  # this expert-parallel rank's numbering (equal to global on one rank)


class Exchange(enum.Enum):
    """Where expert-grouped rows came from (their plan takes them back there; shown by ``describe()``)."""

    NONE = "none"  # this process's own tokens (single process, or every expert local)
    ALL_TO_ALL = "all_to_all"  # exchanged with the other expert-parallel ranks, variable-length
    LOW_LATENCY = "low_latency"  # exchanged in fixed-capacity per-(rank, expert) buffers


@attrs.frozen
class Spec:
    """What crosses one stage boundary. Compared field by field by the contract checker.

    Besides the format, a spec carries what changes the math of the forward, so that the checker can
    tell a composition that computes an MoE forward from one that computes something else:

    * ``weights_at`` — where the router declared the routing weights are applied (set by the top-k;
      ``None`` for a user-written routing stage that declares nothing); only the stage at that place
      may apply them, and they must be applied by the output;
    * ``pending_scale`` — the value of a routed scaling factor left to a later stage (``scaling_factor``
      is ``PENDING``): the stage that applies it must apply this value;
    * ``activations`` — activations applied since the rows were dispatched: the expert computation
      must hold exactly one between its two GEMMs (:func:`moeforge.pipeline.validate` counts the stages
      whose kinds include ``ACTIVATION``);
    * ``alignment`` — for block-aligned rows, what decided their ``block_m``
      (:meth:`moeforge.kernels.config.ConfigTable.alignment`): the GEMMs must align alike;
    * ``global_scale`` — the static global scale NVFP4 rows were quantized with (it travels with the
      quantizer, not the payload): the GEMM reading them must dequantize with the same one;
    * ``slot_order`` — the block-aligned rows may come in the alignment's slot order (a training step's layout,
      :mod:`moeforge.stages.slot_order`), where row ``r`` is not copy ``r``: only stages that read the rows through
      the alignment (row by row, or by its plan) may consume them, so a stage accepts it only where it says so
      (``Accepts.slot_order``), and the others need the dispatch built without it (``slot_rows=False``).
    """

    kind: PayloadKind
    layout: Layout
    dtype: DType
    width: int
    scale_layout: ScaleLayout = ScaleLayout.NONE
    group_list_type: Optional[GroupListType] = None
    routing_weights: RoutingWeights = RoutingWeights.PENDING
    scaling_factor: ScalingFactor = ScalingFactor.NONE
    expert_ids: ExpertIds = ExpertIds.GLOBAL
    num_experts: Optional[int] = None  # experts in this view: global before dispatch, local after
    top_k: Optional[int] = None
    exchange: Exchange = Exchange.NONE
    weights_at: Optional[RoutingWeights] = None
    pending_scale: Optional[float] = None
    activations: int = 0
    alignment: Optional[tuple[object, ...]] = None
    global_scale: Optional[float] = None
    slot_order: bool = False

    def evolve(self, **changes: Any) -> Spec:
        return attrs.evolve(self, **changes)

    def short(self) -> str:
        """One compact line, used by ``Pipeline.describe()``."""
        parts = [self.kind.value, self.layout.value, self.dtype.value]
        if self.scale_layout is not ScaleLayout.NONE:
            parts.append(f"scale={self.scale_layout.value}")
        parts.append(f"w={self.width}")
        if self.num_experts is not None:
            parts.append(f"E={self.num_experts}")
        if self.top_k is not None:
            parts.append(f"k={self.top_k}")
        if self.group_list_type is not None:
            parts.append(f"group_list={self.group_list_type.name.lower()}")
        if self.kind is not PayloadKind.TOKENS:
            placement = ""
            if self.routing_weights is RoutingWeights.PENDING and self.weights_at is not None:
                placement = f"->{self.weights_at.value}"
            parts.append(f"rw={self.routing_weights.value}{placement}")
        if self.scaling_factor is not ScalingFactor.NONE:
            value = f"(x{self.pending_scale:g})" if self.pending_scale is not None else ""
            parts.append(f"rsf={self.scaling_factor.value}{value}")
        if self.kind is PayloadKind.EXPERT_HIDDEN:
            parts.append(f"act={self.activations}")
        if self.kind in (PayloadKind.DISPATCHED, PayloadKind.EXPERT_HIDDEN, PayloadKind.EXPERT_OUTPUT):
            parts.append(f"ids={self.expert_ids.value}")
        if self.exchange is not Exchange.NONE:
            parts.append(f"via={self.exchange.value}")
        if self.slot_order:
            parts.append("slots")
        return " ".join(parts)


def _opt_set(value: Any) -> Optional[frozenset[Any]]:
    if value is None:
        return None
    if isinstance(value, (set, frozenset, list, tuple)):
        return frozenset(value)
    return frozenset({value})


@attrs.frozen
class Accepts:
    """What a stage accepts: for each field, the allowed values (``None`` = anything; every field's default, but
    ``slot_order``'s: ``False`` alone).

    Single values are wrapped into one-element sets, so ``Accepts(kind=PayloadKind.ROUTED)`` works.
    """

    kind: Optional[frozenset[PayloadKind]] = attrs.field(default=None, converter=_opt_set)
    layout: Optional[frozenset[Layout]] = attrs.field(default=None, converter=_opt_set)
    dtype: Optional[frozenset[DType]] = attrs.field(default=None, converter=_opt_set)
    width: Optional[frozenset[int]] = attrs.field(default=None, converter=_opt_set)
    scale_layout: Optional[frozenset[ScaleLayout]] = attrs.field(default=None, converter=_opt_set)
    group_list_type: Optional[frozenset[Optional[GroupListType]]] = attrs.field(
        default=None, converter=_opt_set
    )
    routing_weights: Optional[frozenset[RoutingWeights]] = attrs.field(default=None, converter=_opt_set)
    scaling_factor: Optional[frozenset[ScalingFactor]] = attrs.field(default=None, converter=_opt_set)
    expert_ids: Optional[frozenset[ExpertIds]] = attrs.field(default=None, converter=_opt_set)
    num_experts: Optional[frozenset[Optional[int]]] = attrs.field(default=None, converter=_opt_set)
    top_k: Optional[frozenset[Optional[int]]] = attrs.field(default=None, converter=_opt_set)
    exchange: Optional[frozenset[Exchange]] = attrs.field(default=None, converter=_opt_set)
    weights_at: Optional[frozenset[Optional[RoutingWeights]]] = attrs.field(default=None, converter=_opt_set)
    pending_scale: Optional[frozenset[Optional[float]]] = attrs.field(default=None, converter=_opt_set)
    activations: Optional[frozenset[int]] = attrs.field(default=None, converter=_opt_set)
    # A tuple is one value here, not a collection of them: give alignments as frozenset({alignment}).
    alignment: Optional[frozenset[Optional[tuple[object, ...]]]] = attrs.field(default=None, converter=_opt_set)
    global_scale: Optional[frozenset[Optional[float]]] = attrs.field(default=None, converter=_opt_set)
    # Rows in slot order (Spec.slot_order) only where the stage says it reads the used rows alone: the others refuse.
    slot_order: Optional[frozenset[bool]] = attrs.field(default=frozenset({False}), converter=_opt_set)

    def mismatches(self, spec: Spec) -> list[tuple[str, Any, frozenset[Any]]]:
        """Every field whose value in ``spec`` is not allowed: ``(field, have, allowed)``."""
        found = []
        for field in attrs.fields(Accepts):
            allowed = getattr(self, field.name)
            if allowed is not None:
                have = getattr(spec, field.name)
                if have not in allowed:
                    found.append((field.name, have, allowed))
        return found


def input_spec(hidden_size: int, dtype: torch.dtype, num_experts: int) -> Spec:
    """The spec of a pipeline's input: token-major hidden states plus router logits. ``dtype`` is the
    hidden states' (bf16, fp16, fp32, or float64 for the torch reference)."""
    positive_int("hidden_size", hidden_size)
    positive_int("num_experts", num_experts)
    if not isinstance(dtype, torch.dtype) or dtype not in _INPUT_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(map(str, _INPUT_DTYPES))} (the dtypes a pipeline "
                         f"takes its hidden states in), got {dtype!r}")
    return Spec(
        kind=PayloadKind.TOKENS,
        layout=Layout.TOKEN_MAJOR,
        dtype=DType.from_torch(dtype),
        width=hidden_size,
        num_experts=num_experts,
    )


_INPUT_DTYPES = tuple(_TORCH_DTYPES[dtype] for dtype in (DType.BF16, DType.FP16, DType.FP32, DType.FP64))
