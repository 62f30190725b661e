"""Low-rank adapters on the experts' GEMMs (LoRA), declared with the layer and checked with its pipeline.

``MoELayer(..., adapter=ExpertAdapter(rank=16, alpha=32))`` gives each targeted projection of every local expert a
low-rank update: ``W[e] + scale · B[e] A[e]`` with ``A [E, r, K]`` (or one ``[1, r, K]`` shared by all experts,
``shared_a``), ``B [E, N, r]`` and ``scale = alpha / rank`` — parameters of the layer (``w13_lora_a``,
``w13_lora_b``, ``w2_lora_a``, ``w2_lora_b``), ``A`` drawn like ``nn.Linear``'s weight and ``B`` zero, so a new
adapter leaves the layer's output as it was. The base weights keep their format and stay as they are: freeze them
(``requires_grad_(False)``) to fine-tune the adapter alone.

An :class:`AdaptedGemm` stage computes the update on the rows the GEMM reads, as two more grouped GEMMs of rank
``r`` (``x Aᵀ``, then ``· Bᵀ``, scaled, with the base GEMM's routing weights where its epilogue applies them) added
to the base GEMM's output — never the full-size ``B A``. It wraps the torch stages' GEMMs, whatever their weights'
format (float, or 4-bit weights decoded as they run: a float adapter over a frozen quantized base).
:class:`AdaptedGroupedGemm` does the same around the triton GEMMs on block-aligned rows: the base GEMM without its
fused activation, the two low-rank products as launches of the same grouped-GEMM kernel on the same alignment, the
sum, then the activation as its own kernel; every kernel has its backward, so the adapter trains there too (over
float base weights: the quantized triton GEMMs have no backward). Both read the GEMM's rows as floats: 8-bit rows
(FP8 / INT8, W8A8) dequantized with their scales — serving only, such rows pass no gradient — while NVFP4 rows, whose
global scale the rows do not carry, are refused when the pipeline is built. Over a base
whose method has ``row_gradients`` (its torch GEMMs pass gradients to their rows through the frozen weights: W4A16,
MXFP4, NVFP4) the layer trains on the torch backend although the method alone is inference-only, which is why
``backend="auto"`` picks the torch stages for those bases; ``backend="triton"`` serves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Optional, Union

import attrs
import torch

from moeforge.errors import InputError
from moeforge.kernels.config import GemmConfig, narrow_config
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRoute, GemmRows, GemmUpdate, GemmWeight,
                                                grouped_gemm)
from moeforge.no_backward import records_grad
from moeforge.payloads import Activations, AlignedRows, ExpertRows, StackAlignment
from moeforge.spec import Accepts, DType, Layout, Spec
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages.gemm import GemmRole, expert_rows_gemm
from moeforge.stages.quantize import dequantize
from moeforge.stages.triton import AlignDispatch
from moeforge.tensor_ref import ParamRef, TensorSource, resolve

# The layer's parameter names of each projection's adapter: (A, B).
ADAPTER_NAMES = {GemmRole.GATE_UP: ("w13_lora_a", "w13_lora_b"), GemmRole.DOWN: ("w2_lora_a", "w2_lora_b")}


def _roles(value: Union[Iterable[Union[GemmRole, str]], GemmRole, str]) -> frozenset[GemmRole]:
    items = [value] if isinstance(value, (GemmRole, str)) else list(value)
    try:
        roles = frozenset(item if isinstance(item, GemmRole) else GemmRole(item) for item in items)
    except ValueError:
        raise InputError(f"ExpertAdapter.targets names the experts' GEMMs ('gate_up', 'down'), got {value!r}") from None
    if not roles:
        raise InputError("ExpertAdapter.targets must name at least one GEMM ('gate_up', 'down')")
    return roles


def _rank(instance: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"ExpertAdapter.rank must be a positive int, got {value!r}")


def _alpha(instance: Any, attribute: Any, value: Optional[float]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise InputError(f"ExpertAdapter.alpha must be a positive number (or None: the rank), got {value!r}")


def _count(instance: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"ExpertAdapter.count must be a positive int (adapters in the stack), got {value!r}")


@attrs.frozen
class ExpertAdapter:
    """A LoRA adapter on the experts: ``rank``, ``alpha`` (the update is scaled by ``alpha / rank``; ``None``: the
    rank, a scale of 1), ``targets`` (``"gate_up"``, ``"down"`` or both) and ``shared_a`` (one ``A`` for every
    expert). ``count > 1``: a stack of that many adapters of this shape (serving many fine-tunes of one base), each
    token picking its own by the ``adapter_ids`` the forward takes (``-1``: none)."""

    rank: int = attrs.field(validator=_rank)
    alpha: Optional[float] = attrs.field(default=None, validator=_alpha)
    targets: frozenset[GemmRole] = attrs.field(default=frozenset(GemmRole), converter=_roles)
    shared_a: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    count: int = attrs.field(default=1, validator=_count)

    @property
    def stacked(self) -> bool:
        """Whether the adapter is a stack the tokens choose from (``count > 1``)."""
        return self.count > 1

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def summary(self) -> str:
        roles = ", ".join(role.value for role in GemmRole if role in self.targets)
        return ((f"{self.count} LoRA adapters" if self.stacked else "LoRA adapter")
                + f" r={self.rank}, scale {self.scale:g} on {roles}"
                + (", one A shared by the experts" if self.shared_a else ""))


def create_adapter_weights(layer: torch.nn.Module, adapter: ExpertAdapter, *, num_experts: int, hidden_size: int,
                           intermediate_size: int, gated: bool, dtype: torch.dtype,
                           device: Union[torch.device, str, None]) -> None:
    """Register the adapter's parameters on ``layer``: ``A`` drawn as ``nn.Linear`` draws a weight (Kaiming uniform,
    ``a = sqrt(5)``), ``B`` zero; a stack's with a leading ``count`` dimension (``A [count, E|1, r, K]``,
    ``B [count, E, N, r]``)."""
    widths = {GemmRole.GATE_UP: ((2 if gated else 1) * intermediate_size, hidden_size),
              GemmRole.DOWN: (hidden_size, intermediate_size)}
    for role in GemmRole:
        if role not in adapter.targets:
            continue
        out_features, in_features = widths[role]
        name_a, name_b = ADAPTER_NAMES[role]
        stack = (adapter.count,) if adapter.stacked else ()
        a = torch.empty(*stack, 1 if adapter.shared_a else num_experts, adapter.rank, in_features, dtype=dtype,
                        device=device)
        for matrix in a.view(-1, adapter.rank, in_features):
            torch.nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        layer.register_parameter(name_a, torch.nn.Parameter(a))
        layer.register_parameter(name_b, torch.nn.Parameter(
            torch.zeros(*stack, num_experts, out_features, adapter.rank, dtype=dtype, device=device)))


@attrs.frozen(eq=False)
class AdaptedGemm(Stage[ExpertRows, ExpertRows]):
    """``base`` (one of the experts' GEMM stages on expert-grouped rows: ``role`` and ``apply_routing_weights`` say
    which GEMM and whether its epilogue applies the routing weights) plus ``scale · (x Aᵀ) Bᵀ`` of its rows ``x``
    (see the module docstring)."""

    kinds: ClassVar = (StageKind.GEMM,)
    base: Stage[ExpertRows, ExpertRows]
    lora_a: TensorSource  # [E, r, K] or [1, r, K]; a stack of L adapters: [L, E | 1, r, K]
    lora_b: TensorSource  # [E, N, r]; a stack: [L, E, N, r]
    scale: float

    def __attrs_post_init__(self) -> None:
        if tuple(self.base.kinds) != (StageKind.GEMM,) or not isinstance(getattr(self.base, "role", None), GemmRole) \
                or not isinstance(getattr(self.base, "apply_routing_weights", None), bool):
            raise InputError(f"an adapter wraps one of the experts' GEMM stages (its role and whether it applies the "
                             f"routing weights known), got {self.base.summary()}")

    @property
    def role(self) -> GemmRole:
        role: GemmRole = getattr(self.base, "role")
        return role

    @property
    def apply_routing_weights(self) -> bool:
        return bool(getattr(self.base, "apply_routing_weights"))

    @property
    def stack(self) -> int:
        """Adapters in the stack the rows choose from by their ``adapter_ids``; 0 for one adapter for every row."""
        b = resolve(self.lora_b)
        return int(b.shape[0]) if b.dim() == 4 else 0

    def summary(self) -> str:
        stack = f", {self.stack} adapters" if self.stack else ""
        return f"{self.base.summary()[:-1]}, LoRA r={int(resolve(self.lora_b).shape[-1])} x{self.scale:g}{stack})"

    def accepts(self) -> Accepts:
        # The base's rows: float ones, or 8-bit ones with their scales (the update reads them dequantized); NVFP4 rows
        # are dequantized with a global scale the rows do not carry. Not in slot order: a shared A multiplies every row
        # with a torch GEMM whose weight gradient sums them all (Spec.slot_order).
        accepts = attrs.evolve(self.base.accepts(), slot_order=False)
        if accepts.dtype is None:
            return accepts
        return attrs.evolve(accepts, dtype=accepts.dtype - {DType.NVFP4})

    def hint(self, field: str, have: object) -> Optional[str]:
        if field == "dtype":
            return ("an adapter's update reads the GEMM's rows as floats, and NVFP4 rows carry no global scale: "
                    "dispatch the rows in the layer's dtype (dispatch_dtype='bf16')")
        return self.base.hint(field, have)

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if found:
            return found
        a, b = resolve(self.lora_a), resolve(self.lora_b)
        experts, in_features = spec.num_experts, spec.width
        out_features = self.product_width(spec)
        if a.dim() == 4 and b.dim() == 4 and a.shape[0] == b.shape[0]:  # a stack: each adapter as one
            a, b = a[0], b[0]
        if a.dim() != 3 or a.shape[0] not in (1, experts) or a.shape[2] != in_features:
            found.append(Mismatch("width", tuple(a.shape), f"[{experts} or 1, r, {in_features}]",
                                  "the adapter's A is [experts, rank, in_features] (one expert when shared)"))
        if b.dim() != 3 or tuple(b.shape[:2]) != (experts, out_features) or (a.dim() == 3 and b.shape[2] != a.shape[1]):
            found.append(Mismatch("width", tuple(b.shape), f"[{experts}, {out_features}, r]",
                                  "the adapter's B is [experts, out_features, rank], the rank of its A"))
        return found

    def product_width(self, spec: Spec) -> int:
        """The width of the base GEMM's product, to which the update is added (``B``'s rows)."""
        return self.base.output_spec(spec).width

    def output_spec(self, spec: Spec) -> Spec:
        return self.base.output_spec(spec)

    def __call__(self, x: ExpertRows) -> ExpertRows:
        out = self.base(x)
        a, b = resolve(self.lora_a), resolve(self.lora_b)
        dtype = out.x.data.dtype
        if not self.stack:
            return out.with_x(Activations(out.x.data + self.scale * self._update(x, a, b, dtype)))
        ids = stack_ids(x, self.stack, self.name)
        update = out.x.data.new_zeros(out.x.data.shape)
        for index in range(self.stack):  # each adapter on every row, kept where the row chose it (the reference)
            chosen = (ids == index).unsqueeze(-1)
            update = update + torch.where(chosen, self._update(x, a[index], b[index], dtype), 0)
        outside = ((ids < -1) | (ids >= self.stack)).unsqueeze(-1)  # see stack_ids
        update = torch.where(outside, float("nan"), update)
        return out.with_x(Activations(out.x.data + self.scale * update))

    def _update(self, x: ExpertRows, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(x Aᵀ) Bᵀ`` of one adapter (``A [E | 1, r, K]``, ``B [E, N, r]``) on the rows (quantized ones
        dequantized), with the routing weights where the base's epilogue applies them."""
        if a.shape[0] == 1 and b.shape[0] > 1:
            a = a.expand(b.shape[0], -1, -1)
        x = float_rows(x, a.dtype)
        low = expert_rows_gemm(x, a, None, False, dtype, self.name)
        update: torch.Tensor = expert_rows_gemm(low, b, None, self.apply_routing_weights, dtype, self.name).x.data
        return update


def float_rows(x: ExpertRows, dtype: torch.dtype) -> Any:
    """``x`` with its rows in ``dtype``: 8-bit rows (FP8 / INT8 with their scales) dequantized, float rows as they are
    (cast to ``dtype``)."""
    if x.x.scale is None and x.x.data.dtype == dtype:
        return x
    return x.with_x(Activations(dequantize(x.x, dtype)))


def stack_ids(x: ExpertRows, stack: int, where: str) -> torch.Tensor:
    """The rows' adapter ids (``x.adapter_ids``, in the rows' layout) for a stack of ``stack`` adapters; a clear error
    where the forward was given none. An id outside ``[-1, stack)`` cannot be refused on the device without waiting for
    it (the layer refuses it where that costs nothing: CPU ids, debug mode): the stages give its rows NaN instead, and
    never read outside the stack."""
    if x.adapter_ids is None:
        raise InputError(f"{where}: the layer's adapter is a stack of {stack}: pass each token's adapter "
                         "(forward(..., adapter_ids=ids [tokens], -1 for none))")
    return x.adapter_ids


# The longest K-loop (the base GEMM's input width) over which one adapter's ``· Bᵀ`` runs inside the base GEMM's
# launch: compiled in, that K-step costs each tile more than the launches and the [copies, N] pass it saves, except
# where the K-loops are short (the measurements: docs/notes/kernels-log.md, "One adapter's update inside the base
# GEMM: only over short K-loops").
FUSED_UPDATE_MAX_K = 2048

# A served stack's ``x Aᵀ`` is taken copy by copy (:mod:`moeforge.kernels.stack_shrink`), its ``· Bᵀ`` a K-step per
# adapter a tile's rows chose inside the base GEMM's launch, for at most ``STACK_SHRINK_MAX_COPIES`` copies and, over a
# K-loop longer than ``FUSED_UPDATE_MAX_K``, at most ``FUSED_STACK_MAX_COPIES`` (where the base GEMM is bound by reading
# its weights, those K-steps cost less than the alternative); elsewhere every adapter's columns at once
# (:mod:`moeforge.kernels.stack_wide`, then K-steps of several adapters a tile): measured on an H200
# (docs/notes/kernels-log.md, "The served stack at few copies" and "Every adapter's columns at once").
FUSED_STACK_MAX_COPIES = 512
STACK_SHRINK_MAX_COPIES = 2048
# Copy by copy, ``x Aᵀ`` comes in fp32 parts, one per range of K. Over a K-loop at most this long the base GEMM's launch
# sums them as its tiles load them (few ranges: one launch fewer per GEMM); over a longer one, split into many ranges
# that each of the GEMM's column tiles would sum again, a launch of their own does (docs/notes/kernels-log.md, "The
# served stack's adapter loop, read at the source").
STACK_PARTS_MAX_K = 2048


def stack_update_fuses(k_dim: int, copies: int) -> bool:
    """Whether a served stack's ``· Bᵀ`` by its tiles' chosen adapters pays inside the base GEMM's launch (see
    ``FUSED_STACK_MAX_COPIES``)."""
    return k_dim <= FUSED_UPDATE_MAX_K or copies <= FUSED_STACK_MAX_COPIES


@attrs.frozen(eq=False)
class AdaptedGroupedGemm(AdaptedGemm):
    """``base``, a triton GEMM on block-aligned rows (:class:`~moeforge.stages.triton.FusedGroupedGemm`, or
    :class:`~moeforge.stages.triton_quant.FusedQuantGroupedGemm` reading float rows), plus ``scale · (x Aᵀ) Bᵀ``
    between its product and its epilogue. One adapter: ``x Aᵀ`` as a launch of the grouped-GEMM kernel on the same
    alignment (``[copies, r]``; with one shared ``A``, one matmul of the rows before they are copied), then, where the
    base's K-loop is short (``K <= FUSED_UPDATE_MAX_K``), the base's own launch with ``· Bᵀ`` as one more K-step of
    its product (``base.run`` with a :class:`~moeforge.kernels.grouped_gemm_call.GemmUpdate`): its epilogue
    (activation, routing weights, output quantization) then covers the update, and no ``[copies, N]`` update is
    written or added; over a longer K-loop, ``· Bᵀ`` as a launch of its own whose ``[copies, N]`` output is added to
    the base's product before ``base.activate`` (see ``FUSED_UPDATE_MAX_K``). A served stack (no backward recorded),
    its ``· Bᵀ`` always inside the base's launch: to few copies (at most ``STACK_SHRINK_MAX_COPIES``, each copy's expert
    known; over a long K-loop at most ``FUSED_STACK_MAX_COPIES``: :func:`stack_update_fuses`), each copy's ``x Aᵀ`` by
    its own adapter, copy by copy over ranges of K (:mod:`moeforge.kernels.stack_shrink`), then ``· Bᵀ`` as a K-step
    per adapter the tile's rows chose (:class:`~moeforge.kernels.grouped_gemm_call.GemmUpdate` with ``ids``), which
    sums the ranges as it loads them over a short K-loop (``STACK_PARTS_MAX_K``; a launch of their own over a longer
    one); to more copies, each copy's ``x Aᵀ`` by every adapter of the stack on the base's alignment, kept in its own
    adapter's columns (:mod:`moeforge.kernels.stack_wide`), then ``· Bᵀ`` of every adapter's columns as more K-steps
    on every tile, several adapters a step (``GemmUpdate`` of ``[copies, S·r]`` rows). A batch-invariant layer's stack takes one path
    at every batch size (the paths round differently): the copies aligned again by (adapter, expert) pair, ``x Aᵀ``
    on that alignment, then ``· Bᵀ`` inside the base's launch where its K-loop is short, a K-step per chosen adapter;
    and that path's launches of their own serve a stack that records a backward (training) and a batch-invariant
    stack over a long K-loop: ``base.pre_activation``, ``· Bᵀ`` on the pair alignment, the sum, then
    ``base.activate``. The rows,
    ``A`` and ``B`` differentiate through the kernels' backward (:mod:`moeforge.kernels.backward`)."""

    # The two products' launches by the alignment's block_m, made when built (a forward creates no record: Dynamo
    # cannot trace a frozen attrs class's __init__, so torch.compile traces a lookup instead).
    _launches: dict[int, tuple[GemmConfig, GemmConfig]] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        base = self.base
        if not (callable(getattr(base, "pre_activation", None)) and callable(getattr(base, "activate", None))
                and callable(getattr(base, "run", None)) and isinstance(getattr(base, "role", None), GemmRole)
                and isinstance(getattr(base, "apply_routing_weights", None), bool)):
            raise InputError(f"a triton adapter wraps a GEMM stage that can run with a low-rank update and without its "
                             f"activation (run, pre_activation, activate), got {base.summary()}")
        if getattr(base, "activation", None) is not None and self.apply_routing_weights:
            raise InputError(f"{base.summary()} applies the routing weights after its activation: the adapter's update "
                             "comes before it")
        configs = getattr(base, "configs", None)
        if configs is not None:
            for block_m in configs.block_ms():
                self._launches[block_m] = self._plan(block_m)

    def _plan(self, block_m: int) -> tuple[GemmConfig, GemmConfig]:
        """The launches of ``x Aᵀ`` and ``· Bᵀ`` on rows aligned by ``block_m``: tiles of the rank's width
        (:func:`~moeforge.kernels.config.narrow_config`); in a batch-invariant layer (:mod:`moeforge.batch_invariant`)
        never a split K-loop."""
        a, b = resolve(self.lora_a), resolve(self.lora_b)
        rank, out_features, in_features = int(b.shape[-1]), int(b.shape[-2]), int(a.shape[-1])
        launches = (narrow_config(block_m, rank, in_features), narrow_config(block_m, out_features, rank))
        if self._invariant():
            launches = (attrs.evolve(launches[0], split_k=1), attrs.evolve(launches[1], split_k=1))
        return launches

    def _invariant(self) -> bool:
        return bool(getattr(getattr(self.base, "configs", None), "batch_invariant", False))

    @property
    def kinds(self) -> tuple[StageKind, ...]:  # type: ignore[override]
        return tuple(self.base.kinds)

    def product_width(self, spec: Spec) -> int:
        width = self.base.output_spec(spec).width  # after a fused gated activation: half the product
        activation = getattr(self.base, "activation", None)
        return 2 * width if activation is not None and activation.gated else width

    def __call__(self, x: ExpertRows) -> ExpertRows:
        assert isinstance(x, AlignedRows)
        base: Any = self.base
        a, b = resolve(self.lora_a), resolve(self.lora_b)
        alignment = x.alignment
        rows = float_rows(x, a.dtype).x.data  # quantized rows (W8A8) dequantized: the update reads them as floats
        rows_per_a = 1 if x.copy_major else alignment.copies_per_row
        planned = self._launches.get(alignment.block_m)
        a_launch, b_launch = planned if planned is not None else self._plan(alignment.block_m)
        route = alignment.route()
        if not self.stack and rows.shape[-1] <= FUSED_UPDATE_MAX_K:
            # x Aᵀ by its own launch, then · Bᵀ inside the base GEMM's launch: one more K-step of its product, before
            # its epilogue (activation, routing weights, output quantization) and in its backward. Where the base's
            # rows are the update's own (float) and A is per expert, x Aᵀ records no gradient and the base's backward
            # differentiates it (A's gradient, and x's through A added in the base's row-gradient launch:
            # GemmUpdate.source), else x Aᵀ's own launch has its backward.
            through_base = (a.shape[0] != 1 and rows is x.x.data and a.dtype == b.dtype
                            and int(b.shape[1]) <= FUSED_UPDATE_MAX_K and records_grad(rows, a))
            with torch.no_grad() if through_base else contextlib.nullcontext():
                low = self._low(route, a, rows, rows_per_a, b.dtype, a_launch)
            fused: AlignedRows = base.run(x, GemmUpdate(low, b, self.scale, source=a if through_base else None))
            return fused
        base_tensors = [resolve(t) for t in (getattr(base, "weight", None), getattr(base, "bias", None))
                        if t is not None]
        serving = bool(self.stack) and not records_grad(x.x.data, a, b, *base_tensors)  # (the op has no backward)
        # A batch-invariant layer takes one path at every batch size (the paths round differently): the pair path,
        # · Bᵀ inside the base launch by the K-loop's length alone.
        invariant = self._invariant()
        if serving and not invariant:
            from moeforge.stages.triton import kernel_ops

            ids = stack_ids(x, self.stack, self.name).contiguous()
            if (x.copy_experts is not None and alignment.num_copies <= STACK_SHRINK_MAX_COPIES
                    and stack_update_fuses(rows.shape[-1], alignment.num_copies)):
                # few copies: each copy's x Aᵀ by its own adapter, copy by copy (no second alignment), then · Bᵀ of
                # each copy's adapter inside the base GEMM's launch (a K-step per adapter its tile's rows chose)
                parts = kernel_ops().stack_shrink(rows, a, ids, x.copy_experts, rows_per_a)
                if rows.shape[-1] <= STACK_PARTS_MAX_K:  # the base launch sums the parts (see STACK_PARTS_MAX_K)
                    by_copy = GemmUpdate(parts, b, self.scale, ids=ids)
                else:
                    low, chosen = kernel_ops().stack_reduce(parts, ids, self.stack, self.scale, b.dtype)
                    by_copy = GemmUpdate(low, b, 1.0, ids=chosen)
                shrunk: AlignedRows = base.run(x, by_copy)
                return shrunk
            # many copies: each copy's x Aᵀ by every adapter on the base's alignment (its own adapter's columns kept,
            # weighed), then · Bᵀ of every adapter's columns inside the base GEMM's launch (K-steps of several
            # adapters a tile)
            wide = kernel_ops().stack_wide(rows, a, ids, alignment.sorted_ids, alignment.block_expert,
                                           alignment.num_padded, alignment.block_m, alignment.num_copies, rows_per_a,
                                           self.scale, b.dtype)
            every: AlignedRows = base.run(x, GemmUpdate(wide, b))
            return every
        fused_stack = serving and rows.shape[-1] <= FUSED_UPDATE_MAX_K  # (a batch-invariant layer's, served)
        if fused_stack:
            # a batch-invariant layer serving a stack: each copy's x Aᵀ on the pair alignment, then · Bᵀ of each copy's
            # adapter inside the base GEMM's launch (a K-step per adapter its tile's rows chose)
            low, rows_per_low, stacked = self._stack_low(x, a, int(b.shape[1]), rows, rows_per_a, b.dtype, a_launch)
            low = low.repeat_interleave(rows_per_low, 0) if rows_per_low > 1 else low  # (an update row per copy)
            served: AlignedRows = base.run(x, GemmUpdate(low, b, 1.0, ids=stacked.chosen))
            return dataclasses.replace(served, stack_alignment=stacked)
        product = base.pre_activation(x)
        dtype = product.x.data.dtype
        pairs: Optional[StackAlignment] = None
        if self.stack:
            update, pairs = self._stack_update(x, a, b, rows, rows_per_a, dtype, a_launch, b_launch)
        else:
            low = self._low(route, a, rows, rows_per_a, dtype, a_launch)
            update, _ = grouped_gemm(
                GemmRows(low * self.scale if self.scale != 1.0 else low), GemmWeight(b), route,
                GemmEpilogue(dtype, routing_weights=x.copy_weights if self.apply_routing_weights else None), b_launch)
        # Where nothing is recorded for a backward, the update is added in place (no third [copies, N] buffer).
        summed = product.x.data + update if torch.is_grad_enabled() else product.x.data.add_(update)
        out: AlignedRows = base.activate(dataclasses.replace(product, x=Activations(summed)))
        return dataclasses.replace(out, stack_alignment=pairs) if pairs is not None else out

    def _low(self, route: GemmRoute, a: torch.Tensor, rows: torch.Tensor, rows_per_a: int, dtype: torch.dtype,
             a_launch: GemmConfig) -> torch.Tensor:
        """``x Aᵀ`` of one adapter for each copy of ``route`` (``[copies, r]``, copy order, contiguous)."""
        if a.shape[0] == 1:  # one A for every expert: one product per row, before the rows are copied
            # (a batch-invariant layer's through the one-expert kernel: no library GEMM choosing by shape)
            if self._invariant():
                from moeforge.batch_invariant import linear

                low = linear(rows, a[0])
            else:
                low = rows @ a[0].t()
            return low.to(dtype).repeat_interleave(rows_per_a, 0) if rows_per_a > 1 else low.to(dtype).contiguous()
        low, _ = grouped_gemm(GemmRows(rows, rows_per_a=rows_per_a), GemmWeight(a), route, GemmEpilogue(dtype),
                              a_launch)
        return low

    def _stack_update(self, x: AlignedRows, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, rows_per_a: int,
                      dtype: torch.dtype, a_launch: GemmConfig, b_launch: GemmConfig
                      ) -> tuple[torch.Tensor, StackAlignment]:
        """The update of a stack of adapters, each copy by its own: :meth:`_stack_low`, then ``· Bᵀ`` on the pair
        alignment (the stack's ``B`` viewed as ``count · E`` experts' matrices; one row per copy, in copy order).
        Returns the update and the pair alignment."""
        low, rows_per_low, pairs = self._stack_low(x, a, int(b.shape[1]), rows, rows_per_a, dtype, a_launch)
        route = GemmRoute(pairs.sorted_ids, pairs.block_expert, pairs.num_padded, x.alignment.num_copies,
                          aligned_block_m=x.alignment.block_m)
        update, _ = grouped_gemm(
            GemmRows(low, rows_per_a=rows_per_low), GemmWeight(b.reshape(-1, b.shape[2], b.shape[3])), route,
            GemmEpilogue(dtype, routing_weights=x.copy_weights if self.apply_routing_weights else None), b_launch)
        return update, pairs

    def _stack_low(self, x: AlignedRows, a: torch.Tensor, experts: int, rows: torch.Tensor, rows_per_a: int,
                   dtype: torch.dtype, a_launch: GemmConfig) -> tuple[torch.Tensor, int, StackAlignment]:
        """``(low, rows_per_low, pairs)``: each copy's ``x Aᵀ`` by its own adapter (``[copies, r]``, copy order,
        scaled by the adapters' scale, zero for a copy of no adapter, ``-1``; with a shared ``A``, which multiplies
        each row once, its rows aligned by adapter, one row per token: copy ``c``'s is row ``c // rows_per_low``), the
        copies aligned again by (adapter, expert) pairs, the stack's ``A`` viewed as ``count · E`` experts' matrices
        (``pairs.chosen``: each copy's adapter, in the stack). The layer's other adapted GEMM reuses the pairs
        (``AlignedRows.stack_alignment``)."""
        from moeforge.stages.triton import kernel_ops

        alignment = x.alignment
        stack = int(a.shape[0])
        pairs = x.stack_alignment
        if pairs is None or pairs.stack != stack:  # the first adapted GEMM aligns; the second reuses it
            # each copy's pair key, adapter and product weight (an id outside the stack: its rows NaN, see stack_ids)
            keys, chosen, used = kernel_ops().stack_pairs(
                stack_ids(x, self.stack, self.name), x.copy_experts, alignment.sorted_ids, alignment.block_expert,
                alignment.num_padded, alignment.block_m, stack, experts, self.scale)  # (the scale in the weights)
            sorted_ids, block_expert, num_padded = kernel_ops().align_block_size(
                keys.view(-1, alignment.copies_per_row), stack * experts, alignment.block_m, torch.is_grad_enabled())
            pairs = StackAlignment(sorted_ids, block_expert, num_padded, stack, chosen, used)
        chosen, used = pairs.chosen, pairs.used
        route = GemmRoute(pairs.sorted_ids, pairs.block_expert, pairs.num_padded, alignment.num_copies,
                          aligned_block_m=alignment.block_m)
        if a.shape[1] == 1:  # one A per adapter for every expert: each row once, the rows aligned by adapter
            row_ids = chosen.view(-1, rows_per_a)[:, 0].contiguous()
            row_sorted, row_blocks, row_padded = kernel_ops().align_block_size(
                row_ids.view(-1, 1), stack, alignment.block_m, torch.is_grad_enabled())
            low, _ = grouped_gemm(GemmRows(rows), GemmWeight(a.reshape(stack, a.shape[2], a.shape[3])),
                                  GemmRoute(row_sorted, row_blocks, row_padded, rows.shape[0],
                                            aligned_block_m=alignment.block_m),
                                  GemmEpilogue(dtype, routing_weights=used.view(-1, rows_per_a)[:, 0].contiguous()),
                                  a_launch)
            return low, rows_per_a, pairs
        low, _ = grouped_gemm(GemmRows(rows, rows_per_a=rows_per_a),
                              GemmWeight(a.reshape(stack * experts, a.shape[2], a.shape[3])), route,
                              GemmEpilogue(dtype, routing_weights=used), a_launch)
        return low, 1, pairs


def adapt(stages: Sequence[Stage[Any, Any]], holder: torch.nn.Module, adapter: ExpertAdapter) -> list[Stage[Any, Any]]:
    """``stages`` with each GEMM that ``adapter`` targets wrapped in an :class:`AdaptedGemm` (a torch GEMM) or an
    :class:`AdaptedGroupedGemm` (a triton GEMM on block-aligned rows) reading ``holder``'s adapter parameters. Raises
    :class:`~moeforge.errors.InputError` naming a targeted GEMM it cannot wrap: one that reads NVFP4 rows only, a
    torch GEMM fused with the activation (the update must come before it), another kernel stage."""
    adapted: list[Stage[Any, Any]] = []
    found: set[GemmRole] = set()
    for stage in stages:
        if isinstance(stage, AlignDispatch) and stage.slot_rows is not False:
            # The block-aligned dispatch keeps the rows in copy order: the adapted GEMMs refuse rows in slot order
            # (AdaptedGroupedGemm.accepts, Spec.slot_order).
            stage = attrs.evolve(stage, slot_rows=False)
        role = getattr(stage, "role", None)
        if StageKind.GEMM in stage.kinds and role in adapter.targets:
            dtypes = stage.accepts().dtype
            if dtypes is not None and not dtypes - {DType.NVFP4}:
                raise InputError(f"an expert adapter reads the {role.value} GEMM's rows as floats, and "
                                 f"{stage.summary()} reads NVFP4 rows only, whose global scale the rows do not carry: "
                                 "dispatch the rows in the layer's dtype")
            name_a, name_b = ADAPTER_NAMES[role]
            ref_a, ref_b = ParamRef(holder, name_a), ParamRef(holder, name_b)
            if callable(getattr(stage, "pre_activation", None)):
                stage = AdaptedGroupedGemm(stage, ref_a, ref_b, adapter.scale)
            elif tuple(stage.kinds) != (StageKind.GEMM,) or Layout.BLOCK_ALIGNED in (stage.accepts().layout or ()):
                raise InputError(f"an expert adapter on the {role.value} GEMM adds its update to that GEMM's rows; "
                                 f"this pipeline's is {stage.summary()}, which takes none: build the layer with "
                                 "backend='torch'")
            else:
                stage = AdaptedGemm(stage, ref_a, ref_b, adapter.scale)
            found.add(role)
        adapted.append(stage)
    missing = adapter.targets - found
    if missing:
        raise InputError(f"the expert adapter targets {sorted(role.value for role in missing)} but the pipeline has no "
                         "such GEMM stage")
    return adapted
