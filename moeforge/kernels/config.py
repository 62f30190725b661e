"""Launch configurations of the grouped GEMMs: records, tuned tables per device, a fallback.

A :class:`ConfigTable` maps a token count to the configurations of both GEMMs of one layer shape.
The alignment is computed once for both, by the larger of their ``block_m``; the other GEMM's ``block_m``
must divide it (each of its blocks lies in one aligned block, so in one expert's rows). Tables tuned on a device
live in ``moeforge/kernels/configs/<device>.json`` (written by ``benchmarks/tune_moe.py``), one per
layer shape and compute dtype, and one per quantized weight format that was tuned (its
``QuantMethod.table_key``); shapes or devices without a table use :func:`default_config`.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any, Optional

import attrs

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@attrs.frozen
class GemmConfig:
    """One grouped GEMM's launch configuration. It crosses the ``moeforge::moe_gemm`` custom op as the integer
    list of :func:`moeforge.kernels.grouped_gemm_call.encode_config`, one integer per field: a new field is added
    there too (``tests/test_grouped_gemm_call.py`` checks that every field is encoded)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Copy the weight tiles by TMA (Hopper): None leaves it to the launcher's rule
    # (``launch_plan.weight_tma_pays``); a tuned table may decide per entry (``tune_moe.py --tma``).
    tma: Optional[bool] = None
    # Split the K-loop into this many ranges (partial sums added by a second kernel; ``moe_gemm.moe_gemm``):
    # None leaves it to the launcher's rule (``launch_plan.default_split_k``), 1 never splits.
    split_k: Optional[int] = attrs.field(default=None)
    # 4-bit weights: multiply ``W @ rows^T`` (the decoded weight tile as the warpgroup MMA's register operand,
    # whose MMAs then stay in flight across K-steps; ``moe_gemm.moe_gemm``). False: ``rows @ W^T``. Which wins
    # depends on the tile (docs/notes/kernels-log.md, "The swapped 4-bit product"), so only a tuned table sets it.
    swap: bool = False
    # A row block whose second half is only padding (an expert's last block holding at most ``block_m / 2``
    # rows) runs as a ``block_m / 2``-row tile: half the MMA work on it (``moe_gemm.moe_gemm``). Pays in some
    # cells and loses in others (docs/notes/kernels-log.md, "Half-height tiles for the experts' last blocks"), so only a
    # tuned table sets it. Needs ``block_m >= 32`` (the half tile's dot has 16 rows at least).
    half_tail: bool = attrs.field(default=False)
    # 4-bit weights (INT4, MXFP4, NVFP4): decode this many experts' weights at a time into a scratch in the compute
    # dtype, then run the float GEMM on them over those experts' row blocks (``moe_gemm.moe_gemm``,
    # ``moeforge.kernels.decode_first``). 0: decode in the GEMM's K-loop, in every program. Pays where each expert
    # has many rows (the decoding's cost, once per weight, then weighs less than the K-loop's, once per row block:
    # docs/kernels.md, "Decoding first"), so only a tuned table sets it. Ignored for other formats.
    decode_chunk: int = attrs.field(default=0)
    # Float rows and weights (bf16 / fp16): launch the warp-specialised Gluon kernel (Hopper:
    # ``moeforge.kernels.gluon_grouped_gemm``, a loader partition feeding the MMA warps through a ring of
    # shared-memory slots) with this tile, where it serves the launch (``moeforge.kernels.warp_specialized``
    # names why not: another format, activation or epilogue, another GPU, a Triton without Gluon); else
    # ``moe_gemm`` runs the same tile. Faster where the GEMM is bound by arithmetic (docs/kernels.md, "The
    # warp-specialised grouped GEMM"), so only a tuned table sets it (the H200 table's large-batch SwiGLU gate/up).
    warp_specialized: bool = False

    @decode_chunk.validator
    def _check_decode_chunk(self, attribute: Any, value: int) -> None:
        if value < 0:
            raise ValueError(f"decode_chunk must be >= 0 (experts decoded at a time; 0: in the K-loop), got {value}")

    @half_tail.validator
    def _check_half_tail(self, attribute: Any, value: bool) -> None:
        if value and self.block_m < 32:
            raise ValueError(f"half_tail needs block_m >= 32 (its half tiles have block_m / 2 rows), "
                             f"got {self.block_m}")

    def unfused_gate_up(self) -> GemmConfig:
        """The gate/up GEMM's launch when its gated activation runs as an op of its own (a training forward):
        the fused GEMM's tile reads ``block_n`` gate rows and ``block_n`` up rows of the weight; the unfused one
        reads the same ``2 * block_n`` rows as one tile (the same operand ring and accumulator registers), up to
        256 columns (a TMA box's limit). Swapped and split-K launches (small batches) are kept as they are."""
        if self.block_n > 128 or self.swap or (self.split_k or 1) > 1:
            return attrs.evolve(self, warp_specialized=False) if self.warp_specialized else self
        # (the warp-specialised kernel was measured on the fused gate/up GEMM only: moe_gemm's wide tile here)
        return attrs.evolve(self, block_n=2 * self.block_n, warp_specialized=False)

    def with_block_m(self, block_m: int) -> GemmConfig:
        """The configuration with another ``block_m`` (``half_tail`` dropped below 32 rows)."""
        return attrs.evolve(self, block_m=block_m, half_tail=self.half_tail and block_m >= 32)

    @split_k.validator
    def _check_split_k(self, attribute: Any, value: Optional[int]) -> None:
        if value is not None and value < 1:
            raise ValueError(f"split_k must be None or >= 1, got {value}")


@attrs.frozen
class MoEConfig:
    """Both GEMMs' configurations for one token count. The rows are aligned once, by :attr:`block_m` (the
    larger of the two); the smaller ``block_m`` must divide it, so that each of that GEMM's row blocks lies in
    one aligned block and so in one expert's rows (the kernel reads its expert at ``block // ratio``). The
    two may differ because the GEMMs' best tiles do: the swapped 4-bit product's best gate/up tile has 128 rows
    and its best down tile 256 (docs/notes/kernels-log.md, "Two row blocks on one alignment")."""

    gate_up: GemmConfig
    down: GemmConfig
    # The gate/up GEMM's launch without its fused gated activation (GemmConfig.unfused_gate_up: a training forward,
    # an adapter), made with the record so that a forward creates none.
    gate_up_unfused: GemmConfig = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        small, large = sorted((self.gate_up.block_m, self.down.block_m))
        if small < 1 or large % small:
            raise ValueError(f"one GEMM's block_m must divide the other's (the rows are aligned once, by the "
                             f"larger), got gate_up {self.gate_up.block_m} and down {self.down.block_m}")
        object.__setattr__(self, "gate_up_unfused", self.gate_up.unfused_gate_up())

    @property
    def block_m(self) -> int:
        """The alignment's block: the larger of the two GEMMs' ``block_m``."""
        return max(self.gate_up.block_m, self.down.block_m)

    def gate_up_apart(self, glu: bool) -> GemmConfig:
        """The gate/up GEMM's launch when its activation runs as an op of its own (a training forward, an adapter's
        update in between): :attr:`gate_up_unfused` for a gated activation, whose fused tile read gate and up rows
        apart; :attr:`gate_up` for any other."""
        return self.gate_up_unfused if glu else self.gate_up


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes; the H100/H200 limit is 227 KiB per block


def fit_shared_memory(config: GemmConfig, element_bytes: int, b_tiles: int, staged_bytes: int = 0) -> GemmConfig:
    """``config`` with fewer pipeline stages (then a smaller ``block_k``) until its operand tiles fit
    in shared memory: fp32 operands and the fused gate+up GEMM (``b_tiles=2``) need more. ``staged_bytes``:
    shared memory the kernel takes besides the operand ring (an output tile the epilogue stages there)."""
    while True:
        tile = (config.block_m + b_tiles * config.block_n) * config.block_k * element_bytes
        if tile * config.num_stages + staged_bytes <= SHARED_MEMORY_BUDGET:
            return config
        if config.num_stages > 2:
            config = attrs.evolve(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = attrs.evolve(config, block_k=config.block_k // 2)
        else:
            return config


RANK_WIDE = 64  # a GEMM with an output or reduction at most this wide (an adapter's) takes tiles of its sizes


def narrow_config(block_m: int, n: int, k: int) -> GemmConfig:
    """The launch of a GEMM with one rank-wide side (an adapter's ``x Aᵀ`` or ``· Bᵀ``, or their row gradients) on
    rows aligned by ``block_m``: ``n`` columns out of a reduction over ``k``, each tile as wide as the power of two
    above it between 16 (the MMA's least) and 128 (``n``) or 64 (``k``); the launcher's rules for TMA and split K."""
    block_n = min(128, max(16, 1 << max(n - 1, 0).bit_length()))
    block_k = min(64, max(16, 1 << max(k - 1, 0).bit_length()))
    return GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=4, num_stages=3 if k > block_k else 2)


def row_gradient_config(config: GemmConfig, n: int, k: int) -> GemmConfig:
    """The launch of a grouped GEMM's row gradient ``d_rows = d_pre · W`` (``n``: the forward's reduction, now the
    columns out; ``k``: the forward's columns, now the reduction) whose forward ran with ``config``: that tile where
    both sides are wide (the tuned tables' tiles); tiles of these sizes where one is rank-wide (at most
    :data:`RANK_WIDE`), where the forward's would run a wide side in rank-sized steps."""
    if min(n, k) <= RANK_WIDE:
        return narrow_config(config.block_m, n, k)
    return config


# The fallback configurations by rows per expert (upper bounds), read off the tuned bf16 tables of both GPUs (nine
# shapes): up to 8 rows 16-row tiles (the GEMMs are bound by reading the weights: no work on padding rows); around 16
# to 32 rows 32-row tiles, the down GEMM 128 columns wide; from about 64 rows 128 x 128 tiles, the down GEMM (and the
# row gradients, which take the forward's tiles) 128 x 256, as five of the six tuned entries at 64 rows and every one
# above have them (docs/notes/kernels-log.md, "The training GEMMs' tiles", "The fallback tiles"). Built once: a lookup
# in the forward creates no objects.
_MANY_ROWS = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4)
_DEFAULTS = (
    (8.0, MoEConfig(*[GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)] * 2)),
    (48.0, MoEConfig(GemmConfig(32, 64, 128, group_m=8, num_warps=4, num_stages=3),
                     GemmConfig(32, 128, 128, group_m=8, num_warps=4, num_stages=3))),
    (float("inf"), MoEConfig(_MANY_ROWS, attrs.evolve(_MANY_ROWS, block_n=256, num_stages=3))),
)


def _default_index(num_tokens: int, num_experts: int, top_k: int) -> int:
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    return next(index for index, (bound, _) in enumerate(_DEFAULTS) if rows_per_expert <= bound)


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """A reasonable configuration when no tuned table covers the shape (see ``_DEFAULTS``)."""
    return _DEFAULTS[_default_index(num_tokens, num_experts, top_k)][1]


def device_key(name: str) -> str:
    """A file-name-safe key for a device name, e.g. 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def device_tables(device_name: Optional[str]) -> dict[str, Any]:
    """The tuned tables committed for a device (``configs/<device_key>.json``, tables by :func:`shape_key`), or
    ``{}``: no device, or none tuned for it."""
    if device_name is None:
        return {}
    try:
        text = resources.files("moeforge.kernels").joinpath(f"configs/{device_key(device_name)}.json").read_text()
    except (FileNotFoundError, OSError):
        return {}
    return dict(json.loads(text))


def shape_key(num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: str,
              weight_format: Optional[str] = None) -> str:
    """The key of a layer shape's table: ``E=8,k=2,H=4096,I=14336,bf16``, with the quantized weight
    format appended when the table was tuned for one (``...,bf16,mxfp4``)."""
    key = f"E={num_experts},k={top_k},H={hidden},I={intermediate},{dtype}"
    return key if weight_format is None else f"{key},{weight_format}"


@attrs.frozen
class ConfigTable:
    """Configurations by token count for one layer shape; ``lookup`` picks the nearest bucket."""

    num_experts: int
    top_k: int
    tokens: tuple[int, ...] = ()
    configs: tuple[MoEConfig, ...] = ()
    max_block_m: Optional[int] = None  # a kernel whose tiles spill beyond it (quantized GEMMs: 64)
    # A kernel that decodes its weights in every program (4-bit): ``(rows per expert, block_m)`` in
    # ascending order; a batch with at least that many rows per expert aligns to that block whatever the
    # table says (one decoded weight tile serves more rows; docs/notes/kernels-log.md, "One grouped GEMM for
    # every weight format").
    dequant_blocks: tuple[tuple[float, int], ...] = ()
    # Batch invariance (moeforge.batch_invariant): every entry reduces in the same order, and no stage may
    # pick tiles by token count beyond the table's block_m (no dequant_blocks, no decode-time tiles).
    batch_invariant: bool = False
    # The quantized weight format this table was tuned for (``QuantMethod.table_key``): its GEMMs take the
    # table's tiles as they are, instead of their format's rules on the table's block_m.
    weight_format: Optional[str] = None
    # The entries (or the fallbacks) with max_block_m applied, made once: lookup() runs in every forward.
    _capped_configs: tuple[MoEConfig, ...] = attrs.field(init=False, eq=False, repr=False)
    _dequant_configs: tuple[tuple[MoEConfig, ...], ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        entries = self.configs if self.tokens else tuple(config for _, config in _DEFAULTS)
        if self.batch_invariant:  # a split K-loop rounds differently from one: never split; one kernel throughout
            entries = tuple(MoEConfig(attrs.evolve(config.gate_up, split_k=1, warp_specialized=False),
                                      attrs.evolve(config.down, split_k=1, warp_specialized=False))
                            for config in entries)
        capped = tuple(self._capped(config) for config in entries)
        object.__setattr__(self, "_capped_configs", capped)
        object.__setattr__(self, "_dequant_configs", tuple(
            tuple(self._with_block_m(config, block_m) for config in capped) for _, block_m in self.dequant_blocks))

    def lookup(self, num_tokens: int) -> MoEConfig:
        if not self.tokens:
            index = _default_index(num_tokens, self.num_experts, self.top_k)
        else:
            # the first bucket at or above num_tokens, by a loop that torch.compile traces (it cannot trace bisect,
            # a C builtin: a tuned table's lookup would break a full graph)
            index = len(self.tokens)
            for place, bucket in enumerate(self.tokens):
                if bucket >= num_tokens:
                    index = place
                    break
            if index == len(self.tokens):
                index -= 1
            elif index > 0 and num_tokens - self.tokens[index - 1] < self.tokens[index] - num_tokens:
                index -= 1
        if self.dequant_blocks and not self.batch_invariant:
            rows_per_expert = num_tokens * self.top_k / max(self.num_experts, 1)
            for level in range(len(self.dequant_blocks) - 1, -1, -1):
                if rows_per_expert >= self.dequant_blocks[level][0]:
                    return self._dequant_configs[level][index]
        return self._capped_configs[index]

    def block_ms(self) -> frozenset[int]:
        """Every ``block_m`` :meth:`lookup` can return (an entry's, capped, or a ``dequant_blocks`` level's)."""
        return frozenset(config.block_m for configs in (self._capped_configs, *self._dequant_configs)
                         for config in configs)

    def warp_specialized_tokens(self, gemm: str) -> tuple[int, ...]:
        """The token counts whose entry launches ``gemm`` (``"gate_up"`` or ``"down"``) as the warp-specialised
        kernel (``GemmConfig.warp_specialized``): what ``describe()`` names."""
        return tuple(tokens for tokens, config in zip(self.tokens, self._capped_configs)
                     if getattr(config, gemm).warp_specialized)

    def alignment(self) -> tuple[object, ...]:
        """What decides ``block_m`` for a token count: two tables with equal alignments align every batch
        alike, which a block-aligned dispatch and the GEMMs reading its rows must (``Spec.alignment``)."""
        if not self.tokens:
            return ("default", self.num_experts, self.top_k, self.max_block_m, self.dequant_blocks)
        return ("tuned", self.tokens, tuple(config.block_m for config in self._capped_configs), self.dequant_blocks,
                self.weight_format)

    def _capped(self, config: MoEConfig) -> MoEConfig:
        if self.max_block_m is None or config.block_m <= self.max_block_m:
            return config
        cap = self.max_block_m
        return MoEConfig(config.gate_up.with_block_m(min(config.gate_up.block_m, cap)),
                         config.down.with_block_m(min(config.down.block_m, cap)))

    @staticmethod
    def _with_block_m(config: MoEConfig, block_m: int) -> MoEConfig:
        return MoEConfig(config.gate_up.with_block_m(block_m), config.down.with_block_m(block_m))

    @classmethod
    def from_json(cls, num_experts: int, top_k: int, entries: dict[str, Any]) -> ConfigTable:
        items = sorted((int(m), MoEConfig(GemmConfig(**c["gate_up"]), GemmConfig(**c["down"])))
                       for m, c in entries.items())
        return cls(num_experts, top_k, tuple(m for m, _ in items), tuple(c for _, c in items))

    @classmethod
    def load(cls, device_name: Optional[str], num_experts: int, top_k: int, hidden: int,
             intermediate: int, dtype: str, max_block_m: Optional[int] = None,
             dequant_blocks: tuple[tuple[float, int], ...] = (), weight_format: Optional[str] = None
             ) -> ConfigTable:
        """The tuned table for this device and shape (:meth:`from_tables` on :func:`device_tables`), or an empty
        table (heuristic fallback)."""
        return cls.from_tables(device_tables(device_name), num_experts, top_k, hidden, intermediate, dtype,
                               max_block_m, dequant_blocks, weight_format)

    @classmethod
    def from_tables(cls, tables: dict[str, Any], num_experts: int, top_k: int, hidden: int, intermediate: int,
                    dtype: str, max_block_m: Optional[int] = None,
                    dequant_blocks: tuple[tuple[float, int], ...] = (), weight_format: Optional[str] = None
                    ) -> ConfigTable:
        """The table for this shape among ``tables`` (a device file's contents: tables by :func:`shape_key`), or an
        empty table (heuristic fallback).

        With ``weight_format`` (a quant method's ``table_key``), a table tuned for that format wins: it
        is used as tuned (``max_block_m`` and ``dequant_blocks`` were the tuner's to decide). Otherwise
        the compute dtype's table, with ``max_block_m`` capping the alignment block of every entry and
        ``dequant_blocks`` setting it by rows per expert."""
        if weight_format is not None:
            tuned = tables.get(shape_key(num_experts, top_k, hidden, intermediate, dtype, weight_format))
            if tuned:
                return attrs.evolve(cls.from_json(num_experts, top_k, tuned), weight_format=weight_format)
        entries = tables.get(shape_key(num_experts, top_k, hidden, intermediate, dtype))
        if not entries:
            return cls(num_experts, top_k, max_block_m=max_block_m, dequant_blocks=dequant_blocks)
        return attrs.evolve(cls.from_json(num_experts, top_k, entries), max_block_m=max_block_m,
                            dequant_blocks=dequant_blocks)
