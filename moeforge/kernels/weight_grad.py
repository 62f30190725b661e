# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The experts' weight and bias gradients of a grouped GEMM: ``dW[e] = sum_c d_rows[c]^T rows[c // r]`` and
``db[e] = sum_c d_rows[c]`` over the copies ``c`` routed to expert ``e`` — a GEMM per expert whose reduction runs
over that expert's rows (a "k-grouped" GEMM).

Two passes, and a third for a bias:

1. :func:`gather_expert_rows` copies the operands into expert order: each expert's copies in the ascending order
   the alignment gave them (``sorted_ids``, as :func:`moeforge.kernels.align.align_block_size` places them), one
   run after another (:func:`expert_runs` finds where each run starts, on the device). For this module's kernel one
   operand, the narrower, is padded: each expert's run rounded up to whole reduction steps with zero rows; the
   other is compact, one row per copy. Padding both to the alignment's block would hold up to ``E x (block - 1)``
   rows more in each (the training step's peak memory is reached here); padding neither would leave the last step
   of each run to mask in registers, outside the pipelined loop (the measurements: ``docs/notes/kernels-log.md``,
   "The weight gradient's operands in expert order"). The Gluon kernel zeroes the rows past a run in its last step
   in shared memory, under its pipeline (:mod:`moeforge.kernels.gluon_weight_grad`, ``mask_tail``): where it takes
   the launch and experts hold at most :data:`COMPACT_UNTIL` rows on average — where the padding weighs most — both
   operands are compact.
2. ``_weight_grad_kernel``: one program per ``(expert, N tile, K tile)``, in that order (the tiles of one expert
   and one N strip run together and share it through L2), walking the expert's runs in steps of ``BLOCK_M`` rows
   and accumulating ``dy^T @ x`` in fp32. A step past the end of an expert's copies pairs the padded operand's zero
   rows with the compact one's next rows (the next expert's, or TMA's zero fill past the end): their products are
   zero (unless those rows hold an infinity or a NaN, which then reaches this expert's gradient too — a step whose
   gradients are not finite is lost anyway). On Hopper both operands come by TMA (contiguous runs are what TMA
   copies; a gathered load is not); elsewhere by masked pointer loads.
3. The bias gradient, where asked, beside either kernel: :func:`expert_bias_grad` sums each expert's run of ``dy``
   rows (its first row and its copies, as the weight gradient reads them), one pass over ``dy``.

Deterministic by construction: each output tile is one program summing its expert's rows in slot order, in steps
that start at the run's first row, and the alignment places every expert's copies in ascending order, the same
from run to run (no atomics there either); no atomics, no split reduction.
Experts without rows get zero gradients (their tiles loop zero times and store zeros).

Why not gather inside the GEMM: a contiguous run is what TMA copies, a gathered row is not; gathering once into
expert order costs one pass over the operands and makes the GEMM's loads plain (the A/B is in
``docs/notes/kernels-log.md``, "Backward: the weight gradient on sorted rows").
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch
import triton
import triton.language as tl

from moeforge.kernels import gluon_weight_grad, narrow_weight_grad, pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.kernel_op import KernelOp
from moeforge.kernels.launch_plan import TensorDescriptor
from moeforge.kernels.sizes import cdiv, next_power_of_2


@attrs.frozen
class WeightGradTiles:
    """The weight-gradient kernel's launch: an output tile of ``block_n x block_k``, ``block_m`` rows per
    reduction step (at least 16, dividing the alignment's block), ``num_warps``, ``num_stages``; ``tma``: operands
    by TMA; ``tma_store``: the finished tile stored by TMA too (by either kernel, where it can);
    ``warp_specialized``: the Gluon kernel
    (:mod:`moeforge.kernels.gluon_weight_grad`; two MMA partitions on alternate tiles with ``pingpong``) where it
    takes the launch — bf16 / fp16 operands, an sm_90 GPU — else this module's kernel with the same tiles (the flag
    chooses a kernel, never a result: both sum the same steps in the same order; a bias's gradient is
    :func:`expert_bias_grad` beside either)."""

    block_n: int
    block_k: int
    block_m: int
    num_warps: int
    num_stages: int
    tma: bool
    tma_store: bool = False
    warp_specialized: bool = False
    pingpong: bool = False


LONG_REDUCTION = 1024  # rows per expert from which the wide tiles pay (weight_grad_tiles)
# rows per expert up to which copy order's operands go to the Gluon kernel both compact, each run's last step masked
# (_k_grouped): where the padded operand holds the most padding for its copies (docs/kernels.md, "Backward", has the
# measurements behind the bound)
COMPACT_UNTIL = 64
SHORT_RUN = 32  # rows per expert up to which the steps are 32 rows (weight_grad_tiles)
PINGPONG_UNTIL = 4096  # rows per expert from which the wide tiles beat the Gluon ping-pong (weight_grad_tiles)


def weight_grad_tiles(n: int, k: int, dtype: torch.dtype, aligned_block_m: int, device: torch.device,
                      rows_per_expert: float = float(LONG_REDUCTION)) -> WeightGradTiles:
    """The launch for ``dW [E, n, k]`` of ``dtype`` operands aligned in blocks of ``aligned_block_m`` rows, with
    ``rows_per_expert`` rows on average in each expert's reduction (a bias gradient, where asked, is a launch of its
    own beside it: :func:`expert_bias_grad`).

    On a CUDA device, 16-bit operands, 64-row steps (32 where an expert has at most :data:`SHORT_RUN` rows on
    average: the padded operand holds up to a step less a row more per expert, so short runs take half the
    padding; the kernels log has the memory and the time this trades), TMA where :func:`capability_has_tma`:

    * on an sm_90 GPU that runs the Gluon kernel (:func:`gluon_weight_grad.device_problem`), below
      :data:`PINGPONG_UNTIL` rows per expert: the warp-specialised kernel, two MMA warpgroups on alternate
      128 x 128 tiles, 4 stages — one tile's store overlaps the other's MMAs, which counts where reductions are
      short; from there on the wide tiles' operand reuse counts more; with 64-row steps each partition stores its
      finished tile by TMA from shared memory (where ``dW``'s rows allow: ``tma_store_problem``), with 32-row steps
      from registers, which was faster there (docs/kernels.md, "Backward", has the measurements behind these
      bounds);
    * long reductions (at least :data:`LONG_REDUCTION` rows per expert: Mixtral's shapes): 128 x 256 tiles (256
      along the wider of ``n`` and ``k``), 8 warps, 3 stages — the MMAs dominate and the wide tile reads each
      operand row least often;
    * short ones (many experts: Qwen3, GPT-OSS, DeepSeek-V3): 128 x 128 tiles, 4 warps, 2 stages, the tile stored
      by TMA — a few K-steps per tile, so the time goes to each tile's start and store; two programs fit on an SM
      and one's store overlaps the other's loads (measured in docs/notes/kernels-log.md, "Backward: the weight
      gradient on sorted rows").

    fp32 operands take the short reductions' launch (shared memory for two stages of fp32 tiles). On CPU
    (Triton's interpreter, tests) small tiles: the interpreter's cost grows with the tile."""
    step = weight_grad_step(rows_per_expert, aligned_block_m)
    if device.type != "cuda":
        return WeightGradTiles(32, 32, min(16, aligned_block_m), 4, 2, False)
    tma = capability_has_tma(device)
    if (dtype.itemsize == 2 and rows_per_expert < PINGPONG_UNTIL and tma
            and gluon_weight_grad.device_problem(device) is None):
        return WeightGradTiles(128, 128, step, 4, 4, True, warp_specialized=True, pingpong=True,
                               tma_store=step == 64)
    if dtype.itemsize <= 2 and rows_per_expert >= LONG_REDUCTION:
        block_n, block_k = (128, 256) if k >= n else (256, 128)
        return WeightGradTiles(block_n, block_k, step, 8, 3, tma)
    return WeightGradTiles(128, 128, step, 4, 2, tma, tma_store=tma)


def weight_grad_step(rows_per_expert: float, aligned_block_m: int) -> int:
    """The rows of one reduction step of the weight gradient on a GPU: 64, 32 where an expert has at most
    :data:`SHORT_RUN` rows on average, at most the alignment's block."""
    return max(1, min(32 if rows_per_expert <= SHORT_RUN else 64, aligned_block_m))


def capability_has_tma(device: torch.device) -> bool:
    """Whether the device copies tiles by TMA (an NVIDIA GPU from Hopper on: :func:`pdl.device_capability`, None on
    ROCm) and the installed Triton can describe them."""
    capability = pdl.device_capability(device)
    return TensorDescriptor is not None and capability is not None and capability[0] >= 9


def tma_applies(t: torch.Tensor) -> bool:
    """Whether an operand can be described for TMA: contiguous last dimension, 16-byte aligned base and other
    strides."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.numel() > 0
            and all((stride * t.element_size()) % 16 == 0 for stride in t.stride()[:-1]))


# -- each expert's run of rows ---------------------------------------------------------------------------


@triton.jit
def _expert_runs_kernel(block_expert_ptr, sorted_ids_ptr, num_padded_ptr, runs_ptr, num_blocks, num_experts,
                        num_copies, ALIGNED_M: tl.constexpr, STEP: tl.constexpr, BLOCK_E: tl.constexpr,
                        CHUNK: tl.constexpr, CHUNK_E: tl.constexpr):
    # One program. Row 0 of runs [4, E + 1]: each expert's first block -- its used blocks counted (a histogram of the
    # block -> expert table's used entries), their exclusive running sum -- then the number of used blocks. Row 2:
    # each expert's copies -- its blocks' slots less the padding, which the alignment puts only in an expert's last
    # block -- then all of them. Row 1: their exclusive running sum (each expert's first row in expert order), then
    # the number of copies; row 3 the same over the copies rounded up to whole steps of STEP rows. Rows 0 and 2 are
    # read back after they are written: a barrier between (one CTA).
    used_blocks = tl.load(num_padded_ptr) // ALIGNED_M
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    experts = tl.arange(0, BLOCK_E)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        used = blocks < used_blocks
        owners = tl.load(block_expert_ptr + blocks, mask=used, other=BLOCK_E - 1)
        unused = tl.sum((~used).to(tl.int32), axis=0)  # counted in the last bin: taken out again
        counts += tl.histogram(owners, BLOCK_E) - tl.where(experts == BLOCK_E - 1, unused, 0)
    real = experts < num_experts
    first_blocks = tl.cumsum(counts, axis=0) - counts
    tl.store(runs_ptr + experts, first_blocks, mask=real)
    tl.store(runs_ptr + num_experts, used_blocks)
    tl.debug_barrier()
    lanes = tl.arange(0, ALIGNED_M)
    copies_row = runs_ptr + 2 * (num_experts + 1)
    for start in range(0, num_experts, CHUNK_E):
        chunk = start + tl.arange(0, CHUNK_E)
        inside = chunk < num_experts
        first = tl.load(runs_ptr + chunk, mask=inside, other=0)
        stop = tl.load(runs_ptr + chunk + 1, mask=inside, other=0)
        busy = inside & (stop > first)
        last = (stop - 1).to(tl.int64) * ALIGNED_M
        ids = tl.load(sorted_ids_ptr + last[:, None] + lanes[None, :], mask=busy[:, None], other=0)
        padding = tl.sum(((ids >= num_copies) & busy[:, None]).to(tl.int32), axis=1)
        tl.store(copies_row + chunk, (stop - first) * ALIGNED_M - padding, mask=inside)
    tl.debug_barrier()
    mine = tl.load(copies_row + experts, mask=real, other=0)
    tl.store(runs_ptr + num_experts + 1 + experts, tl.cumsum(mine, axis=0) - mine, mask=real)
    tl.store(runs_ptr + 2 * num_experts + 1, tl.sum(mine, axis=0))
    tl.store(copies_row + num_experts, tl.sum(mine, axis=0))
    whole = tl.cdiv(mine, STEP) * STEP
    tl.store(runs_ptr + 3 * (num_experts + 1) + experts, tl.cumsum(whole, axis=0) - whole, mask=real)
    tl.store(runs_ptr + 4 * num_experts + 3, tl.sum(whole, axis=0))


def expert_runs(block_expert: torch.Tensor, sorted_ids: torch.Tensor, num_padded: torch.Tensor, block_m: int,
                num_experts: int, num_copies: int, step: int) -> torch.Tensor:
    """Where each expert's rows lie, from the alignment's outputs (aligned with ``block_m``, ``num_copies``
    copies), on the device in one launch: ``runs [4, E + 1]`` int32 with ``runs[0, e]`` expert ``e``'s first block
    in the slot order (``runs[0, E]`` the used blocks), ``runs[1, e]`` its first row in expert order (the copies
    of the experts before it; ``runs[1, E]`` all copies), ``runs[2, e]`` its copies (``runs[2, E]`` all) and
    ``runs[3, e]`` its first row in expert order with every run rounded up to whole steps of ``step`` rows
    (``runs[3, E]`` all those rows): where the operands' rows lie in expert order, one of them padded to whole steps
    (``step`` 1: rows in slot order, :mod:`moeforge.kernels.slot_rows`, row 3 the same as row 1)."""
    runs = torch.empty(4, num_experts + 1, dtype=torch.int32, device=block_expert.device)
    block_e = max(next_power_of_2(num_experts), 2)
    chunk = max(16, min(1024, next_power_of_2(block_expert.numel())))
    chunk_e = max(1, min(block_e, 4096 // block_m))

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(ALIGNED_M=block_m, STEP=step, BLOCK_E=block_e, CHUNK=chunk, CHUNK_E=chunk_e), {}

    _EXPERT_RUNS.launch((block_m, step, block_e, chunk, chunk_e, block_expert.device), (1,),
                        (block_expert, sorted_ids, num_padded, runs, block_expert.numel(), num_experts, num_copies),
                        make)
    return runs


def padded_rows(num_copies: int, num_experts: int, step: int) -> int:
    """The most rows ``num_copies`` copies over ``num_experts`` experts take with each expert's run rounded up to
    whole steps of ``step`` rows: a step less a row more for each expert that has a copy."""
    return num_copies + min(num_experts, num_copies) * (step - 1)


@triton.jit
def run_row(slots, used, block_expert_ptr, runs_ptr, num_experts, ALIGNED_M: tl.constexpr, STEP: tl.constexpr):
    """``(row, kept)`` of each slot with its expert's run rounded up to whole steps of ``STEP`` rows (:func:`expert_runs`
    with that step): the expert's first row (runs row 3) plus the slot's place in the expert's blocks, and whether the
    slot lies within its expert's copies rounded up (a used slot past that has no row)."""
    expert = tl.load(block_expert_ptr + slots // ALIGNED_M, mask=used, other=0)
    place = slots - tl.load(runs_ptr + expert, mask=used, other=0) * ALIGNED_M  # in the expert's blocks
    count = tl.load(runs_ptr + 2 * (num_experts + 1) + expert, mask=used, other=0)
    kept = used & (place < tl.cdiv(count, STEP) * STEP)
    return tl.load(runs_ptr + 3 * (num_experts + 1) + expert, mask=used, other=0) + place, kept


@triton.jit
def _gather_expert_rows_kernel(src_ptr, slot_ids_ptr, block_expert_ptr, runs_ptr, dst_ptr, num_padded_ptr,
                               num_copies, num_experts, rows_per_src, width, stride_src, stride_dst,
                               ALIGNED_M: tl.constexpr, STEP: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_W: tl.constexpr):
    # One program per BLOCK_R slots x BLOCK_W columns: each slot holding a copy sends its source row to the copy's
    # row in expert order, its expert's first row plus its place in the expert's run. STEP > 0: runs rounded up to
    # whole steps (runs row 3), the padding slots inside the last step write zero rows (STEP divides ALIGNED_M: the
    # alignment's padding covers them).
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    used = slots < tl.load(num_padded_ptr)
    copies = tl.load(slot_ids_ptr + slots, mask=used, other=num_copies)
    real = copies < num_copies
    if STEP > 0:
        padded, written = run_row(slots, used, block_expert_ptr, runs_ptr, num_experts, ALIGNED_M, STEP)
        targets = padded.to(tl.int64)
    else:
        expert = tl.load(block_expert_ptr + slots // ALIGNED_M, mask=used, other=0)
        place = slots - tl.load(runs_ptr + expert, mask=used, other=0) * ALIGNED_M  # in the expert's run
        written = real
        targets = (tl.load(runs_ptr + num_experts + 1 + expert, mask=used, other=0) + place).to(tl.int64)
    rows = (copies // rows_per_src).to(tl.int64)
    cols_ok = (cols < width)[None, :]
    values = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=real[:, None] & cols_ok, other=0.0)
    tl.store(dst_ptr + targets[:, None] * stride_dst + cols[None, :], values, mask=written[:, None] & cols_ok)


def gather_expert_rows(src: torch.Tensor, slot_ids: torch.Tensor, block_expert: torch.Tensor, runs: torch.Tensor,
                       num_padded: torch.Tensor, num_copies: int, rows_per_src: int, block_m: int,
                       padded_step: int = 0) -> torch.Tensor:
    """The rows ``src[c // rows_per_src]`` of the copies ``c`` the alignment placed (``slot_ids``,
    ``block_expert``, ``num_padded``, aligned with ``block_m``) in its slot order, each expert's copies one run in
    the order the alignment gave them (:func:`expert_runs`' ``runs``). ``padded_step`` 0: without the padding,
    ``dst [num_copies, W]``, expert ``e``'s run from ``runs[1, e]``; else each run from ``runs[3, e]`` and rounded
    up to whole steps of ``padded_step`` rows (which must divide ``block_m``) with zero rows, ``dst`` sized for
    the most such rows (the copies plus ``padded_step - 1`` per expert; rows past ``runs[3, E]`` unwritten).
    ``src [R, W]`` with contiguous columns."""
    if padded_step and block_m % padded_step:
        raise ValueError(f"the padded step of {padded_step} rows must divide the alignment's block of {block_m}")
    if src.stride(1) != 1:
        src = src.contiguous()
    slots, width = slot_ids.numel(), src.shape[1]
    num_experts = runs.shape[1] - 1
    size = padded_rows(num_copies, num_experts, padded_step) if padded_step else num_copies
    dst = src.new_empty(size, width)
    if num_copies == 0 or width == 0:
        return dst
    block_r, block_w = (32, 128) if src.is_cuda else (16, 32)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(ALIGNED_M=block_m, STEP=padded_step, BLOCK_R=block_r, BLOCK_W=block_w), {}

    _GATHER.launch((block_m, padded_step, block_r, block_w, src.device), (cdiv(slots, block_r), cdiv(width, block_w)),
                   (src, slot_ids, block_expert, runs, dst, num_padded, num_copies, num_experts, rows_per_src, width,
                    src.stride(0), dst.stride(0)), make)
    return dst


# -- the k-grouped GEMM -------------------------------------------------------------------------------


@triton.jit
def _weight_grad_kernel(dy_desc, x_desc, dw_desc, dy_ptr, x_ptr, dw_ptr, dy_first_ptr, x_first_ptr, count_ptr, N,
                        K, stride_dy, stride_x, stride_dwe, stride_dwn, stride_dwk, TMA: tl.constexpr,
                        STORE_TMA: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(N, BLOCK_N) * tiles_k
    expert = pid // tiles
    pid_n = (pid % tiles) // tiles_k
    pid_k = pid % tiles_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    dy_first = tl.load(dy_first_ptr + expert)  # the expert's run in each operand (one of them padded)
    x_first = tl.load(x_first_ptr + expert)
    count = tl.load(count_ptr + expert)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for done in range(0, count, BLOCK_M):  # the expert's rows in slot order, whole steps
        if TMA:
            dy = dy_desc.load([dy_first + done, pid_n * BLOCK_N])
            x = x_desc.load([x_first + done, pid_k * BLOCK_K])
        else:
            step = done + tl.arange(0, BLOCK_M)
            ok = step < count
            dy_rows = (dy_first + step).to(tl.int64)
            x_rows = (x_first + step).to(tl.int64)
            dy = tl.load(dy_ptr + dy_rows[:, None] * stride_dy + offs_n[None, :], mask=ok[:, None] & n_ok[None, :],
                         other=0.0)
            x = tl.load(x_ptr + x_rows[:, None] * stride_x + offs_k[None, :], mask=ok[:, None] & k_ok[None, :],
                        other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    expert64 = expert.to(tl.int64)  # expert * stride_dwe passes 2**31 on DeepSeek-sized layers
    if STORE_TMA:  # [E, N, K] descriptor: the box is clipped at this expert's N and K edges
        dw_desc.store([expert, pid_n * BLOCK_N, pid_k * BLOCK_K],
                      tl.reshape(acc.to(dw_ptr.dtype.element_ty), (1, BLOCK_N, BLOCK_K)))
    else:
        tl.store(dw_ptr + expert64 * stride_dwe + offs_n[:, None] * stride_dwn + offs_k[None, :] * stride_dwk,
                 acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _bias_grad_kernel(dy_ptr, first_ptr, count_ptr, db_ptr, N, stride_dy, stride_dbe, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # One program per (expert, BLOCK_N columns): the expert's count rows of dy from its first row, summed in fp32 in
    # steps of BLOCK_M rows from the first (a fixed order), the rows past the run masked (they may be another's).
    expert = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    first = tl.load(first_ptr + expert)
    count = tl.load(count_ptr + expert)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for done in range(0, count, BLOCK_M):
        step = done + tl.arange(0, BLOCK_M)
        rows = (first + step).to(tl.int64)
        ok = (step < count)[:, None] & n_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + offs_n[None, :], mask=ok, other=0.0)
        acc += tl.sum(dy.to(tl.float32), axis=0)
    tl.store(db_ptr + expert.to(tl.int64) * stride_dbe + offs_n, acc.to(db_ptr.dtype.element_ty), mask=n_ok)


def expert_bias_grad(dy: torch.Tensor, first: torch.Tensor, counts: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    """``db[e] = sum of dy[first[e] + i] for i < counts[e]`` (``dy [R, N]`` rows in expert runs, ``first`` and
    ``counts`` int32 ``[E]`` on the device, ``db [E, N]`` written in its dtype): the bias gradient beside either
    weight-gradient kernel, which sum none. Each expert's rows summed in fp32 in a fixed order (steps of rows from the
    run's first: deterministic, no atomics), only the run's rows read; an idle expert's row is zeros."""
    num_experts, n = db.shape
    if db.numel() == 0:
        return db
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    block_m, block_n = (64, 128) if dy.is_cuda else (16, 32)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_M=block_m, BLOCK_N=block_n), {}

    _BIAS_GRAD.launch((block_m, block_n, dy.device), (num_experts, cdiv(n, block_n)),
                      (dy, first, counts, db, n, dy.stride(0), db.stride(0)), make)
    return db


def expert_weight_grad(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
                       block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int,
                       with_bias: bool, dtype: torch.dtype = torch.float32,
                       tiles: Optional[WeightGradTiles] = None, slot_copies: int = 0,
                       slot_runs: Optional[torch.Tensor] = None,
                       scale: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(dW [E, N, K], db [E, N] or None)`` in ``dtype`` (summed in fp32): for each expert the sum over its
    copies ``c`` of ``d_rows[c]^T rows[c // rows_per_a]`` (``d_rows [copies, N]``, ``rows [R, K]`` of one dtype),
    each expert's copies summed in slot order, which the alignment (aligned with ``block_m``) makes ascending: the
    same bits from run to run. ``tiles``: the launch (default :func:`weight_grad_tiles`; a gradient narrow on one side
    — an adapter's ``A`` or ``B`` — without a bias, its rows not in slot order, takes
    :func:`moeforge.kernels.narrow_weight_grad.narrow_weight_grad` instead where ``tiles`` is not given: its few
    MMAs leave reading the rows as the cost, which that kernel does once, with no launch to find the experts' runs).

    ``slot_copies`` > 0: both operands in slot order (:mod:`moeforge.kernels.slot_rows`; ``sorted_ids`` each slot's
    row, ``rows_per_a`` 1), ``slot_copies`` rows, one per copy, each expert's a run from ``slot_runs[1, e]`` (the
    dispatch's :func:`expert_runs`; row 2 its copies): the Gluon kernel sums them where they are, masking each run's
    last step; this module's kernel gathers the narrower operand with the runs rounded up to whole steps, the wider
    read in place. ``scale``: both gradients times it (an adapter's ``alpha / r``; in the narrow kernel before the
    cast, else after)."""
    if tiles is None and narrow_weight_grad.narrow_problem(d_rows, rows, with_bias, slot_copies) is None:
        # (an adapter's A or B: the rows read once by index, the narrow side whole in each program's accumulator)
        return narrow_weight_grad.narrow_weight_grad(d_rows, rows, rows_per_a, sorted_ids, block_expert, num_padded,
                                                     num_experts, block_m, dtype, scale=scale), None
    dw, db = _k_grouped(d_rows, rows, rows_per_a, sorted_ids, block_expert, num_padded, num_experts, block_m,
                        with_bias, dtype, tiles, slot_copies, slot_runs)
    if scale != 1.0:
        dw.mul_(scale)
        if db is not None:
            db.mul_(scale)
    return dw, db


def _k_grouped(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
               block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int, with_bias: bool,
               dtype: torch.dtype, tiles: Optional[WeightGradTiles], slot_copies: int,
               slot_runs: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`expert_weight_grad` on the k-grouped kernels (Triton or Gluon), without its scale."""
    num_copies, n = d_rows.shape
    k = rows.shape[1]
    if slot_copies and (rows_per_a != 1 or slot_runs is None):
        raise ValueError(f"rows in slot order are one per slot, with their experts' runs: rows_per_a must be 1 (got "
                         f"{rows_per_a}) and slot_runs given")
    dw = torch.empty(num_experts, n, k, dtype=dtype, device=rows.device)
    db = torch.empty(num_experts, n, dtype=dtype, device=rows.device) if with_bias else None
    if dw.numel() == 0:
        if db is not None:
            db.zero_()
        return dw, db
    tiles = tiles or weight_grad_tiles(n, k, rows.dtype, block_m, rows.device,
                                       (slot_copies or num_copies) / max(num_experts, 1))
    if block_m % tiles.block_m or tiles.block_m < 16:
        raise ValueError(f"the weight gradient's step of {tiles.block_m} rows must divide the alignment's block "
                         f"of {block_m} and be at least 16 (the MMA's reduction)")
    # (in slot order the dispatch's runs, not rounded up: rows 1 and 2 are what the launches read)
    runs = slot_runs if slot_runs is not None and slot_copies else expert_runs(
        block_expert, sorted_ids, num_padded, block_m, num_experts, num_copies, tiles.block_m)

    def takes(dy: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the tiles ask for the Gluon kernel and it takes these operands (the weight's gradient: a bias's
        is summed beside it)."""
        return tiles.warp_specialized and gluon_weight_grad.operand_problem(
            dy, x, dw, tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages,
            tiles.pingpong) is None

    def launch(dy: torch.Tensor, x: torch.Tensor, dy_first: torch.Tensor, x_first: torch.Tensor,
               mask_tail: bool = False) -> None:
        gluon_weight_grad.launch_checked(dy, x, dw, dy_first, x_first, runs[2], block_m=tiles.block_m,
                                         block_n=tiles.block_n, block_k=tiles.block_k, num_warps=tiles.num_warps,
                                         stages=tiles.num_stages, pingpong=tiles.pingpong,
                                         tma_store=tiles.tma_store, mask_tail=mask_tail)
        if db is not None:
            expert_bias_grad(dy, dy_first, runs[2], db)

    if slot_copies and takes(d_rows, rows):
        # an expert's run from its first row, its copies one row each: the Gluon kernel zeroes the rows past each
        # run in its last step
        launch(d_rows.contiguous(), rows.contiguous(), runs[1], runs[1], mask_tail=True)
        return dw, db
    if slot_copies:
        # this module's kernel sums whole steps: the narrower operand gathered with each run rounded up to whole
        # steps with zero rows (from the rows, in expert order already: slot s holds row sorted_ids[s]), the wider
        # read in place
        padded_runs = expert_runs(block_expert, sorted_ids, num_padded, block_m, num_experts, num_copies,
                                  tiles.block_m)
        dy, x, dy_first, x_first = d_rows.contiguous(), rows.contiguous(), runs[1], runs[1]
        if n <= k:
            dy = gather_expert_rows(d_rows, sorted_ids, block_expert, padded_runs, num_padded, num_copies, 1, block_m,
                                    tiles.block_m)
            dy_first = padded_runs[3]
        else:
            x = gather_expert_rows(rows, sorted_ids, block_expert, padded_runs, num_padded, num_copies, 1, block_m,
                                   tiles.block_m)
            x_first = padded_runs[3]
    elif num_copies <= COMPACT_UNTIL * num_experts and takes(d_rows, rows):
        # short runs: the Gluon kernel zeroes the rows past each run in its last step, both operands compact, one row
        # per copy (their gathered copies take it as the sources do: the same dtypes and widths, fresh contiguous
        # rows)
        dy = gather_expert_rows(d_rows, sorted_ids, block_expert, runs, num_padded, num_copies, 1, block_m, 0)
        x = gather_expert_rows(rows, sorted_ids, block_expert, runs, num_padded, num_copies, rows_per_a, block_m, 0)
        launch(dy, x, runs[1], runs[1], mask_tail=True)
        return dw, db
    else:
        # each expert's copies are in ascending order already (align_block_size); the narrower operand padded to
        # whole steps, the other compact
        pad_dy = n <= k
        dy = gather_expert_rows(d_rows, sorted_ids, block_expert, runs, num_padded, num_copies, 1, block_m,
                                tiles.block_m if pad_dy else 0)
        x = gather_expert_rows(rows, sorted_ids, block_expert, runs, num_padded, num_copies, rows_per_a, block_m,
                               0 if pad_dy else tiles.block_m)
        padded_first, compact_first = runs[3], runs[1]
        dy_first, x_first = (padded_first, compact_first) if pad_dy else (compact_first, padded_first)
    if takes(dy, x):
        launch(dy, x, dy_first, x_first)
        return dw, db
    tma = tiles.tma and tma_applies(dy) and tma_applies(x)
    dy_desc = TensorDescriptor.from_tensor(dy, [tiles.block_m, tiles.block_n]) if tma else None
    x_desc = TensorDescriptor.from_tensor(x, [tiles.block_m, tiles.block_k]) if tma else None
    store_tma = tiles.tma_store and TensorDescriptor is not None and tma_applies(dw)
    dw_desc = TensorDescriptor.from_tensor(dw, [1, tiles.block_n, tiles.block_k]) if store_tma else None
    grid = (num_experts * cdiv(n, tiles.block_n) * cdiv(k, tiles.block_k),)
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(TMA=tma, STORE_TMA=store_tma, PRECISION=precision,
                     BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k),
                dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))

    # (the descriptors' boxes follow the tiles, their dtypes the tensors': both in the key; an absent descriptor is
    # passed as a tensor the kernel never reads, as moe_gemm's launcher does: the launch's signature stays one)
    _WEIGHT_GRAD.launch((tma, store_tma, precision, tiles, rows.device), grid, (
        dy_desc if dy_desc is not None else dy, x_desc if x_desc is not None else x,
        dw_desc if dw_desc is not None else dw, dy, x, dw, dy_first, x_first, runs[2],
        n, k, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1), dw.stride(2)), make)
    if db is not None:
        expert_bias_grad(dy, dy_first, runs[2], db)
    return dw, db


def grads_for_op(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int,
                 with_bias: bool, dtype: torch.dtype, slot_copies: int = 0,
                 slot_runs: Optional[torch.Tensor] = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moeforge::expert_weight_grad`` op's implementation: :func:`expert_weight_grad` with an empty ``db``
    without a bias (an op returns tensors)."""
    dw, db = expert_weight_grad(d_rows, rows, rows_per_a, sorted_ids, block_expert, num_padded, num_experts, block_m,
                                with_bias, dtype, slot_copies=slot_copies, slot_runs=slot_runs, scale=scale)
    return dw, db if db is not None else d_rows.new_empty(0, dtype=dtype)


_EXPERT_RUNS = LaunchSite(_expert_runs_kernel)
_GATHER = LaunchSite(_gather_expert_rows_kernel)
_WEIGHT_GRAD = LaunchSite(_weight_grad_kernel)
_BIAS_GRAD = LaunchSite(_bias_grad_kernel)

# What the grouped GEMM's backward formula calls (moeforge.kernels.backward): the op where it is needed, else the
# function.
EXPERT_WEIGHT_GRAD = KernelOp("moeforge::expert_weight_grad", grads_for_op)
