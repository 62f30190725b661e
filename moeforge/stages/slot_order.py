"""When the block-aligned dispatch gives its rows in slot order, the layout a training step takes.

:class:`~moeforge.stages.triton.AlignDispatch` moves no row for inference: the first GEMM gathers the token rows by
index and every GEMM writes one row per copy in copy order. Where it records a gradient it gathers the token rows
into the alignment's slot order instead (:mod:`moeforge.kernels.slot_rows`, one differentiable op): each expert's
copies one run, rounded up to a whole step of the weight gradient with zero rows. The GEMMs then read and write each
slot's row with the same kernels (their route's ``sorted_ids`` is each slot's row), the backward's weight gradients
read each expert's rows where they lie instead of gathering two copies into expert order, and the combine reads each
copy's row (:class:`~moeforge.stages.triton.AlignedPlan` by ``slot_of``). This module holds the rule;
:meth:`~moeforge.stages.triton.AlignDispatch.slot_order_rows` gathers.

The rows past the last expert's run hold no values (no kernel writes them): every stage between the dispatch and the
combine must read the rows of its slots alone, which the pipeline checks when it is built (``Spec.slot_order``: a
stage that reads every row refuses a dispatch that may give slot order, and the dispatch is then built with
``slot_rows=False``).

The rows then number ``copies + min(E, copies) * (step - 1)`` at most (``step``:
:func:`~moeforge.kernels.weight_grad.weight_grad_step`, 64 or 32 rows), against the copies in copy order, and the
forward saves them for the backward. :func:`slot_rows_pay` takes slot order where that padding is at most a
quarter of the copies — an eighth on average, the runs' ends falling anywhere in their last step (docs/kernels.md,
"Backward", has the measurements behind the bound).
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.payloads import RoutedTokens

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def slot_rows_pay(num_copies: int, num_experts: int, block_m: int) -> bool:
    """Whether ``num_copies`` copies aligned in blocks of ``block_m`` rows over ``num_experts`` experts take slot order
    in a training step: the most padding (a step of the weight gradient less a row for each expert with a copy) at
    most a quarter of the copies (see the module docstring)."""
    from moeforge.kernels.weight_grad import weight_grad_step  # (Triton's: `import moeforge` must not import it)

    step = weight_grad_step(num_copies / max(num_experts, 1), block_m)
    return num_copies > 0 and 4 * min(num_experts, num_copies) * (step - 1) <= num_copies


def slot_rows_apply(x: RoutedTokens) -> Optional[str]:
    """Why the routed tokens ``x`` cannot be gathered into slot order (``None`` where they can): float rows without
    scales (quantized tokens travel with their scales, which the gather does not move), no stack of adapters (its
    pair alignment is built on copy order: the serving path), and no anomaly detection (it checks every gradient
    for NaN, and the rows past the last expert's run hold no values). Under ``torch.compile`` the mode is not read
    (Dynamo cannot trace the query; a compiled step's backward is one node, whose gradients anomaly detection checks
    whole)."""
    if not torch.compiler.is_compiling() and torch.is_anomaly_enabled():
        return ("anomaly detection checks every row of every gradient, and rows past the last expert's run hold no "
                "values")
    if x.x.scale is not None or x.x.data.dtype not in _FLOAT:
        return "quantized tokens are dispatched with their scales in copy order"
    if x.adapter_ids is not None:
        return "a stack of adapters aligns its copies in copy order"
    return None
