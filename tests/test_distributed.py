"""Expert parallelism on CPU: gloo process groups of 2 and 4 local processes (see tests/ep_workers.py).

Each test spawns its ranks once and runs many cases there (a spawn costs ~1.5 s); every rank
asserts against the whole layer computed on one process, and ranks that hang are terminated by
run_ranks' deadline instead of hanging the suite.
"""

from __future__ import annotations

import time

import pytest
import torch

import ep_workers
from moeforge.testing.distributed import RankFailed, RanksTimedOut, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_equals_the_whole_layer(world: int) -> None:
    errors = run_ranks(ep_workers.layers_match, world, timeout=300)
    for rank_errors in errors:
        assert max(rank_errors.values()) < 1e-2


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_dispatch_on_the_wire(world: int) -> None:
    results = run_ranks(ep_workers.fp8_on_the_wire, world, timeout=300)
    rows = results[0]["row_bytes"]
    # Bytes on the wire per row: FP8/INT8 carry half of BF16's data plus their scales and the weight.
    assert rows["bf16"] == 272 and rows["fp8"] == 144 and rows["int8"] == 144 and rows["fp8/group"] == 144
    assert rows["fp32"] == 528
    for name in ("fp8", "int8", "fp8/group", "bf16"):
        for kind in ("all_to_all", "low_latency"):
            sent = sum(r["traffic"][f"{name}/{kind}"][0] for r in results)
            received = sum(r["traffic"][f"{name}/{kind}"][1] for r in results)
            assert sent == received  # nothing lost, nothing invented
        combined = [r["traffic"][f"{name}/combine"] for r in results]
        assert sum(sent for sent, _ in combined) == sum(received for _, received in combined)
    fp8 = sum(r["traffic"]["fp8/all_to_all"][0] for r in results)
    bf16 = sum(r["traffic"]["bf16/all_to_all"][0] for r in results)
    assert 0.5 <= fp8 / bf16 <= 0.56


def test_capacity_overflow_drops_or_raises_on_every_rank() -> None:
    results = run_ranks(ep_workers.overflow, 2, timeout=300)
    assert results[0]["dropped"] == 8  # 6 copies to each of two experts, capacity 2
    assert results[1]["dropped"] == 8


def test_exchanged_rows_need_their_own_combine() -> None:
    run_ranks(ep_workers.contracts, 2, timeout=120)


def test_a_failing_rank_does_not_hang_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(ep_workers.fail_on_rank_one, 2, timeout=3600, collective_timeout=3600)
    assert "rank 1 gives up" in failure.value.failures[1]
    assert time.monotonic() - start < 600  # rank 0 was terminated, not left to its hour-long collective


def test_a_failure_is_reported_before_the_teardown_that_follows_it() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(ep_workers.fail_where_teardown_hangs, 2, timeout=3600, collective_timeout=3600)
    assert "rank 0 hit a device error" in failure.value.failures[0]
    assert time.monotonic() - start < 600  # not the hour the teardown would take


def test_a_hanging_rank_is_terminated_at_the_deadline() -> None:
    # The deadline counts from when both ranks joined (rank 0 then returns at once), not from the spawn:
    # a loaded machine's slow start does not make rank 0 miss it.
    start = time.monotonic()
    with pytest.raises(RanksTimedOut) as timed_out:
        run_ranks(ep_workers.hang_on_rank_one, 2, timeout=2)
    assert timed_out.value.ranks == [1]
    assert time.monotonic() - start < 600  # not the hour rank 1 sleeps


def test_a_rank_that_never_joins_is_terminated_at_the_startup_deadline() -> None:
    with pytest.raises(RanksTimedOut) as timed_out:
        run_ranks(ep_workers.hang_on_rank_one, 2, timeout=2, startup_timeout=0)
    assert timed_out.value.ranks == [0, 1]


def test_quantized_experts_behind_both_dispatchers() -> None:
    errors = run_ranks(ep_workers.quantized_layers_match, 2, timeout=300)
    assert all(len(rank_errors) == 8 for rank_errors in errors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the triton kernels in the interpreter on CPU ranks (gloo): "
                    "on a GPU machine they need CUDA tensors, and NCCL ranks need a GPU each")
def test_triton_expert_gemms_behind_the_all_to_all_and_low_latency_dispatchers() -> None:
    pytest.importorskip("triton")
    errors = run_ranks(ep_workers.triton_experts_match, 2, timeout=300)
    assert all(len(rank_errors) == 6 for rank_errors in errors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the triton kernels in the interpreter on CPU ranks (gloo): "
                    "on a GPU machine they need CUDA tensors, and NCCL ranks need a GPU each")
def test_triton_gemms_with_an_adapter_behind_the_all_to_all_and_low_latency_dispatchers() -> None:
    pytest.importorskip("triton")
    errors = run_ranks(ep_workers.triton_adapters_match, 2, timeout=300)
    for rank_errors in errors:
        assert max(rank_errors.values()) < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the triton kernels in the interpreter on CPU ranks (gloo): "
                    "on a GPU machine they need CUDA tensors, and NCCL ranks need a GPU each")
def test_a_stack_of_adapters_behind_both_dispatchers() -> None:
    errors = run_ranks(ep_workers.stacked_adapters_match, 2, timeout=300)
    for rank_errors in errors:
        assert max(rank_errors.values()) < 1e-4


def test_expert_adapters_behind_the_all_to_all_dispatcher() -> None:
    errors = run_ranks(ep_workers.adapters_match, 2, timeout=300)
    for rank_errors in errors:
        assert max(rank_errors.values()) < 1e-4
