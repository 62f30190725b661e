"""The layer fuzzer (``tests/fuzz_layers.py``) keeps working, and a few of its CPU cases hold: a quantized layer, a
plain one, training with the routing weights on the input, with an adapter, with every token on one expert (seeds
chosen for those draws; each case builds a torch layer, a triton layer under the interpreter and an fp32 reference,
and compares forward, gradients and two steps' bits — see the fuzzer's docstring)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import fuzz_layers  # noqa: E402

SEEDS = {24: "quantized inference", 1: "inference", 4: "training, weights on the input", 19: "training, an adapter",
         14: "training, skewed logits", 59: "quantized, weights on the input"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU cases; a GPU runs the fuzzer's own GPU cases")
@pytest.mark.parametrize("seed", sorted(SEEDS), ids=lambda seed: SEEDS[seed])
def test_a_cpu_case_of_the_fuzzer_holds(seed: int) -> None:
    case = fuzz_layers.draw(seed, cpu=True)
    outcome, reason, _ = fuzz_layers.run_case(case, "cpu")
    assert outcome.startswith("ok") or outcome == "not finite on both backends", (outcome, reason)
