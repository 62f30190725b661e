"""The Triton kernels against the torch reference.

Without a GPU they run in Triton's interpreter at tiny shapes with fp16/fp32 operands (the interpreter
mis-computes ``tl.dot`` on bf16); on a GPU the same tests also run in bf16 and at larger shapes.
Outputs are poisoned with NaN first, so every element is proven written.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.kernels import align, combine, moe_gemm, topk, weight_grad  # noqa: E402
from moeforge.kernels.activations import parameters_of  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.reference import dense_moe  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import (  # noqa: E402
    AlignDispatch,
    FusedGroupedGemm,
    TritonTopK,
    act_code,
)
from moeforge.stages.activation import apply_activation  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL = GemmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)


def _ids(tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if tokens == 0:
        return torch.empty(0, k, dtype=torch.int32, device=DEVICE)
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "an output element was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


# -- alignment ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "any order"])
@pytest.mark.parametrize("tokens,k,experts,block_m", [
    (0, 2, 8, 16), (1, 1, 4, 16), (1, 8, 128, 16), (5, 2, 8, 4), (37, 4, 16, 16), (64, 2, 4, 64), (6, 6, 6, 16),
    (171, 6, 24, 16), (300, 4, 128, 16), (700, 2, 2, 32)])
def test_alignment_groups_every_copy_by_expert(tokens: int, k: int, experts: int, block_m: int, ordered: bool) -> None:
    # The last three take the two-launch path (more than IN_ORDER_COPIES copies): the ordered scatter, or atomics.
    ids = _ids(tokens, experts, k, torch.Generator().manual_seed(tokens))
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, block_m, ordered)
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=experts)
    used = int(num_padded.item())
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert used <= sorted_ids.numel()
    rows = sorted_ids[:used].cpu()
    assert sorted(rows[rows < flat.numel()].tolist()) == list(range(flat.numel()))
    assert int((rows == flat.numel()).sum()) == used - flat.numel()  # the rest is padding
    for block in range(used // block_m):
        members = rows[block * block_m:(block + 1) * block_m]
        members = members[members < flat.numel()]
        assert (flat[members.long()] == int(block_expert[block])).all()


@pytest.mark.parametrize("tokens,k,experts,block_m", [
    (1, 2, 8, 16), (16, 8, 128, 16), (37, 4, 6, 32), (100, 3, 5, 128), (128, 8, 128, 64), (171, 6, 24, 16),
    (129, 8, 64, 16), (400, 8, 256, 64), (333, 7, 5, 32), (520, 4, 128, 16), (700, 2, 2, 16), (300, 4, 512, 16),
    (600, 2, 7, 128), (1100, 4, 1024, 16), (100, 8, 1024, 16), (120, 8, 1000, 16)])
def test_every_batch_aligns_each_experts_copies_in_ascending_order(tokens: int, k: int, experts: int,
                                                                     block_m: int) -> None:
    # Up to align.IN_ORDER_COPIES copies one program sorts them; more, the plan counts them per chunk and the
    # scatter places each chunk in order: either way each expert's copies in ascending order, the order the weight
    # gradient sums in, the same slots from run to run. The cases from (171, 6) on take the two-kernel plan: chunks
    # with a ragged last one, 256 and 512 experts (more blocks than a scatter program writes at a time), 2 experts,
    # experts not a power of two, 128-row blocks.
    ids = _ids(tokens, experts, k, torch.Generator().manual_seed(7 * tokens + k))
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, block_m)
    used = int(num_padded.item())
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = sorted_ids[:used].cpu()
    start = 0
    for expert in range(experts):  # its copies ascending, then its padding, in its own blocks
        run = int((counts[expert] + block_m - 1) // block_m * block_m)
        members = rows[start:start + run]
        assert members[:int(counts[expert])].tolist() == torch.nonzero(flat == expert).flatten().tolist()
        assert (members[int(counts[expert]):] == flat.numel()).all()
        assert (block_expert[start // block_m:(start + run) // block_m].cpu() == expert).all()
        start += run
    assert start == used


def test_alignment_of_every_token_on_one_expert() -> None:
    ids = torch.full((40, 1), 3, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 8, 16)
    assert int(num_padded.item()) == 48
    assert block_expert[:3].tolist() == [3, 3, 3]


# -- routing -----------------------------------------------------------------------------------------

ROUTINGS = {
    "mixtral": (mf.RoutingConfig(), 8, 2, False),
    "no-renorm": (mf.RoutingConfig(renormalize=False), 8, 2, False),
    "gpt-oss": (mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE), 8, 4, False),
    "llama4": (mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE, scoring=mf.Scoring.SIGMOID,
                                renormalize=False), 16, 1, False),
    "deepseek-v3": (mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, selection_bias=True, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5), 32, 4, True),
    "deepseek-v2": (mf.RoutingConfig(n_group=4, topk_group=2, group_score=mf.GroupScore.MAX), 20, 3, False),
    "k=E": (mf.RoutingConfig(), 6, 6, False),
    "pending-scale": (mf.RoutingConfig(routed_scaling_factor=2.0, scaling_in_weights=False), 8, 2, False),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_routing_kernel_matches_select_experts(name: str, tokens: int) -> None:
    config, experts, k, has_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if has_bias else None
    weights, ids = topk.route(logits, bias, k, **topk.routing_flags(config))
    ref = mf.stages.select_experts(logits, k, config, bias)
    assert torch.equal(ids, ref.ids)
    torch.testing.assert_close(weights, ref.weights, atol=1e-6, rtol=1e-5)


def test_routing_kernel_breaks_ties_toward_the_lower_expert() -> None:
    logits = torch.zeros(3, 8, device=DEVICE)
    _, ids = topk.route(logits, None, 3, **topk.routing_flags(mf.RoutingConfig()))
    assert ids.tolist() == [[0, 1, 2]] * 3
    # -0.0 and +0.0 are equal: still the lower expert first (the kernel ranks by integer keys)
    logits = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0, -2.0]], device=DEVICE)
    for config in (mf.RoutingConfig(), mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE)):
        _, ids = topk.route(logits, None, 4, **topk.routing_flags(config))
        assert ids.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_routing_kernel_gives_a_token_the_same_bits_in_any_batch(name: str) -> None:
    """The kernel's tile follows the token count (1 token: one row per program, more: up to 16), and its
    sums do not depend on the tile: a token's weights and ids are bitwise the same in every batch."""
    config, experts, k, has_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(300, experts, generator=gen).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if has_bias else None
    flags = topk.routing_flags(config)
    alone_w, alone_ids = topk.route(pool[:1], bias, k, **flags)
    for tokens, at in ((3, 2), (40, 17), (300, 299)):
        batch = pool[:tokens].clone()
        batch[at] = pool[0]
        weights, ids = topk.route(batch, bias, k, **flags)
        assert torch.equal(ids[at], alone_ids[0]) and torch.equal(weights[at], alone_w[0]), (tokens, at)


@pytest.mark.parametrize("experts,k,renormalize", [(512, 8, False), (1000, 6, True), (160, 160, False)])
def test_routing_kernel_with_many_experts(experts: int, k: int, renormalize: bool) -> None:
    """The softmax's fixed-point denominator over many experts (and every expert chosen)."""
    config = mf.RoutingConfig(renormalize=renormalize)
    logits = (torch.randn(5, experts, generator=torch.Generator().manual_seed(3)) * 4).to(DEVICE)
    weights, ids = topk.route(logits, None, k, **topk.routing_flags(config))
    ref = mf.stages.select_experts(logits, k, config)
    assert torch.equal(ids, ref.ids)
    torch.testing.assert_close(weights, ref.weights, atol=1e-6, rtol=1e-5)


# -- grouped GEMM ------------------------------------------------------------------------------------

ACTIVATIONS = {
    "swiglu": mf.ActivationConfig(),
    "swiglu-interleaved": mf.ActivationConfig(gate_up=mf.GateUpLayout.INTERLEAVED),
    "geglu-tanh": mf.ActivationConfig(mf.ActivationKind.GEGLU, gelu_approximate="tanh"),
    "geglu": mf.ActivationConfig(mf.ActivationKind.GEGLU),
    "gpt-oss": mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED),
    # limits and softcaps the products reach (DeepSeek-V4's / HY-V4's clamp, Inkling2's softcaps)
    "clamped-swiglu": mf.ActivationConfig(mf.ActivationKind.CLAMPED_SWIGLU, limit=0.75),
    "softcapped-swiglu": mf.ActivationConfig(mf.ActivationKind.SOFTCAPPED_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED,
                                             gate_softcap=0.5, up_softcap=1.0),
    "silu": mf.ActivationConfig(mf.ActivationKind.SILU),
    "gelu": mf.ActivationConfig(mf.ActivationKind.GELU),
    "relu2": mf.ActivationConfig(mf.ActivationKind.RELU2),
    "identity": mf.ActivationConfig(mf.ActivationKind.IDENTITY),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_gemm_with_fused_activation_bias_and_weights(name: str, dtype: torch.dtype) -> None:
    act = ACTIVATIONS[name]
    tokens, k, experts, hidden, inter = 7, 2, 4, 40, 24  # K not a multiple of the block: masked loads
    gen = torch.Generator().manual_seed(1)
    width = 2 * inter if act.gated else inter
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, width, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    b13 = torch.randn(experts, width, generator=gen).to(DEVICE, dtype)
    ids = _ids(tokens, experts, k, gen)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, inter), float("nan"), dtype=dtype, device=DEVICE)
    code = act_code(act)
    moe_gemm.moe_gemm(x, w13, out, sorted_ids, block_expert, num_padded, rows_per_a=k, config=SMALL,
                                bias=b13, topk_weights=weights.reshape(-1), act=code, glu=act.gated,
                                interleaved=act.gate_up is mf.GateUpLayout.INTERLEAVED,
                                alpha=parameters_of(act)[0], limit=parameters_of(act)[1])
    flat = ids.reshape(-1).long()
    hidden_ref = torch.einsum("ch,cnh->cn", x.double()[torch.arange(tokens * k, device=DEVICE) // k],
                              w13.double()[flat]) + b13.double()[flat]
    ref = apply_activation(hidden_ref, act) * weights.double().reshape(-1, 1)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_second_gemm_reads_copy_rows(dtype: torch.dtype) -> None:
    tokens, k, experts, hidden, inter = 9, 3, 5, 32, 48
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(tokens * k, inter, generator=gen).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    ids = _ids(tokens, experts, k, gen)
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, SMALL.block_m)
    out = torch.full((tokens * k, hidden), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm.moe_gemm(rows, w2, out, sorted_ids, block_expert, num_padded, rows_per_a=1, config=SMALL)
    ref = torch.einsum("ci,chi->ch", rows.double(), w2.double()[ids.reshape(-1).long()])
    assert _rel(out, ref) < TOL[dtype]


# -- combine -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("tokens,k,hidden", [(0, 2, 16), (1, 1, 8), (11, 3, 40), (4, 8, 1100)])
def test_combine_sums_copies_in_fixed_order(with_weights: bool, tokens: int, k: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(tokens * k, hidden, generator=gen).to(DEVICE, torch.float16)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE) if with_weights else None
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.float32, device=DEVICE)
    combine.combine_copies(rows, k, out, weights, scale=1.5)
    ref = rows.double().view(tokens, k, hidden)
    if weights is not None:
        ref = ref * weights.double().unsqueeze(-1)
    ref = ref.sum(1) * 1.5
    if tokens:
        assert _rel(out, ref) < 1e-6
    again = torch.empty_like(out)
    combine.combine_copies(rows, k, again, weights, scale=1.5)
    assert torch.equal(out, again)


@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("tokens,k,hidden", [(0, 2, 16), (1, 1, 8), (11, 3, 40), (4, 8, 1100), (3, 5, 17)])
def test_combine_backward_gives_the_row_and_weight_gradients(with_weights: bool, weight_grad: bool, tokens: int,
                                                             k: int, hidden: int) -> None:
    # d_rows[t k + j] = scale w[t, j] d_out[t]; d_w[t, j] = scale <d_out[t], rows[t k + j]>; top_k not a power of
    # two, hidden past the last block, an expanded gradient (stride 0, what out.sum() hands over).
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(tokens * k, hidden, generator=gen).to(DEVICE, torch.float16)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE) if with_weights else None
    for grad in (torch.randn(tokens, hidden, generator=gen).to(DEVICE), torch.ones(1, 1, device=DEVICE).expand(
            tokens, hidden)):
        d_rows, d_weights = combine.combine_backward(grad, rows, weights, k, 1.5, weight_grad)
        g = grad.double()[:, None, :] * 1.5
        w = weights.double()[..., None] if weights is not None else torch.ones(1, k, 1, dtype=torch.float64,
                                                                                device=DEVICE)
        assert d_rows.dtype == rows.dtype and d_rows.shape == rows.shape
        if tokens:
            assert _rel(d_rows, (g * w).reshape(rows.shape)) < 1e-3
        if weight_grad and weights is not None:
            assert d_weights is not None and d_weights.dtype == weights.dtype
            want = (g * rows.double().view(tokens, k, hidden)).sum(-1)
            if tokens:
                torch.testing.assert_close(d_weights.double(), want, rtol=1e-5, atol=1e-4)
        else:
            assert d_weights is None


@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("tokens,k,slots,hidden", [(5, 3, 24, 40), (1, 1, 3, 8), (6, 2, 40, 300)])
def test_combine_backward_by_index_zeroes_the_rows_no_copy_reads(weight_grad: bool, tokens: int, k: int, slots: int,
                                                                 hidden: int) -> None:
    # Rows in slot order: each copy's row where the index says (one copy absent: -1), the other slots (padding) read
    # by no copy. Their gradient must be zeros whatever the allocation held (freed NaN rows of the same size first).
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(slots, hidden, generator=gen).to(DEVICE, torch.float16)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    index = torch.randperm(slots, generator=gen)[:tokens * k].view(tokens, k)
    index[0, 0] = -1
    grad = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    stale = torch.full_like(rows, float("nan"))
    del stale
    d_rows, d_weights = combine.combine_backward(grad, rows, weights, k, 1.5, weight_grad, index.to(DEVICE))
    want = torch.zeros(slots, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            if index[t, j] >= 0:
                want[index[t, j]] = 1.5 * float(weights[t, j]) * grad[t].double().cpu()
    assert not bool(d_rows.isnan().any())
    unread = torch.ones(slots, dtype=torch.bool)
    unread[index[index >= 0]] = False
    assert bool((d_rows.cpu()[unread] == 0).all())
    assert _rel(d_rows.cpu(), want) < 1e-3
    if weight_grad:
        assert d_weights is not None and float(d_weights[0, 0]) == 0.0  # the absent copy


# -- the whole triton pipeline -----------------------------------------------------------------------

def _pipeline(experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, routing: mf.RoutingConfig,
              act: mf.ActivationConfig, bias: bool, gen: torch.Generator):
    width = 2 * inter if act.gated else inter
    w13 = (torch.randn(experts, width, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    b13 = torch.randn(experts, width, generator=gen).to(DEVICE, dtype) if bias else None
    b2 = torch.randn(experts, hidden, generator=gen).to(DEVICE, dtype) if bias else None
    table = ConfigTable(experts, k)
    in_epilogue = routing.apply_weights is mf.RoutingWeights.IN_GEMM_EPILOGUE
    folded = routing.scaling_in_weights or routing.routed_scaling_factor == 1.0
    stages = [
        TritonTopK(experts, k, routing),
        AlignDispatch(experts, table),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, b13, act),
        FusedGroupedGemm(mf.GemmRole.DOWN, w2, table, b2, apply_routing_weights=in_epilogue),
        Combine(apply_routing_weights=not in_epilogue,
                       routed_scaling_factor=None if folded else routing.routed_scaling_factor),
    ]
    pipeline = mf.Pipeline(stages, mf.input_spec(hidden, dtype, experts), debug=True)
    return pipeline, dict(w13=w13, w2=w2, w13_bias=b13, w2_bias=b2)


CASES = {
    "mixtral": (8, 2, mf.RoutingConfig(), mf.ActivationConfig(), False),
    "gpt-oss": (8, 4, mf.RoutingConfig(order=mf.ScoreOrder.SELECT_THEN_SCORE, apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE),
                mf.ActivationConfig(mf.ActivationKind.GPT_OSS_SWIGLU, gate_up=mf.GateUpLayout.INTERLEAVED), True),
    "deepseek": (16, 4, mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, scaling_in_weights=False),
                 mf.ActivationConfig(), False),
    "k=E relu2": (4, 4, mf.RoutingConfig(), mf.ActivationConfig(mf.ActivationKind.RELU2), False),
    "identity": (4, 2, mf.RoutingConfig(), mf.ActivationConfig(mf.ActivationKind.IDENTITY), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tokens", [0, 1, 23])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_pipeline_matches_dense_reference(name: str, tokens: int, dtype: torch.dtype) -> None:
    experts, k, routing, act, bias = CASES[name]
    gen = torch.Generator().manual_seed(4)
    hidden, inter = 48, 40
    pipeline, weights = _pipeline(experts, k, hidden, inter, dtype, routing, act, bias, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    if tokens:
        ref = dense_moe(x, logits, top_k=k, routing=routing, activation=act, **weights)
        assert _rel(out, ref) < TOL[dtype] * 2


def test_triton_pipeline_with_every_token_on_one_expert() -> None:
    gen = torch.Generator().manual_seed(5)
    experts, k, hidden, inter = 8, 1, 32, 32
    pipeline, weights = _pipeline(experts, k, hidden, inter, torch.float32, mf.RoutingConfig(),
                                  mf.ActivationConfig(), False, gen)
    x = torch.randn(33, hidden, generator=gen).to(DEVICE)
    logits = torch.full((33, experts), -5.0, device=DEVICE)
    logits[:, 6] = 5.0
    out = pipeline(mf.MoEInput(x, logits)).hidden_states
    ref = dense_moe(x, logits, top_k=k, **weights)
    assert _rel(out, ref) < 1e-5


def test_fused_gemm_rejects_activations_of_another_dtype() -> None:
    table = ConfigTable(4, 2)
    w13 = torch.randn(4, 32, 16, dtype=torch.float16, device=DEVICE)
    w2 = torch.randn(4, 16, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(mf.ContractError, match="dtype"):
        mf.Pipeline([TritonTopK(4, 2), AlignDispatch(4, table),
                     FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                     FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()],
                    mf.input_spec(16, torch.float32, 4))


def test_reference_stages_cannot_consume_block_aligned_rows() -> None:
    table = ConfigTable(4, 2)
    w13 = torch.randn(4, 32, 16, device=DEVICE)
    with pytest.raises(mf.ContractError, match="layout"):
        mf.Pipeline([TritonTopK(4, 2), AlignDispatch(4, table), mf.GroupedGemm(mf.GemmRole.GATE_UP, w13)],
                    mf.input_spec(16, torch.float32, 4))


def test_activation_fusion_is_one_stage_of_two_kinds() -> None:
    table = ConfigTable(4, 2)
    stage = FusedGroupedGemm(mf.GemmRole.GATE_UP, torch.randn(4, 32, 16, device=DEVICE), table,
                             activation=mf.ActivationConfig())
    assert stage.kinds == (mf.StageKind.GEMM, mf.StageKind.ACTIVATION)


def test_dispatch_and_gemms_from_tables_that_align_differently_are_rejected_at_build_time() -> None:
    # Caught when the pipeline is built, no longer on every call (even with zero tokens).
    w13 = torch.randn(4, 32, 16, device=DEVICE)
    w2 = torch.randn(4, 16, 16, device=DEVICE)
    small = GemmConfig(16, 32, 32)
    table16 = ConfigTable(4, 2, (1, 64), (MoEConfig(small, small), MoEConfig(small, small)))
    wide = GemmConfig(32, 32, 32)
    table32 = ConfigTable(4, 2, (1, 64), (MoEConfig(small, small), MoEConfig(wide, wide)))

    def stages(dispatch_table: ConfigTable, gemm_table: ConfigTable) -> list[mf.Stage]:  # type: ignore[type-arg]
        return [TritonTopK(4, 2), AlignDispatch(4, dispatch_table),
                FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, gemm_table, activation=mf.ActivationConfig()),
                FusedGroupedGemm(mf.GemmRole.DOWN, w2, gemm_table), Combine()]

    spec = mf.input_spec(16, torch.float32, 4)
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline(stages(table16, table32), spec)
    assert error.value.field == "alignment" and "same ConfigTable" in error.value.hint
    # A table with the same block_m for every token count aligns alike, although another object.
    copy = ConfigTable(4, 2, (1, 64), (MoEConfig(small, small), MoEConfig(small, small)))
    pipeline = mf.Pipeline(stages(table16, copy), spec)
    x = torch.randn(5, 16, device=DEVICE)
    assert pipeline(mf.MoEInput(x, torch.randn(5, 4, device=DEVICE))).hidden_states.shape == (5, 16)
    assert table16.alignment() != ConfigTable(4, 2).alignment() != ConfigTable(8, 2).alignment()


@pytest.mark.parametrize("plan_block_m,config_block_m", [(32, 16), (16, 32)])
def test_a_plan_aligned_by_another_block_m_is_an_error(plan_block_m: int, config_block_m: int) -> None:
    """The kernel takes each tile's expert from ``block_expert[tile row block]``: a configuration whose
    ``block_m`` differs from the plan's would read the wrong expert for most tiles (a silent wrong answer), so
    the launcher refuses it; the matching configuration runs."""
    gen = torch.Generator().manual_seed(70)
    ids = _ids(40, 4, 2, gen)
    x = torch.randn(40, 32, generator=gen).to(DEVICE)
    weight = torch.randn(4, 16, 32, generator=gen).to(DEVICE)
    out = torch.empty(80, 16, device=DEVICE)
    plan = align.align_block_size(ids, 4, plan_block_m)
    with pytest.raises(ValueError, match="pass the block the rows were aligned with"):
        moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=2, config=GemmConfig(config_block_m, 16, 32))
    moe_gemm.moe_gemm(x, weight, out, *plan, rows_per_a=2, config=GemmConfig(plan_block_m, 16, 32))
    want = torch.einsum("ck,cnk->cn", x.repeat_interleave(2, 0), weight[ids.reshape(-1).long()])
    assert _rel(out, want) < 1e-5
