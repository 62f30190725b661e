"""``moeforge.checkpoint.load_weights``: each naming scheme round-trips from state dicts and from
safetensors files; every error names what is wrong."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.checkpoint import (
    CheckpointError,
    ExpertNaming,
    LoadReport,
    MissingWeightError,
    UnusedWeightsError,
    UnusedWeightsWarning,
    WeightShapeError,
    load_weights,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

E, K, H, I, SHARED_I = 4, 2, 16, 6, 12  # 2I != H: a transposed [E, H, 2I] must not fit
PREFIX = "model.layers.3.mlp."


def make_layer(kind: str = "plain", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> mf.MoELayer:
    """A layer with every tensor random (seeded)."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(backend="torch", dtype=dtype)
    if kind == "shared":  # DeepSeek/Qwen2-like: selection bias, router bias, gated shared experts
        kwargs.update(
            routing=mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, router_bias=True),
            shared_experts=mf.SharedExpertsConfig(SHARED_I, gate=mf.SharedGate.SIGMOID))
    elif kind == "shared_bias":  # shared experts with biases, ungated
        kwargs.update(shared_experts=mf.SharedExpertsConfig(SHARED_I, bias=True))
    elif kind == "interleaved":
        kwargs.update(activation=mf.ActivationConfig(gate_up=mf.GateUpLayout.INTERLEAVED),
                      shared_experts=mf.SharedExpertsConfig(
                          SHARED_I, activation=mf.ActivationConfig(gate_up=mf.GateUpLayout.INTERLEAVED)))
    elif kind == "plain_activation":
        kwargs.update(activation=mf.ActivationConfig(mf.ActivationKind.RELU2),
                      shared_experts=mf.SharedExpertsConfig(
                          SHARED_I, activation=mf.ActivationConfig(mf.ActivationKind.RELU2)))
    else:
        assert kind == "plain"
    layer = mf.MoELayer(E, K, H, I, **kwargs)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for tensor in list(layer.parameters()) + list(layer.buffers()):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    return layer


def _halves(weight: torch.Tensor, layout: mf.GateUpLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up rows of a ``[..., 2I, X]`` (or ``[2I]``) tensor in the layer's layout (dim -2 / 0)."""
    dim = 0 if weight.dim() == 1 else weight.dim() - 2
    if layout is mf.GateUpLayout.INTERLEAVED:
        n = weight.shape[dim]
        return weight.index_select(dim, torch.arange(0, n, 2)), weight.index_select(dim, torch.arange(1, n, 2))
    gate, up = weight.chunk(2, dim=dim)
    return gate, up


def export(layer: mf.MoELayer, naming: ExpertNaming, prefix: str = PREFIX,
           shared_base: str = "shared_expert.") -> dict[str, torch.Tensor]:
    """The layer's tensors under Hugging Face names (what a checkpoint of that family holds)."""
    out: dict[str, torch.Tensor] = {}
    gated, layout = layer.activation.gated, layer.activation.gate_up
    w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
    if naming is ExpertNaming.FUSED:
        if gated:
            gate, up = _halves(w13, layout)
            out["experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        else:
            out["experts.up_proj"] = w13.clone()
        out["experts.down_proj"] = w2.clone()
    else:
        g, u, d = ("w1", "w3", "w2") if naming is ExpertNaming.W1_W3_W2 else ("gate_proj", "up_proj", "down_proj")
        for i in range(layer.num_experts):
            if gated:
                gate, up = _halves(w13[i], layout)
                out[f"experts.{i}.{g}.weight"] = gate.clone()
                out[f"experts.{i}.{u}.weight"] = up.clone()
            else:
                out[f"experts.{i}.{u}.weight"] = w13[i].clone()
            out[f"experts.{i}.{d}.weight"] = w2[i].clone()
    assert layer.router is not None
    out["gate.weight"] = layer.router.weight.detach().clone()
    if layer.router.bias is not None:
        out["gate.bias"] = layer.router.bias.detach().clone()
    if getattr(layer, "e_score_correction_bias", None) is not None:
        out["gate.e_score_correction_bias"] = layer.e_score_correction_bias.clone()
    shared = layer.shared_experts
    if shared is not None:
        sgated, slayout = shared.config.activation.gated, shared.config.activation.gate_up
        names = ["weight"] + (["bias"] if shared.config.bias else [])
        for name in names:
            value = getattr(shared.gate_up_proj, name).detach()
            if sgated:
                gate, up = _halves(value, slayout)
                out[f"{shared_base}gate_proj.{name}"] = gate.clone()
                out[f"{shared_base}up_proj.{name}"] = up.clone()
            else:
                out[f"{shared_base}up_proj.{name}"] = value.clone()
            out[f"{shared_base}down_proj.{name}"] = getattr(shared.down_proj, name).detach().clone()
        if shared.gate is not None:
            out["shared_expert_gate.weight"] = shared.gate.weight.detach().clone()
    return {prefix + key: value for key, value in out.items()}


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, shards: int = 2) -> list[Path]:
    """The tensors split over ``shards`` safetensors files (plus unrelated tensors of other layers)."""
    keys = sorted(tensors)
    paths = []
    for shard in range(shards):
        part = {key: tensors[key].contiguous() for key in keys[shard::shards]}
        part[f"model.layers.{shard}.self_attn.q_proj.weight"] = torch.zeros(2, 2)
        path = directory / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, str(path))
        paths.append(path)
    return paths


def assert_same_layer(got: mf.MoELayer, want: mf.MoELayer) -> None:
    for (name, mine), (_, theirs) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(mine, theirs.to(mine.dtype)), name
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5)).to(want.dtype)
    with torch.no_grad():
        assert torch.equal(got(x), want(x))


KINDS = ["plain", "shared", "shared_bias", "interleaved", "plain_activation"]
NAMINGS = [naming for naming in ExpertNaming if naming is not ExpertNaming.QUANT_METHOD]  # float namings


def _cases() -> list[tuple[str, ExpertNaming]]:
    # w1/w3 name gate and up: a plain activation has no such checkpoint.
    return [(kind, naming) for kind in KINDS for naming in NAMINGS
            if not (kind == "plain_activation" and naming is ExpertNaming.W1_W3_W2)]


@pytest.mark.parametrize(("kind", "naming"), _cases())
def test_round_trip_from_state_dict(kind: str, naming: ExpertNaming) -> None:
    want = make_layer(kind, seed=1)
    state = export(want, naming)
    state["model.layers.4.mlp.gate.weight"] = torch.zeros(E, H)  # another block: not under the prefix
    got = make_layer(kind, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = load_weights(got, state, PREFIX)
    assert report == LoadReport(PREFIX, naming, report.loaded, ())
    assert sorted(report.loaded) == sorted(k for k in state if k.startswith(PREFIX))
    assert_same_layer(got, want)


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("kind", ["plain", "shared", "interleaved"])
def test_round_trip_from_safetensors(kind: str, naming: ExpertNaming, tmp_path: Path) -> None:
    want = make_layer(kind, seed=1)
    paths = write_shards(export(want, naming, shared_base="shared_experts."), tmp_path)
    for source in (paths, [str(p) for p in paths], tmp_path):  # files, names, the directory
        got = make_layer(kind, seed=2)
        report = load_weights(got, source, PREFIX, on_unused="raise")
        assert report.naming is naming and report.unused == ()
        assert_same_layer(got, want)


def test_single_file_and_dtype_conversion(tmp_path: Path) -> None:
    want = make_layer("shared", seed=1)  # fp32 checkpoint ...
    path = tmp_path / "block.safetensors"
    safetensors_torch.save_file(export(want, ExpertNaming.PROJ, prefix=""), str(path))
    got = make_layer("shared", seed=2, dtype=torch.bfloat16)  # ... into a bf16 layer
    load_weights(got, path)
    assert got.w13_weight.dtype == torch.bfloat16
    assert torch.equal(got.w13_weight, want.w13_weight.to(torch.bfloat16))
    assert got.e_score_correction_bias.dtype == torch.float32  # the layer's own dtype for it
    assert torch.equal(got.e_score_correction_bias, want.e_score_correction_bias)
    reference = make_layer("shared", seed=3, dtype=torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16) if v.dtype == torch.float32 and "e_score" not in k else v
                                for k, v in want.state_dict().items()})
    assert_same_layer(got, reference)


def test_selection_bias_without_gate_prefix() -> None:
    want = make_layer("shared", seed=1)
    state = export(want, ExpertNaming.FUSED)
    state[PREFIX + "e_score_correction_bias"] = state.pop(PREFIX + "gate.e_score_correction_bias")
    got = make_layer("shared", seed=2)
    load_weights(got, state, PREFIX, on_unused="raise")
    assert_same_layer(got, want)


def test_process_weights_after_loading_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer()
    calls: list[mf.MoELayer] = []
    monkeypatch.setattr(layer, "process_weights_after_loading", lambda: calls.append(layer))
    load_weights(layer, export(make_layer(seed=1), ExpertNaming.PROJ), PREFIX)
    assert calls == [layer]


# -- real transformers checkpoints --------------------------------------------------------------------

def _hf_mixtral() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=E, num_experts_per_tok=K)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3)
    return model


def test_transformers_save_pretrained_checkpoint(tmp_path: Path) -> None:
    """``save_pretrained`` writes Mixtral's original per-expert w1/w3/w2 names under
    ``block_sparse_moe``: loaded into a preset layer, it computes what the block computes."""
    from moeforge.hf import from_hf

    model = _hf_mixtral()
    model.save_pretrained(tmp_path)
    block = model.model.layers[1].mlp
    layer = mf.MoELayer.from_preset("mixtral", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                    dtype=torch.float32, backend="torch")
    report = load_weights(layer, tmp_path, "model.layers.1.block_sparse_moe.", on_unused="raise")
    assert report.naming is ExpertNaming.W1_W3_W2 and len(report.loaded) == 3 * E + 1
    assert_same_layer(layer, from_hf(block, backend="torch"))


def test_transformers_in_memory_state_dict() -> None:
    from moeforge.hf import from_hf

    model = _hf_mixtral()
    layer = mf.MoELayer.from_preset("mixtral", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                    dtype=torch.float32, backend="torch")
    report = load_weights(layer, model.state_dict(), "model.layers.0.mlp.", on_unused="raise")
    assert report.naming is ExpertNaming.FUSED
    assert_same_layer(layer, from_hf(model.model.layers[0].mlp, backend="torch"))


# -- errors -------------------------------------------------------------------------------------------

def _state(kind: str = "plain", naming: ExpertNaming = ExpertNaming.PROJ) -> dict[str, torch.Tensor]:
    return export(make_layer(kind, seed=1), naming)


def _unchanged(layer: mf.MoELayer) -> Callable[[], None]:
    before = {k: v.clone() for k, v in layer.state_dict().items()}

    def check() -> None:
        for key, value in layer.state_dict().items():
            assert torch.equal(value, before[key]), f"{key} changed by a failed load"
    return check


@pytest.mark.parametrize("missing", [
    "experts.2.up_proj.weight", "experts.3.down_proj.weight", "gate.weight", "gate.bias",
    "gate.e_score_correction_bias", "shared_expert.gate_proj.weight", "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
])
def test_missing_tensor_names_the_full_key(missing: str) -> None:
    state = _state("shared")
    del state[PREFIX + missing]
    layer = make_layer("shared")
    check = _unchanged(layer)
    with pytest.raises(MissingWeightError, match=f"missing tensor '{PREFIX}{missing}'") as info:
        load_weights(layer, state, PREFIX)
    assert info.value.key == PREFIX + missing
    check()


def test_missing_shared_experts_mention_both_namings() -> None:
    state = {k: v for k, v in _state("shared").items() if ".shared_expert." not in k}
    with pytest.raises(MissingWeightError, match=r"shared_expert\.gate_proj\.weight' \(or '.*shared_experts\.\*'"):
        load_weights(make_layer("shared"), state, PREFIX)


def test_missing_experts_say_what_was_expected() -> None:
    state = {k: v for k, v in _state().items() if ".experts." not in k}
    with pytest.raises(MissingWeightError, match=rf"no expert weights under '{PREFIX}'.*experts\.gate_up_proj"):
        load_weights(make_layer(), state, PREFIX)
    with pytest.raises(MissingWeightError, match="no expert weights under 'wrong.prefix.'"):
        load_weights(make_layer(), _state(), "wrong.prefix.")


@pytest.mark.parametrize(("key", "shape"), [
    ("experts.1.gate_proj.weight", (I, H + 1)),
    ("experts.0.down_proj.weight", (I, H)),
    ("gate.weight", (E + 1, H)),
    ("shared_expert.up_proj.weight", (SHARED_I, H, 1)),
])
def test_misshaped_tensor_names_key_and_both_shapes(key: str, shape: tuple[int, ...]) -> None:
    state = _state("shared")
    expected = tuple(state[PREFIX + key].shape)
    state[PREFIX + key] = torch.zeros(shape)
    layer = make_layer("shared")
    check = _unchanged(layer)
    with pytest.raises(WeightShapeError) as info:
        load_weights(layer, state, PREFIX)
    assert str(info.value) == f"tensor '{PREFIX}{key}' has shape {shape}, expected {expected}"
    assert (info.value.key, info.value.expected, info.value.found) == (PREFIX + key, expected, shape)
    check()


def test_misshaped_fused_tensor_in_a_file(tmp_path: Path) -> None:
    state = _state(naming=ExpertNaming.FUSED)
    state[PREFIX + "experts.gate_up_proj"] = torch.zeros(E, H, 2 * I)  # GPT-OSS's transposed layout
    path = write_shards(state, tmp_path, shards=1)
    with pytest.raises(WeightShapeError, match=rf"experts\.gate_up_proj' has shape \({E}, {H}, {2 * I}\), "
                                               rf"expected \({E}, {2 * I}, {H}\)"):
        load_weights(make_layer(), path, PREFIX)


def test_gpt_oss_layout_is_refused() -> None:
    state = _state(naming=ExpertNaming.FUSED)
    state[PREFIX + "experts.gate_up_proj_bias"] = torch.zeros(E, 2 * I)
    with pytest.raises(CheckpointError, match="GPT-OSS.*moeforge.hf.from_hf"):
        load_weights(make_layer(), state, PREFIX)


def _with_extras() -> dict[str, torch.Tensor]:
    state = _state()
    state[PREFIX + f"experts.{E}.up_proj.weight"] = torch.zeros(I, H)  # one expert too many
    state[PREFIX + "experts.0.up_proj.weight_scale"] = torch.ones(1)  # something this loader does not read
    return state


EXTRAS = (f"{PREFIX}experts.0.up_proj.weight_scale", f"{PREFIX}experts.{E}.up_proj.weight")


def test_unused_keys_warn_by_default() -> None:
    layer = make_layer()
    with pytest.warns(UnusedWeightsWarning, match=r"2 tensor\(s\) under the prefix were not loaded: "
                                                  rf"'{EXTRAS[0]}', '{EXTRAS[1]}'"):
        report = load_weights(layer, _with_extras(), PREFIX)
    assert report.unused == EXTRAS
    assert_same_layer(layer, make_layer(seed=1))


def test_unused_keys_raise_before_loading() -> None:
    layer = make_layer()
    check = _unchanged(layer)
    with pytest.raises(UnusedWeightsError) as info:
        load_weights(layer, _with_extras(), PREFIX, on_unused="raise")
    assert info.value.keys == EXTRAS
    check()


def test_unused_keys_ignored_are_still_reported() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = load_weights(make_layer(), _with_extras(), PREFIX, on_unused="ignore")
    assert report.unused == EXTRAS


def test_structure_the_layer_lacks_is_unused() -> None:
    """Shared experts (or a router bias) in the checkpoint that the layer does not have: reported."""
    state = _state("shared")
    with pytest.raises(UnusedWeightsError) as info:
        load_weights(make_layer("plain"), state, PREFIX, on_unused="raise")
    assert PREFIX + "shared_expert_gate.weight" in info.value.keys
    assert PREFIX + "gate.bias" in info.value.keys
    layer = mf.MoELayer(E, K, H, I, router=False, backend="torch", dtype=torch.float32)
    report = load_weights(layer, _state(), PREFIX, on_unused="ignore")
    assert report.unused == (PREFIX + "gate.weight",)


def test_mixed_namings_are_an_error() -> None:
    state = _state()
    state.update(export(make_layer(seed=1), ExpertNaming.W1_W3_W2))
    with pytest.raises(CheckpointError, match=r"mix naming schemes: .*W1_W3_W2.*PROJ|mix naming schemes: .*PROJ.*W1"):
        load_weights(make_layer(), state, PREFIX)


def test_both_shared_namings_are_an_error() -> None:
    state = _state("shared")
    state.update(export(make_layer("shared", seed=1), ExpertNaming.PROJ, shared_base="shared_experts."))
    with pytest.raises(CheckpointError, match="both .*shared_expert.* and .*shared_experts"):
        load_weights(make_layer("shared"), state, PREFIX)


def test_quantized_tensor_is_an_error(tmp_path: Path) -> None:
    state = _state()
    state[PREFIX + "experts.1.down_proj.weight"] = state[PREFIX + "experts.1.down_proj.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj\.weight' is float8_e4m3fn"):
        load_weights(make_layer(), state, PREFIX)
    path = write_shards(state, tmp_path, shards=1)
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj\.weight' is F8_E4M3"):
        load_weights(make_layer(), path, PREFIX)


def test_w1_w3_naming_needs_a_gated_layer() -> None:
    with pytest.raises(CheckpointError, match="w1/w3/w2 naming is for gated experts"):
        load_weights(make_layer("plain_activation"), _state(naming=ExpertNaming.W1_W3_W2), PREFIX)


def test_expert_biases_are_refused() -> None:
    layer = mf.MoELayer(E, K, H, I, expert_bias=True, backend="torch", dtype=torch.float32)
    with pytest.raises(CheckpointError, match="experts have biases"):
        load_weights(layer, _state(), PREFIX)


def test_bad_sources(tmp_path: Path) -> None:
    layer = make_layer()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(layer, tmp_path / "nope.safetensors", PREFIX)
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is not a .safetensors file"):
        load_weights(layer, tmp_path / "model.bin", PREFIX)
    with pytest.raises(CheckpointError, match="no \\*.safetensors file in directory"):
        load_weights(layer, tmp_path, PREFIX)
    with pytest.raises(CheckpointError, match="no checkpoint file given"):
        load_weights(layer, [], PREFIX)
    with pytest.raises(TypeError, match="source must be a state dict"):
        load_weights(layer, 3, PREFIX)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_unused must be"):
        load_weights(layer, _state(), PREFIX, on_unused="loud")  # type: ignore[arg-type]


def test_tensor_in_two_files_is_an_error(tmp_path: Path) -> None:
    state = _state()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_shards(state, tmp_path / "a", shards=1)
    second = write_shards(state, tmp_path / "b", shards=1)
    with pytest.raises(CheckpointError, match="is in two files"):
        load_weights(make_layer(), first + second, PREFIX)
