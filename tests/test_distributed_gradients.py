"""Backward through expert parallelism, on CPU: gloo process groups of 2 and 4 local processes.

The all-to-all dispatch's backward is the combine's exchange and the combine's is the dispatch's (the
low-latency dispatcher's likewise, in its fixed-capacity buffers); every rank's gradients — of its hidden
states, router logits, replicated parameters and of its experts' weights and biases — equal those of
the whole layer on one process (tests/ep_gradient_workers.py): several families, skewed routing, a rank
without tokens, bf16, and copies dropped by a capacity.
"""

from __future__ import annotations

import pytest
import torch

import ep_gradient_workers
from moeforge.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gradients_equal_the_whole_layer(world: int) -> None:
    errors = run_ranks(ep_gradient_workers.gradients_match, world, timeout=300)
    assert all(errors), "every rank compared gradients"
    for rank_errors in errors:
        assert max(rank_errors.values()) < 3e-2
        assert max(error for name, error in rank_errors.items() if not name.startswith("bf16")) < 1e-5
