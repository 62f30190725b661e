"""peft's LoRA on the experts' parameters (``LoraConfig(target_parameters=[...experts.gate_up_proj, ...down_proj])``)
through ``experts_implementation="moeforge"``: the same logits, gradients and training steps as ``"eager"``.

peft registers a parametrization on the experts module for each forward (the weight plus its low-rank update); the
pipeline reads that tensor when it runs (``ParametrizedRef``), so the adapter's matrices get their gradients, and
with the adapter disabled the module's own parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moeforge import hf_experts  # noqa: E402
from moeforge.tensor_ref import ParametrizedRef  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    hf_experts.register()


def _model(seed: int = 0) -> Any:
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return peft.get_peft_model(model, lora)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))


def _use(model: Any, implementation: str) -> None:
    model.base_model.model.set_experts_implementation(implementation)


def test_the_adapted_experts_give_the_eager_logits() -> None:
    model = _model()
    ids = _ids()
    with torch.no_grad():
        _use(model, "eager")
        want = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
        _use(model, "moeforge")
        got = model(ids).logits
        with model.disable_adapter():  # the parameters themselves, without the update
            got_base = model(ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_base, base, rtol=1e-5, atol=1e-5)
    experts = model.base_model.model.model.layers[0].mlp.experts
    while not hasattr(experts, "has_gate"):  # peft wraps the experts module once per targeted parameter
        experts = experts.base_layer
    function = hf_experts.registered_function()
    assert function is not None
    sources = [repr(stage) for pipeline in function.pipelines_for(experts) for stage in pipeline.stages]
    assert any("ParametrizedRef" in text for text in sources), sources


def _lora_grads(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}


def test_the_adapters_get_the_eager_gradients() -> None:
    model = _model(3)
    ids = _ids(4)
    _use(model, "eager")
    want = _lora_grads(model, ids)
    _use(model, "moeforge")
    got = _lora_grads(model, ids)
    assert want.keys() == got.keys() and any("lora" in name for name in want)
    assert all("lora" in name for name in want)  # only the adapters train
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_triton_experts_read_the_adapted_weight() -> None:
    """On a GPU the selector's triton GEMMs read peft's parametrized weight: the eager logits and the adapters'
    eager gradients (fp32)."""
    model = _model(8).cuda()
    ids = _ids(9).cuda()
    _use(model, "eager")
    with torch.no_grad():
        want_logits = model(ids).logits
    want = _lora_grads(model, ids)
    _use(model, "moeforge")
    with torch.no_grad():
        got_logits = model(ids).logits
    got = _lora_grads(model, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert want.keys() == got.keys() and any("lora" in name for name in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    experts = model.base_model.model.model.layers[0].mlp.experts
    while not hasattr(experts, "has_gate"):
        experts = experts.base_layer
    function = hf_experts.registered_function()
    assert function is not None
    text = "\n".join(pipeline.describe() for pipeline in function.pipelines_for(experts))
    assert "backend triton" in text and "FusedGroupedGemm" in text, text


def test_training_steps_follow_the_eager_loss_curve() -> None:
    losses = {}
    ids = _ids(5)
    for implementation in ("eager", "moeforge"):
        model = _model(6)
        _use(model, implementation)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        curve = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            curve.append(float(loss.detach()))
        losses[implementation] = curve
    assert losses["moeforge"][-1] < losses["moeforge"][0]
    torch.testing.assert_close(torch.tensor(losses["moeforge"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-5)


def test_a_parametrized_reference_reads_the_module_when_the_stage_runs() -> None:
    layer = torch.nn.Linear(4, 3)
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Doubled())
    ref = ParametrizedRef(layer, "weight", transposed=True)
    torch.testing.assert_close(ref.get(), 2 * layer.parametrizations.weight.original.t())
    torch.nn.utils.parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)
    torch.testing.assert_close(ref.get(), layer.weight.t())  # the parametrization is gone: the parameter
    del layer
    with pytest.raises(ReferenceError, match="was deleted"):
        ref.get()


class _Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


# -- moeforge's own adapters in peft's layout (moeforge.peft_adapters) -----------------------------------------------


def test_a_peft_adapter_loads_into_moeforge_layers_and_gives_peft_logits() -> None:
    # A tiny Qwen3-MoE with peft's LoRA on its experts (eager experts), against the same base model whose MoE blocks
    # moeforge.hf.patch_model turned into moeforge layers with adapters, filled from peft's tensors.
    from moeforge import hf
    from moeforge.adapters import ExpertAdapter
    from moeforge.peft_adapters import load_peft, peft_experts_tensors, to_peft

    peft_model = _model(7)
    _use(peft_model, "eager")
    patched = _model_without_peft(7)
    hf.patch_model(patched, backend="torch", adapter=ExpertAdapter(rank=4, alpha=8))
    for index, block in enumerate(patched.model.layers):
        experts = peft_model.base_model.model.model.layers[index].mlp.experts
        tensors, scaling = peft_experts_tensors(experts)
        assert sorted(tensors) == ["down_proj", "gate_up_proj"] and scaling == 2.0
        load_peft(block.mlp.layer, tensors, scaling)
        round_trip = to_peft(block.mlp.layer)
        for name, (a, b) in tensors.items():
            assert torch.equal(round_trip[name][0], a) and torch.equal(round_trip[name][1], b)
    ids = _ids(8)
    with torch.no_grad():
        want = peft_model(ids).logits
        got = patched(ids).logits
        without = _model_without_peft(7)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - without).abs().max() > 1e-2  # the adapter counts


def _model_without_peft(seed: int) -> Any:
    """The base model ``_model(seed)`` wraps, built again (the same random weights)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def test_peft_tensors_of_another_shape_or_scaling_are_refused() -> None:
    import moeforge as mf
    from moeforge.adapters import ExpertAdapter
    from moeforge.peft_adapters import load_peft, to_peft

    layer = mf.MoELayer(4, 2, 16, 8, adapter=ExpertAdapter(rank=2, alpha=4))
    tensors = to_peft(layer)
    with pytest.raises(mf.InputError, match="scaling 1 .* differs from the layer's adapter scale 2"):
        load_peft(layer, tensors, 1.0)
    with pytest.raises(mf.InputError, match="no pair for 'down_proj'"):
        load_peft(layer, {"gate_up_proj": tensors["gate_up_proj"]}, 2.0)
    bad = dict(tensors, down_proj=(tensors["down_proj"][0][:-1], tensors["down_proj"][1]))
    with pytest.raises(mf.InputError, match="this layer's adapter needs"):
        load_peft(layer, bad, 2.0)
    shared = mf.MoELayer(4, 2, 16, 8, adapter=ExpertAdapter(rank=2, alpha=4, shared_a=True))
    with pytest.raises(mf.InputError, match="one A per expert"):
        load_peft(shared, {name: (torch.randn_like(a), b) for name, (a, b) in tensors.items()}, 2.0)


# -- peft's adapter files (moeforge.peft_adapters.save_peft_adapter / load_peft_adapter) ------------------------------


def _patched(seed: int, adapter: Any) -> Any:
    from moeforge import hf

    model = _model_without_peft(seed)
    hf.patch_model(model, backend="torch", adapter=adapter)
    return model


@pytest.mark.parametrize("targets", [("gate_up", "down"), ("down",)])
def test_moeforge_adapters_saved_as_a_peft_adapter_load_into_peft(tmp_path: Any, targets: tuple[str, ...]) -> None:
    from moeforge.adapters import ADAPTER_NAMES, ExpertAdapter
    from moeforge.peft_adapters import save_peft_adapter

    patched = _patched(3, ExpertAdapter(rank=2, alpha=6, targets=targets))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for block in patched.model.layers:
            for names in ADAPTER_NAMES.values():
                for name in names:
                    if hasattr(block.mlp.layer, name):
                        param = getattr(block.mlp.layer, name)
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    save_peft_adapter(patched, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(_model_without_peft(3), str(tmp_path / "adapter")).eval()
    _use(loaded, "eager")
    ids = _ids(5)
    with torch.no_grad():
        want = patched(ids).logits
        got = loaded(ids).logits
        without = _model_without_peft(3)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - without).abs().max() > 1e-2


@pytest.mark.parametrize("rslora", [False, True])
def test_a_saved_peft_adapter_loads_into_moeforge_layers(tmp_path: Any, rslora: bool) -> None:
    from moeforge.adapters import ExpertAdapter
    from moeforge.peft_adapters import load_peft_adapter

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False, use_rslora=rslora,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = peft.get_peft_model(_model_without_peft(7), lora)
    _use(peft_model, "eager")
    peft_model.save_pretrained(str(tmp_path / "saved"))
    patched = _patched(7, ExpertAdapter(rank=4, alpha=16 if rslora else 8))  # rsLoRA: lora_alpha / sqrt(r) = 4
    load_peft_adapter(patched, tmp_path / "saved")
    ids = _ids(6)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_peft_adapter_files_moeforge_cannot_load_are_refused(tmp_path: Any) -> None:
    import json

    from moeforge.adapters import ExpertAdapter
    from moeforge.errors import InputError
    from moeforge.peft_adapters import load_peft_adapter, save_peft_adapter

    patched = _patched(3, ExpertAdapter(rank=2, alpha=4))
    folder = save_peft_adapter(patched, tmp_path / "adapter")
    with pytest.raises(InputError, match="scaling"):  # another scale
        load_peft_adapter(_patched(3, ExpertAdapter(rank=2, alpha=2)), folder)
    with pytest.raises(InputError, match="targets"):  # other targets
        load_peft_adapter(_patched(3, ExpertAdapter(rank=2, alpha=4, targets="down")), folder)
    with pytest.raises(InputError, match="rank 2"):  # another rank
        load_peft_adapter(_patched(3, ExpertAdapter(rank=3, alpha=6)), folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    for change in ({"use_dora": True}, {"target_modules": ["q_proj"]}, {"rank_pattern": {"x": 4}}):
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(InputError, match="experts' parameters only"):
            load_peft_adapter(patched, folder)
    with pytest.raises(InputError, match="no block patched"):
        save_peft_adapter(_model_without_peft(3), tmp_path / "nothing")


def test_experts_stored_transposed_are_refused(tmp_path: Any) -> None:
    # GPT-OSS keeps gate_up_proj as [E, H, 2I]: peft's pairs on it are laid out for that, which is not converted yet.
    from moeforge import hf
    from moeforge.adapters import ExpertAdapter
    from moeforge.errors import InputError
    from moeforge.peft_adapters import save_peft_adapter

    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16))
    hf.patch_model(model, backend="torch", adapter=ExpertAdapter(rank=2))
    with pytest.raises(InputError, match="transposed"):
        save_peft_adapter(model, tmp_path / "adapter")


def test_peft_fine_tunes_fill_a_stack_served_together(tmp_path: Any) -> None:
    # Two peft LoRA fine-tunes of one base, saved by peft, loaded into a stack of two: each token's rows take its own
    # fine-tune, as the layer holding that fine-tune alone computes them.
    from moeforge.adapters import ExpertAdapter
    from moeforge.peft_adapters import load_peft_adapter

    for seed in (1, 2):
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        base = _model_without_peft(7)
        torch.manual_seed(100 + seed)  # peft draws the pairs: another fine-tune
        peft.get_peft_model(base, lora).save_pretrained(str(tmp_path / f"tune{seed}"))
    stacked = _patched(7, ExpertAdapter(rank=4, alpha=8, count=2))
    singles = []
    for index, seed in enumerate((1, 2)):
        load_peft_adapter(stacked, tmp_path / f"tune{seed}", index=index)
        single = _patched(7, ExpertAdapter(rank=4, alpha=8))
        load_peft_adapter(single, tmp_path / f"tune{seed}")
        singles.append(single)
    x = torch.randn(6, 32)
    ids = torch.tensor([0, 1, 1, -1, 0, 1])
    with torch.no_grad():
        got = stacked.model.layers[0].mlp.layer(x, adapter_ids=ids)
        for index, single in enumerate(singles):
            want = single.model.layers[0].mlp.layer(x)
            torch.testing.assert_close(got[ids == index], want[ids == index], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(singles[0].model.layers[0].mlp.layer(x), singles[1].model.layers[0].mlp.layer(x))
