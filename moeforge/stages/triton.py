"""The Triton path: routing, block alignment, fused grouped GEMMs and combine on the device.

These stages speak the same specs as the torch reference stages, so the contract checker treats them
alike. The dispatch computes a ``BLOCK_ALIGNED`` plan and the first GEMM gathers its input rows by index;
it moves rows only for a training step's slot order and for routing weights applied on the input. The first
GEMM can fuse the activation (then it covers the ``gemm`` and ``activation`` kinds). Kernels run through the
``moeforge::`` custom ops (``torch.compile`` and CUDA graphs work), the grouped GEMMs through the op's one caller,
:func:`moeforge.kernels.grouped_gemm_call.grouped_gemm`; the ops module is imported when a stage is built, so
``import moeforge`` needs no Triton.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, ClassVar, Optional

import attrs
import torch

from moeforge.errors import BackendUnavailableError, InputError
from moeforge.kernels.config import ConfigTable, GemmConfig
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRows, GemmUpdate, GemmWeight,
                                                grouped_gemm)
from moeforge.no_backward import records_grad
from moeforge.payloads import (Activations, AlignedRows, BlockAlignment, GatheredRows, MoEInput, Plan, RoutedTokens,
                               TopKOutput)
from moeforge.spec import (
    Accepts,
    DType,
    ExpertIds,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
)
from moeforge.stage import JoinedRun, Mismatch, Stage, StageKind
from moeforge.stages.activation import ActivationConfig, GateUpLayout
from moeforge.stages import slot_order
from moeforge.stages.dispatch import (scale_rows, scaled_copy_rows, weights_on_input_accepts,
                                      weights_on_input_hint)
from moeforge.stages.gemm import GemmRole, expert_gemm_accepts
from moeforge.stages.topk import RoutingConfig, TopK
from moeforge.tensor_ref import TensorSource, resolve

KERNEL_DTYPES = frozenset({DType.BF16, DType.FP16, DType.FP32})


def kernel_ops() -> ModuleType:
    """The module registering the ``moeforge::`` custom ops (imports Triton)."""
    try:
        from moeforge.kernels import ops
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise BackendUnavailableError(f"the triton backend needs the 'triton' package: {error}") from error
    return ops


def act_code(config: ActivationConfig) -> int:
    from moeforge.kernels.activations import code_of

    return code_of(config)


@attrs.frozen(eq=False)
class TritonTopK(TopK):
    """:class:`~moeforge.stages.topk.TopK` computed by one Triton kernel (same semantics).

    The kernel covers every :class:`~moeforge.RoutingConfig` except the sparsemixer routing; see
    :meth:`supports` (building one for an unsupported config is an :class:`~moeforge.InputError`)."""

    _flags: dict[str, Any] = attrs.field(init=False, factory=dict)

    @classmethod
    def supports(cls, config: RoutingConfig) -> bool:
        """Whether the kernel computes ``config`` (else use the torch :class:`TopK`)."""
        return config.sparsemixer_eps is None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not self.supports(self.config):
            raise InputError(f"{self.summary()}: the Triton routing kernel cannot compute this routing; "
                             "use the torch TopK stage")
        from moeforge.kernels.topk import routing_flags

        kernel_ops()
        self._flags.update(routing_flags(self.config))

    def summary(self) -> str:
        return "Triton" + super().summary()

    def accepts(self) -> Accepts:
        # The kernel routes in fp32: a float64 layer routes (in fp64) with the torch TopK.
        return attrs.evolve(super().accepts(), dtype=frozenset(KERNEL_DTYPES))

    def hint(self, field: str, have: object) -> Optional[str]:
        if field == "dtype":
            return "the routing kernel serves bf16, fp16 and fp32 layers: route a float64 layer with TopK (torch)"
        return None

    def __call__(self, x: MoEInput) -> RoutedTokens:
        bias = resolve(self.selection_bias).float() if self.selection_bias is not None else None
        weights, ids = kernel_ops().route(x.router_logits, bias, self.top_k, **self._flags)
        return RoutedTokens(x=Activations(x.hidden_states), topk=TopKOutput(weights=weights, ids=ids),
                            adapter_ids=x.adapter_ids)


@attrs.frozen(eq=False)
class AlignDispatch(Stage[RoutedTokens, AlignedRows]):
    """Block-aligned dispatch on the device, no host synchronisation: no rows move for inference (unless the
    routing weights scale the input, below); where grad mode is on (a training step) the rows are gathered into the
    alignment's slot order where :func:`~moeforge.stages.slot_order.slot_rows_pay` says it pays (``slot_rows``:
    ``True`` / ``False`` always / never there), which the GEMMs and the combine read the same way
    (:mod:`moeforge.stages.slot_order`).

    ``configs`` is the launch-configuration table shared with the GEMMs that follow (they must use the
    ``block_m`` the alignment used). ``apply_routing_weights``: the routing weights scale the expert's input
    (``RoutingWeights.ON_INPUT``, Llama-4): each copy's row is its token's row times the copy's weight
    (:func:`~moeforge.stages.dispatch.scale_rows`, as the torch dispatches round it), one row per copy — the
    token's row itself where ``top_k`` is 1 (float rows only; differentiable in both).
    """

    kinds: ClassVar = (StageKind.DISPATCH,)
    num_experts: int
    configs: ConfigTable
    slot_rows: Optional[bool] = None
    apply_routing_weights: bool = False

    def __attrs_post_init__(self) -> None:
        if self.num_experts < 1:
            raise InputError(f"num_experts must be >= 1, got {self.num_experts}")
        kernel_ops()

    def summary(self) -> str:
        slots = {None: ", rows in slot order where a training step pays", True: ", rows in slot order in training",
                 False: ""}[self.slot_rows]
        weights = ", weights on input" if self.apply_routing_weights else ""
        return f"AlignDispatch(triton, block-aligned{slots}{weights})"

    def accepts(self) -> Accepts:
        if self.apply_routing_weights:
            return weights_on_input_accepts(self.num_experts, KERNEL_DTYPES)
        # The plan moves no rows: quantized tokens and their scales pass through untouched (the
        # GEMMs after it say which formats they take).
        return Accepts(kind=PayloadKind.ROUTED, num_experts=self.num_experts,
                       dtype=KERNEL_DTYPES | {DType.FP8_E4M3, DType.INT8, DType.NVFP4},
                       scale_layout={ScaleLayout.NONE, ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128,
                                     ScaleLayout.PER_TENSOR, ScaleLayout.NVFP4_BLOCK16})

    def output_spec(self, spec: Spec) -> Spec:
        return spec.evolve(kind=PayloadKind.DISPATCHED, layout=Layout.BLOCK_ALIGNED, group_list_type=None,
                           expert_ids=ExpertIds.LOCAL, alignment=self.configs.alignment(),
                           slot_order=self.slot_rows is not False,
                           routing_weights=RoutingWeights.ON_INPUT if self.apply_routing_weights
                           else spec.routing_weights)

    def hint(self, field: str, have: object) -> Optional[str]:
        return weights_on_input_hint(self, field, have) if self.apply_routing_weights else None

    def __call__(self, x: RoutedTokens) -> AlignedRows:
        tokens, top_k = x.topk.ids.shape
        config = self.configs.lookup(tokens)  # once per batch: the GEMMs read it from the alignment
        training = torch.is_grad_enabled()
        sorted_ids, block_expert, num_padded = kernel_ops().align_block_size(
            x.topk.ids, self.num_experts, config.block_m, training)  # ordered where it trains
        alignment = BlockAlignment(sorted_ids=sorted_ids, block_expert=block_expert, num_padded=num_padded,
                                   config=config, copies_per_row=top_k, num_tokens=tokens)
        if training and self.slot_rows is not False and slot_order.slot_rows_apply(x) is None and (
                self.slot_rows or slot_order.slot_rows_pay(tokens * top_k)):
            return self.slot_order_rows(x, alignment)
        # each copy's adapter, in copy order (copy t * top_k + j of token t)
        adapter_ids = x.adapter_ids.repeat_interleave(top_k) if x.adapter_ids is not None else None
        rows, copy_major = x.x, False
        if self.apply_routing_weights:  # one row per copy, in copy order: [T, top_k, H] -> [T * top_k, H]
            rows = Activations(scaled_copy_rows(x.x.data, x.topk.weights))
            copy_major = True
        return AlignedRows(x=rows, alignment=alignment, copy_major=copy_major,
                           copy_weights=x.topk.weights.reshape(-1),
                           plan=AlignedPlan(x.topk.weights), adapter_ids=adapter_ids,
                           copy_experts=x.topk.ids.reshape(-1) if adapter_ids is not None else None)

    def joined(self, following: tuple[Stage[Any, Any], ...]) -> Optional[JoinedRun]:
        """This dispatch and the three stages after it as one unit (:mod:`moeforge.stages.triton_step`: one autograd
        node for a training step, the kernels called directly for inference), where they are the ones it runs as the
        stages run them: the gate/up :class:`FusedGroupedGemm` with its activation and without routing weights, the
        down one without either, and a :class:`~moeforge.stages.combine.Combine` applying the routing weights — or,
        where this dispatch applies them on the input (Llama-4), one that does not — all reading this dispatch's
        table; ``None`` otherwise (and for a dispatch that never takes slot order)."""
        from moeforge.stages.combine import Combine

        if self.slot_rows is False or len(following) < 3:
            return None
        gate_up, down, combine = following[:3]
        if type(gate_up) is not FusedGroupedGemm or type(down) is not FusedGroupedGemm or type(combine) is not Combine:
            return None
        if gate_up.role is not GemmRole.GATE_UP or gate_up._act[0] == 0 or gate_up.apply_routing_weights \
                or down.role is not GemmRole.DOWN or down.activation is not None or down.apply_routing_weights \
                or combine.apply_routing_weights == self.apply_routing_weights or gate_up.configs is not self.configs \
                or down.configs is not self.configs:
            return None
        from moeforge.stages.triton_step import ExpertsStep

        factor = combine.routed_scaling_factor
        return ExpertsStep(self.num_experts, self.configs, self.slot_rows, gate_up.weight, gate_up.bias,
                            gate_up._act, down.weight, down.bias, 1.0 if factor is None else factor,
                            combine.out_dtype.torch_dtype if combine.out_dtype is not None else None,
                            self.apply_routing_weights)

    def slot_order_rows(self, x: RoutedTokens, alignment: BlockAlignment) -> AlignedRows:
        """``x``'s rows gathered into the slot order of ``alignment`` (aligned for ``x``'s copies) as
        :class:`AlignedRows` (:mod:`moeforge.stages.slot_order`): ``x.data [copies, H]``, each expert's copies one
        run, the alignment's ``sorted_ids`` each slot's row, the copies' routing weights in the rows' order, where each
        expert's rows and copies lie, and the plan back to the tokens."""
        tokens, top_k = x.topk.ids.shape
        weights = x.topk.weights.float()
        xs, row_weights, slot_of, row_of_slot, runs = kernel_ops().gather_slots(
            x.x.data, weights.reshape(-1), alignment.sorted_ids, alignment.block_expert, alignment.num_padded, top_k,
            self.num_experts, alignment.block_m)
        rows = BlockAlignment(sorted_ids=row_of_slot, block_expert=alignment.block_expert,
                              num_padded=alignment.num_padded, config=alignment.config, copies_per_row=1,
                              num_tokens=int(xs.shape[0]), slot_copies=tokens * top_k, slot_runs=runs)
        index = slot_of.view(tokens, top_k)
        gathered: Optional[GatheredRows] = GatheredRows(xs, x.x.data, index)
        if self.apply_routing_weights:
            xs, gathered = scale_rows(xs, row_weights), None
        return AlignedRows(x=Activations(xs), alignment=rows, copy_major=True, copy_weights=row_weights,
                           plan=AlignedPlan(weights, index), gathered=gathered)


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class AlignedPlan(Plan):
    """The way back from :class:`AlignDispatch`'s rows: the GEMMs write one row per copy in copy order, so token
    ``t``'s copies are rows ``t * top_k .. t * top_k + top_k - 1`` — or, in slot order
    (:mod:`moeforge.stages.slot_order`), rows ``slot_of[t, j]`` (int32 ``[T, top_k]``); ``copy_weights [T, top_k]``
    (fp32). Summed by the triton combine kernel (fixed order, fp32, no atomics); by index, its backward writes zero
    gradients into any row no copy reads."""

    copy_weights: torch.Tensor
    slot_of: Optional[torch.Tensor] = None

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        top_k = int(self.copy_weights.shape[1])
        out: torch.Tensor = kernel_ops().combine_copies(rows, self.copy_weights if weighted else None, top_k,
                                                       scaling_factor if scaling_factor is not None else 1.0,
                                                       out_dtype, self.slot_of)
        return out

    def kept(self) -> torch.Tensor:
        return torch.ones_like(self.copy_weights, dtype=torch.bool)


@attrs.frozen(eq=False)
class FusedGroupedGemm(Stage[AlignedRows, AlignedRows]):
    """A grouped GEMM on block-aligned rows, optionally with the activation fused in its epilogue.

    ``role=GATE_UP`` with ``activation`` set covers the ``gemm`` and ``activation`` kinds and writes
    the ``I``-wide activated rows; ``role=DOWN`` may multiply by the routing weights in the epilogue.
    Where autograd records the call (grad mode on, rows or weights requiring grad) the activation runs as its own
    op after the GEMM (``moeforge::activate_rows``), which keeps the pre-activation rows for the backward: the
    backward then needs no second GEMM to recompute them.
    """

    role: GemmRole
    weight: TensorSource
    configs: ConfigTable
    bias: Optional[TensorSource] = None
    activation: Optional[ActivationConfig] = None
    apply_routing_weights: bool = False
    _act: tuple[int, bool, bool, float, float] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        shape = tuple(resolve(self.weight).shape)
        if len(shape) != 3:
            raise ValueError(f"FusedGroupedGemm weight must be [E, N, K], got shape {shape}")
        if self.activation is not None and self.role is not GemmRole.GATE_UP:
            raise ValueError("only the gate/up GEMM can fuse the activation")
        if self.activation is not None and self.activation.gated and shape[1] % 2:
            raise ValueError(f"a gated activation needs an even gate/up width, got {shape[1]}")
        kernel_ops()
        object.__setattr__(self, "_act", activation_args(self.activation))  # once, not per call

    @property
    def kinds(self) -> tuple[StageKind, ...]:  # type: ignore[override]
        return (StageKind.GEMM, StageKind.ACTIVATION) if self.activation is not None else (StageKind.GEMM,)

    def summary(self) -> str:
        weight = resolve(self.weight)
        text = f"FusedGroupedGemm(triton, {self.role.value}, {weight.shape[2]}->{weight.shape[1]}"
        if self.activation is not None:
            text += f" + {self.activation.summary()}"
        if self.bias is not None:
            text += ", bias"
        if self.apply_routing_weights:
            text += ", weights in epilogue"
        return text + ")" + self._warp_specialized_summary(weight)

    def _warp_specialized_summary(self, weight: torch.Tensor) -> str:
        """Where the table launches this GEMM as the warp-specialised Gluon kernel, or why it cannot here."""
        tokens = self.configs.warp_specialized_tokens(self.role.value)
        if not tokens:
            return ""
        from moeforge.kernels import warp_specialized

        act, glu, interleaved = self._act[:3]
        problem = warp_specialized.stage_problem(weight.device, weight.dtype, act, glu, interleaved,
                                                 self.bias is not None)
        where = f"the table's M = {', '.join(map(str, tokens))}"
        if problem is not None:
            return f" [warp-specialised Gluon kernel at {where} skipped: {problem}]"
        # (a training forward runs the gate/up GEMM unfused, with moe_gemm: GemmConfig.unfused_gate_up)
        return f" [warp-specialised Gluon kernel at {where}{' without autograd' if glu else ''}]"

    def accepts(self) -> Accepts:
        weight = resolve(self.weight)
        return expert_gemm_accepts(self.role, dtypes=KERNEL_DTYPES, scales=ScaleLayout.NONE,
                                   in_features=int(weight.shape[2]), num_experts=int(weight.shape[0]),
                                   apply_routing_weights=self.apply_routing_weights, layouts=Layout.BLOCK_ALIGNED,
                                   alignment=self.configs.alignment(), slot_order=True)

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        if spec.dtype is not DType.from_torch(resolve(self.weight).dtype) and spec.dtype in KERNEL_DTYPES:
            found.append(Mismatch("dtype", spec.dtype, resolve(self.weight).dtype,
                                  "the triton GEMM needs activations in the weights' dtype"))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        out_width = int(resolve(self.weight).shape[1])
        if self.activation is not None and self.activation.gated:
            out_width //= 2
        return spec.evolve(
            kind=PayloadKind.EXPERT_HIDDEN if self.role is GemmRole.GATE_UP else PayloadKind.EXPERT_OUTPUT,
            width=out_width,
            routing_weights=RoutingWeights.IN_GEMM_EPILOGUE if self.apply_routing_weights
            else spec.routing_weights,
        )

    def __call__(self, x: AlignedRows) -> AlignedRows:
        return self.run(x)

    def run(self, x: AlignedRows, update: Optional[GemmUpdate] = None) -> AlignedRows:
        """The forward, with ``update`` (a low-rank update, an adapter's: :mod:`moeforge.adapters`) added to the
        product before the epilogue where given."""
        # Training: the activation runs as its own op, which keeps the pre-activation rows for the backward
        # (no second GEMM there); inference fuses it in the epilogue.
        weight = resolve(self.weight)
        bias = resolve(self.bias) if self.bias is not None else None
        config = x.alignment.config  # chosen by the dispatch for this batch; the spec checked the tables agree
        if self._act[0] != 0 and not self.apply_routing_weights and records_grad(
                x.x.data, weight, bias, *((update.rows, update.weight) if update is not None else ())):
            gemm = config.gate_up_apart(self._act[1])
            return self.activate(self._launch(x, gemm, _NO_ACTIVATION, weight, bias, update))
        return self._launch(x, config.gate_up if self.role is GemmRole.GATE_UP else config.down, self._act, weight,
                            bias, update)

    def pre_activation(self, x: AlignedRows) -> AlignedRows:
        """The GEMM with its bias (and the routing weights where its epilogue applies them) but without its
        activation: ``[copies, N_w]`` rows, one per copy. :meth:`activate` finishes the forward; a training forward
        and an adapter (:mod:`moeforge.adapters`, which adds its update in between) call the two."""
        if self._act[0] != 0 and self.apply_routing_weights:
            raise ValueError(f"{self.summary()}: the routing weights come after the activation")
        config = x.alignment.config
        gemm = config.down if self.role is GemmRole.DOWN else config.gate_up_apart(self._act[1])
        return self._launch(x, gemm, _NO_ACTIVATION, resolve(self.weight),
                            resolve(self.bias) if self.bias is not None else None)

    def activate(self, rows: AlignedRows) -> AlignedRows:
        """The activation of :meth:`pre_activation`'s rows as its own op (``moeforge::activate_rows``, which keeps
        the pre-activation rows for its backward); the rows themselves without an activation."""
        if self._act[0] == 0:
            return rows
        return dataclasses.replace(rows, x=Activations(kernel_ops().activate_rows(rows.x.data, *self._act)))

    def _launch(self, x: AlignedRows, gemm: GemmConfig, act_args: tuple[int, bool, bool, float, float],
                weight: torch.Tensor, bias: Optional[torch.Tensor], update: Optional[GemmUpdate] = None
                ) -> AlignedRows:
        alignment = x.alignment
        act, glu, interleaved, alpha, limit = act_args
        # slot-order rows straight from the dispatch's gather: their gradient is summed into the token rows' here
        gathered = x.gathered if x.gathered is not None and x.gathered.rows is x.x.data else None
        out, _ = grouped_gemm(
            GemmRows(x.x.data, rows_per_a=1 if x.copy_major else alignment.copies_per_row,
                     gathered_from=gathered.tokens if gathered is not None else None,
                     gathered_index=gathered.index if gathered is not None else None),
            GemmWeight(weight),
            alignment.route(),
            GemmEpilogue(x.x.data.dtype, bias=bias,
                         routing_weights=x.copy_weights if self.apply_routing_weights else None, act=act, glu=glu,
                         interleaved=interleaved, alpha=alpha, limit=limit),
            gemm, update,
        )
        return dataclasses.replace(x, x=Activations(out), copy_major=True, gathered=None)


_NO_ACTIVATION = (0, False, False, 1.0, 0.0)  # activation_args(None)


def activation_args(config: Optional[ActivationConfig]) -> tuple[int, bool, bool, float, float]:
    """The kernels' activation arguments ``(code, glu, interleaved, alpha, limit)`` (the last two
    :func:`~moeforge.kernels.activations.parameters_of`; no activation: code 0, the identity)."""
    if config is None:
        return _NO_ACTIVATION
    from moeforge.kernels.activations import code_of, parameters_of

    return (code_of(config), config.gated, config.gate_up is GateUpLayout.INTERLEAVED, *parameters_of(config))
