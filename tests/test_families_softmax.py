"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Granite-MoE (plain and shared): ``moeforge.hf.from_hf(block)``
against the Hugging Face block itself, return signature included.

Each block is built from a small random config in code (no downloads) and *every* parameter and buffer
is filled with random values (HF leaves experts uninitialised and some routers at zero). fp32 must match
to a relative L2 error of 1e-5; bf16 (``block.to(torch.bfloat16)``) to 2e-2, on the tokens whose top-k
is decided in bf16: where HF's ``torch.topk`` meets an exact tie of bf16 router logits at the k-th
place, its choice is unspecified (moeforge sends ties to the lower index), so those tokens are left out.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE as HFGraniteMoeMoE  # noqa: E402
from transformers.models.granitemoeshared import modeling_granitemoeshared as hf_granite_shared  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

import moeforge as mf  # noqa: E402
from hf_helpers import converted_call, rel_err, tokens_of  # noqa: E402
from moeforge.families import family, family_of_block  # noqa: E402
from moeforge.families.granite_moe import returns_router_logits  # noqa: E402
from moeforge.hf import HFMoEBlock, from_hf, patch_model  # noqa: E402
from moeforge.shared_experts import SharedGate  # noqa: E402
from moeforge.stages.topk import Scoring, ScoreOrder  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
_SMALL = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    with torch.no_grad():
        yield


# -- blocks ------------------------------------------------------------------------------------------


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Random values in every parameter and buffer of ``module`` (in place), fp32, in eval mode.
    Routers get a larger scale, so that routing is far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        values = torch.randn(tensor.shape, generator=gen) * tensor.shape[-1] ** -0.5
        if "router" in name or name.startswith("gate.") or "shared_expert_gate" in name:
            values = values * 3.0
        tensor.copy_(values)
    return module.eval()


def _eager(config: Any) -> Any:
    config._experts_implementation = "eager"  # the modeling file's own loop: the reference we read
    return config


def mixtral(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return MixtralSparseMoeBlock(_eager(transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
        **_SMALL)))


def qwen2_moe(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return Qwen2MoeSparseMoeBlock(_eager(transformers.Qwen2MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, shared_expert_intermediate_size=inter + 8,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm, **_SMALL)))


def qwen3_moe(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return Qwen3MoeSparseMoeBlock(_eager(transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm, head_dim=8, **_SMALL)))


def olmoe(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return OlmoeSparseMoeBlock(_eager(transformers.OlmoeConfig(
        hidden_size=hidden, intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm, **_SMALL)))


def granite_moe(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return HFGraniteMoeMoE(_eager(transformers.GraniteMoeConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
        **_SMALL)))


def granite_moe_shared(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> nn.Module:
    return hf_granite_shared.GraniteMoeSharedMoE(_eager(granite_shared_config(hidden, inter, experts, top_k)))


def granite_shared_config(hidden: int, inter: int, experts: int, top_k: int, **extra: Any) -> Any:
    return transformers.GraniteMoeSharedConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
        shared_intermediate_size=inter + 8, **{**_SMALL, **extra})


# case -> (family name, block builder, whether the block reads norm_topk_prob)
CASES: dict[str, tuple[str, Callable[[int, int, int, int, bool], nn.Module], bool]] = {
    "mixtral": ("mixtral", mixtral, False),
    "qwen2_moe": ("qwen2_moe", qwen2_moe, True),
    "qwen3_moe": ("qwen3_moe", qwen3_moe, True),
    "olmoe": ("olmoe", olmoe, True),
    "granite_moe": ("granite_moe", granite_moe, False),
    "granite_moe_shared": ("granite_moe", granite_moe_shared, False),
}


def make(case: str, hidden: int = 32, inter: int = 16, experts: int = 6, top_k: int = 2, norm: bool = True,
         seed: int = 0) -> nn.Module:
    return randomize(CASES[case][1](hidden, inter, experts, top_k, norm), seed)




# -- comparison --------------------------------------------------------------------------------------






def router_weight(block: nn.Module) -> torch.Tensor:
    router = getattr(block, "gate", None) or getattr(block, "router")
    weight = getattr(router, "weight", None)
    if weight is None:
        weight = router.layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def decided_rows(block: nn.Module, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens whose k-th and (k+1)-th largest router logits differ (as HF computes them, in the
    block's dtype): there, any correct top-k picks the same experts."""
    logits = F.linear(x.reshape(-1, x.shape[-1]), router_weight(block)).float()
    if top_k >= logits.shape[-1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    top = logits.topk(top_k + 1, dim=-1).values
    return top[:, -1] != top[:, -2]


def assert_same_return(ours: Any, theirs: Any, dtype: torch.dtype, rows_ok: Optional[torch.Tensor] = None) -> float:
    """Same structure (a tensor, or a tuple of tensors of the same shapes and dtypes) and values within
    ``TOL[dtype]``; ``rows_ok`` selects the token rows compared. Returns the hidden states' error."""
    assert isinstance(ours, tuple) == isinstance(theirs, tuple), (type(ours), type(theirs))
    ours_t = ours if isinstance(ours, tuple) else (ours,)
    theirs_t = theirs if isinstance(theirs, tuple) else (theirs,)
    assert len(ours_t) == len(theirs_t)
    errors = []
    for index, (a, b) in enumerate(zip(ours_t, theirs_t)):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.shape == b.shape and a.dtype == b.dtype, (index, a.shape, b.shape, a.dtype, b.dtype)
        if rows_ok is not None:
            a, b = a.reshape(-1, a.shape[-1])[rows_ok], b.reshape(-1, b.shape[-1])[rows_ok]
        err = rel_err(a, b) if b.numel() else 0.0
        assert err < TOL[dtype], (index, err)
        errors.append(err)
    return errors[0]


def check_parity(block: nn.Module, x: torch.Tensor, top_k: int) -> float:
    """``from_hf(block)`` against ``block(x)``, both in ``x``'s dtype (the block is converted to it)."""
    block = block.to(x.dtype)
    rows_ok = None if x.dtype == torch.float32 else decided_rows(block, x, top_k)
    if rows_ok is not None:
        assert int(rows_ok.sum()) >= 0.6 * rows_ok.numel() - 1, "too many bf16 ties: the test says little"
    _, ours = converted_call(block, x)
    return assert_same_return(ours, block(x), x.dtype, rows_ok)


# -- parity --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    hidden=st.sampled_from([16, 32]),
    inter=st.sampled_from([8, 12]),
    experts=st.integers(1, 8),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6)),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_hf(case: str, data: st.DataObject, hidden: int, inter: int, experts: int,
                    shape: tuple[int, int], norm: bool, seed: int) -> None:
    top_k = data.draw(st.integers(1, experts), label="top_k")
    block = make(case, hidden, inter, experts, top_k, norm, seed)
    for dtype in (torch.float32, torch.bfloat16):  # fp32 first: .to(bf16) converts the block in place
        check_parity(block, tokens_of(hidden, *shape, dtype, seed + 1), top_k)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("experts,top_k,shape", [(4, 4, (1, 1)), (6, 1, (1, 1)), (6, 6, (2, 5)), (1, 1, (2, 3)),
                                                 (8, 2, (4, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_edges(case: str, experts: int, top_k: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """One token, top_k == num_experts, top_k == 1, a single expert, and a larger batch."""
    block = make(case, experts=experts, top_k=top_k, seed=experts * 10 + top_k)
    check_parity(block, tokens_of(32, *shape, dtype, 5), top_k)


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_norm_topk_prob_is_read_from_the_router(case: str) -> None:
    for norm in (False, True):
        block = make(case, norm=norm)
        layer = from_hf(block)
        assert layer.routing.renormalize is norm
        assert layer.routing.scoring is Scoring.SOFTMAX and layer.routing.order is ScoreOrder.SCORE_THEN_SELECT
        # not renormalised, the k weights sum to less than 1: the two settings really differ here
        check_parity(block, tokens_of(32, 2, 4, torch.float32, 1), 2)


def test_routing_settings() -> None:
    granite = from_hf(make("granite_moe"))
    assert granite.routing.order is ScoreOrder.SELECT_THEN_SCORE and granite.routing.scoring is Scoring.SOFTMAX
    assert granite.shared_experts is None and from_hf(make("granite_moe_shared")).shared_experts is None
    mixtral_layer = from_hf(make("mixtral"))
    assert mixtral_layer.routing.renormalize and mixtral_layer.routing.order is ScoreOrder.SCORE_THEN_SELECT
    qwen2 = from_hf(make("qwen2_moe"))
    assert qwen2.shared_experts is not None and qwen2.shared_experts.config.gate is SharedGate.SIGMOID
    assert qwen2.shared_experts.config.intermediate_size == 16 + 8


# -- storage -------------------------------------------------------------------------------------------


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


@pytest.mark.parametrize("case", sorted(CASES))
def test_storage_is_shared_where_promised(case: str) -> None:
    block = make(case)
    layer = from_hf(block)
    assert layer.router is not None
    experts = block.experts
    assert _same_storage(layer.w13_weight, experts.gate_up_proj)
    assert _same_storage(layer.w2_weight, experts.down_proj)
    assert _same_storage(layer.router.weight, router_weight(block))
    if case == "qwen2_moe":
        shared = layer.shared_experts
        assert shared is not None and shared.gate is not None
        assert _same_storage(shared.down_proj.weight, block.shared_expert.down_proj.weight)
        assert _same_storage(shared.gate.weight, block.shared_expert_gate.weight)
        # gate_proj and up_proj are two tensors in HF, one [2I, H] weight here: a copy (documented)
        gate_up = shared.gate_up_proj.weight
        assert gate_up.data_ptr() not in (block.shared_expert.gate_proj.weight.data_ptr(),
                                          block.shared_expert.up_proj.weight.data_ptr())
        assert torch.equal(gate_up, torch.cat([block.shared_expert.gate_proj.weight,
                                               block.shared_expert.up_proj.weight]))
    # Shared storage means an in-place update of the block reaches the layer.
    experts.down_proj.mul_(-2.0)
    router_weight(block).mul_(0.5)
    x = tokens_of(32, 2, 3, torch.float32, 9)
    module = family_of_block(block)
    assert module is not None
    assert_same_return(HFMoEBlock(layer, module, block)(x), block(x), torch.float32)


# -- presets ---------------------------------------------------------------------------------------------


PRESET_OPTIONS: dict[str, dict[str, Any]] = {
    "mixtral": {},
    "qwen2_moe": dict(norm_topk_prob=True, shared_expert_intermediate_size=24),
    "qwen3_moe": dict(norm_topk_prob=True),
    "olmoe": dict(norm_topk_prob=True),
    "granite_moe": {},
    "granite_moe_shared": {},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_preset_equals_the_converted_layer(case: str) -> None:
    name = CASES[case][0]
    block = make(case, experts=6, top_k=2, norm=True)
    converted = from_hf(block)
    layer = mf.MoELayer.from_preset(name, num_experts=6, top_k=2, hidden_size=32, intermediate_size=16,
                                    dtype=torch.float32, environ={}, **PRESET_OPTIONS[case])
    assert layer.routing == converted.routing and layer.activation == converted.activation
    assert (layer.num_experts, layer.top_k, layer.hidden_size, layer.intermediate_size) == (
        converted.num_experts, converted.top_k, converted.hidden_size, converted.intermediate_size)
    assert (layer.shared_experts is None) == (converted.shared_experts is None)
    if layer.shared_experts is not None and converted.shared_experts is not None:
        assert layer.shared_experts.config == converted.shared_experts.config
    assert layer.describe() == converted.describe()
    layer.load_state_dict(converted.state_dict())
    x = tokens_of(32, 1, 11, torch.float32, 3)
    assert torch.equal(layer(x), converted(x))
    # ... and so the preset-built layer is the HF block's function too.
    ours = HFMoEBlock(layer, family(name), block)(x)
    assert_same_return(ours, block(x), torch.float32)


def test_qwen2_moe_preset_needs_the_shared_width() -> None:
    with pytest.raises(TypeError, match="shared_expert_intermediate_size"):
        mf.MoELayer.from_preset("qwen2_moe", num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)


def test_unsupported_activation_is_refused() -> None:
    config = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                         num_experts_per_tok=2, hidden_act="gelu", head_dim=4, **_SMALL)
    with pytest.raises(ValueError, match="silu"):
        from_hf(Qwen3MoeSparseMoeBlock(config))


# -- Granite-MoE-Shared: the shared MLP lives in the decoder layer ------------------------------------------


def test_granite_shared_mlp_can_be_folded_into_a_standalone_layer() -> None:
    config = _eager(granite_shared_config(32, 16, 6, 2))
    block = randomize(hf_granite_shared.GraniteMoeSharedMoE(config), 1)
    mlp = randomize(hf_granite_shared.GraniteMoeSharedMLP(config), 2)
    layer = from_hf(block, shared_mlp=mlp)
    shared = layer.shared_experts
    assert shared is not None and shared.gate is None and shared.config.intermediate_size == 24
    assert _same_storage(shared.gate_up_proj.weight, mlp.input_linear.weight)
    assert _same_storage(shared.down_proj.weight, mlp.output_linear.weight)
    x = tokens_of(32, 2, 5, torch.float32, 4)
    assert rel_err(layer(x), block(x) + mlp(x)) < TOL[torch.float32]
    preset_layer = mf.MoELayer.from_preset("granite_moe", num_experts=6, top_k=2, hidden_size=32,
                                           intermediate_size=16, shared_intermediate_size=24,
                                           dtype=torch.float32, environ={})
    preset_layer.load_state_dict(layer.state_dict())
    assert torch.equal(preset_layer(x), layer(x))


def test_granite_shared_model_patched_keeps_its_logits() -> None:
    """patch_model replaces the block only; the decoder layer still adds its own shared MLP."""
    config = granite_shared_config(32, 16, 4, 2, vocab_size=64, num_hidden_layers=2, max_position_embeddings=32,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = randomize(hf_granite_shared.GraniteMoeSharedForCausalLM(config), 3)
    assert model.model.layers[0].shared_mlp is not None
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    report = patch_model(model)
    assert [entry.path for entry in report.replaced] == ["model.layers.0.block_sparse_moe",
                                                        "model.layers.1.block_sparse_moe"]
    assert model.model.layers[0].shared_mlp is not None
    assert rel_err(model(ids).logits, expected) < 1e-5


# -- Granite-MoE of transformers 4.x (GraniteMoeParallelExperts) -------------------------------------------


class _ParallelExperts(nn.Module):
    def __init__(self, num_experts: int, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))

    def forward(self, inputs: torch.Tensor, expert_size: list[int]) -> torch.Tensor:
        parts = inputs.split(expert_size, dim=0)
        return torch.cat([F.linear(part, self.weight[i]) for i, part in enumerate(parts)], dim=0)


class _TopKGating(nn.Module):
    def __init__(self, input_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype)
        expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0).tolist()
        _, index_sorted_experts = top_k_indices.flatten().sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits


class GraniteMoeMoE(nn.Module):
    """transformers 4.45's ``GraniteMoeMoE`` (its forward, verbatim up to names): returns
    ``(hidden_states, router_logits)``."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.input_size = hidden
        self.activation = nn.SiLU()
        self.input_linear = _ParallelExperts(experts, hidden, inter * 2)
        self.output_linear = _ParallelExperts(experts, inter, hidden)
        self.router = _TopKGating(hidden, experts, top_k)

    def forward(self, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        expert_outputs = self.output_linear(self.activation(chunked[0]) * chunked[1], expert_size)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype)
        layer_output = zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, self.input_size)
        return layer_output, router_logits


@pytest.mark.parametrize("experts,top_k", [(4, 2), (6, 6), (5, 1)])
def test_granite_moe_legacy_layout(experts: int, top_k: int) -> None:
    block = randomize(GraniteMoeMoE(32, 16, experts, top_k), experts)
    assert returns_router_logits(GraniteMoeMoE)  # its module declares no router-logits output hook
    assert not returns_router_logits(HFGraniteMoeMoE)
    assert not returns_router_logits(hf_granite_shared.GraniteMoeSharedMoE)
    layer, ours = converted_call(block, tokens_of(32, 2, 5, torch.float32, 7))
    assert layer.router is not None
    assert _same_storage(layer.w13_weight, block.input_linear.weight)
    assert _same_storage(layer.w2_weight, block.output_linear.weight)
    assert _same_storage(layer.router.weight, block.router.layer.weight)
    theirs = block(tokens_of(32, 2, 5, torch.float32, 7))
    assert_same_return(ours, theirs, torch.float32)
    assert ours[1].dtype == torch.float32 and ours[1].shape == (10, experts)
    assert math.isfinite(float(ours[0].sum()))
