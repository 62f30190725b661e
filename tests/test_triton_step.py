"""The triton experts' training step as one autograd node (``moeforge/stages/triton_step.py``): the pipeline runs the
dispatch, both GEMMs, the activation and the combine as one ``autograd.Function`` where a call records gradients,
and the output and every gradient are the stages' own, bit for bit.

Each check runs the same pipeline twice on the same inputs: through :meth:`Pipeline.__call__` (the joined run where it
takes the call) and stage by stage (what the pipeline did before), and compares the bits — both run the same kernels
on the same machine, so the comparison holds on any CPU. On CPU under the interpreter at tiny shapes; on a GPU the
same at the layers' own tiles.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.kernels.config import ConfigTable  # noqa: E402
from moeforge.payloads import Activations, MoEInput, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages import triton_step  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, HIDDEN, INTER = 4, 32, 24

ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "gpt-oss": mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    "relu2": mf.ActivationConfig(mf.ActivationKind.RELU2),
}

CASES = {  # tokens, top_k, every token's experts (None: drawn)
    "spread": (13, 2, None),
    "one token": (1, 3, None),
    "every token on experts 0 and 1": (9, 2, [[0, 1]] * 9),
    "top_k = experts": (6, EXPERTS, None),
    "an idle expert": (10, 1, [[e % 3] for e in range(10)]),
}


def _weights(act: mf.ActivationConfig, bias: bool, dtype: torch.dtype, seed: int
             ) -> dict[str, Optional[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    n13 = (2 if act.gated else 1) * INTER

    def parameter(*shape: int, scale: float) -> torch.nn.Parameter:
        return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype))

    return {"w13": parameter(EXPERTS, n13, HIDDEN, scale=HIDDEN ** -0.5),
            "w2": parameter(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5),
            "b13": parameter(EXPERTS, n13, scale=0.1) if bias else None,
            "b2": parameter(EXPERTS, HIDDEN, scale=0.1) if bias else None}


def _experts(t: dict[str, Any], act: mf.ActivationConfig, dtype: torch.dtype, top_k: int,  # type: ignore[type-arg]
             combine: Optional[Combine] = None, slot_rows: Optional[bool] = None,
             weights_on_input: bool = False) -> mf.Pipeline:
    """The experts' four stages; ``weights_on_input``: the dispatch scales each copy's row by its weight and the
    combine sums them unweighted (Llama-4's composition)."""
    table = ConfigTable(EXPERTS, top_k)
    spec = mf.input_spec(HIDDEN, dtype, EXPERTS).evolve(kind=mf.PayloadKind.ROUTED, top_k=top_k)
    if weights_on_input:
        spec = spec.evolve(weights_at=mf.RoutingWeights.ON_INPUT)
        combine = combine or Combine(apply_routing_weights=False)
    if combine is not None and combine.routed_scaling_factor is not None:
        spec = spec.evolve(scaling_factor=mf.ScalingFactor.PENDING, pending_scale=combine.routed_scaling_factor)
    return mf.Pipeline([
        AlignDispatch(EXPERTS, table, slot_rows, apply_routing_weights=weights_on_input),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, t["w13"], table, t["b13"], act),
        FusedGroupedGemm(mf.GemmRole.DOWN, t["w2"], table, t["b2"]),
        combine or Combine(),
    ], spec)


def _routed(tokens: int, top_k: int, ids: Any, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.as_tensor(ids).reshape(tokens, top_k).to(DEVICE, torch.int32)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    grad = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    return x, weights, ids, grad


def _staged(pipeline: mf.Pipeline, payload: Any) -> Any:  # type: ignore[type-arg]
    """The pipeline's stages one by one: what it ran before the joined run."""
    for stage in pipeline.stages:
        payload = stage(payload)
    return payload


def _counted(run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()`` and the number of training steps it ran as one node."""
    calls = []
    apply = triton_step._Step.apply
    try:
        triton_step._Step.apply = lambda *args: calls.append(1) or apply(*args)  # type: ignore[method-assign]
        return run(), len(calls)
    finally:
        triton_step._Step.apply = apply  # type: ignore[method-assign]


def _counted_inference(run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()`` and the number of inference calls it ran as one unit."""
    calls = []
    inference = triton_step.ExpertsStep._inference
    try:
        triton_step.ExpertsStep._inference = (  # type: ignore[method-assign]
            lambda self, *args: calls.append(1) or inference(self, *args))
        return run(), len(calls)
    finally:
        triton_step.ExpertsStep._inference = inference  # type: ignore[method-assign]


def _both(pipeline: mf.Pipeline, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,  # type: ignore[type-arg]
          leaves: list[torch.Tensor], grad: torch.Tensor, joins: int = 1) -> None:
    """The pipeline's output and the gradients of ``leaves`` (``x`` and ``weights`` among them where they require
    grad), through the pipeline (``joins``: the steps run as one node) and stage by stage: the same bits."""
    results = []
    for run in (pipeline, lambda payload: _staged(pipeline, payload)):
        def step() -> list[torch.Tensor]:
            out = run(RoutedTokens(Activations(x), TopKOutput(weights, ids))).hidden_states
            return [out.detach(), *torch.autograd.grad(out, leaves, grad, allow_unused=True)]
        result, calls = _counted(step)
        results.append(result)
        assert calls == (joins if run is pipeline else 0)
    for index, (joined, staged) in enumerate(zip(*results)):
        assert (joined is None) == (staged is None), index
        if joined is not None:
            assert joined.dtype == staged.dtype and torch.equal(joined, staged), index


def _leaves(x: torch.Tensor, weights: torch.Tensor, t: dict[str, Any]) -> list[torch.Tensor]:
    x.requires_grad_(True)
    weights.requires_grad_(True)
    return [x, weights, *(p for p in t.values() if p is not None)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_node_gives_the_stages_bits_for_any_routing(case: str) -> None:
    tokens, top_k, ids = CASES[case]
    t = _weights(ACTIVATIONS["swiglu"], True, torch.float32, 1)
    x, weights, ids, grad = _routed(tokens, top_k, ids, torch.float32, 2)
    _both(_experts(t, ACTIVATIONS["swiglu"], torch.float32, top_k), x, weights, ids, _leaves(x, weights, t), grad)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_one_node_gives_the_stages_bits_for_every_activation(act: str) -> None:
    t = _weights(ACTIVATIONS[act], act == "gpt-oss", torch.float32, 3)
    x, weights, ids, grad = _routed(11, 2, None, torch.float32, 4)
    _both(_experts(t, ACTIVATIONS[act], torch.float32, 2), x, weights, ids, _leaves(x, weights, t), grad)


def test_one_node_gives_the_stages_bits_in_half_precision_with_a_scaled_combine_to_fp32() -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float16, 5)
    x, weights, ids, grad = _routed(12, 2, None, torch.float16, 6)
    combine = Combine(routed_scaling_factor=2.5, out_dtype=mf.DType.FP32)
    _both(_experts(t, ACTIVATIONS["swiglu"], torch.float16, 2, combine), x, weights, ids,
          _leaves(x, weights, t), grad.float())


@pytest.mark.parametrize("case", ["spread", "one token", "top_k = experts", "an idle expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_node_gives_the_stages_bits_with_the_weights_on_the_input(case: str, dtype: torch.dtype) -> None:
    # (Llama-4's composition: each copy's row scaled by its weight in the dispatch, the combine unweighted)
    tokens, top_k, ids = CASES[case]
    t = _weights(ACTIVATIONS["swiglu"], dtype == torch.float32, dtype, 22)
    x, weights, ids, grad = _routed(tokens, top_k, ids, dtype, 23)
    _both(_experts(t, ACTIVATIONS["swiglu"], dtype, top_k, weights_on_input=True), x, weights, ids,
          _leaves(x, weights, t), grad)


@pytest.mark.parametrize("requiring", ["x", "weights", "w13", "x weights"])
def test_one_node_with_the_weights_on_the_input_gives_the_stages_bits_whichever_inputs_require_grad(
        requiring: str) -> None:
    names = requiring.split()
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float16, 24)
    x, weights, ids, grad = _routed(10, 2, None, torch.float16, 25)
    tensors = {"x": x, "weights": weights, **t}
    for name, tensor in tensors.items():
        if tensor is not None:
            tensor.requires_grad_(name in names)
    _both(_experts(t, ACTIVATIONS["swiglu"], torch.float16, 2, weights_on_input=True), x, weights, ids,
          [tensors[n] for n in names], grad)


# which of the inputs require grad: the node runs wherever the gate/up GEMM records a gradient
REQUIRING = {
    "the rows alone": (["x"], 1),
    "the routing weights alone": (["weights"], 1),
    "the weights (a frozen input)": (["w13", "w2", "b13", "b2"], 1),
    "the gate/up weight alone": (["w13"], 1),
    "the down weights alone (the gate/up GEMM records nothing: the stages)": (["w2", "b2"], 0),
}


@pytest.mark.parametrize("requiring", sorted(REQUIRING))
def test_one_node_gives_the_stages_bits_whichever_inputs_require_grad(requiring: str) -> None:
    names, joins = REQUIRING[requiring]
    t = _weights(ACTIVATIONS["gpt-oss"], True, torch.float32, 7)
    x, weights, ids, grad = _routed(10, 2, None, torch.float32, 8)
    tensors = {"x": x, "weights": weights, **t}
    for name, tensor in tensors.items():
        tensor.requires_grad_(name in names)
    _both(_experts(t, ACTIVATIONS["gpt-oss"], torch.float32, 2), x, weights, ids, [tensors[n] for n in names],
          grad, joins)


def test_a_layer_routed_by_the_triton_kernel_trains_through_one_node_after_its_routing() -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float32, 9)
    experts = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    layer = mf.Pipeline([TritonTopK(EXPERTS, 2, mf.RoutingConfig()), *experts.stages],
                        mf.input_spec(HIDDEN, torch.float32, EXPERTS))
    assert layer.joined[1] is not None and "stages 1-4: the triton experts as one unit" in layer.describe()
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(7, HIDDEN, generator=gen).to(DEVICE).requires_grad_()
    logits = torch.randn(7, EXPERTS, generator=gen).to(DEVICE).requires_grad_()
    grad = torch.randn(7, HIDDEN, generator=gen).to(DEVICE)
    leaves = [x, logits, t["w13"], t["w2"]]
    results = []
    for run in (layer, lambda payload: _staged(layer, payload)):
        out, calls = _counted(lambda: run(MoEInput(x, logits)).hidden_states)
        assert calls == (1 if run is layer else 0)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, grad)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_calls_it_does_not_take_run_the_stages() -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float32, 11)
    pipeline = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    x, weights, ids, _ = _routed(5, 2, None, torch.float32, 12)

    def calls(payload: RoutedTokens, **kwargs: Any) -> int:
        return _counted(lambda: pipeline.run(payload, **kwargs))[1]

    routed = RoutedTokens(Activations(x), TopKOutput(weights, ids))
    assert calls(routed) == 1
    with torch.no_grad():  # (inference: the kernels called directly, no node)
        assert calls(routed) == 0 and _counted_inference(lambda: pipeline(routed))[1] == 1
    empty = RoutedTokens(Activations(x[:0]), TopKOutput(weights[:0], ids[:0]))  # (no copies: copy order)
    assert calls(empty) == 0 and pipeline(empty).hidden_states.shape == (0, HIDDEN)
    with torch.device(DEVICE):  # (a function mode: the ops serve)
        assert calls(routed) == 0
    saved = _stage_by_stage(pipeline)  # (what the GPU test compares with)
    assert calls(routed) == 0
    pipeline.joined = saved
    assert calls(routed) == 1
    with torch.autograd.graph.save_on_cpu():  # (saved-tensor hooks must see what the backward keeps: the stages)
        assert calls(routed) == 0
    debug = mf.Pipeline(pipeline.stages, pipeline.input_spec, debug=True)  # (checks every stage's payload)
    assert _counted(lambda: debug(routed))[1] == 0
    for p in t.values():
        if p is not None:
            p.requires_grad_(False)
    # (grad mode with nothing requiring grad: the stages, which gather into slot order there)
    assert calls(routed) == 0 and _counted_inference(lambda: pipeline(routed))[1] == 0


@pytest.mark.parametrize("pipeline_of", ["copy order", "weights in the down GEMM",
                                         "weights on the input and in the combine"])
def test_compositions_it_does_not_cover_have_no_joined_run(pipeline_of: str) -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float32, 13)
    table = ConfigTable(EXPERTS, 2)
    dispatch = AlignDispatch(EXPERTS, table, slot_rows=False if pipeline_of == "copy order" else None,
                             apply_routing_weights=pipeline_of.startswith("weights on the input"))
    in_gemm = pipeline_of == "weights in the down GEMM"
    stages = [dispatch, FusedGroupedGemm(mf.GemmRole.GATE_UP, t["w13"], table, activation=ACTIVATIONS["swiglu"]),
              FusedGroupedGemm(mf.GemmRole.DOWN, t["w2"], table, apply_routing_weights=in_gemm),
              Combine(apply_routing_weights=pipeline_of != "weights in the down GEMM")]
    assert dispatch.joined(tuple(stages[1:])) is None
    spec = mf.input_spec(HIDDEN, torch.float32, EXPERTS).evolve(kind=mf.PayloadKind.ROUTED, top_k=2)
    if dispatch.apply_routing_weights:  # (weights applied twice: the pipeline's contract refuses it too)
        with pytest.raises(mf.ContractError, match="routing_weights"):
            mf.Pipeline(stages, spec.evolve(weights_at=mf.RoutingWeights.ON_INPUT))
    else:
        assert mf.Pipeline(stages, spec).joined == (None,) * 4


def test_a_backward_that_keeps_the_graph_runs_twice_and_one_that_does_not_frees_it() -> None:
    t = _weights(ACTIVATIONS["swiglu"], True, torch.float32, 14)
    pipeline = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    x, weights, ids, grad = _routed(9, 2, None, torch.float32, 15)
    leaves = _leaves(x, weights, t)
    out = pipeline(RoutedTokens(Activations(x), TopKOutput(weights, ids))).hidden_states
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, leaves, grad)


def test_an_input_changed_in_place_before_the_backward_is_the_engines_error() -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float32, 16)
    pipeline = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    x, weights, ids, grad = _routed(6, 2, None, torch.float32, 17)
    out = pipeline(RoutedTokens(Activations(x), TopKOutput(weights, ids))).hidden_states
    with torch.no_grad():
        t["w13"].add_(1.0)  # (an optimizer step between the forward and the backward)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)


def test_the_arguments_the_step_passes_are_the_ops() -> None:
    # The step calls the op's function with the op's arguments by position (grouped_gemm_call.arguments): the names it
    # and the backward index by are the function's parameters, in order.
    import inspect

    from moeforge.kernels import grouped_gemm_call

    assert tuple(inspect.signature(grouped_gemm_call.launch).parameters) == grouped_gemm_call.ARGUMENT_NAMES


def _stage_by_stage(pipeline: mf.Pipeline) -> tuple[Any, ...]:  # type: ignore[type-arg]
    """Turn the pipeline's joined runs off (it then runs its stages one by one); returns what to put back."""
    joined = pipeline.joined
    pipeline.joined = (None,) * len(joined)
    return joined


def _layer_steps(layer: mf.MoELayer, x: torch.Tensor, grad: torch.Tensor, joins: int) -> list[list[torch.Tensor]]:
    """A training step of ``layer`` on ``x`` as the pipeline runs it (``joins`` steps as one node) and stage by stage:
    each one's output, input gradient and parameter gradients."""
    results = []
    for joined in (True, False):
        saved = None if joined else _stage_by_stage(layer.pipeline)
        try:
            xi = x.clone().requires_grad_()
            out, calls = _counted(lambda: layer(xi))
            out.backward(grad)
        finally:
            if saved is not None:
                layer.pipeline.joined = saved
        assert calls == (joins if joined else 0)
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])  # type: ignore[misc]
        layer.zero_grad()
    return results


GPU_LAYERS = {  # preset, sizes, tokens: the tables' tiles at real widths (Gluon kernels where the device runs them)
    "mixtral, its own shape": ("mixtral", dict(num_experts=8, top_k=2, hidden_size=4096,
                                               intermediate_size=14336), 1024),
    "qwen3_moe, its own shape": ("qwen3_moe", dict(num_experts=128, top_k=8, hidden_size=2048,
                                                   intermediate_size=768), 1024),
    "gpt_oss, small": ("gpt_oss", dict(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256), 300),
    "deepseek_v3, small": ("deepseek_v3", dict(num_experts=32, top_k=8, hidden_size=512, intermediate_size=256), 2048),
    "llama4, small (weights on the input)": ("llama4", dict(num_experts=16, top_k=1, hidden_size=512,
                                                             intermediate_size=256), 300),
}


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(GPU_LAYERS))
def test_a_bf16_layer_trains_with_the_stages_bits_on_the_gpu(name: str) -> None:
    preset, sizes, tokens = GPU_LAYERS[name]
    torch.manual_seed(0)
    layer = mf.MoELayer.from_preset(preset, **sizes, dtype=torch.bfloat16, device="cuda", backend="triton")
    assert "one autograd node" in layer.describe()
    x = torch.randn(tokens, sizes["hidden_size"], device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    for index, (a, b) in enumerate(zip(*_layer_steps(layer, x, grad, 1))):
        assert torch.equal(a, b), index


@pytest.mark.parametrize("reentrant", [False, True], ids=["saved-tensor hooks", "reentrant"])
def test_activation_checkpointing_gives_the_same_gradients(reentrant: bool) -> None:
    # Without reentry, torch.utils.checkpoint keeps what save_for_backward saves through saved-tensor hooks (the
    # stages run); with it, the forward runs without grad and the backward runs it again, with grad (one node).
    t = _weights(ACTIVATIONS["swiglu"], True, torch.float32, 18)
    pipeline = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    x, weights, ids, grad = _routed(8, 2, None, torch.float32, 19)
    leaves = _leaves(x, weights, t)

    def run(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = pipeline(RoutedTokens(Activations(x), TopKOutput(weights, ids))).hidden_states
        return out

    def grads(out: torch.Tensor) -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        out.backward(grad)  # (a reentrant checkpoint takes .backward(), not autograd.grad)
        return [leaf.grad for leaf in leaves]  # type: ignore[misc]

    plain = grads(run(x, weights))
    out, calls = _counted(lambda: torch.utils.checkpoint.checkpoint(run, x, weights, use_reentrant=reentrant))
    assert calls == 0
    checkpointed, calls = _counted(lambda: grads(out))
    assert calls == (1 if reentrant else 0)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU test above builds the layers as users do")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"])
def test_the_families_layers_train_through_one_node_with_the_stages_bits(family: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # (the selector wants a GPU for the triton stages; the interpreter runs them.) Llama-4 applies its routing weights
    # on the input (top_k 1, its own).
    from moeforge.roles import LayerConfig

    monkeypatch.setattr(LayerConfig, "triton_problem", lambda self: None)
    sizes: dict[str, Any] = dict(num_experts=EXPERTS, top_k=1 if family == "llama4" else 2, hidden_size=HIDDEN,
                                 intermediate_size=INTER)
    if family == "deepseek_v3":
        sizes.update(n_group=1, topk_group=1)
    torch.manual_seed(20)
    layer = mf.MoELayer.from_preset(family, **sizes, dtype=torch.float32, device=DEVICE, backend="auto")
    assert layer.backend is mf.Backend.TRITON
    assert "one autograd node" in layer.describe()
    x = torch.randn(9, HIDDEN)
    grad = torch.randn(9, HIDDEN)
    assert all(torch.equal(a, b) for a, b in zip(*_layer_steps(layer, x, grad, 1)))


INFERENCE = {  # case, activation, bias, dtype, combine, weights on the input
    **{case: (case, "swiglu", False, torch.float32, None, False) for case in CASES},
    **{f"{act}, bias": ("spread", act, True, torch.float32, None, False) for act in ("gpt-oss", "relu2")},
    "fp16, scaled to fp32": ("spread", "swiglu", False, torch.float16,
                             Combine(routed_scaling_factor=2.5, out_dtype=mf.DType.FP32), False),
    **{f"weights on the input, {case}": (case, "swiglu", False, torch.float16, None, True)
       for case in ("spread", "one token", "top_k = experts")},
}


@pytest.mark.parametrize("name", sorted(INFERENCE))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_inference_call_gives_the_stages_bits(name: str, mode: str) -> None:
    case, act, bias, dtype, combine, on_input = INFERENCE[name]
    tokens, top_k, ids = CASES[case]
    t = _weights(ACTIVATIONS[act], bias, dtype, 21)
    pipeline = _experts(t, ACTIVATIONS[act], dtype, top_k, combine, weights_on_input=on_input)
    x, weights, ids, _ = _routed(tokens, top_k, ids, dtype, 22)
    results = []
    for joined in (True, False):
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            routed = RoutedTokens(Activations(x), TopKOutput(weights, ids))
            out, calls = _counted_inference(
                lambda: (pipeline if joined else (lambda payload: _staged(pipeline, payload)))(routed))
        assert calls == (1 if joined else 0)
        results.append(out.hidden_states)
    assert results[0].dtype == results[1].dtype and torch.equal(*results)


def test_an_empty_batch_without_grad_gives_an_empty_output() -> None:
    t = _weights(ACTIVATIONS["swiglu"], False, torch.float32, 23)
    pipeline = _experts(t, ACTIVATIONS["swiglu"], torch.float32, 2)
    x, weights, ids, _ = _routed(4, 2, None, torch.float32, 24)
    with torch.no_grad():
        out, calls = _counted_inference(lambda: pipeline(RoutedTokens(Activations(x[:0]), TopKOutput(weights[:0],
                                                                                                     ids[:0]))))
    assert calls == 1 and out.hidden_states.shape == (0, HIDDEN)
