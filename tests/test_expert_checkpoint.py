"""The per-expert checkpoint loop (``moeforge.expert_checkpoint``): a quant method supplies only
``read_projection`` (how one projection's tensors become its format); the loader owns the naming, the
experts an expert-parallel rank holds, the gate/up layout, the biases and the stacking."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Optional

import pytest
import torch
from test_checkpoint_expert_parallel import RankOf

import moeforge as mf
from moeforge.checkpoint import load_weights
from moeforge.errors import CheckpointError
from moeforge.expert_checkpoint import Part, Projection, held_experts, read_per_expert
from moeforge.spec import FLOAT_DTYPES

E, K, H, I = 4, 2, 16, 8
PREFIX = "model.layers.1.mlp."


class ScaledMethod(mf.QuantMethod):
    """A format written outside moeforge: each projection stored as ``{key}.values`` (fp16) and a scalar
    ``{key}.multiplier``; the layer holds their product in its float dtype. It defines its weights, its
    stages (the unquantized ones) and ``read_projection`` — nothing about namings or expert ranges."""

    accepts: ClassVar[frozenset[mf.DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[mf.ScaleLayout]] = frozenset({mf.ScaleLayout.NONE})
    expert_parameters: ClassVar[tuple[str, ...]] = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
    compute_dtype_parameters: ClassVar[tuple[str, ...]] = expert_parameters

    def __init__(self) -> None:
        self.seen: list[Projection] = []

    def create_weights(self, layer: torch.nn.Module, **kwargs: Any) -> None:
        mf.UnquantizedMethod().create_weights(layer, **kwargs)

    def expert_stages(self, layer: torch.nn.Module, **kwargs: Any) -> list[mf.Stage[Any, Any]]:
        return mf.UnquantizedMethod().expert_stages(layer, **kwargs)

    def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                        projection: Projection) -> dict[str, torch.Tensor]:
        self.seen.append(projection)
        key = f"{projection.key}.values"
        if key not in tensors:
            raise CheckpointError(f"missing tensor '{key}'")
        values = tensors[key]
        if tuple(values.shape) != (projection.out_features, projection.in_features):
            raise CheckpointError(f"tensor '{key}' has shape {tuple(values.shape)}")
        weight = values.float() * tensors[f"{projection.key}.multiplier"].float()
        return {"weight": weight.to(getattr(layer, "w13_weight").dtype)}


def _checkpoint(names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), bias: bool = False,
                experts: range = range(E), seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(checkpoint relative to the block, the float gate/up/down/bias values it encodes per expert)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"gate.weight": torch.randn(E, H, generator=gen)}
    truth: dict[str, torch.Tensor] = {}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    for i in experts:
        for part, name in zip(("gate", "up", "down"), names):
            values = torch.randn(*shapes[part], generator=gen).half()
            multiplier = torch.tensor(float(i + 2))
            out[f"experts.{i}.{name}.values"] = values
            out[f"experts.{i}.{name}.multiplier"] = multiplier
            truth[f"{i}.{part}"] = values.float() * multiplier
            if bias:
                out[f"experts.{i}.{name}.bias"] = truth[f"{i}.{part}.bias"] = torch.randn(shapes[part][0],
                                                                                            generator=gen)
    return out, truth


def _layer(activation: Optional[mf.ActivationConfig] = None, **kwargs: Any) -> mf.MoELayer:
    return mf.MoELayer(E, K, H, I, quant=ScaledMethod(), backend="torch", dtype=torch.float32, environ={},
                       activation=activation or mf.ActivationConfig(), **kwargs)


def _prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PREFIX + key: value for key, value in tensors.items()}


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
@pytest.mark.parametrize("bias", [False, True])
def test_a_method_that_reads_one_projection_loads_a_whole_block(names: tuple[str, str, str], bias: bool) -> None:
    tensors, truth = _checkpoint(names, bias=bias)
    layer = _layer(expert_bias=bias)
    report = load_weights(layer, _prefixed(tensors), PREFIX, on_unused="raise")
    assert report.unused == ()
    for i in range(E):
        torch.testing.assert_close(layer.w13_weight[i], torch.cat([truth[f"{i}.gate"], truth[f"{i}.up"]]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(layer.w2_weight[i], truth[f"{i}.down"], rtol=0, atol=0)
        if bias:
            torch.testing.assert_close(layer.w13_bias[i],
                                       torch.cat([truth[f"{i}.gate.bias"], truth[f"{i}.up.bias"]]), rtol=0, atol=0)
            torch.testing.assert_close(layer.w2_bias[i], truth[f"{i}.down.bias"], rtol=0, atol=0)
    # the method was asked for each projection once, with the layer's sizes
    seen = layer.quant.seen  # type: ignore[attr-defined]
    assert [(p.key, p.part) for p in seen[:3]] == [(f"experts.0.{names[1]}", Part.UP),
                                                  (f"experts.0.{names[0]}", Part.GATE),
                                                  (f"experts.0.{names[2]}", Part.DOWN)]
    assert (seen[0].out_features, seen[0].in_features, seen[2].out_features, seen[2].in_features) == (I, H, H, I)
    assert len(seen) == 3 * E


def test_gate_and_up_rows_follow_an_interleaved_activation() -> None:
    tensors, truth = _checkpoint()
    activation = mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED)
    layer = _layer(activation)
    load_weights(layer, _prefixed(tensors), PREFIX, on_unused="raise")
    for i in range(E):
        assert torch.equal(layer.w13_weight[i, 0::2], truth[f"{i}.gate"])
        assert torch.equal(layer.w13_weight[i, 1::2], truth[f"{i}.up"])
    assert all(p.interleaved == (p.part is not Part.DOWN) for p in layer.quant.seen)  # type: ignore[attr-defined]


def test_a_plain_activation_reads_up_only() -> None:
    tensors, truth = _checkpoint()
    layer = _layer(mf.ActivationConfig(mf.ActivationKind.RELU2))
    report = load_weights(layer, _prefixed(tensors), PREFIX, on_unused="ignore")
    for i in range(E):
        assert torch.equal(layer.w13_weight[i], truth[f"{i}.up"])
    assert sorted(report.unused) == sorted(PREFIX + f"experts.{i}.gate_proj.{s}" for i in range(E)
                                           for s in ("values", "multiplier"))


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_reads_its_own_experts(rank: int) -> None:
    tensors, truth = _checkpoint(experts=range(2 * rank, 2 * rank + 2))  # a shard holding only this rank's experts
    layer = _layer(expert_parallel=RankOf(E, given_rank=rank, given_world=2))
    assert held_experts(layer, 2) == range(2 * rank, 2 * rank + 2)
    load_weights(layer, _prefixed(tensors), PREFIX, on_unused="raise")
    for local, i in enumerate(range(2 * rank, 2 * rank + 2)):
        assert torch.equal(layer.w2_weight[local], truth[f"{i}.down"])


def test_a_missing_bias_and_a_missing_projection_name_their_key() -> None:
    tensors, _ = _checkpoint(bias=True)
    del tensors["experts.2.down_proj.bias"]
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.bias"):
        load_weights(_layer(expert_bias=True), _prefixed(tensors), PREFIX)
    tensors, _ = _checkpoint()
    del tensors["experts.3.up_proj.values"]
    layer = _layer()
    before = layer.w13_weight.clone()
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.values"):
        load_weights(layer, _prefixed(tensors), PREFIX)
    assert torch.equal(layer.w13_weight, before)  # nothing copied


def test_the_loader_owns_the_biases_and_the_gate_up_agreement() -> None:
    class GivesBias(ScaledMethod):
        def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                            projection: Projection) -> dict[str, torch.Tensor]:
            return {**super().read_projection(layer, tensors, projection), "bias": torch.zeros(1)}

    class UpHasMore(ScaledMethod):
        def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                            projection: Projection) -> dict[str, torch.Tensor]:
            found = super().read_projection(layer, tensors, projection)
            return {**found, "extra": found["weight"]} if projection.part is Part.UP else found

    tensors, _ = _checkpoint()
    for method, match in ((GivesBias(), "the loader reads the biases"), (UpHasMore(), r"\['weight'\] for")):
        layer = mf.MoELayer(E, K, H, I, quant=method, backend="torch", dtype=torch.float32, environ={})
        with pytest.raises(CheckpointError, match=match):
            read_per_expert(method, layer, tensors)


def test_a_method_without_a_reader_says_so() -> None:
    class NoReader(ScaledMethod):
        read_projection = mf.QuantMethod.read_projection  # type: ignore[assignment]

    tensors, _ = _checkpoint()
    with pytest.raises(CheckpointError, match="does not read checkpoints"):
        load_weights(mf.MoELayer(E, K, H, I, quant=NoReader(), backend="torch", dtype=torch.float32, environ={}),
                     _prefixed(tensors), PREFIX)
    with pytest.raises(CheckpointError, match="needs hidden_size"):
        read_per_expert(ScaledMethod(), torch.nn.Linear(2, 2), tensors)
