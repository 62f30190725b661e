"""Batch invariance: a token's output is bitwise the same whatever else is in the batch.

On CPU the triton expert stages run under the interpreter with the invariant launch table, at tiny
shapes (fp16 rows; bf16 dots are mis-computed by the interpreter). There the tile products are numpy
matmuls whose rounding may depend on a row's place in the tile and on the CPU's vector unit, so the CPU
checks the structure (one launch configuration) and agreement within rounding; bitwise invariance is the
GPU kernel's property and is asserted where the kernel runs compiled. On a GPU the layer users build
(``MoELayer(..., batch_invariant=True)``) is checked across M in {1, 7, 64, 513, 4096} with the token of
interest at different positions, bf16, with a router, shared experts and every weight format that has
triton experts.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import INVARIANT_CONFIG, invariant_table, linear  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_the_invariant_table_answers_one_config_for_every_token_count() -> None:
    table = invariant_table(8, 2, max_block_m=64)
    assert {table.lookup(m) for m in (1, 7, 64, 513, 4096, 10 ** 6)} == {INVARIANT_CONFIG}
    assert invariant_table(8, 2, max_block_m=32).lookup(5).block_m == 32


def assert_same_rows(part: torch.Tensor, whole: torch.Tensor) -> None:
    if CUDA:
        assert torch.equal(part, whole)
    else:
        torch.testing.assert_close(part, whole, rtol=2e-3, atol=1e-5)


def test_triton_experts_with_the_invariant_table_are_batch_invariant() -> None:
    experts, k, hidden, inter = 4, 2, 64, 48
    gen = torch.Generator().manual_seed(71)
    dtype = torch.float16
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    table = invariant_table(experts, k)
    pipeline = mf.Pipeline([TritonTopK(experts, k, mf.RoutingConfig()), AlignDispatch(experts, table),
                            FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                            FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()],
                           mf.input_spec(hidden, dtype, experts))
    x = torch.randn(70, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(70, experts, generator=gen).to(DEVICE)
    whole = pipeline(mf.MoEInput(x, logits)).hidden_states
    for rows in (slice(0, 1), slice(3, 10), slice(69, 70), slice(5, 70)):
        part = pipeline(mf.MoEInput(x[rows].contiguous(), logits[rows].contiguous())).hidden_states
        assert_same_rows(part, whole[rows])


def test_invariant_linear_is_a_linear_and_row_independent() -> None:
    gen = torch.Generator().manual_seed(72)
    x = torch.randn(20, 48, generator=gen).to(DEVICE)
    w = torch.randn(12, 48, generator=gen).to(DEVICE)
    b = torch.randn(12, generator=gen).to(DEVICE)
    out = linear(x, w, b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert_same_rows(linear(x[7:8], w, b), out[7:8])


def test_batch_invariance_needs_the_triton_backend() -> None:
    with pytest.raises(mf.InputError, match="batch_invariant=True needs the triton backend"):
        mf.MoELayer(4, 2, 64, 32, backend="torch", batch_invariant=True, device=DEVICE)
    with pytest.raises(mf.InputError, match="must be a bool"):
        mf.MoELayer(4, 2, 64, 32, batch_invariant=1, device=DEVICE)  # type: ignore[arg-type]
    if not CUDA:
        with pytest.raises(mf.BackendUnavailableError, match="batch_invariant=True needs the triton backend"):
            mf.MoELayer(4, 2, 64, 32, batch_invariant=True)


LAYERS: dict[str, Callable[[], dict[str, Any]]] = {
    "bf16 mixtral-like": lambda: dict(),
    "bf16 shared experts + sigmoid routing": lambda: dict(
        routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, renormalize=True),
        shared_experts=mf.SharedExpertsConfig(intermediate_size=256, gate=mf.SharedGate.SIGMOID)),
    "fp8 block/group": lambda: dict(quant=mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")),
    "w4a16": lambda: dict(quant=mf.W4A16Method(group_size=128)),
    "mxfp4": lambda: dict(quant=mf.Mxfp4Method()),
    "nvfp4": lambda: dict(quant=mf.Nvfp4Method()),
}


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_output_of_a_token_is_bitwise_the_same_in_every_batch(name: str) -> None:
    torch.manual_seed(0)
    hidden = 1024
    layer = mf.MoELayer(16, 4, hidden, 512, dtype=torch.bfloat16, device="cuda", batch_invariant=True,
                        **LAYERS[name]())
    assert "backend triton" in layer.describe()
    probe = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(probe)
        for m in (1, 7, 64, 513, 4096):
            for position in sorted({0, m // 2, m - 1}):
                batch = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
                batch[position] = probe[0]
                got = layer(batch)[position:position + 1]
                assert torch.equal(got, want), (m, position)
