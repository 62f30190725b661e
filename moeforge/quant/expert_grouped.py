"""``apply_without_routing_weights`` for every quant method, from the method's own expert stages.

NPU-style and fused expert-parallel backends hand a quant method rows that are already grouped by
expert and combine the result themselves. :func:`apply_expert_stages` answers them with the same
computation the layer's forward runs: the method's torch :class:`~moeforge.roles.Experts` stages
(those :meth:`~moeforge.QuantMethod.expert_stages` returns for ``Backend.TORCH``), checked by the
contract checker against a spec made from the arguments, run without routing weights. A method
overrides :meth:`~moeforge.QuantMethod.apply_without_routing_weights` only where it has a fused kernel
of its own (W4A4 on NPUs).

The arguments follow the NPU convention: ``hidden_states`` ``[R, W]`` grouped by local expert with
``group_list`` ``[E]`` as counts (``group_list_type`` 1) or cumulative sums (0), or padded
``[E, C, W]`` with ``group_list`` = valid rows per expert (counts). Float rows come without a scale;
rows in one of the method's quantized formats (FP8, INT8, packed NVFP4) come with the scale its
quantizer produces. Every bad argument is an :class:`~moeforge.errors.InputError` naming it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import attrs
import torch

from moeforge.backend import Backend
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.errors import ContractError, InputError
from moeforge.payloads import Activations, ExpertRows, PaddedRows, Plan, SortedRows, scale_dtype, scale_shape
from moeforge.pipeline import validate
from moeforge.expert_weights import layer_compute_dtype
from moeforge.spec import (
    DType,
    ExpertIds,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    Spec,
)
from moeforge.stage import Stage, StageKind

_FLOAT_DISPATCH = {DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32}


class GroupedMethod(Protocol):
    """What :func:`apply_expert_stages` asks of a quant method (:class:`~moeforge.QuantMethod` has it all)."""

    @property
    def name(self) -> str: ...

    @property
    def accepts(self) -> frozenset[DType]: ...

    def quantize_stage(self, dispatch: DispatchDtype, compute: DType) -> Optional[Stage[Any, Any]]: ...

    def expert_stages(self, layer: torch.nn.Module, *, activation: Any, routing_weights_in_epilogue: bool,
                      backend: Backend = ..., configs: Any = ..., dispatch: Optional[DispatchDtype] = ...
                      ) -> list[Stage[Any, Any]]: ...

    def without_backward(self, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor: ...


class CallerCombines(Plan):
    """The plan of rows that arrived grouped by expert: their caller holds the way back."""

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        raise TypeError("rows given to apply_without_routing_weights are combined by their caller")

    def kept(self) -> torch.Tensor:
        raise TypeError("rows given to apply_without_routing_weights are combined by their caller")


def apply_expert_stages(
    method: GroupedMethod,
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    hidden_states_scale: Optional[torch.Tensor],
    group_list_type: Union[GroupListType, int],
    group_list: torch.Tensor,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """GEMM -> activation -> GEMM of ``method``'s torch expert stages on expert-grouped rows, without
    routing weights; the result is ``hidden_states``' shape (unpacked width) in ``output_dtype``."""
    if not isinstance(hidden_states, torch.Tensor):
        raise InputError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    out_dtype = _float_dtype(output_dtype)
    dispatch, spec = _rows_format(method, layer, hidden_states, hidden_states_scale)
    stages = list(method.expert_stages(layer, activation=getattr(layer, "activation"),
                                       routing_weights_in_epilogue=False, backend=Backend.TORCH,
                                       dispatch=dispatch))
    num_experts, width = _expert_input(stages, method)
    packed = 2 if spec.dtype is DType.NVFP4 else 1
    counts = check_expert_groups(hidden_states, group_list_type, group_list, num_experts, width // packed)
    if hidden_states_scale is not None:
        _check_scale(hidden_states, hidden_states_scale, spec)
    spec = spec.evolve(layout=Layout.EXPERT_SORTED if counts is not None else Layout.EXPERT_PADDED,
                       group_list_type=GroupListType.COUNT if counts is not None else None,
                       num_experts=num_experts)
    stages[-1] = _with_out_dtype(stages[-1], out_dtype)
    try:
        validate(stages, spec)
    except ContractError as error:
        raise InputError(f"{method.name}'s expert stages cannot take these rows ({spec.short()}): {error}") from None
    x = Activations(hidden_states, hidden_states_scale)
    rows: ExpertRows
    if counts is not None:
        rows = SortedRows(x, counts, GroupListType.COUNT,
                          torch.ones(hidden_states.shape[0], dtype=torch.float32, device=hidden_states.device),
                          plan=CallerCombines())
    else:
        rows = PaddedRows(x, group_list.to(torch.int64),
                          torch.ones(hidden_states.shape[:2], dtype=torch.float32, device=hidden_states.device),
                          plan=CallerCombines())
    for stage in stages:
        rows = stage(rows)
    return method.without_backward(rows.x.data.to(out_dtype), hidden_states)


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"output_dtype must be torch.bfloat16, float16 or float32, got {dtype}")
    return dtype


def _rows_format(method: GroupedMethod, layer: torch.nn.Module, hidden_states: torch.Tensor,
                 scale: Optional[torch.Tensor]) -> tuple[DispatchDtype, Spec]:
    """The dispatch format of the rows (what the expert stages are built for) and their spec."""
    floats = {d for d in _FLOAT_DISPATCH if d.activation_dtype in method.accepts}
    quantized = [d for d in DispatchDtype if d.is_quantized and d.activation_dtype in method.accepts]
    dispatch = next((d for d in floats | set(quantized)
                     if d.activation_dtype.torch_dtype == hidden_states.dtype), None)
    if dispatch is None:
        formats = ", ".join(sorted(str(d.activation_dtype.torch_dtype) for d in floats))
        formats += "".join(f", or {d.activation_dtype.torch_dtype} ({d.value}) with its scale" for d in quantized)
        raise InputError(f"hidden_states must be {formats} for {method.name}, got {hidden_states.dtype}")
    width = hidden_states.shape[-1] if hidden_states.dim() else 0
    if not dispatch.is_quantized:
        if scale is not None:
            raise InputError(f"hidden_states_scale must be None for float hidden_states ({method.name} quantizes "
                             "float rows itself where it computes in a quantized format)")
        return dispatch, _dispatched(dispatch.activation_dtype, width)
    packed = 2 if dispatch is DispatchDtype.NVFP4 else 1
    compute = layer_compute_dtype(layer)
    try:
        quantize = method.quantize_stage(dispatch, compute)
    except ContractError as error:
        raise InputError(f"{method.name} cannot take {dispatch.value} hidden_states: {error}") from None
    tokens = Spec(kind=PayloadKind.ROUTED, layout=Layout.TOKEN_MAJOR, dtype=compute, width=width * packed, top_k=1)
    spec = quantize.output_spec(tokens) if quantize is not None else tokens
    if spec.dtype is not dispatch.activation_dtype:
        raise InputError(f"{method.name} quantizes to {spec.dtype.value}, not the {dispatch.value} of hidden_states")
    if scale is None:
        want = scale_shape(spec.scale_layout, tuple(hidden_states.shape[:-1]), spec.width)
        raise InputError(f"hidden_states_scale is required with {hidden_states.dtype} hidden_states: "
                         f"{_name(scale_dtype(spec.scale_layout))} {want} ({spec.scale_layout.value})")
    return dispatch, _dispatched(spec.dtype, spec.width, spec.scale_layout, spec.global_scale)


def _dispatched(dtype: DType, width: int, scales: ScaleLayout = ScaleLayout.NONE,
                global_scale: Optional[float] = None) -> Spec:
    return Spec(kind=PayloadKind.DISPATCHED, layout=Layout.EXPERT_SORTED, dtype=dtype, width=width,
                scale_layout=scales, routing_weights=RoutingWeights.PENDING, expert_ids=ExpertIds.LOCAL,
                global_scale=global_scale)


def _check_scale(hidden_states: torch.Tensor, scale: torch.Tensor, spec: Spec) -> None:
    want = scale_shape(spec.scale_layout, tuple(hidden_states.shape[:-1]), spec.width)
    dtype = scale_dtype(spec.scale_layout)
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want or scale.dtype != dtype:
        have = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise InputError(f"hidden_states_scale must be {_name(dtype)} {want} ({spec.scale_layout.value}), got {have}")
    if scale.device != hidden_states.device:
        raise InputError(f"hidden_states_scale is on {scale.device}, hidden_states on {hidden_states.device}")


def _name(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")


def _expert_input(stages: list[Stage[Any, Any]], method: GroupedMethod) -> tuple[int, int]:
    """Local experts and input width of the first GEMM among ``stages``."""
    gemm = next((stage for stage in stages if StageKind.GEMM in stage.kinds), None)
    accepts = gemm.accepts() if gemm is not None else None
    if accepts is None or accepts.num_experts is None or accepts.width is None \
            or len(accepts.num_experts) != 1 or len(accepts.width) != 1:
        raise TypeError(f"{method.name}'s torch expert stages declare no single expert count and width in their "
                        "first GEMM's accepts(): override apply_without_routing_weights")
    (experts,), (width,) = accepts.num_experts, accepts.width
    if experts is None:
        raise TypeError(f"{method.name}'s first expert GEMM accepts any expert count: override "
                        "apply_without_routing_weights")
    return int(experts), int(width)


def _with_out_dtype(stage: Stage[Any, Any], dtype: torch.dtype) -> Stage[Any, Any]:
    """The last GEMM rounds once, to ``dtype`` (a stage without an ``out_dtype`` field keeps its own and the
    result is cast)."""
    kind = type(stage)
    if attrs.has(kind) and "out_dtype" in attrs.fields_dict(kind):  # type: ignore[arg-type]
        return attrs.evolve(stage, out_dtype=DType.from_torch(dtype))  # type: ignore[misc]
    return stage


def group_list_type_arg(value: object) -> GroupListType:
    """:meth:`GroupListType.parse`, raising :class:`InputError` (the argument error of the apply paths)."""
    try:
        return GroupListType.parse(value)
    except ValueError as error:
        raise InputError(str(error)) from None


def check_expert_groups(
    hidden_states: torch.Tensor,
    group_list_type: Union[GroupListType, int],
    group_list: torch.Tensor,
    num_experts: int,
    width: int,
) -> Optional[torch.Tensor]:
    """Check the expert-grouped arguments of ``apply_without_routing_weights`` (``width``: the last
    dimension ``hidden_states`` must have); return the per-expert row counts (int64) of sorted rows
    ``[R, width]``, or ``None`` for padded rows ``[E, C, width]``. Raises :class:`InputError`."""
    kind = group_list_type_arg(group_list_type)
    if not isinstance(group_list, torch.Tensor) or group_list.dim() != 1 or group_list.shape[0] != num_experts:
        shape = tuple(group_list.shape) if isinstance(group_list, torch.Tensor) else type(group_list).__name__
        raise InputError(f"group_list must be [num_experts={num_experts}], got {shape}")
    if hidden_states.dim() not in (2, 3):
        raise InputError(f"hidden_states must be [R, W] or [E, C, W], got {tuple(hidden_states.shape)}")
    # Check against the weights here: a mismatch would otherwise surface as a matmul shape error.
    if hidden_states.shape[-1] != width or (hidden_states.dim() == 3 and hidden_states.shape[0] != num_experts):
        want = f"[R, {width}] or [{num_experts}, C, {width}]"
        raise InputError(f"hidden_states must be {want} to match the expert weights, got "
                         f"{tuple(hidden_states.shape)}")
    if hidden_states.dim() == 3:
        if kind is not GroupListType.COUNT:
            raise InputError("padded hidden_states [E, C, W] need group_list_type=1 (counts)")
        return None
    counts = group_list.long() if kind is GroupListType.COUNT else torch.diff(
        group_list.long(), prepend=group_list.new_zeros(1, dtype=torch.long))
    if torch.compiler.is_compiling():
        # The counts are data: the compiled graph checks them when it runs (reading them here would break it).
        torch._assert_async((counts >= 0).all() & (counts.sum() == hidden_states.shape[0]),
                            "group_list does not cover hidden_states' rows with non-negative counts")
        return counts
    if bool((counts < 0).any()) or int(counts.sum()) != hidden_states.shape[0]:
        raise InputError(
            f"group_list ({kind.name.lower()}) covers {int(counts.sum())} rows with counts "
            f"{counts.tolist()}; hidden_states has {hidden_states.shape[0]} rows")
    return counts
