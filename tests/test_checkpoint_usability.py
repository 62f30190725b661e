"""``moeforge.checkpoint.load_weights`` where a user slips: a prefix without its trailing dot or under
the wrong path, a layer on the meta device, files without the ``safetensors`` package, a quant method
whose reader leaves a tensor unfilled. None of these needs ``safetensors`` installed."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.checkpoint import MissingPackageError, MissingWeightError, load_weights
from moeforge.errors import CheckpointError, InputError

E, K, H, I, SHARED_I = 4, 2, 16, 8, 12
PREFIX = "model.layers.3.mlp."


def make_layer(**kwargs: Any) -> mf.MoELayer:
    """DeepSeek-like: selection bias, router bias, gated shared experts (every kind of tensor)."""
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, backend="torch", dtype=torch.float32, environ={},
                       routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, router_bias=True),
                       shared_experts=mf.SharedExpertsConfig(SHARED_I, gate=mf.SharedGate.SIGMOID), **kwargs)


def block_tensors(seed: int, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """A checkpoint of one block (PROJ naming) with random values."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    out = {"gate.weight": rand(E, H), "gate.bias": rand(E), "gate.e_score_correction_bias": rand(E),
           "shared_expert.gate_proj.weight": rand(SHARED_I, H), "shared_expert.up_proj.weight": rand(SHARED_I, H),
           "shared_expert.down_proj.weight": rand(H, SHARED_I), "shared_expert_gate.weight": rand(1, H)}
    for i in range(E):
        out.update({f"experts.{i}.gate_proj.weight": rand(I, H), f"experts.{i}.up_proj.weight": rand(I, H),
                    f"experts.{i}.down_proj.weight": rand(H, I)})
    return {prefix + key: value for key, value in out.items()}


def assert_holds(layer: mf.MoELayer, tensors: Mapping[str, torch.Tensor], prefix: str = PREFIX) -> None:
    """The layer's tensors are the checkpoint's (checked against the checkpoint, not another load)."""
    def get(name: str) -> torch.Tensor:
        return tensors[prefix + name]

    want_w13 = torch.stack([torch.cat([get(f"experts.{i}.gate_proj.weight"), get(f"experts.{i}.up_proj.weight")])
                            for i in range(E)])
    want_w2 = torch.stack([get(f"experts.{i}.down_proj.weight") for i in range(E)])
    assert torch.equal(layer.w13_weight, want_w13) and torch.equal(layer.w2_weight, want_w2)
    assert layer.router is not None and layer.router.bias is not None
    assert torch.equal(layer.router.weight, get("gate.weight")) and torch.equal(layer.router.bias, get("gate.bias"))
    assert torch.equal(layer.e_score_correction_bias, get("gate.e_score_correction_bias"))
    shared = layer.shared_experts
    assert shared is not None and shared.gate is not None
    assert torch.equal(shared.gate_up_proj.weight, torch.cat([get("shared_expert.gate_proj.weight"),
                                                              get("shared_expert.up_proj.weight")]))
    assert torch.equal(shared.down_proj.weight, get("shared_expert.down_proj.weight"))
    assert torch.equal(shared.gate.weight, get("shared_expert_gate.weight"))


# -- the prefix ----------------------------------------------------------------------------------------


def test_prefix_without_its_trailing_dot() -> None:
    tensors = block_tensors(1)
    layer = make_layer()
    report = load_weights(layer, tensors, "model.layers.3.mlp", on_unused="raise")
    assert report.prefix == PREFIX
    assert report.unused == ()
    assert PREFIX + "experts.0.gate_proj.weight" in report.loaded
    assert_holds(layer, tensors)


def test_prefix_without_dot_does_not_take_a_longer_layer_number() -> None:
    """``"model.layers.1"`` means layer 1, not also layer 10 (whose keys share the text)."""
    tensors = {**block_tensors(2, "model.layers.1.mlp."), **block_tensors(3, "model.layers.10.mlp.")}
    layer = make_layer()
    report = load_weights(layer, tensors, "model.layers.1.mlp", on_unused="raise")
    assert report.prefix == "model.layers.1.mlp." and report.unused == ()
    assert_holds(layer, tensors, "model.layers.1.mlp.")


def test_a_prefix_with_its_dot_is_used_as_given() -> None:
    tensors = block_tensors(4)
    report = load_weights(make_layer(), tensors, PREFIX, on_unused="raise")
    assert report.prefix == PREFIX


def test_a_wrong_prefix_says_where_the_experts_are() -> None:
    tensors = {**block_tensors(5, "model.layers.0.mlp."), **block_tensors(6, "model.layers.1.mlp.")}
    with pytest.raises(MissingWeightError, match=r"no expert weights under 'model\.layers\.3\.mlp\.'.*experts "
                                                 r"are under 'model\.layers\.0\.mlp\.', 'model\.layers\.1\.mlp\.'"):
        load_weights(make_layer(), tensors, "model.layers.3.mlp.")
    with pytest.raises(MissingWeightError, match=r"no key containing 'experts\.'"):
        load_weights(make_layer(), {"lm_head.weight": torch.zeros(2, 2)}, PREFIX)


def test_a_wrong_prefix_for_a_quantized_layer_says_where_the_experts_are() -> None:
    from test_checkpoint_expert_parallel import w8a8_checkpoint

    tensors = {"model.layers.0.mlp." + key: value for key, value in w8a8_checkpoint("int8_channel", H, I, 0).items()}
    layer = mf.MoELayer(E, K, H, I, quant=mf.Int8W8A8Method(), backend="torch", dtype=torch.float32, environ={})
    with pytest.raises(CheckpointError, match=r"under prefix 'model\.layers\.3\.mlp\.': missing tensor "
                                              r"'experts\.0\.up_proj\.weight'.*under 'model\.layers\.0\.mlp\.'"):
        load_weights(layer, tensors, "model.layers.3.mlp.")
    load_weights(layer, tensors, "model.layers.0.mlp", on_unused="raise")  # the right one, without its dot


def test_prefix_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="prefix must be a str"):
        load_weights(make_layer(), block_tensors(7), 3)  # type: ignore[arg-type]


# -- a layer on the meta device --------------------------------------------------------------------------


def test_meta_layer_is_refused_until_it_has_storage() -> None:
    tensors = block_tensors(8)
    layer = make_layer(device="meta")
    with pytest.raises(InputError, match=r"meta device .*layer\.to_empty\(device=\.\.\.\)"):
        load_weights(layer, tensors, PREFIX)
    assert all(tensor.is_meta for tensor in layer.state_dict().values())  # nothing half-done
    layer.to_empty(device="cpu")
    load_weights(layer, tensors, PREFIX, on_unused="raise")
    # Every tensor the layer has came from the checkpoint: none keeps to_empty's garbage.
    reference = make_layer()
    load_weights(reference, tensors, PREFIX)
    assert layer.state_dict().keys() == reference.state_dict().keys()
    for name, value in layer.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
    assert_holds(layer, tensors)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))


# -- safetensors -------------------------------------------------------------------------------------------


def test_files_without_safetensors_name_the_package_and_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    message = r"'safetensors' package.*pip install 'moeforge\[safetensors\]'"
    with pytest.raises(MissingPackageError, match=message) as info:
        load_weights(make_layer(), path, PREFIX)
    assert isinstance(info.value, ImportError)
    # A state dict needs no package.
    tensors = block_tensors(9)
    layer = make_layer()
    load_weights(layer, tensors, PREFIX, on_unused="raise")
    assert_holds(layer, tensors)


# -- a quant method's reader must fill every expert tensor ---------------------------------------------


class _ForgetsAScale(mf.Int8W8A8Method):
    def load_checkpoint_experts(self, layer: torch.nn.Module,
                                tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        found = super().load_checkpoint_experts(layer, tensors)
        del found["w2_weight_scale"]
        return found


def test_a_reader_that_leaves_an_expert_tensor_unfilled_is_refused() -> None:
    from test_checkpoint_expert_parallel import w8a8_checkpoint

    tensors = {PREFIX + key: value for key, value in w8a8_checkpoint("int8_channel", H, I, 1).items()}
    layer = mf.MoELayer(E, K, H, I, quant=_ForgetsAScale(), backend="torch", dtype=torch.float32, environ={})
    before = layer.w2_weight.clone()
    with pytest.raises(CheckpointError, match=r"filled .* but not \['w2_weight_scale'\]"):
        load_weights(layer, tensors, PREFIX)
    assert torch.equal(layer.w2_weight, before)  # checked before anything was copied


# -- one naming detector for the float loader and the quant methods' readers ---------------------------


def test_naming_is_detected_from_any_expert_and_any_suffix() -> None:
    from moeforge.expert_naming import ExpertNaming, detect_naming, per_expert_projections

    assert detect_naming(["experts.2.w1.qweight", "experts.3.w2.scales", "gate.weight"]) is ExpertNaming.W1_W3_W2
    assert detect_naming(["experts.7.down_proj.weight_scale_inv"]) is ExpertNaming.PROJ
    assert detect_naming(["experts.gate_up_proj", "experts.down_proj"]) is ExpertNaming.FUSED
    assert detect_naming(["gate.weight", "shared_experts.gate_proj.weight"]) is None
    assert per_expert_projections(["experts.3.w3.qweight"], gated=True) == ("w1", "w3", "w2")
    assert per_expert_projections([], gated=True) == ("gate_proj", "up_proj", "down_proj")
    with pytest.raises(CheckpointError, match=r"under 'p\.' mix naming schemes: 'p\.experts\.0\.gate_proj\.weight' "
                                              r"\(PROJ\), 'p\.experts\.1\.w1\.weight' \(W1_W3_W2\)"):
        detect_naming(["experts.1.w1.weight", "experts.0.gate_proj.weight"], "p.")
    with pytest.raises(CheckpointError, match="w1/w3/w2 naming is for gated experts"):
        per_expert_projections(["experts.0.w3.weight"], gated=False)


def test_a_fused_float_checkpoint_into_a_quantized_layer_says_what_it_reads() -> None:
    tensors = {PREFIX + "experts.gate_up_proj": torch.zeros(E, 2 * I, H),
               PREFIX + "experts.down_proj": torch.zeros(E, H, I), PREFIX + "gate.weight": torch.zeros(E, H)}
    layer = mf.MoELayer(E, K, H, I, quant=mf.Int8W8A8Method(), backend="torch", dtype=torch.float32, environ={})
    with pytest.raises(CheckpointError, match=r"stored as experts\.gate_up_proj / experts\.down_proj; this reader "
                                              r"takes per-expert tensors"):
        load_weights(layer, tensors, PREFIX)
