"""What the expert-parallel dispatchers share: the paired-combine interface and small helpers.

Rows travel as bytes (:mod:`~moeforge.distributed.wire`), which autograd cannot follow. A call that records
gradients ties what arrived back to what was sent (:func:`delivered`): the backward of a transport is the
same transport reversed — the dispatch's gradients go home by the combine's exchange, the combine's by the
dispatch's — so that an expert-parallel layer trains like the whole layer on one process. Every rank of
the group must then run the backward (as with any collective in a backward pass).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from moeforge.distributed.group import ExpertParallel
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations
from moeforge.spec import FLOAT_DTYPES, Accepts, DType, Layout, PayloadKind, ScaleLayout, Spec
from moeforge.stages.combine import Combine, combine_rows
from moeforge.stages.dispatch import scale_rows, weights_on_input_accepts, weights_on_input_hint
from moeforge.no_backward import records_grad

# Scales that travel with their rows. A per-tensor scale belongs to one rank's whole batch: after
# the exchange, rows of several ranks would share one expert GEMM with different scales.
WIRE_SCALES = frozenset({ScaleLayout.NONE, ScaleLayout.PER_TOKEN, ScaleLayout.PER_GROUP_128,
                         ScaleLayout.NVFP4_BLOCK16})

# Row formats on the wire: every dtype but float64 (the wire carries fp32 routing weights beside the rows).
WIRE_DTYPES = frozenset(DType) - {DType.FP64}


class ExchangeDispatch(abc.ABC):
    """Base of the dispatchers that send rows to the ranks owning their experts.

    Their rows carry the plan that sends them home (the spec's ``exchange`` field says where they came
    from), so the ordinary :class:`~moeforge.stages.combine.Combine` takes them: :meth:`combine_stage`."""

    ep: ExpertParallel
    apply_routing_weights: bool
    configs: Optional[ConfigTable]

    @property
    def block_aligned(self) -> bool:
        """Whether the rows arrive ``BLOCK_ALIGNED`` (what the triton expert GEMMs read): the dispatcher was given their
        launch table (``configs``)."""
        return self.configs is not None

    def aligned_spec(self, spec: Spec) -> Spec:
        """``spec`` of rows this dispatcher delivers before their alignment, made ``BLOCK_ALIGNED`` where it has the
        triton GEMMs' launch table."""
        if self.configs is None:
            return spec
        return spec.evolve(layout=Layout.BLOCK_ALIGNED, alignment=self.configs.alignment())

    def combine_stage(self, *, apply_routing_weights: bool = True, routed_scaling_factor: Optional[float] = None,
                      out_dtype: Optional[DType] = None) -> Combine:
        """The combine for this dispatcher's rows: :class:`~moeforge.stages.combine.Combine`, whose call
        hands them to their plan, which sends them home and sums them there."""
        return Combine(apply_routing_weights, routed_scaling_factor, out_dtype)

    @abc.abstractmethod
    def replay_refusal(self, device: torch.device) -> Optional[str]:
        """Why a CUDA graph of this dispatcher's call on ``device`` would not do what the call does (it reads a count
        on the host, or raises from one), or ``None`` where a replay does the same: one exchange, no host read. Asked
        after a call, of the calls like it (:mod:`moeforge.decode_graphs` captures only where it is ``None``); the
        same answer on every rank."""

    def accepts(self) -> Accepts:
        if self.apply_routing_weights:
            return weights_on_input_accepts(self.ep.num_experts, FLOAT_DTYPES, scale_layout=WIRE_SCALES)
        return Accepts(kind=PayloadKind.ROUTED, num_experts=self.ep.num_experts, dtype=WIRE_DTYPES,
                       scale_layout=WIRE_SCALES)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field == "scale_layout":
            return ("a per-tensor scale cannot travel with its rows to other ranks: quantize per token or per "
                    "128-group before an expert-parallel dispatch")
        if field == "dtype" and have is DType.FP64:
            return ("expert-parallel rows travel with fp32 routing weights, in bf16, fp16, fp32 or a quantized "
                    "format: a float64 layer (the torch reference, for gradcheck) runs on one process")
        return weights_on_input_hint(self, field, have) if self.apply_routing_weights else None


def scaled_rows(x: Activations, tokens: torch.Tensor, weights: torch.Tensor, on_input: bool) -> Activations:
    """The rows of token-major ``x`` at ``tokens`` (scales follow), times ``weights`` if ``on_input``."""
    data = x.data[tokens]
    scale = x.scale[tokens] if x.scale is not None else None
    if on_input:
        data = scale_rows(data, weights)
    return Activations(data, scale)


def count_per_expert(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Copies per expert (int64). ``index_add_`` rather than ``bincount``: bincount reads the max id on
    the host (a sync) on CUDA, which would break CUDA-graph capture."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))


def exchange_bytes(send: torch.Tensor, recv: torch.Tensor, group: Optional[dist.ProcessGroup],
                   recv_splits: Optional[list[int]] = None, send_splits: Optional[list[int]] = None) -> None:
    """``all_to_all_single`` of any dtype, sent as bytes (gloo has no fp8 or bf16 all-to-all)."""
    dist.all_to_all_single(_bytes(recv), _bytes(send), recv_splits, send_splits, group=group)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    # A dtype view keeps dim 0 of a 2-D tensor (rows), so row split sizes stay valid; a 1-D tensor is
    # only ever exchanged in equal splits.
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def combine_on_source(rows: torch.Tensor, index: torch.Tensor, copy_weight: Optional[torch.Tensor],
                      out_dtype: torch.dtype, scaling_factor: Optional[float]) -> torch.Tensor:
    """``out[t] = scaling_factor * sum_k copy_weight[t, k] * rows[index[t, k]]`` in fp32, ``k`` in
    order (``index`` -1: the copy adds nothing). On CUDA one Triton pass over the copies; elsewhere, and
    in a call that records gradients (the kernel has no backward), the torch reference
    (:func:`~moeforge.stages.combine.combine_rows`)."""
    sources = (rows,) if copy_weight is None else (rows, copy_weight)
    if rows.is_cuda and rows.shape[0] and index.shape[1] and not records_grad(*sources):
        try:
            from moeforge.kernels.combine import combine_copies
        except ImportError:  # no triton: the torch reference below
            pass
        else:
            out = torch.empty(index.shape[0], rows.shape[-1], dtype=out_dtype, device=rows.device)
            weights = copy_weight.float().contiguous() if copy_weight is not None else None
            return combine_copies(rows.contiguous(), index.shape[1], out, weights,
                                  1.0 if scaling_factor is None else scaling_factor, index.contiguous())
    return combine_rows(rows, index, None, out_dtype, scaling_factor, copy_weight=copy_weight)


Reverse = Callable[..., Sequence[Optional[torch.Tensor]]]


class _Delivered(torch.autograd.Function):
    """Identity on what a transport delivered; the backward runs the reverse transport (``back``)."""

    @staticmethod
    def forward(ctx: Any, back: Reverse, count: int,  # noqa: ANN401
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.back, ctx.count = back, count
        return tuple(tensor.view_as(tensor) for tensor in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # noqa: ANN401
        return (None, None, *(None,) * ctx.count, *ctx.back(*grads))


def delivered(outputs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
              back: Reverse) -> tuple[torch.Tensor, ...]:
    """``outputs`` — what a byte-level transport (pack, exchange, unpack) delivered from ``sources`` — tied
    to ``sources`` for autograd: the backward hands ``back`` the gradients of ``outputs`` (zeros for an
    unused one) and ``back`` returns those of ``sources``, sent the reverse way. The values are the
    outputs' own (a view): only call it when :func:`records_grad` (the forward pays nothing otherwise)."""
    tied: tuple[torch.Tensor, ...] = _Delivered.apply(  # type: ignore[no-untyped-call]
        back, len(outputs), *outputs, *sources)
    return tied


def exchange_rows(rows: torch.Tensor, group: Optional[dist.ProcessGroup], send_splits: Optional[list[int]] = None,
                  recv_splits: Optional[list[int]] = None) -> torch.Tensor:
    """``rows`` sent to the other ranks (``send_splits[r]`` rows to rank ``r``; ``None``: equal splits) and
    what they sent here, differentiable: the backward sends the gradients back the way the rows came."""
    received = rows.new_empty(sum(recv_splits) if recv_splits is not None else rows.shape[0], *rows.shape[1:])
    exchange_bytes(rows.contiguous(), received, group, recv_splits, send_splits)
    if not records_grad(rows):
        return received

    def back(grad: torch.Tensor) -> tuple[torch.Tensor]:
        return (exchange_rows(grad.contiguous(), group, recv_splits, send_splits),)

    return delivered((received,), (rows,), back)[0]
