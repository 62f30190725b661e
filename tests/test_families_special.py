"""DeepSeek-V3, GPT-OSS, Llama-4 and PhiMoE: ``moeforge.hf.from_hf(block)`` against the Hugging Face
block itself, return signature included.

Each block is built from a small random config in code (no downloads) and *every* parameter and buffer
is filled with random non-zero values (HF leaves experts uninitialised and routers / biases at zero;
DeepSeek's ``e_score_correction_bias`` gets negative entries). fp32 must match to a relative L2 error of
1e-5; bf16 (``block.to(torch.bfloat16)``) to 2e-2, on the tokens whose routing is decided in bf16:
where HF's ``torch.topk`` meets an exact bf16 tie, or PhiMoE's sparsemixer threshold is met within
bf16 rounding, the two implementations may legitimately choose differently (HF's tie order is
unspecified; moeforge routes in fp32 with ties to the lower index), so those tokens are left out.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("transformers")

from transformers import DeepseekV3Config, GptOssConfig, Llama4TextConfig, PhimoeConfig  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402
from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock  # noqa: E402

import moeforge as mf  # noqa: E402
from hf_helpers import converted_call, rel_err, tokens_of  # noqa: E402
from moeforge.families import family, preset  # noqa: E402
from moeforge.families.deepseek_v3 import hf_group_mask_value  # noqa: E402
from moeforge.hf import HFMoEBlock, from_hf  # noqa: E402
from moeforge.stages import select_experts  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    with torch.no_grad():
        yield


# -- blocks ------------------------------------------------------------------------------------------


def randomize(block: nn.Module, hidden: int, seed: int, router_scale: float = 2.0) -> nn.Module:
    """Random non-zero values in every parameter and buffer of ``block`` (in place), fp32."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        values = torch.randn(tensor.shape, generator=gen)
        if name.endswith("e_score_correction_bias"):
            values = values * 0.4 - 0.3  # mostly negative: biased scores below zero happen
            values[0] = -abs(float(values[0])) - 0.1
        elif tensor.dim() == 1:
            values = values * 0.5  # biases
        else:
            values = values * hidden ** -0.5 * (router_scale if "router" in name or "gate." in name else 1.0)
        tensor.copy_(values)
    return block.eval()


def deepseek_block(hidden: int = 32, inter: int = 16, experts: int = 16, top_k: int = 4, n_group: int = 4,
                   topk_group: int = 2, *, norm: bool = True, scale: float = 2.5, shared: int = 1,
                   seed: int = 0) -> nn.Module:
    config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                              num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                              norm_topk_prob=norm, routed_scaling_factor=scale, n_shared_experts=shared,
                              num_hidden_layers=1)
    return randomize(hf_deepseek.DeepseekV3MoE(config), hidden, seed)


def gpt_oss_block(hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2, *, limit: float = 1.5,
                  seed: int = 0) -> nn.Module:
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=top_k, swiglu_limit=limit, num_hidden_layers=1)
    block = GptOssMLP(config)
    block.experts.limit = limit  # some transformers versions fix it at 7.0 whatever the config says
    return randomize(block, hidden, seed)


def llama4_block(hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 1, *,
                 seed: int = 0) -> nn.Module:
    config = Llama4TextConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                              num_experts_per_tok=top_k, num_hidden_layers=1)
    return randomize(Llama4TextMoe(config), hidden, seed)


def phimoe_block(hidden: int = 32, inter: int = 16, experts: int = 8, *, jitter: float = 0.1,
                 seed: int = 0) -> nn.Module:
    config = PhimoeConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=2, router_jitter_noise=jitter, input_jitter_noise=0.01,
                          num_hidden_layers=1)
    return randomize(PhimoeSparseMoeBlock(config), hidden, seed)




# -- comparison --------------------------------------------------------------------------------------






def topk_ties(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens whose k-th and (k+1)-th largest logits are equal (HF's ``torch.topk`` may pick either)."""
    if top_k >= logits.shape[-1]:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    top = logits.float().topk(top_k + 1, dim=-1).values
    return top[:, -1] == top[:, -2]


def sparsemixer_borderline(logits: torch.Tensor, eps: float, rounds: int = 2) -> torch.Tensor:
    """Tokens where a sparsemixer decision (an arg-max tie, or an expert's distance to the threshold)
    is within bf16 rounding, computed in float64."""
    scores = logits.double()
    remaining = scores.clone()
    near = torch.zeros(scores.shape[0], dtype=torch.bool)
    for _ in range(rounds):
        top2 = remaining.topk(2, dim=-1).values
        near |= top2[:, 0] == top2[:, 1]
        best = top2[:, :1]
        ratio = (best - scores) / scores.abs().clamp(min=best)
        # bf16 rounds (m - s), the division and 2 * eps: about 0.6% of the ratio at worst. ratio == 0
        # (the best itself) is exact in any dtype; exact ties are caught above.
        window = 0.01 * ratio.abs().clamp(min=2 * eps)
        near |= (((ratio - 2 * eps).abs() <= window) & (ratio != 0)).any(-1)
        remaining = remaining.scatter(-1, remaining.argmax(-1, keepdim=True), float("-inf"))
    return near


def assert_same_return(ours: Any, theirs: Any, dtype: torch.dtype, rows_ok: Optional[torch.Tensor] = None,
                       exact: tuple[int, ...] = ()) -> None:
    """Same structure (tensor, or tuple of tensors of the same shapes and dtypes) and values within
    ``TOL[dtype]``; ``rows_ok`` selects the token rows compared in the hidden states (element 0)."""
    ours_t = ours if isinstance(ours, tuple) else (ours,)
    theirs_t = theirs if isinstance(theirs, tuple) else (theirs,)
    assert isinstance(ours, tuple) == isinstance(theirs, tuple)
    assert len(ours_t) == len(theirs_t)
    for index, (a, b) in enumerate(zip(ours_t, theirs_t)):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.shape == b.shape and a.dtype == b.dtype, (index, a.shape, b.shape, a.dtype, b.dtype)
        if index in exact:
            assert torch.equal(a, b), index
            continue
        if index == 0 and rows_ok is not None:
            a, b = a.reshape(-1, a.shape[-1])[rows_ok], b.reshape(-1, b.shape[-1])[rows_ok]
        if b.numel():
            assert rel_err(a, b) < TOL[dtype], (index, rel_err(a, b))


def enough(rows_ok: torch.Tensor) -> torch.Tensor:
    """The kept rows, after checking that near-ties left most tokens in (else the test says little)."""
    assert int(rows_ok.sum()) >= 0.6 * rows_ok.numel() - 1, f"{int((~rows_ok).sum())} of {rows_ok.numel()} skipped"
    return rows_ok


# -- DeepSeek-V3 -------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    n_group=st.sampled_from([1, 2, 4]),
    group_size=st.integers(2, 4),
    data=st.data(),
    hidden=st.sampled_from([16, 24]),
    inter=st.sampled_from([8, 12]),
    shape=st.sampled_from([(1, 1), (1, 7), (2, 5), (3, 4)]),
    norm=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    shared=st.sampled_from([1, 2]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_deepseek_v3_matches_hf(n_group: int, group_size: int, data: st.DataObject, hidden: int, inter: int,
                                shape: tuple[int, int], norm: bool, scale: float, shared: int,
                                dtype: torch.dtype, seed: int) -> None:
    topk_group = data.draw(st.integers(1, n_group), label="topk_group")
    top_k = data.draw(st.integers(1, topk_group * group_size), label="top_k")
    block = deepseek_block(hidden, inter, n_group * group_size, top_k, n_group, topk_group, norm=norm,
                           scale=scale, shared=shared, seed=seed).to(dtype)
    x = tokens_of(hidden, *shape, dtype, seed + 1)
    layer, ours = converted_call(block, x)
    # The router runs in fp32 on both sides (same logits): no bf16 tie can split them.
    assert_same_return(ours, block(x), dtype)
    # Routing: the same experts (as sets: HF's top-k is unsorted) with the same weights.
    _, hf_weights, hf_ids = block.gate(x)
    routed = select_experts(layer.router_logits(x.reshape(-1, hidden)), top_k, layer.routing,
                            layer.e_score_correction_bias)
    assert torch.equal(hf_ids.sort(-1).values, routed.ids.long().sort(-1).values)
    order = hf_ids.argsort(-1)
    torch.testing.assert_close(routed.weights.gather(-1, routed.ids.long().argsort(-1)),
                               hf_weights.float().gather(-1, order), rtol=1e-6, atol=1e-6)


def test_deepseek_v3_negative_bias_decides_and_weights_stay_unbiased() -> None:
    """With a strongly negative correction bias on half the experts, the choice avoids them, while
    the weights are the unbiased sigmoid scores (x routed_scaling_factor, renormalised)."""
    block = deepseek_block(experts=8, top_k=2, n_group=2, topk_group=1, seed=3)
    block.gate.e_score_correction_bias.copy_(torch.tensor([-3.0, 0.1] * 4))
    x = tokens_of(32, 2, 6, torch.float32, 4)
    layer, ours = converted_call(block, x)
    assert_same_return(ours, block(x), torch.float32)
    ids = layer.pipeline.stages[0](mf.MoEInput(x.reshape(-1, 32), layer.router_logits(x.reshape(-1, 32)))).topk.ids
    assert bool((ids % 2 == 1).all())


def test_deepseek_v3_from_hf_settings() -> None:
    block = deepseek_block(hidden=32, inter=16, experts=16, top_k=4, n_group=4, topk_group=2, norm=False,
                           scale=1.5, shared=2)
    layer = from_hf(block)
    r = layer.routing
    assert (r.scoring, r.selection_bias, r.n_group, r.topk_group, r.renormalize) == (
        mf.Scoring.SIGMOID, True, 4, 2, False)
    assert (r.routed_scaling_factor, r.group_score, r.router_in_fp32) == (1.5, mf.GroupScore.SUM_TOP2, True)
    assert r.group_mask_value == float("-inf") == hf_group_mask_value(block)  # this transformers' router
    assert layer.shared_experts is not None and layer.shared_experts.config.intermediate_size == 32
    assert layer.shared_experts.config.gate is mf.SharedGate.NONE
    # Expert weights share the block's storage; the selection bias is the block's buffer.
    assert layer.w13_weight.data_ptr() == block.experts.gate_up_proj.data_ptr()
    assert layer.e_score_correction_bias.data_ptr() == block.gate.e_score_correction_bias.data_ptr()


class DeepseekV3MoE(hf_deepseek.DeepseekV3MoE):
    """The routing of ``transformers`` 5.0's ``DeepseekV3MoE`` (verbatim but for names), which masks the
    dropped groups with 0.0; same class name, so moeforge converts it as a DeepSeek-V3 block."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        self.n_routed_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group

    def route_tokens_to_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = router_logits.sigmoid()
        router_logits_for_choice = router_logits + self.gate.e_score_correction_bias
        group_scores = (
            router_logits_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = router_logits.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * self.gate.routed_scaling_factor
        return topk_indices, topk_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals, orig_shape = hidden_states, hidden_states.shape
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        router_logits = F.linear(flat.float(), self.gate.weight.float())
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        out = self.experts(flat, topk_indices, topk_weights).view(*orig_shape)
        return out + self.shared_experts(residuals)


def test_deepseek_v3_zero_masked_groups_of_transformers_5_0() -> None:
    """8 experts in 4 groups of 2, 3 groups kept, k=6. With dropped groups at 0.0, a dropped expert beats
    a kept one whose biased score is negative. The tokens where HF's choice among the tied zeros is
    arbitrary (it needs some, not all, of the dropped experts) are left out."""
    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=6,
                              n_group=4, topk_group=3, n_shared_experts=1, num_hidden_layers=1)
    block = randomize(DeepseekV3MoE(config), 32, seed=5)
    block.gate.e_score_correction_bias.copy_(torch.tensor([-0.9, 0.3, -0.6, 0.2, -0.7, -0.2, 0.4, -0.8]))
    assert hf_group_mask_value(block) == 0.0
    x = tokens_of(32, 1, 64, torch.float32, 6)
    layer = from_hf(block)
    assert layer.routing.group_mask_value == 0.0 and "dropped groups -> 0" in layer.describe()
    flat = x.reshape(-1, 32)
    logits = layer.router_logits(flat)
    choice = logits.sigmoid() + layer.e_score_correction_bias
    minus_inf = select_experts(logits, 6, mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4,
                                                            topk_group=3), layer.e_score_correction_bias)
    # The kept experts: those of the 3 groups with the best sums of their two biased scores.
    groups = choice.view(-1, 4, 2).topk(2, dim=-1).values.sum(-1).topk(3, dim=-1).indices
    kept = torch.zeros(flat.shape[0], 4, dtype=torch.bool).scatter(1, groups, True).repeat_interleave(2, 1)
    kept_positive = (kept & (choice > 0)).sum(-1)
    needed = 6 - kept_positive  # dropped experts needed
    unambiguous = (needed <= 0) | (needed >= 2)
    assert bool((needed > 0).any()), "no token exercises the 0.0 mask"
    out, ref = HFMoEBlock(layer, family("deepseek_v3"), block)(x), block(x)
    assert int(unambiguous.sum()) >= 32
    assert rel_err(out.reshape(-1, 32)[unambiguous], ref.reshape(-1, 32)[unambiguous]) < TOL[torch.float32]
    # The same layer with -inf masking differs from HF on the tokens that needed a dropped expert.
    routed = select_experts(logits, 6, layer.routing, layer.e_score_correction_bias)
    changed = (routed.ids.sort(-1).values != minus_inf.ids.sort(-1).values).any(-1)
    assert bool(changed[needed > 0].all()) and not bool(changed[needed <= 0].any())


def test_deepseek_v3_from_hf_group_mask_value_override() -> None:
    layer = from_hf(deepseek_block(), group_mask_value=0.0)
    assert layer.routing.group_mask_value == 0.0


# -- GPT-OSS -----------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(2, 8),
    data=st.data(),
    hidden=st.sampled_from([16, 24]),
    inter=st.sampled_from([8, 12]),
    shape=st.sampled_from([(1, 1), (1, 7), (2, 5), (3, 4)]),
    limit=st.sampled_from([0.5, 1.5, 7.0]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_gpt_oss_matches_hf(experts: int, data: st.DataObject, hidden: int, inter: int, shape: tuple[int, int],
                            limit: float, dtype: torch.dtype, seed: int) -> None:
    top_k = data.draw(st.integers(1, experts), label="top_k")
    block = gpt_oss_block(hidden, inter, experts, top_k, limit=limit, seed=seed).to(dtype)
    x = tokens_of(hidden, *shape, dtype, seed + 1)
    layer, ours = converted_call(block, x)
    logits = layer.router_logits(x.reshape(-1, hidden))
    rows = enough(~topk_ties(logits, top_k)) if dtype is torch.bfloat16 else None
    theirs = block(x)
    assert isinstance(theirs, tuple) and theirs[1].shape == (shape[0] * shape[1], top_k)
    assert_same_return(ours, theirs, dtype, rows, exact=(1,))


def test_gpt_oss_layout_and_settings() -> None:
    block = gpt_oss_block(hidden=32, inter=16, experts=8, top_k=2, limit=1.5)
    layer = from_hf(block)
    # HF's [E, H, 2I] interleaved columns become moeforge's [E, 2I, H] interleaved rows (a copy).
    assert torch.equal(layer.w13_weight, block.experts.gate_up_proj.transpose(1, 2))
    assert torch.equal(layer.w2_weight, block.experts.down_proj.transpose(1, 2))
    assert layer.w13_weight.is_contiguous() and layer.w13_weight.data_ptr() != block.experts.gate_up_proj.data_ptr()
    assert layer.w13_bias.data_ptr() == block.experts.gate_up_proj_bias.data_ptr()
    assert layer.router is not None and layer.router.bias is not None
    assert layer.router.bias.data_ptr() == block.router.bias.data_ptr()
    act = layer.activation
    assert (act.kind, act.gate_up, act.alpha, act.limit) == (
        mf.ActivationKind.GPT_OSS_SWIGLU, mf.GateUpLayout.INTERLEAVED, 1.702, 1.5)


def test_gpt_oss_clamp_is_exercised() -> None:
    """The limit clamps some gate and up values (else the parity tests would not test it)."""
    block = gpt_oss_block(limit=0.5)
    x = tokens_of(32, 1, 16, torch.float32, 2).reshape(-1, 32)
    gate_up = torch.einsum("th,ehn->etn", x, block.experts.gate_up_proj) + block.experts.gate_up_proj_bias[:, None]
    assert bool((gate_up[..., 0::2] > 0.5).any()) and bool((gate_up[..., 1::2] < -0.5).any())


# -- Llama-4 -----------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(1, 8),
    data=st.data(),
    hidden=st.sampled_from([16, 24]),
    inter=st.sampled_from([8, 12]),
    shape=st.sampled_from([(1, 1), (1, 7), (2, 5), (3, 4)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_llama4_matches_hf(experts: int, data: st.DataObject, hidden: int, inter: int, shape: tuple[int, int],
                           dtype: torch.dtype, seed: int) -> None:
    top_k = data.draw(st.integers(1, experts), label="top_k")
    block = llama4_block(hidden, inter, experts, top_k, seed=seed).to(dtype)
    x = tokens_of(hidden, *shape, dtype, seed + 1)
    layer, ours = converted_call(block, x)
    logits = layer.router_logits(x.reshape(-1, hidden))
    rows = enough(~topk_ties(logits, top_k)) if dtype is torch.bfloat16 else None
    theirs = block(x)
    # (hidden states flattened to [T, H], raw router logits [T, E])
    assert isinstance(theirs, tuple) and theirs[0].shape == (shape[0] * shape[1], hidden)
    assert theirs[1].shape == (shape[0] * shape[1], experts)
    assert_same_return(ours, theirs, dtype, rows, exact=(1,))


def test_llama4_weights_scale_the_input() -> None:
    block = llama4_block(experts=8, top_k=1)
    layer = from_hf(block)
    assert layer.routing.apply_weights is mf.RoutingWeights.ON_INPUT
    assert (layer.routing.scoring, layer.routing.order, layer.routing.renormalize) == (
        mf.Scoring.SIGMOID, mf.ScoreOrder.SELECT_THEN_SCORE, False)
    x = tokens_of(32, 1, 9, torch.float32, 1)
    ours, theirs = HFMoEBlock(layer, family("llama4"), block)(x), block(x)
    assert_same_return(ours, theirs, torch.float32, exact=(1,))
    # Scaling the output instead gives another function (SwiGLU is not homogeneous).
    other = mf.MoELayer(**{**preset("llama4", num_experts=8, top_k=1, hidden_size=32,
                                                 intermediate_size=16, dtype=torch.float32),
                           "routing": mf.RoutingConfig(scoring=mf.Scoring.SIGMOID,
                                                       order=mf.ScoreOrder.SELECT_THEN_SCORE, renormalize=False)})
    other.load_state_dict(layer.state_dict())
    assert rel_err(other(x.reshape(-1, 32)), theirs[0]) > 1e-3


# -- PhiMoE ------------------------------------------------------------------------------------------


def hf_sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    weights, ids = sparsemixer(logits, jitter_eps=eps, training=False)
    return weights, ids


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(2, 8),
    hidden=st.sampled_from([16, 24]),
    inter=st.sampled_from([8, 12]),
    shape=st.sampled_from([(1, 1), (1, 7), (2, 5), (3, 4)]),
    jitter=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_phimoe_matches_hf(experts: int, hidden: int, inter: int, shape: tuple[int, int], jitter: float,
                           dtype: torch.dtype, seed: int) -> None:
    block = phimoe_block(hidden, inter, experts, jitter=jitter, seed=seed).to(dtype)
    x = tokens_of(hidden, *shape, dtype, seed + 1)
    layer, ours = converted_call(block, x)
    logits = layer.router_logits(x.reshape(-1, hidden))
    rows = enough(~sparsemixer_borderline(logits, jitter)) if dtype is torch.bfloat16 else None
    assert_same_return(ours, block(x), dtype, rows)
    # The routing itself, in fp32 where it is exact: same ids in the same order, same weights.
    if dtype is torch.float32:
        weights, ids = hf_sparsemixer(logits, jitter)
        routed = select_experts(logits, 2, layer.routing)
        assert torch.equal(routed.ids.long(), ids)
        torch.testing.assert_close(routed.weights, weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("jitter", [0.0, 0.01, 0.3])
def test_sparsemixer_routing_matches_hf_function(jitter: float) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(200, 16, generator=gen) * 2
    logits[:5] = torch.tensor([1.0, -2.0] * 8)  # exact ties: max's first index, as HF's
    logits[5] = 0.0
    weights, ids = hf_sparsemixer(logits, jitter)
    routed = select_experts(logits, 2, mf.RoutingConfig(sparsemixer_eps=jitter, renormalize=False))
    assert torch.equal(routed.ids.long(), ids)
    torch.testing.assert_close(routed.weights, weights, rtol=1e-6, atol=1e-7)


def test_sparsemixer_hand_example() -> None:
    """eps = 0.1: experts within 20% (relative) of the current best share its softmax."""
    logits = torch.tensor([[3.0, 2.9, 1.0, 2.5]])
    out = select_experts(logits, 2, mf.RoutingConfig(sparsemixer_eps=0.1, renormalize=False))
    assert out.ids.tolist() == [[0, 1]]
    # Round 1: best 3.0; (3 - s) / max(|s|, 3): 2.9 -> 0.033, 2.5 -> 0.167 (kept), 1.0 -> 0.67 (masked).
    first = torch.tensor([3.0, 2.9, 2.5]).softmax(-1)[0]
    # Round 2: best 2.9 among the rest; 2.5 -> (2.9 - 2.5) / 2.9 = 0.138 (kept); 3.0 is gone.
    second = torch.tensor([2.9, 2.5]).softmax(-1)[0]
    torch.testing.assert_close(out.weights, torch.stack([first, second]).reshape(1, 2))


def test_phimoe_settings_and_training_flag() -> None:
    block = phimoe_block(jitter=0.2)
    layer = from_hf(block)
    assert layer.top_k == 2 and layer.routing.sparsemixer_eps == 0.2 and not layer.routing.renormalize
    assert "sparsemixer eps=0.2" in layer.describe()
    assert layer.w13_weight.data_ptr() == block.experts.gate_up_proj.data_ptr()
    # input_jitter_noise is a training-time perturbation: the eval-mode block ignores it, as we do.
    x = tokens_of(32, 2, 3, torch.float32, 0)
    assert_same_return(HFMoEBlock(layer, family("phimoe"), block)(x), block(x), torch.float32)


def test_sparsemixer_config_is_validated() -> None:
    with pytest.raises(mf.InputError, match="sparsemixer"):
        mf.RoutingConfig(sparsemixer_eps=0.1, scoring=mf.Scoring.SIGMOID)
    with pytest.raises(mf.InputError, match="sparsemixer"):
        mf.RoutingConfig(sparsemixer_eps=0.1, n_group=2, topk_group=1)
    with pytest.raises(mf.InputError, match="sparsemixer_eps"):
        mf.RoutingConfig(sparsemixer_eps=-0.1)
    with pytest.raises(mf.InputError, match="group_mask_value"):
        mf.RoutingConfig(group_mask_value=float("nan"))


# -- presets -----------------------------------------------------------------------------------------


PRESET_CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "deepseek_v3": (lambda: deepseek_block(norm=False, scale=1.5, shared=2),
                    dict(num_experts=16, top_k=4, hidden_size=32, intermediate_size=16, n_group=4, topk_group=2,
                         norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2)),
    "gpt_oss": (lambda: gpt_oss_block(limit=1.5),
                dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, swiglu_limit=1.5)),
    "llama4": (lambda: llama4_block(top_k=2), dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)),
    "phimoe": (lambda: phimoe_block(jitter=0.1),
               dict(num_experts=8, hidden_size=32, intermediate_size=16, router_jitter_noise=0.1)),
}


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_from_preset_equals_the_converted_layer(name: str) -> None:
    make, options = PRESET_CASES[name]
    block = make()
    converted = from_hf(block)
    layer = mf.MoELayer.from_preset(name, dtype=torch.float32, environ={}, **options)
    assert layer.routing == converted.routing and layer.activation == converted.activation
    assert (layer.num_experts, layer.top_k, layer.hidden_size, layer.intermediate_size) == (
        converted.num_experts, converted.top_k, converted.hidden_size, converted.intermediate_size)
    assert (layer.shared_experts is None) == (converted.shared_experts is None)
    if layer.shared_experts is not None and converted.shared_experts is not None:
        assert layer.shared_experts.config == converted.shared_experts.config
    assert layer.describe() == converted.describe()
    layer.load_state_dict(converted.state_dict())
    x = tokens_of(32, 1, 11, torch.float32, 3).reshape(-1, 32)
    assert torch.equal(layer(x), converted(x))
    # ... and so the preset layer is the HF block's function too.
    ours = HFMoEBlock(layer, family(name), block)(x.reshape(1, 11, 32))
    assert_same_return(ours, block(x.reshape(1, 11, 32)), torch.float32,
                       exact=(1,) if name == "llama4" else ())


def test_unsupported_activation_is_refused() -> None:
    config = PhimoeConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, hidden_act="gelu",
                          num_hidden_layers=1)
    with pytest.raises(ValueError, match="silu"):
        from_hf(PhimoeSparseMoeBlock(config))
