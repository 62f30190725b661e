"""Tune the grouped-GEMM launch configurations for this GPU, in any weight format (CUDA only).

    python benchmarks/tune_moe.py --shapes qwen3,mixtral [--formats bf16,fp8,fp8-channel,int8,w4a16,mxfp4,nvfp4]
                                  [--tokens 1,8,...] [--jobs 8] [--tma] [--split-k] [--half-tail] [--decode-first]
                                  [--warp-specialized]
                                  [--out FILE]

For each shape, format and token count it times both expert GEMMs of a triton ``MoELayer`` in that
format (the gate/up GEMM with its fused activation, and the down GEMM), exactly as the layer runs
them: the layer's own stages, re-aligned and re-tiled for every candidate configuration, as CUDA-graph
replays with the L2 flushed, on the layer's random weights, random activations and three random
softmax routings (the mean: which experts a small batch reaches varies). The candidates are a search space pruned
by rows per expert and by the format (``8-bit``: 128-deep K-steps for the per-128 scales; ``4-bit``: the
dequantizing kernels' tiles, up to 256-row blocks; ``--warp-specialized``: bf16 tiles the Gluon kernel takes, also
with it), plus the configuration the layer picks today, so a tuned entry is never slower than the rules
it replaces (up to timing noise). The rows are aligned once, by the larger of the two GEMMs' ``block_m``
(the smaller must divide it): each GEMM is timed on rows aligned by its own ``block_m``, then each GEMM's
best at a smaller block is timed again on rows aligned by the other's larger block (more padding), and the
fastest pair is kept.

The result is merged into ``moeforge/kernels/configs/<device>.json`` under the shape's key, with the
format's ``QuantMethod.table_key`` appended for a quantized format (``E=8,k=2,H=4096,I=14336,bf16,mxfp4``);
``MoELayer`` reads it for that device, shape and format, by the nearest token count: a new table must
cover every default token count (the script refuses a partial one), after which ``--tokens`` may re-tune
some entries. To support a new GPU, run this script on it and commit the file. ``--jobs`` compiles the
candidates in that many processes first (Triton's cache on disk keeps them), so the timing loop does not wait
on the compiler.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_moe  # noqa: E402
from bench_moe import (  # noqa: E402
    DEFAULT_SHAPES, EIGHT_BIT, FLUSH_BYTES, QUANT_METHODS, TOKENS, format_problem, held_formats, random_batch,
    shape_of, time_graph)

import moeforge as mf  # noqa: E402
from moeforge.kernels import gluon_grouped_gemm  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig, device_key, shape_key  # noqa: E402
from moeforge.payloads import Activations, AlignedRows, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages.gemm import GemmRole  # noqa: E402

FORMATS = ("bf16", *QUANT_METHODS)


FOUR_BIT = ("mxfp4", "mxfp4-shuffled", "nvfp4", "nvfp4-shuffled", "w4a16")
# 4-bit weights in the pre-shuffled layout: swapped tiles at every size
SHUFFLED = ("mxfp4-shuffled", "nvfp4-shuffled")


def candidates(fmt: str, rows_per_expert: float) -> Iterator[GemmConfig]:
    """The search space of one format, pruned by how many rows an expert gets on average."""
    if fmt in SHUFFLED:  # swapped tiles only (the plain product reads a shuffled tile slower), 64 or 128 weight rows
        if rows_per_expert <= 4:
            space = dict(block_m=[16], block_n=[64, 128], block_k=[64, 128], group_m=[1], num_warps=[4, 8],
                         num_stages=[3, 4], swap=[True])
        elif rows_per_expert <= 48:
            space = dict(block_m=[16, 32, 64], block_n=[64, 128], block_k=[64, 128], group_m=[8], num_warps=[4],
                         num_stages=[3], swap=[True])
        elif rows_per_expert <= 256:
            space = dict(block_m=[64, 128], block_n=[64, 128], block_k=[64], group_m=[8], num_warps=[4, 8],
                         num_stages=[3], swap=[True])
        else:
            space = dict(block_m=[128, 256], block_n=[64, 128], block_k=[64], group_m=[8], num_warps=[4, 8],
                         num_stages=[3], swap=[True])
        for values in itertools.product(*space.values()):
            yield GemmConfig(**dict(zip(space.keys(), values)))
        return
    if fmt in FOUR_BIT:  # the weights are decoded in every program
        if rows_per_expert <= 4:
            space = dict(block_m=[16], block_n=[32, 64, 128], block_k=[64, 128], group_m=[1], num_warps=[4],
                         num_stages=[3, 4])
        # From 64-row blocks both orientations (swap: W @ rows^T, the decoded tile as the wgmma's register
        # operand): on an H200 swapping made some tiles 0.67-0.89x faster and others up to 5x slower
        # (docs/notes/kernels-log.md, "The swapped 4-bit product"); 16- and 32-row tiles are not swapped (slower on
        # an H100).
        elif rows_per_expert <= 48:
            space = dict(block_m=[16, 32, 64], block_n=[64, 128], block_k=[64], group_m=[8], num_warps=[4],
                         num_stages=[3], swap=[False, True])
        elif rows_per_expert <= 256:
            space = dict(block_m=[64, 128], block_n=[64, 128], block_k=[64], group_m=[8], num_warps=[4, 8],
                         num_stages=[3], swap=[False, True])
        else:  # one decoded tile for as many rows as the registers allow
            space = dict(block_m=[128, 256], block_n=[64, 128], block_k=[64], group_m=[8], num_warps=[4, 8],
                         num_stages=[3], swap=[False, True])
    elif fmt in EIGHT_BIT:  # 128-deep K-steps (one scale group each for fp8 blocks)
        if rows_per_expert <= 4:
            space = dict(block_m=[16], block_n=[32, 64, 128], block_k=[128], group_m=[1], num_warps=[4],
                         num_stages=[3, 4, 5])
        elif rows_per_expert <= 48:  # 64-row (wgmma) tiles too, half of them padding: on an H200 DeepSeek-V3's
            # FP8 GEMMs at 32 rows per expert ran 0.67-0.70x the 32-row tiles' time (ab_fp8_rows64_dsv3-...log)
            space = dict(block_m=[16, 32, 64], block_n=[64, 128], block_k=[128], group_m=[8], num_warps=[4],
                         num_stages=[3, 4])
        elif rows_per_expert <= 256:
            space = dict(block_m=[32, 64], block_n=[64, 128], block_k=[128], group_m=[8], num_warps=[4, 8],
                         num_stages=[3, 4])
        else:  # 64 columns: two accumulators (gate, up) of 128 rows on 8 warps without spilling
            space = dict(block_m=[64, 128], block_n=[64, 128, 256], block_k=[128], group_m=[8], num_warps=[8],
                         num_stages=[3, 4])
    elif rows_per_expert <= 4:  # bf16, weight-streaming: many narrow tiles, deep pipelines
        space = dict(block_m=[16], block_n=[32, 64], block_k=[128, 256], group_m=[1], num_warps=[4],
                     num_stages=[4, 5])
    elif rows_per_expert <= 48:  # 64-row (wgmma) tiles too: on an H200 they won at 32 rows per expert
        space = dict(block_m=[16, 32, 64], block_n=[64, 128], block_k=[128], group_m=[8], num_warps=[4],
                     num_stages=[3, 4])
    elif rows_per_expert <= 256:  # 256-wide tiles too: on an H200 a 128 x 256 down GEMM won at 128-256 rows per expert
        space = dict(block_m=[64, 128], block_n=[128, 256], block_k=[64], group_m=[8], num_warps=[4, 8],
                     num_stages=[3, 4])
    else:  # arithmetic-bound: big tiles
        space = dict(block_m=[64, 128], block_n=[128, 256], block_k=[64], group_m=[8], num_warps=[8],
                     num_stages=[3, 4])
    for values in itertools.product(*space.values()):
        config = GemmConfig(**dict(zip(space.keys(), values)))
        if not (config.swap and config.block_m < 64):
            yield config


# -- the layer's own stages, re-tiled ----------------------------------------------------------------


def build_layer(shape: tuple[int, int, int, int], fmt: str) -> mf.MoELayer:
    layer = bench_moe.build_layer(shape, fmt)
    if fmt != "bf16" and layer.quant.table_key is None:
        raise SystemExit(f"{layer.quant.name} has no table_key: its GEMMs cannot take tuned tiles")
    return layer


def partial_new_tables(table: dict[str, Any], shapes: list[str], formats: list[str], tokens: list[int]) -> list[str]:
    """The keys this run would create (absent from ``table``) without every default token count: a table
    serves every batch by its nearest entry, so one tuned only for small batches would run large ones on
    decode tiles. A format the shape cannot hold (:func:`format_problem`) creates no table: it is skipped."""
    if all(t in tokens for t in TOKENS):
        return []
    keys = (table_key(shape_of(name), fmt) for name in shapes for fmt in formats
            if format_problem(shape_of(name), fmt) is None)
    return [key for key in keys if key not in table]


def table_key(shape: tuple[int, int, int, int], fmt: str) -> str:
    """The key of the table of ``shape`` in ``fmt`` (the one the layer looks up), without building a layer."""
    _, _, hidden, inter = shape
    return shape_key(*shape, "bf16", QUANT_METHODS[fmt](hidden, inter).table_key if fmt != "bf16" else None)


ROUTINGS = 3  # random routings each candidate is timed on: which experts a small batch reaches varies


def routed_tokens(layer: mf.MoELayer, shape: tuple[int, int, int, int], tokens: int, seed: int = 0
                  ) -> RoutedTokens:
    experts, top_k, hidden, _ = shape
    x, logits = random_batch(tokens, hidden, experts, seed)
    topk = mf.stages.select_experts(logits, top_k, layer.routing)
    return RoutedTokens(Activations(x), TopKOutput(topk.weights, topk.ids))


@dataclasses.dataclass
class Gemms:
    """A layer's expert stages split around its two GEMMs (everything after the top-k)."""

    before: list[Any]  # to the gate/up GEMM's input (quantization, dispatch)
    gate_up: Any
    between: list[Any]  # to the down GEMM's input
    down: Any

    @classmethod
    def of(cls, layer: mf.MoELayer) -> Gemms:
        stages = list(layer.pipeline.stages[1:])
        roles = [getattr(stage, "role", None) for stage in stages]
        if GemmRole.GATE_UP not in roles or GemmRole.DOWN not in roles:
            raise SystemExit(f"no triton GEMM stages to tune in {layer.pipeline.describe()}")
        g, d = roles.index(GemmRole.GATE_UP), roles.index(GemmRole.DOWN)
        return cls(stages[:g], stages[g], stages[g + 1:d], stages[d])

    def retabled(self, table: ConfigTable) -> Gemms:
        """The stages reading ``table`` (the dispatch for ``block_m``, the GEMMs for their tiles)."""
        def one(stage: Any) -> Any:
            return attrs.evolve(stage, configs=table) if hasattr(stage, "configs") else stage
        return Gemms([one(s) for s in self.before], one(self.gate_up), [one(s) for s in self.between], one(self.down))

    def inputs(self, routed: RoutedTokens) -> tuple[AlignedRows, AlignedRows]:
        x: Any = routed
        for stage in self.before:
            x = stage(x)
        gate_up_in = x
        x = self.gate_up(x)
        for stage in self.between:
            x = stage(x)
        return gate_up_in, x

    def chosen(self, routed: RoutedTokens) -> tuple[GemmConfig, GemmConfig]:
        """The configurations the layer launches for these tokens today."""
        gate_up_in, down_in = self.inputs(routed)
        return tuple(  # type: ignore[return-value]
            stage.gemm_config(x.alignment) if hasattr(stage, "gemm_config")
            else (x.alignment.config.gate_up if stage.role is GemmRole.GATE_UP else x.alignment.config.down)
            for stage, x in ((self.gate_up, gate_up_in), (self.down, down_in)))


def one_entry_table(layer: mf.MoELayer, tokens: int, block_m: int) -> ConfigTable:
    config = GemmConfig(block_m, 64, 64)
    # A weight format tells the quantized GEMMs to take the tiles they are given (here: the alignment's).
    return ConfigTable(layer.num_experts, layer.top_k, tokens=(tokens,), configs=(MoEConfig(config, config),),
                       weight_format=layer.quant.table_key)


def retiled(x: AlignedRows, role: str, config: GemmConfig) -> AlignedRows:
    """``x`` with ``config`` as the launch configuration of the ``role`` GEMM (the GEMMs read it from the
    alignment); the other GEMM's entry keeps the alignment's ``block_m``, so a smaller ``config.block_m``
    runs on rows aligned by the larger block."""
    old = x.alignment.config
    config_pair = MoEConfig(config, old.down) if role == "gate_up" else MoEConfig(old.gate_up, config)
    return dataclasses.replace(x, alignment=dataclasses.replace(x.alignment, config=config_pair))


SPLITS = (1, 2, 4)  # --split-k: the K-loop splits timed at decode (a few rows per expert)
# --decode-first: the scratch sizes (GiB) whose experts per chunk are timed, above this many rows per expert (on an
# H200 decoding first lost at 256 rows per expert and below: Mixtral M = 1024, Qwen3 M = 4096, GPT-OSS M = 4096)
DECODE_BUDGETS_GIB = (0.5, 2.0)
DECODE_MIN_ROWS = 256


def decode_chunks(shape: tuple[int, int, int, int]) -> list[int]:
    """The experts per chunk timed with ``--decode-first``: as many as a scratch of each of
    :data:`DECODE_BUDGETS_GIB` holds of the larger (gate/up) weight in bf16, at least one, at most all."""
    experts, _, hidden, inter = shape
    per_expert = 2 * inter * hidden * 2
    return sorted({max(1, min(experts, int(gib * 2**30) // per_expert)) for gib in DECODE_BUDGETS_GIB})


def warp_specialized_twins(configs: list[GemmConfig], glu: bool) -> list[GemmConfig]:
    """The candidates whose tile the warp-specialised Gluon kernel takes (one K-loop over ``rows @ W^T``), marked to
    launch it."""
    return [attrs.evolve(config, warp_specialized=True) for config in configs
            if not config.swap and (config.split_k or 1) == 1 and not config.decode_chunk
            and gluon_grouped_gemm.tile_problem(config, glu) is None]


def plan(layer: mf.MoELayer, shape: tuple[int, int, int, int], fmt: str, tokens: int, tma: bool = False,
         split_k: bool = False, half_tail: bool = False, decode_first: bool = False, warp_specialized: bool = False
         ) -> dict[int, dict[str, list[GemmConfig]]]:
    """The candidates by ``block_m`` and GEMM for one token count (the layer's own choice included);
    ``tma``: each with the weight tiles by pointer and by TMA (else the launcher's rule decides);
    ``split_k``: at decode (at most 4 rows per expert), each with the K-loop in 1, 2 and 4 ranges (else the
    launcher's rule decides); ``half_tail``: each of at least 32 rows (the layer's own choice too) also with
    half-height tiles for the experts' last blocks (``GemmConfig.half_tail``); ``decode_first``: 4-bit formats above
    :data:`DECODE_MIN_ROWS` rows per expert, also the bf16 candidates with the weights decoded first
    (``GemmConfig.decode_chunk``), in chunks of each of :func:`decode_chunks` experts; ``warp_specialized``: bf16,
    also each candidate whose tile the warp-specialised Gluon kernel takes with that kernel
    (``GemmConfig.warp_specialized``; :func:`warp_specialized_twins`)."""
    gemms = Gemms.of(layer)
    chosen = gemms.chosen(routed_tokens(layer, shape, tokens))
    space = list(candidates(fmt, tokens * layer.top_k / layer.num_experts))
    if tma:
        space = [attrs.evolve(config, tma=choice) for config in space for choice in (False, True)]
    if split_k and tokens * layer.top_k / layer.num_experts <= 4:
        space = [attrs.evolve(config, split_k=splits) for config in space for splits in SPLITS]
    gate_up_space, down_space = [*space, chosen[0]], [*space, chosen[1]]
    rows = tokens * layer.top_k / layer.num_experts
    if decode_first and fmt in FOUR_BIT and rows > DECODE_MIN_ROWS:
        decoded = [attrs.evolve(config, decode_chunk=chunk) for config in candidates("bf16", rows)
                   for chunk in decode_chunks(shape)]
        gate_up_space, down_space = gate_up_space + decoded, down_space + decoded
    gluon_gate_up, gluon_down = (warp_specialized_twins(gate_up_space, glu=True),
                                 warp_specialized_twins(down_space, glu=False)) \
        if warp_specialized and fmt == "bf16" else ([], [])
    if half_tail:
        gate_up_space, down_space = ([c for config in configs for c in (
            (config, attrs.evolve(config, half_tail=True)) if config.block_m >= 32 else (config,))]
            for configs in (gate_up_space, down_space))
    gate_up_space, down_space = gate_up_space + gluon_gate_up, down_space + gluon_down
    by_block: dict[int, dict[str, list[GemmConfig]]] = {}
    for config in gate_up_space:
        by_block.setdefault(config.block_m, {"gate_up": [], "down": []})["gate_up"].append(config)
    for config in down_space:
        by_block.setdefault(config.block_m, {"gate_up": [], "down": []})["down"].append(config)
    return {m: {role: list(dict.fromkeys(configs)) for role, configs in v.items()} for m, v in by_block.items()}


def runners(layer: mf.MoELayer, shape: tuple[int, int, int, int], tokens: int, block_m: int
            ) -> dict[str, Callable[[GemmConfig], Callable[[], Any]]]:
    """For each GEMM: config -> a function launching it on this token count's rows, once for each of
    :data:`ROUTINGS` routings."""
    gemms = Gemms.of(layer).retabled(one_entry_table(layer, tokens, block_m))
    inputs = [gemms.inputs(routed_tokens(layer, shape, tokens, seed)) for seed in range(ROUTINGS)]

    def make(role: str, stage: Any, xs: list[AlignedRows]) -> Callable[[GemmConfig], Callable[[], Any]]:
        def launcher(config: GemmConfig) -> Callable[[], Any]:
            rows = [retiled(x, role, config) for x in xs]
            return lambda: [stage(x) for x in rows]
        return launcher

    return {"gate_up": make("gate_up", gemms.gate_up, [x for x, _ in inputs]),
            "down": make("down", gemms.down, [x for _, x in inputs])}


# -- compiling ahead, in parallel ------------------------------------------------------------------


def _compile(job: tuple[str, str, list[int], int, int, Any, bool, bool, bool, bool]) -> int:
    """Launch (and so compile into Triton's cache) every ``index % count == worker`` candidate;
    ``creating``: a lock, one layer created at a time (quantizing one takes many times its size)."""
    shape_name, fmt, tokens_list, worker, count, creating, tma, split_k, half_tail, decode_first, warp_specialized = job
    shape = shape_of(shape_name)
    torch.manual_seed(0)
    with creating:
        layer = build_layer(shape, fmt)
        torch.cuda.empty_cache()  # the float weights it was quantized from
    done = 0
    index = 0
    with torch.no_grad():
        for tokens in tokens_list:
            for block_m, roles in plan(layer, shape, fmt, tokens, tma, split_k, half_tail, decode_first,
                                       warp_specialized).items():
                run = runners(layer, shape, tokens, block_m)
                for role, configs in roles.items():
                    for config in configs:
                        index += 1
                        if index % count != worker:
                            continue
                        try:
                            run[role](config)()
                            done += 1
                        except Exception:  # the timing loop reports it
                            pass
    torch.cuda.synchronize()
    return done


def compile_ahead(shape_name: str, fmt: str, tokens_list: list[int], jobs: int, tma: bool = False,
                  split_k: bool = False, half_tail: bool = False, decode_first: bool = False,
                  warp_specialized: bool = False) -> None:
    if jobs <= 1:
        return
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        lock = manager.Lock()
        jobs_list = [(shape_name, fmt, tokens_list, w, jobs, lock, tma, split_k, half_tail, decode_first,
                      warp_specialized) for w in range(jobs)]
        done = sum(pool.map(_compile, jobs_list))
    print(f"  compiled {done} launches in {jobs} processes", flush=True)


def affordable_jobs(shape: tuple[int, int, int, int], fmt: str, tokens: int, jobs: int) -> int:
    """``jobs``, fewer when that many copies of the layer's weights and of the rows of ``tokens`` tokens
    (:data:`ROUTINGS` of them) would not fit beside the one layer being created at a time."""
    experts, top_k, hidden, inter = shape
    bytes_per_weight = 2.0 if fmt == "bf16" else 1.1 if fmt in EIGHT_BIT else 0.6
    layer_bytes = 3 * experts * hidden * inter * bytes_per_weight + (1 << 30)  # + a context
    rows_bytes = ROUTINGS * tokens * (2 * hidden + top_k * (2 * 2 * inter + 2 * hidden))  # bf16 upper bounds
    creating = 3 * experts * hidden * inter * 12  # fp32 weights, and their quantization's temporaries
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(jobs, int((0.8 * free - creating) // (layer_bytes + rows_bytes)) - 1))


# -- timing -----------------------------------------------------------------------------------------


Timed = tuple[float, GemmConfig]  # microseconds, configuration


def mixed_pairs(best: dict[int, dict[str, Timed]]) -> Iterator[tuple[int, int]]:
    """``(gate_up block_m, down block_m)`` of the pairs with different blocks, one dividing the other."""
    for gate_up_m, down_m in itertools.permutations(best, 2):
        small, large = sorted((gate_up_m, down_m))
        if "gate_up" in best[gate_up_m] and "down" in best[down_m] and large % small == 0:
            yield gate_up_m, down_m


def best_pair(best: dict[int, dict[str, Timed]], on_larger: dict[tuple[int, int], Timed]
              ) -> tuple[Timed, Timed]:
    """The fastest ``(gate_up, down)``: each GEMM's best on its own block where both blocks are equal, or,
    for a pair of different blocks (``on_larger``, keyed ``(gate_up block_m, down block_m)``), the GEMM of the
    smaller block as timed again on rows aligned by the larger."""
    options: list[tuple[Timed, Timed]] = [(v["gate_up"], v["down"]) for v in best.values() if len(v) == 2]
    for (gate_up_m, down_m), timed in on_larger.items():
        options.append((timed, best[down_m]["down"]) if gate_up_m < down_m else (best[gate_up_m]["gate_up"], timed))
    return min(options, key=lambda pair: pair[0][0] + pair[1][0])


def tune_cell(layer: mf.MoELayer, shape: tuple[int, int, int, int], fmt: str, tokens: int,
              flush: torch.Tensor, reps: int, tma: bool = False, split_k: bool = False,
              half_tail: bool = False, decode_first: bool = False, warp_specialized: bool = False) -> dict[str, Any]:
    best: dict[int, dict[str, Timed]] = {}
    runs: dict[int, dict[str, Callable[[GemmConfig], Callable[[], Any]]]] = {}

    def timed(block_m: int, role: str, config: GemmConfig) -> Optional[float]:
        try:
            return time_graph(runs[block_m][role](config), reps, flush) / ROUTINGS
        except Exception as error:  # a configuration the compiler rejects is skipped
            print(f"  skip {role} {config}: {type(error).__name__}", flush=True)
            return None

    with torch.no_grad():
        for block_m, roles in plan(layer, shape, fmt, tokens, tma, split_k, half_tail, decode_first,
                                   warp_specialized).items():
            runs[block_m] = runners(layer, shape, tokens, block_m)
            for role, configs in roles.items():
                for config in configs:
                    us = timed(block_m, role, config)
                    slot = best.setdefault(block_m, {})
                    if us is not None and (role not in slot or us < slot[role][0]):
                        slot[role] = (us, config)
        # The smaller block's GEMM again, on rows aligned by the larger block (its padding-only blocks skipped).
        on_larger: dict[tuple[int, int], Timed] = {}
        for gate_up_m, down_m in mixed_pairs(best):
            role, small, large = ("gate_up", gate_up_m, down_m) if gate_up_m < down_m else ("down", down_m, gate_up_m)
            config = best[small][role][1]
            us = timed(large, role, config)
            if us is not None:
                on_larger[gate_up_m, down_m] = (us, config)
    gate_up, down = best_pair(best, on_larger)
    total = gate_up[0] + down[0]
    print(f"  M={tokens:6d}: gate_up {gate_up[0]:.1f} us {gate_up[1]}, down {down[0]:.1f} us {down[1]} "
          f"(total {total:.1f} us)", flush=True)
    chosen = {"gate_up": gate_up, "down": down}
    as_dict = lambda c: dict(block_m=c.block_m, block_n=c.block_n, block_k=c.block_k, group_m=c.group_m,  # noqa: E731
                             num_warps=c.num_warps, num_stages=c.num_stages,
                             **({} if c.tma is None else dict(tma=c.tma)),
                             **({} if c.split_k is None else dict(split_k=c.split_k)),
                             **({} if not c.swap else dict(swap=True)),
                             **({} if not c.half_tail else dict(half_tail=True)),
                             **({} if not c.decode_chunk else dict(decode_chunk=c.decode_chunk)),
                             **({} if not c.warp_specialized else dict(warp_specialized=True)))
    return dict(gate_up=as_dict(chosen["gate_up"][1]), down=as_dict(chosen["down"][1]), us=round(total, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated: names of bench_moe.SHAPES, or a shape written out as ExkxHxI "
                             "(64x8x2048x1024)")
    parser.add_argument("--formats", default="bf16", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes compiling the candidates ahead of the timing (1: compile as it goes)")
    parser.add_argument("--out", default=None, help="default: moeforge/kernels/configs/<device>.json")
    parser.add_argument("--tma", action="store_true",
                        help="time each candidate with the weight tiles by pointer and by TMA (Hopper), and write "
                             "the choice into the table (else the launcher's rule decides)")
    parser.add_argument("--split-k", action="store_true",
                        help="at decode (at most 4 rows per expert), time each candidate with the K-loop split into "
                             f"{', '.join(map(str, SPLITS))} ranges, and write the choice into the table (else the "
                             "launcher's rule decides)")
    parser.add_argument("--half-tail", action="store_true",
                        help="time each candidate of at least 32 rows also with half-height tiles for the experts' "
                             "last blocks, and write the choice into the table")
    parser.add_argument("--decode-first", action="store_true",
                        help=f"4-bit formats above {DECODE_MIN_ROWS} rows per expert: also time the bf16 candidates "
                             "with the weights decoded first, a chunk of experts at a time (GemmConfig.decode_chunk), "
                             "and write the choice into the table")
    parser.add_argument("--warp-specialized", action="store_true",
                        help="bf16: also time each candidate whose tile the warp-specialised Gluon kernel takes with "
                             "that kernel (Hopper; GemmConfig.warp_specialized), and write the choice into the table")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        sys.exit(f"unknown formats {unknown}: choose from {', '.join(FORMATS)}")
    if not torch.cuda.is_available():
        sys.exit("tune_moe.py needs a CUDA device")
    device = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parents[1] / "moeforge" / "kernels" / "configs" / f"{device_key(device)}.json")
    table = json.loads(out.read_text()) if out.exists() else {}
    tokens_list = [int(t) for t in args.tokens.split(",")]
    refused = partial_new_tables(table, args.shapes.split(","), formats, tokens_list)
    if refused:
        sys.exit(f"{', '.join(refused)}: no table on {device} yet, and a new table needs every token count of the "
                 f"default --tokens ({','.join(map(str, TOKENS))}); tune those first, then refine some with --tokens")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for name in args.shapes.split(","):
        shape = shape_of(name)
        for fmt in held_formats(name, formats):
            torch.manual_seed(0)
            compile_ahead(name, fmt, tokens_list, affordable_jobs(shape, fmt, max(tokens_list), args.jobs), args.tma,
                          args.split_k, args.half_tail, args.decode_first, args.warp_specialized)
            layer = build_layer(shape, fmt)
            key = table_key(shape, fmt)
            print(f"{name} {key}", flush=True)
            entries = table.setdefault(key, {})
            for tokens in tokens_list:
                entries[str(tokens)] = tune_cell(layer, shape, fmt, tokens, flush, args.reps, args.tma,
                                                    args.split_k, args.half_tail, args.decode_first,
                                                    args.warp_specialized)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(table, indent=1, sort_keys=True))  # progress survives a time-out
            del layer
            torch.cuda.empty_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
