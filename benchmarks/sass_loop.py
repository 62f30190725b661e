"""Count the SASS instructions of the grouped GEMM's K-loop for one operand format and tile, without a GPU.

    python benchmarks/sass_loop.py --weights mxfp4 --glu --block 16,128,64 [--warps 4] [--stages 3]
                                   [--dtype bf16] [--rows nvfp4] [--swap] [--portable] [--prefetch] [--fold]
                                   [--shuffled] [--grid 1] [--half-tail] [--drain 0|1] [--hazards] [--dump FILE]

It compiles ``moe_gemm_kernel`` for sm_90 with the ptxas and nvdisasm that ship inside the ``triton``
wheel (no CUDA device or driver needed), finds the K-loop (the longest backward branch) and prints its
instructions by opcode, with the kernel's registers, spills and shared memory. ``--hazards`` also lists the
instructions of the K-loops that write a register a warpgroup MMA still in flight reads (:func:`register_hazards`).
A development tool: the instruction counts quoted in ``docs/notes/kernels-log.md`` come from it. They are the local
Triton's code, which may differ from the GPU machines' Triton: to compile with another version, put its wheel's files first
on the path (``pip install --no-deps --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR:.``), and
measure on a GPU before trusting a difference.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moeforge.kernels.formats import KTail, RowFormat, RowScales, WeightFormat  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.kernels.launch_plan import cvt_by_four, drain_mma  # noqa: E402
from moeforge.kernels.moe_gemm import moe_gemm_kernel  # noqa: E402

FORMATS = {"float": WeightFormat.FLOAT, "int4": WeightFormat.INT4, "mxfp4": WeightFormat.MXFP4,
           "nvfp4": WeightFormat.NVFP4, "fp8-block": WeightFormat.FP8}  # fp8-block: FP8 rows per 128-group
GROUPS = {WeightFormat.INT4: 128, WeightFormat.MXFP4: 32, WeightFormat.NVFP4: 16, WeightFormat.FLOAT: 1,
          WeightFormat.FP8: 1}
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_kernel(weights: WeightFormat, *, glu: bool, block: tuple[int, int, int], warps: int, stages: int,
                   dtype: str, swap: bool, ptx: bool, prefetch: bool, tile_scale: bool = False,
                   fold: bool = False, half_tail: bool = False, persistent: int = 0, shuffled: bool = False,
                   nvfp4_rows: bool = False, drain: Optional[bool] = None, update: int = 0,
                   wide: int = 0, group: int = 1, tma: bool = False, stack: int = 0) -> Any:
    """``moe_gemm_kernel`` for bf16/fp16 rows and ``weights`` (FP8: FP8 rows with per-128-group scales and
    128x128-block weight scales, ``tile_scale``: one per tile), compiled for sm_90 (the compiled kernel), with
    the weight tiles loaded by pointer (``tma``: float weights by TMA through a descriptor, ``B_TMA`` 1, as the
    launcher copies them on Hopper) and one program per tile (a persistent grid's tile loop would be the longest
    loop). ``fold``: MXFP4 in bf16 with the
    ``x 2**126`` folded into the scales (weights whose E8M0 codes are all at most 128). ``half_tail``: with the
    half-height variant of the tile for the experts' last blocks (the loop counted is the full tile's);
    ``persistent``: the grid (0 one program per tile, 1 persistent, 2 flattened); ``shuffled``: the 4-bit weight in the
    pre-shuffled layout (``moeforge.kernels.shuffle``); ``nvfp4_rows``: NVFP4 rows (decoded in the K-loop to
    ``dtype``, the output's) instead of ``dtype`` rows; ``drain``: the kernel's ``DRAIN_MMA``, by default the
    launcher's rule for an sm_90 device and the installed Triton (:func:`moeforge.kernels.launch_plan.drain_mma`).
    ``stack``: with ``update``, a stack's update, each copy its own adapter's K-step (UPDATE_STACK), the rows in this
    many fp32 parts (UPDATE_PARTS: a served stack at few copies; 1: the rows as given, in the rows' dtype)."""
    names = moe_gemm_kernel.arg_names
    if tma and weights is not WeightFormat.FLOAT:
        raise SystemExit("sass_loop.py compiles the TMA weight tiles of float weights only (--weights float)")
    packed = weights.packed
    fp8 = weights is WeightFormat.FP8
    operand = "fp8e4nv" if fp8 else dtype
    swapped = swap and packed
    if drain is None:
        drain = drain_mma((9, 0), swapped, RowFormat.NVFP4 if nvfp4_rows else RowFormat.FLOAT, GemmConfig(*block))
    pointers = dict(a_ptr="*u8" if nvfp4_rows else f"*{operand}", a_scale_ptr="*u8" if nvfp4_rows else "*fp32",
                    b_ptr="*u8" if packed else f"*{operand}",
                    b_desc=f"tensordesc<{operand}[{block[1]},{block[2]}]>" if tma else "*u8",
                    b_scale_ptr="*u8" if weights in (WeightFormat.MXFP4, WeightFormat.NVFP4) else
                    ("*fp32" if fp8 else f"*{dtype}"),
                    b_zero_ptr="*u8", b_global_ptr="*fp32", bias_ptr=f"*{dtype}", c_ptr=f"*{dtype}",
                    c_scale_ptr="*fp32", weights_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                    num_padded_ptr="*i32", block_range_ptr="*i32", p_ptr="*fp32",
                    u_ptr="*fp32" if stack > 1 else f"*{dtype}",
                    ub_ptr=f"*{dtype}", uid_ptr="*i32")
    constexprs: dict[str, Any] = dict(
        A_FMT=int(RowFormat.NVFP4 if nvfp4_rows else RowFormat.FP8 if fp8 else RowFormat.FLOAT),
        A_SCALE=int(RowScales.NVFP4 if nvfp4_rows else RowScales.GROUP if fp8 else RowScales.NONE),
        B_FMT=int(weights), B_BLOCKED=fp8, B_TILE_SCALE=tile_scale,
        GROUP=GROUPS[weights], HAS_ZEROS=False,
        QUANT_OUT=False, ACT=1 if glu else 0, GLU=glu, HAS_BIAS=False, MUL_WEIGHTS=not glu,
        EVEN_K=int(KTail.EVEN_VECTOR_SCALES if packed else KTail.EVEN),
        PRECISION="tf32", SWAP=swapped, PTX=ptx and (packed or nvfp4_rows), FP8_CVT=ptx and (packed or nvfp4_rows),
        CVT_BY_FOUR=ptx and packed and cvt_by_four(GemmConfig(*block)), PREFETCH=prefetch and packed,
        B_TMA=1 if tma else 0, SPLIT=False, PERSISTENT=persistent, HALF_TAIL=half_tail, DRAIN_MMA=drain,
        B_GLOBAL=weights is WeightFormat.NVFP4 or nvfp4_rows,
        EXPERT_RANGE=False, B_SHUFFLED=shuffled and packed, PDL=False, BLOCK_M=block[0],
        # a low-rank update's K-step (an adapter's) of this width, 0: none; wide: a stack's every adapter's columns,
        # ``group`` adapters a K-step
        UPDATE_K=update * (group if wide else 1), UPDATE_PRECISION="tf32",
        UPDATE_STACK=stack > 0, UPDATE_PARTS=stack if stack > 1 else 0, UPDATE_WIDE=wide,
        UPDATE_GROUP=group if wide else 0,
        BLOCK_N=block[1], BLOCK_K=block[2], GROUP_M=8,
        ALIGN_RATIO=1,  # rows aligned by the tile's own block_m
        SCALE_FOLD=fold and ptx and dtype == "bf16" and (weights is WeightFormat.MXFP4 or (
            weights is WeightFormat.NVFP4 and shuffled)),
        # unit strides, as the launcher's contiguous operands have them
        stride_ak=1, stride_bk=1, stride_bsk=1, stride_bzk=1, stride_cn=1, stride_bias_n=1, gate_stride=1,
        stride_csg=1, stride_ask=1, stride_ubk=1)
    missing = {p.name for p in moe_gemm_kernel.params if p.is_constexpr} - set(constexprs)
    if missing:
        raise SystemExit(f"sass_loop.py does not set the kernel's constexprs {sorted(missing)}: update it")
    multiple_of_16 = {"N", "K", "stride_am", "stride_be", "stride_bn", "stride_bse", "stride_bsn", "stride_cm",
                      "up_offset", "stride_bias_e", "stride_csm", "stride_bze", "stride_bzn", "stride_asm", "stride_um",
                      "stride_ubs", "stride_ube", "stride_ubn"}
    floats = ("a_global", "alpha", "limit", "update_scale")
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats else "i32")
                 for n in names}
    if update % 16 == 0:  # a rank the JIT sees divisible by 16 (16, 32, 64): as a launch with it specialises
        multiple_of_16.add("update_width")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in constexprs and (n.endswith("_ptr") or n in multiple_of_16)}
    source = ASTSource(moe_gemm_kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(kernel: Any) -> tuple[str, str]:
    """``(sass, resource usage)`` of a compiled kernel, by the wheel's nvdisasm and cuobjdump."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    return sass, usage


def k_loop(sass: str) -> collections.Counter[str]:
    """Opcodes of the longest loop (from a label to the last backward branch to it): the K-loop."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:", line.strip())}
    best = (0, -1)
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and target.group(1) in labels and labels[target.group(1)] < i:
            if i - labels[target.group(1)] > best[1] - best[0]:
                best = (labels[target.group(1)], i)
    found: collections.Counter[str] = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        match = _INSTRUCTION.match(line)
        if match:
            found[match.group(1).split(".")[0]] += 1
    return found


# Instructions without a general-register destination (stores, barriers, branches, the MMAs themselves, predicate
# and uniform-register writes), by their opcode's first part.
_NO_REGISTER_WRITE = {"ST", "STS", "STG", "STL", "RED", "REDG", "BAR", "BRA", "WARPGROUP", "HGMMA", "QGMMA", "IGMMA",
                      "DEPBAR", "LDGDEPBAR", "LDGSTS", "NOP", "EXIT", "RET", "ISETP", "FSETP", "HSETP2", "DSETP",
                      "PLOP3", "R2P", "R2UR", "S2UR", "WARPSYNC", "MEMBAR", "FENCE", "CCTL", "SYNCS", "ERRBAR", "CALL",
                      "YIELD", "BSYNC", "BSSY", "UTMALDG", "UTMASTG", "UTMACCTL", "UTMAPF"}
_OPERATION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


def _written(opcode: str, operands: str) -> range:
    """The general registers an instruction writes (its first operand, 1, 2 or 4 wide)."""
    base = opcode.split(".")[0]
    first = re.match(r"R(\d+)\b", operands.strip())
    if base in _NO_REGISTER_WRITE or base.startswith("U") or first is None:
        return range(0)
    width = 4 if ".128" in opcode or base == "HMMA" or (base == "LDSM" and ".4" in opcode) else \
        2 if ".64" in opcode or opcode.startswith("IMAD.WIDE") or (base == "LDSM" and ".2" in opcode) else 1
    return range(int(first.group(1)), int(first.group(1)) + width)


def register_hazards(sass: str, rounds: int = 3) -> list[str]:
    """The instructions of the innermost loops of ``sass`` (nvdisasm's listing) that write a register an MMA of a
    warpgroup (``HGMMA`` / ``QGMMA`` / ``IGMMA``) still in flight reads: its left operand ``R<n> .. R<n + 3>`` when it
    takes that operand from registers. Such an MMA reads the registers asynchronously, until a ``WARPGROUP.DEPBAR``
    retires its group, so the write may land before the read. Each loop is run ``rounds`` times in order (an MMA
    without ``gsb0`` joins the group the next one with ``gsb0`` closes; ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves the
    last ``N`` groups in flight). One line per distinct instruction and register."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:", line.strip())}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i and re.search(r"[HQI]GMMA", "\n".join(
                lines[labels[target.group(1)]:i])):
            loops.append((labels[target.group(1)], i))
    innermost = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    found: list[str] = []
    for first, last in innermost:
        body = [(m.group(1), m.group(2), line.strip()) for line in lines[first:last + 1]
                if (m := _OPERATION.search(line))]
        in_flight: list[set[int]] = []
        group: set[int] = set()
        for _ in range(rounds):
            for opcode, operands, text in body:
                if re.match(r"[HQI]GMMA", opcode):
                    left = operands.split(",")[1].strip()
                    if left.startswith("R"):
                        group |= set(range(int(left[1:]), int(left[1:]) + 4))
                    if "gsb0" in operands:
                        in_flight.append(group)
                        group = set()
                elif opcode.startswith("WARPGROUP.DEPBAR"):
                    keep = int(operands.rsplit("0x", 1)[1], 16)
                    in_flight = in_flight[len(in_flight) - keep:] if keep else []
                else:
                    for register in _written(opcode, operands):
                        if register in group or any(register in g for g in in_flight):
                            hazard = f"R{register}: {text}"
                            if hazard not in found:
                                found.append(hazard)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="mxfp4", choices=sorted(FORMATS))
    parser.add_argument("--glu", action="store_true", help="the gate/up GEMM (two weight tiles per step)")
    parser.add_argument("--block", default="16,128,64", help="BLOCK_M,BLOCK_N,BLOCK_K")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--rows", default="float", choices=("float", "nvfp4"),
                        help="the rows: in --dtype, or NVFP4 decoded to --dtype in the K-loop")
    parser.add_argument("--swap", action="store_true")
    parser.add_argument("--portable", action="store_true", help="the portable decoding instead of the packed one")
    parser.add_argument("--prefetch", action="store_true", help="4-bit scales loaded one K-step ahead")
    parser.add_argument("--tile-scale", action="store_true", help="fp8-block: one weight scale per tile and step")
    parser.add_argument("--fold", action="store_true",
                        help="bf16: the x 2**126 folded into the scales (mxfp4: E8M0 codes all <= 128; nvfp4: shuffled "
                             "only, as the launcher folds)")
    parser.add_argument("--half-tail", action="store_true",
                        help="with the half-height tile for the experts' last blocks (GemmConfig.half_tail)")
    parser.add_argument("--grid", type=int, default=0, choices=(0, 1, 2),
                        help="0 one program per tile, 1 persistent, 2 flattened")
    parser.add_argument("--shuffled", action="store_true", help="4-bit weights in the pre-shuffled layout")
    parser.add_argument("--drain", type=int, default=None, choices=(0, 1),
                        help="the kernel's DRAIN_MMA (default: the launcher's rule for sm_90 and this Triton)")
    parser.add_argument("--hazards", action="store_true",
                        help="list the registers written while a warpgroup MMA still reads them")
    parser.add_argument("--tma", action="store_true",
                        help="float weights: the weight tiles by TMA through a descriptor (B_TMA 1), as the launcher "
                             "copies them on Hopper")
    parser.add_argument("--update", type=int, default=0,
                        help="with a low-rank update (an adapter's) of this rank: its K-step after the loop")
    parser.add_argument("--wide", type=int, default=0,
                        help="with --update: a stack's update in every adapter's columns (UPDATE_WIDE: 1, the rank the width)")
    parser.add_argument("--group", type=int, default=4,
                        help="with --wide: adapters a K-step of the update (UPDATE_GROUP; the launcher's for 8 rank-16 adapters)")
    parser.add_argument("--stack", type=int, default=0,
                        help="with --update: a stack's update, each copy its adapter's K-step, its rows in this many "
                             "fp32 parts (1: as given)")
    parser.add_argument("--dump", default=None, help="write the SASS here")
    args = parser.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    if len(block) != 3:
        raise SystemExit("--block takes BLOCK_M,BLOCK_N,BLOCK_K")
    kernel = compile_kernel(FORMATS[args.weights], glu=args.glu, block=block, warps=args.warps,  # type: ignore[arg-type]
                            stages=args.stages, dtype=args.dtype, swap=args.swap, ptx=not args.portable,
                            prefetch=args.prefetch, tile_scale=args.tile_scale, fold=args.fold,
                            half_tail=args.half_tail, persistent=args.grid, shuffled=args.shuffled,
                            nvfp4_rows=args.rows == "nvfp4", drain=None if args.drain is None else bool(args.drain),
                            update=args.update, wide=args.wide, group=args.group, tma=args.tma, stack=args.stack)
    sass, usage = disassemble(kernel)
    if args.dump:
        Path(args.dump).write_text(sass)
    loop = k_loop(sass)
    print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|LOCAL:\d+)", usage)), f"shared {kernel.metadata.shared} B")
    print(f"K-loop: {sum(loop.values())} instructions")
    print(", ".join(f"{op} {n}" for op, n in loop.most_common()))
    if args.hazards:
        hazards = register_hazards(sass)
        print(f"hazards: {len(hazards)}")
        for hazard in hazards:
            print("  " + hazard)


if __name__ == "__main__":
    main()
