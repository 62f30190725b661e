"""The expert tensors as data: what an :class:`~moeforge.roles.Experts` implementation builds its stages from.

A quant method turns whatever holds a layer's expert tensors — a :class:`~moeforge.MoELayer`, a transformers
experts module, a test's own tensors — into one frozen :class:`ExpertWeights` record
(:meth:`moeforge.QuantMethod.expert_weights`): per projection (gate/up, down) the weight, its scales, zero
points, global scales and bias, and the layout the weight is held in. The Experts classes read that record and
nothing else, so they know no parameter name and work the same from every holder.

The tensors are :data:`~moeforge.tensor_ref.TensorSource` s: a tensor, or a reference read when the stage runs
(so ``layer.to(...)``, ``load_state_dict`` and training are seen without rebuilding). Where the names come from
is :class:`ExpertNames`: a quant method's own for a ``MoELayer``, transformers' for its experts modules.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from moeforge.errors import InputError
from moeforge.kernels import shuffle
from moeforge.spec import DType
from moeforge.tensor_ref import (LayerRef, ParamRef, ParametrizedRef, TensorSource, TransposedParamRef, parametrized,
                                 resolve)


@attrs.frozen
class StoredLayout:
    """How a weight's packed 4-bit codes are held: plain, or ``shuffled`` for the triton GEMMs, the gate/up
    weight's rows ``paired`` when they are interleaved (see :mod:`moeforge.kernels.shuffle`). The weights are e2m1
    codes (the methods with the option: MXFP4, NVFP4), shuffled with their words' bits placed for the decoding."""

    shuffled: bool = False
    paired: bool = False  # (the gate/up weight only)

    def of(self, prefix: str) -> StoredLayout:
        """The layout of ``prefix``'s weight (``"w13"`` or ``"w2"``: the down weight is never paired)."""
        return StoredLayout(self.shuffled, self.paired and prefix == "w13")

    def stored(self, data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain packed ``data [..., N, *bytes]`` (one row's bytes in one or more trailing dimensions, e.g.
        MXFP4's ``[K / 32, 16]``) and its ``scales [..., N, groups]`` as this layout holds them."""
        if not self.shuffled:
            return data, scales
        flat = shuffle.shuffle(data.reshape(*scales.shape[:-1], -1), e2m1=True, paired=self.paired)
        return flat.reshape(data.shape), shuffle.pair_rows(scales) if self.paired else scales

    def plain(self, data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of :meth:`stored`."""
        if not self.shuffled:
            return data, scales
        flat = shuffle.unshuffle(data.reshape(*scales.shape[:-1], -1), e2m1=True, paired=self.paired)
        return flat.reshape(data.shape), shuffle.unpair_rows(scales) if self.paired else scales


@attrs.frozen
class ProjectionWeights:
    """One expert projection's tensors: ``weight`` ``[E, N, K]`` in its format (packed 4-bit: ``[E, N, K / 2]``
    bytes, or MXFP4's ``[E, N, K / 32, 16]`` blocks), and what the format adds — ``scale`` (per channel, per
    block or per K-group), ``zero_point`` (INT4), ``global_scale`` (NVFP4, fp32 ``[E]``) — and the optional
    float ``bias`` ``[E, N]``; ``layout``: how ``weight`` and ``scale`` are held."""

    weight: TensorSource
    scale: Optional[TensorSource] = None
    zero_point: Optional[TensorSource] = None
    global_scale: Optional[TensorSource] = None
    bias: Optional[TensorSource] = None
    layout: StoredLayout = StoredLayout()

    def plain(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight and its scale, now, in the plain layout (what the torch references decode)."""
        weight, scale = resolve(self.weight), None if self.scale is None else resolve(self.scale)
        if scale is None or not self.layout.shuffled:
            return weight, scale
        return self.layout.plain(weight, scale)


@attrs.frozen
class ExpertWeights:
    """A layer's expert tensors: the gate/up projection (``[E, 2I, H]``, or ``[E, I, H]`` ungated) and the down
    projection (``[E, H, I]``), and ``dtype``, the float dtype the experts compute and produce (the float weights'
    dtype; a quantized GEMM's output).

    ``holder``: a weak reference to the module the tensors were read from, for the one kind of implementation that
    takes a whole layer — a quant method's own entry point (an NPU kernel's, or a method written outside moeforge
    that overrides ``expert_stages``); ``None`` when the record was made from tensors."""

    gate_up: ProjectionWeights
    down: ProjectionWeights
    dtype: DType
    holder: Optional[LayerRef] = attrs.field(default=None, eq=False)

    def layer(self) -> torch.nn.Module:
        """The module the tensors were read from; ``TypeError`` for a record made from tensors."""
        if self.holder is None:
            raise TypeError("these expert weights were not read from a module: an implementation that takes the "
                            "whole layer cannot run on them")
        return self.holder.get()


@attrs.frozen
class ProjectionNames:
    """Where a holder keeps one projection's tensors: attribute names (``None``: the format has no such tensor);
    ``transposed``: the weight is held ``[E, K, N]`` (transformers' layout) and read as a view."""

    weight: str
    scale: Optional[str] = None
    zero_point: Optional[str] = None
    global_scale: Optional[str] = None
    bias: Optional[str] = None
    transposed: bool = False


@attrs.frozen
class ExpertNames:
    """Where a holder keeps the expert tensors: both projections' :class:`ProjectionNames`."""

    gate_up: ProjectionNames
    down: ProjectionNames

    @classmethod
    def of(cls, weight: str, scale: Optional[str] = None, zero_point: Optional[str] = None,
           global_scale: Optional[str] = None, bias: Optional[str] = "{}_bias") -> ExpertNames:
        """Names with ``{}`` standing for the projection's prefix, ``w13`` and ``w2`` (a ``MoELayer``'s)."""
        def names(prefix: str) -> ProjectionNames:
            def named(name: Optional[str]) -> Optional[str]:
                return None if name is None else name.format(prefix)

            return ProjectionNames(weight.format(prefix), named(scale), named(zero_point), named(global_scale),
                                   named(bias))

        return cls(names("w13"), names("w2"))

    def all(self) -> tuple[str, ...]:
        """Every name, gate/up's first."""
        return tuple(name for projection in (self.gate_up, self.down)
                     for name in attrs.astuple(projection)[:5] if name is not None)


def read_expert_weights(holder: torch.nn.Module, names: ExpertNames, dtype: DType,
                        layout: StoredLayout = StoredLayout()) -> ExpertWeights:
    """The record of ``holder``'s tensors ``names``, read by reference (each read when a stage runs). The weight,
    scale and global scale must be parameters or buffers of ``holder``, or tensors a parametrization computes
    (:class:`~moeforge.tensor_ref.ParametrizedRef`: peft's LoRA on the experts' parameters); a zero point or bias it
    holds as ``None`` (or lacks) is absent. ``layout``: how ``holder`` keeps its packed weights (the down weight's is
    never paired). Raises ``ValueError`` naming a missing tensor."""

    def required(name: Optional[str], transposed: bool = False) -> Optional[TensorSource]:
        if name is None:
            return None
        if parametrized(holder, name):
            return ParametrizedRef(holder, name, transposed)
        return TransposedParamRef(holder, name) if transposed else ParamRef(holder, name)

    def optional(name: Optional[str]) -> Optional[TensorSource]:
        if name is None or getattr(holder, name, None) is None:
            return None
        return ParametrizedRef(holder, name) if parametrized(holder, name) else ParamRef(holder, name)

    def projection(names: ProjectionNames, prefix: str) -> ProjectionWeights:
        weight = required(names.weight, names.transposed)
        assert weight is not None
        return ProjectionWeights(weight, required(names.scale), optional(names.zero_point),
                                 required(names.global_scale), optional(names.bias), layout.of(prefix))

    return ExpertWeights(projection(names.gate_up, "w13"), projection(names.down, "w2"), dtype, LayerRef(holder))


def layer_compute_dtype(layer: torch.nn.Module) -> DType:
    """The float dtype ``layer`` computes in (``MoELayer.dtype``): what a quantized GEMM produces."""
    dtype = getattr(layer, "dtype", None)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{type(layer).__name__} has no float 'dtype' attribute (bf16, fp16 or fp32, as "
                         f"MoELayer.dtype): the quantized GEMMs produce the layer's dtype; got {dtype!r}")
    return DType.from_torch(dtype)  # type: ignore[arg-type]
