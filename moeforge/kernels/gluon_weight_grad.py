# Gluon kernels (@gluon.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The experts' weight gradient warp-specialised in Gluon for Hopper: ``dW[e] = dy_e^T @ x_e`` over each expert's
copies in expert order — on the operands :func:`moeforge.kernels.weight_grad.expert_weight_grad` gathers into that
order — the same tiles, steps and sums as its ``_weight_grad_kernel`` (the Triton twin, which CI runs in the
interpreter and the GPU tests compare this kernel with, bit for bit). (A gradient narrow on one side, an adapter's,
runs :mod:`moeforge.kernels.narrow_weight_grad` instead, its rows read by index.)

A persistent program walks the output tiles ``p, p + P, ...`` in the twin's order (expert, then ``BLOCK_N`` strip,
then ``BLOCK_K`` strip) in partitions that meet at a ring of ``STAGES`` shared-memory slots:

* the **loader** (one warp): per reduction step of each tile, ``BLOCK_M`` rows of ``dy`` (the tile's ``BLOCK_N``
  columns) and of ``x`` (its ``BLOCK_K`` columns) into a free slot by TMA;
* the **MMA partitions**: per step, the warpgroup MMA of ``dy``'s tile transposed in shared memory (``A``, its rows
  the reduction) by ``x``'s, one MMA in flight; at a tile's end its accumulator converted to rows of 16-byte pieces
  and stored — or (``TMA_STORE``) written to the partition's shared-memory buffer and stored from there by TMA, the
  buffer rewritten once the previous tile's store has read it (for short reductions, where a tile's store weighs
  as much as its MMAs). With ``pingpong`` two MMA partitions of one warpgroup each take alternate tiles, so one's store
  overlaps the other's MMAs; they take their K-loops in turns (``turn`` barriers), so that neither waits on a slot
  more than one ring pass ahead of its barrier (a wait knows a phase only by its parity) — the weight gradient's
  K-loops are short (an expert's rows: a few steps at many experts), which is where the store weighs.

A tile's step count is its expert's rows in whole steps, read off ``counts`` by every partition, so the ring
positions agree; an idle expert's tiles take no step and store zeros. A run's last step, where the run is not whole
steps long, brings the rows after the run: zeros where one operand's runs are padded to whole steps (the twin's
operands), else the next expert's first rows (or TMA's zero fill past the last row) — with ``MASK_TAIL`` the MMA
partition zeroes those rows of the ``x`` tile in shared memory before its MMA, so both operands may be compact (one
row per copy: no padded copy of either) and the products are the twin's (zero rows times the next expert's rows of
the other operand: zeros, unless those hold an infinity or a NaN, as in the twin's padded steps). No bias: a layer's
bias gradient is summed beside it (:func:`moeforge.kernels.weight_grad.expert_bias_grad`).
Gluon has no CPU interpreter: :func:`compile_for_hopper` compiles the kernel for sm_90 on a CPU (the CI test).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moeforge.kernels import gluon_grouped_gemm as gluon_gemm
from moeforge.kernels.sizes import multiprocessors

_GLUON_ERROR: Optional[str] = gluon_gemm.unavailable_reason()
if _GLUON_ERROR is None:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moeforge.kernels.bound_launch import FIXED_OPTIONS, LaunchSite
    from moeforge.kernels.gluon_grouped_gemm import _mma_layout, _row_layout, _tma_load

    # The TMA store's name: ``async_store`` from Triton 3.7 on, ``async_copy_shared_to_global`` before.
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

LOADER_WARPS = 1  # TMA copies: one warp issues them
LOADER_REGISTERS = 24
CONSUMER_REGISTERS = 232  # two MMA warpgroups of 128 x 128 fp32 accumulators and the loader in 64K registers


unavailable_reason = gluon_gemm.unavailable_reason  # (the same Gluon calls, checked once)


if _GLUON_ERROR is None:

    @gluon.jit
    def _tile_of(tile, per_expert, tiles_k):
        """Tile ``tile``'s (expert, ``BLOCK_N`` strip, ``BLOCK_K`` strip): the twin's grid order."""
        return tile // per_expert, tile % per_expert // tiles_k, tile % tiles_k

    @gluon.jit
    def _loader(dy_desc, x_desc, dy_first_ptr, x_first_ptr, count_ptr, dy_bufs, x_bufs, ready, empty, N, K,
                num_experts, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr):
        tiles_k = gl.cdiv(K, BLOCK_K)
        per_expert = gl.cdiv(N, BLOCK_N) * tiles_k
        step = 0
        for tile in range(gl.program_id(0), num_experts * per_expert, gl.num_programs(0)):
            expert, pid_n, pid_k = _tile_of(tile, per_expert, tiles_k)
            dy_first = gl.load(dy_first_ptr + expert)
            x_first = gl.load(x_first_ptr + expert)
            count = gl.load(count_ptr + expert)
            for done in range(0, count, BLOCK_M):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # (the first pass finds it free)
                mbarrier.expect(ready.index(slot), dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
                _tma_load(dy_desc, [dy_first + done, pid_n * BLOCK_N], ready.index(slot), dy_bufs.index(slot))
                _tma_load(x_desc, [x_first + done, pid_k * BLOCK_K], ready.index(slot), x_bufs.index(slot))
                step += 1

    @gluon.jit
    def _zero_rows_from(buf, keep, ROWS: gl.constexpr, COLS: gl.constexpr):
        """Rows ``keep`` and on of the ``[ROWS, COLS]`` tile in shared memory ``buf`` set to zero (a run's last step:
        those rows are the next expert's), the tile then fenced for the MMA's reads: the 16-row pieces past ``keep``
        written zeros, the piece that holds row ``keep`` read, masked and written back."""
        layout: gl.constexpr = _row_layout(COLS, gl.num_warps())
        for piece in gl.static_range(ROWS // 16):
            if piece * 16 + 16 > keep:
                part = buf.slice(piece * 16, 16)
                if piece * 16 >= keep:
                    part.store(gl.zeros([16, COLS], buf.dtype, layout))
                else:
                    rows = piece * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                    tile = part.load(layout)
                    part.store(gl.where((rows < keep)[:, None], tile, gl.zeros([16, COLS], buf.dtype, layout)))
        fence_async_shared()

    @gluon.jit
    def _mma_partition(dy_bufs, x_bufs, ready, empty, turn, dw_ptr, dw_desc, out_bufs, count_ptr, N, K, num_experts,
                       stride_dwe, stride_dwn, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr,
                       TMA_STORE: gl.constexpr, MASK_TAIL: gl.constexpr):
        # Consumer CONSUMER of CONSUMERS takes every CONSUMERS-th of the program's tiles from its CONSUMER-th and
        # counts every tile's steps (the loader fills the ring with all of them in order): ``step`` is the ring
        # position of the current tile's first step.
        layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_K, gl.num_warps())
        store_layout: gl.constexpr = _row_layout(BLOCK_K, gl.num_warps())
        tiles_k = gl.cdiv(K, BLOCK_K)
        per_expert = gl.cdiv(N, BLOCK_N) * tiles_k
        step = 0
        index = 0
        turns = 0
        for tile in range(gl.program_id(0), num_experts * per_expert, gl.num_programs(0)):
            expert, pid_n, pid_k = _tile_of(tile, per_expert, tiles_k)
            count = gl.load(count_ptr + expert)
            steps = gl.cdiv(count, BLOCK_M)
            if index % CONSUMERS == CONSUMER:
                acc = gl.zeros((BLOCK_N, BLOCK_K), gl.float32, layout)
                if CONSUMERS > 1:  # (consumer 0's first turn is free)
                    mbarrier.wait(turn.index(CONSUMER), (turns & 1) ^ (1 - CONSUMER))
                    turns += 1
                previous = 0
                for s in range(0, steps):
                    ring = step + s
                    slot = ring % STAGES
                    mbarrier.wait(ready.index(slot), (ring // STAGES) & 1)
                    if MASK_TAIL:
                        keep = count - s * BLOCK_M
                        if keep < BLOCK_M:  # the run's last step, partly the next expert's rows: zeros in x
                            _zero_rows_from(x_bufs.index(slot), keep, BLOCK_M, BLOCK_K)
                    acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot), acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    mbarrier.arrive(empty.index(previous), pred=s > 0)  # the step before has retired
                    previous = slot
                if CONSUMERS > 1:  # the other consumer's K-loop may start: this one's MMAs are issued
                    mbarrier.arrive(turn.index(1 - CONSUMER))
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index(previous), pred=steps > 0)
                if TMA_STORE:  # through this partition's buffer, once its previous tile's store has read it
                    out = out_bufs.index(CONSUMER)
                    tma.store_wait(0)
                    out.store(acc.to(dw_desc.dtype))
                    fence_async_shared()
                    _tma_store(dw_desc, [expert * N + pid_n * BLOCK_N, pid_k * BLOCK_K], out)
                else:
                    # the tile in rows of 16-byte pieces (the MMA layout's threads hold 4 bytes of a row each)
                    value = gl.convert_layout(acc.to(dw_ptr.dtype.element_ty), store_layout)
                    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, store_layout))
                    offs_k = pid_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, store_layout))
                    rows = expert.to(gl.int64) * stride_dwe + offs_n.to(gl.int64) * stride_dwn
                    gl.store(dw_ptr + rows[:, None] + offs_k[None, :], value,
                             mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])
            step += steps
            index += 1
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit
    def ws_weight_grad_kernel(dy_desc, x_desc, dw_ptr, dw_desc, dy_first_ptr, x_first_ptr, count_ptr, N, K, num_experts,
                              stride_dwe, stride_dwn, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                              TMA_STORE: gl.constexpr, MASK_TAIL: gl.constexpr,
                              LOADER_WARPS_: gl.constexpr, LOADER_REGS: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr):
        dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BLOCK_M, BLOCK_N], dy_desc.layout)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if TMA_STORE:  # a finished tile's buffer per MMA partition (``dw_desc``: dW as [E * N, K])
            out_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2 if PINGPONG else 1] + dw_desc.block_type.shape,
                                                 dw_desc.layout)
        else:
            out_bufs = empty  # (not read: the tile is stored from registers)
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)  # (the TMA copies' expected bytes: one arrival)
            mbarrier.init(empty.index(slot), count=1)
        # Ping-pong's turns; one MMA partition takes none and is handed ``empty`` (never touched as one): a barrier
        # initialised and unused is dead to the shared-memory allocator, which may give its bytes to other buffers,
        # plain accesses over an mbarrier object (see the forward kernel, moeforge.kernels.gluon_grouped_gemm)
        if PINGPONG:
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for consumer in gl.static_range(2):
                mbarrier.init(turn.index(consumer), count=1)
        else:
            turn = empty
        fence_async_shared()
        # (each partition's arguments as a tuple written out: a tuple held in a variable loses its constexprs)
        if PINGPONG:
            gl.warp_specialize([
                (_mma_partition, (dy_bufs, x_bufs, ready, empty, turn, dw_ptr, dw_desc, out_bufs, count_ptr, N, K,
                                  num_experts, stride_dwe, stride_dwn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 2,
                                  TMA_STORE, MASK_TAIL)),
                (_mma_partition, (dy_bufs, x_bufs, ready, empty, turn, dw_ptr, dw_desc, out_bufs, count_ptr, N, K,
                                  num_experts, stride_dwe, stride_dwn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 1, 2,
                                  TMA_STORE, MASK_TAIL)),
                (_loader, (dy_desc, x_desc, dy_first_ptr, x_first_ptr, count_ptr, dy_bufs, x_bufs, ready, empty, N,
                           K, num_experts, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
            ], [CONSUMER_WARPS, LOADER_WARPS_], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_mma_partition, (dy_bufs, x_bufs, ready, empty, turn, dw_ptr, dw_desc, out_bufs, count_ptr, N, K,
                                  num_experts, stride_dwe, stride_dwn, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 1,
                                  TMA_STORE, MASK_TAIL)),
                (_loader, (dy_desc, x_desc, dy_first_ptr, x_first_ptr, count_ptr, dy_bufs, x_bufs, ready, empty, N,
                           K, num_experts, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
            ], [LOADER_WARPS_], [LOADER_REGS])

    # The kernel's bound launches by their key and specialisation (moeforge.kernels.bound_launch)
    _WS_WEIGHT_GRAD = LaunchSite(ws_weight_grad_kernel)


def _partitions(pingpong: bool) -> dict[str, Any]:
    return dict(PINGPONG=pingpong, LOADER_WARPS_=LOADER_WARPS, LOADER_REGS=LOADER_REGISTERS, CONSUMER_WARPS=4,
                CONSUMER_REGS=CONSUMER_REGISTERS)


def shared_memory_bytes(block_m: int, block_n: int, block_k: int, stages: int, pingpong: bool,
                        element_bytes: int = 2, out_bytes: int = 2) -> int:
    """An upper bound of a launch's shared memory: the ring's tiles, each MMA partition's finished tile (converted
    for the store, or the TMA store's buffer) in ``out_bytes`` per element, the barriers."""
    ring = stages * block_m * (block_n + block_k) * element_bytes
    store = block_n * block_k * (2 if pingpong else 1) * out_bytes
    return ring + store + 8 * (2 * stages + 2) + 1024


def tma_store_problem(dw: torch.Tensor, block_m: int, block_n: int, block_k: int, stages: int,
                      pingpong: bool) -> Optional[str]:
    """Why the finished tiles cannot be stored by TMA (``None`` where they can; else they are stored from registers):
    the store sees dW as ``[E * N, K]``, so a tile must not cross into the next expert's rows, and its buffers must
    fit beside the ring."""
    num_experts, n, k = dw.shape
    if not dw.is_contiguous():
        return "a TMA store needs a contiguous dW"
    if n % block_n:
        return f"a TMA store of {block_n}-row tiles would cross from one expert's {n} rows into the next's"
    if shared_memory_bytes(block_m, block_n, block_k, stages, pingpong,
                           out_bytes=dw.element_size()) > gluon_gemm.SHARED_MEMORY_LIMIT:
        return f"the store buffers of {dw.dtype} tiles need more than a block's shared memory beside {stages} stages"
    return None


def tile_problem(block_m: int, block_n: int, block_k: int, num_warps: int, stages: int,
                 pingpong: bool) -> Optional[str]:
    """What this kernel does not take in a launch's tiles (``None``: it takes them)."""
    if block_m not in (32, 64, 128) or block_n not in (64, 128, 256) or block_k not in (64, 128, 256):
        return (f"the warp-specialised weight gradient's steps are 32, 64 or 128 rows and its tiles 64 to 256 wide, "
                f"got {block_m} rows of {block_n} x {block_k}")
    if num_warps not in (4, 8) or stages < 2:
        return (f"the warp-specialised weight gradient takes 4 or 8 MMA warps and 2 stages or more, got {num_warps} "
                f"warps, {stages} stages")
    if pingpong and (num_warps != 4 or block_n * block_k > 128 * 128):
        return (f"a ping-pong MMA partition is one warpgroup holding at most 128 x 128 accumulators, got "
                f"{block_n} x {block_k} on {num_warps} warps")
    if shared_memory_bytes(block_m, block_n, block_k, stages, pingpong) > gluon_gemm.SHARED_MEMORY_LIMIT:
        return f"the tiles need more than a block's {gluon_gemm.SHARED_MEMORY_LIMIT} bytes of shared memory"
    return None


def operand_problem(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, block_m: int, block_n: int, block_k: int,
                    num_warps: int, stages: int, pingpong: bool) -> Optional[str]:
    """Why these operands, gradient and tiles cannot take this kernel (``None`` where they can)."""
    if dy.numel() == 0 or x.numel() == 0:
        return "no rows to describe for TMA (the twin stores the zero gradient)"
    if dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype:
        return (f"the warp-specialised weight gradient takes bf16 / fp16 operands of one dtype, got {dy.dtype} and "
                f"{x.dtype}")
    found = tile_problem(block_m, block_n, block_k, num_warps, stages, pingpong)
    if found is not None:
        return found
    for name, t in (("dy", dy), ("x", x)):  # TMA: contiguous rows, 16-byte aligned base and row stride
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return f"{name} must have contiguous rows at 16-byte aligned addresses and strides (TMA)"
    if dw.dim() != 3 or dw.stride(2) != 1 or (dw.shape[2] * dw.element_size()) % 16 or dw.data_ptr() % 16:
        return "dW must be [E, N, K] with contiguous rows of whole 16-byte pieces (the store's)"
    return device_problem(dy.device)


def device_problem(device: torch.device) -> Optional[str]:
    """Why this kernel cannot run on ``device``: not an sm_90 GPU, or Gluon unavailable here (``None`` where it
    can)."""
    return gluon_gemm.device_problem(device, "the warp-specialised weight gradient")


def _descriptor(t: torch.Tensor, box: tuple[int, int]) -> Any:
    return TensorDescriptor.from_tensor(t, list(box), gluon_gemm.shared_layout(box, t.dtype))


def launch_checked(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, dy_first: torch.Tensor,
                   x_first: torch.Tensor, counts: torch.Tensor, *, block_m: int, block_n: int, block_k: int,
                   num_warps: int, stages: int, pingpong: bool, tma_store: bool = False,
                   programs: Optional[int] = None, mask_tail: bool = False) -> torch.Tensor:
    """``dw[e] = sum over expert e's rows r of dy[r]^T x[r]`` in whole steps of ``block_m`` rows (what
    ``_weight_grad_kernel`` computes on the same operands), on operands :func:`operand_problem` accepted: ``dy`` and
    ``x`` in expert order, expert ``e``'s rows from ``dy_first[e]`` and ``x_first[e]``, ``counts[e]`` of them, the rows
    after them in a run's last step zeros in one operand (its runs padded to whole steps) — or, with ``mask_tail``,
    anything (both operands compact: the kernel zeroes them). ``tma_store``: each finished tile stored by TMA
    from shared memory (where :func:`tma_store_problem` allows; else from registers). ``programs``: the persistent
    grid (one per multiprocessor by default)."""
    num_experts, n, k = dw.shape
    if dw.numel() == 0:
        return dw
    grid = programs or min(multiprocessors(dy.device), num_experts * -(-n // block_n) * -(-k // block_k))
    tma_store = tma_store and tma_store_problem(dw, block_m, block_n, block_k, stages, pingpong) is None
    # (without the TMA store its descriptor's place takes dW itself, never read: one signature per launch)
    dw_desc = _descriptor(dw.view(num_experts * n, k), (block_n, block_k)) if tma_store else dw

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return (dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, TMA_STORE=tma_store,
                     MASK_TAIL=mask_tail, **_partitions(pingpong)),
                dict(num_warps=num_warps))

    # (the key names what the constexprs and the descriptors' boxes, dtypes and layouts follow; the launch site adds
    # the other arguments' specialisation, and its bound launch skips the JIT's binding of every argument per call)
    _WS_WEIGHT_GRAD.launch(
        (block_m, block_n, block_k, stages, tma_store, mask_tail, pingpong, num_warps, dy.dtype, dw.dtype, dy.device),
        (grid,),
        (_descriptor(dy, (block_m, block_n)), _descriptor(x, (block_m, block_k)), dw, dw_desc, dy_first, x_first,
         counts, n, k, num_experts, dw.stride(0), dw.stride(1)), make)
    return dw


def compile_for_hopper(block_m: int, block_n: int, block_k: int, num_warps: int, stages: int, pingpong: bool,
                       dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
                       tma_store: bool = False, mask_tail: bool = False) -> Any:
    """The kernel compiled for sm_90 down to machine code without a GPU (Triton's ``ptxas``): what the CPU test
    checks, and where the PTX and the register counts can be read (``.asm``)."""
    if _GLUON_ERROR is not None:
        raise ValueError(_GLUON_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    name = names[dtype]

    def desc(box: list[int]) -> str:
        return f"tensordesc<{name}[{box[0]},{box[1]}],{gluon_gemm.shared_layout(tuple(box), dtype)!r}>"

    out_layout = gluon_gemm.shared_layout((block_n, block_k), out_dtype) if tma_store else None
    dw_desc = (f"tensordesc<{names[out_dtype]}[{block_n},{block_k}],{out_layout!r}>" if tma_store
               else f"*{names[out_dtype]}")
    signature = dict(dy_desc=desc([block_m, block_n]), x_desc=desc([block_m, block_k]), dw_ptr=f"*{names[out_dtype]}",
                     dw_desc=dw_desc, dy_first_ptr="*i32", x_first_ptr="*i32", count_ptr="*i32", N="i32", K="i32",
                     num_experts="i32", stride_dwe="i32", stride_dwn="i32")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, TMA_STORE=tma_store,
                      MASK_TAIL=mask_tail, **_partitions(pingpong))
    signature.update({key: "constexpr" for key in constexprs})
    divisible = ("dw_ptr", "dy_first_ptr", "x_first_ptr", "count_ptr", "N", "K", "stride_dwe", "stride_dwn") + (
        () if tma_store else ("dw_desc",))
    order = list(signature)
    attrs = {(order.index(key),): [["tt.divisibility", 16]] for key in divisible}
    source = GluonASTSource(ws_weight_grad_kernel, signature, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **FIXED_OPTIONS))
