"""Backward through the triton path: the grouped GEMM, the combine and the routing weights have
autograd formulas (``moeforge/kernels/backward.py``); gradients equal those of a per-token float64 loop
over the chosen experts (autograd through ``select_experts`` and ``apply_activation``).

On CPU under the interpreter at tiny shapes (fp32 operands: 1e-5; fp16: 2e-2), on a GPU the same plus
the layer users build (``MoELayer(..., backend="triton")``) against the torch backend in bf16, and a
compiled training step.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.kernels import align  # noqa: E402
from moeforge.kernels.weight_grad import expert_weight_grad  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.stages.activation import apply_activation  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.topk import select_experts  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "gpt-oss": mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    "geglu-tanh": mf.ActivationConfig(mf.ActivationKind.GEGLU, gelu_approximate="tanh"),
    "relu2": mf.ActivationConfig(mf.ActivationKind.RELU2),
}
ROUTINGS = {
    "softmax": mf.RoutingConfig(),
    "sigmoid renormalized, scaled": mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, renormalize=True,
                                                     routed_scaling_factor=2.5),
    "select then softmax": mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE),
}


def _table(experts: int, k: int, block_m: Optional[int] = None) -> ConfigTable:
    """The default table, or one entry aligning in blocks of ``block_m`` rows (small tiles otherwise)."""
    if block_m is None:
        return ConfigTable(experts, k)
    config = GemmConfig(block_m, 32, 32, 1, 4, 2)
    return ConfigTable(experts, k, tokens=(1,), configs=(MoEConfig(config, config),))


def _pipeline(experts: int, k: int, hidden: int, tensors: dict[str, torch.Tensor], act: mf.ActivationConfig,
              routing: mf.RoutingConfig, dtype: torch.dtype,
              slot_rows: Optional[bool] = None, block_m: Optional[int] = None
              ) -> mf.Pipeline:  # type: ignore[type-arg]
    table = _table(experts, k, block_m)
    epilogue = routing.apply_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE
    on_input = routing.apply_weights is mf.RoutingWeights.ON_INPUT
    return mf.Pipeline([
        TritonTopK(experts, k, routing), AlignDispatch(experts, table, slot_rows, apply_routing_weights=on_input),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, tensors["w13"], table, tensors["b13"], act),
        FusedGroupedGemm(mf.GemmRole.DOWN, tensors["w2"], table, tensors["b2"], apply_routing_weights=epilogue),
        Combine(apply_routing_weights=not (epilogue or on_input),
                routed_scaling_factor=None if routing.scaling_in_weights or routing.routed_scaling_factor == 1.0
                else routing.routed_scaling_factor),
    ], mf.input_spec(hidden, dtype, experts))


def _reference(x: torch.Tensor, logits: torch.Tensor, k: int, t: dict[str, torch.Tensor], act: mf.ActivationConfig,
               routing: mf.RoutingConfig) -> torch.Tensor:
    """float64, one token and expert at a time."""
    topk = select_experts(logits.double(), k, routing)
    on_input = routing.apply_weights is mf.RoutingWeights.ON_INPUT
    out = []
    for token in range(x.shape[0]):
        row = x.new_zeros(x.shape[1], dtype=torch.float64)
        for j in range(k):
            e, weight = int(topk.ids[token, j]), topk.weights[token, j].double()
            rows = x[token].double() * weight if on_input else x[token].double()
            h = apply_activation(rows @ t["w13"][e].double().T + t["b13"][e].double(), act)
            y = h @ t["w2"][e].double().T + t["b2"][e].double()
            row = row + (y if on_input else weight * y)
        out.append(row)
    return torch.stack(out) if out else x.new_zeros(0, x.shape[1], dtype=torch.float64)


def _tensors(experts: int, hidden: int, inter: int, gated: bool, dtype: torch.dtype, gen: torch.Generator
             ) -> dict[str, torch.Tensor]:
    n13 = (2 if gated else 1) * inter
    made = {"w13": torch.randn(experts, n13, hidden, generator=gen) * hidden ** -0.5,
            "w2": torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5,
            "b13": torch.randn(experts, n13, generator=gen) * 0.1, "b2": torch.randn(experts, hidden, generator=gen) * 0.1}
    return {name: torch.nn.Parameter(value.to(DEVICE, dtype)) for name, value in made.items()}


def _check_gradients(tokens: int, experts: int, k: int, act: mf.ActivationConfig, routing: mf.RoutingConfig,
                     dtype: torch.dtype, tolerance: float, logits: Any = None, slot_rows: bool = False,
                     block_m: Optional[int] = None) -> None:
    hidden, inter = 32, 48
    gen = torch.Generator().manual_seed(81)
    t = _tensors(experts, hidden, inter, act.gated, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype).requires_grad_()
    if logits is None:
        logits = torch.randn(tokens, experts, generator=gen)
    logits = logits.to(DEVICE).requires_grad_()
    out = _pipeline(experts, k, hidden, t, act, routing, dtype, slot_rows, block_m)(
        mf.MoEInput(x, logits)).hidden_states
    grad = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    inputs = [x, logits, *t.values()]
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    ref = _reference(x, logits, k, t, act, routing)
    want = torch.autograd.grad(ref, inputs, grad.double(), allow_unused=True)
    for name, g, w in zip(["x", "logits", *t], got, want):
        assert g is not None, name
        w = torch.zeros_like(g) if w is None else w
        err = float((g.double() - w.double()).norm() / w.double().norm().clamp(min=1e-30))
        assert err < tolerance or float(w.abs().max()) == 0 and float(g.abs().max()) == 0, (name, err)


# The rows in copy order, as inference dispatches them, and in slot order (moeforge.stages.slot_order), as a training
# step does where it pays: forced here at shapes where the rule would not take it; in 64-row blocks, each expert's
# run of rows cut short of its blocks (a whole number of the weight gradient's 32-row steps at these few copies).
LAYOUTS: dict[str, dict[str, Any]] = {"copy order": dict(slot_rows=False), "slot order": dict(slot_rows=True),
                                      "slot order, runs short of the blocks": dict(slot_rows=True, block_m=64)}


# (slot order for two activations: gated on concatenated and on interleaved rows; the others are the same kernels)
@pytest.mark.parametrize("act, layout", [(act, "copy order") for act in sorted(ACTIVATIONS)]
                         + [("swiglu", "slot order"), ("gpt-oss", "slot order"),
                            ("gpt-oss", "slot order, runs short of the blocks")])
@pytest.mark.parametrize("weights_at", ["combine", "epilogue"])
def test_gradients_of_every_activation_and_routing_weight_placement(act: str, weights_at: str, layout: str) -> None:
    place = mf.RoutingWeights.IN_GEMM_EPILOGUE if weights_at == "epilogue" else mf.RoutingWeights.IN_COMBINE
    _check_gradients(9, 4, 2, ACTIVATIONS[act], mf.RoutingConfig(apply_weights=place), torch.float32, 1e-5,
                     **LAYOUTS[layout])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("k", [1, 3])
def test_gradients_with_the_routing_weights_on_the_input(k: int, layout: str) -> None:
    # Llama-4's placement: each copy's row is its token's row times the copy's weight before the gate/up GEMM; the
    # combine sums the copies unweighted. The weights' gradient comes through the scaled rows (both layouts).
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, order=mf.ScoreOrder.SELECT_THEN_SCORE, renormalize=False,
                               apply_weights=mf.RoutingWeights.ON_INPUT)
    _check_gradients(9, 4, k, ACTIVATIONS["swiglu"], routing, torch.float32, 1e-5, **LAYOUTS[layout])
    _check_gradients(1, 3, 3, ACTIVATIONS["gpt-oss"], routing, torch.float32, 1e-5, **LAYOUTS[layout])


@pytest.mark.parametrize("routing, layout", [(routing, "copy order") for routing in sorted(ROUTINGS)]
                         + [("sigmoid renormalized, scaled", "slot order"),
                            ("sigmoid renormalized, scaled", "slot order, runs short of the blocks")])
def test_gradients_of_the_routing_weights(routing: str, layout: str) -> None:
    _check_gradients(7, 6, 3, ACTIVATIONS["swiglu"], ROUTINGS[routing], torch.float32, 1e-5, **LAYOUTS[layout])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_with_idle_experts_one_busy_expert_and_top_k_equal_to_experts(layout: str) -> None:
    logits = torch.full((12, 4), -4.0)
    logits[:, 2] = 4.0  # every token's first choice is expert 2; with k=1 experts 0, 1, 3 get nothing
    _check_gradients(12, 4, 1, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32, 1e-5, logits=logits,
                     **LAYOUTS[layout])
    _check_gradients(5, 3, 3, ACTIVATIONS["relu2"], mf.RoutingConfig(), torch.float32, 1e-5,
                     **LAYOUTS[layout])
    _check_gradients(1, 3, 2, ACTIVATIONS["gpt-oss"], mf.RoutingConfig(), torch.float32, 1e-5,
                     **LAYOUTS[layout])  # one token


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_in_half_precision(layout: str) -> None:
    _check_gradients(9, 4, 2, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float16, 2e-2, **LAYOUTS[layout])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_empty_batch_has_zero_gradients(layout: str) -> None:
    gen = torch.Generator().manual_seed(82)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    x = torch.zeros(0, 32, device=DEVICE, requires_grad=True)
    logits = torch.zeros(0, 4, device=DEVICE, requires_grad=True)
    out = _pipeline(4, 2, 32, t, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32,
                    **LAYOUTS[layout])(mf.MoEInput(x, logits))
    grads = torch.autograd.grad(out.hidden_states.sum(), [x, *t.values()], allow_unused=True)
    assert grads[0] is not None and grads[0].shape == (0, 32)
    assert all(g is None or not g.any() for g in grads[1:])


def test_only_a_recorded_forward_runs_the_activation_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inference (no grad mode, or nothing requiring grad) keeps the activation fused in the gate/up GEMM's epilogue;
    # a forward autograd records runs it as its own op, which keeps the pre-activation rows for the backward —
    # whichever of rows and weights requires grad (a frozen-weight fine-tune, an experts-only one) — and both give
    # the same output.
    gen = torch.Generator().manual_seed(85)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    x = torch.randn(9, 32, generator=gen).to(DEVICE)
    logits = torch.randn(9, 4, generator=gen).to(DEVICE)
    pipe = _pipeline(4, 2, 32, t, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32)  # registers the ops
    calls = []
    from moeforge.kernels import activation_rows

    # (the activation op's function: what the op, the eager path and the training step's one node all run)
    real = activation_rows.activate_rows
    monkeypatch.setattr(activation_rows, "activate_rows", lambda *args: calls.append(1) or real(*args))
    with torch.no_grad():
        fused = pipe(mf.MoEInput(x, logits)).hidden_states
    assert not calls
    for p in t.values():
        p.requires_grad_(False)
    assert torch.equal(pipe(mf.MoEInput(x, logits)).hidden_states, fused) and not calls
    separate = pipe(mf.MoEInput(x.clone().requires_grad_(), logits)).hidden_states
    assert len(calls) == 1
    torch.testing.assert_close(separate, fused, rtol=1e-5, atol=1e-5)
    t["w13"].requires_grad_(True)
    out = pipe(mf.MoEInput(x, logits)).hidden_states
    assert len(calls) == 2
    (d_w13,) = torch.autograd.grad(out.sum(), [t["w13"]])
    assert d_w13.shape == t["w13"].shape and bool(d_w13.abs().sum() > 0)


def test_the_weight_gradient_kernel_sums_each_experts_copies_in_order() -> None:
    gen = torch.Generator().manual_seed(83)
    tokens, k, experts = 10, 2, 5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    ids[ids == 3] = 1  # expert 3 gets no copy (and expert 1 two per token at most once: distinct per row)
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % experts, ids[:, 1])
    ids[ids == 3] = 4
    rows = torch.randn(tokens, 24, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * k, 40, generator=gen).to(DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids.to(DEVICE), experts, 16)
    dw, db = expert_weight_grad(d_rows, rows, k, sorted_ids, block_expert, num_padded, experts, 16, True)
    assert dw.dtype == torch.float32
    flat = ids.reshape(-1).long().to(DEVICE)
    for e in range(experts):
        chosen = (flat == e).nonzero().flatten()
        want = d_rows[chosen].double().T @ rows[chosen // k].double()
        torch.testing.assert_close(dw[e].double(), want, rtol=1e-5, atol=1e-5)
        assert db is not None
        torch.testing.assert_close(db[e].double(), d_rows[chosen].double().sum(0), rtol=1e-5, atol=1e-5)
    assert not dw[3].any()


def test_quantized_grouped_gemms_refuse_a_backward() -> None:
    """The op-level guard (the layer says it first, naming the method): an FP8 GEMM whose rows require
    grad cannot be differentiated silently."""
    from moeforge.kernels.config import GemmConfig
    from moeforge.kernels.formats import WeightFormat
    from moeforge.kernels.grouped_gemm_call import GemmEpilogue, GemmRoute, GemmRows, GemmWeight, grouped_gemm
    from moeforge.stages.triton import kernel_ops

    kernel_ops()  # registers the op

    gen = torch.Generator().manual_seed(84)
    rows = torch.randn(4, 128, generator=gen).to(DEVICE)
    ids = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    plan = align.align_block_size(ids, 1, 16)
    weight = torch.randn(1, 32, 128, generator=gen).to(DEVICE).to(torch.float8_e4m3fn)
    scale = torch.ones(1, 32, device=DEVICE)
    bias = torch.zeros(1, 32, device=DEVICE, requires_grad=True)
    out, _ = grouped_gemm(GemmRows(rows.to(torch.float8_e4m3fn), torch.ones(4, 1, device=DEVICE)),
                          GemmWeight(weight, WeightFormat.FP8, scale), GemmRoute(*plan, 4),
                          GemmEpilogue(torch.float32, bias=bias), GemmConfig(16, 32, 128, 1, 4, 2))
    with pytest.raises(mf.InputError, match="inference-only"):
        out.sum().backward()


def test_an_inference_forward_of_many_copies_equals_the_reference() -> None:
    # Beyond 1024 copies an inference forward (grad mode off) aligns with the atomic scatter, a training one with the
    # ordered scatter: both against the float64 reference, and the training forward's gradients too.
    routing, act = ROUTINGS["softmax"], mf.ActivationConfig()
    gen = torch.Generator().manual_seed(17)
    t = _tensors(8, 32, 48, act.gated, torch.float32, gen)
    x = torch.randn(300, 32, generator=gen).to(DEVICE)
    logits = torch.randn(300, 8, generator=gen).to(DEVICE)
    pipeline = _pipeline(8, 4, 32, t, act, routing, torch.float32)
    want = _reference(x, logits, 4, t, act, routing)
    with torch.no_grad():
        got = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
    _check_gradients(300, 8, 4, act, routing, torch.float32, 1e-5)


@pytest.mark.parametrize("tokens", [40, 3000])
def test_the_alignment_places_the_copies_in_the_same_slots_every_run(tokens: int) -> None:
    # The weight gradient sums each expert's rows in slot order: its bits are the same from run to run because the
    # alignment's slots are (each expert's copies ascending, no atomics; 6000 copies take the two-kernel plan, whose
    # scatter once used atomics and placed them in any order).
    gen = torch.Generator().manual_seed(91)
    k, experts, block = 2, 3, 16
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32).to(DEVICE)
    first = align.align_block_size(ids, experts, block)
    for _ in range(3):
        again = align.align_block_size(ids, experts, block)
        used = int(first[2])
        assert int(again[2]) == used and torch.equal(again[0][:used], first[0][:used])
        assert torch.equal(again[1][:used // block], first[1][:used // block])
    rows = torch.randn(tokens, 24, generator=gen).to(DEVICE)
    d_rows = torch.randn(tokens * k, 40, generator=gen).to(DEVICE)
    dw, db = expert_weight_grad(d_rows, rows, k, *first, experts, block, True)
    dw2, db2 = expert_weight_grad(d_rows, rows, k, *align.align_block_size(ids, experts, block), experts, block, True)
    assert torch.equal(dw, dw2) and db is not None and db2 is not None and torch.equal(db, db2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_every_gradient_is_bitwise_the_same_from_run_to_run_and_in_a_cuda_graph(family: str) -> None:
    # Thousands of copies per expert: the alignment's atomics order them differently from run to run. GPT-OSS's
    # expert biases: on Hopper their gradients are a launch of their own beside the Gluon weight gradient.
    torch.manual_seed(0)
    layer = mf.MoELayer.from_preset(family, num_experts=8, top_k=2, hidden_size=512, intermediate_size=256,
                                    dtype=torch.bfloat16, device="cuda", backend="triton")
    x = torch.randn(8192, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8192, 512, device="cuda", dtype=torch.bfloat16)

    def step() -> list[torch.Tensor]:
        x.grad = None
        layer.zero_grad(set_to_none=False)
        layer(x).backward(grad)
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]

    first = step()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(step(), first))
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    x.grad = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x).backward(grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for p in [x, *layer.parameters()]:
            p.grad.zero_()  # type: ignore[union-attr]
        layer(x).backward(grad)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replayed = [x.grad] + [p.grad for p in layer.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(replayed, first))  # type: ignore[arg-type]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("slot_rows", [False, True], ids=["copy order", "slot order"])
@pytest.mark.parametrize("tokens", [300, 8192])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_triton_layer_gradients_equal_the_torch_backend_in_bf16(family: str, tokens: int, slot_rows: bool) -> None:
    torch.manual_seed(0)
    sizes = dict(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256)
    fast = mf.MoELayer.from_preset(family, **sizes, dtype=torch.bfloat16, device="cuda", backend="triton")
    slow = mf.MoELayer.from_preset(family, **sizes, dtype=torch.bfloat16, device="cuda", backend="torch")
    slow.load_state_dict(fast.state_dict())
    assert "backend triton" in fast.describe()
    where, dispatch = next((index, stage) for index, stage in enumerate(fast.pipeline.stages)
                           if isinstance(stage, AlignDispatch))
    fast.replace_stage(where, attrs.evolve(dispatch, slot_rows=slot_rows))
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    grads = []
    for layer in (fast, slow):
        xi = x.clone().requires_grad_()
        layer(xi).float().square().mean().backward()
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
        layer.zero_grad()
    for got, want in zip(*grads):
        assert got is not None and want is not None
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 3e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_compiled_training_step() -> None:
    torch.manual_seed(0)
    layer = mf.MoELayer(8, 2, 256, 128, dtype=torch.bfloat16, device="cuda", backend="triton")
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-2)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = layer(x).float().square().mean()
        loss.backward()
        return loss

    compiled = torch.compile(step)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    eager_loss = step(x)
    eager = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad()
    compiled_loss = compiled(x)
    got = [p.grad for p in layer.parameters() if p.grad is not None]
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-3)
    for g, w in zip(got, eager):
        assert float((g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)) < 1e-2
    optimizer.step()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_training_step_compiles_with_the_backward_ops(layout: str) -> None:
    """AOT autograd traces the registered backward (the custom ops' fakes, the weight-gradient op)."""
    gen = torch.Generator().manual_seed(85)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    pipeline = _pipeline(4, 2, 32, t, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32, **LAYOUTS[layout])
    x = torch.randn(9, 32, generator=gen).to(DEVICE)
    logits = torch.randn(9, 4, generator=gen).to(DEVICE).requires_grad_()

    def step(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss = pipeline(mf.MoEInput(x, logits)).hidden_states.square().mean()
        loss.backward()
        return loss

    eager = step(x, logits).detach()
    want = [p.grad.clone() for p in t.values() if p.grad is not None]
    for p in t.values():
        p.grad = None
    got_loss = torch.compile(step, backend="aot_eager")(x, logits).detach()
    torch.testing.assert_close(got_loss, eager)
    for g, w in zip([p.grad for p in t.values() if p.grad is not None], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_one_compiled_step_trains_layers_of_different_tiles() -> None:
    """Two pipelines whose tables align in different blocks, trained through one compiled function: its second
    compilation reads the launch's tile sizes as symbolic ints (they differed from the first call's), which the
    GEMM's backward must specialise, not hash."""
    gen = torch.Generator().manual_seed(87)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    x = torch.randn(9, 32, generator=gen).to(DEVICE)
    logits = torch.randn(9, 4, generator=gen).to(DEVICE)

    def step(pipeline: mf.Pipeline, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
        loss: torch.Tensor = pipeline(mf.MoEInput(x, logits)).hidden_states.square().mean()
        return loss

    compiled = torch.compile(step, backend="aot_eager")
    for block_m in (None, 64, 32):
        pipeline = _pipeline(4, 2, 32, t, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32, block_m=block_m)
        (want,) = torch.autograd.grad(step(pipeline, x, logits), [t["w13"]])
        (got,) = torch.autograd.grad(compiled(pipeline, x, logits), [t["w13"]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_training_forward_traces_in_one_graph(layout: str) -> None:
    """The training forward's gate/up GEMM runs without its fused activation on the table's unfused launch
    (``MoEConfig.gate_up_unfused``, made with the table): no launch record is made in the forward, which Dynamo could
    not trace (a frozen attrs class's ``__init__``); in slot order too."""
    gen = torch.Generator().manual_seed(86)
    t = _tensors(4, 32, 48, True, torch.float32, gen)
    pipeline = _pipeline(4, 2, 32, t, ACTIVATIONS["swiglu"], mf.RoutingConfig(), torch.float32, **LAYOUTS[layout])
    x = torch.randn(9, 32, generator=gen).to(DEVICE)
    logits = torch.randn(9, 4, generator=gen).to(DEVICE)

    def forward(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = pipeline(mf.MoEInput(x, logits)).hidden_states
        return out

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, logits), forward(x, logits)
    torch.testing.assert_close(got, want)
    (d_got,) = torch.autograd.grad(got.square().sum(), [t["w13"]])
    (d_want,) = torch.autograd.grad(want.square().sum(), [t["w13"]])
    torch.testing.assert_close(d_got, d_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(mf.ActivationKind))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_backward_reads_back_the_activation_the_forward_ran(kind: mf.ActivationKind, approximate: str) -> None:
    """The backward rebuilds the activation from the kernels' arguments: every kind, layout, GELU form and the kind's
    two numbers (alpha and limit, or the softcaps) come back as they went in (the identity of an ungated GEMM as no
    activation)."""
    from moeforge.kernels.activations import code_of, config_of, parameters_of

    numbers = (dict(gate_softcap=1.5, up_softcap=6.0) if kind is mf.ActivationKind.SOFTCAPPED_SWIGLU
               else dict(alpha=1.5, limit=6.0))
    for layout in mf.GateUpLayout:
        config = mf.ActivationConfig(kind, layout if kind.gated else mf.GateUpLayout.CONCATENATED,
                                     gelu_approximate=approximate if kind in (mf.ActivationKind.GELU,
                                                                              mf.ActivationKind.GEGLU) else "none",
                                     **numbers)
        back = config_of(code_of(config), config.gated, config.gate_up is mf.GateUpLayout.INTERLEAVED,
                         *parameters_of(config))
        assert back == (None if kind is mf.ActivationKind.IDENTITY else config)
