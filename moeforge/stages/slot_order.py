"""When the block-aligned dispatch gives its rows in slot order, the layout a training step takes.

:class:`~moeforge.stages.triton.AlignDispatch` moves no row for inference: the first GEMM gathers the token rows by
index and every GEMM writes one row per copy in copy order. Where it records a gradient it gathers the token rows
into the alignment's slot order instead (:mod:`moeforge.kernels.slot_rows`, one differentiable op): each expert's
copies one run, one row per copy. The GEMMs then read and write each slot's row with the same kernels (their
route's ``sorted_ids`` is each slot's row), the backward's weight gradients read each expert's rows where they lie
instead of gathering two copies into expert order, and the combine reads each copy's row
(:class:`~moeforge.stages.triton.AlignedPlan` by ``slot_of``). This module holds the rule;
:meth:`~moeforge.stages.triton.AlignDispatch.slot_order_rows` gathers.

Row ``r`` is then not copy ``r``: every stage between the dispatch and the combine must read the rows through the
alignment (row by row, or by its plan), which the pipeline checks when it is built (``Spec.slot_order``: a stage that
reads the rows as copies refuses a dispatch that may give slot order, and the dispatch is then built with
``slot_rows=False``).

The rows number the copies, one row each; the forward saves them for the backward where copy order saves the token
rows. :func:`slot_rows_pay` takes slot order wherever it applies (docs/kernels.md, "Backward", has the measurements
behind the rule).
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.payloads import RoutedTokens

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def slot_rows_pay(num_copies: int) -> bool:
    """Whether ``num_copies`` copies take slot order in a training step: wherever there are copies. Against copy
    order it saves the backward's gathers into expert order (four; two where the Triton weight gradient runs) and, at
    the weight gradients' peak, their copies; it costs one gather of the token rows in the forward (see the module
    docstring)."""
    return num_copies > 0


def slot_rows_apply(x: RoutedTokens) -> Optional[str]:
    """Why the routed tokens ``x`` cannot be gathered into slot order (``None`` where they can): float rows without
    scales (quantized tokens travel with their scales, which the gather does not move), and no stack of adapters (its
    pair alignment is built on copy order: the serving path)."""
    if x.x.scale is not None or x.x.data.dtype not in _FLOAT:
        return "quantized tokens are dispatched with their scales in copy order"
    if x.adapter_ids is not None:
        return "a stack of adapters aligns its copies in copy order"
    return None
