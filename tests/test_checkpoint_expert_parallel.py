"""``moeforge.checkpoint.load_weights`` under expert parallelism, for the float namings and every quant
method that reads a checkpoint (``load_checkpoint_experts``): FP8 and INT8 W8A8, W4A16 (GPTQ, AWQ),
MXFP4.

Checkpoints name experts by their global id; rank ``r`` of ``W`` holds experts ``r*E/W .. (r+1)*E/W - 1``
(its ``expert_range``). Each rank's layer is compared, tensor by tensor and bit for bit, with the whole
layer loaded from the same checkpoint and sliced to that range. Loading needs no collective, so the
ranks are built in this process from an :class:`ExpertParallel` that states its rank (``RankOf``)
instead of asking a process group.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

import attrs
import pytest
import torch

import moeforge as mf
from moeforge.checkpoint import load_weights
from moeforge.distributed import ExpertParallel
from moeforge.quant.int4_packing import Int4Weight, int4_to_awq, int4_to_gptq, pack_int4
from moeforge.quant.mxfp4 import CHECKPOINT_KEYS
from moeforge.quant.w8a8 import quantize_weight_blockwise, quantize_weight_per_channel

E, K = 4, 2
PREFIX = "model.layers.5.mlp."
_EXPERT_ID = re.compile(r"experts\.(\d+)\.")


@attrs.frozen(eq=False)
class RankOf(ExpertParallel):
    """``ExpertParallel(num_experts)`` as rank ``given_rank`` of ``given_world`` sees it, without a
    process group (loading a checkpoint runs no collective)."""

    given_rank: int = 0
    given_world: int = 1

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "rank", self.given_rank)
        object.__setattr__(self, "world_size", self.given_world)


# -- checkpoints (names relative to the block) -------------------------------------------------------------

def _float_experts(hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert gate, up ``[E, I, H]`` and down ``[E, H, I]`` float weights."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, inter, hidden, generator=gen) * hidden**-0.5
    up = torch.randn(E, inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(E, hidden, inter, generator=gen) * inter**-0.5
    return gate, up, down


def _router(hidden: int, seed: int) -> dict[str, torch.Tensor]:
    return {"gate.weight": torch.randn(E, hidden, generator=torch.Generator().manual_seed(seed + 1))}


def float_checkpoint(naming: str, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    gate, up, down = _float_experts(hidden, inter, seed)
    out = _router(hidden, seed)
    if naming == "fused":
        out["experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out["experts.down_proj"] = down
        return out
    g, u, d = ("w1", "w3", "w2") if naming == "w1_w3_w2" else ("gate_proj", "up_proj", "down_proj")
    for i in range(E):
        out.update({f"experts.{i}.{g}.weight": gate[i], f"experts.{i}.{u}.weight": up[i],
                    f"experts.{i}.{d}.weight": down[i]})
    return out


def w8a8_checkpoint(kind: str, hidden: int, inter: int, seed: int, names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj"), bias: bool = False) -> dict[str, torch.Tensor]:
    """``kind``: ``fp8_block`` (``weight_scale_inv`` per 128x128 block), ``fp8_channel`` or
    ``int8_channel`` (``weight_scale [N, 1]``)."""
    out = _router(hidden, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    for proj, weights in zip(names, _float_experts(hidden, inter, seed)):
        for i in range(E):
            base = f"experts.{i}.{proj}"
            if kind == "fp8_block":
                out[f"{base}.weight"], out[f"{base}.weight_scale_inv"] = quantize_weight_blockwise(weights[i])
            else:
                dtype = mf.DType.FP8_E4M3 if kind == "fp8_channel" else mf.DType.INT8
                q, scale = quantize_weight_per_channel(weights[i], dtype)
                out[f"{base}.weight"], out[f"{base}.weight_scale"] = q, scale[:, None]
            if bias:
                out[f"{base}.bias"] = torch.randn(weights.shape[1], generator=gen)
    return out


def w4a16_checkpoint(fmt: str, hidden: int, inter: int, seed: int, group: int,
                     names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
    out = _router(hidden, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    for proj, (n, k) in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter))):
        for i in range(E):
            weight = Int4Weight(pack_int4(torch.randint(0, 16, (n, k), generator=gen)),
                                (torch.rand(n, k // group, generator=gen) + 0.1).half(),
                                torch.randint(1, 16, (n, k // group), generator=gen).to(torch.uint8))
            packed = int4_to_awq(weight) if fmt == "awq" else int4_to_gptq(weight)
            out.update({f"experts.{i}.{proj}.{key}": value for key, value in packed.items()})
    return out


def mxfp4_checkpoint(hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    """GPT-OSS's fused tensors: every expert in one ``[E, ...]`` tensor per kind."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w13_blocks": (E, 2 * inter, hidden // 32, 16), "w13_scales": (E, 2 * inter, hidden // 32),
              "w2_blocks": (E, hidden, inter // 32, 16), "w2_scales": (E, hidden, inter // 32),
              "w13_bias": (E, 2 * inter), "w2_bias": (E, hidden)}
    out = _router(hidden, seed)
    out["gate.bias"] = torch.randn(E, generator=gen)  # GPT-OSS's router has a bias
    for key, name in CHECKPOINT_KEYS.items():
        if name.endswith("blocks"):
            out[key] = torch.randint(0, 256, shapes[name], generator=gen).to(torch.uint8)
        elif name.endswith("scales"):
            out[key] = torch.randint(120, 130, shapes[name], generator=gen).to(torch.uint8)
        else:
            out[key] = torch.randn(shapes[name], generator=gen)
    return out


@attrs.frozen
class Case:
    make_checkpoint: Callable[[], dict[str, torch.Tensor]]
    layer_kwargs: Callable[[], dict[str, Any]]  # a fresh quant method per layer
    hidden: int
    inter: int


def _quant(method: Callable[[], Optional[mf.QuantMethod]], **extra: Any) -> Callable[[], dict[str, Any]]:
    return lambda: dict(quant=method(), **extra)


CASES: dict[str, Case] = {
    "float proj": Case(lambda: float_checkpoint("proj", 32, 16, 0), _quant(lambda: None), 32, 16),
    "float w1_w3_w2": Case(lambda: float_checkpoint("w1_w3_w2", 32, 16, 1), _quant(lambda: None), 32, 16),
    "float fused": Case(lambda: float_checkpoint("fused", 32, 16, 2), _quant(lambda: None), 32, 16),
    "fp8 block": Case(lambda: w8a8_checkpoint("fp8_block", 128, 128, 3),
                      _quant(lambda: mf.Fp8W8A8Method("block", "token")), 128, 128),
    "fp8 channel w1_w3_w2 + bias": Case(
        lambda: w8a8_checkpoint("fp8_channel", 32, 16, 4, ("w1", "w3", "w2"), bias=True),
        _quant(lambda: mf.Fp8W8A8Method("channel", "token"), expert_bias=True), 32, 16),
    "int8 channel": Case(lambda: w8a8_checkpoint("int8_channel", 32, 16, 5),
                         _quant(lambda: mf.Int8W8A8Method()), 32, 16),
    "w4a16 gptq": Case(lambda: w4a16_checkpoint("gptq", 64, 32, 6, 32),
                       _quant(lambda: mf.W4A16Method(group_size=32, checkpoint_format="gptq")), 64, 32),
    "w4a16 awq w1_w3_w2": Case(lambda: w4a16_checkpoint("awq", 64, 32, 7, 32, ("w1", "w3", "w2")),
                               _quant(lambda: mf.W4A16Method(group_size=32, checkpoint_format="awq")), 64, 32),
    "mxfp4": Case(lambda: mxfp4_checkpoint(32, 32, 8),
                  _quant(lambda: mf.Mxfp4Method(), expert_bias=True,
                         routing=mf.RoutingConfig(router_bias=True)), 32, 32),
}


def build(case: Case, ep: Optional[ExpertParallel] = None) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(E, K, case.hidden, case.inter, backend="torch", dtype=torch.float32, environ={},
                       expert_parallel=ep, **case.layer_kwargs())


def prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PREFIX + key: value for key, value in tensors.items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes' values, comparable with torch.equal for any dtype (fp8 included)."""
    return tensor.detach().contiguous().view(torch.uint8) if tensor.element_size() == 1 else tensor.detach()


def expert_tensors(layer: mf.MoELayer) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name) for name in layer.quant.expert_parameter_names(layer)}


# -- tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rank_loads_the_experts_of_its_range(name: str, world: int) -> None:
    case = CASES[name]
    tensors = prefixed(case.make_checkpoint())
    whole = build(case)
    load_weights(whole, tensors, PREFIX, on_unused="raise")
    whole_experts = expert_tensors(whole)
    assert whole_experts  # every case has expert tensors to compare
    local = E // world
    for rank in range(world):
        layer = build(case, RankOf(E, given_rank=rank, given_world=world))
        report = load_weights(layer, tensors, PREFIX, on_unused="ignore")
        held = range(rank * local, (rank + 1) * local)
        assert layer.expert_range == held
        mine = expert_tensors(layer)
        assert sorted(mine) == sorted(whole_experts)
        for tensor_name, value in mine.items():
            want = whole_experts[tensor_name][held.start:held.stop]
            assert value.shape == want.shape and value.dtype == want.dtype, tensor_name
            assert torch.equal(bits(value), bits(want)), f"rank {rank}: {tensor_name} is not experts {held}"
        assert layer.router is not None and whole.router is not None
        assert torch.equal(layer.router.weight, whole.router.weight)
        # What the rank left unread is exactly the other ranks' per-expert tensors.
        others = {key for key in tensors
                  if (match := _EXPERT_ID.search(key)) is not None and int(match.group(1)) not in held}
        assert set(report.unused) == others


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_ranks_hold_different_experts(name: str) -> None:
    """The comparison above can tell the ranks apart: rank 0 and rank 1 hold different values (the
    defect it guards against: rank 1 of a W8A8 layer held experts 0-1)."""
    case = CASES[name]
    tensors = prefixed(case.make_checkpoint())
    layers = []
    for rank in range(2):
        layer = build(case, RankOf(E, given_rank=rank, given_world=2))
        load_weights(layer, tensors, PREFIX, on_unused="ignore")
        layers.append(expert_tensors(layer))
    for tensor_name in layers[0]:
        assert not torch.equal(bits(layers[0][tensor_name]), bits(layers[1][tensor_name])), tensor_name


@pytest.mark.parametrize("name", [name for name in sorted(CASES) if name not in ("float fused", "mxfp4")])
def test_a_checkpoint_holding_only_the_ranks_experts(name: str) -> None:
    """A rank's own shard of a per-expert checkpoint (experts 2 and 3 only) is enough, whatever its
    naming: the naming is detected from the experts present, not from expert 0."""
    case = CASES[name]
    full = prefixed(case.make_checkpoint())
    shard = {key: value for key, value in full.items()
             if (match := _EXPERT_ID.search(key)) is None or int(match.group(1)) in (2, 3)}
    whole = build(case)
    load_weights(whole, full, PREFIX, on_unused="raise")
    layer = build(case, RankOf(E, given_rank=1, given_world=2))
    report = load_weights(layer, shard, PREFIX, on_unused="raise")
    assert report.unused == ()
    for tensor_name, value in expert_tensors(layer).items():
        assert torch.equal(bits(value), bits(expert_tensors(whole)[tensor_name][2:4])), tensor_name


def test_a_missing_expert_of_the_range_is_named_by_its_global_id() -> None:
    case = CASES["fp8 block"]
    tensors = prefixed(case.make_checkpoint())
    del tensors[PREFIX + "experts.3.down_proj.weight"]
    layer = build(case, RankOf(E, given_rank=1, given_world=2))
    with pytest.raises(mf.CheckpointError, match=r"missing tensor 'experts\.3\.down_proj\.weight'"):
        load_weights(layer, tensors, PREFIX)
    # Rank 0 does not need expert 3.
    load_weights(build(case, RankOf(E, given_rank=0, given_world=2)), tensors, PREFIX, on_unused="ignore")


def test_mxfp4_needs_every_expert_in_its_fused_tensors() -> None:
    case = CASES["mxfp4"]
    tensors = prefixed(case.make_checkpoint())
    key = PREFIX + "experts.down_proj_blocks"
    tensors[key] = tensors[key][2:]  # a rank's slice is not a GPT-OSS checkpoint
    layer = build(case, RankOf(E, given_rank=1, given_world=2))
    with pytest.raises(mf.CheckpointError, match=r"experts\.down_proj_blocks' has shape \[2, .*\(all 4 experts\)"):
        load_weights(layer, tensors, PREFIX)
