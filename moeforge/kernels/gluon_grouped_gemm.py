# Gluon kernels (@gluon.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""A warp-specialised grouped GEMM for Hopper in Gluon: the expert GEMM of float rows and weights (bf16 / fp16), the
same product as :func:`moeforge.kernels.moe_gemm.moe_gemm` (its Triton twin) on the same block-aligned plan.

A persistent program walks its share of the tiles (``BLOCK_M`` aligned rows of one expert × ``BLOCK_N`` output
columns; ``GROUP_M`` row blocks at a time, column by column, so that the programs at work share weight tiles and rows
in L2) in two partitions that meet
at a ring of ``STAGES`` shared-memory slots, each guarded by two barriers:

* the **loader** (its own warps): per K-step, waits until the slot is free, copies the weight tile(s) with the
  tensor memory accelerator (one descriptor over the weight viewed as ``[E · N_w, K]`` rows), and gathers the rows
  by index (``copy // rows_per_a``) with ``cp.async``, each of its threads arriving on the slot's ``ready`` barrier
  when its copies land;
* the **MMA partition** (the program's ``num_warps`` warps): per K-step, waits for the slot, fences the async proxy
  (the gathered rows are generic-proxy writes, the MMA an async-proxy read), issues the warpgroup MMA
  asynchronously, and frees the slot of the step before once that MMA has retired (one MMA in flight); at the end
  of a tile, the epilogue: the gated activation (``act(gate) · up``, the two accumulators side by side), the routing
  weights, the output rows written at their copy indices.

The loader runs ahead of the MMAs by up to ``STAGES`` K-steps, across tile boundaries, so the next tile's loads
overlap this tile's last MMAs and its epilogue. Both partitions walk the same tiles in the same order and count
K-steps the same way (tile ``i`` of a program starts at ring step ``i · k_steps``); a slot's barrier phase is
``(step // STAGES) & 1``. With ``pingpong``, two MMA partitions of one warpgroup take alternate tiles, so one's
epilogue overlaps the other's K-loop; they run their K-loops in turns, so that neither waits on a slot more than one
ring pass ahead of its barrier (a wait knows a phase only by its parity).

Which launches take it, and which fall back to the twin: :mod:`moeforge.kernels.warp_specialized`.

Gluon has no CPU interpreter: the Triton twin runs in CI, and a CPU test compiles this kernel for sm_90 to machine
code (``compile_for_hopper``); the GPU tests compare it against the twin and the torch reference.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from moeforge.kernels.config import GemmConfig
from moeforge.kernels.sizes import multiprocessors

_GLUON_ERROR: Optional[str] = None
try:  # (Gluon is experimental: a Triton without it, or with another API, leaves the Triton kernels to serve)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moeforge.kernels.bound_launch import FIXED_OPTIONS, LaunchSite
    # The asynchronous copies' names: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _gather_load = (async_copy.async_load if hasattr(async_copy, "async_load")
                    else async_copy.async_copy_global_to_shared)
except (ImportError, AttributeError) as error:  # pragma: no cover (every supported Triton has it)
    _GLUON_ERROR = f"Triton's Gluon is not importable here: {error}"

# The Gluon calls this kernel makes, as Triton 3.6 to 3.9 spell them: another Triton that renames or reshapes one is
# named here (describe() shows it, the Triton twin serves) instead of failing at the first launch.
_USED = ("gl.warp_specialize", "gl.allocate_shared_memory", "gl.NVMMASharedLayout.get_default_for",
         "gl.NVMMADistributedLayout", "gl.BlockedLayout", "gl.SliceLayout", "gl.convert_layout",
         "mbarrier.init", "mbarrier.wait", "mbarrier.arrive", "mbarrier.expect", "mbarrier.MBarrierLayout",
         "async_copy.mbarrier_arrive", "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared",
         "TensorDescriptor.from_tensor", "gluon.jit", "gluon.constexpr_function")


def _api_problem() -> Optional[str]:
    import inspect

    found = {"gl": gl, "mbarrier": mbarrier, "async_copy": async_copy, "warpgroup_mma": warpgroup_mma,
             "warpgroup_mma_wait": warpgroup_mma_wait, "fence_async_shared": fence_async_shared,
             "TensorDescriptor": TensorDescriptor, "gluon": gluon}
    for name in _USED:
        head, *rest = name.split(".")
        value: Any = found[head]
        for part in rest:
            value = getattr(value, part, None)
        if value is None:
            return f"Triton {triton.__version__}'s Gluon has no {name}, which this kernel calls (written for 3.6 to 3.9)"
    parameters = list(inspect.signature(gl.warp_specialize).parameters)[:3]
    if parameters != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return (f"Triton {triton.__version__}'s gl.warp_specialize takes {parameters}, not the (functions and "
                f"arguments, workers' warps, workers' registers) this kernel passes (written for 3.6 to 3.9)")
    return None


if _GLUON_ERROR is None:
    _GLUON_ERROR = _api_problem()

SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a block may take on sm_90
LOADER_WARPS = 4
LOADER_REGISTERS = 88
# Ping-pong: two MMA partitions of num_warps = 4 and the loader share the 64K registers of 12 warps: 224, 224 (the
# first, the default partition, gets what Triton leaves it) and 56 a thread.
PINGPONG_LOADER_REGISTERS = 56
PINGPONG_CONSUMER_REGISTERS = 224


def unavailable_reason() -> Optional[str]:
    """Why this kernel cannot run in this process (``None`` where it can be compiled; running it needs sm_90)."""
    return _GLUON_ERROR


def device_problem(device: torch.device, kernel: str = "the warp-specialised kernel") -> Optional[str]:
    """Why ``kernel`` (a Gluon kernel of moeforge's, by name) cannot run on ``device``: not an sm_90 GPU, or Gluon
    unavailable here (``None`` where it can)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_problem(device, kernel)


@functools.lru_cache(maxsize=None)
def _device_problem(device: torch.device, kernel: str) -> Optional[str]:
    if device.type != "cuda":
        return f"{kernel} is for sm_90 (Hopper) GPUs, the rows are on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"{kernel} is for sm_90 (Hopper) GPUs, {device} is sm_{capability[0]}{capability[1]}"
    return _GLUON_ERROR


if _GLUON_ERROR is None:

    @gluon.constexpr_function
    def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
        """The warpgroup MMA's accumulator layout: warps stacked along M first (16 rows each), the widest
        instruction N that divides ``BLOCK_N`` (at most 256)."""
        warps = [4, 1]
        while warps[0] * warps[1] != num_warps:
            if BLOCK_M > 16 * warps[0]:
                warps[0] *= 2
            else:
                warps[1] *= 2
        widest = max(BLOCK_N // warps[1], 8)
        n = 256
        while n > widest or BLOCK_N % n:
            n -= 8
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _row_layout(BLOCK_N, warps):
        """A layout of ``[rows, BLOCK_N]`` 16-bit tiles in 16-byte pieces (8 elements) a thread along a row."""
        across = min(BLOCK_N // 8, 32)
        return gl.BlockedLayout([1, 8], [32 // across, across], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _gather_layout(BLOCK_K, warps):
        """The loader's layout of a ``[BLOCK_M, BLOCK_K]`` row tile: 16 bytes (8 elements) a thread along K."""
        across = min(BLOCK_K // 8, 32)
        return gl.BlockedLayout([1, 8], [32 // across, across], [warps, 1], [1, 0])

    @gluon.jit
    def _tile_of(tile, m_tiles, n_tiles, GROUP_M: gl.constexpr):
        """Tile ``tile``'s (row block, column tile): groups of ``GROUP_M`` row blocks, each group's tiles column by
        column, so that the programs working at one time share weight tiles (and rows) in L2."""
        in_group = GROUP_M * n_tiles
        first_m = tile // in_group * GROUP_M
        group_rows = gl.minimum(m_tiles - first_m, GROUP_M)
        return first_m + tile % in_group % group_rows, tile % in_group // group_rows

    @gluon.jit
    def _loader(a_ptr, w_desc, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, a_bufs, w_bufs, ready, empty,
                N, K, num_copies, rows_per_a, stride_am, up_offset, u_ptr, ub_ptr, stride_um, stride_ubs, stride_ube,
                stride_ubn, update_stack, update_steps,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                GLU: gl.constexpr, GROUP_M: gl.constexpr, WEIGHT_KN: gl.constexpr, UPDATE_RANK: gl.constexpr):
        layout: gl.constexpr = _gather_layout(BLOCK_K, gl.num_warps())
        rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
        k_layout: gl.constexpr = gl.SliceLayout(0, layout)
        n_tiles = gl.cdiv(N, BLOCK_N)
        m_tiles = gl.load(num_padded_ptr) // BLOCK_M
        offs_k = gl.arange(0, BLOCK_K, layout=k_layout)
        step = 0
        for tile in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_of(tile, m_tiles, n_tiles, GROUP_M)
            copies = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_layout))
            row_ok = copies < num_copies
            rows = gl.where(row_ok, copies // rows_per_a, 0).to(gl.int64)
            expert = gl.load(block_expert_ptr + pid_m)
            w_row = expert * (2 * up_offset if GLU else N) + pid_n * BLOCK_N  # ([E · N_w, K] rows)
            for k in range(0, K, BLOCK_K):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # (the first pass finds it free)
                if GLU:
                    mbarrier.expect(ready.index(slot), 2 * w_desc.block_type.nbytes)
                    _tma_load(w_desc, [w_row, k], ready.index(slot), w_bufs.index(2 * slot))
                    _tma_load(w_desc, [w_row + up_offset, k], ready.index(slot),
                                                    w_bufs.index(2 * slot + 1))
                elif WEIGHT_KN:  # ([E · K, N] rows: the expert's K rows from k, its columns from the tile's)
                    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
                    _tma_load(w_desc, [expert * K + k, pid_n * BLOCK_N], ready.index(slot), w_bufs.index(slot))
                else:
                    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
                    _tma_load(w_desc, [w_row, k], ready.index(slot), w_bufs.index(slot))
                k_ok = (k + offs_k) < K
                _gather_load(
                    a_bufs.index(slot), a_ptr + rows[:, None] * stride_am + (k + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :])
                async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                step += 1
            if UPDATE_RANK > 0:
                # a stack's update in every adapter's columns (u [copies, S·R] weighed, B [S, E, N_w, R]): more
                # K-steps of BLOCK_K columns, BLOCK_K // R adapters each, through the same ring — u's columns by copy
                # (not copy // rows_per_a), B's rows gathered adapter by adapter, both by cp.async (zeros past the
                # stack); one plain arrival stands for the weight copy's
                member = offs_k // UPDATE_RANK
                within = offs_k % UPDATE_RANK
                u_rows = u_ptr + gl.where(row_ok, copies, 0).to(gl.int64)[:, None] * stride_um + offs_k[None, :]
                offs_bn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)
                n_ok = offs_bn < N
                b_cols = (ub_ptr + expert.to(gl.int64) * stride_ube + member.to(gl.int64)[None, :] * stride_ubs
                          + within[None, :])
                for update in range(update_steps):
                    first = update * (BLOCK_K // UPDATE_RANK)
                    used = (first + member) < update_stack
                    slot = step % STAGES
                    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                    mbarrier.arrive(ready.index(slot))
                    _gather_load(a_bufs.index(slot), u_rows + first * UPDATE_RANK,
                                 mask=row_ok[:, None] & used[None, :])
                    b_rows = b_cols + first * stride_ubs + offs_bn.to(gl.int64)[:, None] * stride_ubn
                    if GLU:
                        _gather_load(w_bufs.index(2 * slot), b_rows, mask=n_ok[:, None] & used[None, :])
                        _gather_load(w_bufs.index(2 * slot + 1), b_rows + up_offset * stride_ubn,
                                     mask=n_ok[:, None] & used[None, :])
                    else:
                        _gather_load(w_bufs.index(slot), b_rows, mask=n_ok[:, None] & used[None, :])
                    async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                    step += 1

    @gluon.jit
    def _mma_partition(a_bufs, w_bufs, ready, empty, turn, out_ptr, weights_ptr, sorted_ids_ptr, num_padded_ptr,
                       N, K, num_copies, stride_om, update_steps,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       GLU: gl.constexpr, MUL_WEIGHTS: gl.constexpr, GROUP_M: gl.constexpr,
                       COALESCED_STORE: gl.constexpr, WEIGHT_KN: gl.constexpr, CONSUMER: gl.constexpr,
                       CONSUMERS: gl.constexpr):
        # Consumer CONSUMER of CONSUMERS takes every CONSUMERS-th of the program's tiles, from its CONSUMER-th; the
        # loader fills the ring with every tile's K-steps in order, so tile i's first step is i * k_steps. Two
        # consumers run their K-loops in turns (``turn``: consumer c waits on its barrier before a K-loop and arrives
        # on the other's after it): a consumer that waited for a slot's step further ahead than the ring's next pass
        # would read a parity of an older pass as done (a barrier's wait knows a phase only by its parity).
        layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, gl.num_warps())
        n_tiles = gl.cdiv(N, BLOCK_N)
        m_tiles = gl.load(num_padded_ptr) // BLOCK_M
        k_steps = gl.cdiv(K, BLOCK_K) + update_steps  # (an update's K-steps come through the ring after the tile's)
        index = CONSUMER
        turns = 0
        for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), m_tiles * n_tiles,
                          CONSUMERS * gl.num_programs(0)):
            pid_m, pid_n = _tile_of(tile, m_tiles, n_tiles, GROUP_M)
            step = index * k_steps
            index += CONSUMERS
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
            acc_up = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
            if CONSUMERS > 1:  # (consumer 0's first turn is free)
                mbarrier.wait(turn.index(CONSUMER), (turns & 1) ^ (1 - CONSUMER))
                turns += 1
            previous = 0
            for k in range(0, k_steps):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                # The rows (and an update's columns) came by cp.async, writes of the generic proxy; the MMA reads shared
                # memory through the async proxy, which sees them only after an async-proxy fence (PTX manual, wgmma's
                # "Async Proxy"). The barrier's wait orders them before this thread; the fence, before its MMA.
                fence_async_shared()
                if GLU:
                    acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot).permute((1, 0)), acc,
                                        is_async=True)
                    acc_up = warpgroup_mma(a_bufs.index(slot), w_bufs.index(2 * slot + 1).permute((1, 0)), acc_up,
                                           is_async=True)
                    acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
                elif WEIGHT_KN:  # (the weight tile is [BLOCK_K, BLOCK_N] already)
                    acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot), acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                else:
                    acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                # the step before has retired: its slot is free
                mbarrier.arrive(empty.index(previous), pred=k > 0)
                previous = slot
                step += 1
            if CONSUMERS > 1:  # the other consumer's K-loop may start: this one's MMAs are issued
                mbarrier.arrive(turn.index(1 - CONSUMER))
            if GLU:
                acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(previous), pred=k_steps > 0)
            # the epilogue: SwiGLU's act(gate) · up, the routing weights, each row at its copy index
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            copies = gl.load(sorted_ids_ptr + offs_m)
            row_ok = copies < num_copies
            if GLU:
                acc = acc / (1.0 + gl.exp(-acc)) * acc_up
            if MUL_WEIGHTS:
                acc = acc * gl.load(weights_ptr + copies, mask=row_ok, other=0.0)[:, None]
            value = acc.to(out_ptr.dtype.element_ty)
            if COALESCED_STORE:
                # through shared memory into rows of 16-byte pieces, a warp writing whole row segments (the MMA
                # layout's threads hold 4 bytes of a row each)
                store_layout: gl.constexpr = _row_layout(BLOCK_N, gl.num_warps())
                value = gl.convert_layout(value, store_layout)
                offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
                offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
                copies = gl.load(sorted_ids_ptr + offs_m)
                row_ok = copies < num_copies
            gl.store(out_ptr + copies.to(gl.int64)[:, None] * stride_om + offs_n[None, :], value,
                     mask=row_ok[:, None] & (offs_n < N)[None, :])

    @gluon.jit
    def ws_grouped_gemm_kernel(a_ptr, w_desc, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                               N, K, num_copies, rows_per_a, stride_am, stride_om, up_offset, u_ptr, ub_ptr,
                               stride_um, stride_ubs, stride_ube, stride_ubn, update_stack, update_steps,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                               STAGES: gl.constexpr, GLU: gl.constexpr, MUL_WEIGHTS: gl.constexpr,
                               GROUP_M: gl.constexpr, COALESCED_STORE: gl.constexpr, WEIGHT_KN: gl.constexpr,
                               UPDATE_RANK: gl.constexpr, PINGPONG: gl.constexpr,
                               LOADER_WARPS_: gl.constexpr,
                               LOADER_REGS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        dtype: gl.constexpr = w_desc.dtype
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES * (2 if GLU else 1)] + w_desc.block_type.shape,
                                           w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            # ready: the weight copy's expected bytes (one arrival) and each loader thread's row copies
            mbarrier.init(ready.index(slot), count=1 + 32 * LOADER_WARPS_)
            mbarrier.init(empty.index(slot), count=1)
        # Ping-pong's K-loop turns. One MMA partition takes none and is handed ``empty`` in their place (never touched
        # as one): a barrier initialised and never used again is dead to Triton's shared-memory allocator, which gives
        # its bytes to the epilogue's scratch — plain stores over an mbarrier object, undefined in PTX
        # (docs/kernels.md, "The warp-specialised kernel's wrong rows under load").
        if PINGPONG:
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for consumer in gl.static_range(2):
                mbarrier.init(turn.index(consumer), count=1)
        else:
            turn = empty
        fence_async_shared()
        # (each partition's arguments as a tuple written out: a tuple held in a variable loses its constexprs)
        if PINGPONG:  # two MMA partitions on alternate tiles: one's epilogue overlaps the other's K-loop
            gl.warp_specialize([
                (_mma_partition, (a_bufs, w_bufs, ready, empty, turn, out_ptr, weights_ptr, sorted_ids_ptr,
                                  num_padded_ptr, N, K, num_copies, stride_om, update_steps, BLOCK_M, BLOCK_N,
                                  BLOCK_K, STAGES, GLU, MUL_WEIGHTS, GROUP_M, COALESCED_STORE, WEIGHT_KN, 0, 2)),
                (_mma_partition, (a_bufs, w_bufs, ready, empty, turn, out_ptr, weights_ptr, sorted_ids_ptr,
                                  num_padded_ptr, N, K, num_copies, stride_om, update_steps, BLOCK_M, BLOCK_N,
                                  BLOCK_K, STAGES, GLU, MUL_WEIGHTS, GROUP_M, COALESCED_STORE, WEIGHT_KN, 1, 2)),
                (_loader, (a_ptr, w_desc, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, a_bufs, w_bufs, ready,
                           empty, N, K, num_copies, rows_per_a, stride_am, up_offset, u_ptr, ub_ptr, stride_um,
                           stride_ubs, stride_ube, stride_ubn, update_stack, update_steps, BLOCK_M, BLOCK_N, BLOCK_K,
                           STAGES, GLU, GROUP_M, WEIGHT_KN, UPDATE_RANK)),
            ], [CONSUMER_WARPS, LOADER_WARPS_], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_mma_partition, (a_bufs, w_bufs, ready, empty, turn, out_ptr, weights_ptr, sorted_ids_ptr,
                                  num_padded_ptr, N, K, num_copies, stride_om, update_steps, BLOCK_M, BLOCK_N,
                                  BLOCK_K, STAGES, GLU, MUL_WEIGHTS, GROUP_M, COALESCED_STORE, WEIGHT_KN, 0, 1)),
                (_loader, (a_ptr, w_desc, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, a_bufs, w_bufs, ready,
                           empty, N, K, num_copies, rows_per_a, stride_am, up_offset, u_ptr, ub_ptr, stride_um,
                           stride_ubs, stride_ube, stride_ubn, update_stack, update_steps, BLOCK_M, BLOCK_N, BLOCK_K,
                           STAGES, GLU, GROUP_M, WEIGHT_KN, UPDATE_RANK)),
            ], [LOADER_WARPS_], [LOADER_REGS])


    # The kernel's bound launches by their key and specialisation (moeforge.kernels.bound_launch)
    _WS_GROUPED_GEMM = LaunchSite(ws_grouped_gemm_kernel)


def gl_dtype(dtype: torch.dtype) -> Any:
    """Gluon's name of a tile's dtype (16-bit operands; fp32 outputs)."""
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def _weight_box(config: GemmConfig, weight_kn: bool) -> list[int]:
    return [config.block_k, config.block_n] if weight_kn else [config.block_n, config.block_k]


@functools.lru_cache(maxsize=None)
def shared_layout(box: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The default shared-memory layout (the widest swizzle the box's rows allow) of TMA boxes of ``dtype``: made
    once per box and dtype (a launch builds its descriptors with it; the layout is an immutable record)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype(dtype))


def weight_descriptor(weight: torch.Tensor, config: GemmConfig, weight_kn: bool = False) -> Any:
    """The weight's TMA descriptor: ``[E, N_w, K]`` viewed as ``[E · N_w, K]`` rows, tiles of ``block_n × block_k``
    (``weight_kn``: ``[E, K, N]`` as ``[E · K, N]`` rows, tiles of ``block_k × block_n``)."""
    rows = weight.reshape(-1, weight.shape[-1])
    box = _weight_box(config, weight_kn)
    return TensorDescriptor.from_tensor(rows, box, shared_layout(tuple(box), weight.dtype))


def operand_problem(a: torch.Tensor, weight: torch.Tensor, config: GemmConfig, glu: bool, aligned_block_m: int,
                    weight_kn: bool = False, coalesced_store: bool = True, pingpong: bool = False) -> Optional[str]:
    """What this kernel does not take among these rows, weight, tile and alignment (``None``: it takes them)."""
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if a.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != a.dtype:
        return (f"the warp-specialised GEMM takes bf16 / fp16 rows and weights of one dtype, got {a.dtype} and "
                f"{weight.dtype}")
    if weight.dim() != 3 or not weight.is_contiguous():
        return f"weight must be a contiguous {'[E, K, N]' if weight_kn else '[E, N_w, K]'}, got {tuple(weight.shape)}"
    if glu and weight_kn:
        return "the gated gate/up GEMM reads [E, 2N, K] weights (weight_kn=False)"
    if glu and weight.shape[1] % 2:
        return f"the gated gate/up GEMM needs an even weight width, got {weight.shape[1]}"
    k_dim = weight.shape[1] if weight_kn else weight.shape[2]
    if a.dim() != 2 or a.stride(1) != 1 or a.shape[1] != k_dim:
        return f"rows must be [rows, K={k_dim}] with contiguous rows, got {tuple(a.shape)}"
    found = tile_problem(config, glu, a.element_size(), coalesced_store, pingpong)
    if found is not None:
        return found
    if aligned_block_m % config.block_m:
        return f"block_m={config.block_m} must divide the alignment's block {aligned_block_m}"
    if k_dim % 16 or a.stride(0) % 16 or weight.shape[2] % 8:
        return (f"K and the rows' stride must be multiples of 16 elements and the weight's rows of 16 bytes (the rows' "
                f"16-byte copies, the weight's TMA descriptor), got K={k_dim}, stride {a.stride(0)}, weight rows of "
                f"{weight.shape[2]}")
    if a.data_ptr() % 16 or weight.data_ptr() % 16:
        return "the rows and the weight must start at 16-byte aligned addresses (16-byte copies, a TMA descriptor)"
    return None


def tile_problem(config: GemmConfig, glu: bool, element_bytes: int = 2, coalesced_store: bool = True,
                 pingpong: bool = False) -> Optional[str]:
    """What this kernel does not take in a launch configuration: its tile's sizes, warps and stages, and the shared
    memory they take with the store and partitions asked for (``None``: it takes it)."""
    if (config.block_m not in (64, 128) or config.num_warps not in (4, 8) or config.block_k not in (32, 64, 128)
            or config.block_n % 16 or not 16 <= config.block_n <= 256 or config.num_stages < 2):
        return (f"the warp-specialised GEMM's tiles have 64 or 128 rows, 16 to 256 columns (a multiple of 16), K-steps "
                f"of 32, 64 or 128, 4 or 8 MMA warps and at least 2 stages, got {config.block_m} x {config.block_n} x "
                f"{config.block_k}, {config.num_warps} warps, {config.num_stages} stages")
    if pingpong and config.num_warps != 4:
        return f"ping-pong MMA partitions are one warpgroup each (num_warps=4), got {config.num_warps}"
    if pingpong and config.block_m * config.block_n > (64 if glu else 128) * 128:
        return (f"a ping-pong MMA partition (one warpgroup) holds at most {64 if glu else 128} x 128 accumulators"
                f"{' for gate and for up' if glu else ''}, got {config.block_m} x {config.block_n}")
    needed = shared_memory_bytes(config, glu, element_bytes, coalesced_store, pingpong)
    if needed > SHARED_MEMORY_LIMIT:
        return f"the tile needs {needed} bytes of shared memory, more than a block's {SHARED_MEMORY_LIMIT}"
    return None


def check_operands(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: GemmConfig, glu: bool,
                   aligned_block_m: int, weight_kn: bool = False, coalesced_store: bool = True,
                   pingpong: bool = False) -> None:
    """A ``ValueError`` naming what this kernel does not take."""
    problem = operand_problem(a, weight, config, glu, aligned_block_m, weight_kn, coalesced_store, pingpong)
    if problem is not None:
        raise ValueError(problem)
    n_out = weight.shape[2] if weight_kn else weight.shape[1] // 2 if glu else weight.shape[1]
    if out.dim() != 2 or out.shape[1] != n_out or out.stride(1) != 1 or out.dtype not in (a.dtype, torch.float32):
        raise ValueError(f"out must be [copies, {n_out}] in {a.dtype} or fp32 with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if out.data_ptr() % 16 or out.stride(0) * out.element_size() % 16:
        raise ValueError(f"out's rows must start at 16-byte aligned addresses (the store's 16-byte pieces), got a "
                         f"row stride of {out.stride(0) * out.element_size()} bytes")


def shared_memory_bytes(config: GemmConfig, glu: bool, element_bytes: int = 2, coalesced_store: bool = True,
                        pingpong: bool = False) -> int:
    """An upper bound of the shared memory a launch takes: the ring's row and weight tiles, the output tile the
    coalesced store passes through (one per MMA partition), the barriers."""
    ring = config.num_stages * (config.block_m + (2 if glu else 1) * config.block_n) * config.block_k
    store = config.block_m * config.block_n * (2 if pingpong else 1) if coalesced_store else 0
    return (ring + store) * element_bytes + 8 * (2 * config.num_stages + 2) + 1024


def ws_grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                    block_expert: torch.Tensor, num_padded: torch.Tensor, *, rows_per_a: int, config: GemmConfig,
                    glu: bool = False, topk_weights: Optional[torch.Tensor] = None,
                    aligned_block_m: Optional[int] = None, programs: Optional[int] = None,
                    pingpong: bool = False, coalesced_store: bool = True, weight_kn: bool = False,
                    update: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``out[copy] = epilogue(a[copy // rows_per_a] @ weight[expert].T)`` for every copy of the block-aligned plan
    (``sorted_ids``, ``block_expert``, ``num_padded``), as :func:`moeforge.kernels.moe_gemm.moe_gemm` computes it:
    ``glu`` the SwiGLU gate/up GEMM (concatenated ``[gate | up]`` rows; ``out`` ``N_w / 2`` wide), else a plain one;
    ``topk_weights [copies]`` multiply each row. ``config``: ``block_m / block_n / block_k``, ``num_warps`` (the MMA
    partition's; 8 for 128-row tiles), ``num_stages`` (the ring's slots). ``programs``: the persistent grid (by default
    one per multiprocessor). ``pingpong``: two MMA partitions of ``num_warps`` (4) on alternate tiles, so that one's
    epilogue overlaps the other's K-loop. ``coalesced_store``: the output tile through shared memory into 16-byte
    row pieces before it is written (else written from the MMA layout, 4 bytes a thread and row). ``weight_kn``:
    ``weight [E, K, N]``, ``out[copy] = epilogue(a[copy // rows_per_a] @ weight[expert])`` (the stored ``[E, N_w, K]``
    weight read this way is the row gradient's product, ``d_pre @ W``). ``out``: the rows' dtype or fp32 (a row
    gradient whose copies are summed afterwards). ``update``: ``(rows [copies, S·R], weight [S, E, N_w, R])``, a
    stack's update in every adapter's columns added to each copy's product before the epilogue (copy ``c``'s
    ``rows[c]`` against its expert's ``weight[:, e]``, the adapters' ``R`` columns side by side:
    :func:`update_problem`)."""
    aligned = aligned_block_m or config.block_m
    check_operands(a, weight, out, config, glu, aligned, weight_kn, coalesced_store, pingpong)
    if update is not None:
        found = update_problem(a, weight, config, update[0], update[1], None, 1.0, weight_kn)
        if found is not None:
            raise ValueError(found)
    if block_expert.numel() != -(-sorted_ids.numel() // aligned):  # (the plan's last block may be partial)
        raise ValueError(f"block_expert has {block_expert.numel()} entries for {sorted_ids.numel()} slots in blocks "
                         f"of {aligned}")
    return launch_checked(a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a, config=config,
                          glu=glu, topk_weights=topk_weights, aligned_block_m=aligned, programs=programs,
                          pingpong=pingpong, coalesced_store=coalesced_store, weight_kn=weight_kn, update=update)


def launch_checked(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                   block_expert: torch.Tensor, num_padded: torch.Tensor, *, rows_per_a: int, config: GemmConfig,
                   glu: bool, topk_weights: Optional[torch.Tensor], aligned_block_m: int,
                   programs: Optional[int] = None, pingpong: bool = False, coalesced_store: bool = True,
                   weight_kn: bool = False, update: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                   ) -> torch.Tensor:
    """:func:`ws_grouped_gemm` on operands already checked (its checks, or :func:`operand_problem` on a launch whose
    output and plan the caller made, and :func:`update_problem`): the launch alone. ``update``: a stack's update in
    every adapter's columns, ``(rows [copies, S·R], weight [S, E, N_w, R])`` (see :func:`update_problem`)."""
    if aligned_block_m != config.block_m:  # a tile's expert by its own block: the plan's table repeated
        block_expert = block_expert.repeat_interleave(aligned_block_m // config.block_m)
    num_copies, n_out = out.shape
    if num_copies == 0 or n_out == 0:
        return out
    if programs is None:
        programs = multiprocessors(a.device)
    mul_weights = topk_weights is not None
    if update is not None:
        u, ub = update
        rank, stack = int(ub.shape[3]), int(ub.shape[0])
        update_args = (u, ub, u.stride(0), ub.stride(0), ub.stride(1), ub.stride(2), stack,
                       -(-stack // (config.block_k // rank)))
    else:
        rank, update_args = 0, (out, out, 0, 0, 0, 0, 0, 0)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages,
                     GLU=glu, MUL_WEIGHTS=mul_weights, GROUP_M=config.group_m, COALESCED_STORE=coalesced_store,
                     WEIGHT_KN=weight_kn, UPDATE_RANK=rank, **_partitions(pingpong)),
                dict(num_warps=config.num_warps))

    # (the key names what the constexprs and the descriptor's box, dtype and layout follow: the launch site adds the
    # other arguments' specialisation; the bound launch skips the JIT's binding of every argument on each call)
    _WS_GROUPED_GEMM.launch(
        (config, glu, mul_weights, coalesced_store, weight_kn, pingpong, rank, weight.dtype, a.device), (programs,),
        (a, weight_descriptor(weight, config, weight_kn), out, topk_weights if mul_weights else out, sorted_ids,
         block_expert, num_padded, n_out, a.shape[1], num_copies, rows_per_a, a.stride(0), out.stride(0),
         n_out if glu else 0, *update_args), make)
    return out


def update_problem(a: torch.Tensor, weight: torch.Tensor, config: GemmConfig, rows: Optional[torch.Tensor],
                   update_weight: Optional[torch.Tensor], ids: Optional[torch.Tensor], scale: float,
                   weight_kn: bool = False) -> Optional[str]:
    """What this kernel does not take in a low-rank update (``None``: no update, or one it takes): it adds a stack's
    update in every adapter's columns (``rows [copies, S·R]``, weighed, from
    :func:`moeforge.kernels.stack_wide.stack_wide`; ``update_weight [S, E, N_w, R]``; no ids, scale 1) as more K-steps
    through its ring, ``BLOCK_K // R`` adapters a step, loaded by ``cp.async`` in 16-byte pieces: ``R`` a multiple of
    16 dividing ``BLOCK_K``, the rows' dtype, contiguous rows and ``R`` columns."""
    if rows is None and update_weight is None:
        return None
    if rows is None or update_weight is None or ids is not None or update_weight.dim() != 4 or rows.dim() != 2:
        return "the warp-specialised kernel adds a stack's update in every adapter's columns alone (no ids, no parts)"
    stack, experts, width, rank = (int(size) for size in update_weight.shape)
    if scale != 1.0 or weight_kn:
        return "the warp-specialised kernel's update comes weighed (scale 1), on [E, N_w, K] weights"
    if rank % 16 or config.block_k % rank or rows.shape[1] != stack * rank:
        return (f"the warp-specialised kernel's update steps take ranks that are multiples of 16 dividing BLOCK_K="
                f"{config.block_k}, rows [copies, S·R]; got rank {rank}, rows {tuple(rows.shape)}")
    if (experts, width) != (int(weight.shape[0]), int(weight.shape[1])) or update_weight.dtype != a.dtype \
            or rows.dtype != a.dtype:
        return "the update's weight must be [S, E, N_w, R] of the GEMM's experts and rows, in the rows' dtype"
    if (rows.stride(1) != 1 or update_weight.stride(3) != 1 or rows.stride(0) % 8
            or any(stride % 8 for stride in update_weight.stride()[:3]) or rows.data_ptr() % 16
            or update_weight.data_ptr() % 16):
        return "the update's rows and weight need contiguous 16-byte pieces (cp.async)"
    return None


def _partitions(pingpong: bool) -> dict[str, Any]:
    """The partitions' compile-time settings: one MMA partition, or two (ping-pong), and the loader's."""
    return dict(PINGPONG=pingpong, LOADER_WARPS_=LOADER_WARPS,
                LOADER_REGS=PINGPONG_LOADER_REGISTERS if pingpong else LOADER_REGISTERS,
                CONSUMER_WARPS=4, CONSUMER_REGS=PINGPONG_CONSUMER_REGISTERS)


def compile_for_hopper(config: GemmConfig, glu: bool, mul_weights: bool, dtype: torch.dtype = torch.bfloat16,
                       pingpong: bool = False, coalesced_store: bool = True, weight_kn: bool = False,
                       out_fp32: bool = False, update_rank: int = 0) -> Any:
    """The kernel compiled for sm_90 down to machine code without a GPU (Triton's ``ptxas``): what the CPU test
    checks, and where the PTX and the register counts can be read (``.asm``)."""
    if _GLUON_ERROR is not None:
        raise ValueError(_GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    out_name = "fp32" if out_fp32 else name
    box = _weight_box(config, weight_kn)
    layout = shared_layout(tuple(box), dtype)
    signature = dict(a_ptr=f"*{name}", w_desc=f"tensordesc<{name}[{box[0]},{box[1]}],{layout!r}>",
                     out_ptr=f"*{out_name}", weights_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                     num_padded_ptr="*i32", N="i32", K="i32", num_copies="i32", rows_per_a="i32", stride_am="i32",
                     stride_om="i32", up_offset="i32", u_ptr=f"*{name}", ub_ptr=f"*{name}", stride_um="i32",
                     stride_ubs="i32", stride_ube="i32", stride_ubn="i32", update_stack="i32", update_steps="i32")
    constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      STAGES=config.num_stages, GLU=glu, MUL_WEIGHTS=mul_weights, GROUP_M=config.group_m,
                      COALESCED_STORE=coalesced_store, WEIGHT_KN=weight_kn, UPDATE_RANK=update_rank,
                      **_partitions(pingpong))
    signature.update({key: "constexpr" for key in constexprs})
    # what the JIT specialises at a launch whose pointers, widths and strides are multiples of 16
    divisible = ("a_ptr", "out_ptr", "weights_ptr", "sorted_ids_ptr", "block_expert_ptr", "num_padded_ptr", "N", "K",
                 "stride_am", "stride_om", "up_offset", "u_ptr", "ub_ptr", "stride_um", "stride_ubs", "stride_ube",
                 "stride_ubn")
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = GluonASTSource(ws_grouped_gemm_kernel, signature, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, **FIXED_OPTIONS))
