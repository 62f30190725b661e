"""The symmetric-memory expert-parallel dispatcher (:mod:`moeforge.distributed.symmetric`), on every rank of a group.

CPU: gloo ranks with the symmetric windows emulated by shared files (tests/symmetric_workers.py), the kernels in
Triton's interpreter writing into the other processes' memory. GPU: NCCL ranks, one GPU each, PyTorch's symmetric
memory (needs two GPUs of one host).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import symmetric_workers
from moeforge.testing.distributed import RankFailed, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _check(results: list[dict[str, Any]], transport: str) -> None:
    for result in results:
        for name, error in result["errors"].items():  # fp16 triton GEMMs against the float layer: 1e-2
            assert error < (1e-2 if "triton" in name or "bf16 partials" in name else 1e-4), (name, error)
        assert result["dropped_changes_output"]
        assert result["too_many"] and result["overflow_raised"]
        assert result["replay default"] == ("SymmetricDispatch has not been called yet", None)
        assert "capacity=7" in (result["replay capacity 7"][1] or ""), result["replay capacity 7"]
    assert transport in results[0]["describe"] and "tokens sent once per rank where max_tokens saves 2 MiB" in results[0]["describe"]
    assert "tokens sent once per rank;" in results[0]["once describe"]
    assert all(result["ranks agree to send tokens once"] for result in results)
    assert "copies summed on their owner (float32 partials)" in results[0]["summed describe"]
    assert "sum_on_owner takes True, False or the partials' dtype" in results[0]["bad partials"]
    assert "send_tokens_once takes None (chosen from max_tokens), True or False" in results[0]["bad once"]
    assert "rows of 33 bfloat16 do not fill them; use sum_on_owner=True" in results[0]["odd partials"]
    for result in results:  # the same sums in another order: within fp32 rounding of the one-row-per-copy combine
        assert all(error < 1e-6 for name, error in result["errors"].items() if "summed" in name), result["errors"]
        # partials rounded to bf16: within its rounding
        assert all(error < 1e-2 for name, error in result["errors"].items() if "bf16 partials" in name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated windows are CPU memory: on a GPU machine the GPU "
                    "test below runs the real transport")
@pytest.mark.parametrize("world", [2, 4])
def test_the_symmetric_dispatcher_equals_the_whole_layer_and_the_nccl_transport(world: int, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    results = run_ranks(symmetric_workers.symmetric_layers_match, world, "cpu", str(tmp_path), timeout=600)
    _check(results, "symmetric memory (NVLink)")


def test_without_symmetric_memory_the_low_latency_exchange_serves_and_describe_says_why() -> None:
    results = run_ranks(symmetric_workers.symmetric_without_its_transport, 2, timeout=300)
    for result in results:
        assert result["error"] < 1e-5
        assert "transport chosen at the first call" in result["before"]
        assert "NCCL low-latency exchange: the rows are not on a CUDA device" in result["after"]
        assert result["replay"] is None  # (the low-latency exchange's answer at its default capacity)


@pytest.mark.parametrize("world", [2, 4])
def test_on_gpus_of_one_host_the_symmetric_dispatcher_equals_the_whole_layer(world: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_ranks(symmetric_workers.symmetric_layers_match, world, "cuda", backend="nccl", timeout=600)
    _check(results, "symmetric memory (NVLink)")


def _check_compact(results: list[dict[str, Any]]) -> None:
    for result in results:
        for name, error in result["errors"].items():  # fp16 triton GEMMs: 1e-2; FP8 ones: 3e-2 (as test_distributed)
            assert error < (3e-2 if "fp8" in name else 1e-2 if "triton" in name else 1e-3), (name, error)
        assert result["overflow raised"] and result["dropped changes output"]
        assert result["checked"] == [2 * 16 - 1], result["checked"]  # (the buffer that cannot overflow is not)
        assert result["empty everywhere"] == (0, 128) and result["adapters change the output"]
        assert {"triton same experts", "triton top-k = experts", "triton adapters"} <= result["errors"].keys()
        assert "compact rows are read by the triton expert GEMMs only" in result["torch describe"]
        described = result["triton describe"]
        assert "max_rows=" in described and "block-aligned" in described and "symmetric memory (NVLink)" in described
        assert "tokens sent once per rank" in described
        assert all(error < 2e-3 for name, error in result["errors"].items() if "summed" in name), result["errors"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated windows are CPU memory: on a GPU machine the GPU "
                    "test below runs the real transport")
def test_compact_buffers_feed_the_triton_gemms_and_bound_the_rows(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    _check_compact(run_ranks(symmetric_workers.compact_buffers_match, 2, "cpu", str(tmp_path), timeout=600))


def test_compact_buffers_on_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_compact(run_ranks(symmetric_workers.compact_buffers_match, 2, "cuda", backend="nccl", timeout=600))


def test_a_rank_that_stops_answering_fails_the_others_barrier_within_seconds() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(symmetric_workers.a_rank_stops_answering, 2, backend="nccl", timeout=3600, collective_timeout=3600)
    assert 0 in failure.value.failures  # rank 0's barrier timed out (2 s) and raised a device error
    assert time.monotonic() - start < 300  # not the hour rank 1 sleeps



def test_decode_graphs_of_expert_parallel_layers_on_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for result in run_ranks(symmetric_workers.decode_graphs_match, 2, backend="nccl", timeout=600):
        assert all(result["equal"].values()), result["equal"]
        for name in ("symmetric", "symmetric, triton", "compact, triton", "low latency"):
            assert result["graphs"][name] >= 1 and not result["refusals"][name], (name, result)
        for name in ("capacity 7", "all-to-all"):
            assert result["graphs"][name] == 0 and result["refusals"][name], (name, result)
        assert "reads its split sizes on the host" in result["refusals"]["all-to-all"][0]
        assert "capacity=7" in result["refusals"]["capacity 7"][0]
