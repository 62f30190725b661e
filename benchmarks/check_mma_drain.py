"""The register-operand wgmma race on one Hopper GPU, reproduced and closed: what ``launch_plan.drain_mma`` is for.

    OUT=/some/folder python benchmarks/check_mma_drain.py

With Triton < 3.9, a wgmma whose left operand comes from registers decoded in the K-loop (the swapped
4-bit product, the NVFP4 rows) is split into k16 MMAs that each wait only for all but the last n-1; the next K-step's
decoding / scale loads / addresses are given (by ptxas) the registers of MMAs still in flight -> wrong values, more
often where the tensor cores are busier (several programs per SM). The launcher's answer: launch_plan.drain_mma -> the
kernel's DRAIN_MMA (wgmma.wait_group 0 after each K-step).

Sections (each prints a VERDICT line; everything also goes to $OUT/fences.txt):
  A  environment (Triton, bundled ptxas, drain rule)
  B  fence 1 reproduced: Mixtral shuffled MXFP4 with the 3d9aaf4 tiles (gate_up 128x64x64 w4, down 128x128x64 w8,
     pointer loads) on one program per tile, drain off / on; persistent grid with 1x and 2x SMs programs, drain off /
     on. Every element against the plain weight's unswapped product (shared-memory operands). Plus the SASS hazard
     count of each launched kernel (benchmarks/sass_loop.register_hazards).
  C  fence 2 reproduced: NVFP4 rows x bf16 weights (GPT-OSS-like, E=32 k=4 H=I=2880, M=1024), tiles (64,128,64,4)
     gate_up and (128,256,64,8) down, persistent grid with half tiles, drain off / on, 10 runs, against the float
     GEMM on the decoded rows.
  D  cost of the drain: Mixtral mxfp4-shuffled table entries of this device at M = 8, 256, 1024 (drain off = main,
     drain on), and the 128-row entry on one program per tile with the drain.
  E  the new GPU tests, run by pytest with the drain off (should FAIL: they catch the bug) and on (should pass).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from moeforge.kernels import align, shuffle  # noqa: E402
from moeforge.kernels import launch_plan  # noqa: E402
from moeforge.kernels import moe_gemm as mg  # noqa: E402
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig  # noqa: E402
from moeforge.kernels.formats import RowFormat, WeightFormat  # noqa: E402
from moeforge.quant.fp4 import dequantize_nvfp4, quantize_nvfp4  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
OUT.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "fences.txt", "w")
START = time.time()
DEV = torch.device("cuda")


def say(*parts: object) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


spec = importlib.util.spec_from_file_location("sass_loop", ROOT / "benchmarks" / "sass_loop.py")
sass_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loop)

REAL_DRAIN = launch_plan.drain_mma
REAL_SMS = mg.multiprocessors


def set_drain(on: bool) -> None:
    launch_plan.drain_mma = REAL_DRAIN if on else (lambda *a, **k: False)


def set_sms(factor: int) -> None:
    mg.multiprocessors = lambda d: factor * REAL_SMS(d)


def kernels() -> dict:
    cache = mg.moe_gemm_kernel.device_caches[torch.cuda.current_device()][0]
    return dict(cache)


def new_hazards(before: dict) -> str:
    out = []
    for key, k in kernels().items():
        if key in before:
            continue
        try:
            sass, _ = sass_loop.disassemble(k)
            out.append(str(len(sass_loop.register_hazards(sass))))
        except Exception as e:  # noqa: BLE001
            out.append(f"? ({type(e).__name__})")
    return ",".join(out) if out else "cached"


def bad_count(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    o, r = out.float(), ref.float()
    diff = (o - r).abs()
    bound = 0.02 * r.abs() + 0.02 * r.pow(2).mean().sqrt()
    bad = (~torch.isfinite(o)) | (diff > bound)
    worst = float(diff[torch.isfinite(diff)].max()) if torch.isfinite(diff).any() else float("inf")
    return int(bad.sum()), (float("inf") if not torch.isfinite(o).all() else worst)


def repeated(run, ref: torch.Tensor, times: int) -> tuple[int, int, float, str]:
    """``run()`` ``times`` times against ``ref``: (bad runs, bad elements, worst |diff|, SASS hazards of the kernels
    the first run compiled)."""
    before = kernels()
    runs_bad, total, worst, hz = 0, 0, 0.0, None
    for _ in range(times):
        out = run()
        torch.cuda.synchronize()
        if hz is None:
            hz = new_hazards(before)
        n, w = bad_count(out, ref)
        runs_bad += n > 0
        total += n
        worst = max(worst, w)
    return runs_bad, total, worst, hz


# -- A --------------------------------------------------------------------------------------------
props = torch.cuda.get_device_properties(DEV)
ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ptxas_version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
say(f"A device {props.name} SMs {props.multi_processor_count} torch {torch.__version__} triton {triton.__version__} "
    f"ptxas {ptxas_version} RS_WGMMA_RACE {mg.RS_WGMMA_RACE} drain rule (9,0) swapped: "
    f"{REAL_DRAIN((9, 0), True, RowFormat.FLOAT, GemmConfig(128, 64, 64))}")

# -- B --------------------------------------------------------------------------------------------
say("\nB fence 1: Mixtral shuffled MXFP4 (E=8 H=4096 I=14336 k=2), 3d9aaf4 tiles, pointer loads")
E, H, I, K_TOP = 8, 4096, 14336, 2


def mixtral_weights() -> tuple[torch.Tensor, ...]:
    """Mixtral's MXFP4 gate/up and down weights (random codes, scales near 1), plain and shuffled, and scales."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    plain_gu = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=DEV, generator=gen)
    scale_gu = torch.randint(119, 125, (E, 2 * I, H // 32), dtype=torch.uint8, device=DEV, generator=gen)
    plain_dn = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=DEV, generator=gen)
    scale_dn = torch.randint(119, 125, (E, H, I // 32), dtype=torch.uint8, device=DEV, generator=gen)
    return (plain_gu, scale_gu, plain_dn, scale_dn, shuffle.shuffle(plain_gu, e2m1=True),
            shuffle.shuffle(plain_dn, e2m1=True))


plain_gu, scale_gu, plain_dn, scale_dn, shuf_gu, shuf_dn = mixtral_weights()


def mixtral_case(m: int, which: str, config: GemmConfig):
    g = torch.Generator(device=DEV).manual_seed(m)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:K_TOP] for _ in range(m)]).to(torch.int32)
    plan = align.align_block_size(ids, E, config.block_m)
    if which == "gate_up":
        a = torch.randn(m, H, device=DEV, dtype=torch.bfloat16, generator=g)
        common = dict(rows_per_a=K_TOP, glu=True, act=ACT_SILU, weight_scale=scale_gu, weight_format=WeightFormat.MXFP4,
                      weight_scale_max=128)
        n_out, plain, shuf = I, plain_gu, shuf_gu
    else:
        a = torch.randn(m * K_TOP, I, device=DEV, dtype=torch.bfloat16, generator=g)
        common = dict(rows_per_a=1, glu=False, weight_scale=scale_dn, weight_format=WeightFormat.MXFP4,
                      weight_scale_max=128)
        n_out, plain, shuf = H, plain_dn, shuf_dn
    copies = m * K_TOP
    ref = torch.empty(copies, n_out, device=DEV, dtype=torch.bfloat16)
    mg.moe_gemm(a, plain, ref, *plan, config=config, swap=False, tma=False, grid="tiles", **common)

    def run(**options):
        out = torch.full((copies, n_out), float("nan"), device=DEV, dtype=torch.bfloat16)
        mg.moe_gemm(a, shuf, out, *plan, config=config, swap=True, weight_shuffled=True, **common, **options)
        return out
    return ref, run


B_CASES = [(256, "down", GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=False)),
           (1024, "gate_up", GemmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=3, tma=False)),
           (1024, "down", GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=False))]
B_VARIANTS = [("tiles", False, 1), ("tiles", True, 1), ("persistent", False, 1), ("persistent", False, 2),
              ("persistent", True, 2)]
summary_b: dict = {}
for m, which, config in B_CASES:
    ref, run = mixtral_case(m, which, config)
    for grid, drain, factor in B_VARIANTS:
        set_drain(drain)
        set_sms(factor)
        runs_bad, total, worst, hz = repeated(lambda: run(grid=grid, tma=False), ref, 5)
        set_drain(True)
        set_sms(1)
        summary_b[(m, which, grid, drain, factor)] = runs_bad
        say(f"B M={m} {which} {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} grid={grid} "
            f"programs={factor}xSMs drain={'on' if drain else 'off'}: bad runs {runs_bad}/5, bad elements {total}, "
            f"worst |diff| {worst:.3g}, SASS hazards of the compiled kernel {hz}")
    del ref, run
    torch.cuda.empty_cache()
off_bad = sum(v for k, v in summary_b.items() if k[2] == "tiles" and not k[3])
on_bad = sum(v for k, v in summary_b.items() if k[3])
pers_2x = sum(v for k, v in summary_b.items() if k[2] == "persistent" and not k[3] and k[4] == 2)
pers_1x = sum(v for k, v in summary_b.items() if k[2] == "persistent" and not k[3] and k[4] == 1)
say(f"VERDICT B: fence 1 reproduced without the drain on one program per tile: {'YES' if off_bad else 'NO'} "
    f"({off_bad} bad runs); with the drain: {'CLEAN' if on_bad == 0 else f'STILL BAD ({on_bad} runs)'}; "
    f"persistent without the drain, 1x SMs: {pers_1x} bad runs, 2x SMs: {pers_2x} bad runs "
    f"({'the persistent fence only hid it' if pers_2x else 'no failure on persistent seen'})")
del plain_gu, scale_gu, plain_dn, scale_dn, shuf_gu, shuf_dn
torch.cuda.empty_cache()
say(f"(elapsed {time.time() - START:.0f} s)")

# -- C --------------------------------------------------------------------------------------------
say("\nC fence 2: NVFP4 rows x bf16 weights, GPT-OSS-like (E=32 k=4 H=I=2880, M=1024), persistent grid + half tiles")
E2, H2, K2, M2 = 32, 2880, 4, 1024
g = torch.Generator(device=DEV).manual_seed(1)
ids2 = torch.stack([torch.randperm(E2, device=DEV, generator=g)[:K2] for _ in range(M2)]).to(torch.int32)
a_global = 2.0 ** -9
bad_c_off = bad_c_on = 0
for tile, glu in (((64, 128, 64, 4), True), ((128, 256, 64, 8), False)):
    bm, bn, bk, w = tile
    config = GemmConfig(bm, bn, bk, group_m=8, num_warps=w, num_stages=3)
    plan = align.align_block_size(ids2, E2, bm)
    n_w = 2 * H2 if glu else H2
    weight = (torch.randn(E2, n_w, H2, device=DEV, generator=g) * H2 ** -0.5).to(torch.bfloat16)
    x = torch.randn(M2 if glu else M2 * K2, H2, device=DEV, generator=g)
    q = quantize_nvfp4(x, a_global)
    decoded = dequantize_nvfp4(q.data, q.scale, a_global, torch.bfloat16)
    rows_per_a = K2 if glu else 1
    common = dict(rows_per_a=rows_per_a, glu=glu, act=ACT_SILU if glu else 0)
    ref = torch.empty(M2 * K2, H2, device=DEV, dtype=torch.bfloat16)
    mg.moe_gemm(decoded, weight, ref, *plan, config=config, grid="tiles", **common)
    for grid, half, drain in (("persistent", True, False), ("persistent", True, True), ("tiles", True, False)):
        set_drain(drain)

        def nvfp4_rows(grid: str = grid, half: bool = half) -> torch.Tensor:
            out = torch.full_like(ref, float("nan"))
            mg.moe_gemm(q.data, weight, out, *plan, config=config, grid=grid, half_tail=half, a_scale=q.scale,
                        a_global=a_global, **common)
            return out
        runs_bad, total, worst, hz = repeated(nvfp4_rows, ref, 10)
        set_drain(True)
        if grid == "persistent":
            if drain:
                bad_c_on += runs_bad
            else:
                bad_c_off += runs_bad
        say(f"C {'gate_up' if glu else 'down'} {bm}x{bn}x{bk} w{w} grid={grid} half_tail={half} "
            f"drain={'on' if drain else 'off'}: bad runs {runs_bad}/10, bad elements {total}, worst {worst:.3g}, "
            f"SASS hazards {hz}")
    del weight, x, q, decoded, ref
    torch.cuda.empty_cache()
say(f"VERDICT C: fence 2 reproduced without the drain (persistent + half tiles): {'YES' if bad_c_off else 'NO'} "
    f"({bad_c_off} bad runs); with the drain: {'CLEAN' if bad_c_on == 0 else f'STILL BAD ({bad_c_on})'}")
say(f"(elapsed {time.time() - START:.0f} s)")

# -- D --------------------------------------------------------------------------------------------
say("\nD cost of the drain: this device's Mixtral mxfp4-shuffled table entries (median us, 3 rounds x 20)")
table = ConfigTable.load(props.name, E, K_TOP, H, I, "bf16", weight_format="mxfp4-shuffled")
plain_gu, scale_gu, plain_dn, scale_dn, shuf_gu, shuf_dn = mixtral_weights()
del plain_gu, plain_dn


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000 for s, e in zip(start, end))


for m in (8, 256, 1024):
    if time.time() - START > 200:
        say("D skipped the rest (time)")
        break
    entry = table.lookup(m)
    gi = torch.Generator(device=DEV).manual_seed(m)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=gi)[:K_TOP] for _ in range(m)]).to(torch.int32)
    for which, config in (("gate_up", entry.gate_up), ("down", entry.down)):
        plan = align.align_block_size(ids, E, config.block_m)
        if which == "gate_up":
            a = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(m * K_TOP, I, device=DEV, dtype=torch.bfloat16)
            args = dict(rows_per_a=K_TOP, glu=True, act=ACT_SILU, weight_scale=scale_gu, weight=shuf_gu)
        else:
            a = torch.randn(m * K_TOP, I, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(m * K_TOP, H, device=DEV, dtype=torch.bfloat16)
            args = dict(rows_per_a=1, glu=False, weight_scale=scale_dn, weight=shuf_dn)
        weight = args.pop("weight")

        def call(**extra):
            return lambda: mg.moe_gemm(a, weight, out, *plan, config=config, weight_format=WeightFormat.MXFP4,
                                       weight_scale_max=128, weight_shuffled=True, **args, **extra)
        variants = [("main (no drain)", False, {}), ("drain", True, {})]
        if config.block_m >= 128:
            variants.append(("drain, one program per tile", True, dict(grid="tiles")))
        times: dict = {name: [] for name, _, _ in variants}
        for _ in range(3):
            for name, drain, extra in variants:
                set_drain(drain)
                times[name].append(timed(call(**extra)))
                set_drain(True)
        base = statistics.median(times["main (no drain)"])
        say(f"D M={m} {which} {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} "
            f"split={config.split_k} tma={config.tma}: " + ", ".join(
                f"{name} {statistics.median(v):.1f} us ({statistics.median(v) / base:.3f}x)" for name, v in times.items()))
say(f"(elapsed {time.time() - START:.0f} s)")
del shuf_gu, shuf_dn, scale_gu, scale_dn
torch.cuda.empty_cache()

# -- E --------------------------------------------------------------------------------------------
say("\nE the new GPU tests with the drain off (expected: FAIL) and on (expected: pass)")
SELECT = ["tests/test_mma_drain_gpu.py"]
for drain in (False, True):
    if time.time() - START > 225:
        say("E skipped (time)")
        break
    code = ("import sys, pytest; import moeforge.kernels.launch_plan as m\n"
            + ("" if drain else "m.drain_mma = lambda *a, **k: False\n")
            + f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{SELECT!r}]))")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = [line for line in r.stdout.splitlines() if "passed" in line or "failed" in line or "FAILED" in line]
    say(f"E drain={'on' if drain else 'off'}: exit {r.returncode}: " + " | ".join(tail[-4:]))
    say(f"VERDICT E{'2' if drain else '1'}: " + (("tests catch the bug" if r.returncode else "tests MISS the bug")
                                                  if not drain else ("tests pass" if r.returncode == 0 else "tests FAIL")))
say(f"done in {time.time() - START:.0f} s")
