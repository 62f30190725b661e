"""The triton experts as one unit: dispatch, both GEMMs, activation and combine, one autograd node when training.

Called stage by stage, a training forward of the triton experts records five autograd nodes (the slot-order
gather, the gate/up GEMM, the activation, the down GEMM, the combine), and each kernel call passes through its
:class:`~moeforge.kernels.kernel_op.KernelOp`, an ``autograd.Function`` and the stages' payload records. Where the
step's GPU time is short (many experts, a thousand tokens) that Python is the step's time, not the GPU's
(docs/kernels.md, "The eager host path", has the figures). :class:`ExpertsStep` runs the
same kernels, the same functions with the same arguments in the same order, inside one ``autograd.Function``: its
forward calls each op's implementation and the ``setup_context`` the op registers (on a :class:`_OpContext`), its
backward each op's registered backward in reverse order. The outputs and every gradient are the ones the stages
give, bit for bit (``tests/test_triton_step.py``); what goes is the per-kernel dispatch and four autograd nodes.
Without grad mode (``torch.no_grad()``, ``torch.inference_mode()``: serving, ``generate()``) it calls the stages'
inference kernels directly with their arguments — the same bits again, without the payload records and the ops'
dispatch, which at a decode batch are much of an eager forward's host time.

:class:`~moeforge.pipeline.Pipeline` runs it in place of the four stages ``AlignDispatch``, ``FusedGroupedGemm``
(gate/up with its activation, with or without bias), ``FusedGroupedGemm`` (down) and ``Combine`` (the routing weights
applied in the combine, or on the input by the dispatch as Llama-4's are; any scaling factor and output dtype) when the
dispatch offers it
(:meth:`~moeforge.stages.triton.AlignDispatch.joined`) and a call is one it takes (:meth:`ExpertsStep.__call__`):
plain tensors, no mode or ``torch.compile`` (what :func:`~moeforge.kernels.kernel_op.call_route` routes to the
functions), token rows without scales or adapters; and either grad mode off, or grad mode on with the gate/up GEMM's
operands recording a gradient, no saved-tensor hooks (activation checkpointing without reentry, ``save_on_cpu``: they
must see every tensor the backward keeps) and at least one copy — the calls the dispatch gathers into slot order
(:mod:`moeforge.stages.slot_order`). Every other call (grad mode on with nothing requiring grad among them) runs the
stages one by one.

Memory: the intermediates the stages' nodes keep (the slot-order rows, the pre-activation, the activation, the down
GEMM's rows) are kept by this node, and its backward lets each go once the op that kept it has run its backward, as
the autograd engine frees a node's saved tensors — unless the backward keeps the graph (``retain_graph=True``), when
it keeps them all for the next. The inputs are saved with ``save_for_backward``, so an input changed in place before
the backward is the autograd engine's error, as with the stages.

Gradients arrive together: the node's backward returns every input's gradient at its end, where the stages' nodes
give the down GEMM's weight gradient before the gate/up GEMM's backward runs (a data-parallel wrapper that starts a
parameter's reduction when its gradient is ready overlaps that one reduction less).

Work: a backward asked for some of the inputs' gradients only (``torch.autograd.grad`` of the routing weights alone,
say) runs every op's backward whose inputs require grad, where the engine would skip the stages' nodes on no path to
an asked input; the gradients asked for are the same.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from moeforge.kernels import activation_rows, backward, combine, grouped_gemm_call
from moeforge.kernels.config import ConfigTable
from moeforge.kernels.grouped_gemm_call import GemmEpilogue, GemmRoute, GemmRows, GemmWeight
from moeforge.kernels.kernel_op import DIRECT, DIRECT_WITH_GRAD, call_route
from moeforge.payloads import MoEOutput, RoutedTokens
from moeforge.spec import accumulation_dtype
from moeforge.stages import slot_order
from moeforge.stages.dispatch import scale_rows, scaled_copy_rows
from moeforge.tensor_ref import TensorSource, resolve

_GATHERED_FROM = grouped_gemm_call.ARGUMENT_NAMES.index("gathered_from")
_GEMM_ARGUMENTS = len(grouped_gemm_call.ARGUMENT_NAMES)


@attrs.frozen(eq=False)
class ExpertsStep:
    """The four stages as one unit — one autograd node for a training call, the kernels called directly without grad
    mode — for the calls :meth:`__call__` takes (see the module docstring): what
    each stage reads, as a plain record (made by :meth:`moeforge.stages.triton.AlignDispatch.joined`, which checks
    that the stages after it are the four this runs). The dispatch's ``num_experts``, ``configs`` and ``slot_rows``;
    the gate/up GEMM's weight ``w13``, bias ``b13`` and activation ``act`` (the kernels' arguments,
    :func:`~moeforge.stages.triton.activation_args`; an activation, code not 0); the down GEMM's ``w2`` and ``b2``;
    the combine's ``scale`` (its routed scaling factor, or 1) and ``out_dtype`` (``None``: the rows');
    ``weights_on_input``: the dispatch scales each copy's row by its routing weight (Llama-4:
    :func:`~moeforge.stages.dispatch.scale_rows`) and the combine sums the rows unweighted, else the combine applies
    the weights."""

    num_experts: int
    configs: ConfigTable
    slot_rows: Optional[bool]
    w13: TensorSource
    b13: Optional[TensorSource]
    act: tuple[int, bool, bool, float, float]
    w2: TensorSource
    b2: Optional[TensorSource]
    scale: float
    out_dtype: Optional[torch.dtype]
    weights_on_input: bool = False
    joins: int = attrs.field(default=3, init=False)  # the stages after the dispatch it runs

    def summary(self) -> str:
        return ("the triton experts as one unit (moeforge.stages.triton_step): one autograd node where a call records "
                "gradients on plain tensors, the kernels called directly without grad mode")

    def __call__(self, x: RoutedTokens) -> Optional[MoEOutput]:
        """The combined output of the four stages for ``x`` — through one autograd node where the call records
        gradients, by calling the kernels without grad mode — or ``None`` where this call is not one this takes (the
        pipeline then runs the stages)."""
        rows, weights, ids = x.x.data, x.topk.weights, x.topk.ids
        if x.x.scale is not None or x.adapter_ids is not None:
            return None
        w13, w2 = resolve(self.w13), resolve(self.w2)
        b13 = resolve(self.b13) if self.b13 is not None else None
        b2 = resolve(self.b2) if self.b2 is not None else None
        route = call_route((rows, weights, ids, w13, w2, b13, b2))
        if not torch.is_grad_enabled():
            return self._inference(rows, weights, ids, w13, w2, b13, b2) if route == DIRECT else None
        if route != DIRECT_WITH_GRAD or _saved_tensor_hooks():
            return None
        # The gate/up GEMM records a gradient (its activation then runs as its own op, as the stage does), and the
        # dispatch gathers these rows into slot order.
        if not any(t is not None and t.requires_grad for t in (rows, weights, w13, b13)):
            return None
        if slot_order.slot_rows_apply(x) is not None or not (
                self.slot_rows or slot_order.slot_rows_pay(ids.numel())):
            return None
        apply = _Step.apply
        out: torch.Tensor = apply(self, rows, weights, ids, w13, w2, b13, b2)  # type: ignore[no-untyped-call]
        return MoEOutput(out)

    def _inference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor]) -> MoEOutput:
        """The four stages' kernels without grad mode, with their arguments: the alignment (unordered), the gate/up
        GEMM gathering the token rows by index (or reading each copy's row scaled by its weight, ``weights_on_input``)
        with the activation in its epilogue, the down GEMM, the combine in copy order — no payload records, no op
        dispatch."""
        from moeforge.kernels import ops  # (registered by the stages that made the step)

        tokens, top_k = ids.shape
        config = self.configs.lookup(tokens)
        sorted_ids, block_expert, num_padded = ops.align_block_size.impl(ids, self.num_experts, config.block_m, False)
        route = GemmRoute(sorted_ids, block_expert, num_padded, tokens * top_k, aligned_block_m=config.block_m)
        act = self.act
        rows_in = GemmRows(x, rows_per_a=top_k)
        if self.weights_on_input:  # one row per copy, in copy order, scaled by its weight
            rows_in = GemmRows(scaled_copy_rows(x, weights))
        hidden, _ = grouped_gemm_call.launch(*grouped_gemm_call.arguments(
            rows_in, GemmWeight(w13), route,
            GemmEpilogue(x.dtype, bias=b13, act=act[0], glu=act[1], interleaved=act[2], alpha=act[3], limit=act[4]),
            config.gate_up))
        rows, _ = grouped_gemm_call.launch(*grouped_gemm_call.arguments(
            GemmRows(hidden), GemmWeight(w2), route, GemmEpilogue(hidden.dtype, bias=b2), config.down))
        return MoEOutput(combine.combined(rows, None if self.weights_on_input else weights, top_k, self.scale,
                                          self.out_dtype or rows.dtype))


class _ScaledRows:
    """The backward of ``(rows.to(wide) * weights[:, None]).to(rows.dtype)`` —
    :func:`~moeforge.stages.dispatch.scale_rows`, the dispatch's scaling of each slot's row by its copy's routing
    weight — as the autograd engine computes that expression's: the upstream gradient cast to the product's dtype,
    times the weights for the rows (cast back to theirs), times the widened rows summed along each row for the
    weights. It keeps what the engine's nodes keep: the weights where the rows need a gradient, the widened rows
    where the weights do."""

    def __init__(self, rows: torch.Tensor, weights: torch.Tensor, need_rows: bool, need_weights: bool) -> None:
        self.wide = rows.to(accumulation_dtype(rows.dtype)) if need_weights else None
        self.weights = weights.unsqueeze(-1) if need_rows else None
        self.dtype = rows.dtype

    def backward(self, d_scaled: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(d_rows, d_weights)`` for the gradient ``d_scaled`` of the scaled rows (``None`` where not needed)."""
        wide = d_scaled.to(self.wide.dtype if self.wide is not None else accumulation_dtype(self.dtype))
        d_rows = (wide * self.weights).to(self.dtype) if self.weights is not None else None
        d_weights = (wide * self.wide).sum(-1, keepdim=True).squeeze(-1) if self.wide is not None else None
        return d_rows, d_weights


class _OpContext:
    """What an op's ``setup_context`` writes and its ``backward`` reads, for an op run inside :class:`_Step`: the
    saved tensors, which inputs need a gradient (as the autograd engine would say for the op's node), and the
    attributes ``setup_context`` sets."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        pass  # (the step passes None for a gradient nothing produced, as the engine does without materialising)


def _gemm_needs(rows: bool, weight: bool, bias: bool, gathered_from: bool = False) -> tuple[bool, ...]:
    """A ``moeforge::moe_gemm`` node's ``needs_input_grad``: the rows, the weight, the bias and the token rows the
    rows were gathered from; every other input none."""
    needs = [False] * _GEMM_ARGUMENTS
    needs[0], needs[2], needs[6], needs[_GATHERED_FROM] = rows, weight, bias, gathered_from
    return tuple(needs)


# torch's private queries (present in torch 2.4 to 2.13), looked up once: the default saved-tensor hooks on top of the
# stack (torch's checkpointing reads it too), and whether the running backward keeps the graph (AOT autograd reads it)
_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_KEEPS_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are set (``torch.autograd.graph.saved_tensors_hooks``: activation checkpointing
    without reentry, ``save_on_cpu``): they see what ``save_for_backward`` saves, and this node keeps its
    intermediates beside it, so such calls run the stages. ``True`` where torch lacks the query."""
    return _TOP_SAVED_TENSOR_HOOKS is None or _TOP_SAVED_TENSOR_HOOKS(False) is not None


def _keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); ``True`` (keep everything) where torch
    lacks the query."""
    return _KEEPS_GRAPH is None or bool(_KEEPS_GRAPH())


class _Step(torch.autograd.Function):
    """One training step of the experts (:class:`ExpertsStep`): the stages' kernels in their order."""

    @staticmethod
    def forward(ctx: Any, step: ExpertsStep, x: torch.Tensor, topk_weights: torch.Tensor,  # type: ignore[override]
                ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                b2: Optional[torch.Tensor]) -> torch.Tensor:
        from moeforge.kernels import ops  # (registered by the stages that made the step)

        need_x, need_w, _, need_w13, need_w2, need_b13, need_b2 = ctx.needs_input_grad[1:]
        tokens, top_k = ids.shape
        copies = tokens * top_k
        # AlignDispatch: the alignment for a training step, the rows gathered into its slot order
        config = step.configs.lookup(tokens)
        sorted_ids, block_expert, num_padded = ops.align_block_size.impl(ids, step.num_experts, config.block_m, True)
        weights = topk_weights.float()
        gather = (x, weights.reshape(-1), sorted_ids, block_expert, num_padded, top_k, step.num_experts,
                  config.block_m)
        gathered = ops.gather_slots.impl(*gather)
        xs, slot_weights, slot_of, row_of_slot, runs = gathered
        index = slot_of.view(tokens, top_k)
        route = GemmRoute(row_of_slot, block_expert, num_padded, copies, aligned_block_m=config.block_m,
                          slot_copies=copies, slot_runs=runs)
        act = step.act
        upstream = need_x or need_w  # (the rows: the gather's output, from x and the weights)
        tape: list[Any] = []
        if step.weights_on_input:
            # the gather as its own op (its backward sums each token's slot rows), then each slot's row scaled by
            # its copy's weight as the dispatch scales it (:class:`_ScaledRows` differentiates it as autograd would)
            gather_op = _OpContext((need_x, need_w) + (False,) * 6)
            backward.gather_slots_setup_context(gather_op, gather, gathered)
            rows_in = GemmRows(scale_rows(xs, slot_weights))
            tape += [gather_op, _ScaledRows(xs, slot_weights, upstream, need_w)]
        else:
            rows_in = GemmRows(xs, gathered_from=x, gathered_index=index)
        del gathered, xs, slot_weights
        # FusedGroupedGemm (gate/up), its activation as its own op (as a recorded forward runs it)
        arguments = grouped_gemm_call.arguments(rows_in, GemmWeight(w13), route, GemmEpilogue(x.dtype, bias=b13),
                                                config.gate_up_apart(act[1]))
        pre, _ = grouped_gemm_call.launch(*arguments)
        gate_up = _OpContext(_gemm_needs(upstream, need_w13, need_b13, need_x and not step.weights_on_input))
        backward.moe_gemm_setup_context(gate_up, arguments, None)
        hidden = ops.activate_rows.impl(pre, *act)
        activation = _OpContext(())
        activation_rows.autograd_setup_context(activation, (pre, *act), hidden)
        del pre
        # FusedGroupedGemm (down)
        upstream = upstream or need_w13 or need_b13
        arguments = grouped_gemm_call.arguments(GemmRows(hidden), GemmWeight(w2), route,
                                                GemmEpilogue(hidden.dtype, bias=b2), config.down)
        rows, _ = grouped_gemm_call.launch(*arguments)
        down = _OpContext(_gemm_needs(upstream, need_w2, need_b2))
        backward.moe_gemm_setup_context(down, arguments, None)
        # Combine: the routing weights applied (unless the dispatch applied them), each copy read at its slot
        upstream = upstream or need_w2 or need_b2
        arguments = (rows, None if step.weights_on_input else weights, top_k, step.scale,
                     step.out_dtype or rows.dtype, index)
        out = combine.combined(*arguments)
        combined = _OpContext((upstream, need_w and not step.weights_on_input, False, False, False, False))
        backward.combine_setup_context(combined, arguments, out)
        ctx.save_for_backward(x, topk_weights, w13, w2, b13, b2)  # (the engine's check of in-place changes)
        ctx.tape = tape + [gate_up, activation, down, combined]
        ctx.needs = (need_x or need_w or need_w13 or need_b13, need_w2 or need_b2)  # (below the combine, the down)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        topk_weights = ctx.saved_tensors[1]  # (raises where a backward already freed the graph)
        tape, keep = ctx.tape, _keeps_graph()
        if not keep:
            ctx.tape = None
        gate_up, activation, down, combined = tape[-4:]
        dispatched = tape[:-4]  # (weights on the input: the gather's and the scaling's)
        below_down, down_itself = ctx.needs
        d_rows, d_weights = backward.combine_backward(combined, grad_out)[:2]
        del combined, grad_out
        if not keep:
            tape.clear()  # (each op's saved tensors go once its backward has run)
        d_x = dw13 = db13 = dw2 = db2 = None
        if below_down or down_itself:
            grads = backward.moe_gemm_backward(down, d_rows, None)
            d_hidden, dw2, db2 = grads[0], grads[2], grads[6]
            del down, d_rows, grads
            if below_down:
                d_pre = activation_rows.autograd_backward(activation, d_hidden)[0]
                del activation, d_hidden
                grads = backward.moe_gemm_backward(gate_up, d_pre, None)
                d_x, dw13, db13 = grads[_GATHERED_FROM], grads[2], grads[6]
                if dispatched and grads[0] is not None:  # (the scaled rows' gradient: x or the weights need one)
                    gather_op, scaled = dispatched
                    dispatched.clear()
                    d_xs, d_slot_weights = scaled.backward(grads[0])
                    del grads, scaled
                    d_x, d_weights = backward.gather_slots_backward(gather_op, d_xs, d_slot_weights, None, None,
                                                                    None)[:2]
                    if d_weights is not None:
                        d_weights = d_weights.view(topk_weights.shape)
        if d_weights is not None:
            d_weights = d_weights.to(topk_weights.dtype)  # (the stages' ``weights.float()``'s backward)
        return None, d_x, d_weights, None, dw13, dw2, db13, db2
