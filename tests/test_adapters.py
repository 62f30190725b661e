"""Expert adapters (LoRA on the experts' GEMMs, moeforge.adapters): the layer with an adapter computes what the layer
with the merged weights ``W + scale · B A`` computes, differentiates with respect to A and B, starts as the base
layer (B zero), and refuses what it does not compute when it is built.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.adapters import ADAPTER_NAMES, AdaptedGemm, ExpertAdapter
from moeforge.stages.gemm import GemmRole

E, K, H, I = 6, 2, 16, 8


def _layer(adapter: ExpertAdapter, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(seed)
    return mf.MoELayer(E, K, H, I, adapter=adapter, dtype=dtype, **kwargs)


def _randomise_adapter(layer: mf.MoELayer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name_a, name_b in ADAPTER_NAMES.values():
            for name in (name_a, name_b):
                if hasattr(layer, name):
                    param = getattr(layer, name)
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype) * 0.3)


def _merged(layer: mf.MoELayer, adapter: ExpertAdapter) -> mf.MoELayer:
    """A layer without adapter whose expert weights are the adapted layer's merged ``W + scale · B A``."""
    plain = mf.MoELayer(E, K, H, I, dtype=layer.dtype)
    state = {name: value for name, value in layer.state_dict().items() if "lora" not in name}
    with torch.no_grad():
        for role, weight in ((GemmRole.GATE_UP, "w13_weight"), (GemmRole.DOWN, "w2_weight")):
            if role in adapter.targets:
                name_a, name_b = ADAPTER_NAMES[role]
                a, b = getattr(layer, name_a), getattr(layer, name_b)
                state[weight] = state[weight] + adapter.scale * torch.bmm(b, a.expand(b.shape[0], -1, -1))
    plain.load_state_dict(state)
    return plain


@pytest.mark.parametrize("adapter", [
    ExpertAdapter(rank=4, alpha=8),
    ExpertAdapter(rank=3, targets="down"),
    ExpertAdapter(rank=2, alpha=1.5, targets=["gate_up"], shared_a=True),
])
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_the_adapted_layer_equals_the_merged_weights(adapter: ExpertAdapter, tokens: int) -> None:
    layer = _layer(adapter)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        base = layer(x)
        _randomise_adapter(layer, 1)
        got = layer(x)
        want = _merged(layer, adapter)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if tokens:
        assert (got - base).abs().max() > 1e-3  # the adapter changes the output


def test_padded_rows_take_the_adapter_too() -> None:
    adapter = ExpertAdapter(rank=3, alpha=3)
    layer = _layer(adapter, dispatcher="padded")
    _randomise_adapter(layer, 13)
    x = torch.randn(10, H)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _merged(layer, adapter)(x), rtol=1e-5, atol=1e-5)


def test_a_new_adapter_leaves_the_output_as_it_was() -> None:
    layer = _layer(ExpertAdapter(rank=4))
    plain = mf.MoELayer(E, K, H, I)
    plain.load_state_dict({name: value for name, value in layer.state_dict().items() if "lora" not in name})
    x = torch.randn(9, H)
    with torch.no_grad():
        assert torch.equal(layer(x), plain(x))
    assert not layer.w13_lora_b.any() and layer.w13_lora_a.abs().sum() > 0


def test_every_token_on_one_expert_and_top_k_equal_to_the_experts() -> None:
    adapter = ExpertAdapter(rank=2, alpha=4)
    for top_k, logits in ((1, torch.full((7, E), -10.0).index_fill_(1, torch.tensor([2]), 10.0)), (E, None)):
        torch.manual_seed(3)
        layer = mf.MoELayer(E, top_k, H, I, adapter=adapter)
        _randomise_adapter(layer, 4)
        plain = mf.MoELayer(E, top_k, H, I)
        state = _merged(layer, adapter).state_dict()
        plain.load_state_dict(state)
        x = torch.randn(7, H)
        with torch.no_grad():
            torch.testing.assert_close(layer(x, logits), plain(x, logits), rtol=1e-5, atol=1e-5)


def test_the_adapter_differentiates_like_the_merged_weights() -> None:
    adapter = ExpertAdapter(rank=2, alpha=3)
    layer = _layer(adapter, dtype=torch.float64, seed=5)
    _randomise_adapter(layer, 6)
    for name, param in layer.named_parameters():
        param.requires_grad_("lora" in name)  # the base frozen, as in a fine-tune
    x = torch.randn(6, H, dtype=torch.float64, requires_grad=True)
    params = [layer.w13_lora_a, layer.w13_lora_b, layer.w2_lora_a, layer.w2_lora_b]
    assert torch.autograd.gradcheck(lambda inp, *ps: layer(inp), (x, *params), eps=1e-6, atol=1e-5)
    out = layer(x).sum()
    grads = torch.autograd.grad(out, params)
    # the same gradients through the merged weight W + scale · B A, by autograd on the dense product
    a13, b13, a2, b2 = (p.detach().clone().requires_grad_() for p in params)
    merged = _merged(layer, adapter)
    base13 = merged.w13_weight.detach() - adapter.scale * torch.bmm(b13.detach(), a13.detach())
    base2 = merged.w2_weight.detach() - adapter.scale * torch.bmm(b2.detach(), a2.detach())
    dense = _dense_forward(merged, x.detach(), base13 + adapter.scale * torch.bmm(b13, a13),
                           base2 + adapter.scale * torch.bmm(b2, a2))
    want = torch.autograd.grad(dense.sum(), [a13, b13, a2, b2])
    for got_grad, want_grad in zip(grads, want):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-9)


def _dense_forward(layer: mf.MoELayer, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Softmax top-k routing and SwiGLU experts, each token through its experts, with the given weights."""
    logits = layer.router_logits(x)
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for k in range(K):
        hidden = torch.einsum("th,tnh->tn", x, w13[ids[:, k]])
        gate, up = hidden.chunk(2, dim=-1)
        out = out + weights[:, k:k + 1] * torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, w2[ids[:, k]])
    return out


def test_fine_tuning_the_adapter_alone_lowers_the_loss() -> None:
    layer = _layer(ExpertAdapter(rank=4, alpha=8), seed=7)
    for name, param in layer.named_parameters():
        param.requires_grad_("lora" in name)
    x, target = torch.randn(32, H), torch.randn(32, H)
    optimizer = torch.optim.Adam([p for p in layer.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0]
    assert layer.w13_weight.grad is None  # the base stayed frozen


def test_the_pipeline_shows_the_adapter() -> None:
    layer = _layer(ExpertAdapter(rank=4, alpha=8, shared_a=True))
    text = layer.describe()
    assert "LoRA r=4 x2" in text and "LoRA adapter r=4, scale 2 on gate_up, down, one A shared" in text
    assert sum(isinstance(stage, AdaptedGemm) for stage in layer.pipeline.stages) == 2
    assert layer.backend is mf.Backend.TORCH
    assert layer.w13_lora_a.shape == (1, 4, H) and layer.w2_lora_b.shape == (E, H, 4)


@pytest.mark.parametrize("bad", [{"rank": 0}, {"rank": 2.0}, {"rank": 2, "alpha": -1.0}, {"rank": 2, "targets": []},
                                 {"rank": 2, "targets": "up"}, {"rank": 2, "shared_a": 1}])
def test_bad_adapter_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises((mf.InputError, TypeError)):
        ExpertAdapter(**bad)


@pytest.mark.parametrize("method", ["unquantized", "w4a16", "mxfp4", "nvfp4", "fp8", "int8"])
def test_over_a_quantized_base_the_update_is_the_low_rank_product(method: str) -> None:
    # A float adapter over frozen quantized weights: each adapted GEMM's output is its base GEMM's plus
    # scale * (x A^T) B^T of each row's expert, whatever the base's format; 8-bit rows (W8A8) read dequantized.
    from moeforge.stages.quantize import dequantize

    quant = {"unquantized": None, "w4a16": mf.W4A16Method(group_size=32), "mxfp4": mf.Mxfp4Method(),
             "nvfp4": mf.Nvfp4Method(), "fp8": mf.Fp8W8A8Method(), "int8": mf.Int8W8A8Method()}[method]
    adapter = ExpertAdapter(rank=3, alpha=6)
    torch.manual_seed(8)
    layer = mf.MoELayer(4, 2, 64, 64, quant=quant, adapter=adapter)
    _randomise_adapter(layer, 9)
    payload: Any = mf.MoEInput(torch.randn(11, 64), torch.randn(11, 4))
    checked = 0
    with torch.no_grad():
        for stage in layer.pipeline.stages:
            if isinstance(stage, AdaptedGemm):
                rows, counts = dequantize(payload.x, torch.float32), payload.counts().tolist()
                name_a, name_b = ADAPTER_NAMES[stage.role]
                a, b = getattr(layer, name_a), getattr(layer, name_b)
                want = torch.cat([part @ a[e].T @ b[e].T for e, part in enumerate(rows.split(counts))]) * adapter.scale
                got = stage(payload).x.data - stage.base(payload).x.data
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                checked += 1
            payload = stage(payload)
    assert checked == 2


def test_an_adapter_over_frozen_int4_weights_trains_like_one_over_their_float_values() -> None:
    # QLoRA-style: the W4A16 GEMMs pass gradients to their rows through the frozen weights, so the adapter gets the
    # gradients it would get over the dequantized float weights.
    from moeforge.quant.w4a16 import int4_experts

    adapter = ExpertAdapter(rank=2, alpha=4)
    torch.manual_seed(10)
    quantized = mf.MoELayer(4, 2, 64, 64, quant=mf.W4A16Method(group_size=32), adapter=adapter)
    _randomise_adapter(quantized, 11)
    state = {name: value for name, value in quantized.state_dict().items() if "lora" in name or "router" in name}
    for stage, name in ((quantized.pipeline.stages[2], "w13_weight"), (quantized.pipeline.stages[4], "w2_weight")):
        assert isinstance(stage, AdaptedGemm)
        decoded = int4_experts(stage.base.weight())  # type: ignore[attr-defined]
        state[name] = torch.stack([decoded.expert(e) for e in range(4)])
    dense = mf.MoELayer(4, 2, 64, 64, adapter=adapter)
    dense.load_state_dict(state)
    x = torch.randn(9, 64)
    grads = []
    for layer in (quantized, dense):
        for name, param in layer.named_parameters():
            param.requires_grad_("lora" in name)
        out = layer(x)
        grads.append((out, torch.autograd.grad(out.square().sum(), [layer.w13_lora_a, layer.w13_lora_b,
                                                                     layer.w2_lora_a, layer.w2_lora_b])))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-5)
    for got, want in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(mf.errors.InferenceOnlyError):  # without an adapter the quantized layer stays inference-only
        plain = mf.MoELayer(4, 2, 64, 64, quant=mf.W4A16Method(group_size=32))
        plain(x.requires_grad_()).sum().backward()


def test_what_it_does_not_compute_is_refused_when_built() -> None:
    with pytest.raises(mf.InputError, match="adapter must be an ExpertAdapter"):
        mf.MoELayer(E, K, H, I, adapter=4)  # type: ignore[arg-type]
    with pytest.raises(mf.ContractError, match="NVFP4 rows carry no global scale"):  # rows quantized to NVFP4
        mf.MoELayer(E, K, 128, 128, adapter=ExpertAdapter(rank=2), dispatch_dtype="nvfp4",
                    quant=mf.Nvfp4Method(input_global_scale=4.0 / (6 * 448)))


def test_an_adapter_over_a_w8a8_base_serves_and_refuses_a_backward() -> None:
    # 8-bit rows have no gradient (the quantization): the layer stays inference-only, with the adapter too.
    layer = mf.MoELayer(E, K, 128, 128, adapter=ExpertAdapter(rank=2), quant=mf.Fp8W8A8Method())
    _randomise_adapter(layer, 3)
    x = torch.randn(5, 128)
    with torch.no_grad():
        assert layer(x).shape == (5, 128)
    with pytest.raises(mf.errors.InferenceOnlyError):
        layer(x.requires_grad_()).sum().backward()


@pytest.mark.parametrize("layout", [mf.Layout.EXPERT_SORTED, mf.Layout.EXPERT_PADDED])
@pytest.mark.parametrize("role,weights_in_epilogue", [(GemmRole.GATE_UP, False), (GemmRole.DOWN, False),
                                                      (GemmRole.DOWN, True)])
def test_an_adapted_gemm_honours_its_contract(layout: mf.Layout, role: GemmRole, weights_in_epilogue: bool) -> None:
    # Property test (moeforge.testing): on drawn payloads of either expert-grouped layout the stage produces what its
    # output spec says (the base GEMM's spec: the adapter changes values, not formats).
    from moeforge.testing import assert_stage_honours_contract

    experts, rank, k, n = 3, 2, 8, 6
    gen = torch.Generator().manual_seed(12)
    base = mf.GroupedGemm(role, torch.randn(experts, n, k, generator=gen), apply_routing_weights=weights_in_epilogue)
    stage = AdaptedGemm(base, torch.randn(experts, rank, k, generator=gen), torch.randn(experts, n, rank, generator=gen),
                        1.5)
    kind = mf.PayloadKind.DISPATCHED if role is GemmRole.GATE_UP else mf.PayloadKind.EXPERT_HIDDEN
    spec = mf.Spec(kind, layout, mf.DType.FP32, k, num_experts=experts, top_k=2,
                   group_list_type=mf.GroupListType.COUNT if layout is mf.Layout.EXPERT_SORTED else None,
                   expert_ids=mf.ExpertIds.LOCAL, activations=0 if role is GemmRole.GATE_UP else 1)
    assert stage.output_spec(spec) == base.output_spec(spec)
    assert_stage_honours_contract(stage, spec, max_examples=8)


# -- a stack of adapters, each token choosing its own (ExpertAdapter(count=...), forward(..., adapter_ids=...)) -------


def _merged_for(layer: mf.MoELayer, adapter: ExpertAdapter, index: int) -> mf.MoELayer:
    """A layer without adapter whose expert weights are ``W + scale · B A`` of the stack's adapter ``index``
    (``-1``: the base weights)."""
    plain = mf.MoELayer(E, K, H, I, dtype=layer.dtype)
    state = {name: value for name, value in layer.state_dict().items() if "lora" not in name}
    with torch.no_grad():
        for role, weight in ((GemmRole.GATE_UP, "w13_weight"), (GemmRole.DOWN, "w2_weight")):
            if role in adapter.targets and index >= 0:
                name_a, name_b = ADAPTER_NAMES[role]
                a, b = getattr(layer, name_a)[index], getattr(layer, name_b)[index]
                state[weight] = state[weight] + adapter.scale * torch.bmm(b, a.expand(b.shape[0], -1, -1))
    plain.load_state_dict(state)
    return plain


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("adapter", [ExpertAdapter(rank=3, alpha=6, count=3),
                                     ExpertAdapter(rank=2, count=2, shared_a=True, targets="gate_up")])
def test_each_token_takes_its_own_adapter_of_a_stack(dispatcher: str, adapter: ExpertAdapter) -> None:
    layer = _layer(adapter, dispatcher=dispatcher)
    _randomise_adapter(layer, 5)
    assert layer.w13_lora_b.shape[0] == adapter.count and "adapters" in layer.describe()
    x = torch.randn(12, H)
    ids = torch.tensor([0, 1, -1, 1, 0, 0, -1, 1, 1, 0, -1, 0]) % adapter.count - (torch.arange(12) % 5 == 2).long()
    with torch.no_grad():
        got = layer(x, adapter_ids=ids)
        for index in range(-1, adapter.count):
            chosen = ids == index
            torch.testing.assert_close(got[chosen], _merged_for(layer, adapter, index)(x)[chosen], rtol=1e-5,
                                       atol=1e-5)
        assert torch.equal(layer(x.view(3, 4, H), adapter_ids=ids.view(3, 4)).view(12, H), got)  # [B, S] ids


def test_an_adapter_no_token_chose_gets_no_gradient() -> None:
    layer = _layer(ExpertAdapter(rank=2, count=3))
    _randomise_adapter(layer, 6)
    x = torch.randn(9, H)
    ids = torch.tensor([0, 2, 2, -1, 0, 2, 0, -1, 2])
    layer(x, adapter_ids=ids).square().sum().backward()
    for name in ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"):
        grad = getattr(layer, name).grad
        assert grad is not None and grad[1].abs().max() == 0 and grad[0].abs().max() > 0 and grad[2].abs().max() > 0


def test_adapter_ids_are_checked() -> None:
    stacked = _layer(ExpertAdapter(rank=2, count=2))
    x = torch.randn(4, H)
    with pytest.raises(mf.InputError, match="stack of 2: pass adapter_ids"):
        stacked(x)
    with pytest.raises(mf.InputError, match=r"must lie in \[-1, 2\)"):
        stacked(x, adapter_ids=torch.tensor([0, 1, 2, 0]))
    with pytest.raises(mf.InputError, match="one per token"):
        stacked(x, adapter_ids=torch.tensor([0, 1]))
    with pytest.raises(mf.InputError, match="int32 or int64"):
        stacked(x, adapter_ids=torch.tensor([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(mf.InputError, match="this layer has one adapter"):
        _layer(ExpertAdapter(rank=2))(x, adapter_ids=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(mf.InputError, match="this layer has none"):
        mf.MoELayer(E, K, H, I)(x, adapter_ids=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(mf.InputError, match="count must be a positive int"):
        ExpertAdapter(rank=2, count=0)
    from moeforge.peft_adapters import to_peft

    with pytest.raises(mf.InputError, match="name which one"):
        to_peft(stacked)
    with pytest.raises(mf.InputError, match="name which one"):
        to_peft(stacked, index=2)
    with pytest.raises(mf.InputError, match="this layer has one"):
        to_peft(_layer(ExpertAdapter(rank=2)), index=0)
