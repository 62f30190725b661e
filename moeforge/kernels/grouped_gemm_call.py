"""The one caller of the ``moeforge::moe_gemm`` custom op: operand records in, the op's arguments out.

A ``torch.library`` custom op takes a flat schema of tensors, scalars and integer lists, so the grouped GEMM's op
(:mod:`moeforge.kernels.ops`) has 32 positional arguments. Nothing in the package calls it except
:func:`grouped_gemm`, which takes the operands as four records and the launch configuration and spells the
positional order out once:

* :class:`GemmRows`: the rows, their scales, NVFP4 rows' global scale, and how many copies read each row;
* :class:`GemmWeight`: the expert weights, their :class:`~moeforge.kernels.formats.WeightFormat`, scales, zero
  points, global scales, layout (pre-shuffled) and a known bound on MXFP4's scale codes;
* :class:`GemmRoute`: the block-aligned plan (:mod:`moeforge.kernels.align`): which copy each row slot holds,
  each block's expert, the padded row count, the number of copies, the block the rows were aligned with, and
  whether the rows are in slot order (:mod:`moeforge.kernels.slot_rows`: what the weight gradient reads in place);
* :class:`GemmEpilogue`: what happens to the accumulators: bias, routing weights, activation, output dtype,
  FP8 output quantization.

An absent operand is ``None`` in its record; the op's own placeholders (``0`` for "the configuration's
``block_m``", ``255`` for "no bound known") are written here only. The launch configuration crosses the op as
the fixed-length integer list of :func:`encode_config`, which the op parses with :func:`decode_config`.
``tests/test_grouped_gemm_call.py`` fails if another module of the package calls the op.

The op's implementation, :func:`launch`, is here too, beside its one caller: :data:`MOE_GEMM` (a
:class:`~moeforge.kernels.kernel_op.KernelOp`) calls it directly in an eager call that needs no op, and the op
otherwise.

The records are frozen dataclasses, not ``attrs`` classes: the stages build them in every forward, and Dynamo
cannot trace a frozen ``attrs`` ``__init__`` (see :mod:`moeforge.payloads`). This module imports neither Triton
(the stages import it with ``import moeforge``; :func:`launch` imports the launcher when first called) nor
:mod:`moeforge.kernels.ops`, which registers the op with :func:`launch` and its backward
(:mod:`moeforge.kernels.backward`, which calls :func:`grouped_gemm`): the op exists once :mod:`moeforge.kernels.ops`
is imported, which the Triton stages do when they are built (:func:`moeforge.stages.triton.kernel_ops`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from moeforge.kernels.config import GemmConfig
from moeforge.kernels.formats import SCALE_BLOCK, WeightFormat
from moeforge.kernels.kernel_op import KernelOp

# The op's ``config`` argument: one integer per field, in this order (:func:`encode_config`).
CONFIG_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "tma", "split_k", "swap",
                 "half_tail", "decode_chunk", "warp_specialized")

NO_SCALE_BOUND = 255  # the op's weight_scale_max when no bound on the E8M0 codes is known (every code is <= 255)


def encode_config(config: GemmConfig) -> list[int]:
    """``config`` as the op's ``config`` argument: one integer per field of :data:`CONFIG_FIELDS`, in that
    order; ``tma`` as -1 (``None``: the launcher's rule), 0 or 1; ``split_k`` as 0 (``None``: the launcher's rule)
    or itself; ``swap``, ``half_tail`` and ``warp_specialized`` as 0 or 1; the others as themselves."""
    return [config.block_m, config.block_n, config.block_k, config.group_m, config.num_warps, config.num_stages,
            -1 if config.tma is None else int(config.tma), 0 if config.split_k is None else config.split_k,
            int(config.swap), int(config.half_tail), config.decode_chunk, int(config.warp_specialized)]


def decode_config(values: Sequence[int]) -> GemmConfig:
    """The inverse of :func:`encode_config`; a list of another length is a ``ValueError``."""
    if len(values) != len(CONFIG_FIELDS):
        raise ValueError(f"the moe_gemm op's config is {len(CONFIG_FIELDS)} integers ({', '.join(CONFIG_FIELDS)}; "
                         f"made by encode_config), got {len(values)}: {list(values)}")
    (block_m, block_n, block_k, group_m, num_warps, num_stages, tma, split_k, swap, half_tail, decode_chunk,
     warp_specialized) = values
    return GemmConfig(block_m, block_n, block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                      tma=None if tma < 0 else bool(tma), split_k=None if split_k == 0 else split_k, swap=bool(swap),
                      half_tail=bool(half_tail), decode_chunk=decode_chunk, warp_specialized=bool(warp_specialized))


@dataclasses.dataclass(frozen=True, eq=False)
class GemmRows:
    """The rows the GEMM reads: copy ``c`` of the route reads row ``c // rows_per_a``."""

    data: torch.Tensor  # [R, K]: float, float8_e4m3fn or int8; or uint8 [R, K / 2]: NVFP4 (packed e2m1)
    # FP8 / INT8: fp32 [1] (per tensor), [R, 1] (per token) or [R, K / 128] (per group); NVFP4: e4m3 [R, K / 16]
    scale: Optional[torch.Tensor] = None
    global_scale: float = 1.0  # NVFP4 rows: the static global scale they were quantized with
    rows_per_a: int = 1  # copies per row (top_k for token-major rows a first GEMM gathers from; else 1)
    # Rows gathered from token rows, data[gathered_index[t, j]] = gathered_from[t] (the training step's slot order,
    # moeforge.kernels.slot_rows): the backward sums the rows' gradient into gathered_from's by that index itself,
    # before the weight gradient, and gives data none (the gather's backward would sum the same, after it: the rows'
    # gradient, as many bytes as the rows, would then be held through the weight gradient)
    gathered_from: Optional[torch.Tensor] = None
    gathered_index: Optional[torch.Tensor] = None  # int32 [T, k]


@dataclasses.dataclass(frozen=True, eq=False)
class GemmWeight:
    """The experts' weights ``[E, N_w, K]`` (packed 4-bit: ``[E, N_w, K / 2]`` uint8) and what decodes them
    (:func:`moeforge.kernels.formats.weight_operand` says what each format needs)."""

    data: torch.Tensor
    format: WeightFormat = WeightFormat.FLOAT
    scale: Optional[torch.Tensor] = None
    zero: Optional[torch.Tensor] = None  # INT4's zero points
    global_scale: Optional[torch.Tensor] = None  # NVFP4's fp32 [E] (or float weights decoded from NVFP4)
    shuffled: bool = False  # 4-bit weights in the pre-shuffled layout (moeforge.kernels.shuffle)
    # MXFP4: a bound on the E8M0 codes of ``scale`` (moeforge.kernels.scale_bound), None where none is known
    scale_max: Optional[int] = None


@dataclasses.dataclass(frozen=True, eq=False)
class GemmRoute:
    """The block-aligned plan of the copies (:func:`moeforge.kernels.align.align_block_size`)."""

    sorted_ids: torch.Tensor  # the copy in each row slot (num_copies: padding)
    block_expert: torch.Tensor  # each aligned block's expert
    num_padded: torch.Tensor  # [1]: the row slots in use
    num_copies: int  # the output's rows
    aligned_block_m: Optional[int] = None  # the block the rows were aligned with (None: the config's block_m)
    # Rows in slot order (moeforge.kernels.slot_rows): the number of copies they hold (one row each), every slot's
    # sorted_ids its row (num_copies: none); 0: rows in copy order. The backward's weight gradient then reads each
    # expert's rows in place instead of gathering them, where slot_runs (weight_grad.expert_runs of the copies: rows
    # 1 and 2) says.
    slot_copies: int = 0
    slot_runs: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True, eq=False)
class GemmEpilogue:
    """What the GEMM does with its accumulators before it stores them: bias, activation (the codes of
    :mod:`moeforge.kernels.activations`; 0, the identity), routing weights, then the output's dtype or, with
    ``fp8_out``, float8_e4m3fn with one fp32 scale per 128 columns."""

    out_dtype: torch.dtype
    bias: Optional[torch.Tensor] = None  # [E, N_w]
    routing_weights: Optional[torch.Tensor] = None  # one per copy, multiplied in after the activation
    act: int = 0
    glu: bool = False  # a gated activation on [gate | up] (or interleaved) weight rows: N = N_w / 2 columns out
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = 0.0
    fp8_out: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class GemmUpdate:
    """A low-rank update added to the product before the epilogue: ``scale * rows[c] @ weight[expert of c]^T`` for copy
    ``c`` (an adapter's, :mod:`moeforge.adapters`); with ``ids``, a stack of them: ``weight [S, E, N_w, R]`` and copy
    ``c``'s is ``scale * rows[c] @ weight[ids[c], expert of c]^T`` (no backward: the serving path); a stack's rows may
    come in parts (fp32 ``[P, num_copies, R]``, summed by the launch, ``ids`` the raw adapter ids), or without ids in
    every adapter's columns (``[num_copies, S·R]``, weighed, zero outside each copy's own adapter's: ``scale`` 1; see
    :func:`moeforge.kernels.moe_gemm.moe_gemm`)."""

    rows: torch.Tensor  # [num_copies, R], copy order, contiguous rows (a stack's: fp32 parts [P, C, R], or [C, S·R])
    weight: torch.Tensor  # [E, N_w, R]: the GEMM weight's experts and rows; the rows' float dtype ([S, E, N_w, R])
    scale: float = 1.0
    ids: Optional[torch.Tensor] = None  # [num_copies] int32: each copy's update in a stack (with parts: raw ids)
    # [E, R, K]: where ``rows`` came from, ``rows[c] = a[c // rows_per_a] @ source[expert of c]^T`` on the GEMM's own
    # rows and route (an adapter's A), computed without recording a gradient: the GEMM's backward then gives source
    # its gradient and adds ``d rows[c] @ source[e]`` to its rows' gradient inside the row-gradient launch (one
    # launch and one sum over the copies instead of two, and no add)
    source: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.source is not None and self.rows.requires_grad and torch.is_grad_enabled():
            raise ValueError("a GemmUpdate's rows made from its source are computed without recording a gradient "
                             "(the GEMM's backward gives the source its gradient): compute them under torch.no_grad()")


def config_of(values: Sequence[int]) -> GemmConfig:
    """:func:`decode_config`, once per distinct list (a launch and its backward decode the same few configurations
    over and over). ``int()`` of each value: traced by torch.compile, a field that differed between two compiled calls
    of one function (two layers' tables) comes as a symbolic int, which that specialises (the launch's tiles are
    constants of the graph)."""
    return _config_of(tuple(int(value) for value in values))


@functools.lru_cache(maxsize=1024)
def _config_of(values: tuple[int, ...]) -> GemmConfig:
    return decode_config(values)


def outputs(a: torch.Tensor, weight: torch.Tensor, num_copies: int, glu: bool, out_dtype: torch.dtype,
            fp8_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The uninitialised outputs of :func:`launch` (the op's fake too: sizes depend on sizes only)."""
    n_out = weight.shape[1] // 2 if glu else weight.shape[1]
    if fp8_out:
        return (a.new_empty(num_copies, n_out, dtype=torch.float8_e4m3fn),
                a.new_empty(num_copies, n_out // SCALE_BLOCK, dtype=torch.float32))
    return a.new_empty(num_copies, n_out, dtype=out_dtype), a.new_empty(0, dtype=torch.float32)


# The op's parameters, in its order (:func:`launch`'s; what its ``setup_context`` and backward read by name).
ARGUMENT_NAMES = ("a", "a_scale", "weight", "weight_scale", "weight_zero", "weight_global", "bias", "topk_weights",
                  "sorted_ids", "block_expert", "num_padded", "num_copies", "rows_per_a", "weight_format", "a_global",
                  "act", "glu", "interleaved", "alpha", "limit", "config", "out_dtype", "fp8_out", "aligned_block_m",
                  "weight_scale_max", "weight_shuffled", "update_rows", "update_weight", "update_scale", "update_ids",
                  "slot_copies", "slot_runs", "update_source", "gathered_from", "gathered_index")


def launch(
    a: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    weight: torch.Tensor,
    weight_scale: Optional[torch.Tensor],
    weight_zero: Optional[torch.Tensor],
    weight_global: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    num_copies: int,
    rows_per_a: int,
    weight_format: int,
    a_global: float,
    act: int,
    glu: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    config: list[int],
    out_dtype: torch.dtype,
    fp8_out: bool,
    aligned_block_m: int = 0,
    weight_scale_max: int = 255,
    weight_shuffled: bool = False,
    update_rows: Optional[torch.Tensor] = None,
    update_weight: Optional[torch.Tensor] = None,
    update_scale: float = 1.0,
    update_ids: Optional[torch.Tensor] = None,
    slot_copies: int = 0,
    slot_runs: Optional[torch.Tensor] = None,
    update_source: Optional[torch.Tensor] = None,
    gathered_from: Optional[torch.Tensor] = None,
    gathered_index: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moeforge::moe_gemm`` op's implementation, the one grouped GEMM (:func:`moeforge.kernels.moe_gemm.moe_gemm`,
    imported when first called: this module imports no Triton): ``(out, out_scale)``, where ``out_scale`` is the
    per-128-group FP8 scale when ``fp8_out`` (else empty). Called through :data:`MOE_GEMM` by :func:`grouped_gemm`
    only, which fills these positional arguments from operand records. ``config``: the launch configuration as
    :func:`encode_config` writes it (a list of another length is a ``ValueError``); ``aligned_block_m``: the block the
    rows were aligned with (0: ``config``'s ``block_m``); ``weight_scale_max``: a bound on MXFP4's E8M0 codes (255:
    none known); ``weight_shuffled``: a 4-bit weight in the pre-shuffled layout (:mod:`moeforge.kernels.shuffle`);
    ``update_*``: a low-rank update (:class:`GemmUpdate`; ``update_source`` is read by the backward
    alone); ``slot_copies``, ``slot_runs``: :class:`GemmRoute`'s, ``gathered_from``, ``gathered_index``:
    :class:`GemmRows`' (the forward computes the same either way; the backward reads them). A ``config`` with ``warp_specialized`` launches the Gluon
    kernel where it serves these operands (:mod:`moeforge.kernels.warp_specialized`), else ``moe_gemm``."""
    from moeforge.kernels import moe_gemm as kernel

    if update_source is not None:
        _check_source(update_source, update_rows, update_weight, update_ids, a, weight)
    if gathered_from is not None or gathered_index is not None:
        _check_gathered(gathered_from, gathered_index, a, rows_per_a)
    out, out_scale = outputs(a, weight, num_copies, glu, out_dtype, fp8_out)
    gemm = config_of(config)
    if gemm.warp_specialized and num_copies:  # the tuned table's choice, where that kernel serves this launch
        from moeforge.kernels import warp_specialized

        aligned = aligned_block_m or gemm.block_m
        update = (update_rows, update_weight, update_ids, update_scale) if update_weight is not None else None
        if warp_specialized.problem(
                a, weight, quantized=any(t is not None for t in (a_scale, weight_scale, weight_zero, weight_global)),
                weight_format=WeightFormat(weight_format), bias=bias is not None, act=act, glu=glu,
                interleaved=interleaved, out_dtype=out_dtype, fp8_out=fp8_out, update=update,
                config=gemm, aligned_block_m=aligned) is None:
            warp_specialized.launch(a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a,
                                    config=gemm, glu=glu, topk_weights=topk_weights, aligned_block_m=aligned,
                                    update=(update_rows, update_weight)
                                    if update_rows is not None and update_weight is not None else None)
            return out, out_scale
    kernel.moe_gemm(
        a, weight, out, sorted_ids, block_expert, num_padded, rows_per_a=rows_per_a, config=gemm,
        weight_format=WeightFormat(weight_format), a_scale=a_scale, a_global=a_global,
        weight_scale=weight_scale, weight_zero=weight_zero, weight_global=weight_global, bias=bias,
        topk_weights=topk_weights, act=act, glu=glu, interleaved=interleaved, alpha=alpha, limit=limit,
        out_scale=out_scale if fp8_out else None, aligned_block_m=aligned_block_m or None,
        weight_scale_max=weight_scale_max if weight_scale_max < NO_SCALE_BOUND else None,
        weight_shuffled=weight_shuffled, update_rows=update_rows, update_weight=update_weight,
        update_scale=update_scale, update_ids=update_ids)
    return out, out_scale


def _check_source(source: torch.Tensor, rows: Optional[torch.Tensor], weight_b: Optional[torch.Tensor],
                  ids: Optional[torch.Tensor], a: torch.Tensor, weight: torch.Tensor) -> None:
    """A :class:`GemmUpdate`'s ``source`` must be the ``[E, R, K]`` float matrix of one update's rows (no stack)."""
    if rows is None or weight_b is None or ids is not None or weight_b.dim() != 3:
        raise ValueError("update_source is the source of one low-rank update's rows: it takes update_rows and an "
                         "update_weight [E, N_w, R], no stack")
    want = (int(weight.shape[0]), int(rows.shape[1]), int(a.shape[1]))
    if tuple(source.shape) != want or source.dtype != rows.dtype:
        raise ValueError(f"update_source must be [E, R, K] = {want} in the rows' dtype {rows.dtype}, got "
                         f"{tuple(source.shape)} {source.dtype}")


def _check_gathered(source: Optional[torch.Tensor], index: Optional[torch.Tensor], a: torch.Tensor,
                    rows_per_a: int) -> None:
    """:class:`GemmRows`' ``gathered_from [T, K]`` (the rows' dtype) and ``gathered_index`` (int32 ``[T, k]``) come
    together, for rows read one per copy (``rows_per_a`` 1)."""
    if source is None or index is None:
        raise ValueError("gathered_from and gathered_index come together: the token rows and where each copy's row is")
    if rows_per_a != 1 or index.dtype != torch.int32 or index.dim() != 2 or source.dim() != 2 \
            or source.shape[0] != index.shape[0] or source.shape[1] != a.shape[1] or source.dtype != a.dtype:
        raise ValueError(f"gathered_from must be [T, K] = [{index.shape[0] if index.dim() else '?'}, {a.shape[1]}] "
                         f"in the rows' dtype {a.dtype} and gathered_index int32 [T, k], for rows read one per copy; "
                         f"got {tuple(source.shape)} {source.dtype}, {tuple(index.shape)} {index.dtype}, rows_per_a "
                         f"{rows_per_a}")


# The op's one caller in the package: the op where torch.compile or a dispatch mode needs it, else launch (under the
# op's backward where autograd records the call).
MOE_GEMM = KernelOp("moeforge::moe_gemm", launch, differentiable=True)


def grouped_gemm(rows: GemmRows, weight: GemmWeight, route: GemmRoute, epilogue: GemmEpilogue, config: GemmConfig,
                 update: Optional[GemmUpdate] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out, out_scale)`` of the grouped GEMM (``torch.ops.moeforge.moe_gemm``, launching
    :func:`moeforge.kernels.moe_gemm.moe_gemm`): ``out [num_copies, N]`` where copy ``c``'s row is the epilogue
    of ``rows[c // rows_per_a] @ weight[expert of c]^T``; ``out_scale [num_copies, N / 128]`` with ``fp8_out``,
    else ``None``. ``config``: the launch configuration, before the launcher fits it to the operands. ``update``: a
    low-rank update added to each copy's product before the epilogue."""
    out, out_scale = MOE_GEMM(*arguments(rows, weight, route, epilogue, config, update))
    result: torch.Tensor = out
    return result, out_scale if epilogue.fp8_out else None


def arguments(rows: GemmRows, weight: GemmWeight, route: GemmRoute, epilogue: GemmEpilogue, config: GemmConfig,
              update: Optional[GemmUpdate] = None) -> tuple[Any, ...]:
    """The op's positional arguments for :func:`grouped_gemm`'s operands, in the op's order (every one: what
    :func:`launch` and the op's ``setup_context`` take). :func:`grouped_gemm` calls the op with them; the training
    step that runs the op's functions itself (:mod:`moeforge.stages.triton_step`) calls :func:`launch`."""
    return (
        rows.data, rows.scale, weight.data, weight.scale, weight.zero, weight.global_scale, epilogue.bias,
        epilogue.routing_weights, route.sorted_ids, route.block_expert, route.num_padded, route.num_copies,
        rows.rows_per_a, int(weight.format), rows.global_scale, epilogue.act, epilogue.glu, epilogue.interleaved,
        epilogue.alpha, epilogue.limit, encode_config(config), epilogue.out_dtype, epilogue.fp8_out,
        0 if route.aligned_block_m is None else route.aligned_block_m,
        NO_SCALE_BOUND if weight.scale_max is None else weight.scale_max, weight.shuffled,
        *((update.rows, update.weight, float(update.scale), update.ids) if update is not None
          else (None, None, 1.0, None)), route.slot_copies, route.slot_runs,
        update.source if update is not None else None, rows.gathered_from, rows.gathered_index)
