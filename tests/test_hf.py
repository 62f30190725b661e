"""``moeforge.hf``: whole tiny ``transformers`` models, patched in place, give the same logits, the same
generated tokens and the same auxiliary loss; unsupported blocks are left alone; the state dict
holds every tensor once."""

from __future__ import annotations

import copy
import importlib
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from moeforge import MoELayer  # noqa: E402
from moeforge.families import FAMILIES, family  # noqa: E402
from moeforge.hf import (  # noqa: E402
    HFMoEBlock,
    NothingPatchedWarning,
    PatchError,
    PatchReport,
    from_hf,
    patch_model,
)

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
               tie_word_embeddings=False)


def _mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2))


def _qwen3_moe() -> nn.Module:
    # Layer 1 is a dense MLP (mlp_only_layers): it must be left alone, and not reported as skipped.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=3, head_dim=8, intermediate_size=64, moe_intermediate_size=24,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]))


def _qwen2_moe() -> nn.Module:
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2))


def _olmoe() -> nn.Module:
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_experts=6, num_experts_per_tok=2))


def _deepseek_v3() -> nn.Module:
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, intermediate_size=64,
        moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))


def _gpt_oss() -> nn.Module:
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        head_dim=8, sliding_window=16))


def _phimoe() -> nn.Module:
    return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))


def _granite_moe() -> nn.Module:
    return transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))


def _llama4() -> nn.Module:
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **_COMMON, num_hidden_layers=2, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
        num_experts_per_tok=1, head_dim=8, moe_layers=[0, 1]))


# family -> (builder, the paths patch_model must replace)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[str, ...]]] = {
    "mixtral": (_mixtral, ("model.layers.0.mlp", "model.layers.1.mlp")),
    "qwen3_moe": (_qwen3_moe, ("model.layers.0.mlp", "model.layers.2.mlp")),
    "qwen2_moe": (_qwen2_moe, ("model.layers.0.mlp", "model.layers.1.mlp")),
    "olmoe": (_olmoe, ("model.layers.0.mlp", "model.layers.1.mlp")),
    "deepseek_v3": (_deepseek_v3, ("model.layers.1.mlp",)),
    "gpt_oss": (_gpt_oss, ("model.layers.0.mlp", "model.layers.1.mlp")),
    "phimoe": (_phimoe, ("model.layers.0.mlp", "model.layers.1.mlp")),
    "granite_moe": (_granite_moe, ("model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe")),
    "llama4": (_llama4, ("model.layers.0.feed_forward", "model.layers.1.feed_forward")),
}


def _require_family(name: str) -> None:
    """Every family named in a test must exist and import."""
    family(name)  # every listed family exists: importing it must work


def build(name: str, seed: int = 0) -> nn.Module:
    """A tiny model with EVERY parameter random (``transformers`` leaves expert weights uninitialised),
    in eval mode."""
    torch.manual_seed(seed)
    model = MODELS[name][0]().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias: a buffer
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model


def tokens(batch: int = 2, length: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: nn.Module, ids: torch.Tensor, new_tokens: int = 4) -> torch.Tensor:
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, use_cache=True, pad_token_id=0)
    return out


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches(name: str) -> None:
    _require_family(name)
    model = build(name)
    ids = tokens()
    want_logits, want_tokens = logits(model, ids), greedy(model, ids)
    expected_paths = MODELS[name][1]

    report = patch_model(model)

    assert [entry.path for entry in report.replaced] == list(expected_paths)
    assert {entry.family for entry in report.replaced} == {name}
    assert report.skipped == () and report.already_patched == ()
    for path in expected_paths:
        block = model.get_submodule(path)
        assert isinstance(block, HFMoEBlock) and isinstance(block.layer, MoELayer)
    assert rel_err(logits(model, ids), want_logits) < 1e-5
    got_tokens = greedy(model, ids)
    assert got_tokens.shape[1] == ids.shape[1] + 4
    assert torch.equal(got_tokens, want_tokens)
    assert str(report).startswith(f"replaced {len(expected_paths)} MoE block(s)")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_training_view_matches(name: str) -> None:
    """Loss, auxiliary load-balancing loss (router logits captured through the patched block) and the
    gradients of the expert weights are those of the unpatched model."""
    _require_family(name)
    reference = build(name)
    model = copy.deepcopy(reference)
    patch_model(model)
    ids = tokens()
    want = reference(ids, labels=ids, output_router_logits=True)
    got = model(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == len(MODELS[name][1])
    for mine, theirs in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(got.aux_loss, want.aux_loss)
    torch.testing.assert_close(got.loss, want.loss)
    want.loss.backward()
    got.loss.backward()
    path = MODELS[name][1][0]
    theirs_block, mine_block = reference.get_submodule(path), model.get_submodule(path)
    assert isinstance(mine_block, HFMoEBlock)
    torch.testing.assert_close(mine_block.layer.w13_weight.grad, theirs_block.experts.gate_up_proj.grad)
    torch.testing.assert_close(mine_block.layer.w2_weight.grad, theirs_block.experts.down_proj.grad)
    assert mine_block.layer.router is not None
    torch.testing.assert_close(mine_block.layer.router.weight.grad, theirs_block.gate.weight.grad)


def test_state_dict_holds_each_tensor_once(tmp_path: Path) -> None:
    """The documented layout: ``<block>.layer.<moeforge name>``, nothing under the HF names, no
    aliased tensors (safetensors refuses those), same total size; it saves and loads into another
    model patched the same way."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = build("mixtral")
    before = model.state_dict()
    patch_model(model)
    after = model.state_dict()

    assert sum(t.numel() for t in after.values()) == sum(t.numel() for t in before.values())
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in before.values())
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp."
        assert {k[len(prefix):] for k in after if k.startswith(prefix)} == {
            "layer.w13_weight", "layer.w2_weight", "layer.router.weight"}
        assert torch.equal(after[prefix + "layer.w13_weight"], before[prefix + "experts.gate_up_proj"])
        assert torch.equal(after[prefix + "layer.w2_weight"], before[prefix + "experts.down_proj"])
        assert torch.equal(after[prefix + "layer.router.weight"], before[prefix + "gate.weight"])
    storages = [t.untyped_storage().data_ptr() for t in after.values()]
    assert len(set(storages)) == len(storages)

    path = tmp_path / "patched.safetensors"
    safetensors_torch.save_file(after, str(path))
    other = build("mixtral", seed=7)
    patch_model(other)
    other.load_state_dict(safetensors_torch.load_file(str(path)))
    ids = tokens()
    torch.testing.assert_close(logits(other, ids), logits(model, ids), rtol=0, atol=0)


def test_save_pretrained_writes_each_tensor_once(tmp_path: Path) -> None:
    """``save_pretrained`` works on a patched model and writes the layer's tensors once, under
    moeforge's names (``transformers`` may rename the block's prefix on the way, e.g. Mixtral's
    ``mlp`` -> ``block_sparse_moe``): such a file is for a patched model, not for ``from_pretrained``."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = build("mixtral")
    patch_model(model)
    model.save_pretrained(tmp_path)  # type: ignore[operator]
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        saved.update(safetensors_torch.load_file(str(file)))
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in model.parameters())
    assert sorted(k.rsplit(".layer.", 1)[1] for k in saved if ".layer." in k) == sorted(
        ["router.weight", "w13_weight", "w2_weight"] * 2)
    assert not [k for k in saved if ".experts." in k]


def test_patching_twice_is_harmless() -> None:
    model = build("mixtral")
    first = patch_model(model)
    blocks = [model.get_submodule(entry.path) for entry in first.replaced]
    ids = tokens()
    want = logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingPatchedWarning)  # nothing to do is not nothing done
        second = patch_model(model)
    assert second.replaced == () and second.skipped == ()
    assert second.already_patched == tuple(entry.path for entry in first.replaced)
    assert [model.get_submodule(entry.path) for entry in first.replaced] == blocks
    assert "2 block(s) were already patched" in str(second)
    torch.testing.assert_close(logits(model, ids), want, rtol=0, atol=0)


class DummyMoE(nn.Module):
    """An MoE-looking block moeforge has no converter for."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, 2, bias=False)
        self.experts = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(hidden_states), dim=-1)
        return sum(weights[..., i:i + 1] * expert(hidden_states)  # type: ignore[return-value]
                   for i, expert in enumerate(self.experts))


def _with_dummy() -> tuple[nn.Module, DummyMoE]:
    model = build("mixtral")
    dummy = DummyMoE(32)
    model.get_submodule("model.layers.1").mlp = dummy
    return model, dummy


def test_unsupported_block_is_skipped_and_untouched() -> None:
    model, dummy = _with_dummy()
    state = {k: v.clone() for k, v in dummy.state_dict().items()}
    ids = tokens()
    want_logits, want_tokens = logits(model, ids), greedy(model, ids)

    report = patch_model(model)

    assert [entry.path for entry in report.replaced] == ["model.layers.0.mlp"]
    assert len(report.skipped) == 1
    skipped = report.skipped[0]
    assert (skipped.path, skipped.block_class) == ("model.layers.1.mlp", "DummyMoE")
    assert "no moeforge converter" in skipped.reason
    assert "model.layers.1.mlp: DummyMoE" in str(report)
    assert model.get_submodule("model.layers.1.mlp") is dummy
    for key, value in dummy.state_dict().items():
        assert torch.equal(value, state[key])
    assert rel_err(logits(model, ids), want_logits) < 1e-5
    assert torch.equal(greedy(model, ids), want_tokens)


def test_strict_raises_before_changing_anything() -> None:
    model, dummy = _with_dummy()
    original = model.get_submodule("model.layers.0.mlp")
    with pytest.raises(PatchError, match=r"model\.layers\.1\.mlp \(DummyMoE\): no moeforge converter"):
        patch_model(model, strict=True)
    assert model.get_submodule("model.layers.0.mlp") is original
    assert model.get_submodule("model.layers.1.mlp") is dummy


def test_nothing_patched_warns_and_lists_the_blocks_left_alone() -> None:
    model = nn.Sequential(DummyMoE(8), nn.Sequential(DummyMoE(8)))
    with pytest.warns(NothingPatchedWarning) as record:
        report = patch_model(model)
    assert report.replaced == () and len(report.skipped) == 2
    assert len(record) == 1
    assert str(record[0].message).splitlines() == [
        "patch_model replaced nothing in Sequential: left 2 MoE-looking block(s) alone",
        "  0: DummyMoE (no moeforge converter for this class)",
        "  1.0: DummyMoE (no moeforge converter for this class)",
    ]


def test_no_moe_block_at_all_warns_with_the_supported_blocks() -> None:
    with pytest.warns(NothingPatchedWarning, match=r"Sequential has no MoE-looking block \(a module with an "
                                                   r"'experts' child\); supported blocks: .*MixtralSparseMoeBlock"):
        assert patch_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == PatchReport((), (), ())


def test_a_model_with_replaced_blocks_does_not_warn() -> None:
    model, _ = _with_dummy()  # one block replaced, one left alone: the report says which
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingPatchedWarning)
        report = patch_model(model)
    assert len(report.replaced) == 1 and len(report.skipped) == 1


@pytest.mark.parametrize("value", ["mistralai/Mixtral-8x7B-v0.1", None, {"model": 1}])
def test_patch_model_needs_a_module(value: object) -> None:
    with pytest.raises(TypeError, match=rf"patch_model: model must be a torch\.nn\.Module .*got "
                                        rf"{type(value).__name__}; load the model first"):
        patch_model(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"from_hf: block must be .*got {type(value).__name__}"):
        from_hf(value)  # type: ignore[arg-type]


class MixtralSparseMoeBlock(nn.Module):
    """Right class name, wrong contents: the converter refuses it, patch_model reports why."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_converter_refusal_is_reported() -> None:
    model = nn.Sequential(MixtralSparseMoeBlock())
    with pytest.warns(NothingPatchedWarning, match=r"replaced nothing in Sequential: left 1 MoE-looking block\(s\) "
                                                   r"alone\n  0: MixtralSparseMoeBlock \(mixtral converter refused it"):
        report = patch_model(model)
    assert report.replaced == ()
    assert report.skipped[0].path == "0"
    assert "mixtral converter refused it" in report.skipped[0].reason
    assert "experts.gate_up_proj" in report.skipped[0].reason
    assert isinstance(model[0], MixtralSparseMoeBlock)
    with pytest.raises(PatchError, match="mixtral converter refused it"):
        patch_model(model, strict=True)


def test_shared_block_is_replaced_everywhere() -> None:
    block = build("mixtral").get_submodule("model.layers.0.mlp")
    container = nn.ModuleDict({"a": block, "b": nn.Sequential(block)})
    report = patch_model(container)
    assert [entry.path for entry in report.replaced] == ["a", "b.0"]
    assert isinstance(container["a"], HFMoEBlock)
    assert container["b"][0] is container["a"]  # type: ignore[index]


def test_patch_model_arguments() -> None:
    model = build("mixtral")
    with pytest.raises(TypeError, match="patch_model takes no 'dtype'"):
        patch_model(model, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="use moeforge.hf.from_hf"):
        patch_model(model.get_submodule("model.layers.0.mlp"))
    report = patch_model(model, backend="torch", debug=True)
    block = model.get_submodule(report.replaced[0].path)
    assert isinstance(block, HFMoEBlock)
    assert block.layer.debug and block.layer.backend.value == "torch"


def test_block_call_conventions_and_hooks() -> None:
    model = build("mixtral")
    original = model.get_submodule("model.layers.0.mlp")
    seen: list[torch.Tensor] = []
    handle = original.register_forward_hook(lambda module, args, output: seen.append(output))
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        want = original(x)
    patch_model(model)
    block = model.get_submodule("model.layers.0.mlp")
    with torch.no_grad():
        torch.testing.assert_close(block(x), want)
        torch.testing.assert_close(block(hidden_states=x), want)
    assert len(seen) == 3  # the hook registered on the original block still fires ...
    handle.remove()
    with torch.no_grad():
        block(x)
    assert len(seen) == 3  # ... and its handle still removes it
    with pytest.raises(TypeError, match="takes one argument 'hidden_states'"):
        block(x, x)
    with pytest.raises(TypeError, match="takes one argument 'hidden_states'"):
        block(x, output_router_logits=True)
    assert not block.training  # follows the replaced block's mode
    assert "replaces MixtralSparseMoeBlock (mixtral)" in repr(block)


def test_original_tensors_are_released() -> None:
    model = build("mixtral")
    patch_model(model)
    block = model.get_submodule("model.layers.0.mlp")
    assert isinstance(block, HFMoEBlock)
    assert all(t.device.type == "meta" for t in block.original.parameters())
    assert block.layer.w13_weight.device.type == "cpu"


def test_patched_model_deepcopies_and_pickles() -> None:
    model = build("mixtral")
    patch_model(model)
    ids = tokens()
    want = logits(model, ids)
    torch.testing.assert_close(logits(copy.deepcopy(model), ids), want, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.testing.assert_close(logits(torch.load(buffer, weights_only=False), ids), want, rtol=0, atol=0)


def test_cast_after_patching() -> None:
    reference = build("mixtral")
    model = copy.deepcopy(reference)
    patch_model(model)
    reference.to(torch.bfloat16)
    model.to(torch.bfloat16)
    block = model.get_submodule("model.layers.0.mlp")
    assert isinstance(block, HFMoEBlock) and block.layer.dtype == torch.bfloat16
    ids = tokens()
    assert rel_err(logits(model, ids).float(), logits(reference, ids).float()) < 2e-2


def test_from_hf() -> None:
    model = build("mixtral")
    block = model.get_submodule("model.layers.0.mlp")
    layer = from_hf(block)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), block(x[None])[0])
    patch_model(model)
    patched = model.get_submodule("model.layers.0.mlp")
    assert isinstance(patched, HFMoEBlock)
    assert from_hf(patched) is patched.layer
    with pytest.raises(TypeError, match="no moeforge converter for DummyMoE; supported blocks: .*MixtralSparseMoeBlock"):
        from_hf(DummyMoE(8))


def test_report_is_plain_data() -> None:
    with pytest.warns(NothingPatchedWarning):
        report = patch_model(nn.Linear(2, 2))
    assert report == PatchReport((), (), ())
    assert str(report) == "replaced 0 MoE block(s)"


def test_no_family_module_is_broken() -> None:
    """Every family module that exists imports and declares what ``moeforge.hf`` reads."""
    for name in FAMILIES:
        module = family(name)
        assert module.NAME == name
        assert module.HF_BLOCK_CLASSES and callable(module.from_hf) and callable(module.hf_output)
    importlib.import_module("moeforge.families.mixtral")
