"""W4A16Method.load_checkpoint_experts: per-expert GPTQ (v1, v2) and AWQ checkpoints, packed here by
independent bit loops, into a layer whose forward is then checked against the float64 MoE over the
integers the checkpoint was made from; most tests call the hook directly, the last ones go through
``moeforge.checkpoint.load_weights``, which calls it for quantized layers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.errors import CheckpointError
from moeforge.quant.w4a16 import W4A16Method
from moeforge.reference import dense_moe
from test_int4_packing import _word, loop_awq, loop_gptq, random_int4

E, K, H, I, G = 3, 2, 64, 32, 32
Ints = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
PROJ = ("gate_proj", "up_proj", "down_proj")
MIXTRAL = ("w1", "w3", "w2")


def expert_ints(seed: int = 0, symmetric: bool = False, hidden: int = H, inter: int = I, group: int = G) -> Ints:
    """Random int4 values, zero points (1..15, so v1 can store them; 8 when symmetric) and fp16-exact
    scales per expert and projection (gate, up: [I, H]; down: [H, I])."""
    ints: Ints = {}
    for i in range(E):
        for j, proj in enumerate(("gate", "up", "down")):
            n, k = (hidden, inter) if proj == "down" else (inter, hidden)
            q, zeros, scales = random_int4(n, k, group, seed=seed * 100 + 3 * i + j)
            scales = (scales * 0.05).half().float()  # exact in fp16, as the checkpoint stores them
            ints[(i, proj)] = (q, torch.full_like(zeros, 8) if symmetric else zeros, scales)
    return ints


def checkpoint(ints: Ints, fmt: str, names: tuple[str, str, str] = PROJ, *, g_idx: bool = True,
               zeros: bool = True, only: tuple[str, ...] = ("gate", "up", "down")) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for (i, proj), (q, z, s) in ints.items():
        if proj not in only:
            continue
        name = names[("gate", "up", "down").index(proj)]
        packed = loop_awq(q, z, s) if fmt == "awq" else loop_gptq(q, z, s, v1=fmt == "gptq")
        if fmt != "awq" and g_idx:
            packed["g_idx"] = (torch.arange(q.shape[1]) // (q.shape[1] // s.shape[1])).int()
        if not zeros:
            del packed["qzeros"]
        tensors.update({f"experts.{i}.{name}.{key}": value for key, value in packed.items()})
    return tensors


def dense(ints: Ints, gated: bool = True, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 w13 [E, 2I, H] (or [E, I, H]) and w2 [E, H, I] straight from the integers."""
    def value(i: int, proj: str) -> torch.Tensor:
        q, z, s = ints[(i, proj)]
        group = q.shape[1] // s.shape[1]
        return (q.double() - z.double().repeat_interleave(group, 1)) * s.double().repeat_interleave(group, 1)

    w13, w2 = [], []
    for i in range(E):
        gate, up = value(i, "gate"), value(i, "up")
        if not gated:
            w13.append(up)
        elif interleaved:
            w13.append(torch.stack([gate, up], dim=1).flatten(0, 1))
        else:
            w13.append(torch.cat([gate, up]))
        w2.append(value(i, "down"))
    return torch.stack(w13), torch.stack(w2)


def make_layer(method: W4A16Method, dtype: torch.dtype = torch.float32, hidden: int = H, inter: int = I,
               **kwargs: Any) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(E, K, hidden, inter, quant=method, backend="torch", environ={}, dtype=dtype, **kwargs)


def load(layer: mf.MoELayer, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What moeforge.checkpoint.load_weights would do with the hook: check, then copy, then process."""
    loaded = layer.quant.load_checkpoint_experts(layer, tensors)
    for name, value in loaded.items():
        target = getattr(layer, name)
        assert value.shape == target.shape and value.dtype == target.dtype, name
    with torch.no_grad():
        for name, value in loaded.items():
            getattr(layer, name).copy_(value)
    layer.process_weights_after_loading()
    return loaded


def check_forward(layer: mf.MoELayer, w13: torch.Tensor, w2: torch.Tensor, bound: float = 1e-5) -> None:
    x = torch.randn(10, layer.hidden_size, generator=torch.Generator().manual_seed(3)).to(layer.dtype)
    with torch.no_grad():
        logits = layer.router_logits(x)
        ref = dense_moe(x, logits, top_k=layer.top_k, w13=w13, w2=w2, w13_bias=getattr(layer, "w13_bias", None),
                        w2_bias=getattr(layer, "w2_bias", None), routing=layer.routing, activation=layer.activation)
        out = layer(x, logits)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < bound, rel


def _dequantized(layer: mf.MoELayer, prefix: str) -> torch.Tensor:
    from moeforge.quant.int4_packing import dequantize_int4

    return dequantize_int4(getattr(layer, f"{prefix}_qweight"), getattr(layer, f"{prefix}_scales"),
                           getattr(layer, f"{prefix}_qzeros", None), torch.float64)


# -- formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_load_each_format(fmt: str, dtype: torch.dtype) -> None:
    ints = expert_ints(seed=1)
    layer = make_layer(W4A16Method(G, checkpoint_format=fmt), dtype)
    loaded = load(layer, checkpoint(ints, fmt))
    assert set(loaded) == {"w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"}
    w13, w2 = dense(ints)
    # the scales are fp16-exact, so the loaded int4 weights reproduce the checkpoint's exactly
    assert torch.equal(_dequantized(layer, "w13"), w13) and torch.equal(_dequantized(layer, "w2"), w2)
    check_forward(layer, w13, w2, 1e-5 if dtype == torch.float32 else 3e-3)


def test_v1_and_v2_differ_by_one_in_the_zero_points() -> None:
    """Why checkpoint_format is explicit: the same tensors read as v1 and as v2 give zeros 1 apart."""
    tensors = checkpoint(expert_ints(seed=2), "gptq")
    as_v1 = W4A16Method(G).load_checkpoint_experts(make_layer(W4A16Method(G)), tensors)
    layer_v2 = make_layer(W4A16Method(G, checkpoint_format="gptq_v2"))
    as_v2 = layer_v2.quant.load_checkpoint_experts(layer_v2, tensors)
    assert torch.equal(as_v1["w2_qzeros"].long() - as_v2["w2_qzeros"].long(), torch.ones_like(as_v1["w2_qzeros"]).long())
    assert torch.equal(as_v1["w2_qweight"], as_v2["w2_qweight"])


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("with_zeros", [True, False])
def test_symmetric_checkpoint(fmt: str, with_zeros: bool) -> None:
    ints = expert_ints(seed=3, symmetric=True)
    tensors = checkpoint(ints, fmt, zeros=with_zeros)
    if with_zeros and fmt == "gptq":
        assert tensors["experts.0.gate_proj.qzeros"][0, 0].item() == _word([7] * 8)  # v1 stores 8 - 1
    layer = make_layer(W4A16Method(G, zero_points=False, checkpoint_format=fmt))
    loaded = load(layer, tensors)
    assert "w13_qzeros" not in loaded and layer.w13_qzeros is None
    check_forward(layer, *dense(ints))
    if with_zeros:  # a symmetric checkpoint also loads into a zero-point layer (all zeros 8)
        zp = make_layer(W4A16Method(G, checkpoint_format=fmt))
        load(zp, tensors)
        assert bool((zp.w2_qzeros == 8).all())


def test_asymmetric_checkpoint_into_a_symmetric_layer_is_refused() -> None:
    layer = make_layer(W4A16Method(G, zero_points=False))
    with pytest.raises(CheckpointError, match=r"'experts\.0\.up_proj\.qzeros'.*zero_points=True"):
        layer.quant.load_checkpoint_experts(layer, checkpoint(expert_ints(), "gptq"))


# -- namings and layouts ---------------------------------------------------------------------------------


def test_mixtral_naming_interleaved_layout_and_biases() -> None:
    ints = expert_ints(seed=4)
    tensors = checkpoint(ints, "awq", MIXTRAL)
    gen = torch.Generator().manual_seed(9)
    for i in range(E):
        for name, size in (("w1", I), ("w3", I), ("w2", H)):
            tensors[f"experts.{i}.{name}.bias"] = (torch.randn(size, generator=gen) * 0.1).half()
    activation = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED)
    layer = make_layer(W4A16Method(G, checkpoint_format="awq"), activation=activation, expert_bias=True)
    loaded = load(layer, tensors)
    assert torch.equal(loaded["w13_bias"][1, 0::2], tensors["experts.1.w1.bias"].float())
    assert torch.equal(loaded["w13_bias"][1, 1::2], tensors["experts.1.w3.bias"].float())
    w13, w2 = dense(ints, interleaved=True)
    assert torch.equal(_dequantized(layer, "w13"), w13)
    check_forward(layer, w13, w2)


def test_plain_activation_reads_up_proj_only() -> None:
    ints = expert_ints(seed=5)
    layer = make_layer(W4A16Method(G), activation=mf.ActivationConfig(mf.ActivationKind.RELU2))
    load(layer, checkpoint(ints, "gptq", only=("up", "down")))
    check_forward(layer, *dense(ints, gated=False))


@pytest.mark.parametrize("group_size", [64, 128])
def test_larger_groups(group_size: int) -> None:
    ints = expert_ints(seed=6, hidden=128, inter=128, group=group_size)
    layer = make_layer(W4A16Method(group_size, checkpoint_format="awq"), hidden=128, inter=128)
    load(layer, checkpoint(ints, "awq"))
    check_forward(layer, *dense(ints))


class Recording(Mapping[str, torch.Tensor]):
    """A lazy checkpoint view that records which tensors were read (membership tests read nothing)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.read = tensors, set[str]()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_reads_only_the_expert_tensors() -> None:
    tensors = checkpoint(expert_ints(), "gptq")
    expert_keys = set(tensors)
    tensors["gate.weight"] = torch.zeros(E, H)
    tensors["experts.3.gate_proj.qweight"] = torch.zeros(1, dtype=torch.int32)  # beyond num_experts
    view = Recording(tensors)
    layer = make_layer(W4A16Method(G))
    layer.quant.load_checkpoint_experts(layer, view)
    assert view.read == expert_keys


# -- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["experts.2.down_proj.scales", "experts.0.gate_proj.qweight",
                                 "experts.1.up_proj.qzeros"])
def test_missing_tensor_names_its_key(key: str) -> None:
    tensors = checkpoint(expert_ints(), "gptq")
    del tensors[key]
    layer = make_layer(W4A16Method(G))
    with pytest.raises(CheckpointError, match=f"missing tensor '{key}'".replace(".", r"\.")):
        layer.quant.load_checkpoint_experts(layer, tensors)


def test_misshapen_tensor_names_its_key_and_shapes() -> None:
    tensors = checkpoint(expert_ints(), "gptq")
    tensors["experts.1.up_proj.qweight"] = tensors["experts.1.up_proj.qweight"][:, :8]
    layer = make_layer(W4A16Method(G))
    with pytest.raises(CheckpointError, match=r"'experts\.1\.up_proj\.qweight' has shape \(8, 8\), expected \(8, 32\)"):
        layer.quant.load_checkpoint_experts(layer, tensors)


def test_wrong_format_and_group_size_get_a_hint() -> None:
    awq = checkpoint(expert_ints(), "awq")
    layer = make_layer(W4A16Method(G))  # gptq
    with pytest.raises(CheckpointError, match="checkpoint_format='awq'"):
        layer.quant.load_checkpoint_experts(layer, awq)
    gptq = checkpoint(expert_ints(), "gptq")
    awq_layer = make_layer(W4A16Method(G, checkpoint_format="awq"))
    with pytest.raises(CheckpointError, match="checkpoint_format='gptq'"):
        awq_layer.quant.load_checkpoint_experts(awq_layer, gptq)
    coarse = checkpoint(expert_ints(hidden=128, inter=128, group=64), "gptq")
    fine = make_layer(W4A16Method(32), hidden=128, inter=128)
    with pytest.raises(CheckpointError, match="group size looks like 64"):
        fine.quant.load_checkpoint_experts(fine, coarse)


def test_act_order_checkpoint_is_refused() -> None:
    tensors = checkpoint(expert_ints(hidden=128, inter=128), "gptq")  # trivial g_idx: loads (above)
    # desc_act=True: 32 inputs per group, but scattered over the row
    shuffled = torch.randperm(128, generator=torch.Generator().manual_seed(0)) // G
    tensors["experts.2.gate_proj.g_idx"] = shuffled.int()
    layer = make_layer(W4A16Method(G), hidden=128, inter=128)
    with pytest.raises(CheckpointError, match=r"'experts\.2\.gate_proj\.g_idx'.*act-order"):
        layer.quant.load_checkpoint_experts(layer, tensors)


def test_mixed_naming_is_refused() -> None:
    tensors = checkpoint(expert_ints(), "gptq")
    tensors.update(checkpoint(expert_ints(), "gptq", MIXTRAL))
    layer = make_layer(W4A16Method(G))
    with pytest.raises(CheckpointError, match="mix naming"):
        layer.quant.load_checkpoint_experts(layer, tensors)


def test_bias_problems() -> None:
    layer = make_layer(W4A16Method(G), expert_bias=True)
    tensors = checkpoint(expert_ints(), "gptq")
    with pytest.raises(CheckpointError, match=r"missing tensor 'experts\.0\.up_proj\.bias'"):
        layer.quant.load_checkpoint_experts(layer, tensors)
    for i in range(E):
        for name, size in (("gate_proj", I), ("up_proj", I), ("down_proj", H)):
            tensors[f"experts.{i}.{name}.bias"] = torch.zeros(size + (name == "down_proj"))
    with pytest.raises(CheckpointError, match=r"'experts\.0\.down_proj\.bias'"):
        layer.quant.load_checkpoint_experts(layer, tensors)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_load_weights_reads_a_quantized_block_through_the_hook(fmt: str) -> None:
    """moeforge.checkpoint.load_weights: the experts by the quant method's hook, the router as usual,
    under a prefix, all in one atomic load; unknown keys reported."""
    from moeforge.checkpoint import ExpertNaming, load_weights

    ints = expert_ints(seed=3)
    prefix = "model.layers.0.mlp."
    tensors = {prefix + key: value for key, value in checkpoint(ints, fmt).items()}
    router = torch.randn(E, H)
    tensors[prefix + "gate.weight"] = router
    tensors[prefix + "experts.9.gate_proj.qweight"] = torch.zeros(1, dtype=torch.int32)  # not this layer's
    layer = make_layer(W4A16Method(group_size=G, checkpoint_format=fmt))
    report = load_weights(layer, tensors, prefix, on_unused="ignore")
    assert report.naming is ExpertNaming.QUANT_METHOD
    assert report.unused == (prefix + "experts.9.gate_proj.qweight",)
    assert prefix + "experts.0.gate_proj.qweight" in report.loaded and prefix + "gate.weight" in report.loaded
    assert layer.router is not None and torch.equal(layer.router.weight, router)
    w13, w2 = dense(ints)
    x = torch.randn(5, H, dtype=torch.float64)
    logits = x @ router.double().t()
    want = dense_moe(x, logits, top_k=K, w13=w13, w2=w2)
    got = layer(x.float(), logits.float()).double()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_load_weights_is_atomic_for_a_quantized_block() -> None:
    from moeforge.checkpoint import load_weights

    ints = expert_ints(seed=4)
    tensors = checkpoint(ints, "gptq")
    del tensors["experts.2.down_proj.scales"]
    tensors["gate.weight"] = torch.randn(E, H)
    layer = make_layer(W4A16Method(group_size=G))
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    with pytest.raises(CheckpointError, match="experts.2.down_proj.scales"):
        load_weights(layer, tensors)
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name]), name
