# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""One grouped GEMM for every weight format, over block-aligned expert rows.

A program computes a ``BLOCK_M x BLOCK_N`` tile of one expert: it reads the copy indices of its rows
from ``sorted_ids`` (:mod:`moeforge.kernels.align`), gathers the input rows by index inside the kernel
(``copy // rows_per_a``: the token for the first GEMM, the copy itself for the second), multiplies by
the expert's ``[N, K]`` weight, and in the epilogue applies the scales that are constant along K, adds
the bias, applies the activation (a gated one accumulates the gate and the up tile side by side and
writes ``act(gate) * up``: the ``2 * I`` wide intermediate never reaches memory), multiplies by the
routing weight and writes each row at its copy index, in a float dtype or as FP8 with one scale per
128 columns (the down GEMM's input).

The operand formats are compile-time parameters (``/docs/kernels.md`` has the layouts):

* **rows** (:class:`RowFormat`): bf16 / fp16 / fp32; FP8-e4m3 or INT8 with fp32 scales per token
  ``[R, 1]``, per tensor ``[1]`` or (FP8) per 128-group ``[R, K / 128]``; NVFP4 (``[R, K / 2]`` packed
  e2m1, e4m3 scales ``[R, K / 16]``, a static fp32 global scale).
* **weights** (:class:`WeightFormat`, ``[E, N, K]`` or ``[E, N, K / 2]`` packed): the rows' float
  dtype; FP8 / INT8 with fp32 scales per channel ``[E, N]`` or per 128x128 block
  ``[E, ceil(N / 128), ceil(K / 128)]``; INT4 (two per byte, scales ``[E, N, K / G]`` in the rows'
  dtype, optional uint8 zero points, else 8); MXFP4 (e2m1, E8M0 scales ``[E, N, K / 32]``); NVFP4
  (e2m1, e4m3 scales ``[E, N, K / 16]``, fp32 global scales ``[E]``).

8-bit operands meet in ``tl.dot`` (FP8 accumulates in fp32, INT8 exactly in int32). Scales that change
every 128 K-elements (FP8 groups / blocks) scale each K-step's partial product before it is added
(the DeepGEMM / vLLM scheme; it also promotes Hopper's reduced-precision FP8 accumulation every
K-step). 4-bit operands are dequantized in registers to the compute dtype (the rows' float dtype, or
the output dtype for NVFP4 rows) and meet in a 16-bit ``tl.dot``: an e2m1 value times an E8M0 or e4m3
scale is exact in bf16 and fp16, so the only rounding is the accumulation's; NVFP4's global scales
multiply the finished accumulator. The K-loop runs in a fixed order for every row count, so with one launch
configuration a row's result does not depend on the other rows (batch invariance). At decode it may be split
into ranges of K-steps (``split_k``, :func:`default_split_k`): fp32 partial sums that
:func:`moe_gemm_reduce_kernel` adds in a fixed order before the epilogue (deterministic, but not the same
rounding, so batch-invariant tables never split).

On Hopper the launcher also picks, by its rules (docs/kernels.md, "How a launch is planned today"), weight tiles
copied by the tensor memory accelerator (a host-side descriptor, :func:`weight_tma_pays`) and a persistent grid
(:func:`default_grid`); both read the same values in the same order, so the output is bitwise the same.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import attrs
import torch
import triton
import triton.language as tl

from moeforge.kernels import decode_first, launch_memo, pdl, shuffle
from moeforge.kernels.bound_launch import BoundLaunch
from moeforge.kernels.pdl import device_capability
from moeforge.kernels.activations import ACT_NONE
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.launch_plan import (GRIDS, LaunchFacts, TensorDescriptor, default_grid, fitted_config,
                                          glu_strides, plan_launch, transposed_weight, vector_scales,
                                          weight_tma_applies)
from moeforge.kernels.dequant import (NVFP4_FOLD_REST, e2m1, e2m1_pairs, e4m3, e4m3_pairs,
                                      group_scales, packed_decoding, spread, unpair, weight_tile)
from moeforge.kernels.format_codes import (K_EVEN_VECTOR_SCALES, K_RAGGED, ROWS_FLOAT, ROWS_NVFP4, SCALES_GROUP,
                                           SCALES_ROW, W_FIRST_E2M1, W_FIRST_PACKED, W_FP8, W_INT8, W_NVFP4)
from moeforge.kernels.formats import (NVFP4_GROUP, SCALE_BLOCK, RowFormat, RowScales, WeightFormat,
                                      weight_operand)
from moeforge.kernels.gemm_epilogue import add_bias, epilogue, store
from moeforge.kernels.tile_order import grouped
from moeforge.kernels.sizes import cdiv, multiprocessors, next_power_of_2
from moeforge.kernels.stack_pairs import copy_adapters


# Row scale modes (A_SCALE): none, one per row (per token; per tensor with stride 0), per 128-group
# (FP8), per 16-block e4m3 (NVFP4).


# -- shared pieces ---------------------------------------------------------------------------------


@triton.jit
def _load_packed(ptrs, ok, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PER: tl.constexpr = 2):
    """The packed bytes ``[ROWS, BLOCK_K // 2]`` of K-step ``k`` (``ok``: the rows that exist); ``PER`` 8: the 32-bit
    words ``[ROWS, BLOCK_K // 8]`` of a shuffled e2m1 weight (``K`` a multiple of 8)."""
    if EVEN_K != K_RAGGED:
        return tl.load(ptrs, mask=ok[:, None], other=0)
    else:
        unit_ok = k * (BLOCK_K // PER) + tl.arange(0, BLOCK_K // PER) < K // PER
        return tl.load(ptrs, mask=ok[:, None] & unit_ok[None, :], other=0)


@triton.jit
def _step_scales(s_gate, z_gate, s_up, z_up, n_ok, k, K, stride_sg, stride_zg, GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr, GLU: tl.constexpr, CLAMP: tl.constexpr):
    """``(gate scales, gate zero points, up scales, up zero points)`` of K-step ``k`` (:func:`group_scales`, with
    ``CLAMP``); an absent one (no zero points, no up tile) is the gate scales again, never read."""
    sg = group_scales(s_gate, n_ok, k, K, stride_sg, GROUP, BLOCK_K, CLAMP)
    zg = sg
    if HAS_ZEROS:
        zg = group_scales(z_gate, n_ok, k, K, stride_zg, GROUP, BLOCK_K, CLAMP)
    su, zu = sg, zg
    if GLU:
        su = group_scales(s_up, n_ok, k, K, stride_sg, GROUP, BLOCK_K, CLAMP)
        if HAS_ZEROS:
            zu = group_scales(z_up, n_ok, k, K, stride_zg, GROUP, BLOCK_K, CLAMP)
    return sg, zg, su, zu


@triton.jit
def _weight_rows_tma(b_desc, row, col, UP: tl.constexpr, up_offset, B_TMA: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr):
    """The ``[ROWS, COLS]`` weight tile at tile row ``row`` and column ``col`` copied by TMA: the gate rows
    (``UP`` false) or the up rows. ``B_TMA`` 1: ``b_desc`` views the weight as ``[E * N_w, K]`` rows, the up
    rows ``up_offset`` below the gate rows; 2 (interleaved gate/up rows g0 u0 g1 u1 ...): as
    ``[E * N, 2, K]`` (row, gate or up, K): one box ``[ROWS, 1, COLS]`` takes every other row."""
    if B_TMA == 2:
        return tl.reshape(b_desc.load([row, UP, col]), (ROWS, COLS))
    else:
        return b_desc.load([row + UP * up_offset, col])


@triton.jit
def _dot8(a, b, INT8: tl.constexpr):
    """``a @ b`` of 8-bit operands as fp32 (INT8 sums exactly in int32, FP8 in fp32)."""
    if INT8:
        return tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    else:
        return tl.dot(a, b)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _lowest_bit(bits):
    """The index of the lowest set bit of the int64 ``bits`` (at most bit 31 set: a chunk of 32 adapters); 0 when
    none is set. The lowest bit alone, ``bits & -bits``, is a power of two, exact in fp32: its exponent is the
    index."""
    low = (bits & -bits).to(tl.float32)
    return tl.maximum((low.to(tl.int32, bitcast=True) >> 23) - 127, 0)


@triton.jit
def _stack_b(ub_adapter, gate_rows, up_rows, stride_ubn, u_ok, n_ok, GLU: tl.constexpr):
    """One adapter's ``B`` of the tile's expert, ``[R, BLOCK_N]`` (gate rows; with ``GLU`` the up rows too, else the
    gate tile again)."""
    ub = tl.load(ub_adapter + gate_rows[None, :] * stride_ubn, mask=u_ok[:, None] & n_ok[None, :], other=0.0)
    ub_up = ub
    if GLU:
        ub_up = tl.load(ub_adapter + up_rows[None, :] * stride_ubn, mask=u_ok[:, None] & n_ok[None, :], other=0.0)
    return ub, ub_up


@triton.jit
def _chosen_bits(uid, first, update_stack):
    """The adapters ``first .. first + 31`` that a row of the tile chose (``uid``: each row's adapter, -1 for none),
    a bit each: one OR over the rows."""
    in_chunk = (uid >= first) & (uid < first + 32) & (uid < update_stack)
    shift = tl.where(in_chunk, uid - first, 0).to(tl.int64)
    return tl.reduce(tl.where(in_chunk, tl.full(uid.shape, 1, tl.int64) << shift, tl.zeros(uid.shape, tl.int64)), 0,
                     _bit_or)


@triton.jit
def _update_operands(ub_ptr, expert, k_first, update_width, update_scale, stride_ube, stride_ubk,
                     UPDATE_K: tl.constexpr, SPLIT: tl.constexpr):
    """An update's K-step operands for the tile's expert: ``(the step's columns, their mask along the rank, the
    expert's B pointers, the scale)``; with a split K-loop the scale is 0 outside its first range, so the update is
    added once."""
    offs_u = tl.arange(0, UPDATE_K)
    u_ok = offs_u < update_width
    ub_expert = ub_ptr + expert * stride_ube + offs_u[:, None] * stride_ubk
    factor = update_scale
    if SPLIT:
        factor = tl.where(k_first == 0, update_scale, 0.0)
    return offs_u, u_ok, ub_expert, factor


@triton.jit
def _stack_update_rows(u_ptr, uid_ptr, ub_ptr, copies, row_ok, expert, k_first, update_width, update_scale,
                       update_stack, update_parts, stride_um, stride_up, stride_ube, stride_ubk, UPDATE_K: tl.constexpr,
                       SPLIT: tl.constexpr, UPDATE_PARTS: tl.constexpr):
    """A stack's update rows for the tile's copies, ``(u [BLOCK_M, UPDATE_K] weighed, each row's adapter (-1: none),
    the expert's B pointers, the rank's mask, the scale)``. With ``UPDATE_PARTS`` u in parts (a stack's x Aᵀ over
    ranges of K, fp32 [P, copies, R]; moeforge.kernels.stack_shrink): summed here in one fixed order, and weighed by
    each copy's raw id: the scale for an adapter of the stack, 0 for none (-1), NaN outside it, whose rows then take
    adapter 0's K-step (stack_pairs). Else u [copies, R] and the ids as given. With a split K-loop, in its first
    range only."""
    offs_u, u_ok, ub_expert, factor = _update_operands(ub_ptr, expert, k_first, update_width, update_scale,
                                                       stride_ube, stride_ubk, UPDATE_K, SPLIT)
    if UPDATE_PARTS:
        parts = tl.arange(0, UPDATE_PARTS)
        u = tl.sum(tl.load(u_ptr + parts[:, None, None] * stride_up
                           + (copies.to(tl.int64)[:, None] * stride_um + offs_u[None, :])[None],
                           mask=(parts < update_parts)[:, None, None] & (row_ok[:, None] & u_ok[None, :])[None],
                           other=0.0), axis=0)
        chosen, used = copy_adapters(uid_ptr, copies, row_ok, update_stack, factor)
        u = (u * used[:, None]).to(ub_ptr.dtype.element_ty)
        uid = tl.where(row_ok, chosen, -1)
    else:
        u = tl.load(u_ptr + copies.to(tl.int64)[:, None] * stride_um + offs_u[None, :],
                    mask=row_ok[:, None] & u_ok[None, :], other=0.0)
        u = (u * factor).to(u_ptr.dtype.element_ty)  # (scaled in its dtype, as the rank-wide product's output was)
        uid = tl.load(uid_ptr + copies, mask=row_ok, other=-1)
    return u, uid, ub_expert, u_ok, factor


@triton.jit
def _drain_mma(x):
    """Wait until every warpgroup MMA issued so far has finished (``wgmma.wait_group 0``; ``x``, any int32, only gives
    the instruction an operand)."""
    return tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


# -- the kernel ------------------------------------------------------------------------------------


@triton.jit
def _gemm_tile(
    pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS: tl.constexpr,
    BLOCK_M: tl.constexpr, ALIGN_RATIO: tl.constexpr,
):
    """Tile ``(pid_m, pid_n)``: ``BLOCK_M`` aligned rows of one expert times ``BLOCK_N`` output columns, over the
    K-steps ``k_first .. k_last - 1``; with ``SPLIT``, one range of a split K-loop (:func:`moe_gemm_reduce_kernel`).
    The rows were aligned by blocks of ``ALIGN_RATIO * BLOCK_M``: ``block_expert`` has one entry per aligned block.
    ``DRAIN_MMA``: each K-step ends by waiting for its warpgroup MMAs (:func:`drain_mma`)."""
    (a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, b_global_ptr, bias_ptr, c_ptr, c_scale_ptr, weights_ptr,
     sorted_ids_ptr, block_expert_ptr, u_ptr, ub_ptr, uid_ptr) = ops
    (N, K, num_copies, rows_per_a, a_global, expert_first, update_width, update_scale, update_stack,
     update_parts) = sizes
    (stride_am, stride_ak, stride_asm, stride_ask, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
     stride_bze, stride_bzn, stride_bzk, stride_bias_e, stride_bias_n, stride_cm, stride_cn, stride_csm, stride_csg,
     gate_stride, up_offset, alpha, limit, stride_um, stride_ubs, stride_ube, stride_ubn, stride_ubk,
     stride_up) = strides
    A_FMT: tl.constexpr = FLAGS[0]
    A_SCALE: tl.constexpr = FLAGS[1]
    B_FMT: tl.constexpr = FLAGS[2]
    B_BLOCKED: tl.constexpr = FLAGS[3]
    B_TILE_SCALE: tl.constexpr = FLAGS[4]
    GROUP: tl.constexpr = FLAGS[5]
    HAS_ZEROS: tl.constexpr = FLAGS[6]
    QUANT_OUT: tl.constexpr = FLAGS[7]
    ACT: tl.constexpr = FLAGS[8]
    GLU: tl.constexpr = FLAGS[9]
    HAS_BIAS: tl.constexpr = FLAGS[10]
    MUL_WEIGHTS: tl.constexpr = FLAGS[11]
    EVEN_K: tl.constexpr = FLAGS[12]
    PRECISION: tl.constexpr = FLAGS[13]
    SWAP: tl.constexpr = FLAGS[14]
    PTX: tl.constexpr = FLAGS[15]
    FP8_CVT: tl.constexpr = FLAGS[16]
    CVT_BY_FOUR: tl.constexpr = FLAGS[17]
    B_TMA: tl.constexpr = FLAGS[18]
    SPLIT: tl.constexpr = FLAGS[19]
    PREFETCH: tl.constexpr = FLAGS[20]
    BLOCK_N: tl.constexpr = FLAGS[21]
    BLOCK_K: tl.constexpr = FLAGS[22]
    SCALE_FOLD: tl.constexpr = FLAGS[23]
    B_GLOBAL: tl.constexpr = FLAGS[24]
    EXPERT_RANGE: tl.constexpr = FLAGS[25]
    B_SHUFFLED: tl.constexpr = FLAGS[26]
    DRAIN_MMA: tl.constexpr = FLAGS[27]
    UPDATE_K: tl.constexpr = FLAGS[28]
    UPDATE_PRECISION: tl.constexpr = FLAGS[29]
    UPDATE_STACK: tl.constexpr = FLAGS[30]
    UPDATE_PARTS: tl.constexpr = FLAGS[31]
    UPDATE_WIDE: tl.constexpr = FLAGS[32]
    UPDATE_GROUP: tl.constexpr = FLAGS[33]

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    copies = tl.load(sorted_ids_ptr + offs_m)
    row_ok = copies < num_copies
    expert = tl.load(block_expert_ptr + pid_m // ALIGN_RATIO).to(tl.int64)
    if EXPERT_RANGE:  # the per-expert operands hold experts expert_first, expert_first + 1, ... only
        expert -= expert_first
    a_rows = (copies // rows_per_a).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    gate_rows = offs_n * gate_stride
    up_rows = gate_rows + up_offset
    # the weight's rows (and its scales' and zero points'); the bias keeps gate_rows / up_rows. B_SHUFFLED 2: interleaved
    # gate/up rows stored by 32-row chunks of 16 gate rows then their 16 up rows (kernels/shuffle.py, paired rows)
    if B_SHUFFLED == 2:
        w_gate_rows = (offs_n // 16) * 32 + offs_n % 16
        w_up_rows = w_gate_rows + 16
    else:
        w_gate_rows = gate_rows
        w_up_rows = up_rows

    # The compute dtype of a dequantized 4-bit operand: the rows' float dtype, or the output's.
    if A_FMT == ROWS_FLOAT:
        DTYPE = a_ptr.dtype.element_ty
    else:
        DTYPE = c_ptr.dtype.element_ty
    if A_FMT == ROWS_NVFP4:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_kb[None, :] * stride_ak
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    if A_FMT == ROWS_NVFP4:
        a_ptrs += k_first * (BLOCK_K // 2) * stride_ak
    else:
        a_ptrs += k_first * BLOCK_K * stride_ak
    a_scale_rows = a_scale_ptr + a_rows * stride_asm
    b_expert = b_ptr + expert * stride_be
    # a shuffled e2m1 weight is read as 32-bit words (its decoding takes each word apart: kernels/shuffle.py)
    WORDS: tl.constexpr = B_SHUFFLED > 0 and B_FMT >= W_FIRST_E2M1
    PER: tl.constexpr = 8 if WORDS else 2  # K-elements per loaded element of a packed weight
    CLAMP: tl.constexpr = EVEN_K == K_EVEN_VECTOR_SCALES  # a step's 4-bit scale groups read as vectors (group_scales, vector_scales)
    if WORDS:  # [N, K / 8] words (the bytes contiguous: stride_bk 1)
        offs_kw = tl.arange(0, BLOCK_K // 8)
        b_gate = (b_expert + w_gate_rows[:, None] * stride_bn).to(tl.pointer_type(tl.int32)) + offs_kw[None, :]
        b_up = (b_expert + w_up_rows[:, None] * stride_bn).to(tl.pointer_type(tl.int32)) + offs_kw[None, :]
        b_step = BLOCK_K // 8
    elif B_FMT >= W_FIRST_PACKED:  # packed [N, K / 2]: K-contiguous byte tiles
        b_gate = b_expert + w_gate_rows[:, None] * stride_bn + offs_kb[None, :] * stride_bk
        b_up = b_expert + w_up_rows[:, None] * stride_bn + offs_kb[None, :] * stride_bk
        b_step = (BLOCK_K // 2) * stride_bk
    else:
        b_gate = b_expert + offs_k[:, None] * stride_bk + gate_rows[None, :] * stride_bn
        b_up = b_expert + offs_k[:, None] * stride_bk + up_rows[None, :] * stride_bn
        b_step = BLOCK_K * stride_bk
    b_gate += k_first * b_step
    b_up += k_first * b_step
    s_expert = b_scale_ptr + expert * stride_bse
    s_gate = s_expert + w_gate_rows * stride_bsn
    s_up = s_expert + w_up_rows * stride_bsn
    z_gate = b_zero_ptr + expert * stride_bze + w_gate_rows * stride_bzn
    z_up = b_zero_ptr + expert * stride_bze + w_up_rows * stride_bzn
    # B_TMA: the weight tiles are copied by Hopper's tensor memory accelerator through ``b_desc``, a
    # descriptor of the weight viewed as ``[E * N_w, K]`` (packed: ``K / 2`` bytes) rows, or for interleaved
    # gate/up rows as ``[E * N, 2, K]`` (:func:`_weight_rows_tma`); the tile's rows start at ``b_row``. A
    # tile's rows past N read the next rows (the next expert's, or zeros past the last expert): they only
    # reach the columns past N, which are never stored (and never scale an FP8 group). B_TMA 3: a transposed
    # float weight (the row gradient's), described as the [E, K, N_w] tensor it views; its boxes are clipped
    # at each expert's K and N edges (zeros), the reduction's tail included.
    if B_TMA >= 2:
        b_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
    else:
        b_row = (expert * (stride_be // stride_bn) + pid_n * BLOCK_N).to(tl.int32)
    # B_TILE_SCALE: the 128x128 weight-scale blocks of the tile's gate rows and of its up rows
    gate_block = (pid_n * BLOCK_N * gate_stride) // 128
    up_block = (pid_n * BLOCK_N * gate_stride + up_offset) // 128

    # 8-bit scales that change every 128 K-elements (PER_K) scale each step's partial product
    # (BLOCK_K divides 128, so a step never straddles two scales); INT8 otherwise sums exactly in int32.
    PER_K: tl.constexpr = A_SCALE == SCALES_GROUP or B_BLOCKED
    # SWAP (4-bit weights): the dequantized weight tile is the MMA's left operand, which may live in
    # registers (Hopper's wgmma reads only its right operand from shared memory): out^T = W @ rows^T,
    # and the token rows are the MMA's narrow N side (a few rows per expert waste no MMA work). The
    # accumulators are transposed once at the end.
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif B_FMT == W_INT8 and not PER_K:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # PREFETCH (4-bit weights): each K-step's scales are loaded one step ahead (single-byte loads the
    # pipeliner leaves in the loop stall the step that uses them); the launcher asks for it where that pays
    # (prefetch_scales).
    if B_FMT >= W_FIRST_PACKED and PREFETCH:
        sg_next, zg_next, su_next, zu_next = _step_scales(s_gate, z_gate, s_up, z_up, n_ok, k_first, K, stride_bsk,
                                                          stride_bzk, GROUP, BLOCK_K, HAS_ZEROS, GLU, CLAMP)
    # A stack's update, each copy its own adapter's K-step, in a plain GEMM (the down projection): its rows, ids, the
    # tile's first chosen adapters and the lowest one's B are loaded before the K-loop, so that their latency hides
    # behind it (after it they are a chain of dependent loads as long as a short K-loop: the down GEMM's six steps at
    # Qwen3's shape). The gate/up GEMM loads them after its K-loop: held across it, its two B tiles cost it a third
    # of its blocks per multiprocessor (docs/notes/kernels-log.md).
    EARLY_STACK: tl.constexpr = UPDATE_K and UPDATE_STACK and not UPDATE_WIDE and not GLU
    if EARLY_STACK:
        u, uid, ub_expert, u_ok, factor = _stack_update_rows(
            u_ptr, uid_ptr, ub_ptr, copies, row_ok, expert, k_first, update_width, update_scale, update_stack,
            update_parts, stride_um, stride_up, stride_ube, stride_ubk, UPDATE_K, SPLIT, UPDATE_PARTS)
        bits_first = _chosen_bits(uid, 0, update_stack)
        ub_first, ub_up_first = _stack_b(ub_expert + _lowest_bit(bits_first) * stride_ubs, gate_rows, up_rows,
                                         stride_ubn, u_ok, n_ok, GLU)
    if not SPLIT:  # the whole K-loop, its bound computed here (as before the split existed: same code)
        k_last = tl.cdiv(K, BLOCK_K)
    for k in range(k_first, k_last):
        k_ok = offs_k < K - k * BLOCK_K
        # -- the rows' tile [BLOCK_M, BLOCK_K] (NVFP4 rows dequantized to the compute dtype)
        if A_FMT == ROWS_NVFP4:
            packed = _load_packed(a_ptrs, row_ok, k, K, BLOCK_K, EVEN_K)
            if PTX:
                sa = group_scales(a_scale_rows, row_ok, k, K // 2, stride_ask, 8, BLOCK_K // 2)
                row_scales = e4m3_pairs(sa, DTYPE, FP8_CVT, CVT_BY_FOUR and BLOCK_K // 16 >= 4)
                pairs = e2m1_pairs(packed, spread(row_scales, 8, BLOCK_M, BLOCK_K // 2), DTYPE)
                a = unpair(pairs, DTYPE, BLOCK_M, BLOCK_K)
            else:
                sa = group_scales(a_scale_rows, row_ok, k, K, stride_ask, 16, BLOCK_K)
                a = (e2m1(packed, BLOCK_M, BLOCK_K) * spread(e4m3(sa), 16, BLOCK_M, BLOCK_K)).to(DTYPE)
            a_ptrs += (BLOCK_K // 2) * stride_ak
        else:
            if EVEN_K != K_RAGGED:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
        if B_FMT >= W_FIRST_PACKED:
            # -- 4-bit weights, dequantized in registers
            if PREFETCH:
                sg, zg, su, zu = sg_next, zg_next, su_next, zu_next
                sg_next, zg_next, su_next, zu_next = _step_scales(s_gate, z_gate, s_up, z_up, n_ok, k + 1, K,
                                                                  stride_bsk, stride_bzk, GROUP, BLOCK_K, HAS_ZEROS,
                                                                  GLU, CLAMP)
            else:
                sg, zg, su, zu = _step_scales(s_gate, z_gate, s_up, z_up, n_ok, k, K, stride_bsk, stride_bzk, GROUP,
                                              BLOCK_K, HAS_ZEROS, GLU, CLAMP)
            if B_TMA:
                packed = _weight_rows_tma(b_desc, b_row, k * (BLOCK_K // PER), 0, up_offset, B_TMA, BLOCK_N,
                                          BLOCK_K // PER)
                if GLU:
                    packed_up = _weight_rows_tma(b_desc, b_row, k * (BLOCK_K // PER), 1, up_offset, B_TMA, BLOCK_N,
                                                 BLOCK_K // PER)
            else:
                packed = _load_packed(b_gate, n_ok, k, K, BLOCK_K, EVEN_K, PER)
                if GLU:
                    packed_up = _load_packed(b_up, n_ok, k, K, BLOCK_K, EVEN_K, PER)
                b_gate += b_step
                b_up += b_step
            b = weight_tile(packed, sg, zg, DTYPE, B_FMT, GROUP, HAS_ZEROS, PTX, FP8_CVT, CVT_BY_FOUR,
                            SCALE_FOLD, BLOCK_N, BLOCK_K, B_SHUFFLED)
            if GLU:
                bu = weight_tile(packed_up, su, zu, DTYPE, B_FMT, GROUP, HAS_ZEROS, PTX, FP8_CVT, CVT_BY_FOUR,
                                 SCALE_FOLD, BLOCK_N, BLOCK_K, B_SHUFFLED)
            if SWAP:
                a_t = tl.trans(a)
                acc = tl.dot(b, a_t, acc, input_precision=PRECISION)
                if GLU:
                    acc_up = tl.dot(bu, a_t, acc_up, input_precision=PRECISION)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
                if GLU:
                    acc_up = tl.dot(a, tl.trans(bu), acc_up, input_precision=PRECISION)
        else:
            # -- the weight tiles [BLOCK_K, BLOCK_N]
            if B_TMA == 3:  # a transposed weight: [1, BLOCK_K, BLOCK_N] boxes of the [E, K, N_w] tensor it views
                b = tl.reshape(b_desc.load([expert.to(tl.int32), k * BLOCK_K, pid_n * BLOCK_N]), (BLOCK_K, BLOCK_N))
            elif B_TMA:
                b = tl.trans(_weight_rows_tma(b_desc, b_row, k * BLOCK_K, 0, up_offset, B_TMA, BLOCK_N, BLOCK_K))
                if GLU:
                    bu = tl.trans(_weight_rows_tma(b_desc, b_row, k * BLOCK_K, 1, up_offset, B_TMA, BLOCK_N, BLOCK_K))
            else:
                if EVEN_K != K_RAGGED:
                    b = tl.load(b_gate, mask=n_ok[None, :], other=0.0)
                    if GLU:
                        bu = tl.load(b_up, mask=n_ok[None, :], other=0.0)
                else:
                    b = tl.load(b_gate, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    if GLU:
                        bu = tl.load(b_up, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                b_gate += b_step
                b_up += b_step
            # -- multiply-accumulate
            if B_FMT == W_FP8 or B_FMT == W_INT8:
                if PER_K:
                    kb = (k * BLOCK_K) // 128
                    part = _dot8(a, b, B_FMT == W_INT8)
                    if GLU:
                        part_up = _dot8(a, bu, B_FMT == W_INT8)
                    if B_TILE_SCALE:
                        # the tile's gate (and up) weight rows lie in one 128-row scale block: the step's
                        # scale is one per row (the rows' group scale times the block's), one multiply-add
                        # per element
                        sb = tl.load(s_expert + gate_block * stride_bsn + kb * stride_bsk)
                        if GLU:
                            sbu = tl.load(s_expert + up_block * stride_bsn + kb * stride_bsk)
                        if A_SCALE == SCALES_GROUP:
                            sa = tl.load(a_scale_rows + kb * stride_ask, mask=row_ok, other=0.0)
                            acc += part * (sa * sb)[:, None]
                            if GLU:
                                acc_up += part_up * (sa * sbu)[:, None]
                        else:
                            acc += part * sb
                            if GLU:
                                acc_up += part_up * sbu
                    else:
                        if A_SCALE == SCALES_GROUP:
                            sa = tl.load(a_scale_rows + kb * stride_ask, mask=row_ok, other=0.0)[:, None]
                            part = part * sa
                            if GLU:
                                part_up = part_up * sa
                        if B_BLOCKED:
                            sb = tl.load(s_expert + (gate_rows // 128) * stride_bsn + kb * stride_bsk, mask=n_ok,
                                         other=0.0)
                            part = part * sb[None, :]
                            if GLU:
                                sbu = tl.load(s_expert + (up_rows // 128) * stride_bsn + kb * stride_bsk,
                                              mask=n_ok, other=0.0)
                                part_up = part_up * sbu[None, :]
                        acc += part
                        if GLU:
                            acc_up += part_up
                elif B_FMT == W_INT8:
                    acc = tl.dot(a, b, acc, out_dtype=tl.int32)
                    if GLU:
                        acc_up = tl.dot(a, bu, acc_up, out_dtype=tl.int32)
                else:
                    acc = tl.dot(a, b, acc)
                    if GLU:
                        acc_up = tl.dot(a, bu, acc_up)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                if GLU:
                    acc_up = tl.dot(a, bu, acc_up, input_precision=PRECISION)
        if DRAIN_MMA:
            _drain_mma(k)

    # Scales constant along K multiply the finished accumulator once.
    if SWAP:
        out = tl.trans(acc)
        out_up = tl.trans(acc_up)
    else:
        out = acc.to(tl.float32)
        out_up = acc_up.to(tl.float32)
    if A_SCALE == SCALES_ROW:
        sa = tl.load(a_scale_rows, mask=row_ok, other=0.0)[:, None]
        out = out * sa
        out_up = out_up * sa
    if (B_FMT == W_FP8 or B_FMT == W_INT8) and not B_BLOCKED:
        out = out * tl.load(s_gate, mask=n_ok, other=0.0)[None, :]
        if GLU:
            out_up = out_up * tl.load(s_up, mask=n_ok, other=0.0)[None, :]
    NVFP4_FOLD: tl.constexpr = SCALE_FOLD and B_FMT == W_NVFP4  # the tiles held 2**-7 times the values (dequant.py)
    if B_GLOBAL or A_FMT == ROWS_NVFP4 or NVFP4_FOLD:
        g = a_global
        if B_GLOBAL:
            g = g * tl.load(b_global_ptr + expert)
        if NVFP4_FOLD:  # (exact: a power of two)
            g = g * NVFP4_FOLD_REST
        out = out * g
        out_up = out_up * g
    if UPDATE_K:
        # A low-rank update, scale * u[copy] @ ub[expert]^T (u [copies, R] in copy order, ub [E, N_w, R]; an adapter's,
        # moeforge.adapters): one more K-step of UPDATE_K on the finished product, before the epilogue; with a split
        # K-loop, in its first range only.
        if UPDATE_STACK and not EARLY_STACK:
            u, uid, ub_expert, u_ok, factor = _stack_update_rows(
                u_ptr, uid_ptr, ub_ptr, copies, row_ok, expert, k_first, update_width, update_scale, update_stack,
                update_parts, stride_um, stride_up, stride_ube, stride_ubk, UPDATE_K, SPLIT, UPDATE_PARTS)
        elif not UPDATE_STACK:
            offs_u, u_ok, ub_expert, factor = _update_operands(ub_ptr, expert, k_first, update_width, update_scale,
                                                               stride_ube, stride_ubk, UPDATE_K, SPLIT)
            if not UPDATE_WIDE:
                u = tl.load(u_ptr + copies.to(tl.int64)[:, None] * stride_um + offs_u[None, :],
                            mask=row_ok[:, None] & u_ok[None, :], other=0.0)
                u = (u * factor).to(u_ptr.dtype.element_ty)  # (scaled in its dtype, as the rank-wide product's was)
        if UPDATE_WIDE:
            # every adapter's columns at once (u [copies, S·R]: each copy's x Aᵀ by every adapter of the stack, zero
            # outside its own adapter's R columns, already weighed; moeforge.kernels.stack_wide): K-steps of UPDATE_K
            # columns on every tile, each covering UPDATE_GROUP adapters of UPDATE_K // UPDATE_GROUP columns (the rank
            # padded to a power of two), B [S, E, N_w, R] gathered adapter by adapter into one tile; no ids, no turns.
            # A few wide steps instead of one step per adapter: each step's MMA waits for its tiles' stores, so the
            # step count, not the flops, set the time (docs/notes/kernels-log.md). Triton pipelines the steps, three
            # stages: the tiles go to shared memory by cp.async two steps ahead of the MMA, holding no registers (the
            # masks are constant over each adapter's columns, so the loads qualify). UPDATE_WIDE 1: R is the padded
            # width, so no mask runs along R and the loads are whole vectors (2: a rank below it, masked).
            PADDED: tl.constexpr = UPDATE_K // UPDATE_GROUP
            offs_w = tl.arange(0, UPDATE_K)
            member = offs_w // PADDED  # (which adapter of the step each column belongs to)
            within = offs_w % PADDED
            width = PADDED  # (a compile-time stride: the rows' loads whole vectors too)
            if UPDATE_WIDE == 2:
                width = update_width
            u_rows = u_ptr + copies.to(tl.int64)[:, None] * stride_um + (member * width + within)[None, :]
            ub_cols = ub_ptr + expert * stride_ube + member[:, None] * stride_ubs + within[:, None] * stride_ubk
            ub_gate = ub_cols + gate_rows[None, :] * stride_ubn
            ub_up = ub_cols + up_rows[None, :] * stride_ubn
            for first in tl.range(0, update_stack, UPDATE_GROUP, num_stages=3):
                used = member < update_stack - first
                if UPDATE_WIDE == 2:
                    used = used & (within < update_width)
                u = tl.load(u_rows + first * width, mask=row_ok[:, None] & used[None, :], other=0.0)
                ub = tl.load(ub_gate + first * stride_ubs, mask=used[:, None] & n_ok[None, :], other=0.0)
                if SPLIT:  # (the first range's alone)
                    u = (u * factor).to(u_ptr.dtype.element_ty)
                out = tl.dot(u, ub, out, input_precision=UPDATE_PRECISION)
                if GLU:
                    ub_up_here = tl.load(ub_up + first * stride_ubs, mask=used[:, None] & n_ok[None, :], other=0.0)
                    out_up = tl.dot(u, ub_up_here, out_up, input_precision=UPDATE_PRECISION)
        elif UPDATE_STACK:
            # a stack of adapters (ub [S, E, N_w, R]): each copy's row meets its own adapter's B (uid [copies]), one
            # K-step per adapter that a row of this tile chose, the other rows zero in it. The chosen adapters are
            # found by one OR over the tile's rows per 32 adapters (a bit each; one reduction across the warps, not
            # one per adapter) and visited in increasing order, the next one's B loaded before this one's MMA, so
            # that its latency hides behind the MMA.
            if EARLY_STACK:  # (the first chunk's bits and its lowest adapter's B loaded before the K-loop)
                bits, ub, ub_up = bits_first, ub_first, ub_up_first
            for first in range(0, update_stack, 32):
                if EARLY_STACK:
                    if first > 0:
                        bits = _chosen_bits(uid, first, update_stack)
                        ub, ub_up = _stack_b(ub_expert + (first + _lowest_bit(bits)) * stride_ubs, gate_rows,
                                             up_rows, stride_ubn, u_ok, n_ok, GLU)
                else:
                    bits = _chosen_bits(uid, first, update_stack)
                    ub, ub_up = _stack_b(ub_expert + (first + _lowest_bit(bits)) * stride_ubs, gate_rows, up_rows,
                                         stride_ubn, u_ok, n_ok, GLU)
                adapter = first + _lowest_bit(bits)
                while bits != 0:
                    u_here = tl.where((uid == adapter)[:, None], u, tl.zeros_like(u))
                    bits = bits & (bits - 1)
                    after = first + _lowest_bit(bits)  # (``first`` when none is left: loaded, never used)
                    ub_next, ub_up_next = _stack_b(ub_expert + after * stride_ubs, gate_rows, up_rows, stride_ubn,
                                                   u_ok, n_ok, GLU)
                    out = tl.dot(u_here, ub, out, input_precision=UPDATE_PRECISION)
                    if GLU:
                        out_up = tl.dot(u_here, ub_up, out_up, input_precision=UPDATE_PRECISION)
                    ub, ub_up, adapter = ub_next, ub_up_next, after
        else:
            ub = tl.load(ub_expert + gate_rows[None, :] * stride_ubn, mask=u_ok[:, None] & n_ok[None, :], other=0.0)
            out = tl.dot(u, ub, out, input_precision=UPDATE_PRECISION)  # accumulated in place: no second tile
            if GLU:
                ub_up = tl.load(ub_expert + up_rows[None, :] * stride_ubn, mask=u_ok[:, None] & n_ok[None, :],
                                other=0.0)
                out_up = tl.dot(u, ub_up, out_up, input_precision=UPDATE_PRECISION)
    if SPLIT:
        # one range of a split K-loop: its partial sums, with everything linear that is constant along K
        # (the bias with the first range), go to the fp32 partials [splits, copies, N (gate) | N (up)];
        # moe_gemm_reduce_kernel adds them in order and applies the rest of the epilogue.
        if HAS_BIAS:  # (the first range's test as a block: the interpreter takes no scalar in a mask)
            first = n_ok & (offs_n * 0 + k_first == 0)
            out, out_up = add_bias(out, out_up, expert, gate_rows, up_offset, first, bias_ptr, stride_bias_e,
                                    stride_bias_n, GLU)
        p_rows = p_ptr + copies.to(tl.int64)[:, None] * stride_pm
        tl.store(p_rows + offs_n[None, :], out, mask=row_ok[:, None] & n_ok[None, :])
        if GLU:
            tl.store(p_rows + (N + offs_n)[None, :], out_up, mask=row_ok[:, None] & n_ok[None, :])
    else:
        out = epilogue(out, out_up, expert, gate_rows, up_offset, n_ok, copies, row_ok,
                        bias_ptr, stride_bias_e, stride_bias_n, weights_ptr, alpha, limit,
                        ACT, GLU, HAS_BIAS, MUL_WEIGHTS)
        store(out, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn, c_scale_ptr, stride_csm,
               stride_csg, QUANT_OUT, BLOCK_M, BLOCK_N)


@triton.jit
def _gemm_block(
    pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS: tl.constexpr,
    BLOCK_M: tl.constexpr, ALIGN_RATIO: tl.constexpr, HALF_TAIL: tl.constexpr,
):
    """:func:`_gemm_tile` of row block ``pid_m``; with ``HALF_TAIL``, a block whose second half is only padding
    (an expert's last block, at most ``BLOCK_M / 2`` rows: the rows are sorted by expert, each expert's padding
    after its rows) as its first half alone, a ``BLOCK_M / 2``-row tile: half the MMA work on the same rows (bitwise
    the same where both tiles take the same MMA instruction: see :func:`moe_gemm`)."""
    sorted_ids_ptr = ops[10]
    num_copies = sizes[2]
    # a Python False unless HALF_TAIL: the branch below then compiles to the full tile alone
    half = False
    if HALF_TAIL:
        half = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_copies
    if half:
        _gemm_tile(2 * pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS, BLOCK_M // 2, 2 * ALIGN_RATIO)
    else:
        _gemm_tile(pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS, BLOCK_M, ALIGN_RATIO)


@triton.jit
def moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, b_zero_ptr, b_global_ptr, bias_ptr, c_ptr, c_scale_ptr, weights_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, p_ptr, u_ptr, ub_ptr, uid_ptr,
    N, K, num_copies, rows_per_a, a_global, expert_first, update_width, update_scale, update_stack, update_parts,
    block_range_ptr,
    k_steps_split,
    stride_ps, stride_pm,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,
    stride_bse, stride_bsn, stride_bsk,
    stride_bze, stride_bzn, stride_bzk,
    stride_bias_e, stride_bias_n,
    stride_cm, stride_cn, stride_csm, stride_csg,
    gate_stride, up_offset,
    alpha, limit,
    stride_um, stride_ubs, stride_ube, stride_ubn, stride_ubk, stride_up,
    A_FMT: tl.constexpr, A_SCALE: tl.constexpr, B_FMT: tl.constexpr, B_BLOCKED: tl.constexpr,
    B_TILE_SCALE: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, QUANT_OUT: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr, PTX: tl.constexpr, FP8_CVT: tl.constexpr,
    CVT_BY_FOUR: tl.constexpr, B_TMA: tl.constexpr, SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ALIGN_RATIO: tl.constexpr, SCALE_FOLD: tl.constexpr, HALF_TAIL: tl.constexpr, PERSISTENT: tl.constexpr,
    B_GLOBAL: tl.constexpr, EXPERT_RANGE: tl.constexpr, B_SHUFFLED: tl.constexpr, DRAIN_MMA: tl.constexpr,
    UPDATE_K: tl.constexpr, UPDATE_PRECISION: tl.constexpr, UPDATE_STACK: tl.constexpr, UPDATE_PARTS: tl.constexpr,
    UPDATE_WIDE: tl.constexpr, UPDATE_GROUP: tl.constexpr, PDL: tl.constexpr,
):
    """The grid over the tiles (``PERSISTENT``: 0 one program per tile, 1 persistent, 2 persistent with the
    tile loop flattened into the K-loop; :func:`default_grid`) around :func:`_gemm_tile`. The kernel's arguments are
    spelled out here only: the tiles receive them as four tuples (operands, sizes, strides, the compile-time
    flags), which Triton unpacks at compile time (the same machine code as flat arguments). ``SPLIT`` (one program
    per tile): the grid's second axis splits the K-loop into ranges of ``k_steps_split`` steps, each writing
    its partial sums to ``p_ptr`` (``[splits, copies, N]``, or ``2 N`` wide with the up columns after the
    gate ones; :func:`moe_gemm_reduce_kernel` finishes them). ``PDL``: launched as a programmatic dependent
    (:mod:`moeforge.kernels.pdl`), it first waits for the kernel before it."""
    pdl.wait_for_the_kernel_before(PDL)
    # the operands, sizes, strides and compile-time flags every tile reads, passed down as four tuples
    ops = (a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, b_global_ptr, bias_ptr, c_ptr, c_scale_ptr, weights_ptr,
           sorted_ids_ptr, block_expert_ptr, u_ptr, ub_ptr, uid_ptr)
    sizes = (N, K, num_copies, rows_per_a, a_global, expert_first, update_width, update_scale, update_stack,
             update_parts)
    strides = (stride_am, stride_ak, stride_asm, stride_ask, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn,
               stride_bsk, stride_bze, stride_bzn, stride_bzk, stride_bias_e, stride_bias_n, stride_cm, stride_cn,
               stride_csm, stride_csg, gate_stride, up_offset, alpha, limit, stride_um, stride_ubs, stride_ube,
               stride_ubn, stride_ubk, stride_up)
    FLAGS: tl.constexpr = (A_FMT, A_SCALE, B_FMT, B_BLOCKED, B_TILE_SCALE, GROUP, HAS_ZEROS, QUANT_OUT, ACT, GLU,
                            HAS_BIAS, MUL_WEIGHTS, EVEN_K, PRECISION, SWAP, PTX, FP8_CVT, CVT_BY_FOUR, B_TMA, SPLIT,
                            PREFETCH, BLOCK_N, BLOCK_K, SCALE_FOLD, B_GLOBAL, EXPERT_RANGE, B_SHUFFLED, DRAIN_MMA,
                            UPDATE_K, UPDATE_PRECISION, UPDATE_STACK, UPDATE_PARTS, UPDATE_WIDE, UPDATE_GROUP)
    num_padded = tl.load(num_padded_ptr)
    k_first = 0
    k_last = 0  # without SPLIT, _gemm_tile runs the whole K-loop
    if SPLIT:
        k_first = tl.program_id(1) * k_steps_split
        k_last = tl.minimum(k_first + k_steps_split, tl.cdiv(K, BLOCK_K))
        p_ptr += tl.program_id(1).to(tl.int64) * stride_ps
    if PERSISTENT:
        # a persistent grid (1; 2: flattened): each program takes tiles grid-stride over the aligned
        # blocks that exist; with EXPERT_RANGE, over the aligned blocks block_range_ptr[0] .. [1] - 1 only
        num_pid_m = num_padded // BLOCK_M
        m_first = 0
        if EXPERT_RANGE:
            m_first = tl.load(block_range_ptr) * ALIGN_RATIO
            num_pid_m = tl.load(block_range_ptr + 1) * ALIGN_RATIO - m_first
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=PERSISTENT == 2):
            pid_m, pid_n = grouped(tile, num_pid_m, num_pid_n, GROUP_M)
            if EXPERT_RANGE:
                pid_m += m_first
            _gemm_block(pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS, BLOCK_M,
                        ALIGN_RATIO, HALF_TAIL)
    else:
        pid_m, pid_n = grouped(tl.program_id(0), tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N)), tl.cdiv(N, BLOCK_N),
                                GROUP_M)
        live = pid_m * BLOCK_M < num_padded
        if ALIGN_RATIO > 1:  # a block of only padding rows (aligned by a larger block) has nothing to compute
            live = live & (tl.load(sorted_ids_ptr + pid_m * BLOCK_M) < num_copies)
        if live:
            _gemm_block(pid_m, pid_n, k_first, k_last, p_ptr, stride_pm, ops, b_desc, sizes, strides, FLAGS, BLOCK_M,
                        ALIGN_RATIO, HALF_TAIL)


@triton.jit
def moe_gemm_reduce_kernel(
    p_ptr, c_ptr, c_scale_ptr, weights_ptr, sorted_ids_ptr, num_padded_ptr,
    N, num_copies, splits, stride_ps, stride_pm, stride_cm, stride_cn, stride_csm, stride_csg, alpha, limit,
    ACT: tl.constexpr, GLU: tl.constexpr, MUL_WEIGHTS: tl.constexpr, QUANT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """The end of a split K-loop: over the same aligned blocks as the GEMM, each row's ``splits`` partial
    sums (``p_ptr [splits, copies, N | 2 N]``, scaled and with the bias) added in order, then the activation,
    the routing weight and the store of :func:`_gemm_tile`'s epilogue (a fixed order: deterministic)."""
    pdl.wait_for_the_kernel_before(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        copies = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = copies < num_copies
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        ok = row_ok[:, None] & n_ok[None, :]
        rows = p_ptr + copies.to(tl.int64)[:, None] * stride_pm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, splits):
            acc += tl.load(rows + offs_n[None, :], mask=ok, other=0.0)
            if GLU:
                acc_up += tl.load(rows + (N + offs_n)[None, :], mask=ok, other=0.0)
            rows += stride_ps
        out = epilogue(acc, acc_up, 0, offs_n, 0, n_ok, copies, row_ok, p_ptr, 0, 0, weights_ptr, alpha, limit,
                        ACT, GLU, False, MUL_WEIGHTS)
        store(out, copies, row_ok, pid_n, offs_n, n_ok, N, c_ptr, stride_cm, stride_cn, c_scale_ptr, stride_csm,
               stride_csg, QUANT_OUT, BLOCK_M, BLOCK_N)


# -- the launcher ----------------------------------------------------------------------------------

# The widest K-step of a stack's update in every adapter's columns (UPDATE_WIDE; :func:`wide_group`), on one
# program per tile and on the persistent grids. Each step's MMA waits for its operands' stores to shared memory, so
# fewer, wider steps pay, until their tiles' registers spill (docs/notes/kernels-log.md, "Wide steps for the wide
# update" and "The wide update's steps pipelined by Triton").
WIDE_STEP = 64
WIDE_STEP_PERSISTENT = 32


def _row_scale_mode(fmt: RowFormat, a: torch.Tensor, a_scale: Optional[torch.Tensor], k_dim: int
                    ) -> tuple[RowScales, int, int]:
    """``(mode, stride_row, stride_k)`` of the rows' scales."""
    rows = a.shape[0]
    if fmt is RowFormat.FLOAT:
        return RowScales.NONE, 0, 0
    if a_scale is None:
        raise ValueError(f"{fmt.name} rows need their scales")
    if fmt is RowFormat.NVFP4:
        if a_scale.dtype != torch.float8_e4m3fn or tuple(a_scale.shape) != (rows, k_dim // NVFP4_GROUP):
            raise ValueError(f"NVFP4 rows need float8_e4m3fn scales [{rows}, {k_dim // NVFP4_GROUP}], got "
                             f"{a_scale.dtype} {tuple(a_scale.shape)}")
        return RowScales.NVFP4, a_scale.stride(0), a_scale.stride(1)
    if a_scale.dtype != torch.float32:
        raise ValueError(f"row scales must be fp32, got {a_scale.dtype}")
    if a_scale.numel() == 1 and a_scale.dim() <= 1:
        return RowScales.ROW, 0, 0  # per tensor: every row reads the one scale
    if a_scale.dim() == 2 and a_scale.shape[0] == rows and a_scale.shape[1] == 1 and k_dim > SCALE_BLOCK:
        return RowScales.ROW, a_scale.stride(0), 0
    if a_scale.dim() == 2 and a_scale.shape[0] == rows and a_scale.shape[1] == cdiv(k_dim, SCALE_BLOCK):
        # (with K <= 128 one group is the whole row: per token and per group coincide)
        return RowScales.GROUP, a_scale.stride(0), a_scale.stride(1)
    raise ValueError(f"a_scale must be [1], [{rows}, 1] or [{rows}, {k_dim // SCALE_BLOCK}], "
                     f"got {tuple(a_scale.shape)}")


def _weight_descriptor(weight: torch.Tensor, config: GemmConfig, paired: bool, words: bool = False) -> Any:
    """The TMA descriptor of :func:`weight_tma_applies`: ``[E * N_w, K]`` rows with a ``[BLOCK_N, BLOCK_K]``
    box, or for interleaved gate/up rows (``paired``) ``[E * N, 2, K]`` with a ``[BLOCK_N, 1, BLOCK_K]`` box
    (a ``[2, E * N, K]`` view with a leading unit box, tried too, compiled and measured the same). ``words``: a
    shuffled e2m1 weight, whose tiles the kernel reads as 32-bit words (the same bytes). A transposed weight
    (:func:`transposed_weight`): the ``[E, K, N_w]`` tensor it views, ``[1, BLOCK_K, BLOCK_N]`` boxes."""
    if transposed_weight(weight):
        base = weight.transpose(1, 2)
        return TensorDescriptor(base, list(base.shape), [base.stride(0), base.stride(1), 1],
                                [1, config.block_k, config.block_n])
    if words:
        weight = weight.view(torch.int32)
    experts, n_w, k_elems = weight.shape
    inner = {torch.uint8: config.block_k // 2, torch.int32: config.block_k // 8}.get(weight.dtype, config.block_k)
    row = weight.stride(1)
    if paired:
        return TensorDescriptor(weight, [experts * n_w // 2, 2, k_elems], [2 * row, row, 1], [config.block_n, 1, inner])
    return TensorDescriptor(weight, [experts * n_w, k_elems], [row, 1], [config.block_n, inner])


def _decode_first(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, num_padded: torch.Tensor, *, chunk: int, config: GemmConfig,
                  aligned: int, weight_format: WeightFormat, weight_scale: Optional[torch.Tensor],
                  weight_zero: Optional[torch.Tensor], weight_global: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], ptx: Optional[bool], grid: Optional[str], compute_dtype: torch.dtype,
                  shuffled: bool, options: dict[str, Any]) -> torch.Tensor:
    """:func:`moe_gemm` with ``decode_chunk``: for each run of ``chunk`` experts, their 4-bit weights decoded into
    one scratch (:func:`moeforge.kernels.decode_first.decode_weights`), then the float GEMM over their row blocks
    (:func:`moeforge.kernels.decode_first.block_ranges`) with their slices of the per-expert operands. One stream:
    each decoding starts after the GEMM before it has read the scratch."""
    assert weight_scale is not None  # (checked by weight_operand)
    experts, n_w = weight.shape[0], weight.shape[1]
    scratch = torch.empty((min(chunk, experts), n_w, 2 * weight.shape[2]), dtype=compute_dtype, device=weight.device)
    starts = list(range(0, experts, chunk))
    ranges = decode_first.block_ranges(block_expert, num_padded, aligned, chunk, experts)
    # (no half tiles: they made the persistent grids slower, see moe_gemm)
    float_config = attrs.evolve(config, decode_chunk=0, swap=False, split_k=None, half_tail=False)
    if grid is None:
        grid = default_grid(device_capability(a.device), WeightFormat.FLOAT, float_config, options["glu"],
                            out.shape[0] / experts, out.element_size())
        grid = grid if grid != "tiles" else "persistent"
    for index, first in enumerate(starts):
        last = min(first + chunk, experts)
        decoded = decode_first.decode_weights(weight[first:last], weight_format, weight_scale[first:last],
                                              weight_zero[first:last] if weight_zero is not None else None,
                                              out=scratch[:last - first], ptx=ptx, shuffled=shuffled,
                                              paired_rows=shuffled and options["glu"] and options["interleaved"])
        moe_gemm(a, decoded, out, sorted_ids, block_expert, num_padded, config=float_config,
                 weight_global=weight_global[first:last] if weight_global is not None else None,
                 bias=bias[first:last] if bias is not None else None, grid=grid, split_k=1, aligned_block_m=aligned,
                 expert_first=first, block_range=ranges[index:index + 2], **options)
    return out


def moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    *,
    rows_per_a: int,
    config: GemmConfig,
    weight_format: WeightFormat = WeightFormat.FLOAT,
    a_scale: Optional[torch.Tensor] = None,
    a_global: float = 1.0,
    weight_scale: Optional[torch.Tensor] = None,
    weight_zero: Optional[torch.Tensor] = None,
    weight_global: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    act: int = ACT_NONE,
    glu: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    out_scale: Optional[torch.Tensor] = None,
    swap: Optional[bool] = None,
    ptx: Optional[bool] = None,
    tma: Optional[bool] = None,
    grid: Optional[str] = None,
    split_k: Optional[int] = None,
    aligned_block_m: Optional[int] = None,
    weight_scale_max: Optional[int] = None,
    half_tail: Optional[bool] = None,
    decode_chunk: Optional[int] = None,
    expert_first: int = 0,
    block_range: Optional[torch.Tensor] = None,
    weight_shuffled: bool = False,
    update_rows: Optional[torch.Tensor] = None,
    update_weight: Optional[torch.Tensor] = None,
    update_scale: float = 1.0,
    update_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the kernel: ``out[copy] = epilogue(rows[copy // rows_per_a] @ weight[expert].T)`` for every
    copy of ``sorted_ids`` (see the module docstring for the formats).

    ``a [rows, K]`` (``[rows, K / 2]`` uint8 for NVFP4 rows, with ``a_scale`` and the static
    ``a_global``); ``weight [E, N_w, K]`` or packed ``[E, N_w, K / 2]`` in ``weight_format`` with its
    ``weight_scale`` / ``weight_zero`` / ``weight_global``; ``out [num_copies, N]`` (``N = N_w // 2`` when
    ``glu``) in bf16/fp16/fp32, or float8_e4m3fn with ``out_scale [num_copies, N / 128]`` to quantize per
    128-group in the epilogue (needs ``config.block_n`` and ``N`` multiples of 128). ``aligned_block_m``: the
    block ``sorted_ids`` was aligned with (``block_expert`` has one entry per such block; a length that does
    not match is a ValueError); by default ``config.block_m``. ``config.block_m`` must divide it: each tile's
    rows then lie in one aligned block, and a tile of padding rows only is skipped. The rest of ``config`` is
    fitted by :func:`fit_config`.
    ``swap`` (4-bit weights; ignored for others): multiply ``W @ rows^T`` (the dequantized weight as the MMA's
    left operand, in registers); by default as ``config.swap`` says (a tuned table's choice: which orientation
    wins depends on the tile, see docs/notes/kernels-log.md, "The swapped 4-bit product in the tuned tables"). On
    Hopper with a Triton before 3.9, each K-step of a swapped product (and of NVFP4 rows on tiles of 64 rows or more)
    waits for its MMAs before the next one decodes (:func:`drain_mma`).
    ``ptx`` (4-bit operands): decode them with the packed inline-PTX conversion
    (:mod:`moeforge.kernels.dequant`); by default wherever it applies (:func:`packed_decoding`).
    ``tma``: copy the weight tiles with the tensor memory accelerator (:func:`weight_tma_applies`; it
    runs under Triton's interpreter too); by default as ``config.tma`` says (a tuned table's choice) where
    it applies, else where it applies and pays (:func:`weight_tma_pays`).
    ``grid``: ``tiles``, ``persistent`` or ``flattened`` (:func:`default_grid`, which picks by default).
    ``split_k``: split the K-loop into that many ranges of whole K-steps (at most one per step), each program
    writing fp32 partial sums that a second kernel adds in a fixed order before the epilogue (deterministic,
    but the rounding differs from one K-loop, and with it batch invariance); by default as ``config.split_k``
    says, else :func:`default_split_k`. A split runs one program per tile (``grid="tiles"``).
    ``weight_scale_max`` (MXFP4): a bound on the E8M0 codes of ``weight_scale``, if the caller knows one (from
    the tensor: :class:`moeforge.kernels.scale_bound.ScaleCodeBound`). At most 128 (``FOLDED_SCALE_MAX``), the
    packed bf16 decoding folds its ``x 2**126`` into the scales (one multiply per pair of weights fewer, the
    same values); a code above a bound given wrongly decodes as inf, so the output is inf / NaN, never finite
    and wrong. Ignored for other formats and by the portable decoding. (Shuffled NVFP4's packed bf16 decoding always
    folds part of it: its e4m3 scales are bounded; :func:`scale_fold`.)
    ``half_tail``: run a row block whose second half is only padding (an expert's last block with at most
    ``config.block_m / 2`` rows) as a ``block_m / 2``-row tile, half the MMA work. Bitwise the same output where
    both tiles take the same MMA instruction (Hopper: wgmma for 128 and 64 rows, ``mma.sync`` for 32 and 16);
    a 64-row block's 32-row half leaves wgmma for ``mma.sync``, which rounds the sums differently. Unless given,
    as ``config.half_tail`` says (a tuned table's choice). Needs ``config.block_m >= 32``. It runs one program per
    tile unless ``grid`` asks for a persistent one: the branch slowed the persistent grids' tiles down
    (docs/notes/kernels-log.md, "Half-height tiles for the experts' last blocks"), so the default grid is one program
    per tile (and the decoding path below leaves half tiles out).
    ``decode_chunk`` (4-bit weights; ignored for others): decode that many experts' weights at a time into a
    scratch in the compute dtype (:mod:`moeforge.kernels.decode_first`), then run the float GEMM on it over those
    experts' row blocks, on a persistent grid (``grid`` ``persistent`` or ``flattened``; no split K-loop); the
    scratch holds ``min(decode_chunk, E)`` experts. 0 decodes in the K-loop. Unless given, as
    ``config.decode_chunk`` says (a tuned table's choice); ``swap`` and ``weight_scale_max`` then do not apply.
    ``expert_first`` and ``block_range`` (what the decoding path launches): the per-expert operands (weight,
    scales, bias, global scales) hold experts ``expert_first ..`` only, and a persistent grid runs the aligned
    blocks ``block_range[0] .. block_range[1] - 1`` (int32 on the device), which must be those experts'.
    ``weight_shuffled`` (4-bit weights): ``weight`` is in the pre-shuffled layout (:mod:`moeforge.kernels.shuffle`,
    ``shuffle.shuffle(w, e2m1=weight_format.e2m1)``: MXFP4 / NVFP4 with their words' bits placed for the decoding,
    read as 32-bit words, so K-contiguous and 4-byte aligned; its scales and zero points are not shuffled); the tiles
    must cover whole shuffled blocks. Interleaved gate/up
    rows (``glu`` and ``interleaved``) must be shuffled paired, with the scales' and zero points' rows paired too
    (``shuffle.pair_rows``; the bias stays interleaved); they are read by pointer, not by TMA. By default tiles
    of 128 rows or more on a shuffled weight run on a persistent grid (:func:`default_grid`).
    ``update_rows [num_copies, R]`` (copy order, contiguous rows) and ``update_weight [E, N_w, R]`` (any strides, the
    weight's row layout, one float dtype): a low-rank update ``update_scale * update_rows[copy] @
    update_weight[expert].T`` added to the product before the epilogue, as one more K-step (an adapter's,
    :mod:`moeforge.adapters`; the row gradient's too). 4-bit weights then decode in the K-loop. With ``update_ids
    [num_copies]`` (int32) and ``update_weight [S, E, N_w, R]``, a stack of ``S`` updates: copy ``c``'s is
    ``update_scale * update_rows[c] @ update_weight[update_ids[c], expert].T``, none for an id outside ``[0, S)`` (a
    tile runs one K-step per update its rows chose); or ``update_rows [P, num_copies, R]`` fp32 in parts
    (:func:`moeforge.kernels.stack_shrink.stack_shrink`'s ranges of K), summed in one fixed order as the tiles load them
    and weighed by the raw ``update_ids`` (int32 or int64): ``update_scale`` for an id in ``[0, S)``, nothing for
    ``-1``, NaN outside ``[-1, S)`` (:func:`moeforge.kernels.stack_pairs.copy_adapters`). Or, without ids,
    ``update_rows [num_copies, S·R]`` and ``update_weight [S, E, N_w, R]``: every adapter's columns at once, copy
    ``c``'s ``update_rows[c] @ B_wide[expert]ᵀ`` (``B_wide [E, N_w, S·R]``, gathered adapter by adapter), as more
    K-steps on every tile, several adapters a step (:func:`wide_group`): the rows come weighed and zero outside each copy's own adapter's columns
    (:func:`moeforge.kernels.stack_wide.stack_wide`), ``update_scale`` 1. A stack has no backward (the adapters'
    serving path).
    """
    key = (launch_memo.tensor_key(a), launch_memo.tensor_key(weight), launch_memo.tensor_key(out), a.device,
           launch_memo.tensor_key(a_scale), launch_memo.tensor_key(weight_scale), launch_memo.tensor_key(weight_zero),
           launch_memo.tensor_key(weight_global), launch_memo.tensor_key(bias), launch_memo.tensor_key(topk_weights),
           launch_memo.tensor_key(out_scale), launch_memo.tensor_key(sorted_ids), launch_memo.tensor_key(block_expert),
           launch_memo.tensor_key(num_padded), launch_memo.tensor_key(block_range), rows_per_a, config,
           int(weight_format), a_global, act, glu, interleaved, alpha, limit, swap, ptx, tma, grid, split_k,
           aligned_block_m, weight_scale_max, half_tail, decode_chunk, expert_first, weight_shuffled,
           launch_memo.tensor_key(update_rows), launch_memo.tensor_key(update_weight), update_scale,
           launch_memo.tensor_key(update_ids))
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _prepare(
            a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a, config=config,
            weight_format=weight_format, a_scale=a_scale, a_global=a_global, weight_scale=weight_scale,
            weight_zero=weight_zero, weight_global=weight_global, bias=bias, topk_weights=topk_weights, act=act,
            glu=glu, interleaved=interleaved, alpha=alpha, limit=limit, out_scale=out_scale, swap=swap, ptx=ptx,
            tma=tma, grid=grid, split_k=split_k, aligned_block_m=aligned_block_m, weight_scale_max=weight_scale_max,
            half_tail=half_tail, decode_chunk=decode_chunk, expert_first=expert_first, block_range=block_range,
            weight_shuffled=weight_shuffled, update_rows=update_rows, update_weight=update_weight,
            update_scale=update_scale, update_ids=update_ids)
        _LAUNCHES.put(key, launch)
    result: torch.Tensor = launch(a, weight, out, sorted_ids, block_expert, num_padded, a_scale, weight_scale,
                                  weight_zero, weight_global, bias, topk_weights, out_scale, block_range, update_rows,
                                  update_weight, update_ids)
    return result


# Every launch recipe made, by the operands' metadata and the options: a memo of :func:`_prepare` (see
# :mod:`moeforge.kernels.launch_memo`).
_LAUNCHES: launch_memo.LaunchMemo[_Launch] = launch_memo.LaunchMemo(launch_memo.CAPACITY)


def _prepare(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    *,
    rows_per_a: int,
    config: GemmConfig,
    weight_format: WeightFormat,
    a_scale: Optional[torch.Tensor],
    a_global: float,
    weight_scale: Optional[torch.Tensor],
    weight_zero: Optional[torch.Tensor],
    weight_global: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    out_scale: Optional[torch.Tensor],
    swap: Optional[bool],
    ptx: Optional[bool],
    tma: Optional[bool],
    grid: Optional[str],
    split_k: Optional[int],
    aligned_block_m: Optional[int],
    weight_scale_max: Optional[int],
    half_tail: Optional[bool],
    decode_chunk: Optional[int],
    expert_first: int,
    block_range: Optional[torch.Tensor],
    weight_shuffled: bool,
    update_rows: Optional[torch.Tensor],
    update_weight: Optional[torch.Tensor],
    update_scale: float,
    update_ids: Optional[torch.Tensor],
) -> _Launch:
    """Check the operands and plan the launch of :func:`moe_gemm`: a :class:`_GemmLaunch` (or, for no rows or
    columns, :class:`_NoLaunch`; for 4-bit weights decoded first, :class:`_DecodeFirstLaunch`) that launches it
    for operands of the same metadata. Reads the operands' metadata only, never their values."""
    weight_format = WeightFormat(weight_format)
    if weight_scale_max is not None and not 0 <= weight_scale_max <= 255:
        raise ValueError(f"weight_scale_max bounds uint8 E8M0 codes (0..255), got {weight_scale_max}")
    aligned = config.block_m if aligned_block_m is None else aligned_block_m
    if aligned < 1 or aligned % config.block_m:
        raise ValueError(f"config.block_m={config.block_m} must divide the alignment's block, got {aligned}")
    if block_expert.numel() != cdiv(sorted_ids.numel(), aligned):
        # a plan aligned by another block: the kernel would read the wrong expert for most tiles
        raise ValueError(f"block_expert has {block_expert.numel()} entries, but {sorted_ids.numel()} sorted_ids in "
                         f"blocks of {aligned} need {cdiv(sorted_ids.numel(), aligned)}: pass the block the "
                         "rows were aligned with (aligned_block_m, by default config.block_m)")
    if grid is not None and grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    use_half_tail = config.half_tail if half_tail is None else half_tail
    if use_half_tail and config.block_m < 32:
        raise ValueError(f"half_tail needs block_m >= 32 (its half tiles have block_m / 2 rows), got {config.block_m}")
    chunk = config.decode_chunk if decode_chunk is None else decode_chunk
    if chunk < 0:
        raise ValueError(f"decode_chunk must be >= 0 (experts decoded at a time; 0: in the K-loop), got {chunk}")
    decoding_first = bool(chunk) and weight_format.packed and update_rows is None
    if decoding_first and (grid == "tiles" or (split_k if split_k is not None else config.split_k or 1) > 1):
        raise ValueError("decoding the weights first runs the float GEMM on a persistent grid, without a split "
                         f"K-loop: got grid={grid!r}, split_k={split_k if split_k is not None else config.split_k}")
    paired_rows = weight_shuffled and glu and interleaved
    if weight_shuffled:
        if not weight_format.packed:
            raise ValueError(f"weight_shuffled is a layout of packed 4-bit weights, got {weight_format.name}")
        if paired_rows and tma:
            raise ValueError("a shuffled weight of paired gate/up rows is read by pointer (tma=True is refused)")
        shuffle.check_shape(weight, paired=paired_rows)
        if weight_format.e2m1:
            shuffle.check_words(weight, weight_format.name)
        if glu and not paired_rows and (weight.shape[1] // 2) % shuffle.BLOCK:
            raise ValueError(f"a shuffled gate/up weight needs N a multiple of {shuffle.BLOCK} (its up rows start "
                             f"at N), got N={weight.shape[1] // 2}")
    if expert_first and block_range is None:
        raise ValueError("expert_first names the first expert of a block range: pass block_range too")
    if block_range is not None and (grid not in ("persistent", "flattened") or (split_k or 1) > 1):
        raise ValueError(f"a block range runs on a persistent grid (grid='persistent' or 'flattened', no split), "
                         f"got grid={grid!r}, split_k={split_k}")
    asked = config
    row_format = RowFormat.of(a.dtype)
    if row_format is RowFormat.NVFP4 and weight_format in (WeightFormat.FP8, WeightFormat.INT8):
        raise ValueError("NVFP4 rows meet float or 4-bit weights, not 8-bit ones")
    if row_format in (RowFormat.FP8, RowFormat.INT8) and weight_format not in (WeightFormat.FP8, WeightFormat.INT8):
        raise ValueError(f"{row_format.name} rows need 8-bit weights of their dtype, got {weight_format.name}")
    w = weight_operand(weight_format, weight, weight_scale, weight_zero, weight_global,
                       rows_dtype=a.dtype if row_format is not RowFormat.NVFP4 else out.dtype)
    k_dim = w.k_dim
    a_k = a.shape[1] * (2 if row_format is RowFormat.NVFP4 else 1)
    if a_k != k_dim:
        raise ValueError(f"rows have K={a_k}, the weight K={k_dim}")
    a_mode, stride_asm, stride_ask = _row_scale_mode(row_format, a, a_scale, k_dim)
    if (row_format is RowFormat.NVFP4 or weight_format.packed) and out_scale is None and (
            out.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"out must be bf16/fp16/fp32, got {out.dtype}")
    num_copies, n_out = out.shape
    update_k, update_precision, update_stack, update_parts, update_wide = _update_launch(
        update_rows, update_weight, update_ids, update_scale, weight, num_copies)
    quant_out = out_scale is not None
    compute_dtype = out.dtype if row_format is RowFormat.NVFP4 else a.dtype
    compute_bytes = 1 if row_format in (RowFormat.FP8, RowFormat.INT8) else compute_dtype.itemsize
    config = fitted_config(config, compute_bytes, packed=weight_format.packed or row_format is RowFormat.NVFP4,
                           per_k_scales=a_mode is RowScales.GROUP or w.blocked, glu=glu, grid=grid,
                           out_bytes=out.element_size())
    if weight_shuffled and not (chunk and weight_format.packed):  # (decoding first reads it with its own tiles)
        shuffle.check_tile(config)
    if quant_out and (weight_format not in (WeightFormat.FP8, WeightFormat.INT8) or config.block_n % SCALE_BLOCK
                      or n_out % SCALE_BLOCK):
        raise ValueError(f"FP8 output quantization in the epilogue is for 8-bit GEMMs with block_n and N "
                         f"multiples of 128, got {weight_format.name}, {config.block_n} and {n_out}")
    can_ptx = packed_decoding(a.device, compute_dtype, weight_format)
    if ptx and not can_ptx:
        raise ValueError(f"the packed 4-bit decoding runs on NVIDIA GPUs in bf16/fp16 (MXFP4 in bf16), got "
                         f"{a.device.type} {compute_dtype} {weight_format.name}")
    if num_copies == 0 or n_out == 0:
        return _NoLaunch()
    if decoding_first:
        return _DecodeFirstLaunch(dict(chunk=chunk, config=asked, aligned=aligned, weight_format=weight_format, ptx=ptx,
                                       grid=grid, compute_dtype=compute_dtype, shuffled=weight_shuffled),
                                  dict(rows_per_a=rows_per_a, a_global=a_global, act=act, glu=glu,
                                       interleaved=interleaved, alpha=alpha, limit=limit, tma=tma))
    capability = device_capability(a.device)
    facts = LaunchFacts(
        weight_format=weight_format, row_format=row_format, row_scales=a_mode, compute_dtype=compute_dtype,
        out_bytes=out.element_size(), experts=int(weight.shape[0]), n_out=n_out, k_dim=k_dim, copies=num_copies,
        padded_rows=sorted_ids.numel(), glu=glu, interleaved=interleaved, shuffled=weight_shuffled,
        blocked_scales=w.blocked, capability=capability, multiprocessors=multiprocessors(a.device),
        packed_decoding=can_ptx, tma_applies=weight_tma_applies(weight, config, glu, interleaved),
        vector_scales=vector_scales(weight_scale, weight_zero), weight_scale_max=weight_scale_max, config=asked,
        swap=swap, ptx=ptx, tma=tma, grid=grid, split_k=split_k, half_tail=half_tail,
        one_update=update_k > 0 and not update_stack and not update_wide)
    plan = plan_launch(facts)
    update_group = wide_group(update_k, update_stack, plan.grid) if update_wide else 0
    update_k *= max(update_group, 1)  # (a wide update's K-step: the group's padded ranks)
    config = plan.config
    paired = glu and interleaved
    paired_rows = weight_shuffled and paired
    gate_stride, up_offset = glu_strides(glu, interleaved, n_out)
    blocks = sorted_ids.numel() // config.block_m
    splits = plan.splits
    # a split K-loop's partial sums: gate columns, then up columns
    partials = (splits, num_copies, n_out * (2 if glu else 1)) if splits > 1 else None
    stride_ps, stride_pm = (partials[1] * partials[2], partials[2]) if partials is not None else (0, 0)
    dependent = pdl.applies(capability)
    main = BoundLaunch(moe_gemm_kernel, plan.programs, dict(
        A_FMT=int(row_format), A_SCALE=int(a_mode), B_FMT=int(weight_format), B_BLOCKED=w.blocked,
        B_TILE_SCALE=plan.tile_scale,
        GROUP=w.group, HAS_ZEROS=weight_zero is not None, QUANT_OUT=quant_out,
        ACT=act, GLU=glu, HAS_BIAS=bias is not None, MUL_WEIGHTS=topk_weights is not None,
        EVEN_K=int(plan.k_tail),
        PRECISION=plan.precision,
        SWAP=plan.swap,
        PTX=plan.ptx,
        FP8_CVT=plan.fp8_cvt,
        CVT_BY_FOUR=plan.cvt_by_four,
        B_TMA=(3 if transposed_weight(weight) else 2 if paired else 1) if plan.tma else 0,
        SPLIT=splits > 1,
        PERSISTENT=GRIDS.index(plan.grid),
        PREFETCH=plan.prefetch,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ALIGN_RATIO=aligned // config.block_m,
        HALF_TAIL=plan.half_tail,
        B_GLOBAL=weight_global is not None,
        EXPERT_RANGE=block_range is not None,
        B_SHUFFLED=(2 if paired_rows else 1) if weight_shuffled else 0,
        DRAIN_MMA=plan.drain,
        SCALE_FOLD=plan.scale_fold,
        UPDATE_K=update_k, UPDATE_PRECISION=update_precision, UPDATE_STACK=update_stack > 0 and not update_wide,
        UPDATE_PARTS=next_power_of_2(update_parts) if update_parts else 0,
        UPDATE_WIDE=update_wide, UPDATE_GROUP=update_group,
        PDL=pdl.flag(dependent, release=False),
    ), dict(num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(dependent)))
    sizes = (n_out, k_dim, num_copies, rows_per_a, float(a_global), expert_first,
             update_weight.shape[-1] if update_weight is not None else 0, float(update_scale), update_stack, update_parts)
    strides = (plan.steps_per_split, stride_ps, stride_pm, a.stride(0), a.stride(1), stride_asm, stride_ask,
               weight.stride(0), weight.stride(1), weight.stride(2),
               *w.scale_strides, *w.zero_strides,
               bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
               out.stride(0), out.stride(1),
               out_scale.stride(0) if out_scale is not None else 0, out_scale.stride(1) if out_scale is not None else 0,
               gate_stride, up_offset,
               alpha, limit,
               update_rows.stride(-2) if update_rows is not None else 0,
               *_stack_strides(update_weight), update_rows.stride(0) if update_rows is not None and update_parts else 0)
    reduce = None
    if partials is not None:
        block_n = 128 if quant_out else max(16, min(128, 4096 // config.block_m, next_power_of_2(n_out)))
        reduce = BoundLaunch(moe_gemm_reduce_kernel, (blocks, cdiv(n_out, block_n)), dict(
            ACT=act, GLU=glu, MUL_WEIGHTS=topk_weights is not None, QUANT_OUT=quant_out,
            BLOCK_M=config.block_m, BLOCK_N=block_n, PDL=pdl.flag(dependent),
        ), dict(num_warps=4, **pdl.launch_options(dependent)))
    return _GemmLaunch(
        main=main, reduce=reduce, sizes=sizes, strides=strides, partials=partials,
        reduce_sizes=(n_out, num_copies, splits, stride_ps, stride_pm, out.stride(0), out.stride(1),
                      out_scale.stride(0) if out_scale is not None else 0,
                      out_scale.stride(1) if out_scale is not None else 0, alpha, limit),
        descriptor=(config, paired, weight_shuffled and weight_format.e2m1) if plan.tma else None,
        a_scale_bytes=a_scale is not None and a_scale.dtype == torch.float8_e4m3fn,
        weight_scale_bytes=weight_scale is not None and weight_scale.dtype == torch.float8_e4m3fn)


def _update_launch(update_rows: Optional[torch.Tensor], update_weight: Optional[torch.Tensor],
                   update_ids: Optional[torch.Tensor], update_scale: float, weight: torch.Tensor, num_copies: int
                   ) -> tuple[int, str, int, int, int]:
    """``(UPDATE_K, UPDATE_PRECISION, the stack's size, the rows' parts, UPDATE_WIDE)`` of a low-rank update's
    operands (0, "ieee", 0, 0, 0 without one; the size 0 for one update; the parts 0 for ``[num_copies, R]`` rows;
    UPDATE_WIDE 0 but for rows in every adapter's columns: 1 where R is a power of two, else 2, and then UPDATE_K an
    adapter's columns, the rank to a power of two, which the launch multiplies by :func:`wide_group` once its grid is
    known), checked against the weight's experts and rows: a ``ValueError`` naming what does not fit."""
    if update_rows is None and update_weight is None and update_ids is None:
        return 0, "ieee", 0, 0, 0
    if update_rows is None or update_weight is None:
        raise ValueError("a low-rank update takes update_rows and update_weight together")
    stack = 0
    wide = False
    if update_ids is not None:
        # (int64 too with rows in parts, whose ids the launch reads as raw ids: stack_pairs.copy_adapters)
        id_dtypes = (torch.int32, torch.int64) if update_rows.dim() == 3 else (torch.int32,)
        if update_ids.dtype not in id_dtypes or tuple(update_ids.shape) != (num_copies,) or update_ids.stride(0) != 1:
            raise ValueError(f"update_ids must be int32 [num_copies={num_copies}] contiguous, got {update_ids.dtype} "
                             f"{tuple(update_ids.shape)}")
        if update_weight.dim() != 4:
            raise ValueError(f"a stack of updates (update_ids) takes update_weight [S, E, N_w, R], got "
                             f"{tuple(update_weight.shape)}")
        stack = int(update_weight.shape[0])
        if stack < 1:
            raise ValueError("a stack of updates holds at least one")
        update_weight = update_weight[0]
    elif update_weight.dim() == 4:
        # every adapter's columns at once: rows [num_copies, S·R], each copy's zero outside its own adapter's columns
        stack, rank = int(update_weight.shape[0]), int(update_weight.shape[3])
        if update_rows.dim() != 2 or stack < 1 or update_rows.shape[-1] != stack * rank:
            raise ValueError(f"update_weight [S, E, N_w, R] = {tuple(update_weight.shape)} is a stack of updates: pass "
                             f"each copy's (update_ids), or update_rows [num_copies, S·R = {stack * rank}] (every "
                             f"adapter's columns), got {tuple(update_rows.shape)}")
        if update_scale != 1.0:
            raise ValueError(f"update_rows of every adapter's columns come weighed (moeforge.kernels.stack_wide): "
                             f"update_scale must be 1, got {update_scale}")
        update_weight = update_weight[0]
        wide = True
    parts = 0
    if update_rows.dim() == 3:  # a stack's rows in parts (fp32 [P, num_copies, R]), summed and weighed in the launch
        if update_ids is None or update_rows.dtype != torch.float32 or update_rows.shape[0] < 1:
            raise ValueError(f"update_rows in parts [P, num_copies, R] are a stack's (update_ids), fp32, at least one "
                             f"part; got {update_rows.dtype} {tuple(update_rows.shape)}"
                             f"{'' if update_ids is not None else ' without update_ids'}")
        parts = int(update_rows.shape[0])
        rows = update_rows[0]
    else:
        rows = update_rows
    width = (rows.shape[1] // (stack if wide else 1)) if rows.dim() == 2 else -1
    # (a column's stride matters only where a row has more than one and there are rows: torch gives an empty or a
    # one-column tensor any stride there)
    if rows.dim() != 2 or rows.shape[0] != num_copies or (rows.stride(1) != 1 and rows.shape[1] > 1 and num_copies):
        raise ValueError(f"update_rows must be [num_copies={num_copies}, R] (or a stack's [P, num_copies, R] parts) "
                         f"with contiguous rows, got {tuple(update_rows.shape)} strides {update_rows.stride()}")
    if update_weight.dim() != 3 or tuple(update_weight.shape) != (weight.shape[0], weight.shape[1], width):
        raise ValueError(f"update_weight must be [E, N_w, R] = {(weight.shape[0], weight.shape[1], width)} (the "
                         f"weight's experts and rows, the rows' R), got {tuple(update_weight.shape)}")
    if (not parts and update_rows.dtype != update_weight.dtype) or not update_weight.dtype.is_floating_point \
            or update_weight.element_size() < 2:
        raise ValueError(f"a low-rank update's operands share one float dtype (bf16, fp16, fp32), got "
                         f"{update_rows.dtype} and {update_weight.dtype}")
    precision = "ieee" if update_weight.dtype == torch.float32 else "tf32"
    padded = next_power_of_2(width)
    if wide:
        return padded, precision, stack, parts, 1 if padded == width else 2
    return max(16, padded), precision, stack, parts, 0


def wide_group(padded: int, stack: int, grid: str) -> int:
    """How many adapters of a stack's update in every adapter's columns (``stack`` adapters, each ``padded``
    columns: the rank to a power of two) one K-step covers (UPDATE_GROUP): as many as fit in
    :data:`WIDE_STEP` columns on one program per tile, :data:`WIDE_STEP_PERSISTENT` on the persistent grids, and
    at least 16 columns (the MMA's K)."""
    step = WIDE_STEP if grid == "tiles" else WIDE_STEP_PERSISTENT
    return max(min(next_power_of_2(stack), step // padded), -(-16 // padded), 1)


def _stack_strides(update_weight: Optional[torch.Tensor]) -> tuple[int, ...]:
    """The update weight's four strides (adapter, expert, row, rank): one update's ``[E, N_w, R]`` as a stack of one
    (its adapter stride 0), none's all 0."""
    if update_weight is None:
        return (0, 0, 0, 0)
    return tuple(update_weight.stride()) if update_weight.dim() == 4 else (0, *update_weight.stride())


class _GemmLaunch:
    """:func:`moe_gemm`'s launch for operands of one metadata (made by :func:`_prepare`): the kernels bound to
    their grid and constexprs (:class:`~moeforge.kernels.bound_launch.BoundLaunch`) and every size and stride;
    a call passes the tensors (and builds the weight's TMA descriptor, which holds the tensor, afresh)."""

    __slots__ = ("main", "reduce", "sizes", "strides", "partials", "reduce_sizes", "descriptor", "a_scale_bytes",
                 "weight_scale_bytes")

    def __init__(self, *, main: BoundLaunch, reduce: Optional[BoundLaunch], sizes: tuple[Any, ...],
                 strides: tuple[Any, ...], partials: Optional[tuple[int, int, int]], reduce_sizes: tuple[Any, ...],
                 descriptor: Optional[tuple[GemmConfig, bool, bool]], a_scale_bytes: bool,
                 weight_scale_bytes: bool) -> None:
        self.main, self.reduce, self.sizes, self.strides = main, reduce, sizes, strides
        self.partials, self.reduce_sizes, self.descriptor = partials, reduce_sizes, descriptor
        self.a_scale_bytes, self.weight_scale_bytes = a_scale_bytes, weight_scale_bytes

    def __call__(self, a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, a_scale: Optional[torch.Tensor],
                 weight_scale: Optional[torch.Tensor], weight_zero: Optional[torch.Tensor],
                 weight_global: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], out_scale: Optional[torch.Tensor],
                 block_range: Optional[torch.Tensor], update_rows: Optional[torch.Tensor],
                 update_weight: Optional[torch.Tensor], update_ids: Optional[torch.Tensor]) -> torch.Tensor:
        dummy = weight  # a pointer for absent operands (never read: their constexpr flag is off)
        # e4m3 scales are read as bytes and decoded in the kernel (see _e4m3).
        if self.a_scale_bytes:
            assert a_scale is not None
            a_scale = a_scale.view(torch.uint8)
        if self.weight_scale_bytes:
            assert weight_scale is not None
            weight_scale = weight_scale.view(torch.uint8)
        partials = torch.empty(self.partials, dtype=torch.float32, device=a.device) if self.partials else None
        self.main(
            a, a_scale if a_scale is not None else dummy, weight,
            _weight_descriptor(weight, *self.descriptor) if self.descriptor is not None else dummy,
            weight_scale if weight_scale is not None else dummy,
            weight_zero if weight_zero is not None else dummy,
            weight_global if weight_global is not None else dummy,
            bias if bias is not None else dummy, out, out_scale if out_scale is not None else dummy,
            topk_weights if topk_weights is not None else dummy,
            sorted_ids, block_expert, num_padded, partials if partials is not None else dummy,
            update_rows if update_rows is not None else dummy, update_weight if update_weight is not None else dummy,
            update_ids if update_ids is not None else dummy, *self.sizes,
            block_range if block_range is not None else num_padded, *self.strides)
        if self.reduce is not None:
            assert partials is not None
            self.reduce(partials, out, out_scale if out_scale is not None else dummy,
                        topk_weights if topk_weights is not None else dummy, sorted_ids, num_padded,
                        *self.reduce_sizes)
        return out


class _NoLaunch:
    """No rows or no columns: nothing to compute."""

    __slots__ = ()

    def __call__(self, a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *rest: Any) -> torch.Tensor:
        return out


class _DecodeFirstLaunch:
    """4-bit weights decoded a chunk of experts at a time, then the float GEMM on them (:func:`_decode_first`,
    whose own launches are memoised as any other)."""

    __slots__ = ("plan", "options")

    def __init__(self, plan: dict[str, Any], options: dict[str, Any]) -> None:
        self.plan, self.options = plan, options

    def __call__(self, a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, a_scale: Optional[torch.Tensor],
                 weight_scale: Optional[torch.Tensor], weight_zero: Optional[torch.Tensor],
                 weight_global: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], out_scale: Optional[torch.Tensor],
                 block_range: Optional[torch.Tensor], update_rows: Optional[torch.Tensor] = None,
                 update_weight: Optional[torch.Tensor] = None,
                 update_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _decode_first(a, weight, out, sorted_ids, block_expert, num_padded, weight_scale=weight_scale,
                             weight_zero=weight_zero, weight_global=weight_global, bias=bias, **self.plan,
                             options=dict(self.options, a_scale=a_scale, topk_weights=topk_weights))


_Launch = Union[_GemmLaunch, _NoLaunch, _DecodeFirstLaunch]  # what _prepare makes and the memo keeps
