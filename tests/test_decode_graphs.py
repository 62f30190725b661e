"""Decode graphs: an eager forward at decode batch sizes replayed as a CUDA graph (moeforge.decode_graphs).

A replay gives the bits of the launched forward; it reads weights changed in place and captures anew for a
replaced one; it captures only what it may (no gradient recorded, CUDA, at most max_tokens rows, not inside the
caller's own capture) and launches everything else as before; it keeps at most max_graphs graphs. The same through
MoELayer(decode_graphs=...) and through transformers' experts (hf_experts.capture_decode_graphs).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import moeforge as mf
from moeforge.decode_graphs import DecodeGraphs, DecodeGraphSettings

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"max_graphs": -1}, {"max_tokens": 2.5}, {"max_graphs": True}])
def test_settings_are_positive_ints(bad: dict[str, object]) -> None:
    with pytest.raises(mf.InputError, match="must be a positive int"):
        DecodeGraphSettings(**bad)  # type: ignore[arg-type]


def test_a_layer_takes_settings_only() -> None:
    with pytest.raises(mf.InputError, match="decode_graphs must be a DecodeGraphSettings"):
        mf.MoELayer(4, 2, 16, 8, decode_graphs=16, backend="torch")  # type: ignore[arg-type]


def test_a_cpu_layer_runs_as_without_graphs() -> None:
    torch.manual_seed(0)
    plain = mf.MoELayer(4, 2, 16, 8, backend="torch")
    graphed = mf.MoELayer(4, 2, 16, 8, backend="torch", decode_graphs=DecodeGraphSettings())
    graphed.load_state_dict(plain.state_dict())
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(graphed(x), plain(x))
    assert graphed.decode_graphs is not None and len(graphed.decode_graphs) == 0


def test_copies_start_without_graphs() -> None:
    graphs = DecodeGraphs(DecodeGraphSettings(max_tokens=4))
    for copied in (copy.deepcopy(graphs), pickle.loads(pickle.dumps(graphs))):
        assert copied.settings == graphs.settings and len(copied) == 0 and copied is not graphs


def _layer(**kwargs: object) -> mf.MoELayer:
    torch.manual_seed(0)
    layer = mf.MoELayer(8, 2, 64, 32, dtype=torch.bfloat16, device="cuda", backend="triton", **kwargs)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.05)
    return layer


def _pair(**settings: int) -> tuple[mf.MoELayer, mf.MoELayer]:
    plain = _layer()
    graphed = _layer(decode_graphs=DecodeGraphSettings(**settings))
    graphed.load_state_dict(plain.state_dict())
    return plain, graphed


@gpu
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_a_replay_gives_the_launched_bits(tokens: int) -> None:
    plain, graphed = _pair()
    with torch.no_grad():
        for seed in range(3):  # the capture, then replays on other values
            gen = torch.Generator("cuda").manual_seed(seed)
            x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            assert torch.equal(graphed(x), plain(x))
    assert graphed.decode_graphs is not None and len(graphed.decode_graphs) == 1


@gpu
def test_what_is_not_captured_runs_as_before() -> None:
    plain, graphed = _pair(max_tokens=8)
    graphs = graphed.decode_graphs
    assert graphs is not None
    x = torch.randn(9, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(graphed(x), plain(x)) and len(graphs) == 0  # more rows than max_tokens
        assert graphed(x[:0]).shape == (0, 64) and len(graphs) == 0
    out = graphed(x[:4])  # grad mode, weights requiring grad: autograd records the call
    assert out.grad_fn is not None and len(graphs) == 0
    out.float().sum().backward()
    assert graphed.w13_weight.grad is not None
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        static = x[:4].clone()
        graphed(static)  # warm the kernels up outside the caller's capture
        with torch.cuda.graph(graph):  # the caller's own capture: the layer launches inside it
            captured = graphed(static)
        graph.replay()
        assert torch.equal(captured, plain(static)) and len(graphs) == 1  # the warm-up call was captured


@gpu
def test_weights_changed_in_place_are_read_and_replaced_ones_captured_anew() -> None:
    plain, graphed = _pair()
    graphs = graphed.decode_graphs
    assert graphs is not None
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graphed(x)
        for layer in (plain, graphed):
            layer.w2_weight.mul_(2)
        assert torch.equal(graphed(x), plain(x)) and len(graphs) == 1
        new = torch.randn_like(plain.w13_weight) * 0.05
        for layer in (plain, graphed):
            layer.w13_weight = torch.nn.Parameter(new.clone())
        assert torch.equal(graphed(x), plain(x)) and len(graphs) == 2


@gpu
def test_a_graph_captured_in_inference_mode_replays_outside_it() -> None:
    plain, graphed = _pair()
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        first = graphed(x)
    with torch.no_grad():
        again = graphed(x)
        want = plain(x)  # outside no_grad the forward would take the training path: other roundings
    assert torch.equal(first, again) and torch.equal(again, want)


@gpu
def test_at_most_max_graphs_are_kept() -> None:
    plain, graphed = _pair(max_graphs=2)
    with torch.no_grad():
        for tokens in (1, 2, 3, 1):
            x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(graphed(x), plain(x))
    assert graphed.decode_graphs is not None and len(graphed.decode_graphs) == 2


@gpu
def test_a_rebuilt_pipeline_drops_the_graphs() -> None:
    plain, graphed = _pair()
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graphed(x)
        graphed.rebuild_pipeline()
        assert graphed.decode_graphs is not None and len(graphed.decode_graphs) == 0
        assert torch.equal(graphed(x), plain(x))


@gpu
def test_transformers_experts_replay_their_graphs() -> None:
    transformers = pytest.importorskip("transformers")
    from moeforge import hf_experts

    hf_experts.register()
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_experts_implementation("moeforge")
    ids = torch.randint(0, 128, (2, 5), device="cuda")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert hf_experts.capture_decode_graphs(model, DecodeGraphSettings(max_tokens=4)) == 2
        got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    experts = model.model.layers[0].mlp.experts
    graphs = experts.__dict__["_moeforge_decode_graphs"]
    assert len(graphs) == 1  # the decode steps' 2 tokens (the prefill's 10 are more than max_tokens)
    assert hf_experts.capture_decode_graphs(model, None) == 2 and "_moeforge_decode_graphs" not in experts.__dict__
