"""The Triton routing path for the DeepSeek-V3, PhiMoE and Llama-4 families.

* ``RoutingConfig.group_mask_value`` (what the dropped groups are masked with: ``-inf``, or ``0.0`` as
  in older ``transformers``) is computed by the routing kernel, not ignored;
* the sparsemixer routing (PhiMoE) is not in the kernel: ``TritonTopK`` refuses it, and a triton-backend
  ``MoELayer`` routes it with the torch ``TopK`` stage;
* Llama-4's routing weights scale the experts' input (``RoutingWeights.ON_INPUT``): the block-aligned dispatch
  scales each copy's row, so the layer runs on the triton path, trains there, and quantizes after the dispatch.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py``) at tiny shapes in fp32.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.roles import LayerConfig  # noqa: E402
from moeforge.kernels import topk  # noqa: E402
from moeforge.reference import layer_reference  # noqa: E402
from moeforge.stages import select_experts  # noqa: E402
from moeforge.stages.triton import AlignDispatch, TritonTopK  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FILLS = [0.0, -0.25, float("-inf")]


def _deepseek(fill: float, n_group: int = 4, topk_group: int = 2, **kwargs: Any) -> mf.RoutingConfig:
    kwargs.setdefault("scoring", mf.Scoring.SIGMOID)
    return mf.RoutingConfig(selection_bias=True, n_group=n_group, topk_group=topk_group, group_mask_value=fill,
                            **kwargs)


def _inputs(tokens: int, experts: int, seed: int, bias_shift: float = -0.6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.4 + bias_shift  # mostly negative: fills can win
    return logits.to(DEVICE), bias.to(DEVICE)


# (experts, top_k, config): E=24 and E=12 are not powers of two, so the kernel has padding columns.
ROUTINGS = {
    "sum-top2": lambda fill: (32, 6, _deepseek(fill, routed_scaling_factor=2.5)),
    "max": lambda fill: (24, 5, _deepseek(fill, n_group=4, topk_group=3, group_score=mf.GroupScore.MAX)),
    "softmax-no-renorm": lambda fill: (12, 4, _deepseek(fill, n_group=3, topk_group=2, renormalize=False,
                                                        scoring=mf.Scoring.SOFTMAX)),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("tokens", [0, 1, 29])
def test_kernel_group_mask_value_matches_select_experts(name: str, fill: float, tokens: int) -> None:
    experts, k, config = ROUTINGS[name](fill)
    logits, bias = _inputs(tokens, experts, seed=tokens + 1)
    weights, ids = topk.route(logits, bias, k, **topk.routing_flags(config))
    ref = select_experts(logits, k, config, bias)
    assert torch.equal(ids, ref.ids)
    torch.testing.assert_close(weights, ref.weights, atol=1e-6, rtol=1e-5)


def test_kernel_zero_fill_changes_the_choice() -> None:
    """The test above would pass with a kernel that ignores the fill if the fill never mattered."""
    experts, k, zero = ROUTINGS["sum-top2"](0.0)
    logits, bias = _inputs(64, experts, seed=3)
    _, ids_zero = topk.route(logits, bias, k, **topk.routing_flags(zero))
    _, ids_inf = topk.route(logits, bias, k, **topk.routing_flags(_deepseek(float("-inf"), routed_scaling_factor=2.5)))
    changed = (ids_zero.sort(-1).values != ids_inf.sort(-1).values).any(-1)
    assert 0 < int(changed.sum()) < 64


def test_kernel_zero_fill_never_picks_padding_columns() -> None:
    """12 experts (16 kernel columns), every kept choice negative, k = all kept experts: the 3 dropped
    experts (at 0.0) come first, then the kept ones, and never a padding column."""
    config = _deepseek(0.0, n_group=4, topk_group=3)
    logits, _ = _inputs(9, 12, seed=4)
    bias = torch.full((12,), -5.0, device=DEVICE)
    weights, ids = topk.route(logits, bias, 9, **topk.routing_flags(config))
    assert int(ids.max()) < 12
    ref = select_experts(logits, 9, config, bias)
    assert torch.equal(ids, ref.ids)
    torch.testing.assert_close(weights, ref.weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fill", FILLS)
def test_triton_topk_stage_honours_the_fill(fill: float) -> None:
    experts, k, config = ROUTINGS["sum-top2"](fill)
    logits, bias = _inputs(17, experts, seed=5)
    x = torch.randn(17, 8, device=DEVICE)
    triton_stage = TritonTopK(experts, k, config, bias)
    torch_stage = mf.TopK(experts, k, config, bias)
    got, want = triton_stage(mf.MoEInput(x, logits)).topk, torch_stage(mf.MoEInput(x, logits)).topk
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-5)
    if fill != float("-inf"):
        assert "dropped groups ->" in triton_stage.summary()


# -- the sparsemixer is not in the kernel --------------------------------------------------------------

SPARSEMIXER = mf.RoutingConfig(sparsemixer_eps=0.1, renormalize=False)


def test_triton_topk_supports() -> None:
    assert TritonTopK.supports(mf.RoutingConfig())
    assert TritonTopK.supports(_deepseek(0.0))
    assert not TritonTopK.supports(SPARSEMIXER)


def test_triton_topk_refuses_the_sparsemixer() -> None:
    with pytest.raises(mf.InputError, match="cannot compute"):
        TritonTopK(8, 2, SPARSEMIXER)
    with pytest.raises(mf.InputError, match="sparsemixer"):
        topk.routing_flags(SPARSEMIXER)


def _triton_layer(seed: int, quant: Optional[Callable[[], mf.QuantMethod]] = None,
                  **kwargs: Any) -> tuple[mf.MoELayer, mf.MoELayer]:
    """A triton-backend layer and the same layer on the torch backend (same weights, fp32; ``quant``: each layer's
    own quant method, made by it).

    Without CUDA the selector does not pick the triton implementations (they want a GPU); the kernels
    do run in the interpreter, so the layer is built with the selector told they can."""
    torch.manual_seed(seed)
    options: dict[str, Any] = dict(dtype=torch.float32, environ={}, device=DEVICE)
    if quant is not None:
        kwargs["quant"] = quant()
    reference = mf.MoELayer.from_preset(backend="torch", **options, **kwargs)
    with torch.no_grad():
        for param in reference.parameters():
            if param.dtype == torch.float32:  # (not a quantized storage)
                param.normal_(std=0.3)
        bias: Optional[torch.Tensor] = getattr(reference, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(std=0.4).sub_(0.5)
    if quant is not None:
        kwargs["quant"] = quant()
    if CUDA:
        layer = mf.MoELayer.from_preset(backend="triton", **options, **kwargs)
        layer.load_state_dict(reference.state_dict())
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LayerConfig, "triton_problem", lambda self: None)
            layer = mf.MoELayer.from_preset(backend="auto", **options, **kwargs)
        assert layer.backend is mf.Backend.TRITON
        layer.load_state_dict(reference.state_dict())
    return layer, reference


@pytest.mark.parametrize("tokens", [1, 21])
def test_triton_layer_routes_the_sparsemixer_with_the_torch_stage(tokens: int) -> None:
    layer, reference = _triton_layer(0, family="phimoe", num_experts=8, hidden_size=32, intermediate_size=16,
                                     router_jitter_noise=0.1)
    stages = layer.pipeline.stages
    assert type(stages[0]) is mf.TopK and "sparsemixer" in layer.describe()
    assert "AlignDispatch" in layer.describe()  # the rest is the triton path
    x = torch.randn(tokens, 32, device=DEVICE)
    with torch.no_grad():
        out, ref = layer(x), reference(x)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
        dense = layer_reference(layer, x)
    assert float((out.double() - dense).norm() / dense.norm()) < 1e-5


@pytest.mark.parametrize("fill", [0.0, float("-inf")])
def test_triton_layer_deepseek_with_the_fill(fill: float) -> None:
    layer, reference = _triton_layer(1, family="deepseek_v3", num_experts=16, top_k=4, hidden_size=32,
                                     intermediate_size=16, n_group=4, topk_group=2, group_mask_value=fill)
    assert isinstance(layer.pipeline.stages[0], TritonTopK)
    x = torch.randn(19, 32, device=DEVICE)
    with torch.no_grad():
        out, ref = layer(x), reference(x)
        dense = layer_reference(layer, x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    assert float((out.double() - dense).norm() / dense.norm()) < 1e-5


def _llama4(seed: int, **kwargs: Any) -> tuple[mf.MoELayer, mf.MoELayer]:
    return _triton_layer(seed, family="llama4", num_experts=8, hidden_size=32, intermediate_size=16, **kwargs)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [0, 1, 21])
def test_triton_layer_llama4_scales_the_input_and_trains_as_the_torch_layer(tokens: int, top_k: int) -> None:
    layer, reference = _llama4(2, top_k=top_k)
    dispatch = layer.pipeline.stages[1]
    assert isinstance(dispatch, AlignDispatch) and dispatch.apply_routing_weights
    assert "weights on input" in layer.describe() and "Combine(unweighted" in layer.describe()
    x = torch.randn(tokens, 32, device=DEVICE)
    with torch.no_grad():
        out, ref = layer(x), reference(x)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    if tokens:
        assert float((out.double() - layer_reference(layer, x)).norm() / ref.double().norm()) < 1e-5
    grad = torch.randn(tokens, 32, device=DEVICE)

    def gradients(model: mf.MoELayer) -> list[Optional[torch.Tensor]]:
        rows = x.clone().requires_grad_()
        return list(torch.autograd.grad(model(rows), [rows, *model.parameters()], grad, allow_unused=True))

    for name, got, want in zip(["x", *dict(layer.named_parameters())], gradients(layer), gradients(reference)):
        if want is None or not want.any():
            assert got is None or not got.any(), name
        else:
            assert got is not None and torch.allclose(got, want, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("method", [mf.Fp8W8A8Method, lambda: mf.W4A16Method(group_size=32)],
                         ids=["fp8", "w4a16"])
def test_triton_layer_llama4_quantizes_after_scaling_the_rows(method: Any) -> None:
    layer, reference = _triton_layer(3, method, family="llama4", num_experts=8, top_k=1, hidden_size=64,
                                     intermediate_size=32)
    assert layer.dispatch_decision.dtype.value == "fp32"  # float rows on the wire: the weights scale them first
    x = torch.randn(13, 64, device=DEVICE)
    with torch.no_grad():
        out, ref = layer(x), reference(x)
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_a_dispatch_scaling_the_input_refuses_quantized_tokens() -> None:
    from moeforge.kernels.config import ConfigTable

    table = ConfigTable(4, 1)
    routing = mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)
    quantize = mf.QuantizeTokens(mf.PerTokenQuantizer())
    with pytest.raises(mf.ContractError, match="quantize after the dispatch"):
        mf.Pipeline([mf.TopK(4, 1, routing), quantize, AlignDispatch(4, table, apply_routing_weights=True)],
                    mf.input_spec(32, torch.float32, 4))


ADAPTERS = {"per-expert A": dict(rank=4, alpha=8.0), "shared A": dict(rank=2, shared_a=True),
            "a stack of three": dict(rank=4, alpha=4.0, count=3)}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_triton_layer_llama4_with_an_adapter_on_the_scaled_rows(adapter: str) -> None:
    # The adapters read the dispatch's rows, here one scaled row per copy (a shared A multiplies all of them with a
    # torch GEMM; a stack aligns the copies by (adapter, expert) pair).
    from moeforge.adapters import ExpertAdapter

    config = ExpertAdapter(**ADAPTERS[adapter])  # type: ignore[arg-type]
    layer, reference = _llama4(4, top_k=2, adapter=config)
    x = torch.randn(11, 32, device=DEVICE)
    ids = {"adapter_ids": torch.randint(0, config.count, (11,), device=DEVICE)} if config.count > 1 else {}
    with torch.no_grad():
        assert torch.allclose(layer(x, **ids), reference(x, **ids), atol=1e-5, rtol=1e-4)
    if config.count > 1:
        return  # (a stack serves; it has no backward)
    rows = [x.clone().requires_grad_() for _ in range(2)]
    got = torch.autograd.grad(layer(rows[0]).sum(), [rows[0], *layer.parameters()])
    want = torch.autograd.grad(reference(rows[1]).sum(), [rows[1], *reference.parameters()])
    for name, g, w in zip(["x", *dict(layer.named_parameters())], got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), name
