"""The warp-specialised Gluon grouped GEMM (:mod:`moeforge.kernels.gluon_grouped_gemm`). On CPU: the kernel compiles
for sm_90 down to machine code with the installed Triton (Gluon has no interpreter; this catches a Gluon API that
moved). On a Hopper GPU: its output against float64 and against its Triton twin (``moe_gemm``, the same product on the
same plan) over the cases users reach — no rows, one token, an idle expert, every token on one expert, top-k equal to
the experts, K and N tails, aligned blocks larger than the tile — for the SwiGLU gate/up GEMM, the plain down GEMM
with routing weights and the weight read by its rows (the row gradient's product); outputs poisoned with NaN.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

pytest.importorskip("triton")

from moeforge.kernels import align, moe_gemm  # noqa: E402
from moeforge.kernels import gluon_grouped_gemm as gluon_gemm  # noqa: E402
from moeforge.kernels.config import GemmConfig  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402

import moeforge as mf  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
COMPILABLE = gluon_gemm.unavailable_reason() is None
# name: (tile, ping-pong MMA partitions)
CONFIGS = {"128x128x64, 4 stages, 8 warps": (GemmConfig(128, 128, 64, num_warps=8, num_stages=4), False),
           "64x128x64, 3 stages, 4 warps": (GemmConfig(64, 128, 64, num_warps=4, num_stages=3), False),
           "128x64x64, 4 stages, 8 warps": (GemmConfig(128, 64, 64, num_warps=8, num_stages=4), False),
           "ping-pong 64x128x64, 4 stages": (GemmConfig(64, 128, 64, num_warps=4, num_stages=4), True),
           "ping-pong 128x128x64, 4 stages": (GemmConfig(128, 128, 64, num_warps=4, num_stages=4), True)}


_COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[2])
from ptx_barriers import barriers_overlapped
from moeforge.kernels.config import GemmConfig
from moeforge.kernels.gluon_grouped_gemm import compile_for_hopper, shared_memory_bytes
found = []
for block_m, block_n, block_k, warps, stages, pingpong in json.loads(sys.argv[1]):
    layouts = ["plain", "gated", "weight rows reduced"][:: 2 if pingpong and block_m * block_n > 64 * 128 else 1]
    for layout in layouts:
        glu = layout == "gated"
        config = GemmConfig(block_m, block_n, block_k, num_warps=warps, num_stages=stages)
        kernel = compile_for_hopper(config, glu, mul_weights=not glu, pingpong=pingpong,
                                    weight_kn=layout == "weight rows reduced", out_fp32=layout == "weight rows reduced")
        ptx = kernel.asm["ptx"]
        found.append(dict(glu=glu, shared=kernel.metadata.shared, cubin=len(kernel.asm["cubin"]),
                          bound=shared_memory_bytes(config, glu, pingpong=pingpong),
                          parts=[part in ptx for part in ("wgmma.mma_async", "cp.async.mbarrier.arrive.noinc",
                                                          "setmaxnreg")], overlapped=barriers_overlapped(ptx)[:2]))
block_m, block_n, block_k, warps, stages, pingpong = json.loads(sys.argv[1])[0]
for glu in (False, True):  # the first configuration with a stack's update of rank 16: more K-steps through the ring
    config = GemmConfig(block_m, block_n, block_k, num_warps=warps, num_stages=stages)
    kernel = compile_for_hopper(config, glu, mul_weights=not glu, pingpong=pingpong, update_rank=16)
    ptx = kernel.asm["ptx"]
    found.append(dict(glu=glu, shared=kernel.metadata.shared, cubin=len(kernel.asm["cubin"]),
                      bound=shared_memory_bytes(config, glu, pingpong=pingpong),
                      parts=[part in ptx for part in ("wgmma.mma_async", "cp.async.mbarrier.arrive.noinc",
                                                      "setmaxnreg")], overlapped=barriers_overlapped(ptx)[:2]))
print(json.dumps(found))
"""


@pytest.mark.skipif(not COMPILABLE, reason=gluon_gemm.unavailable_reason() or "")
def test_the_kernel_compiles_for_hopper() -> None:
    # In a process of its own: Triton's bindings report leaked objects on the stderr of a process that compiled
    # Gluon, at its exit.
    configs = [[c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, pingpong]
               for c, pingpong in CONFIGS.values()]
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 3 * len(CONFIGS) - 1 + 2  # (no gated 128 x 128 ping-pong; two with an update)
    for kernel in found:  # warpgroup MMAs, the loader's row copies arriving on the barrier, the partitions' registers
        assert all(kernel["parts"]) and kernel["cubin"] > 0, kernel
        assert kernel["shared"] <= min(227 * 1024, kernel["bound"]), kernel  # (the selector's bound holds)
        # no initialised barrier's bytes given to plain data (tests/ptx_barriers.py): the wrong rows under load
        assert not kernel["overlapped"], kernel


def _case(tokens: int, experts: int, top_k: int, hidden: int, n_out: int, glu: bool, dtype: torch.dtype,
          gen: torch.Generator, route: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    w = (torch.randn(experts, 2 * n_out if glu else n_out, hidden, generator=gen) * hidden ** -0.5).to("cuda", dtype)
    if route is None:
        route = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
            torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens * top_k, generator=gen).to("cuda")
    return x, w, route.to("cuda", torch.int32).reshape(tokens, top_k), weights


def _reference(x: torch.Tensor, w: torch.Tensor, route: torch.Tensor, weights: torch.Tensor, glu: bool,
               rows_per_a: int) -> torch.Tensor:
    flat = route.reshape(-1).long()
    copies = torch.arange(flat.numel(), device=x.device)
    pre = torch.einsum("ch,cnh->cn", x.double()[copies // rows_per_a], w.double()[flat])
    if glu:
        gate, up = pre.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return pre * weights.double()[:, None]


CASES = {  # tokens, experts, top_k, hidden, n_out, a fixed routing
    "many tokens": (300, 8, 2, 512, 384, None),
    "no rows": (0, 4, 2, 256, 128, None),
    "one token": (1, 8, 2, 256, 128, None),
    "an idle expert": (40, 4, 1, 256, 128, torch.tensor([[0], [1], [3]] * 13 + [[0]])),
    "every token on one expert": (70, 6, 1, 256, 128, torch.full((70, 1), 2)),
    "top-k = experts": (33, 4, 4, 256, 128, None),
    "K and N tails": (50, 4, 2, 208, 72, None),
}


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("glu", [False, True], ids=["down", "swiglu gate/up"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_kernel_equals_float64_and_its_triton_twin(config: str, case: str, glu: bool, dtype: torch.dtype) -> None:
    gemm, pingpong = CONFIGS[config]
    if glu and pingpong and gemm.block_m * gemm.block_n > 64 * 128:
        pytest.skip("a ping-pong partition holds gate and up accumulators of at most 64 x 128")
    tokens, experts, top_k, hidden, n_out, route = CASES[case]
    gen = torch.Generator().manual_seed(len(case) + glu)
    x, w, route, weights = _case(tokens, experts, top_k, hidden, n_out, glu, dtype, gen, route)
    aligned = 128  # the plan's blocks; a 64-row tile takes half a block
    rows_per_a = top_k if glu else 1
    a = x if glu else torch.randn(tokens * top_k, hidden, generator=gen).to("cuda", dtype)
    plan = align.align_block_size(route, experts, aligned)
    out = torch.full((tokens * top_k, n_out), float("nan"), dtype=dtype, device="cuda")
    # (a grid of 3 programs: each walks several tiles, ping-pong consumers take turns)
    gluon_gemm.ws_grouped_gemm(a, w, out, *plan, rows_per_a=rows_per_a, config=gemm, glu=glu,
                               topk_weights=None if glu else weights, aligned_block_m=aligned, pingpong=pingpong,
                               programs=3 if case == "many tokens" else None)
    twin = torch.full_like(out, float("nan"))
    moe_gemm.moe_gemm(a, w, twin, *plan, rows_per_a=rows_per_a, config=GemmConfig(64, 64, 64, num_warps=4),
                      topk_weights=None if glu else weights, act=act_code(mf.ActivationConfig()) if glu else 0,
                      glu=glu, aligned_block_m=aligned)
    if tokens == 0:
        return
    want = _reference(a, w, route, weights, glu, rows_per_a)
    assert not out.isnan().any(), "a row was not written"
    scale = want.norm()
    tolerance = 1e-2 if dtype is torch.bfloat16 else 2e-3
    assert float((out.double() - want).norm() / scale) < tolerance
    assert float((out.double() - twin.double()).norm() / scale) < tolerance


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rank, stack", [(16, 8), (16, 3), (32, 5), (64, 1)])
@pytest.mark.parametrize("glu", [False, True], ids=["down", "swiglu gate/up"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_stacks_update_in_every_adapters_columns_equals_float64_and_the_twin(config: str, case: str, glu: bool,
                                                                                 rank: int, stack: int) -> None:
    # a served stack's update (rows [copies, S·R] weighed, B [S, E, N_w, R]) as more K-steps through the ring, against
    # the Triton twin's (moe_gemm's UPDATE_WIDE) and float64
    gemm, pingpong = CONFIGS[config]
    if glu and pingpong and gemm.block_m * gemm.block_n > 64 * 128:
        pytest.skip("a ping-pong partition holds gate and up accumulators of at most 64 x 128")
    tokens, experts, top_k, hidden, n_out, route = CASES[case]
    gen = torch.Generator().manual_seed(len(case) + glu + rank + stack)
    x, w, route, weights = _case(tokens, experts, top_k, hidden, n_out, glu, torch.bfloat16, gen, route)
    aligned, rows_per_a = 128, top_k if glu else 1
    a = x if glu else torch.randn(tokens * top_k, hidden, generator=gen).to("cuda", torch.bfloat16)
    u = (torch.randn(tokens * top_k, stack * rank, generator=gen) * 0.3).to("cuda", torch.bfloat16)
    b = (torch.randn(stack, experts, w.shape[1], rank, generator=gen) * 0.3).to("cuda", torch.bfloat16)
    plan = align.align_block_size(route, experts, aligned)
    out = torch.full((tokens * top_k, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    gluon_gemm.ws_grouped_gemm(a, w, out, *plan, rows_per_a=rows_per_a, config=gemm, glu=glu,
                               topk_weights=None if glu else weights, aligned_block_m=aligned, pingpong=pingpong,
                               programs=3 if case == "many tokens" else None, update=(u, b))
    twin = torch.full_like(out, float("nan"))
    moe_gemm.moe_gemm(a, w, twin, *plan, rows_per_a=rows_per_a, config=GemmConfig(64, 64, 64, num_warps=4),
                      topk_weights=None if glu else weights, act=act_code(mf.ActivationConfig()) if glu else 0,
                      glu=glu, aligned_block_m=aligned, update_rows=u, update_weight=b)
    if tokens == 0:
        return
    flat = route.reshape(-1).long()
    copies = torch.arange(flat.numel(), device="cuda")
    wide = b.double().permute(1, 2, 0, 3).reshape(experts, w.shape[1], stack * rank)  # [E, N_w, S·R]
    pre = (torch.einsum("ch,cnh->cn", a.double()[copies // rows_per_a], w.double()[flat])
           + torch.einsum("cr,cnr->cn", u.double(), wide[flat]))
    if glu:
        gate, up = pre.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    else:
        want = pre * weights.double()[:, None]
    assert not out.isnan().any(), "a row was not written"
    scale = want.norm()
    assert float((out.double() - want).norm() / scale) < 1e-2
    assert float((out.double() - twin.double()).norm() / scale) < 1e-2


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_weight_read_by_its_rows_is_the_row_gradients_product(config: str, case: str,
                                                                   out_dtype: torch.dtype) -> None:
    # weight_kn: out[c] = a[c] @ W[e] for W [E, K, N] (the stored [E, N_w, K] weight read this way is d_pre @ W), in
    # the rows' dtype or fp32 (a row gradient whose copies are summed afterwards).
    gemm, pingpong = CONFIGS[config]
    tokens, experts, top_k, hidden, n_out, route = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    _, _, route, _ = _case(tokens, experts, top_k, hidden, n_out, False, torch.bfloat16, gen, route)
    w = (torch.randn(experts, hidden, n_out, generator=gen) * hidden ** -0.5).to("cuda", torch.bfloat16)
    a = torch.randn(tokens * top_k, hidden, generator=gen).to("cuda", torch.bfloat16)
    plan = align.align_block_size(route, experts, 128)
    out = torch.full((tokens * top_k, n_out), float("nan"), dtype=out_dtype, device="cuda")
    gluon_gemm.ws_grouped_gemm(a, w, out, *plan, rows_per_a=1, config=gemm, aligned_block_m=128, pingpong=pingpong,
                               weight_kn=True)
    twin = torch.full_like(out, float("nan"))
    moe_gemm.moe_gemm(a, w.transpose(1, 2), twin, *plan, rows_per_a=1, config=GemmConfig(64, 64, 64, num_warps=4),
                      aligned_block_m=128)
    if tokens == 0:
        return
    want = torch.einsum("ck,ckn->cn", a.double(), w.double()[route.reshape(-1).long()])
    assert not out.isnan().any(), "a row was not written"
    tolerance = 1e-2 if out_dtype is torch.bfloat16 else 1e-5  # (fp32 out: the sums of bf16 products, unrounded)
    assert float((out.double() - want).norm() / want.norm()) < tolerance
    assert float((out.double() - twin.double()).norm() / want.norm()) < 1e-2


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", ["128x128x64, 4 stages, 8 warps", "ping-pong 64x128x64, 4 stages"])
def test_the_kernel_is_deterministic_and_any_grid_or_store_gives_the_same_rows(config: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x, w, route, _ = _case(500, 16, 4, 1024, 512, True, torch.bfloat16, gen)
    plan = align.align_block_size(route, 16, 128)
    gemm, pingpong = CONFIGS[config]
    outs = []
    for programs, coalesced in ((None, True), (None, True), (7, True), (1, True), (None, False)):
        out = torch.empty(500 * 4, 512, dtype=torch.bfloat16, device="cuda")
        gluon_gemm.ws_grouped_gemm(x, w, out, *plan, rows_per_a=4, config=gemm, glu=True, programs=programs,
                                   pingpong=pingpong, coalesced_store=coalesced, aligned_block_m=128)
        outs.append(out)
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


def test_operands_it_does_not_take_are_refused_by_name() -> None:
    if not COMPILABLE:
        pytest.skip(gluon_gemm.unavailable_reason() or "")
    config = CONFIGS["128x128x64, 4 stages, 8 warps"][0]
    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    out = torch.zeros(8, 32, dtype=torch.bfloat16)
    cases = [((a.float(), w, out, False, 128), "bf16 / fp16"),
             ((a, w[:, :, :32].contiguous(), out, False, 128), "rows must be"),
             ((a, w.transpose(1, 2), out, False, 128), "contiguous"), ((a, w, out[:, :16], False, 128), "out must"),
             ((a, w, out, True, 128), "out must"), ((a, w, out, False, 64), "must divide"),
             ((a[:, :8].contiguous(), w[:, :, :8].contiguous(), out, False, 128), "multiples of 16"),
             ((torch.zeros(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64), w, out, False, 128), "16-byte aligned"),
             ((a, w, torch.zeros(8, 36, dtype=torch.bfloat16)[:, :32], False, 128), "16-byte aligned")]
    with pytest.raises(ValueError, match="weight_kn=False"):
        gluon_gemm.check_operands(a, w, out, config, True, 128, weight_kn=True)
    with pytest.raises(ValueError, match=r"rows must be \[rows, K=32\]"):  # [E, K, N]: K is the middle size
        gluon_gemm.check_operands(a, w, out, config, False, 128, weight_kn=True)
    for (rows, weight, output, glu, aligned), words in cases:
        with pytest.raises(ValueError, match=words):
            gluon_gemm.check_operands(rows, weight, output, config, glu, aligned)
    # the plan's block table: one entry per block of its slots, the last block possibly partial
    slots, empty_out = torch.zeros(200, dtype=torch.int32), out[:0]
    gluon_gemm.ws_grouped_gemm(a, w, empty_out, slots, torch.zeros(2, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), rows_per_a=2, config=config)
    with pytest.raises(ValueError, match="block_expert has 1 entries for 200 slots"):
        gluon_gemm.ws_grouped_gemm(a, w, empty_out, slots, torch.zeros(1, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), rows_per_a=2, config=config)
    plan = (torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    for tile, glu, words in ((config, False, "num_warps=4"), (CONFIGS["ping-pong 128x128x64, 4 stages"][0], True,
                                                                "at most 64 x 128")):
        with pytest.raises(ValueError, match=words):
            gluon_gemm.ws_grouped_gemm(a, torch.zeros(2, 64 if glu else 32, 64, dtype=torch.bfloat16), out, *plan,
                                       rows_per_a=2, config=tile, glu=glu, pingpong=True)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_random_launches_equal_float64() -> None:
    """Hypothesis over the kernel's launches: experts, top-k, tokens (none to several tiles a program), K and N (any
    multiples of 16 and 8, tails included), the tile, the grid, the store, gated or plain (with routing weights,
    or the weight read by its rows), bf16 or fp16, against the float64 product; outputs poisoned with NaN."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(data=st.data())
    def check(data: st.DataObject) -> None:
        draw = data.draw
        name = draw(st.sampled_from(sorted(CONFIGS)))
        gemm, pingpong = CONFIGS[name]
        layout = draw(st.sampled_from(["gated", "plain", "weight rows"]))
        glu = layout == "gated"
        if glu and pingpong and gemm.block_m * gemm.block_n > 64 * 128:
            glu, layout = False, "plain"
        experts = draw(st.integers(1, 12))
        top_k = draw(st.integers(1, min(experts, 6)))
        tokens = draw(st.integers(0, 400))
        k_dim = 16 * draw(st.integers(1, 24))
        n_out = 8 * draw(st.integers(1, 40))
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
        programs = draw(st.sampled_from([None, 1, 3, 17]))
        coalesced = draw(st.booleans())
        seed = draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        route = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens \
            else torch.empty(0, top_k, dtype=torch.int64)
        route = route.to("cuda", torch.int32)
        rows_per_a = top_k if glu else 1
        a = torch.randn(tokens * top_k // rows_per_a, k_dim, generator=gen).to("cuda", dtype)
        n_w = 2 * n_out if glu else n_out
        shape = (experts, k_dim, n_w) if layout == "weight rows" else (experts, n_w, k_dim)
        w = (torch.randn(*shape, generator=gen) * k_dim ** -0.5).to("cuda", dtype)
        weights = torch.rand(tokens * top_k, generator=gen).to("cuda") if layout == "plain" else None
        plan = align.align_block_size(route, experts, 128)
        out = torch.full((tokens * top_k, n_out), float("nan"), dtype=dtype, device="cuda")
        gluon_gemm.ws_grouped_gemm(a, w, out, *plan, rows_per_a=rows_per_a, config=gemm, glu=glu,
                                   topk_weights=weights, aligned_block_m=128, programs=programs, pingpong=pingpong,
                                   coalesced_store=coalesced, weight_kn=layout == "weight rows")
        if tokens == 0:
            return
        flat = route.reshape(-1).long()
        copies = torch.arange(flat.numel(), device="cuda")
        product = w.double()[flat] if layout == "weight rows" else w.double()[flat].transpose(1, 2)
        pre = torch.einsum("ck,ckn->cn", a.double()[copies // rows_per_a], product)
        if glu:
            gate, up = pre.chunk(2, dim=-1)
            pre = torch.nn.functional.silu(gate) * up
        if weights is not None:
            pre = pre * weights.double()[:, None]
        assert not out.isnan().any(), ("a row was not written", name, layout, experts, top_k, tokens, k_dim, n_out)
        error = float((out.double() - pre).norm() / pre.norm().clamp(min=1e-30))
        assert error < (1e-2 if dtype is torch.bfloat16 else 2e-3), (error, name, layout, k_dim, n_out)

    check()


def test_a_triton_whose_gluon_moved_is_named_not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    if not COMPILABLE:
        pytest.skip(gluon_gemm.unavailable_reason() or "")
    assert gluon_gemm._api_problem() is None  # (the installed Triton: 3.6 on the GPU machine, 3.9 in CI)
    monkeypatch.delattr(gluon_gemm.mbarrier, "expect")
    assert "has no mbarrier.expect, which this kernel calls" in (gluon_gemm._api_problem() or "")
    monkeypatch.undo()

    def reshaped(functions, default_args, worker_num_warps=None):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(gluon_gemm.gl, "warp_specialize", reshaped)
    assert "gl.warp_specialize takes ['functions', 'default_args', 'worker_num_warps']" in (
        gluon_gemm._api_problem() or "")
