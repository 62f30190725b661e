"""Token alignment on the device: group the top-k copies by expert, padded to the GEMM's block size.

Produces the ``BLOCK_ALIGNED`` layout the fused grouped GEMM reads: ``sorted_ids`` lists copy
indices ``t * top_k + k`` grouped by expert, each expert's run padded with the sentinel
``T * top_k`` to a multiple of ``block_m``; ``block_expert[b]`` is the expert of block ``b``;
``num_padded`` (on the device) is the used length. No host synchronisation, fixed output sizes: CUDA-graph
capturable. Up to :data:`IN_ORDER_COPIES` copies (decode and small prefill batches) one launch sorts them in one
program, each expert's copies in ascending order. More take three launches, each of the two wide ones with one
program per chunk of :data:`SCATTER_CHUNK` copies: the chunks' histograms; a plan program (one: the histograms summed
in chunk order, each expert's padded run, and each chunk's base, the copies of each expert in the chunks before it);
a scatter, each program placing its chunk's copies and writing its share of the block table and the padding slots.
No single program walks every copy or every block, which matters at many groups (a stack of adapters aligns by
(adapter, expert) pairs). The scatter places the copies in one of two ways:

* ``ordered`` (what a training forward asks for): each scatter program ranks each copy among its expert's, from its
  chunk's base: ascending order again, the same slots
  from run to run, no atomics. The weight gradient sums each expert's rows in slot order
  (:mod:`moeforge.kernels.weight_grad`), so this order makes it deterministic.
* otherwise (inference): the scatter places copies with atomics, in an order that varies from run to run; cheaper
  (its programs do not rank sub-blocks one after another; docs/kernels.md has the figures), and nothing
  else depends on it -- a grouped GEMM's rows are independent of their neighbours, the combine reads rows by copy
  index, not by position.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, num_copies, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                         PDL: tl.constexpr):
    # One program per chunk of CHUNK copies: the histogram of its expert ids, row `chunk` of counts [chunks, BLOCK_E].
    pdl.wait_for_the_kernel_before(PDL)
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_copies, other=BLOCK_E - 1)
    hist = tl.histogram(ids, BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    masked = tl.sum((offs >= num_copies).to(tl.int32), axis=0)  # masked lanes were counted in the last bin
    tl.store(counts_ptr + chunk * BLOCK_E + experts, hist - tl.where(experts == BLOCK_E - 1, masked, 0))


@triton.jit
def _plan_kernel(counts_ptr, runs_ptr, num_padded_ptr, chunks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                 PDL: tl.constexpr):
    # One program: the chunks' histograms summed in chunk order, each row replaced by the counts of the chunks before
    # it (the ordered scatter's base, which its programs then move); each expert's padded run in ``runs`` (its start
    # as the cursor, which the scatter moves, then its start again, its count and its end, which the scatter's
    # programs read to write the block -> expert table and the padding) and the used length.
    pdl.wait_for_the_kernel_before(PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for chunk in range(0, chunks):
        row = counts_ptr + chunk * BLOCK_E + experts
        hist = tl.load(row)
        tl.store(row, counts)
        counts += hist
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(runs_ptr + experts, starts)
    tl.store(runs_ptr + BLOCK_E + experts, starts)
    tl.store(runs_ptr + 2 * BLOCK_E + experts, counts)
    tl.store(runs_ptr + 3 * BLOCK_E + experts, ends)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def _write_blocks(runs_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr, num_copies, blocks_per_program,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr, CHUNK_B: tl.constexpr):
    """This program's share of the used blocks (``blocks_per_program`` of them): each block's expert in the block
    table -- the number of padded runs ending at or before it, a binary search over the runs' ends -- and its padding
    slots (past its expert's copies) set to ``num_copies``. The copies' own slots are the scatter's: the two never
    write the same slot."""
    used_blocks = tl.load(num_padded_ptr) // BLOCK_M
    first_block = tl.program_id(0) * blocks_per_program
    for first in range(0, blocks_per_program, CHUNK_B):
        lanes = first + tl.arange(0, CHUNK_B)
        blocks = first_block + lanes
        mask = (lanes < blocks_per_program) & (blocks < used_blocks)
        bound = blocks * BLOCK_M
        owner = tl.zeros((CHUNK_B,), dtype=tl.int32)
        for level in tl.static_range(0, LOG_E + 1):
            candidate = owner + (1 << (LOG_E - level))
            end = tl.load(runs_ptr + 3 * BLOCK_E + candidate - 1, mask=mask & (candidate <= BLOCK_E),
                          other=2147483647)
            owner = tl.where(end <= bound, candidate, owner)
        tl.store(block_expert_ptr + blocks, owner, mask=mask)
        start = tl.load(runs_ptr + BLOCK_E + owner, mask=mask, other=0)
        count = tl.load(runs_ptr + 2 * BLOCK_E + owner, mask=mask, other=0)
        slots = bound[:, None] + tl.arange(0, BLOCK_M)[None, :]
        padding = mask[:, None] & (slots - start[:, None] >= count[:, None])
        tl.store(sorted_ids_ptr + slots, num_copies, mask=padding)


@triton.jit
def _write_plan(ends_ptr, total, num_copies, block_expert_ptr, sorted_ids_ptr, num_padded_ptr, BLOCK_M: tl.constexpr,
                BLOCK_E: tl.constexpr, LOG_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr):
    """Store the used length, the block -> expert table and every used slot as padding (``num_copies``), from each
    expert's padded run ending at ``ends_ptr[e]`` (``total`` slots in all). Block b belongs to the expert whose padded
    run contains it: the number of runs ending at or before it, a binary search over the runs' ends, CHUNK_B blocks at
    a time."""
    tl.store(num_padded_ptr, total)
    used_blocks = total // BLOCK_M
    for first in range(0, used_blocks, CHUNK_B):
        blocks = first + tl.arange(0, CHUNK_B)
        mask = blocks < used_blocks
        bound = blocks * BLOCK_M
        owner = tl.zeros((CHUNK_B,), dtype=tl.int32)
        for level in tl.static_range(0, LOG_E + 1):
            candidate = owner + (1 << (LOG_E - level))
            end = tl.load(ends_ptr + candidate - 1, mask=mask & (candidate <= BLOCK_E), other=2147483647)
            owner = tl.where(end <= bound, candidate, owner)
        tl.store(block_expert_ptr + blocks, owner, mask=mask)
    for first in range(0, total, CHUNK):
        slots = first + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + slots, num_copies, mask=slots < total)


@triton.jit
def _scatter_kernel(ids_ptr, runs_ptr, chunk_base_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr,
                    num_copies, blocks_per_program, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    LOG_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, CHUNK_B: tl.constexpr,
                    PDL: tl.constexpr):
    # One program per chunk of CHUNK copies, SUB at a time: copy i of expert e lands at e's padded start, plus the
    # copies of e in earlier chunks (the plan's chunk base) and in earlier sub-blocks (this program's running count,
    # kept in its chunk-base row), plus those before it in its sub-block: each expert's copies in ascending order.
    pdl.wait_for_the_kernel_before(PDL)
    chunk = tl.program_id(0)
    base_row = chunk_base_ptr + chunk * BLOCK_E
    lanes = tl.arange(0, SUB)
    earlier = lanes[None, :] < lanes[:, None]  # [i, j]: j comes before i
    for first in range(0, CHUNK, SUB):
        offs = chunk * CHUNK + first + lanes
        mask = offs < num_copies
        ids = tl.load(ids_ptr + offs, mask=mask, other=BLOCK_E - 1)
        before = tl.sum(((ids[None, :] == ids[:, None]) & earlier).to(tl.int32), axis=1)
        position = tl.load(runs_ptr + ids, mask=mask, other=0) + tl.load(base_row + ids, mask=mask, other=0) + before
        tl.store(sorted_ids_ptr + position, offs, mask=mask)
        tl.debug_barrier()  # every lane read the row before it moves on
        experts = tl.arange(0, BLOCK_E)
        tl.store(base_row + experts, tl.load(base_row + experts) + tl.histogram(ids, BLOCK_E))
        tl.debug_barrier()  # the row updated before the next sub-block reads it
    _write_blocks(runs_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr, num_copies, blocks_per_program,
                  BLOCK_M, BLOCK_E, LOG_E, CHUNK_B)


@triton.jit
def _scatter_any_order_kernel(ids_ptr, runs_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr,
                              num_copies, blocks_per_program, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                              LOG_E: tl.constexpr, BLOCK: tl.constexpr, CHUNK_B: tl.constexpr, PDL: tl.constexpr):
    # Each copy takes the next slot of its expert by an atomic increment: an order that varies from run to run.
    pdl.wait_for_the_kernel_before(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_copies
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    position = tl.atomic_add(runs_ptr + ids, 1, mask=mask)
    tl.store(sorted_ids_ptr + position, offs, mask=mask)
    _write_blocks(runs_ptr, block_expert_ptr, sorted_ids_ptr, num_padded_ptr, num_copies, blocks_per_program,
                  BLOCK_M, BLOCK_E, LOG_E, CHUNK_B)


@triton.jit
def _align_in_order_kernel(
    ids_ptr,
    shift_ptr,
    block_expert_ptr,
    sorted_ids_ptr,
    num_padded_ptr,
    num_copies,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LOG_E: tl.constexpr,
    COPIES: tl.constexpr,
    CHUNK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program, at most COPIES copies: the count and plan of _plan_kernel, then every copy placed by a
    # sort of (expert, copy) keys: each expert's copies in ascending order, the same slots from run to run.
    pdl.wait_for_the_kernel_before(PDL)
    offs = tl.arange(0, COPIES)
    mask = offs < num_copies
    ids = tl.load(ids_ptr + offs, mask=mask, other=BLOCK_E - 1)
    hist = tl.histogram(ids, BLOCK_E)
    masked = tl.sum((offs >= num_copies).to(tl.int32), axis=0)
    experts = tl.arange(0, BLOCK_E)
    counts = hist - tl.where(experts == BLOCK_E - 1, masked, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(shift_ptr + BLOCK_E + experts, ends)  # (shift_ptr: 4 * BLOCK_E words) the runs' ends, for the search
    tl.debug_barrier()
    _write_plan(shift_ptr + BLOCK_E, total, num_copies, block_expert_ptr, sorted_ids_ptr, num_padded_ptr, BLOCK_M,
                BLOCK_E, LOG_E, COPIES, CHUNK_B)
    # The copy at position j of the sorted keys lands in slot j + shift[its expert]: its expert's padded start less
    # the copies of the experts before it.
    tl.store(shift_ptr + experts, (ends - padded) - (tl.cumsum(counts, axis=0) - counts), mask=experts < BLOCK_E)
    tl.debug_barrier()  # the padding and the shifts stored before any copy is placed
    keys = tl.sort(tl.where(mask, ids * COPIES + offs, BLOCK_E * COPIES))
    expert = keys // COPIES
    shift = tl.load(shift_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + offs + shift, keys % COPIES, mask=mask)


IN_ORDER_COPIES = 1024  # at most this many copies are aligned by one program, each expert's in ascending order
IN_ORDER_BLOCKS = 64  # blocks whose expert that program searches for at a time
SCATTER_CHUNK = 1024  # more: copies counted per chunk (one program each), each chunk placed by one scatter program
SCATTER_SUB = 128  # lanes a scatter program places at a time (its [SUB, SUB] comparisons rank each among its expert's)


def max_padded_rows(num_copies: int, num_experts: int, block_m: int) -> int:
    """Upper bound of ``num_padded``: every expert that has a copy wastes at most ``block_m - 1``."""
    return num_copies + min(num_experts, num_copies) * (block_m - 1)


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, ordered: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert, num_padded)`` for ``topk_ids [T, K]`` (int32, on the device); ``ordered``: each
    expert's copies in ascending order whatever the batch (the weight gradient's order), else only up to
    :data:`IN_ORDER_COPIES` copies (see the module's docstring)."""
    ids = topk_ids.reshape(-1)
    num_copies = ids.numel()
    size = max(max_padded_rows(num_copies, num_experts, block_m), block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(cdiv(size, block_m), dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    block_e = max(next_power_of_2(num_experts), 2)
    runs = torch.empty(4 * block_e, dtype=torch.int32, device=ids.device)  # the plan's per-expert numbers
    if num_copies <= IN_ORDER_COPIES:
        copies = max(next_power_of_2(num_copies), 16)

        def in_order() -> tuple[dict[str, Any], dict[str, Any]]:
            dependent = pdl.pdl_applies(ids.device)
            return (dict(BLOCK_M=block_m, BLOCK_E=block_e, LOG_E=block_e.bit_length() - 1, COPIES=copies,
                         CHUNK_B=IN_ORDER_BLOCKS, PDL=pdl.flag(dependent)),
                    dict(num_warps=4, **pdl.launch_options(dependent)))

        _IN_ORDER.launch((block_m, block_e, copies, ids.device), (1,),
                         (ids, runs, block_expert, sorted_ids, num_padded, num_copies), in_order)
        return sorted_ids, block_expert, num_padded

    chunks = cdiv(num_copies, SCATTER_CHUNK)
    blocks_per_program = cdiv(cdiv(size, block_m), chunks)  # the scatter's programs share the block table's writing
    log_e = block_e.bit_length() - 1
    chunk_b = max(1, 4096 // block_m)

    def count() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(ids.device)
        return dict(BLOCK_E=block_e, CHUNK=SCATTER_CHUNK, PDL=pdl.flag(dependent)), pdl.launch_options(dependent)

    def plan() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(ids.device)
        return dict(BLOCK_M=block_m, BLOCK_E=block_e, PDL=pdl.flag(dependent)), pdl.launch_options(dependent)

    def scatter() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(ids.device)
        return (dict(BLOCK_M=block_m, BLOCK_E=block_e, LOG_E=log_e, CHUNK=SCATTER_CHUNK, SUB=SCATTER_SUB,
                     CHUNK_B=chunk_b, PDL=pdl.flag(dependent)), pdl.launch_options(dependent))

    def any_order() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(ids.device)
        return (dict(BLOCK_M=block_m, BLOCK_E=block_e, LOG_E=log_e, BLOCK=SCATTER_CHUNK, CHUNK_B=chunk_b,
                     PDL=pdl.flag(dependent)), pdl.launch_options(dependent))

    chunk_base = torch.empty(chunks, block_e, dtype=torch.int32, device=ids.device)  # each chunk's counts, then base
    _CHUNK_COUNTS.launch((block_e, ids.device), (chunks,), (ids, chunk_base, num_copies), count)
    _PLAN.launch((block_m, block_e, ids.device), (1,), (chunk_base, runs, num_padded, chunks), plan)
    if ordered:
        _SCATTER.launch((block_m, block_e, ids.device), (chunks,), (
            ids, runs, chunk_base, block_expert, sorted_ids, num_padded, num_copies, blocks_per_program), scatter)
    else:
        _SCATTER_ANY_ORDER.launch((block_m, block_e, ids.device), (chunks,), (
            ids, runs, block_expert, sorted_ids, num_padded, num_copies, blocks_per_program), any_order)
    return sorted_ids, block_expert, num_padded


_IN_ORDER = LaunchSite(_align_in_order_kernel)
_CHUNK_COUNTS = LaunchSite(_chunk_counts_kernel)
_PLAN = LaunchSite(_plan_kernel)
_SCATTER = LaunchSite(_scatter_kernel)
_SCATTER_ANY_ORDER = LaunchSite(_scatter_any_order_kernel)
