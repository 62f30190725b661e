"""``Mxfp4Method(shuffled=True)``: MXFP4 layers holding their blocks in the triton GEMMs' pre-shuffled layout.

The parameters hold the shuffled bytes (gate/up rows paired when interleaved, their scales' rows too); every way the
weights are written (initialised, ``quantize_weights``, ``load_checkpoint_experts``, ``load_state_dict``) stores that
layout, and ``state_dict()`` gives the plain one, so a shuffled layer and a plain one exchange state dicts and
checkpoints and compute the same outputs: bitwise on the torch backend (the same dequantized weights), and on the
triton pipeline (under the interpreter on CPU, compiled on a GPU) against the torch backend. Concatenated and
interleaved gate/up rows (GPT-OSS's), with biases; a layout built for one activation refuses stages of the other.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.errors import InputError
from moeforge.kernels import shuffle
from moeforge.quant.mxfp4 import CHECKPOINT_KEYS, LAYOUT_ATTRIBUTE, Mxfp4Method, StoredLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))

E, K, H, I = 4, 2, 128, 64
INTERLEAVED = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED)
ACTIVATIONS = {"concatenated": mf.ActivationConfig(), "interleaved": INTERLEAVED}


def _layer(shuffled: bool, activation: str, **kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("backend", "torch")
    torch.manual_seed(kwargs.pop("seed", 0))
    return mf.MoELayer(E, K, H, I, quant=Mxfp4Method(shuffled=shuffled), activation=ACTIVATIONS[activation],
                       expert_bias=True, environ={}, **kwargs)


def _x(tokens: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_repr_and_table_key() -> None:
    assert repr(Mxfp4Method(shuffled=True)) == "Mxfp4Method(shuffled=True)"
    assert Mxfp4Method(shuffled=True).table_key == "mxfp4-shuffled"
    assert Mxfp4Method().table_key == "mxfp4" and repr(Mxfp4Method()) == "Mxfp4Method()"


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@torch.no_grad()
def test_parameters_hold_the_shuffled_bytes_and_the_state_dict_the_plain_ones(activation: str) -> None:
    plain = _layer(False, activation, seed=3)
    shuffled = _layer(True, activation, seed=4)
    layout = getattr(shuffled, LAYOUT_ATTRIBUTE)
    assert layout == StoredLayout(True, activation == "interleaved")
    shuffled.load_state_dict(plain.state_dict())
    _assert_same_state(shuffled.state_dict(), plain.state_dict())
    paired = activation == "interleaved"
    want = shuffle.shuffle(plain.w13_blocks.flatten(2), paired=paired).reshape(plain.w13_blocks.shape)
    assert torch.equal(shuffled.w13_blocks, want) and not torch.equal(shuffled.w13_blocks, plain.w13_blocks)
    want_scales = shuffle.pair_rows(plain.w13_scales) if paired else plain.w13_scales
    assert torch.equal(shuffled.w13_scales, want_scales)
    assert torch.equal(shuffled.w2_blocks,
                       shuffle.shuffle(plain.w2_blocks.flatten(2)).reshape(plain.w2_blocks.shape))
    assert torch.equal(shuffled.w2_scales, plain.w2_scales)  # the down weight's rows are never paired
    for tokens in (0, 1, 7):
        x = _x(tokens)
        assert torch.equal(shuffled(x), plain(x))
    # and back: a plain layer takes the shuffled layer's state dict
    again = _layer(False, activation, seed=5)
    again.load_state_dict(shuffled.state_dict())
    assert torch.equal(again(_x(5)), plain(_x(5)))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@torch.no_grad()
def test_quantize_weights_and_the_initial_weights_store_the_layout(activation: str) -> None:
    # the initial (random, quantized) weights: a shuffled layer's plain state is what a plain layer of the same
    # seed draws
    _assert_same_state(_layer(True, activation, seed=6).state_dict(), _layer(False, activation, seed=6).state_dict())
    plain, shuffled = _layer(False, activation), _layer(True, activation, seed=9)
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=gen) * I ** -0.5
    for layer in (plain, shuffled):
        quant = layer.quant
        assert isinstance(quant, Mxfp4Method)
        quant.quantize_weights(layer, w13, w2)
    state = {k: v for k, v in plain.state_dict().items() if "blocks" in k or "scales" in k}
    for name, value in state.items():
        assert torch.equal(shuffled.state_dict()[name], value), name


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@torch.no_grad()
def test_a_gpt_oss_checkpoint_loads_into_a_shuffled_layer(activation: str) -> None:
    source = _layer(False, activation, seed=11)
    names = {name: key for key, name in CHECKPOINT_KEYS.items()}
    tensors = {names[name]: getattr(source, name).detach().clone() for name in names}
    target = _layer(True, activation, seed=12)
    assert source.router is not None and target.router is not None
    target.router.weight.copy_(source.router.weight)
    loaded = target.quant.load_checkpoint_experts(target, tensors)
    for name, value in loaded.items():
        getattr(target, name).copy_(value)
    target.process_weights_after_loading()
    assert not torch.equal(target.w13_blocks, source.w13_blocks)
    assert torch.equal(target(_x(6)), source(_x(6)))


@torch.no_grad()
def test_weights_created_again_keep_one_pair_of_hooks() -> None:
    layer = _layer(True, "concatenated", seed=1)
    quant = layer.quant
    assert isinstance(quant, Mxfp4Method)
    quant.create_weights(layer, num_experts=E, hidden_size=H, intermediate_size=I, gated=True, bias=True,
                         dtype=torch.float32, device="cpu")
    plain = _layer(False, "concatenated", seed=2)
    layer.load_state_dict(plain.state_dict())
    _assert_same_state(layer.state_dict(), plain.state_dict())
    # the parameters hold the bytes shuffled once (two pairs of hooks would shuffle them twice, and unshuffle twice)
    want = shuffle.shuffle(plain.w13_blocks.flatten(2)).reshape(plain.w13_blocks.shape)
    assert torch.equal(layer.w13_blocks, want)
    assert torch.equal(layer(_x(5)), plain(_x(5)))


def test_stages_for_the_other_gate_up_layout_are_refused() -> None:
    pytest.importorskip("triton")
    from moeforge.kernels.config import ConfigTable

    layer = _layer(True, "concatenated")
    with pytest.raises(InputError, match="shuffled for concatenated gate/up rows"):
        layer.quant.expert_stages(layer, activation=INTERLEAVED, routing_weights_in_epilogue=True,
                                  backend=mf.Backend.TRITON, configs=ConfigTable(E, K))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_triton_pipeline_reads_the_shuffled_blocks(activation: str) -> None:
    """The triton experts (default tiles: swapped, 64 weight rows; and a table's) against the same shuffled layer
    on the torch backend: one token, a batch, every token on one expert, an empty batch."""
    pytest.importorskip("triton")
    from test_quant_triton_layer import DEVICE, _triton_pipeline

    from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig

    reference = _layer(True, activation, dtype=torch.float16, device=DEVICE)
    gemm = GemmConfig(32, 64, 64, group_m=2, num_warps=4, num_stages=2, swap=True)
    tuned = ConfigTable(E, K, (1,), (MoEConfig(gemm, gemm),), weight_format="mxfp4-shuffled")
    one_expert = torch.full((9, E), -5.0, device=DEVICE)
    one_expert[:, 2] = 5.0
    for table in (None, tuned):
        pipeline = _triton_pipeline(reference, table)
        assert "shuffled weight" in pipeline.describe()
        gen = torch.Generator().manual_seed(9)
        for tokens, logits in ((1, None), (9, None), (9, one_expert), (0, None)):
            x = torch.randn(tokens, H, generator=gen).to(DEVICE, torch.float16)
            logits = torch.randn(tokens, E, generator=gen).to(DEVICE) if logits is None else logits
            with torch.no_grad():
                got = pipeline(mf.MoEInput(x, logits)).hidden_states
                want = reference(x, logits)
            assert got.shape == (tokens, H)
            if tokens:
                assert not torch.isnan(got.float()).any()
                err = float((got.float() - want.float()).norm() / want.float().norm())
                assert err < 2e-2, (activation, tokens, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 333])
def test_a_shuffled_gpt_oss_like_layer_equals_the_plain_one(tokens: int) -> None:
    """GPT-OSS-like (interleaved clamped SwiGLU, biases) at a realistic width in bf16, the triton backend: the
    shuffled layer against the plain one with the same state (the same tiles' outputs agree to rounding)."""
    kwargs = dict(activation=INTERLEAVED, expert_bias=True, dtype=torch.bfloat16, device="cuda", environ={},
                  backend="triton")
    torch.manual_seed(0)
    plain = mf.MoELayer(32, 4, 1024, 512, quant=Mxfp4Method(), **kwargs)  # type: ignore[arg-type]
    shuffled = mf.MoELayer(32, 4, 1024, 512, quant=Mxfp4Method(shuffled=True), **kwargs)  # type: ignore[arg-type]
    shuffled.load_state_dict(plain.state_dict())
    slow = mf.MoELayer(32, 4, 1024, 512, quant=Mxfp4Method(), **{**kwargs, "backend": "torch"})  # type: ignore[arg-type]
    slow.load_state_dict(plain.state_dict())
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want, ref = shuffled(x), plain(x), slow(x)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
