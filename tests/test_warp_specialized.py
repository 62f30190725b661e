"""A tuned table's ``warp_specialized`` entries (:mod:`moeforge.kernels.warp_specialized`): the launches the Gluon
kernel takes and the reasons it gives for the others; the flag never reaching a training gate/up GEMM or the
batch-invariant family; a pipeline whose table asks for it computing the layer the plain table computes — on CPU
(the interpreter: ``moe_gemm`` serves every launch, the reason in the stage's summary) and on a Hopper GPU, where
the Gluon kernel serves the inference launches and not the training ones; the tuner timing the marked tiles and
writing the flag.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import in_family, invariant_table  # noqa: E402
from moeforge.kernels import warp_specialized  # noqa: E402
from moeforge.kernels.activations import ACT_GELU, ACT_NONE, ACT_SILU  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = GemmConfig(128, 128, 64, num_warps=8, num_stages=4, warp_specialized=True)


def _problem(**changes: Any) -> Any:
    a = changes.pop("a", torch.zeros(4, 256, dtype=torch.bfloat16))
    weight = changes.pop("weight", torch.zeros(2, 512, 256, dtype=torch.bfloat16))
    launch = dict(quantized=False, weight_format=WeightFormat.FLOAT, bias=False, act=ACT_SILU, glu=True,
                  interleaved=False, out_dtype=a.dtype, fp8_out=False, update=None, config=TILE,
                  aligned_block_m=128)
    launch.update(changes)
    return warp_specialized.problem(a, weight, **launch)


@pytest.mark.parametrize("changes, words", [
    (dict(quantized=True), "float rows and weights"),
    (dict(weight_format=WeightFormat.FP8), "float rows and weights"),
    (dict(weight=torch.zeros(2, 512, 256, dtype=torch.float16)), "float rows and weights of one dtype"),
    (dict(out_dtype=torch.float16), "writes the rows' dtype or fp32"),
    (dict(fp8_out=True), "not fp8"),
    (dict(update=(None, torch.zeros(3, 2, 512, 16, dtype=torch.bfloat16), None, 1.0)),
     "a stack's update in every adapter's columns alone"),
    (dict(update=(torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(2, 512, 16, dtype=torch.bfloat16), None, 2.0)),
     "a stack's update in every adapter's columns alone"),
    (dict(update=(torch.zeros(8, 24, dtype=torch.bfloat16), torch.zeros(3, 2, 512, 8, dtype=torch.bfloat16), None,
                  1.0)), "multiples of 16 dividing BLOCK_K"),
    (dict(config=attrs.evolve(TILE, split_k=2)), "no split"),
    (dict(config=attrs.evolve(TILE, swap=True)), "no swapped product"),
    (dict(a=torch.zeros(4, 256), weight=torch.zeros(2, 512, 256)), "bf16 / fp16"),
    (dict(bias=True), "no bias"),
    (dict(act=ACT_GELU), "SwiGLU"),
    (dict(interleaved=True), "concatenated"),
    (dict(glu=False, act=ACT_SILU), "plain GEMM has no activation"),
    (dict(weight=torch.zeros(2, 500, 256, dtype=torch.bfloat16)), "whole 16-byte pieces, not 250 columns"),
])
def test_a_launch_names_why_the_warp_specialised_kernel_cannot_take_it(changes: dict[str, Any], words: str) -> None:
    found = _problem(**changes)
    assert found is not None and words in found, found


@pytest.mark.skipif(HOPPER, reason="the operands' own problems show where the device has none")
def test_on_another_device_the_reason_is_the_device() -> None:
    found = _problem()
    assert found is not None and ("sm_90" in found or "Gluon" in found), found
    assert "sm_90" in (_problem(glu=False, act=ACT_NONE) or "")


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("changes, words", [
    (dict(config=GemmConfig(32, 128, 64, warp_specialized=True)), "64 or 128 rows"),
    (dict(aligned_block_m=64), "must divide"),
    (dict(a=torch.zeros(4, 200, dtype=torch.bfloat16), weight=torch.zeros(2, 512, 200, dtype=torch.bfloat16)),
     "multiples of 16"),
    (dict(config=GemmConfig(128, 256, 128, num_warps=8, num_stages=4, warp_specialized=True)), "shared memory"),
    (dict(a="one element off"), "16-byte aligned"),
])
def test_a_launch_the_hopper_kernel_cannot_take_is_named(changes: dict[str, Any], words: str) -> None:
    a, weight = torch.zeros(4, 256, dtype=torch.bfloat16, device="cuda"), \
        torch.zeros(2, 512, 256, dtype=torch.bfloat16, device="cuda")
    assert _problem(a=a, weight=weight) is None  # (the launch the table's tile takes)
    changes = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in changes.items()}
    if isinstance(changes.get("a"), str):  # (a view one element into its storage: the rows 2 bytes off)
        changes["a"] = torch.zeros(4 * 256 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 256)
    found = _problem(**{"a": a, "weight": weight, **changes})
    assert found is not None and words in found, found


def test_the_flag_never_reaches_a_training_gate_up_launch_or_the_invariant_family() -> None:
    # a training forward runs the gate/up GEMM unfused (moe_gemm's wide tile): measured faster only fused
    assert not TILE.unfused_gate_up().warp_specialized
    assert not attrs.evolve(TILE, block_n=256).unfused_gate_up().warp_specialized
    assert not in_family(attrs.evolve(TILE, split_k=1))
    tuned = ConfigTable(8, 2, (64, 4096), (MoEConfig(GemmConfig(64, 64, 64), GemmConfig(64, 64, 64)),
                                           MoEConfig(TILE, attrs.evolve(TILE, block_n=256, warp_specialized=False))))
    assert tuned.warp_specialized_tokens("gate_up") == (4096,) and tuned.warp_specialized_tokens("down") == ()
    invariant = invariant_table(8, 2, tuned=tuned)
    assert not any(invariant.lookup(m).gate_up.warp_specialized for m in (1, 64, 4096, 10 ** 5))


def _pipeline(table: ConfigTable, w13: torch.Tensor, w2: torch.Tensor, experts: int, k: int, hidden: int) -> Any:
    return mf.Pipeline([TritonTopK(experts, k, mf.RoutingConfig()), AlignDispatch(experts, table),
                        FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
                        FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine()],
                       mf.input_spec(hidden, w13.dtype, experts))


@pytest.mark.parametrize("tokens", [0, 1, 40, 300] if HOPPER else [0, 1, 20])
def test_a_table_that_asks_for_the_kernel_computes_the_same_layer(tokens: int, monkeypatch: Any) -> None:
    experts, k, hidden, inter = (8, 2, 256, 192) if HOPPER else (4, 2, 64, 32)
    dtype = torch.bfloat16 if HOPPER else torch.float16  # (the interpreter mis-computes bf16 dots)
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE, dtype)
    tile = TILE if HOPPER else GemmConfig(64, 32, 32, num_warps=4, num_stages=2, warp_specialized=True)
    plain = attrs.evolve(tile, warp_specialized=False)
    asked = ConfigTable(experts, k, (1,), (MoEConfig(tile, plain),))
    table = ConfigTable(experts, k, (1,), (MoEConfig(plain, plain),))
    launches = []
    original = warp_specialized.launch
    monkeypatch.setattr(warp_specialized, "launch", lambda *args, **kw: launches.append(1) or original(*args, **kw))
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    with torch.no_grad():
        got = _pipeline(asked, w13, w2, experts, k, hidden)(mf.MoEInput(x, logits)).hidden_states
        want = _pipeline(table, w13, w2, experts, k, hidden)(mf.MoEInput(x, logits)).hidden_states
    assert len(launches) == (1 if HOPPER and tokens else 0)
    if HOPPER:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    else:  # the same moe_gemm launch served both
        assert torch.equal(got, want)
    # training: the unfused gate/up GEMM and every backward launch are moe_gemm's, as without the flag
    grads = []
    for each in (asked, table):
        weights = [w.clone().requires_grad_() for w in (w13, w2)]
        rows = x.clone().requires_grad_()
        out = _pipeline(each, *weights, experts, k, hidden)(mf.MoEInput(rows, logits)).hidden_states
        out.float().square().sum().backward()
        grads.append([out] + [t.grad for t in (rows, *weights)])
    assert len(launches) == (1 if HOPPER and tokens else 0)
    for one, other in zip(*grads):
        assert (one is None and other is None) or torch.equal(one, other)


def test_the_stage_summary_says_where_the_kernel_serves_or_why_not() -> None:
    w13 = torch.zeros(4, 64, 64, dtype=torch.float16, device=DEVICE)
    asked = ConfigTable(4, 2, (64, 4096), (MoEConfig(GemmConfig(64, 64, 64), GemmConfig(64, 64, 64)),
                                           MoEConfig(attrs.evolve(TILE, block_m=64, num_warps=4),
                                                     GemmConfig(64, 64, 64))))
    gate_up = FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, asked, activation=mf.ActivationConfig())
    summary = gate_up.summary()
    assert "warp-specialised Gluon kernel at the table's M = 4096" in summary, summary
    assert ("without autograd" in summary) if HOPPER else ("skipped" in summary and "sm_90" in summary), summary
    gelu = FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, asked,
                            activation=mf.ActivationConfig(kind=mf.ActivationKind.GEGLU))
    assert "skipped: the warp-specialised kernel's gated activation is SwiGLU" in gelu.summary()
    down = FusedGroupedGemm(mf.GemmRole.DOWN, torch.zeros(4, 64, 32, dtype=torch.float16, device=DEVICE), asked)
    assert "warp-specialised" not in down.summary()


def test_the_tuner_times_the_warp_specialized_kernel_and_writes_the_choice(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_moe.tune_cell(..., warp_specialized=True)`` on a small triton pipeline with made-up times: each
    candidate tile the Gluon kernel takes (64 rows here, not 16 or 32) is timed also marked ``warp_specialized``
    (on CPU ``moe_gemm`` runs it: the launch names the device); the faster choice is written and read back; a
    quantized format gets no such candidates."""
    from test_mixed_row_blocks import tuned_with_a_flag, tuner_on_a_small_pipeline

    experts, k, hidden = 4, 2, 48
    tune_moe, layer = tuner_on_a_small_pipeline(monkeypatch, experts, k, seed=6)
    tiles = [GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(64, 32, 16, 1, 4, 2), GemmConfig(64, 32, 32, 1, 4, 2)]
    monkeypatch.setattr(tune_moe, "candidates", lambda fmt, rows: iter(tiles))
    twins = tune_moe.warp_specialized_twins(tiles, glu=True)
    assert twins == [attrs.evolve(tiles[2], warp_specialized=True)]  # (a K-step of 16: not the Gluon kernel's)
    # gate/up: the marked 64-row tile fastest; down: the unmarked one
    launched = tuned_with_a_flag(monkeypatch, capsys, tune_moe, layer, "warp_specialized", 64)
    assert ("gate_up", 64, True) in launched and ("down", 64, True) in launched
    assert ("gate_up", 16, True) not in launched
    assert not any(c.warp_specialized for roles in tune_moe.plan(layer, (experts, k, hidden, 40), "fp8", 20,
                                                                   warp_specialized=True).values()
                   for configs in roles.values() for c in configs)


@pytest.mark.parametrize("adapter", ["one adapter", "a served stack of three"])
def test_adapters_over_a_table_that_asks_for_the_kernel_compute_the_same_layer(adapter: str) -> None:
    """An adapter over a marked table: a launch with its update inside (one adapter's, a served stack's) is not the
    Gluon kernel's, a plain one may be; the outputs equal the plain table's (on CPU the same bits: ``moe_gemm``
    serves both) and the torch layer's, and a training step through the marked table the same gradients (where a
    marked down GEMM runs plain in training, the Gluon kernel may serve it on a GPU: there within rounding)."""
    from test_adapters_triton import _randomise_adapter

    from moeforge.adapters import ExpertAdapter, adapt
    from moeforge.selector import expert_stages

    experts, k, hidden, inter = 6, 2, 64, 32
    dtype = torch.bfloat16 if HOPPER else torch.float16  # (the interpreter mis-computes bf16 dots)
    spec = ExpertAdapter(rank=4, alpha=8) if adapter == "one adapter" else ExpertAdapter(rank=3, alpha=6, count=3)
    torch.manual_seed(3)
    layer = mf.MoELayer(experts, k, hidden, inter, adapter=spec, dtype=dtype, device=DEVICE, backend="torch",
                        environ={})
    _randomise_adapter(layer, 4)
    gen = torch.Generator().manual_seed(5)
    tile = GemmConfig(64, 32, 32, num_warps=4, num_stages=2, warp_specialized=True)
    plain = attrs.evolve(tile, warp_specialized=False)

    def pipeline(table: ConfigTable) -> Any:
        # (the layer's own top-k, so that only the GEMMs differ: two top-k kernels may break a tie of bf16 logits
        # apart; on an H200 this test's routing was the same with either)
        stages = [layer.pipeline.stages[0], AlignDispatch(experts, table)]
        stages += expert_stages(layer.quant, layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                backend=mf.Backend.TRITON, configs=table, dispatch=layer.dispatch_decision.dtype)
        stages.append(Combine(out_dtype=mf.DType.from_torch(dtype)))
        return mf.Pipeline(adapt(stages, layer, spec), mf.input_spec(hidden, dtype, experts))

    asked = pipeline(ConfigTable(experts, k, (1,), (MoEConfig(tile, tile),)))
    table = pipeline(ConfigTable(experts, k, (1,), (MoEConfig(plain, plain),)))
    x = torch.randn(40, hidden, generator=gen).to(DEVICE, dtype)
    logits = layer.router_logits(x).detach()
    ids = (torch.arange(40, device=DEVICE) % 4 - 1) if spec.count > 1 else None
    with torch.no_grad():
        got, want = (run.run(mf.MoEInput(x, logits, ids)).hidden_states for run in (asked, table))
        reference = layer.pipeline.run(mf.MoEInput(x, logits, ids)).hidden_states
    if HOPPER:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(got, want)
    # (bf16 on an H200: outputs up to ~75 here; the triton layer and the torch one each stray up to 0.4-0.8 from the
    # float64 layer, and up to 0.5 from each other, in elements near zero: a bound on the output's scale)
    atol = 1e-2 * float(reference.abs().max()) if HOPPER else 3e-2
    torch.testing.assert_close(got.float(), reference.float(), rtol=3e-2, atol=atol)
    if spec.count > 1:
        return  # (a stack trains through the launches of its own, unchanged by the table)
    params = [param for name, param in layer.named_parameters() if "router" not in name]
    upstream = torch.randn(40, hidden, generator=gen).to(DEVICE) * 1e-2  # (fp16 weight gradients stay finite)
    grads = []
    for run in (asked, table):
        rows = x.clone().requires_grad_()
        out = run.run(mf.MoEInput(rows, logits)).hidden_states
        grads.append(torch.autograd.grad((out.float() * upstream).sum(), [rows, *params]))
    for one, other in zip(*grads):
        assert torch.isfinite(one).all()
        if HOPPER:
            torch.testing.assert_close(one.float(), other.float(), rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(one, other)


def test_the_h200_table_marks_the_large_batch_swiglu_gate_up_entries_the_readme_names() -> None:
    # (README, "Backends and performance": Qwen3 and Mixtral from M = 1024, DeepSeek-V3 and GPT-OSS from 4096)
    marked = {(128, 8, 2048, 768): (1024, 4096, 16384), (8, 2, 4096, 14336): (1024, 4096, 16384),
              (256, 8, 7168, 2048): (4096, 16384), (128, 4, 2880, 2880): (4096, 16384)}
    for (experts, k, hidden, inter), tokens in marked.items():
        table = ConfigTable.load("NVIDIA H200", experts, k, hidden, inter, "bf16")
        assert table.warp_specialized_tokens("gate_up") == tokens and table.warp_specialized_tokens("down") == ()
        assert ConfigTable.load("NVIDIA H100 80GB HBM3", experts, k, hidden, inter, "bf16"
                                ).warp_specialized_tokens("gate_up") == ()  # (not measured there)
    w13 = torch.zeros(128, 2 * 768, 2048, dtype=torch.bfloat16)
    table = ConfigTable.load("NVIDIA H200", 128, 8, 2048, 768, "bf16")
    summary = FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()).summary()
    assert "warp-specialised Gluon kernel at the table's M = 1024, 4096, 16384" in summary, summary
