"""The launchers' memo of launch recipes (moeforge.kernels.launch_memo) and the bound launches they keep
(moeforge.kernels.bound_launch).

A recipe is a pure function of the operands' metadata: a second launch with the same metadata reuses it and
computes the same bits as a launcher without the memo; anything the launch depends on — shapes, strides, dtypes,
an address's alignment, the options — makes another recipe; a bad launch is refused every time, never remembered.
On a GPU the bound launch goes through the compiled kernel's launcher from the second call on (the same bits as
the JIT's), and through the JIT where a launch hook is set or the current device is another; under Triton's
interpreter it always goes through the JIT.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moeforge.kernels.config import GemmConfig
from moeforge.kernels.launch_memo import LaunchMemo, tensor_key

triton = pytest.importorskip("triton")

from moeforge.kernels import align, combine, moe_gemm  # noqa: E402
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.bound_launch import BoundLaunch, specialization  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemmConfig(16, 16, 32, group_m=2, num_warps=1, num_stages=1)


def test_the_memo_keeps_at_most_its_capacity_dropping_the_oldest() -> None:
    memo: LaunchMemo[int] = LaunchMemo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    memo.put("c", 3)
    assert len(memo) == 2 and memo.get("a") is None and memo.get("b") == 2 and memo.get("c") == 3
    with pytest.raises(ValueError, match="at least one recipe"):
        LaunchMemo(0)


def test_a_tensor_key_holds_metadata_and_alignment_not_values() -> None:
    buffer = torch.randn(64, dtype=torch.float16)
    a, b = buffer[:32].view(4, 8), buffer[32:].view(4, 8)
    assert tensor_key(a) == tensor_key(b)  # 64 bytes apart: the same alignment, other values
    assert tensor_key(buffer[1:33].view(4, 8)) != tensor_key(a)  # 2 bytes off
    assert tensor_key(a.t()) != tensor_key(a) and tensor_key(a.float()) != tensor_key(a)
    assert tensor_key(None) is None


def test_the_specialisation_reads_dtypes_alignment_and_integers() -> None:
    x = torch.zeros(8, dtype=torch.float16)
    assert specialization((x, 16, 1.5)) == ((torch.float16, True), 16, float)
    assert specialization((x[1:], 17, 2.5)) == ((torch.float16, False), 17, float)


def _route(tokens: int, experts: int, top_k: int, block_m: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    plan: tuple[torch.Tensor, ...] = align.align_block_size(ids.to(torch.int32).to(DEVICE), experts, block_m)
    return (ids.to(DEVICE), *plan)


def _reference(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of each copy (row ``c // top_k`` through expert ``ids[c]``), in fp32."""
    tokens, top_k = ids.shape
    rows = x.float().repeat_interleave(top_k, 0)
    pre = torch.einsum("ck,cnk->cn", rows, w13.float()[ids.reshape(-1).long()])
    gate, up = pre.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def _gate_up(x: torch.Tensor, w13: torch.Tensor, plan: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    _, sorted_ids, block_expert, num_padded = plan
    out = torch.full((x.shape[0] * top_k, w13.shape[1] // 2), float("nan"), device=DEVICE, dtype=x.dtype)
    moe_gemm.moe_gemm(x, w13, out, sorted_ids, block_expert, num_padded, rows_per_a=top_k, config=SMALL,
                      act=ACT_SILU, glu=True)
    return out


def test_a_second_launch_reuses_the_recipe_and_computes_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, experts, top_k, hidden, inter = 7, 4, 2, 32, 16
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE).half()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE).half()
    plan = _route(tokens, experts, top_k, SMALL.block_m, 1)
    moe_gemm._LAUNCHES.clear()
    first = _gate_up(x, w13, plan, top_k)
    assert len(moe_gemm._LAUNCHES) == 1
    other_x = torch.randn(tokens, hidden, generator=gen).to(DEVICE).half()  # other values, same metadata
    second = _gate_up(other_x, w13, plan, top_k)
    again = _gate_up(x, w13, plan, top_k)
    assert len(moe_gemm._LAUNCHES) == 1
    assert torch.equal(first, again)
    torch.testing.assert_close(second.float(), _reference(other_x, w13, plan[0]), rtol=2e-2, atol=2e-2)
    (launch,) = moe_gemm._LAUNCHES._recipes.values()
    assert (launch.main.compiled is not None) == (DEVICE == "cuda")  # launched by the compiled kernel's launcher
    moe_gemm._LAUNCHES.clear()  # a launcher without the memo: the same bits
    assert torch.equal(_gate_up(x, w13, plan, top_k), first)


def test_what_the_launch_depends_on_makes_another_recipe() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, experts, top_k, hidden, inter = 5, 4, 2, 32, 16
    buffer = torch.randn(tokens * hidden + 1, generator=gen).to(DEVICE).half()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE).half()
    plan = _route(tokens, experts, top_k, SMALL.block_m, 3)
    moe_gemm._LAUNCHES.clear()
    aligned = buffer[:-1].view(tokens, hidden)
    shifted = buffer[1:].view(tokens, hidden)  # 2 bytes off: no 16-byte alignment to specialise on
    strided = torch.randn(hidden, tokens, generator=gen).to(DEVICE).half().t()
    for x in (aligned, shifted, strided):
        torch.testing.assert_close(_gate_up(x, w13, plan, top_k).float(), _reference(x, w13, plan[0]),
                                   rtol=2e-2, atol=2e-2)
    assert len(moe_gemm._LAUNCHES) == 3
    more = _route(tokens + 1, experts, top_k, SMALL.block_m, 4)
    x = torch.randn(tokens + 1, hidden, generator=gen).to(DEVICE).half()
    torch.testing.assert_close(_gate_up(x, w13, more, top_k).float(), _reference(x, w13, more[0]),
                               rtol=2e-2, atol=2e-2)
    assert len(moe_gemm._LAUNCHES) == 4


def test_a_bad_launch_is_refused_every_time() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=gen).to(DEVICE).half()
    w13 = torch.randn(4, 32, 24, generator=gen).to(DEVICE).half()  # K = 24, the rows' 32
    plan = _route(3, 4, 2, SMALL.block_m, 6)
    moe_gemm._LAUNCHES.clear()
    for _ in range(2):
        with pytest.raises(ValueError, match="rows have K=32, the weight K=24"):
            _gate_up(x, w13, plan, 2)
    assert len(moe_gemm._LAUNCHES) == 0


def test_a_small_launcher_keeps_one_bound_launch_per_key() -> None:
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(12, 40, generator=gen).to(DEVICE)
    weights = torch.rand(6, 2, generator=gen).to(DEVICE)
    site = combine._COMBINE
    site.memo.clear()
    outs = [combine.combine_copies(rows, 2, torch.empty(6, 40, device=DEVICE), weights) for _ in range(3)]
    assert len(site.memo) == 1 and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], (rows.view(6, 2, 40) * weights[..., None]).sum(1))
    combine.combine_copies(rows, 3, torch.empty(4, 40, device=DEVICE), None)
    assert len(site.memo) == 2
    (bound,) = [site.memo.get(key) for key in list(site.memo._recipes)[:1]]
    assert isinstance(bound, BoundLaunch)
    assert (bound.compiled is not None) == (DEVICE == "cuda")  # the interpreter has no compiled kernel


@pytest.mark.skipif(DEVICE != "cuda", reason="a compiled kernel's launcher needs a CUDA device")
def test_a_launch_hook_sends_the_bound_launch_through_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = torch.randn(8, 64, device=DEVICE)
    out = torch.empty(4, 64, device=DEVICE)
    combine._COMBINE.memo.clear()
    combine.combine_copies(rows, 2, out)
    combine.combine_copies(rows, 2, out)
    bound = combine._COMBINE.memo.get(next(iter(combine._COMBINE.memo._recipes)))
    assert bound is not None and bound.compiled is not None  # bound from the second call on
    seen: list[Any] = []
    hooks = triton.knobs.runtime.launch_enter_hook
    if hasattr(hooks, "calls"):  # a chain of hooks (Triton 3.6 to 3.9)
        monkeypatch.setattr(hooks, "calls", [seen.append])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", seen.append)
    fresh = combine.combine_copies(rows, 2, torch.empty(4, 64, device=DEVICE))
    torch.cuda.synchronize()
    assert seen and torch.equal(fresh, out)
