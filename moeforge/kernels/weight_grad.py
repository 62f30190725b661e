# Triton kernels (@triton.jit bodies) are not annotatable; their Python launchers are.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The experts' weight and bias gradients of a grouped GEMM: ``dW[e] = sum_c d_rows[c]^T rows[c // r]`` and
``db[e] = sum_c d_rows[c]`` over the copies ``c`` routed to expert ``e`` — a GEMM per expert whose reduction runs
over that expert's rows (a "k-grouped" GEMM).

Two passes:

1. :func:`gather_sorted_rows` copies the operands into the block-aligned slot order the forward used
   (``sorted_ids``: each expert's copies in ascending order, as :func:`moeforge.kernels.align.align_block_size`
   places them) and its padding slots zero: every expert's rows are then one contiguous run of whole blocks.
2. ``_weight_grad_kernel``: one program per ``(expert, N tile, K tile)``, in that order (the tiles of one expert
   and one N strip run together and share it through L2), walking the expert's run in steps of ``BLOCK_M`` rows
   and accumulating ``dy^T @ x`` in fp32. On Hopper both operands come by TMA (contiguous runs are what TMA copies;
   a gathered load is not); elsewhere by pointer loads of the same contiguous rows.

Deterministic by construction: each output tile is one program summing its expert's rows in slot order, and the
alignment places every expert's copies in ascending order, the same slots from run to run (no atomics there
either); no atomics, no split reduction.
Experts without rows get zero gradients (their tiles loop zero times and store zeros).

Why not gather inside the GEMM: a contiguous run is what TMA copies, a gathered row is not; gathering once into
slot order costs one pass over the operands and makes the GEMM's loads plain (the A/B is in
``docs/notes/kernels-log.md``, "Backward: the weight gradient on sorted rows").
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch
import triton
import triton.language as tl

from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.kernel_op import KernelOp
from moeforge.kernels.launch_plan import TensorDescriptor
from moeforge.kernels.sizes import cdiv, next_power_of_2


@attrs.frozen
class WeightGradTiles:
    """The weight-gradient kernel's launch: an output tile of ``block_n x block_k``, ``block_m`` rows per
    reduction step (at least 16, dividing the alignment's block), ``num_warps``, ``num_stages``; ``tma``: operands
    by TMA; ``tma_store``: the finished tile stored by TMA too."""

    block_n: int
    block_k: int
    block_m: int
    num_warps: int
    num_stages: int
    tma: bool
    tma_store: bool = False


LONG_REDUCTION = 1024  # rows per expert from which the wide tiles pay (weight_grad_tiles)


def weight_grad_tiles(n: int, k: int, dtype: torch.dtype, aligned_block_m: int, device: torch.device,
                      rows_per_expert: float = float(LONG_REDUCTION)) -> WeightGradTiles:
    """The launch for ``dW [E, n, k]`` of ``dtype`` operands aligned in blocks of ``aligned_block_m`` rows, with
    ``rows_per_expert`` rows on average in each expert's reduction.

    On a CUDA device, 16-bit operands, 64-row steps, TMA where :func:`capability_has_tma`:

    * long reductions (at least :data:`LONG_REDUCTION` rows per expert: Mixtral's shapes): 128 x 256 tiles (256
      along the wider of ``n`` and ``k``), 8 warps, 3 stages — the MMAs dominate and the wide tile reads each
      operand row least often;
    * short ones (many experts: Qwen3, GPT-OSS, DeepSeek-V3): 128 x 128 tiles, 4 warps, 2 stages, the tile stored
      by TMA — a few K-steps per tile, so the time goes to each tile's start and store; two programs fit on an SM
      and one's store overlaps the other's loads (measured in docs/notes/kernels-log.md, "Backward: the weight
      gradient on sorted rows").

    fp32 operands take the short reductions' launch (shared memory for two stages of fp32 tiles). On CPU
    (Triton's interpreter, tests) small tiles: the interpreter's cost grows with the tile."""
    step = min(64, aligned_block_m)
    if device.type != "cuda":
        return WeightGradTiles(32, 32, min(16, aligned_block_m), 4, 2, False)
    tma = capability_has_tma(device)
    if dtype.itemsize <= 2 and rows_per_expert >= LONG_REDUCTION:
        block_n, block_k = (128, 256) if k >= n else (256, 128)
        return WeightGradTiles(block_n, block_k, step, 8, 3, tma)
    return WeightGradTiles(128, 128, step, 4, 2, tma, tma_store=tma)


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


# -- the slot order ---------------------------------------------------------------------------------------


@triton.jit
def _first_blocks_kernel(block_expert_ptr, num_padded_ptr, first_ptr, num_blocks, num_experts,
                         ALIGNED_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # One program: each expert's used blocks counted (a histogram of the block -> expert table's used entries), their
    # exclusive running sum is each expert's first block; then the number of used blocks.
    used_blocks = tl.load(num_padded_ptr) // ALIGNED_M
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    experts = tl.arange(0, BLOCK_E)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        used = blocks < used_blocks
        owners = tl.load(block_expert_ptr + blocks, mask=used, other=BLOCK_E - 1)
        unused = tl.sum((~used).to(tl.int32), axis=0)  # counted in the last bin: taken out again
        counts += tl.histogram(owners, BLOCK_E) - tl.where(experts == BLOCK_E - 1, unused, 0)
    tl.store(first_ptr + experts, tl.cumsum(counts, axis=0) - counts, mask=experts < num_experts)
    tl.store(first_ptr + num_experts, used_blocks)


def expert_first_blocks(block_expert: torch.Tensor, num_padded: torch.Tensor, block_m: int,
                        num_experts: int) -> torch.Tensor:
    """``first[e]`` = the first row block of expert ``e`` (``[E + 1]``; ``first[E]`` = the number of used
    blocks), from the alignment's block -> expert table (experts in ascending order), on the device: one launch."""
    first = torch.empty(num_experts + 1, dtype=torch.int32, device=block_expert.device)
    block_e = max(next_power_of_2(num_experts), 2)
    chunk = max(16, min(1024, next_power_of_2(block_expert.numel())))

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(ALIGNED_M=block_m, BLOCK_E=block_e, CHUNK=chunk), {}

    _FIRST_BLOCKS.launch((block_m, block_e, chunk, block_expert.device), (1,),
                         (block_expert, num_padded, first, block_expert.numel(), num_experts), make)
    return first


@triton.jit
def _gather_sorted_rows_kernel(src_ptr, slot_ids_ptr, dst_ptr, num_padded_ptr, num_copies, rows_per_src, width,
                               stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    used = slots < tl.load(num_padded_ptr)
    copies = tl.load(slot_ids_ptr + slots, mask=used, other=num_copies)
    real = copies < num_copies
    rows = (copies // rows_per_src).to(tl.int64)
    cols_ok = cols < width
    values = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=real[:, None] & cols_ok[None, :],
                     other=0.0)
    tl.store(dst_ptr + slots.to(tl.int64)[:, None] * stride_dst + cols[None, :], values,
             mask=used[:, None] & cols_ok[None, :])


def gather_sorted_rows(src: torch.Tensor, slot_ids: torch.Tensor, num_padded: torch.Tensor, num_copies: int,
                       rows_per_src: int) -> torch.Tensor:
    """``dst [slots, W]``: ``dst[s] = src[slot_ids[s] // rows_per_src]`` for the used slots (``s < num_padded``),
    zero where ``slot_ids[s]`` is the padding sentinel (``num_copies``); slots past ``num_padded`` are left unwritten
    (nobody reads them). ``src [R, W]`` with contiguous columns."""
    if src.stride(1) != 1:
        src = src.contiguous()
    slots, width = slot_ids.numel(), src.shape[1]
    dst = src.new_empty(slots, width)
    if slots == 0 or width == 0:
        return dst
    block_r, block_w = (32, 128) if src.is_cuda else (16, 32)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(BLOCK_R=block_r, BLOCK_W=block_w), {}

    _GATHER.launch((block_r, block_w, src.device), (cdiv(slots, block_r), cdiv(width, block_w)),
                   (src, slot_ids, dst, num_padded, num_copies, rows_per_src, width, src.stride(0), dst.stride(0)),
                   make)
    return dst


# -- the k-grouped GEMM -------------------------------------------------------------------------------


@triton.jit
def _weight_grad_kernel(dy_desc, x_desc, dw_desc, dy_ptr, x_ptr, dw_ptr, db_ptr, first_block_ptr,
                        N, K, stride_dy, stride_x, stride_dwe, stride_dwn, stride_dwk, stride_dbe,
                        ALIGNED_M: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr, STORE_TMA: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
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
    start = tl.load(first_block_ptr + expert) * ALIGNED_M
    end = tl.load(first_block_ptr + expert + 1) * ALIGNED_M
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for row in range(start, end, BLOCK_M):  # the expert's rows, in slot order
        if TMA:
            dy = dy_desc.load([row, pid_n * BLOCK_N])
            x = x_desc.load([row, pid_k * BLOCK_K])
        else:
            rows = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + offs_n[None, :], mask=n_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
        if HAS_BIAS:
            bias += tl.sum(dy.to(tl.float32), axis=0)
    expert64 = expert.to(tl.int64)  # expert * stride_dwe passes 2**31 on DeepSeek-sized layers
    if STORE_TMA:  # [E, N, K] descriptor: the box is clipped at this expert's N and K edges
        dw_desc.store([expert, pid_n * BLOCK_N, pid_k * BLOCK_K],
                      tl.reshape(acc.to(dw_ptr.dtype.element_ty), (1, BLOCK_N, BLOCK_K)))
    else:
        tl.store(dw_ptr + expert64 * stride_dwe + offs_n[:, None] * stride_dwn + offs_k[None, :] * stride_dwk,
                 acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            tl.store(db_ptr + expert64 * stride_dbe + offs_n, bias.to(db_ptr.dtype.element_ty), mask=n_ok)


def expert_weight_grad(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
                       block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int,
                       with_bias: bool, dtype: torch.dtype = torch.float32,
                       tiles: Optional[WeightGradTiles] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(dW [E, N, K], db [E, N] or None)`` in ``dtype`` (summed in fp32): for each expert the sum over its
    copies ``c`` of ``d_rows[c]^T rows[c // rows_per_a]`` (``d_rows [copies, N]``, ``rows [R, K]`` of one dtype),
    each expert's copies summed in slot order, which the alignment (aligned with ``block_m``) makes ascending: the
    same bits from run to run. ``tiles``: the launch (default :func:`weight_grad_tiles`)."""
    num_copies, n = d_rows.shape
    k = rows.shape[1]
    dw = torch.empty(num_experts, n, k, dtype=dtype, device=rows.device)
    db = torch.empty(num_experts, n, dtype=dtype, device=rows.device) if with_bias else None
    if dw.numel() == 0:
        if db is not None:
            db.zero_()
        return dw, db
    tiles = tiles or weight_grad_tiles(n, k, rows.dtype, block_m, rows.device, num_copies / max(num_experts, 1))
    if block_m % tiles.block_m or tiles.block_m < 16:
        raise ValueError(f"the weight gradient's step of {tiles.block_m} rows must divide the alignment's block "
                         f"of {block_m} and be at least 16 (the MMA's reduction)")
    first = expert_first_blocks(block_expert, num_padded, block_m, num_experts)
    # each expert's copies are in ascending order already (align_block_size)
    dy = gather_sorted_rows(d_rows, sorted_ids, num_padded, num_copies, 1)
    x = gather_sorted_rows(rows, sorted_ids, num_padded, num_copies, rows_per_a)
    tma = tiles.tma and tma_applies(dy) and tma_applies(x)
    dy_desc = TensorDescriptor.from_tensor(dy, [tiles.block_m, tiles.block_n]) if tma else None
    x_desc = TensorDescriptor.from_tensor(x, [tiles.block_m, tiles.block_k]) if tma else None
    store_tma = tiles.tma_store and TensorDescriptor is not None and tma_applies(dw)
    dw_desc = TensorDescriptor.from_tensor(dw, [1, tiles.block_n, tiles.block_k]) if store_tma else None
    dbias = db if db is not None else dw
    grid = (num_experts * cdiv(n, tiles.block_n) * cdiv(k, tiles.block_k),)
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(ALIGNED_M=block_m, HAS_BIAS=with_bias, TMA=tma, STORE_TMA=store_tma, PRECISION=precision,
                     BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k),
                dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))

    # (the descriptors' boxes follow the tiles, their dtypes the tensors': both in the key; an absent descriptor is
    # passed as a tensor the kernel never reads, as moe_gemm's launcher does: the launch's signature stays one)
    _WEIGHT_GRAD.launch((block_m, with_bias, tma, store_tma, precision, tiles, rows.device), grid, (
        dy_desc if dy_desc is not None else dy, x_desc if x_desc is not None else x,
        dw_desc if dw_desc is not None else dw, dy, x, dw, dbias, first,
        n, k, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1), dw.stride(2), dbias.stride(0)), make)
    return dw, db


def grads_for_op(d_rows: torch.Tensor, rows: torch.Tensor, rows_per_a: int, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, num_experts: int, block_m: int,
                 with_bias: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moeforge::expert_weight_grad`` op's implementation: :func:`expert_weight_grad` with an empty ``db``
    without a bias (an op returns tensors)."""
    dw, db = expert_weight_grad(d_rows, rows, rows_per_a, sorted_ids, block_expert, num_padded, num_experts, block_m,
                                with_bias, dtype)
    return dw, db if db is not None else d_rows.new_empty(0, dtype=dtype)


_FIRST_BLOCKS = LaunchSite(_first_blocks_kernel)
_GATHER = LaunchSite(_gather_sorted_rows_kernel)
_WEIGHT_GRAD = LaunchSite(_weight_grad_kernel)

# What the grouped GEMM's backward formula calls (moeforge.kernels.backward): the op where it is needed, else the
# function.
EXPERT_WEIGHT_GRAD = KernelOp("moeforge::expert_weight_grad", grads_for_op)
