"""The warp-specialised Gluon weight gradient (``moeforge/kernels/gluon_weight_grad.py``).

On CPU: it compiles for sm_90 down to machine code (Triton's ``ptxas``) in every partition layout it offers (the rows
gathered into expert order first, then loaded by TMA; each run's last step masked or not), within its shared-memory
bound; launches it does not take are
refused with the reason, and the flag then runs the Triton twin (``_weight_grad_kernel``) — a kernel choice, never
another result. On an sm_90 GPU: bit for bit the twin's
gradient with the same tiles (the same steps summed in the same order), over the batches users give — an idle expert,
every copy on one expert, one token, ``top_k`` = experts, runs of whole and partial steps (its operands compact, the
twin's with one padded) —
with one, two and all programs walking the tiles (the ring wrapping many times, the ping-pong partitions alternating),
and within bf16 of a float64 sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import attrs
import pytest
import torch

pytest.importorskip("triton")

from moeforge.kernels import align, gluon_weight_grad, weight_grad  # noqa: E402
from moeforge.kernels.weight_grad import WeightGradTiles, expert_weight_grad  # noqa: E402

GLUON = gluon_weight_grad.unavailable_reason() is None
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and GLUON

LAUNCHES = {  # the Gluon launches the tests run: (step rows, N tile, K tile, MMA warps, stages, ping-pong, TMA store)
    "ping-pong 128 x 128": (64, 128, 128, 4, 4, True, False),
    "one partition 128 x 128": (64, 128, 128, 4, 4, False, False),
    "one partition 128 x 256, 8 warps": (64, 128, 256, 8, 3, False, False),
    "one partition 256 x 128, 8 warps": (64, 256, 128, 8, 3, False, False),
    "ping-pong, 32-row steps": (32, 128, 128, 4, 4, True, False),
    "one partition, 32-row steps": (32, 128, 128, 4, 3, False, False),
    "ping-pong 128 x 128, stored by TMA": (64, 128, 128, 4, 4, True, True),
    "one partition 128 x 256, 8 warps, stored by TMA": (64, 128, 256, 8, 3, False, True),
}


def _tiles(launch: tuple[int, int, int, int, int, bool, bool]) -> WeightGradTiles:
    block_m, block_n, block_k, warps, stages, pingpong, tma_store = launch
    return WeightGradTiles(block_n, block_k, block_m, warps, stages, True, tma_store=tma_store, warp_specialized=True,
                           pingpong=pingpong)


COMPILED = [(launch, torch.bfloat16, False) for launch in LAUNCHES] + [
    ("ping-pong 128 x 128", torch.float16, False),  # (fp16 once: the dtype changes no partition)
    # each run's last step masked (both operands compact): the layouts the rule takes
    ("ping-pong 128 x 128", torch.bfloat16, True), ("ping-pong, 32-row steps", torch.bfloat16, True),
    ("ping-pong 128 x 128, stored by TMA", torch.bfloat16, True)]


_COMPILE = """
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
from ptx_barriers import barriers_overlapped
from moeforge.kernels import gluon_weight_grad
found = []
for block_m, block_n, block_k, warps, stages, pingpong, tma_store, dtype, mask_tail in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    kernel = gluon_weight_grad.compile_for_hopper(block_m, block_n, block_k, warps, stages, pingpong, dtype, dtype,
                                                  tma_store=tma_store, mask_tail=mask_tail)
    ptx = kernel.asm["ptx"]
    found.append(dict(shared=kernel.metadata.shared, wgmma="wgmma" in ptx,
                      tma_store="cp.async.bulk.tensor.2d.global.shared" in ptx,
                      overlapped=barriers_overlapped(ptx)[:2]))
print(json.dumps(found))
"""


@pytest.mark.skipif(not GLUON, reason=str(gluon_weight_grad.unavailable_reason()))
def test_it_compiles_for_hopper_within_its_shared_memory_bound() -> None:
    # In a process of its own, as the forward Gluon kernel's test: once a kernel has run in Triton's interpreter, the
    # interpreter's patches of triton.language stay in the process, and a Gluon compile after it failed (in CI, by
    # the order xdist gave the tests); and Triton's bindings report leaked objects at the exit of a process that
    # compiled Gluon.
    cases = [[*LAUNCHES[launch], str(dtype)[6:], mask_tail] for launch, dtype, mask_tail in COMPILED]
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=900, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == len(COMPILED)
    for (launch, dtype, _), kernel in zip(COMPILED, found):
        block_m, block_n, block_k, warps, stages, pingpong, tma_store = LAUNCHES[launch]
        assert gluon_weight_grad.tile_problem(block_m, block_n, block_k, warps, stages, pingpong) is None
        bound = gluon_weight_grad.shared_memory_bytes(block_m, block_n, block_k, stages, pingpong)
        assert bound <= gluon_weight_grad.gluon_gemm.SHARED_MEMORY_LIMIT, launch
        assert kernel["shared"] <= bound, (launch, dtype, kernel)
        assert kernel["wgmma"] and kernel["tma_store"] == tma_store, (launch, dtype, kernel)
        # no initialised barrier's bytes given to plain data (tests/ptx_barriers.py)
        assert not kernel["overlapped"], (launch, dtype, kernel)


@pytest.mark.parametrize("tiles, needle", [
    ((64, 128, 256, 8, 4, True), "ping-pong"),
    ((64, 128, 256, 4, 4, True), "ping-pong"),
    ((64, 256, 256, 8, 4, False), "shared memory"),
    ((16, 128, 128, 4, 4, False), "steps"),
    ((64, 128, 128, 4, 1, False), "stages"),
], ids=["ping-pong on 8 warps", "ping-pong tile too wide", "ring too large", "16-row steps", "one stage"])
def test_tiles_it_cannot_take_are_named(tiles: tuple[int, int, int, int, int, bool], needle: str) -> None:
    found = gluon_weight_grad.tile_problem(*tiles)
    assert found is not None and needle in found


def _case(tokens: int, k: int, experts: int, n: int, kdim: int, dtype: torch.dtype, device: str,
          only: Optional[int] = None, idle: tuple[int, ...] = (), seed: int = 5
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if only is not None:
        ids = torch.full((tokens, k), only, dtype=torch.int32)
    else:
        active = torch.tensor([e for e in range(experts) if e not in idle])
        ids = torch.stack([active[torch.randperm(len(active), generator=gen)[:k]] for _ in range(tokens)])
    rows = torch.randn(tokens, kdim, generator=gen).to(device, dtype)
    d_rows = torch.randn(tokens * k, n, generator=gen).to(device, dtype)
    return ids.to(torch.int32).to(device), rows, d_rows


def test_a_launch_it_does_not_take_runs_the_twin_with_the_same_bits() -> None:
    # on CPU (no sm_90) or with fp32 operands the Triton kernel with the same tiles serves, a bias or not; on an sm_90
    # GPU a bias no longer keeps the Gluon kernel off (its bias gradient is a launch of its own): the weight gradient's
    # bits are the twin's either way
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids, rows, d_rows = _case(9, 2, 4, 40, 24, torch.float16, device, idle=(1,))
    plan = align.align_block_size(ids, 4, 16)
    tiles = _tiles((16, 16, 32, 4, 2, True, False))
    for with_bias in (False, True):
        got = expert_weight_grad(d_rows, rows, 2, *plan, 4, 16, with_bias, tiles=tiles)
        want = expert_weight_grad(d_rows, rows, 2, *plan, 4, 16, with_bias,
                                  tiles=attrs.evolve(tiles, warp_specialized=False))
        assert torch.equal(got[0], want[0])
    found = gluon_weight_grad.operand_problem(d_rows.float(), rows.float(), got[0], 64, 128, 128, 4, 4, True)
    assert found is not None and "bf16" in found
    found = gluon_weight_grad.operand_problem(d_rows[:0], rows[:0], got[0], 64, 128, 128, 4, 4, True)
    assert found is not None and "no rows" in found


CASES = {  # (tokens, top_k, experts, N, K, only, idle)
    "spread, idle expert": (700, 2, 6, 392, 328, None, (4,)),
    "gradient rows padded (N > K)": (700, 2, 6, 328, 392, None, (4,)),
    "every copy on one expert": (300, 2, 4, 256, 256, 2, ()),
    "one token": (1, 2, 4, 256, 128, None, ()),
    "top_k = experts": (96, 3, 3, 128, 256, None, ()),
    "many tiles per program": (2000, 2, 16, 512, 384, None, (0, 9)),
    # at most COMPACT_UNTIL rows per expert: both operands compact, each run's last step masked in the kernel
    "short runs, compact": (120, 2, 6, 392, 328, None, (4,)),
    "short runs, compact, N > K": (120, 2, 6, 328, 392, None, (4,)),
    "short runs, many tiles per program": (500, 2, 16, 512, 384, None, (0, 9)),
}


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon this kernel was written for")
@pytest.mark.parametrize("programs", [None, 1, 3], ids=["a program per SM", "one program", "three programs"])
@pytest.mark.parametrize("launch", list(LAUNCHES), ids=list(LAUNCHES))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_it_stores_the_twins_bits(case: str, launch: str, programs: Optional[int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, k, experts, n, kdim, only, idle = CASES[case]
    ids, rows, d_rows = _case(tokens, k, experts, n, kdim, torch.bfloat16, "cuda", only, idle)
    plan = align.align_block_size(ids, experts, 128)
    tiles = _tiles(LAUNCHES[launch])
    if programs is not None:
        monkeypatch.setattr(gluon_weight_grad, "multiprocessors", lambda device: programs)
    got, _ = expert_weight_grad(d_rows, rows, k, *plan, experts, 128, False, torch.bfloat16, tiles=tiles)
    want, _ = expert_weight_grad(d_rows, rows, k, *plan, experts, 128, False, torch.bfloat16,
                                 tiles=attrs.evolve(tiles, warp_specialized=False, pingpong=False))
    assert torch.equal(got, want)
    for e in idle:
        assert not got[e].any()


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon this kernel was written for")
@pytest.mark.parametrize("launch", list(LAUNCHES), ids=list(LAUNCHES))
def test_it_equals_a_float64_sum_per_expert_in_bf16(launch: str) -> None:
    tokens, k, experts, n, kdim, only, idle = CASES["spread, idle expert"]
    ids, rows, d_rows = _case(tokens, k, experts, n, kdim, torch.bfloat16, "cuda", only, idle, seed=8)
    plan = align.align_block_size(ids, experts, 128)
    got, _ = expert_weight_grad(d_rows, rows, k, *plan, experts, 128, False, torch.float32,
                                tiles=_tiles(LAUNCHES[launch]))
    flat = ids.reshape(-1).long().cpu()
    for e in range(experts):
        chosen = (flat == e).nonzero().flatten()
        want = d_rows.cpu()[chosen].double().T @ rows.cpu()[chosen // k].double()
        torch.testing.assert_close(got[e].cpu().double(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon this kernel was written for")
@pytest.mark.parametrize("launch", ["ping-pong 128 x 128", "ping-pong, 32-row steps", "one partition 128 x 256, 8 warps"])
@pytest.mark.parametrize("case", ["spread, idle expert", "short runs, compact, N > K", "one token"])
def test_rows_in_slot_order_are_summed_in_place_with_the_twins_bits(case: str, launch: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows in slot order hold one row per copy, each expert's run unpadded: the kernel reads them where they are
    # (nothing gathered), masking each run's last step; the twin gathers the narrower operand padded; the copy-order
    # sum is the same too.
    from moeforge.kernels import slot_rows

    tokens, k, experts, n, kdim, only, idle = CASES[case]
    ids, rows, d_rows = _case(tokens, k, experts, n, kdim, torch.bfloat16, "cuda", only, idle)
    plan = align.align_block_size(ids, experts, 128)
    xs, _, slot_of, row_of_slot, runs = slot_rows.gather_slots(rows, None, *plan, k, experts, 128)
    d_xs = torch.empty_like(d_rows)
    d_xs[slot_of.long()] = d_rows
    tiles = _tiles(LAUNCHES[launch])
    gathers: list[int] = []
    gather = weight_grad.gather_expert_rows
    monkeypatch.setattr(weight_grad, "gather_expert_rows", lambda *a, **kw: gathers.append(1) or gather(*a, **kw))
    slot = dict(slot_copies=tokens * k, slot_runs=runs)
    got, _ = expert_weight_grad(d_xs, xs, 1, row_of_slot, plan[1], plan[2], experts, 128, False, torch.bfloat16,
                                tiles=tiles, **slot)
    assert not gathers
    twin, _ = expert_weight_grad(d_xs, xs, 1, row_of_slot, plan[1], plan[2], experts, 128, False, torch.bfloat16,
                                 tiles=attrs.evolve(tiles, warp_specialized=False, pingpong=False), **slot)
    copy_order, _ = expert_weight_grad(d_rows, rows, k, *plan, experts, 128, False, torch.bfloat16, tiles=tiles)
    assert torch.equal(got, twin) and torch.equal(got, copy_order)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon this kernel was written for")
@pytest.mark.parametrize("launch", ["ping-pong 128 x 128", "ping-pong, 32-row steps"])
def test_a_runs_last_step_takes_nothing_of_the_next_experts_rows(launch: str) -> None:
    # Both operands compact (short runs: at most COMPACT_UNTIL rows per expert): a run's last step brings the next
    # expert's first rows, whose x rows the kernel zeroes. Expert 1's rows hold values a thousand times the others':
    # experts 0 and 2 (runs of 35 and 3 rows, partial last steps) must equal a float64 sum of their own rows.
    gen = torch.Generator().manual_seed(17)
    ids = torch.tensor([0] * 35 + [1] * 20 + [2] * 3 + [3] * 1, dtype=torch.int32)[torch.randperm(59, generator=gen)]
    ids = ids.view(-1, 1).cuda()
    rows = torch.randn(59, 256, generator=gen).to("cuda", torch.bfloat16)
    d_rows = torch.randn(59, 128, generator=gen).to("cuda", torch.bfloat16)
    d_rows[ids.view(-1) == 1] *= 1000
    rows[ids.view(-1) == 1] *= 1000
    plan = align.align_block_size(ids, 4, 128)
    assert 59 <= weight_grad.COMPACT_UNTIL * 4  # (the compact operands)
    got, _ = expert_weight_grad(d_rows, rows, 1, *plan, 4, 128, False, torch.float32, tiles=_tiles(LAUNCHES[launch]))
    flat = ids.view(-1).cpu()
    for e in (0, 2):
        mine = (flat == e).nonzero().flatten()
        want = d_rows.cpu()[mine].double().T @ rows.cpu()[mine].double()
        torch.testing.assert_close(got[e].cpu().double(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and a Triton whose Gluon this kernel was written for")
def test_no_copies_give_zero_gradients() -> None:
    ids = torch.zeros(0, 2, dtype=torch.int32, device="cuda")
    plan = align.align_block_size(ids, 3, 128)
    d_rows = torch.zeros(0, 256, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(0, 128, device="cuda", dtype=torch.bfloat16)
    dw, _ = expert_weight_grad(d_rows, rows, 2, *plan, 3, 128, False, torch.bfloat16,
                               tiles=_tiles(LAUNCHES["ping-pong 128 x 128"]))
    assert dw.shape == (3, 256, 128) and not dw.any()


def test_tiles_that_would_cross_an_expert_or_overflow_shared_memory_are_stored_from_registers() -> None:
    # the TMA store sees dW as [E * N, K]: a tile past an expert's N rows would write the next expert's
    assert gluon_weight_grad.tma_store_problem(torch.empty(3, 384, 200, dtype=torch.bfloat16), 64, 128, 128, 4,
                                               True) is None
    found = gluon_weight_grad.tma_store_problem(torch.empty(3, 392, 200, dtype=torch.bfloat16), 64, 128, 128, 4, True)
    assert found is not None and "cross" in found
    found = gluon_weight_grad.tma_store_problem(torch.empty(3, 400, 384, dtype=torch.bfloat16)[:, :384], 64, 128,
                                                128, 4, True)
    assert found is not None and "contiguous" in found
    # fp32 tiles of two partitions beside four stages: over sm_90's 227 KB
    found = gluon_weight_grad.tma_store_problem(torch.empty(3, 384, 256, dtype=torch.float32), 64, 128, 128, 4, True)
    assert found is not None and "shared memory" in found
