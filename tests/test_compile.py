"""``torch.compile(layer)`` on the CPU: the forward traces, with ``fullgraph=True`` for the unquantized
layers, and gives the eager result.

Most tests compile with the ``aot_eager`` backend: it runs Dynamo (the tracing that failed on the attrs
payloads) and AOT autograd with fake tensors (which checks the custom ops' fake implementations)
without Inductor's code generation, which takes tens of seconds per graph on a CPU. One test compiles
with the default backend, the path a user takes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.kernels.config import default_config
from moeforge.payloads import AlignedRows, BlockAlignment, PaddedRows, SortedRows
from moeforge.stages.dispatch import PaddedPlan, SortedPlan

E, H, I = 8, 64, 32


def _layer(**kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(0)
    top_k = kwargs.pop("top_k", 2)
    return mf.MoELayer(E, top_k, H, I, dtype=torch.float32, **kwargs)


UNQUANTIZED = {
    "mixtral": {},
    "padded": dict(dispatcher="padded"),
    "cumsum-shared-gated": dict(shared_experts=mf.SharedExpertsConfig(32, gate=mf.SharedGate.SIGMOID)),
    "deepseek": dict(routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4,
                                              topk_group=2, routed_scaling_factor=2.5, scaling_in_weights=False)),
    "llama4-on-input": dict(top_k=1, routing=mf.RoutingConfig(
        order=mf.ScoreOrder.SELECT_THEN_SCORE, scoring=mf.Scoring.SIGMOID, apply_weights=mf.RoutingWeights.ON_INPUT)),
    "gpt-oss": dict(activation=mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED),
                    expert_bias=True, routing=mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE,
                                                               apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE)),
    "k=E relu2": dict(top_k=E, activation=mf.ActivationConfig(mf.ActivationKind.RELU2)),
}

QUANTIZED = {
    "fp8": mf.Fp8W8A8Method,
    "int8": mf.Int8W8A8Method,
    "w4a16": lambda: mf.W4A16Method(group_size=32),
    "mxfp4": mf.Mxfp4Method,
    "nvfp4": mf.Nvfp4Method,
    "w4a4-npu": mf.W4A4NpuMethod,
}


def _compare(layer: mf.MoELayer, compiled: Any, tokens: tuple[int, ...] = (5, 1, 0)) -> None:
    for count in tokens:
        x = torch.randn(count, H)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(UNQUANTIZED))
def test_unquantized_layer_compiles_in_one_graph(name: str) -> None:
    layer = _layer(**UNQUANTIZED[name])
    _compare(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"))


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_layer_compiles_in_one_graph(name: str) -> None:
    # The torch reference decodes FP8/INT8/int4 weights one expert at a time in a loop over the counts
    # read on the host: one custom op (moeforge.quant.decoded_gemm), so the graph does not break there.
    layer = _layer(quant=QUANTIZED[name]())
    _compare(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"))


@pytest.mark.parametrize("name", ["fp8", "w4a16"])
def test_a_compiled_quantized_layer_refuses_a_backward_as_the_eager_one_does(name: str) -> None:
    layer = _layer(quant=QUANTIZED[name]())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(mf.errors.InferenceOnlyError, match="inference-only"):
        layer(torch.randn(6, H, requires_grad=True)).sum().backward()
    # AOT autograd traces the backward while compiling: the error comes then, wrapped by Dynamo, same reason.
    with pytest.raises((mf.errors.InferenceOnlyError, torch._dynamo.exc.Unsupported), match="inference-only"):
        compiled(torch.randn(6, H, requires_grad=True)).sum().backward()


def test_compiled_layer_with_the_default_backend_matches_eager_values_and_gradients(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A private Inductor cache: its on-disk key leaves out ATEN_CPU_CAPABILITY, so a kernel cached by a
    # run on the CPU's own vector width is reused, wrongly, by a run with ATEN_CPU_CAPABILITY=avx2 on the
    # same machine (an index-out-of-bounds error inside the generated kernel).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer = _layer(shared_experts=mf.SharedExpertsConfig(32))
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(7, H, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    eager_grads = [x.grad.clone()] + [param.grad.clone() for param in layer.parameters()]  # type: ignore[union-attr]
    x.grad, _ = None, layer.zero_grad(set_to_none=True)
    compiled_out = compiled(x)
    torch.testing.assert_close(compiled_out, out, rtol=1e-5, atol=1e-5)
    compiled_out.square().sum().backward()
    compiled_grads = [x.grad] + [param.grad for param in layer.parameters()]
    for eager, traced in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(traced, eager, rtol=1e-4, atol=1e-5)


def test_payloads_are_built_inside_a_compiled_function() -> None:
    # attrs' frozen __init__ starts with a descriptor lookup Dynamo cannot trace: the payloads are
    # frozen dataclasses. Every payload (and plan) is built and read back in one graph.
    def build(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        routed = mf.RoutedTokens(mf.Activations(x), mf.TopKOutput(x[:, :2], ids))
        sorted_rows = SortedRows(routed.x, ids[0].long(), mf.GroupListType.COUNT, x[:, 0],
                                 plan=SortedPlan(ids.long(), x[:, :2]))
        padded = PaddedRows(mf.Activations(x[None]), ids[0], x[None, :, 0],
                            plan=PaddedPlan(ids.long(), x[:, :2], ids.sum()))
        alignment = BlockAlignment(ids[:, 0], ids[0], ids[:1, 0], config, copies_per_row=2, num_tokens=3)
        aligned = AlignedRows(routed.x, alignment, False, x[:, 0], plan=sorted_rows.plan)
        evolved = sorted_rows.with_x(mf.Activations(x * 2))
        out = mf.MoEOutput(evolved.x.data + padded.x.data[0] + aligned.x.data)
        return mf.MoEInput(out.hidden_states, x).hidden_states

    x, ids = torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int32)
    config = default_config(3, 4, 2)  # a launch configuration is looked up (not built) in the forward
    torch.testing.assert_close(torch.compile(build, fullgraph=True, backend="eager")(x, ids), build(x, ids))


def test_an_eager_forward_does_not_import_dynamo() -> None:
    # Calling a custom op imports torch._dynamo (about a second, and its import writes
    # TORCHINDUCTOR_CACHE_DIR into os.environ): the torch reference calls its grouped-matmul op only
    # while compiling. A fresh process, so that no other test has imported it already.
    code = textwrap.dedent("""
        import os, sys, torch, moeforge as mf
        before = dict(os.environ)
        for dispatcher in ("sorted", "padded"):
            layer = mf.MoELayer(4, 2, 16, 8, dtype=torch.float32, dispatcher=dispatcher, expert_bias=True)
            layer(torch.randn(3, 16)).sum().backward()
        assert "torch._dynamo" not in sys.modules, "the eager forward imported torch._dynamo"
        assert dict(os.environ) == before
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
