"""The launch plan of the grouped GEMM: every choice :func:`moeforge.kernels.moe_gemm.moe_gemm` makes about a launch,
made in one place, from plain facts, with the reason for each.

The launcher turns its tensors into :class:`LaunchFacts` (formats, sizes, the device, what the caller or the tuned
table asked for, and the two facts only a tensor tells: whether its weight can be copied by TMA and whether its
scale rows load as vectors) and asks :func:`plan_launch` for a :class:`LaunchPlan`: the fitted tile, the grid and
how many programs, the split K-loop, TMA, the swapped product, the packed decoding and its conversions, scale
prefetch and folding, half tiles, the K-step wait, the K-loop's tail. Facts in, plan out: no tensor, no device call,
so the rules run (and are tested) on any machine, and ``plan.reasons`` says which rule or request decided each
choice. The rules themselves are the functions below, each with the measurement behind it in its docstring's
reference to ``docs/notes/kernels-log.md``.
"""

from __future__ import annotations

import re
from typing import Optional

import attrs
import torch
import triton

from moeforge.kernels.config import RANK_WIDE, GemmConfig, fit_shared_memory
from moeforge.kernels.dequant import FOLDED_SCALE_MAX
from moeforge.kernels.formats import SCALE_BLOCK, KTail, RowFormat, RowScales, WeightFormat
from moeforge.kernels.sizes import cdiv

try:  # host-side tensor descriptors (Triton >= 3.3): the weight tiles through Hopper's TMA
    from triton.tools.tensor_descriptor import TensorDescriptor as TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

def fit_config(config: GemmConfig, compute_bytes: int, *, packed: bool, per_k_scales: bool,
               glu: bool) -> GemmConfig:
    """``config`` fitted to the kernel for these operands: a K-step within one 128-wide scale group
    when 8-bit scales change along K; at least 32 K-elements per step when an operand is 4-bit
    (``packed``: 16 bytes per row); operand tiles that fit in shared memory (``compute_bytes`` per
    element: 1 for 8-bit, else the compute dtype's, a dequantized 4-bit tile included)."""
    if per_k_scales and config.block_k > SCALE_BLOCK:
        config = attrs.evolve(config, block_k=SCALE_BLOCK)
    if packed and config.block_k < 32:
        config = attrs.evolve(config, block_k=32)
    fitted = fit_shared_memory(config, compute_bytes, 2 if glu else 1)
    if packed and fitted.block_k < 32:
        fitted = attrs.evolve(fitted, block_k=32, num_stages=2)
    return fitted


def scale_fold(weight_format: WeightFormat, compute_dtype: torch.dtype, packed: bool, weight_scale_max: Optional[int],
               shuffled: bool) -> bool:
    """Whether the packed bf16 e2m1 decoding (``packed``) folds its ``x 2**126`` into the scales
    (:mod:`moeforge.kernels.dequant`): MXFP4 whose E8M0 codes are all at most ``FOLDED_SCALE_MAX`` (known:
    ``weight_scale_max``), and shuffled NVFP4 (``2**119`` of it; the epilogue multiplies by the rest). Plain NVFP4 does
    not: on its byte decoding the fold did not pay (docs/notes/kernels-log.md, "Shuffled NVFP4 folds its ...")."""
    if not packed or compute_dtype != torch.bfloat16:
        return False
    if weight_format is WeightFormat.MXFP4:
        return weight_scale_max is not None and weight_scale_max <= FOLDED_SCALE_MAX
    return weight_format is WeightFormat.NVFP4 and shuffled


def prefetch_scales(weight_format: WeightFormat, config: GemmConfig, swapped: bool) -> bool:
    """Whether a 4-bit weight's K-steps load their scales one step ahead (the kernel's ``PREFETCH``): from 64-row
    blocks, and on swapped tiles of any height, whose MMA is a wgmma over 64 weight rows; the 16- and 32-row
    ``mma.sync`` tiles got slower with it (docs/notes/kernels-log.md, "Scales one K-step ahead" and "Scales one
    K-step ahead on swapped tiles of any height")."""
    return weight_format.packed and (config.block_m >= 64 or swapped)


def vector_scales(scale: Optional[torch.Tensor], zero: Optional[torch.Tensor]) -> bool:
    """Whether a 4-bit weight's ``scale`` (and ``zero`` points) rows are aligned so that Triton can load a K-step's
    groups as one vector: contiguous groups, 16-byte aligned start, other strides multiples of 16 (its divisibility
    hints). Where they are, even-K tiles of e2m1 weights clamp the step instead of masking each group
    (``group_scales``' ``CLAMP``, the kernel's ``EVEN_K == K_EVEN_VECTOR_SCALES``), which pays on such rows only
    (docs/notes/kernels-log.md, "A step's scales loaded as vectors")."""
    present = [t for t in (scale, zero) if t is not None]
    return bool(present) and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                                 and all(step % 16 == 0 for step in t.stride()[:-1]) for t in present)


# the smallest block of a shuffled weight's tiles that default_grid puts on the persistent grid
SHUFFLED_PERSISTENT_BLOCK_M = 128


def _version(text: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version string such as ``3.6.0`` or ``3.9.0+git1234``."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


# Triton before 3.9 lets the next K-step write the registers that a warpgroup MMA of this step still reads (see
# drain_mma)
RS_WGMMA_RACE = _version(triton.__version__) < (3, 9)


def drain_mma(capability: Optional[tuple[int, int]], swapped: bool, row_format: RowFormat, config: GemmConfig,
              race: bool = RS_WGMMA_RACE) -> bool:
    """Whether each K-step waits for all of its warpgroup MMAs before the loop goes on (the kernel's ``DRAIN_MMA``).

    On Hopper the MMA takes its left operand from registers where that operand is decoded in the K-loop: the 4-bit
    weight tile of a swapped product (``W @ rows^T``), the NVFP4 rows of a wgmma tile (64 rows or more) otherwise.
    The MMA reads those registers asynchronously, until a ``wgmma.wait_group`` retires it. Triton before 3.9
    (``race``) splits the dot into k16 MMAs and after each waits only until at most ``n - 1`` of the loop's ``n`` are in
    flight, so when a step ends most of its MMAs may not have read their operand yet, while ptxas gives those
    registers to the next step's decoding, scale loads and addresses: compiled for sm_90, Mixtral's swapped 128-row
    tiles write 14-37 registers per step under an MMA in flight (``benchmarks/sass_loop.py --hazards``). Whether the
    MMA has read them first depends on how busy the tensor cores are (programs per SM, MMA length), so the output is
    wrong on some grids and tiles and right on others. Waiting for the step's MMAs at its end closes the window."""
    if not race or capability is None or capability[0] != 9:
        return False
    return swapped or (row_format is RowFormat.NVFP4 and config.block_m >= 64)


def glu_strides(glu: bool, interleaved: bool, n_out: int) -> tuple[int, int]:
    """``(gate_stride, up_offset)``: the weight row of output column n's gate is ``n * gate_stride``,
    its up row ``n * gate_stride + up_offset`` ([gate | up] or interleaved g0 u0 g1 u1 ...)."""
    if not glu:
        return 1, 0
    return (2, 1) if interleaved else (1, n_out)


def cvt_by_four(config: GemmConfig) -> bool:
    """Whether e4m3 scales are converted four at a time (``dequant.e4m3_pairs``): tiles of at least 64 columns and
    at most 64 rows, where it made the K-loop faster (docs/notes/kernels-log.md, "e4m3 scales four at a time")."""
    return config.block_n >= 64 and config.block_m <= 64


def tile_in_one_scale_block(block_n: int, gate_stride: int, up_offset: int, glu: bool) -> bool:
    """Whether every tile's gate rows (``n * gate_stride``) lie in one 128-row weight-scale block, and its
    up rows (``+ up_offset``) in one: the tile's rows start at multiples of ``block_n * gate_stride``,
    which divides 128; interleaved up rows sit beside their gate rows, concatenated ones start
    ``up_offset`` further, a multiple of the span."""
    span = block_n * gate_stride
    return SCALE_BLOCK % span == 0 and (not glu or up_offset % span < gate_stride)


def transposed_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight [E, N_w, K]`` is the transposed view of an ``[E, K, N_w]`` tensor whose rows are contiguous
    (``N_w`` contiguous, not ``K``): the weight of the backward's row gradient, ``W.transpose(1, 2)``."""
    return weight.dim() == 3 and weight.stride(1) == 1 and weight.stride(2) != 1


def weight_tma_applies(weight: torch.Tensor, config: GemmConfig, glu: bool, interleaved: bool) -> bool:
    """Whether the weight tiles of ``config`` can be copied by the tensor memory accelerator: a descriptor
    over the weight viewed as ``[E * N_w, K]`` rows (``weight [E, N_w, K]``, K contiguous, experts one after
    the other, rows and base 16-byte aligned), tiles of at most 256 by 256 elements whose rows span a
    multiple of 16 bytes; interleaved gate/up rows are viewed as ``[E * N, 2, K]``. A transposed float weight
    (:func:`transposed_weight`, no gate/up pairs) is described as the ``[E, K, N_w]`` tensor it views, with
    ``[1, BLOCK_K, BLOCK_N]`` boxes clipped at each expert's edges."""
    if TensorDescriptor is None or weight.dim() != 3 or (glu and interleaved and weight.shape[1] % 2):
        return False
    if transposed_weight(weight):
        size = weight.element_size()
        return (not glu and weight.dtype != torch.uint8 and weight.data_ptr() % 16 == 0
                and (weight.stride(0) * size) % 16 == 0 and (weight.stride(2) * size) % 16 == 0
                and (config.block_n * size) % 16 == 0 and config.block_k <= 256 and config.block_n <= 256
                and weight.numel() > 0)
    experts, n_w, k_elems = weight.shape
    row_bytes = (config.block_k // 2 if weight.dtype == torch.uint8 else config.block_k) * weight.element_size()
    return (weight.stride(2) == 1 and (weight.stride(0) == n_w * weight.stride(1) or experts == 1)
            and weight.stride(1) * weight.element_size() % 16 == 0 and weight.data_ptr() % 16 == 0
            and row_bytes % 16 == 0 and config.block_k <= 256 and config.block_n <= 256
            and experts * n_w < 2 ** 31 and k_elems > 0)


def weight_tma_pays(capability: Optional[tuple[int, int]], weight_format: WeightFormat, config: GemmConfig,
                    interleaved: bool = False) -> bool:
    """Whether :func:`moe_gemm` copies the weight tiles by TMA by default (where it applies): on Hopper
    (``capability`` 9.x, see :func:`device_capability`), with the wgmma tiles where it measured faster
    (docs/notes/kernels-log.md, "Hopper: TMA weight tiles and persistent grids"): float weights from 64 rows,
    8-bit weights from 64 rows and 128 columns, 4-bit weights from 128 rows. With ``interleaved`` gate/up rows
    (every other row, ``_weight_rows_tma``) 4-bit weights keep pointer loads. Smaller tiles gain or lose by shape,
    so a tuned table decides for them per entry (``GemmConfig.tma``)."""
    if capability is None or capability[0] != 9:
        return False
    if weight_format.packed:
        return config.block_m >= 128 and not interleaved
    if weight_format in (WeightFormat.FP8, WeightFormat.INT8):
        return config.block_m >= 64 and config.block_n >= 128
    return config.block_m >= 64


GRIDS = ("tiles", "persistent", "flattened")


def default_grid(capability: Optional[tuple[int, int]], weight_format: WeightFormat, config: GemmConfig, glu: bool,
                 rows_per_expert: float, out_bytes: int, shuffled: bool = False) -> str:
    """The grid :func:`moe_gemm` launches by default (see ``GRIDS``): ``tiles``, one program per tile
    (the programs past the aligned blocks that exist return at once); ``persistent``, one program per SM
    taking the tiles that exist grid-stride; ``flattened``, persistent with the tile loop and the K-loop
    flattened into one pipelined loop, so that the next tile's loads overlap this tile's epilogue.

    The persistent grids pay for float weights on Hopper where a tile's accumulators fill the register file (128
    fp32 values per thread: one program per SM either way) and each expert has at least two row blocks
    (``rows_per_expert``, the copies over the experts): ``persistent`` for the fused gate/up GEMM, ``flattened``
    for the down GEMM (whose plain epilogue overlaps the next tile's loads). Where two programs fit on an SM, with
    8-bit and 4-bit tiles, and with about one block per expert they lost (docs/notes/kernels-log.md, "Hopper: TMA
    weight tiles and persistent grids").

    The flattened loop stages the output tile in shared memory beside the operand ring: for ``out_bytes`` 4
    (fp32 outputs: the backward's, an fp32 layer's) the whole ``block_m x block_n`` tile, which does not fit beside
    a 4-stage ring of 128x256 tiles; 2-byte outputs stage less and fit. So fp32 outputs take the persistent grid
    (measurements: docs/notes/kernels-log.md, "The flattened grid and fp32 outputs").

    A pre-shuffled 4-bit weight's tiles of 128 rows or more (``shuffled``, ``SHUFFLED_PERSISTENT_BLOCK_M``) take the
    persistent grid on Hopper: the H100 and H200 tables' entries for them were tuned on it."""
    if shuffled and capability is not None and capability[0] == 9 and config.block_m >= SHUFFLED_PERSISTENT_BLOCK_M:
        return "persistent"
    if (weight_format is not WeightFormat.FLOAT or capability is None or capability[0] != 9
            or config.block_m < 128 or rows_per_expert < 2 * config.block_m):
        return "tiles"
    accumulators = config.block_m * config.block_n * (2 if glu else 1) // (config.num_warps * 32)
    if accumulators < 128:
        return "tiles"
    return "persistent" if glu or out_bytes > 2 else "flattened"


def default_split_k(capability: Optional[tuple[int, int]], weight_format: WeightFormat, config: GemmConfig,
                    programs: int, k_steps: int, sms: int) -> int:
    """How many ranges :func:`moe_gemm` splits the K-loop into by default. ``programs``: the tiles of the busy
    experts (``min(aligned blocks, E) * column tiles``, an upper bound known on the host), ``k_steps``: the
    K-loop's length, ``sms``: the device's multiprocessors.

    A split pays only where a few programs' long dequantizing K-loops set the time; elsewhere the second launch
    and the partial sums cost more than they give (docs/notes/kernels-log.md, "Split K for decode"). So: 4-bit
    weights, or 8-bit ones with K-loops of at least 96 steps; decode tiles (16 and 32 rows); fewer than 2 programs
    per SM; about 4 programs per SM after the split, at least 8 K-steps per range, at most 4 ranges (8-bit: 2)."""
    if (capability is None or weight_format is WeightFormat.FLOAT or config.block_m > 32 or programs >= 2 * sms
            or programs < 1 or (not weight_format.packed and k_steps < 96)):
        return 1
    most = 4 if weight_format.packed else 2
    return max(1, min(most, k_steps // 8, -(-4 * sms // programs)))


# The most ranges :func:`narrow_split_k` splits a K-loop into: more gained nothing on the serving stack's rank-wide
# products (docs/notes/kernels-log.md, "The served stack at few copies").
NARROW_MOST_SPLITS = 16


def narrow_split_k(capability: Optional[tuple[int, int]], programs: int, k_steps: int, sms: int) -> int:
    """How many ranges :func:`moe_gemm` splits the K-loop of a float GEMM with one column tile of at most
    :data:`~moeforge.kernels.config.RANK_WIDE` columns (a rank-wide product: an adapter's ``x Aᵀ``, a row gradient
    of rank-wide width) into by default. ``programs``: an estimate of the row
    blocks that hold rows (:func:`narrow_programs`), ``k_steps``: the K-loop's length, ``sms``: the device's
    multiprocessors.

    Such a launch has one program per row block, each running the whole K-loop over a tile only ``r`` columns wide:
    with fewer programs than multiprocessors its time is the latency of that loop, not its bytes (a stack of adapters
    at one token: a program or two per GEMM, each over the whole K). So on NVIDIA GPUs, below one program per SM:
    enough ranges for about 4 programs per SM, at least 4 K-steps each, at most :data:`NARROW_MOST_SPLITS`
    (docs/notes/kernels-log.md, "The served stack at few copies")."""
    if capability is None or programs < 1 or programs >= sms:
        return 1
    return max(1, min(NARROW_MOST_SPLITS, k_steps // 4, -(-4 * sms // programs)))


def narrow_programs(padded_rows: int, block_m: int, copies: int, experts: int) -> int:
    """The row blocks of an aligned launch that hold rows, estimated on the host: at most ``padded_rows // block_m``
    (the alignment's bound), and at most one partly filled block per busy expert (``min(experts, copies)``) plus the
    full ones (``copies // block_m``)."""
    return min(padded_rows // block_m, min(experts, copies) + copies // block_m)


@attrs.frozen
class LaunchFacts:
    """What a launch is planned from: plain values, hashable (a plan can be kept per layer and token-count bucket).

    ``config``: the tile asked for (a tuned table's entry, or a stage's rule); ``asked``: the caller's overrides of
    the table's choices (``None``: not asked); ``padded_rows``: the aligned rows (``sorted_ids``' length);
    ``copies``: the real rows; ``tma_applies`` / ``vector_scales``: what the weight tensor allows
    (:func:`weight_tma_applies`, :func:`vector_scales`)."""

    weight_format: WeightFormat
    row_format: RowFormat
    row_scales: RowScales
    compute_dtype: torch.dtype
    out_bytes: int
    experts: int
    n_out: int
    k_dim: int
    copies: int
    padded_rows: int
    glu: bool
    interleaved: bool
    shuffled: bool
    blocked_scales: bool  # 8-bit weights with 128x128 block scales
    capability: Optional[tuple[int, int]]
    multiprocessors: int
    packed_decoding: bool  # the packed inline-PTX decoding can run here (dequant.packed_decoding)
    tma_applies: bool
    vector_scales: bool
    weight_scale_max: Optional[int]
    config: GemmConfig
    swap: Optional[bool] = None
    ptx: Optional[bool] = None
    tma: Optional[bool] = None
    grid: Optional[str] = None
    split_k: Optional[int] = None
    half_tail: Optional[bool] = None
    one_update: bool = False  # the launch adds one low-rank update (an adapter's, not a stack's) after its K-loop

    @property
    def compute_bytes(self) -> int:
        if self.row_format in (RowFormat.FP8, RowFormat.INT8):
            return 1
        return self.compute_dtype.itemsize


@attrs.frozen
class LaunchPlan:
    """One launch of ``moe_gemm_kernel`` (and of the split K-loop's reduction, when ``splits > 1``), decided."""

    config: GemmConfig  # fitted to the shared memory
    grid: str  # one of GRIDS
    programs: tuple[int, ...]  # the launch grid
    splits: int
    steps_per_split: int
    tma: bool
    swap: bool
    ptx: bool
    fp8_cvt: bool
    cvt_by_four: bool
    prefetch: bool
    half_tail: bool
    drain: bool
    scale_fold: bool
    k_tail: KTail
    precision: str
    tile_scale: bool  # FP8 block scales: one per tile
    reasons: tuple[str, ...] = attrs.field(default=(), eq=False)  # recorded by plan_launch(explain=True) only

    def explain(self) -> str:
        """The plan and why, one choice per line (empty unless it was planned with ``explain=True``)."""
        return "\n".join(self.reasons)


def fitted_config(config: GemmConfig, compute_bytes: int, *, packed: bool, per_k_scales: bool, glu: bool,
                  grid: Optional[str], out_bytes: int) -> GemmConfig:
    """``config`` fitted to the shared memory (:func:`fit_config`), and for an asked ``flattened`` grid with
    outputs wider than 2 bytes to the output tile its epilogue stages too (see :func:`default_grid`)."""
    config = fit_config(config, compute_bytes, packed=packed, per_k_scales=per_k_scales, glu=glu)
    if grid == "flattened" and out_bytes > 2:
        config = fit_shared_memory(config, compute_bytes, 2 if glu else 1,
                                   staged_bytes=config.block_m * config.block_n * out_bytes)
    return config


def _source(asked: object, table: object) -> str:
    return "asked" if asked is not None else "the table's entry" if table is not None else "rule"


def explain_launch(facts: LaunchFacts) -> str:
    """The plan for ``facts`` and why, one choice per line (:meth:`LaunchPlan.explain`)."""
    return plan_launch(facts, explain=True).explain()


def plan_launch(facts: LaunchFacts, *, explain: bool = False) -> LaunchPlan:
    """The launch for ``facts`` (see the module docstring); with ``explain``, the reason for each choice in
    ``plan.reasons`` (the launcher plans on every call and leaves them out: :func:`explain_launch`). Raises
    ``ValueError`` for a combination no launch can serve (a split K-loop asked on a persistent grid, TMA asked where
    it cannot copy the tiles)."""
    f = facts
    fmt, asked = f.weight_format, f.config
    config = fitted_config(asked, f.compute_bytes, packed=fmt.packed or f.row_format is RowFormat.NVFP4,
                           per_k_scales=f.row_scales is RowScales.GROUP or f.blocked_scales, glu=f.glu, grid=f.grid,
                           out_bytes=f.out_bytes)
    if f.ptx and not f.packed_decoding:
        raise ValueError(f"the packed 4-bit decoding runs on NVIDIA GPUs in bf16/fp16 (MXFP4 in bf16), got "
                         f"{f.compute_dtype} {fmt.name}")
    ptx = f.packed_decoding if f.ptx is None else f.ptx
    paired = f.glu and f.interleaved
    paired_rows = f.shuffled and paired
    if f.tma is None:  # the configuration's choice (a tuned table's), else the rule; where TMA applies
        wanted = config.tma if config.tma is not None else weight_tma_pays(f.capability, fmt, config, paired)
        tma = wanted and f.tma_applies and not paired_rows
    else:
        tma = f.tma
        if tma and not f.tma_applies:
            raise ValueError(f"the weight tiles cannot be copied by TMA (tile {config.block_n}x{config.block_k}; "
                             "see weight_tma_applies)")
    e4m3_scales = fmt is WeightFormat.NVFP4 or f.row_format is RowFormat.NVFP4
    fp8_cvt = ptx and e4m3_scales and f.capability is not None and f.capability >= (8, 9)
    blocks = f.padded_rows // config.block_m
    tiles = blocks * cdiv(f.n_out, config.block_n)
    k_steps = cdiv(f.k_dim, config.block_k)
    if f.split_k is not None and f.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {f.split_k}")
    if f.split_k is not None or config.split_k is not None:  # asked for (a persistent grid cannot have it)
        splits = f.split_k if f.split_k is not None else config.split_k
        split_source = _source(f.split_k, config.split_k)
    elif f.grid in (None, "tiles") and fmt is WeightFormat.FLOAT and f.n_out <= min(config.block_n, RANK_WIDE):
        splits = narrow_split_k(f.capability, narrow_programs(f.padded_rows, config.block_m, f.copies, f.experts),
                                k_steps, f.multiprocessors)
        split_source = "narrow_split_k"
    elif f.grid in (None, "tiles"):
        busy = min(blocks, f.experts) * cdiv(f.n_out, config.block_n)
        splits = default_split_k(f.capability, fmt, config, busy, k_steps, f.multiprocessors)
        split_source = "default_split_k"
    else:
        splits, split_source = 1, "a persistent grid runs whole K-loops"
    assert splits is not None
    steps_per_split = cdiv(k_steps, min(splits, k_steps))
    splits = cdiv(k_steps, steps_per_split)  # every range has at least one step
    if splits > 1 and f.grid not in (None, "tiles"):
        raise ValueError(f"a split K-loop runs one program per tile, not grid={f.grid!r}")
    half_tail = config.half_tail if f.half_tail is None else f.half_tail
    if splits > 1:
        grid, grid_source = "tiles", "a split K-loop"
    elif f.grid is not None:
        grid, grid_source = f.grid, "asked"
    else:
        grid = default_grid(f.capability, fmt, config, f.glu, f.copies / f.experts, f.out_bytes, f.shuffled)
        grid_source = "default_grid"
        if grid == "flattened" and f.one_update:
            # the flattened loop holds the epilogue and the next tile's loads beside the accumulators: one update's
            # tiles and MMA push it into spills inside the loop (docs/notes/kernels-log.md), the persistent one not
            grid, grid_source = "persistent", "default_grid, persistent for a launch with one update"
    if half_tail and f.grid is None:
        grid, grid_source = "tiles", "half tiles run one program per tile unless asked"
    programs: tuple[int, ...] = ((tiles, splits) if splits > 1 else (tiles,)) if grid == "tiles" else (
        min(tiles, f.multiprocessors),)
    swap = fmt.packed and bool(f.swap if f.swap is not None else config.swap)
    prefetch = prefetch_scales(fmt, config, swap)
    drain = drain_mma(f.capability, swap, f.row_format, config)
    fold = scale_fold(fmt, f.compute_dtype, ptx, f.weight_scale_max, f.shuffled)
    k_tail = (KTail.RAGGED if f.k_dim % config.block_k else
              KTail.EVEN_VECTOR_SCALES if fmt.e2m1 and f.vector_scales else KTail.EVEN)
    gate_stride, up_offset = glu_strides(f.glu, f.interleaved, f.n_out)
    reasons: tuple[str, ...] = ()
    if explain:  # (text only when asked: the launcher plans on every call)
        fitted = "" if config == asked else " (fitted to the shared memory: fit_config)"
        if f.tma is not None:
            tma_source = "asked"
        elif config.tma is not None:
            tma_source = "the table's entry" + (", where it applies" if config.tma else "")
        else:
            tma_source = "weight_tma_pays, where it applies"
        reasons = (f"tile {config.block_m}x{config.block_n}x{config.block_k}, {config.num_warps} warps, "
                   f"{config.num_stages} stages{fitted}",
                   f"tma={tma} ({tma_source})",
                   f"split K-loop: {splits} ({split_source})",
                   f"grid {grid}, {programs} programs ({grid_source})",
                   f"swap={swap} ({_source(f.swap, config.swap)})",
                   f"packed decoding={ptx} ({'asked' if f.ptx is not None else 'packed_decoding'}), fp8 cvt={fp8_cvt}, "
                   f"scale prefetch={prefetch} (prefetch_scales), scale fold={fold} (scale_fold)",
                   f"half tiles={half_tail} ({_source(f.half_tail, config.half_tail or None)}), K-step wait={drain} "
                   f"(drain_mma), K tail {k_tail.name.lower()}")
    return LaunchPlan(config=config, grid=grid, programs=programs, splits=splits, steps_per_split=steps_per_split,
                      tma=tma, swap=swap, ptx=ptx, fp8_cvt=fp8_cvt, cvt_by_four=fp8_cvt and cvt_by_four(config),
                      prefetch=prefetch, half_tail=half_tail, drain=drain, scale_fold=fold, k_tail=k_tail,
                      precision="ieee" if f.compute_bytes == 4 else "tf32",
                      tile_scale=f.blocked_scales and tile_in_one_scale_block(config.block_n, gate_stride, up_offset,
                                                                              f.glu),
                      reasons=reasons)
