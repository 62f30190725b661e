"""``Mxfp4Method(shuffled=True)`` and ``Nvfp4Method(shuffled=True)``: FP4 layers holding their packed weights in
the triton GEMMs' pre-shuffled layout (:mod:`moeforge.quant.stored_layout`).

The parameters hold the shuffled bytes (gate/up rows paired when interleaved, their scales' rows too); every way the
weights are written (initialised, ``quantize_weights``, MXFP4's ``load_checkpoint_experts``, ``load_state_dict``)
stores that layout, and ``state_dict()`` gives the plain one, so a shuffled layer and a plain one exchange state
dicts (and GPT-OSS checkpoints) and compute the same outputs: bitwise on the torch backend (the same dequantized
weights), and on the triton pipeline (under the interpreter on CPU, compiled on a GPU) against the torch backend.
Concatenated and interleaved gate/up rows (GPT-OSS's), with biases; NVFP4 with float rows and with NVFP4 rows; a
layout built for one activation refuses stages of the other.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.errors import InputError
from moeforge.kernels import shuffle
from moeforge.quant.base import QuantMethod
from moeforge.quant.mxfp4 import CHECKPOINT_KEYS, Mxfp4Method
from moeforge.quant.nvfp4 import Nvfp4Method
from moeforge.quant.stored_layout import LAYOUT_ATTRIBUTE, StoredLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grids import grid  # noqa: E402

E, K, H, I = 4, 2, 128, 64
INTERLEAVED = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED)
ACTIVATIONS = {"concatenated": mf.ActivationConfig(), "interleaved": INTERLEAVED}
# the methods with a shuffled option, and the names of their packed weights and block scales ({}: w13 or w2)
METHODS: dict[str, tuple[Callable[..., QuantMethod], str, str]] = {
    "mxfp4": (Mxfp4Method, "{}_blocks", "{}_scales"),
    "nvfp4": (Nvfp4Method, "{}_weight", "{}_weight_scale"),
    "nvfp4-rows": (lambda **kw: Nvfp4Method(0.02, **kw), "{}_weight", "{}_weight_scale"),
}


def _layer(shuffled: bool, activation: str, fmt: str = "mxfp4", **kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("backend", "torch")
    torch.manual_seed(kwargs.pop("seed", 0))
    return mf.MoELayer(E, K, H, I, quant=METHODS[fmt][0](shuffled=shuffled), activation=ACTIVATIONS[activation],
                       expert_bias=True, environ={}, **kwargs)


def _packed(layer: mf.MoELayer, fmt: str, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s packed ``prefix`` weight as ``[E, N, K / 2]`` bytes, and its block scales."""
    data, scales = (getattr(layer, name.format(prefix)) for name in METHODS[fmt][1:])
    return data.reshape(*scales.shape[:-1], -1), scales


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
    assert repr(Nvfp4Method(shuffled=True)) == "Nvfp4Method(input_global_scale=None, shuffled=True)"
    assert Nvfp4Method(shuffled=True).table_key == "nvfp4-shuffled"
    assert Nvfp4Method(0.5, shuffled=True).table_key == "nvfp4-nvfp4rows-shuffled"
    assert Nvfp4Method(0.5).table_key == "nvfp4-nvfp4rows" and repr(Nvfp4Method()) == \
        "Nvfp4Method(input_global_scale=None)"


def test_nvfp4_sizes_that_are_not_whole_shuffled_blocks_are_refused() -> None:
    with pytest.raises(InputError, match=r"hidden_size divisible by 32.*Nvfp4Method\(\)"):
        mf.MoELayer(E, K, 48, I, quant=Nvfp4Method(shuffled=True), environ={})
    with pytest.raises(InputError, match="intermediate_size divisible by 32"):
        mf.MoELayer(E, K, H, 16, quant=Nvfp4Method(shuffled=True), environ={})
    mf.MoELayer(E, K, 48, 16, quant=Nvfp4Method(), environ={})  # plain NVFP4 takes multiples of 16
    with pytest.raises(InputError, match="shuffled must be a bool"):
        Nvfp4Method(shuffled=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", sorted(METHODS))
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@torch.no_grad()
def test_parameters_hold_the_shuffled_bytes_and_the_state_dict_the_plain_ones(activation: str, fmt: str) -> None:
    plain = _layer(False, activation, fmt, seed=3)
    shuffled = _layer(True, activation, fmt, seed=4)
    layout = getattr(shuffled, LAYOUT_ATTRIBUTE)
    assert layout == StoredLayout(True, activation == "interleaved")
    assert getattr(plain, LAYOUT_ATTRIBUTE) == StoredLayout()
    shuffled.load_state_dict(plain.state_dict())
    _assert_same_state(shuffled.state_dict(), plain.state_dict())
    paired = activation == "interleaved"
    (data, scales), (stored, stored_scales) = _packed(plain, fmt, "w13"), _packed(shuffled, fmt, "w13")
    assert torch.equal(stored, shuffle.shuffle(data, e2m1=True, paired=paired)) and not torch.equal(stored, data)
    assert torch.equal(stored_scales, shuffle.pair_rows(scales) if paired else scales)
    (data, scales), (stored, stored_scales) = _packed(plain, fmt, "w2"), _packed(shuffled, fmt, "w2")
    assert torch.equal(stored, shuffle.shuffle(data, e2m1=True))
    assert torch.equal(stored_scales, scales)  # the down weight's rows are never paired
    for tokens in (0, 1, 7):
        x = _x(tokens)
        assert torch.equal(shuffled(x), plain(x))
    # and back: a plain layer takes the shuffled layer's state dict
    again = _layer(False, activation, fmt, seed=5)
    again.load_state_dict(shuffled.state_dict())
    assert torch.equal(again(_x(5)), plain(_x(5)))


@pytest.mark.parametrize("fmt", sorted(METHODS))
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@torch.no_grad()
def test_quantize_weights_and_the_initial_weights_store_the_layout(activation: str, fmt: str) -> None:
    # the initial (random, quantized) weights: a shuffled layer's plain state is what a plain layer of the same
    # seed draws
    _assert_same_state(_layer(True, activation, fmt, seed=6).state_dict(),
                       _layer(False, activation, fmt, seed=6).state_dict())
    plain, shuffled = _layer(False, activation, fmt), _layer(True, activation, fmt, seed=9)
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=gen) * I ** -0.5
    for layer in (plain, shuffled):
        quant = layer.quant
        assert isinstance(quant, (Mxfp4Method, Nvfp4Method))
        quant.quantize_weights(layer, w13, w2)
    state = {k: v for k, v in plain.state_dict().items() if "bias" not in k and "router" not in k}
    assert len(state) >= 4
    for name, value in state.items():
        assert torch.equal(shuffled.state_dict()[name], value), name
    for name in ("router.weight", "w13_bias", "w2_bias"):  # (drawn from other seeds)
        shuffled.get_parameter(name).copy_(plain.get_parameter(name))
    assert torch.equal(shuffled(_x(5)), plain(_x(5)))


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


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@torch.no_grad()
def test_weights_created_again_keep_one_pair_of_hooks(fmt: str) -> None:
    layer = _layer(True, "concatenated", fmt, seed=1)
    quant = layer.quant
    assert isinstance(quant, (Mxfp4Method, Nvfp4Method))
    quant.create_weights(layer, num_experts=E, hidden_size=H, intermediate_size=I, gated=True, bias=True,
                         dtype=torch.float32, device="cpu")
    plain = _layer(False, "concatenated", fmt, seed=2)
    layer.load_state_dict(plain.state_dict())
    _assert_same_state(layer.state_dict(), plain.state_dict())
    # the parameters hold the bytes shuffled once (two pairs of hooks would shuffle them twice, and unshuffle twice)
    assert torch.equal(_packed(layer, fmt, "w13")[0], shuffle.shuffle(_packed(plain, fmt, "w13")[0], e2m1=True))
    assert torch.equal(layer(_x(5)), plain(_x(5)))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_stages_for_the_other_gate_up_layout_are_refused(fmt: str) -> None:
    pytest.importorskip("triton")
    from moeforge.kernels.config import ConfigTable

    layer = _layer(True, "concatenated", fmt)
    with pytest.raises(InputError, match="shuffled for concatenated gate/up rows"):
        selected_stages(layer.quant, layer, activation=INTERLEAVED, routing_weights_in_epilogue=True,
                                  backend=mf.Backend.TRITON, configs=ConfigTable(E, K))


@pytest.mark.parametrize(("activation", "fmt"), grid(sorted(ACTIVATIONS), sorted(METHODS)))
def test_the_triton_pipeline_reads_the_shuffled_blocks(activation: str, fmt: str) -> None:
    """The triton experts (default tiles: swapped, 64 weight rows; and a table's) against the same shuffled layer
    on the torch backend: one token, a batch, every token on one expert, an empty batch."""
    pytest.importorskip("triton")
    from test_quant_triton_layer import DEVICE, _triton_pipeline

    from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig

    reference = _layer(True, activation, fmt, dtype=torch.float16, device=DEVICE)
    gemm = GemmConfig(32, 64, 64, group_m=2, num_warps=4, num_stages=2, swap=True)
    tuned = ConfigTable(E, K, (1,), (MoEConfig(gemm, gemm),), weight_format=reference.quant.table_key)
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
@pytest.mark.parametrize("fmt", sorted(METHODS))
@pytest.mark.parametrize("tokens", [1, 64, 333])
def test_a_shuffled_gpt_oss_like_layer_equals_the_plain_one(tokens: int, fmt: str) -> None:
    """GPT-OSS-like (interleaved clamped SwiGLU, biases) at a realistic width in bf16, the triton backend: the
    shuffled layer against the plain one with the same state (the same tiles' outputs agree to rounding)."""
    kwargs = dict(activation=INTERLEAVED, expert_bias=True, dtype=torch.bfloat16, device="cuda", environ={},
                  backend="triton")
    method = METHODS[fmt][0]
    torch.manual_seed(0)
    plain = mf.MoELayer(32, 4, 1024, 512, quant=method(), **kwargs)  # type: ignore[arg-type]
    shuffled = mf.MoELayer(32, 4, 1024, 512, quant=method(shuffled=True), **kwargs)  # type: ignore[arg-type]
    shuffled.load_state_dict(plain.state_dict())
    slow = mf.MoELayer(32, 4, 1024, 512, quant=method(), **{**kwargs, "backend": "torch"})  # type: ignore[arg-type]
    slow.load_state_dict(plain.state_dict())
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want, ref = shuffled(x), plain(x), slow(x)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
