"""The host-time harness of ``benchmarks/bench_host_step.py``: a training step runs with the launches stubbed, gives
gradients of every leaf's shape, and leaves the launcher as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_host_step  # noqa: E402
from moeforge.kernels import bound_launch  # noqa: E402


@pytest.mark.parametrize("slot_rows", [False, True])
def test_a_stubbed_step_differentiates_every_leaf_and_restores_the_launcher(slot_rows: bool) -> None:
    launch = bound_launch.BoundLaunch.__call__
    forward, step = bench_host_step.training_step(16, 4, 8, 32, 16, slot_rows)
    with bench_host_step.launches_stubbed():
        assert bound_launch.BoundLaunch.__call__ is not launch
        out, leaves = forward()
        grads = step()
    assert bound_launch.BoundLaunch.__call__ is launch
    assert out.shape == (8, 32)
    assert [g.shape for g in grads] == [leaf.shape for leaf in leaves]


def test_the_floor_step_differentiates_the_same_leaves() -> None:
    # (bench_host_step --floor: the step's autograd nodes, allocations and launch calls alone)
    grads = bench_host_step.floor_step(16, 4, 8, 32, 16)()
    assert [tuple(g.shape) for g in grads] == [(8, 32), (8, 4), (16, 32, 32), (16, 32, 16)]


def test_the_one_node_floor_and_the_staged_step_differentiate_the_same_leaves() -> None:
    # (bench_host_step --floor --staged: the floor in the training step's one node; the step stage by stage)
    grads = bench_host_step.one_node_floor_step(16, 4, 8, 32, 16)()
    assert [tuple(g.shape) for g in grads] == [(8, 32), (8, 4), (16, 32, 32), (16, 32, 16)]
    _, staged = bench_host_step.training_step(16, 4, 8, 32, 16, joined=False)
    with bench_host_step.launches_stubbed():
        assert [tuple(g.shape) for g in staged()] == [(8, 32), (8, 4), (16, 32, 32), (16, 32, 16)]


def test_the_inference_forward_runs_as_one_unit_and_stage_by_stage() -> None:
    # (bench_host_step --inference: the pipeline with and without its joined runs)
    pipeline, forward = bench_host_step.inference_forward(16, 4, 8, 32, 16)
    assert any(run is not None for run in pipeline.joined)
    with bench_host_step.launches_stubbed():
        assert forward().hidden_states.shape == (8, 32)
        joined, pipeline.joined = pipeline.joined, (None,) * len(pipeline.joined)
        assert forward().hidden_states.shape == (8, 32)
        pipeline.joined = joined


@pytest.mark.parametrize("joined", [True, False])
def test_the_weights_on_input_step_differentiates_every_leaf_under_the_index_filling_stub(joined: bool) -> None:
    # (bench_host_step --weights-on-input: Llama-4's experts; the step reads the gather's slot_of on the host's side,
    # which the plain stub leaves as uninitialised memory)
    forward, step = bench_host_step.training_step(16, 1, 8, 32, 16, True, joined=joined, weights_on_input=True)
    with bench_host_step.launches_stubbed(valid_indices=True):
        out, leaves = forward()
        grads = step()
        ids = torch.full((3,), 7, dtype=torch.int32)
        bound_launch.BoundLaunch.__call__(None, ids, torch.ones(2))  # type: ignore[arg-type]
        assert ids.tolist() == [0, 0, 0]
    assert out.shape == (8, 32)
    assert [g.shape for g in grads] == [leaf.shape for leaf in leaves]
