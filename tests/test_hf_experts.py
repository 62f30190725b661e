"""``experts_implementation="moeforge"`` (``moeforge.hf_experts``): tiny random ``transformers`` models of
several families give the logits, the greedy tokens and the gradients of ``transformers``' eager experts;
every layout flag of ``@use_experts_implementation`` is read as ``transformers`` reads it; what moeforge
does not compute is refused by name; registering is explicit and idempotent; nothing outlives a model."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(moe, "ExpertsInterface"):
    pytest.skip("this transformers has no experts interface", allow_module_level=True)

from moeforge import hf_experts  # noqa: E402
from moeforge.errors import BackendUnavailableError, InputError, UnsupportedExpertsError  # noqa: E402
from hf_helpers import randomise_weights  # noqa: E402

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
               tie_word_embeddings=False)


def _qwen3_moe() -> Any:
    return transformers.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, head_dim=8, intermediate_size=64,
                                       moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                                       norm_topk_prob=True)


def _mixtral() -> Any:
    return transformers.MixtralConfig(**_COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2)


def _gpt_oss() -> Any:
    return transformers.GptOssConfig(**_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, head_dim=8, sliding_window=16)


def _deepseek_v3() -> Any:
    return transformers.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8)


def _qwen2_moe() -> Any:
    return transformers.Qwen2MoeConfig(**_COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2)


def _olmoe() -> Any:
    return transformers.OlmoeConfig(**_COMMON, num_hidden_layers=2, intermediate_size=24, num_experts=6,
                                    num_experts_per_tok=2)


def _deepseek_v4() -> Any:
    # the clamped SwiGLU (silu(min(gate, limit)) * clamp(up, +-limit)); a small limit, so that both clamps bite
    return transformers.DeepseekV4Config(**_COMMON, num_hidden_layers=2, moe_intermediate_size=24, head_dim=8,
                                         q_lora_rank=16, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2,
                                         sliding_window=16, swiglu_limit=0.5)


def _hy_v4() -> Any:
    # the clamped SwiGLU in the experts' _apply_gate, no act_fn
    return transformers.HYV4Config(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, intermediate_size=64,
                                   moe_intermediate_size=24, n_routed_experts=6, n_shared_experts=1,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, swiglu_limit=0.5)


def _inkling2() -> Any:
    # the softcapped SwiGLU (act_fn(gate, up) with softcaps the tiny model's values reach)
    from transformers.models.inkling2 import Inkling2TextConfig

    return Inkling2TextConfig(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, head_dim=8,
                              moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
                              mlp_gate_softcap=0.75, mlp_up_softcap=1.0)


# family -> (model class name, config); every experts class here is decorated with @use_experts_implementation
FAMILIES: dict[str, tuple[str, Callable[[], Any]]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", _qwen3_moe),
    "mixtral": ("MixtralForCausalLM", _mixtral),
    "gpt_oss": ("GptOssForCausalLM", _gpt_oss),  # transposed, biases, interleaved clamped SwiGLU
    "deepseek_v3": ("DeepseekV3ForCausalLM", _deepseek_v3),
    "qwen2_moe": ("Qwen2MoeForCausalLM", _qwen2_moe),
    "olmoe": ("OlmoeForCausalLM", _olmoe),
    "deepseek_v4": ("DeepseekV4ForCausalLM", _deepseek_v4),  # the clamped SwiGLU, act_fn SiLU
    "hy_v4": ("HYV4ForCausalLM", _hy_v4),  # the clamped SwiGLU, no act_fn
    "inkling2": ("Inkling2ForCausalLM", _inkling2),  # the softcapped SwiGLU
}


@pytest.fixture(scope="module")
def function() -> hf_experts.ExpertsFunction:
    return hf_experts.register()


def build(name: str, seed: int = 0, implementation: str = "eager") -> Any:
    """A tiny model with every parameter random (``transformers`` leaves expert weights uninitialised), in
    eval mode, in fp32."""
    class_name, config = FAMILIES[name]
    if not hasattr(transformers, class_name):  # DeepSeek-V4, HY-V4, Inkling2 came with later transformers releases
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config()).eval()
    randomise_weights(model, seed + 1)
    model.set_experts_implementation(implementation)
    return model


def tokens(batch: int = 2, length: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if hasattr(module, "has_gate") and hasattr(module, "down_proj")]


# -- whole models -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_logits_match_eager(name: str, function: hf_experts.ExpertsFunction) -> None:
    model = build(name)
    ids = tokens()
    want = logits(model, ids)
    model.set_experts_implementation("moeforge")
    assert model.config._experts_implementation == "moeforge"
    got = logits(model, ids)
    assert rel_err(got, want) <= 1e-6
    # Every experts module of the model ran through this function's pipelines (none fell back to eager).
    assert all(function.pipelines_for(module) for module in experts_modules(model))


# (Inkling2's router keeps fp32 weights that a bf16 model's eager forward multiplies bf16 rows with: eager fails)
@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "inkling2"])
def test_bf16_logits_are_as_accurate_as_eager(name: str, function: hf_experts.ExpertsFunction) -> None:
    """In bf16 both implementations round differently; moeforge's error against the fp32 logits is that of
    the eager experts (within a quarter), and the two stay within a few bf16 steps of each other."""
    model = build(name)
    ids = tokens()
    exact = logits(model, ids)
    model.to(torch.bfloat16)
    eager = logits(model, ids)
    model.set_experts_implementation("moeforge")
    got = logits(model, ids)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, exact) <= 1.25 * rel_err(eager, exact)
    assert rel_err(got, eager) <= 2e-2


def greedy(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """The greedy continuation, and the smallest gap between the best and second-best logit on the way."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    margin = min(float((top[:, 0] - top[:, 1]).min()) for top in (s.topk(2, dim=-1).values for s in out.scores))
    return out.sequences, margin


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_greedy_generation_matches_eager(name: str, function: hf_experts.ExpertsFunction) -> None:
    model = build(name)
    ids = tokens()
    want, margin = greedy(model, ids, 6)
    # The comparison means something only when no step is a near tie (a 1e-6 difference could flip it).
    assert margin > 1e-4, f"test data: a near tie at some step (gap {margin:.2e}); pick another seed"
    model.set_experts_implementation("moeforge")
    got, _ = greedy(model, ids, 6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v4"])
def test_gradients_match_eager(name: str, function: hf_experts.ExpertsFunction) -> None:
    """The backward runs through moeforge's torch stages: every parameter (expert weights and biases, the
    router through the routing weights, attention, embeddings) gets the eager gradient."""
    model = build(name).train()
    ids = tokens()
    grads: dict[str, dict[str, torch.Tensor]] = {}
    losses = {}
    for implementation in ("eager", "moeforge"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses[implementation] = loss.detach()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(losses["moeforge"], losses["eager"], rtol=1e-6, atol=0)
    assert grads["moeforge"].keys() == grads["eager"].keys()
    experts = [n for n in grads["eager"] if ".experts." in n]
    assert experts and all(bool(grads["moeforge"][n].abs().sum() > 0) for n in experts)
    for n, want in grads["eager"].items():
        assert rel_err(grads["moeforge"][n], want) <= 1e-5, n


def test_loaded_model_switches_back_and_forth(tmp_path: Path, function: hf_experts.ExpertsFunction) -> None:
    build("qwen3_moe").save_pretrained(tmp_path)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="moeforge").eval()
    assert model.config._experts_implementation == "moeforge"
    ids = tokens()
    got = logits(model, ids)
    for implementation in ("eager", "moeforge", "grouped_mm", "moeforge", "eager"):
        model.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        assert rel_err(logits(model, ids), got) <= 1e-6
    # One pipeline per experts module, built once and kept across the switches.
    assert all(len(function.pipelines_for(module)) == 1 for module in experts_modules(model))


def test_weights_are_read_when_the_experts_run(function: hf_experts.ExpertsFunction) -> None:
    """The pipelines hold no copy: an in-place update, a new parameter and a dtype change are all seen."""
    model = build("gpt_oss")
    ids = tokens()
    model.set_experts_implementation("moeforge")
    logits(model, ids)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.mul_(1.5)
    experts.down_proj = nn.Parameter(torch.randn_like(experts.down_proj) * 0.2)
    experts.down_proj_bias.data = torch.randn_like(experts.down_proj_bias) * 0.2
    got = logits(model, ids)
    model.set_experts_implementation("eager")
    assert rel_err(got, logits(model, ids)) <= 1e-6
    model.to(torch.float16)
    want = logits(model, ids)
    model.set_experts_implementation("moeforge")
    got = logits(model, ids)
    assert got.dtype == torch.float16 and rel_err(got, want) <= 1e-2
    assert len(function.pipelines_for(experts)) == 2  # fp32 and fp16
    model.to(torch.float64)
    with pytest.raises(InputError, match=r"hidden_states are torch.float64; moeforge computes in torch.bfloat16"):
        logits(model, ids)


def test_deleting_a_model_frees_it(function: hf_experts.ExpertsFunction) -> None:
    model = build("mixtral").train()
    ids = tokens()
    model.set_experts_implementation("moeforge")
    model(ids, labels=ids).loss.backward()
    before = function.cached_modules()
    assert before >= 2
    model_ref = weakref.ref(model)
    weight_ref = weakref.ref(model.model.layers[0].mlp.experts.gate_up_proj)
    del model
    # Freed by reference counting alone, as the eager model is: the pipelines keep no cycle.
    assert model_ref() is None and weight_ref() is None
    gc.collect()
    assert function.cached_modules() == before - 2


# -- the layout flags, on experts modules of each layout ------------------------------------------------

def _experts_class(**flags: bool) -> type[nn.Module]:
    @moe.use_experts_implementation(**flags)
    class TinyExperts(nn.Module):
        def __init__(self, config: Any, act: str, experts: int = 5, hidden: int = 12, intermediate: int = 10) -> None:
            super().__init__()
            has_gate, transposed = flags.get("has_gate", True), flags.get("is_transposed", False)
            up = (2 if has_gate else 1) * intermediate
            shapes = {"up": (experts, hidden, up) if transposed else (experts, up, hidden),
                      "down": (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)}
            name = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, name, nn.Parameter(torch.randn(shapes["up"]) * 0.3))
            self.down_proj = nn.Parameter(torch.randn(shapes["down"]) * 0.3)
            if flags.get("has_bias", False):
                setattr(self, f"{name}_bias", nn.Parameter(torch.randn(experts, up) * 0.3))
                self.down_proj_bias = nn.Parameter(torch.randn(experts, hidden) * 0.3)
            self.num_experts = experts
            self.act_fn = transformers.activations.ACT2FN[act]

        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            raise AssertionError("the experts implementation runs, not this")

    return TinyExperts


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 12, generator=gen)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    return hidden, ids, weights


LAYOUTS = [
    (dict(), "silu"),                                                       # Mixtral, Qwen, DeepSeek
    (dict(is_transposed=True), "silu"),                                     # Aria
    (dict(is_transposed=True, has_bias=True), "gelu"),
    (dict(has_bias=True), "gelu_pytorch_tanh"),
    (dict(has_gate=False), "relu2"),                                        # Nemotron-H
    (dict(has_gate=False, is_transposed=True, has_bias=True), "gelu_new"),
    (dict(has_gate=False), "silu"),
]


@pytest.mark.parametrize("flags,act", LAYOUTS, ids=[f"{'-'.join(f) or 'default'}-{a}" for f, a in LAYOUTS])
def test_each_layout_matches_transformers(flags: dict[str, bool], act: str) -> None:
    """Against transformers' own batched_mm experts function, which reads the same flags; an empty batch
    and a batch on one expert included. A function of its own: this test touches no registry."""
    function = hf_experts.ExpertsFunction()
    config = transformers.PretrainedConfig()
    config._experts_implementation = "eager"
    module = _experts_class(**flags)(config, act)
    for tokens_, top_k, seed in ((9, 2, 0), (1, 3, 1), (0, 2, 2)):
        hidden, ids, weights = _routing(tokens_, 5, top_k, seed)
        want = moe.batched_mm_experts_forward(module, hidden, ids, weights)
        got = function(module, hidden, ids, weights)
        assert got.shape == want.shape == hidden.shape and got.dtype == hidden.dtype
        if tokens_:
            assert rel_err(got, want) <= 1e-6
    hidden, ids, weights = _routing(6, 5, 1, 3)
    ids = torch.full_like(ids, 4)  # every token on the last expert
    assert rel_err(function(module, hidden, ids, weights), moe.batched_mm_experts_forward(module, hidden, ids,
                                                                                         weights)) <= 1e-6


def test_the_pipeline_says_what_it_runs() -> None:
    function = hf_experts.ExpertsFunction()
    config = transformers.PretrainedConfig()
    module = _experts_class(is_transposed=True, has_bias=True)(config, "silu")
    text = function.pipeline(module, torch.zeros(3, 12), 2).describe()
    assert "routing: given by transformers" in text
    assert "GroupedGemm(gate_up, 12->20, bias)" in text and "Activate(swiglu, concatenated)" in text
    assert "experts TorchUnquantizedExperts" in text and "backend torch" in text


# -- FP8 experts (transformers' FP8Experts, FP8 checkpoints) ----------------------------------------------

def _fp8_experts(block_size: Any = (128, 128), activation_scheme: str = "dynamic", seed: int = 0,
                 hidden: int = 256, intermediate: int = 128) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """transformers' FP8Experts (a subclass, decorated as transformers decorates it when it loads an FP8
    checkpoint) holding DeepSeek-V3-format weights quantized from random floats; and the dequantized weights."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from moeforge.quant.w8a8 import dequantize_weight, quantize_weight_blockwise

    class TinyFP8Experts(fp8.FP8Experts):  # a subclass: decorating it leaves transformers' class alone
        pass

    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=4,
                                         num_experts_per_tok=2, hidden_act="silu")
    config._experts_implementation = "moeforge"
    decorated = moe.use_experts_implementation(TinyFP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    module = decorated(config, block_size=block_size, activation_scheme=activation_scheme)
    generator = torch.Generator().manual_seed(seed)
    dequantized = {}
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name)
            if block_size is None or tuple(block_size) != (128, 128):
                continue
            floats = torch.randn(weight.shape, generator=generator) / weight.shape[-1] ** 0.5
            q, scale = quantize_weight_blockwise(floats)
            weight.copy_(q)
            getattr(module, f"{name}_scale_inv").copy_(scale)
            dequantized[name] = dequantize_weight(q, scale)
    return module, dequantized


def test_fp8_experts_run_in_deepseek_v3_format(function: hf_experts.ExpertsFunction) -> None:
    """An FP8Experts module of an FP8 checkpoint runs through moeforge's FP8 stages (activations quantized per
    128-group, e4m3 x e4m3 GEMMs with 128x128 block scales), within FP8 rounding of the float experts on the
    dequantized weights; the block scales mean what they mean to transformers' own dequantizer."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    assert fp8.ALL_FP8_EXPERTS_FUNCTIONS[hf_experts.NAME] is function
    module, dequantized = _fp8_experts()
    if hasattr(fp8, "_dequantize_fp8_weight"):  # transformers 5.23 (5.17 dequantizes at loading only)
        theirs = fp8._dequantize_fp8_weight(module.gate_up_proj.data, module.gate_up_proj_scale_inv.data,
                                            [128, 128], torch.float32)
        assert torch.equal(theirs, dequantized["gate_up_proj"])
    reference = _module()  # float experts with the dequantized weights
    reference.gate_up_proj = nn.Parameter(dequantized["gate_up_proj"])
    reference.down_proj = nn.Parameter(dequantized["down_proj"])
    reference.num_experts = 4
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 256, generator=gen).to(torch.bfloat16)
    ids = torch.rand(11, 4, generator=gen).argsort(-1)[:, :2]
    weights = torch.rand(11, 2, generator=gen).to(torch.bfloat16)
    got = module(hidden, ids, weights)  # transformers' forward dispatches to the registered function
    want = moe.batched_mm_experts_forward(reference, hidden.float(), ids, weights.float())
    assert got.dtype == torch.bfloat16 and got.shape == hidden.shape
    assert 1e-3 < rel_err(got, want) < 0.08  # FP8 activations: a few percent, never exact
    (pipeline,) = function.pipelines_for(module)
    text = pipeline.describe()
    assert "W8A8GroupedGemm(gate_up, 256->256, w=fp8_e4m3/block128, a=fp8_e4m3/per_group_128)" in text
    assert "dispatch fp8" in text and "experts TorchW8A8Experts" in text


def test_other_fp8_formats_are_refused_by_name() -> None:
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    hidden, ids, weights = _routing(4, 4, 2, 0)
    hidden = torch.randn(4, 256).to(torch.bfloat16)
    function = hf_experts.ExpertsFunction()
    module, _ = _fp8_experts(block_size=(64, 64))
    with pytest.raises(UnsupportedExpertsError, match=r"block_size=\(64, 64\): moeforge computes FP8 experts with "
                                                      r"128x128 weight blocks"):
        function(module, hidden, ids, weights)
    module, _ = _fp8_experts(activation_scheme="static")
    with pytest.raises(UnsupportedExpertsError, match=r"activation_scheme='static'"):
        function(module, hidden, ids, weights)
    module, _ = _fp8_experts(hidden=192)
    with pytest.raises(UnsupportedExpertsError, match=r"need hidden_size divisible by 128, got 192"):
        function(module, torch.randn(4, 192).to(torch.bfloat16), ids, weights)
    module, _ = _fp8_experts()
    module.down_proj_scale_inv = nn.Parameter(torch.ones(4, 2, 1, dtype=fp8._get_ue8m0_dtype()), requires_grad=False)
    with pytest.raises(UnsupportedExpertsError, match=r"UE8M0 scales"):
        function(module, hidden, ids, weights)


# -- what is refused ----------------------------------------------------------------------------------------

def _module(act: str = "silu", **flags: bool) -> nn.Module:
    return _experts_class(**flags)(transformers.PretrainedConfig(), act)


def _run(module: nn.Module, top_k: int = 2) -> torch.Tensor:
    hidden, ids, weights = _routing(4, 5, top_k, 0)
    return hf_experts.ExpertsFunction()(module, hidden, ids, weights)


def test_an_activation_moeforge_does_not_compute_is_named() -> None:
    with pytest.raises(UnsupportedExpertsError, match=r"TinyExperts.act_fn is Tanh, an activation moeforge does not"):
        _run(_module("tanh"))
    with pytest.raises(UnsupportedExpertsError, match=r"gates with act_fn=ReLUSquaredActivation"):
        _run(_module("relu2"))
    module = _module()
    del module.act_fn
    module.act_fn = lambda x: torch.nn.functional.silu(x) + 1  # a plain function moeforge does not know
    with pytest.raises(UnsupportedExpertsError, match=r"act_fn is .*<lambda>"):
        _run(module)


def test_a_gating_that_differs_from_its_declared_activation_is_refused() -> None:
    """A class that overrides _apply_gate (a softcap here) is checked against what it computes."""
    module = _module()
    module._apply_gate = lambda gate_up: 5 * torch.tanh(nn.functional.silu(gate_up.chunk(2, -1)[0]) / 5) * \
        gate_up.chunk(2, -1)[1]
    with pytest.raises(UnsupportedExpertsError, match=r"TinyExperts's _apply_gate does not compute swiglu"):
        _run(module)
    clamped = _module()
    clamped.limit = 7.0  # a clamp without GPT-OSS's alpha: the default gating, which does not clamp
    _run(clamped)
    clamped.alpha = 1.702  # now declared GPT-OSS's, but its _apply_gate is still the plain SwiGLU
    with pytest.raises(UnsupportedExpertsError, match=r"does not compute gpt_oss_swiglu"):
        _run(clamped)


def test_a_module_changed_after_its_first_call_is_read_again() -> None:
    """The cached pipeline is keyed by everything it depends on: a new activation, gating or flag is seen."""
    function = hf_experts.ExpertsFunction()
    module = _module()
    hidden, ids, weights = _routing(4, 5, 2, 0)
    function(module, hidden, ids, weights)
    module.act_fn = transformers.activations.ACT2FN["gelu"]
    assert rel_err(function(module, hidden, ids, weights), moe.batched_mm_experts_forward(module, hidden, ids,
                                                                                         weights)) <= 1e-6
    module.act_fn = nn.Tanh()
    with pytest.raises(UnsupportedExpertsError, match="act_fn is Tanh"):
        function(module, hidden, ids, weights)
    module.act_fn = transformers.activations.ACT2FN["silu"]
    module._apply_gate = lambda gate_up: gate_up.chunk(2, -1)[1]
    with pytest.raises(UnsupportedExpertsError, match="_apply_gate does not compute swiglu"):
        function(module, hidden, ids, weights)
    del module._apply_gate
    module.has_post_expert_norm = True
    with pytest.raises(UnsupportedExpertsError, match="has_post_expert_norm"):
        function(module, hidden, ids, weights)
    assert len(function.pipelines_for(module)) == 2  # silu and gelu


def test_what_moeforge_does_not_run_is_refused() -> None:
    module = _module()
    module._is_expert_parallel = True
    with pytest.raises(UnsupportedExpertsError, match="expert parallelism"):
        _run(module)
    module = _module()
    module.has_post_expert_norm = True
    with pytest.raises(UnsupportedExpertsError, match="has_post_expert_norm"):
        _run(module)
    plain = nn.Module()
    plain.down_proj = nn.Parameter(torch.zeros(5, 12, 10))
    with pytest.raises(UnsupportedExpertsError, match=r"no boolean 'has_gate' attribute.*@use_experts_implementation"):
        _run(plain)
    module = _module()
    module.gate_up_proj = nn.Parameter(torch.zeros(5, 21, 12))
    with pytest.raises(UnsupportedExpertsError, match=r"gate_up_proj \(5, 21, 12\) and down_proj \(5, 12, 10\)"):
        _run(module)


def test_bad_arguments_name_themselves() -> None:
    module = _module()
    function = hf_experts.ExpertsFunction()
    hidden, ids, weights = _routing(4, 5, 2, 0)
    with pytest.raises(InputError, match=r"top_k_index and top_k_weights must both be \[tokens=4, top_k\]"):
        function(module, hidden, ids, weights[:, :1])
    with pytest.raises(InputError, match=r"top_k_index must hold integer expert ids"):
        function(module, hidden, ids.float(), weights)
    with pytest.raises(InputError, match=r"hidden_states must be \[tokens, 12\]"):
        function(module, hidden[:, :8], ids, weights)


# -- registration ---------------------------------------------------------------------------------------

def test_register_is_explicit_and_idempotent(function: hf_experts.ExpertsFunction) -> None:
    assert hf_experts.register() is function
    assert moe.ALL_EXPERTS_FUNCTIONS[hf_experts.NAME] is function
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    assert fp8.ALL_FP8_EXPERTS_FUNCTIONS[hf_experts.NAME] is function  # FP8 checkpoints' experts too
    assert hf_experts.registered_function() is function
    assert "moeforge" in repr(function)


def test_importing_the_module_registers_nothing() -> None:
    code = ("import sys\n"
            "import moeforge.hf_experts\n"
            "print('transformers' in sys.modules)\n"
            "import transformers.integrations.moe as moe\n"
            "print('moeforge' in moe.ALL_EXPERTS_FUNCTIONS)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_a_name_registered_by_another_library_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(*args: Any) -> None:
        raise AssertionError

    monkeypatch.setitem(moe.ExpertsInterface._global_mapping, hf_experts.NAME, other)
    with pytest.raises(BackendUnavailableError, match="already registered to .*other.*leaves it as it is"):
        hf_experts.register()
    assert moe.ALL_EXPERTS_FUNCTIONS[hf_experts.NAME] is other


def test_a_transformers_that_refuses_registered_names_is_said_so(monkeypatch: pytest.MonkeyPatch,
                                                                 function: hf_experts.ExpertsFunction) -> None:
    """Early transformers 5 releases check experts_implementation against a fixed list: as they did."""
    def fixed_list_check(self: Any, requested_experts: Optional[str]) -> str:
        applicable = "grouped_mm" if requested_experts is None else requested_experts
        if applicable not in ["eager", "grouped_mm", "batched_mm"]:
            raise ValueError(f'Specified `experts_implementation="{applicable}"` is not supported. The only possible '
                             'arguments are `experts_implementation="eager"`, `"experts_implementation=grouped_mm"` '
                             'and `"experts_implementation=batched_mm"`.')
        return applicable

    monkeypatch.setattr(transformers.modeling_utils.PreTrainedModel, "get_correct_experts_implementation",
                        fixed_list_check)
    with pytest.raises(BackendUnavailableError, match=r"refuses experts_implementation='moeforge'.*fixed list.*"
                       r"moeforge does not patch transformers.*patch_model"):
        hf_experts.register()
