"""Where the warp-specialised Gluon grouped GEMM serves a ``moe_gemm`` launch, and that launch.

A launch configuration with ``warp_specialized`` (:class:`~moeforge.kernels.config.GemmConfig`; the tuned tables set
it where it was measured faster, ``tune_moe.py --warp-specialized``) asks for
:func:`moeforge.kernels.gluon_grouped_gemm.ws_grouped_gemm`. It computes the float GEMM only — bf16 / fp16 rows and
weights of one dtype, the SwiGLU gate/up GEMM (concatenated halves) or a plain one, routing weights, a served stack's
update in every adapter's columns (as more K-steps through its ring), no bias, no other low-rank update, no split
K-loop — on an sm_90 GPU with a Triton whose Gluon it was written for. :func:`problem` names why a launch is not one
of those (``None`` where it is), and :func:`moeforge.kernels.grouped_gemm_call.launch` then runs ``moe_gemm`` with the
same tile: the flag chooses a kernel, never a result. :func:`stage_problem` is the part known when a stage is built,
what ``describe()`` shows.
"""

from __future__ import annotations

from typing import Optional

import torch

from moeforge.kernels import gluon_grouped_gemm as gluon_gemm
from moeforge.kernels.activations import ACT_NONE, ACT_SILU
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.formats import WeightFormat

# A launch's low-rank update as problem() reads it: (rows, weight, ids, scale)
Update = tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], float]


def stage_problem(device: torch.device, dtype: torch.dtype, act: int, glu: bool, interleaved: bool,
                  bias: bool) -> Optional[str]:
    """Why a GEMM stage of this device, dtype, activation (the kernels' codes) and bias cannot launch the
    warp-specialised kernel (``None`` where it can)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the warp-specialised kernel takes bf16 / fp16 rows and weights, not {dtype}"
    if bias:
        return "the warp-specialised kernel adds no bias"
    if glu and (act != ACT_SILU or interleaved):
        return "the warp-specialised kernel's gated activation is SwiGLU over concatenated [gate | up] halves"
    if not glu and act != ACT_NONE:
        return "the warp-specialised kernel's plain GEMM has no activation"
    return gluon_gemm.device_problem(device)


def problem(a: torch.Tensor, weight: torch.Tensor, *, quantized: bool, weight_format: WeightFormat,
            bias: bool, act: int, glu: bool, interleaved: bool, out_dtype: torch.dtype, fp8_out: bool,
            update: Optional[Update], config: GemmConfig, aligned_block_m: int) -> Optional[str]:
    """Why this ``moe_gemm`` launch cannot run as the warp-specialised kernel (``None`` where it can).
    ``quantized``: the rows or the weight carry scales, zero points or global scales; ``update``: the launch's low-rank
    update as ``(rows, weight, ids, scale)`` (:func:`~moeforge.kernels.gluon_grouped_gemm.update_problem` says which it
    takes), ``None`` without one."""
    if quantized or weight_format is not WeightFormat.FLOAT or weight.dtype != a.dtype:
        return "the warp-specialised kernel computes float rows and weights of one dtype"
    if fp8_out or out_dtype not in (a.dtype, torch.float32):
        return f"the warp-specialised kernel writes the rows' dtype or fp32, not {'fp8' if fp8_out else out_dtype}"
    if update is not None:
        rows, update_weight, ids, scale = update
        found = gluon_gemm.update_problem(a, weight, config, rows, update_weight, ids, scale)
        if found is not None:
            return found
    out_width = weight.shape[1] // 2 if glu else weight.shape[1]
    if out_width * (4 if out_dtype == torch.float32 else a.element_size()) % 16:
        return f"the warp-specialised kernel writes rows of whole 16-byte pieces, not {out_width} columns"
    if (config.split_k or 1) > 1 or config.swap:
        return "the warp-specialised kernel runs one K-loop over rows @ W^T (no split, no swapped product)"
    found = stage_problem(a.device, a.dtype, act, glu, interleaved, bias)
    if found is not None:
        return found
    return gluon_gemm.operand_problem(a, weight, config, glu, aligned_block_m)


def launch(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
           block_expert: torch.Tensor, num_padded: torch.Tensor, *, rows_per_a: int, config: GemmConfig, glu: bool,
           topk_weights: Optional[torch.Tensor], aligned_block_m: int,
           update: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The launch :func:`problem` accepted (its operands checked there; ``out`` and the plan the caller's, made for
    it): one persistent program per multiprocessor. ``update``: ``(rows, weight)`` of the update it accepted."""
    return gluon_gemm.launch_checked(a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
                                     config=config, glu=glu, topk_weights=topk_weights,
                                     aligned_block_m=aligned_block_m, update=update)
