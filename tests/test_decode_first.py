"""4-bit weights decoded first (``GemmConfig.decode_chunk``, ``moe_gemm(..., decode_chunk=C)``).

The weights of ``C`` experts at a time are decoded into a scratch in the compute dtype
(:func:`moeforge.kernels.decode_first.decode_weights`), then the float GEMM runs over those experts' row blocks
(:func:`moeforge.kernels.decode_first.block_ranges`, a persistent grid). The decoded values are the ones the GEMM's
in-register decoding computes, bitwise (against a torch decoding of the codes here); the GEMM's output is then
compared with the in-register path closely (another MMA operand path: on the GPU the sums may round apart; under
the interpreter on CPU they came out equal). Every 4-bit format (INT4 with and without zero points and with a
group larger than the K-step, MXFP4, NVFP4 with float and with NVFP4 rows), down and fused gate/up, chunks of one
expert, uneven chunks, one chunk and more than all experts; routings with an idle expert, every row on one expert,
an empty batch; bias and routing weights per chunk; the errors; the batch-invariant family; a whole layer from a
table whose entries ask for it; the tuner's candidates. Outputs are poisoned with NaN: every element is proven
written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeforge as mf  # noqa: E402
from moeforge.batch_invariant import family_member, in_family  # noqa: E402
from moeforge.kernels import align, decode_first, moe_gemm  # noqa: E402
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402
from moeforge.kernels.grouped_gemm_call import decode_config, encode_config  # noqa: E402
from moeforge.stages.triton import act_code  # noqa: E402
from test_triton_quant_gemm import ACTIVATIONS, reference_gemm, rel  # noqa: E402
from test_weight_tma import CUDA, DEVICE, DTYPE, HOPPER, operands  # noqa: E402

FOUR_BIT = ["int4", "int4-zeros", "mxfp4", "nvfp4", "nvfp4-rows"]
# rows per expert: 40 (a full block of 32 and 8 more), 20, 16, none, 1
COUNTS = (40, 20, 16, 0, 1)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def _ids(counts: tuple[int, ...] = COUNTS, seed: int = 0) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))][:, None]


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes ``[..., 2 * B]`` of ``packed [..., B]`` (low nibble first)."""
    p = packed.long()
    return torch.stack([p & 0xF, p >> 4], -1).flatten(-2)


def _torch_decoding(fmt: str, args: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The decoded weight ``[E, N, K]`` in ``dtype``, by torch from the codes: ``(q - z) * s`` rounded once (INT4),
    ``e2m1 * scale`` (exact) for the FP4 formats, without NVFP4's global scale."""
    codes = _codes(args["weight"].cpu())
    scale = args["weight_scale"].cpu()
    group = codes.shape[-1] // scale.shape[-1]
    if fmt.startswith("int4"):
        zero = args["weight_zero"].cpu().long() if args.get("weight_zero") is not None else torch.full_like(
            scale, 8, dtype=torch.long)
        q = (codes - zero.repeat_interleave(group, -1)).to(dtype)
        return q * scale.to(dtype).repeat_interleave(group, -1)
    values = E2M1[codes]
    if fmt == "mxfp4":
        s = torch.pow(2.0, scale.double() - 127)
    else:
        s = scale.double()
    return (values * s.repeat_interleave(group, -1)).to(dtype)


@pytest.mark.parametrize("fmt", ["int4", "int4-zeros", "int4-g256", "mxfp4", "nvfp4"])
def test_the_decoded_weights_are_the_codes_values(fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    experts, n_w, hidden = 3, 72, 512  # K = 512: four 128-wide steps; g256: two steps per group
    w = (torch.randn(experts, n_w, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    if fmt == "int4-g256":
        from test_weight_tma import pack_int4

        packed, scale, zeros, _ = pack_int4(w, 256, True, DTYPE)
        args = dict(weight=packed, weight_scale=scale, weight_zero=zeros, weight_format=WeightFormat.INT4)
    else:
        args = operands(fmt, w[0], w)
        args.pop("a")
    out = torch.full((experts, n_w, hidden), float("nan"), dtype=DTYPE, device=DEVICE)
    decode_first.decode_weights(args["weight"], args["weight_format"], args["weight_scale"], args.get("weight_zero"),
                                out=out)
    want = _torch_decoding(fmt.replace("-g256", "-zeros"), args, DTYPE)
    assert torch.equal(out.cpu(), want)
    if CUDA:  # the portable decoding gives the same values as the packed one
        if fmt == "mxfp4" and DTYPE != torch.bfloat16:
            return
        portable = torch.empty_like(out)
        decode_first.decode_weights(args["weight"], args["weight_format"], args["weight_scale"],
                                    args.get("weight_zero"), out=portable, ptx=False)
        assert torch.equal(portable, out)


def _run(fmt: str, *, glu: bool, config: GemmConfig, chunks: tuple[int, ...], counts: tuple[int, ...] = COUNTS,
         hidden: int = 64, n_out: int = 40, seed: int = 0, **options: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([output decoding in the K-loop, then with each of chunks], float64 reference)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = _ids(counts, seed=seed).to(DEVICE)
    tokens, experts = ids.shape[0], len(counts)
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, 2 * n_out if glu else n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    plan = align.align_block_size(ids, experts, config.block_m)
    act = ACTIVATIONS["swiglu"] if glu else None
    args = operands(fmt, rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    outs = []
    for chunk in (0, *chunks):
        out = torch.full((tokens, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, act=act_code(act) if act else 0,
                          glu=glu, decode_chunk=chunk, **options, **args)
        outs.append(out)
    return outs, reference_gemm(rows, 1, ids, w, None, act)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(got.float()).any()
    assert rel(got, want) < (1e-2 if CUDA else 1e-4)


@pytest.mark.parametrize("glu", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_decoding_first_computes_the_in_register_decodings_rows(fmt: str, glu: bool) -> None:
    """Chunks of 1 (every expert alone, the idle one too), 2 (uneven: 2, 2, 1), 5 (all) and 8 (more than all)."""
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    outs, ref = _run(fmt, glu=glu, config=config, chunks=(1, 2, 5, 8))
    assert not torch.isnan(outs[0].float()).any()
    for out in outs[1:]:
        _close(out, outs[0])
    assert rel(outs[-1], ref) < 0.5  # loose: 4-bit quantization errors reach 0.2; a wrong expert or row is near 1


@pytest.mark.parametrize("routing", ["one expert", "first and last", "empty"])
def test_decoding_first_on_skewed_routings(routing: str) -> None:
    counts = {"one expert": (0, 0, 37, 0), "first and last": (33, 0, 0, 5), "empty": (0, 0, 0, 0)}[routing]
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    for fmt in ("int4-zeros", "nvfp4"):
        outs, _ = _run(fmt, glu=True, config=config, chunks=(1, 3), counts=counts)
        for out in outs[1:]:
            if out.numel():
                _close(out, outs[0])


@pytest.mark.parametrize("grid", ["persistent", "flattened"])
def test_decoding_first_with_bias_routing_weights_and_rows_aligned_by_a_larger_block(grid: str) -> None:
    """The bias and the routing weights are sliced per chunk with the weights; rows aligned by 64 for a 32-row
    tile (padding-only blocks inside a chunk's range); both persistent grids."""
    gen = torch.Generator().manual_seed(7)
    ids = _ids(seed=7).to(DEVICE)
    tokens, experts, hidden, n_out = ids.shape[0], len(COUNTS), 64, 40
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    bias = torch.randn(experts, n_out, generator=gen).to(DEVICE, DTYPE)
    weights = torch.rand(tokens, generator=gen).to(DEVICE)
    plan = align.align_block_size(ids, experts, 64)
    args = operands("mxfp4", rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2)
    outs = []
    for chunk, chosen_grid in ((0, None), (2, grid), (3, None)):
        out = torch.full((tokens, n_out), float("nan"), dtype=DTYPE, device=DEVICE)
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, bias=bias, topk_weights=weights,
                          aligned_block_m=64, decode_chunk=chunk, grid=chosen_grid, **args)
        outs.append(out)
    for out in outs[1:]:
        _close(out, outs[0])
    want = (torch.einsum("tk,tnk->tn", rows.double(), w.double()[ids[:, 0].long()]) + bias.double()[ids[:, 0].long()]
            ) * weights.double()[:, None]
    assert rel(outs[1], want) < 0.5


def test_the_block_ranges_of_the_chunks() -> None:
    ids = _ids((3, 0, 40, 1, 0, 33), seed=2).to(DEVICE)  # blocks of 16: 1, 0, 3, 1, 0, 3
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, 6, 16)
    got = decode_first.block_ranges(block_expert, num_padded, 16, 2, 6)
    assert got.dtype == torch.int32 and got.tolist() == [0, 1, 5, 8]
    assert decode_first.block_ranges(block_expert, num_padded, 16, 4, 6).tolist() == [0, 5, 8]
    assert decode_first.block_ranges(block_expert, num_padded, 16, 9, 6).tolist() == [0, 8]
    empty = align.align_block_size(ids[:0], 6, 16)
    assert decode_first.block_ranges(empty[1], empty[2], 16, 4, 6).tolist() == [0, 0, 0]


def test_decoding_first_errors_the_configuration_and_the_family() -> None:
    ids = _ids().to(DEVICE)
    tokens, experts = ids.shape[0], len(COUNTS)
    rows = torch.randn(tokens, 64, device=DEVICE)
    args = operands("int4", rows, torch.randn(experts, 32, 64, device=DEVICE) / 8)
    a, weight = args.pop("a"), args.pop("weight")
    plan = align.align_block_size(ids, experts, 32)
    out = torch.empty(tokens, 32, dtype=DTYPE, device=DEVICE)
    config = GemmConfig(32, 32, 32, num_warps=4, num_stages=2, decode_chunk=2)
    with pytest.raises(ValueError, match="persistent grid, without a split"):
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, grid="tiles", **args)
    with pytest.raises(ValueError, match="persistent grid, without a split"):
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=attrs.evolve(config, split_k=2), **args)
    with pytest.raises(ValueError, match="decode_chunk must be >= 0"):
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, decode_chunk=-1, **args)
    with pytest.raises(ValueError, match="decode_chunk must be >= 0"):
        GemmConfig(32, 32, 32, decode_chunk=-1)
    with pytest.raises(ValueError, match="pass block_range too"):
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=GemmConfig(32, 32, 32), expert_first=1, **args)
    with pytest.raises(ValueError, match="block range runs on a persistent grid"):
        moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=GemmConfig(32, 32, 32),
                          block_range=torch.zeros(2, dtype=torch.int32, device=DEVICE), **args)
    with pytest.raises(ValueError, match="decodes 4-bit weights"):
        decode_first.decode_weights(rows[None], WeightFormat.FLOAT, rows, out=torch.empty_like(rows[None]))
    with pytest.raises(ValueError, match="out must be"):
        decode_first.decode_weights(weight, WeightFormat.INT4, args["weight_scale"],
                                    out=torch.empty(experts, 32, 63, dtype=DTYPE, device=DEVICE))
    # float weights ignore it (nothing to decode); the configuration carries it through the custom op's integers
    float_out = torch.full((tokens, 32), float("nan"), dtype=DTYPE, device=DEVICE)
    moe_gemm.moe_gemm(rows.to(DTYPE), torch.randn(experts, 32, 64, device=DEVICE, dtype=DTYPE), float_out, *plan,
                      rows_per_a=1, config=config)
    assert not torch.isnan(float_out.float()).any()
    assert decode_config(encode_config(config)) == config
    assert config.with_block_m(64).decode_chunk == 2
    # the batch-invariant family decodes in the K-loop (one path for every token count)
    member = family_member(attrs.evolve(config, block_m=64), 2, 1)
    assert member.decode_chunk == 0 and in_family(member)
    assert not in_family(attrs.evolve(member, decode_chunk=2))


@pytest.mark.parametrize("name", ["w4a16 g32 zeros", "mxfp4", "nvfp4", "nvfp4 rows"])
def test_a_layer_whose_table_asks_to_decode_first_equals_the_torch_layer(name: str) -> None:
    """The quantized triton pipeline with a table (tuned for the method's format) whose entries decode 3 experts at
    a time (of 4: an uneven last chunk): one token, a batch, every token on one expert, an empty batch; against the
    same layer on the torch backend."""
    from test_quant_triton_layer import METHODS, _reference, _triton_pipeline

    reference = _reference(METHODS[name], "auto")
    experts, k = reference.num_experts, reference.top_k
    gemm = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=2, decode_chunk=3)
    table = ConfigTable(experts, k, (1,), (MoEConfig(gemm, attrs.evolve(gemm, block_n=64)),),
                        weight_format=reference.quant.table_key)
    pipeline = _triton_pipeline(reference, table)
    one_expert = torch.full((9, experts), -5.0, device=DEVICE)
    one_expert[:, 2] = 5.0
    gen = torch.Generator().manual_seed(9)
    for tokens, logits in ((1, None), (9, None), (9, one_expert), (0, None)):
        x = torch.randn(tokens, reference.hidden_size, generator=gen).to(DEVICE, torch.float16)
        logits = torch.randn(tokens, experts, generator=gen).to(DEVICE) if logits is None else logits
        with torch.no_grad():
            got = pipeline(mf.MoEInput(x, logits)).hidden_states
            want = reference(x, logits)
        assert got.shape == (tokens, reference.hidden_size)
        if tokens:
            assert not torch.isnan(got.float()).any()
            assert rel(got, want) < 2e-2, (name, tokens)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (wgmma tiles, TMA)")
@pytest.mark.parametrize("fmt", ["int4-zeros", "mxfp4", "nvfp4", "nvfp4-rows"])
@pytest.mark.parametrize("block", [(128, 128, 64, 8), (128, 256, 64, 8), (64, 128, 64, 4)],
                         ids=["128x128", "128x256", "64x128"])
def test_decoding_first_on_hopper_tiles(block: tuple[int, int, int, int], fmt: str) -> None:
    """The bf16 tables' wgmma tiles at a real width, with TMA and half tiles: rows per expert 300, 200, 64, none,
    1; chunks of 2 (uneven) and all five."""
    block_m, block_n, block_k, warps = block
    config = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=3)
    for options in (dict(), dict(tma=True, half_tail=True)):  # (half tiles: asked for, left out by the decoding path)
        for glu in (True, False):
            if glu and block_n == 256:
                continue
            outs, ref = _run(fmt, glu=glu, config=config, chunks=(2, 5), counts=(300, 200, 64, 0, 1), hidden=1024,
                             n_out=704, seed=3, **options)
            for out in outs[1:]:
                _close(out, outs[0])
            assert rel(outs[1], ref) < 0.5


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_decoding_first_is_captured_in_a_cuda_graph() -> None:
    """The chunks' block ranges and scratch come from device work only: the launch replays in a CUDA graph, and
    follows new routings copied into the captured plan."""
    gen = torch.Generator().manual_seed(4)
    tokens, experts, hidden, n_out = 96, 6, 256, 128
    rows = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w = (torch.randn(experts, n_out, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    args = operands("int4-zeros", rows, w)
    a, weight = args.pop("a"), args.pop("weight")
    config = GemmConfig(64, 64, 64, num_warps=4, num_stages=3, decode_chunk=4)

    def ids_of(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, experts, (tokens, 1), generator=g, dtype=torch.int32).to(DEVICE)

    plan = list(align.align_block_size(ids_of(0), experts, 64))
    out = torch.empty(tokens, n_out, dtype=DTYPE, device=DEVICE)
    run = lambda: moe_gemm.moe_gemm(a, weight, out, *plan, rows_per_a=1, config=config, **args)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in (1, 2):
        ids = ids_of(seed)
        for held, new in zip(plan, align.align_block_size(ids, experts, 64)):
            held.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full_like(out, float("nan"))
        moe_gemm.moe_gemm(a, weight, want, *plan, rows_per_a=1, config=config, decode_chunk=0, **args)
        _close(out, want)


def test_the_tuner_times_decoding_first_and_writes_the_choice(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``tune_moe.tune_cell(..., decode_first=True)`` on a small W4A16 triton pipeline (the GEMMs run, under the
    interpreter on CPU) with made-up times: the bf16 candidates are timed again with the weights decoded first, in
    chunks of 1 and 3 experts; the gate/up GEMM's fastest is chunks of 3, the down GEMM's the in-register decoding;
    the choice is written and read back. Float layers get no such candidates."""
    import types

    from test_mixed_row_blocks import made_up_times, tuner_on_a_small_pipeline  # (puts benchmarks/ on the path)
    from test_quant_triton_layer import METHODS, _reference, _triton_pipeline

    tune_moe, float_layer = tuner_on_a_small_pipeline(monkeypatch, 4, 2, seed=5)
    reference = _reference(METHODS["w4a16 g32 zeros"], "auto")
    experts, k, hidden, inter = reference.num_experts, reference.top_k, reference.hidden_size, 128
    layer = types.SimpleNamespace(pipeline=_triton_pipeline(reference, ConfigTable(experts, k)), num_experts=experts,
                                  top_k=k, routing=reference.routing,
                                  quant=types.SimpleNamespace(table_key=reference.quant.table_key))
    gen = torch.Generator().manual_seed(6)
    monkeypatch.setattr(tune_moe, "random_batch", lambda tokens, h, e, seed=0: (
        torch.randn(tokens, h, generator=gen).to(DEVICE, torch.float16),
        torch.randn(tokens, e, generator=gen).to(DEVICE)))
    monkeypatch.setattr(tune_moe, "candidates", lambda fmt, rows: iter([GemmConfig(16, 32, 32, 1, 4, 2)]))
    per_expert = 2 * inter * hidden * 2  # bytes of one expert's gate/up weight in bf16
    monkeypatch.setattr(tune_moe, "DECODE_BUDGETS_GIB", (per_expert / 2**30, 3.5 * per_expert / 2**30))
    monkeypatch.setattr(tune_moe, "DECODE_MIN_ROWS", 4)
    shape = (experts, k, hidden, inter)
    assert tune_moe.decode_chunks(shape) == [1, 3]
    times = {("gate_up", 0): 20.0, ("gate_up", 1): 30.0, ("gate_up", 3): 10.0,
             ("down", 0): 10.0, ("down", 1): 15.0, ("down", 3): 12.0}
    launched = made_up_times(monkeypatch, tune_moe, lambda x, role, c: (role, c.decode_chunk), times)
    entry = tune_moe.tune_cell(layer, shape, "w4a16", 20, flush=None, reps=1,  # type: ignore[arg-type]
                               decode_first=True)
    assert "skip" not in capsys.readouterr().out
    assert {("gate_up", 1), ("gate_up", 3), ("down", 1), ("down", 3)} <= set(launched)
    assert entry["gate_up"]["decode_chunk"] == 3 and "decode_chunk" not in entry["down"]
    loaded = ConfigTable.from_json(experts, k, {"20": entry}).lookup(20)
    assert loaded.gate_up.decode_chunk == 3 and loaded.down.decode_chunk == 0
    # below the rows per expert, or for float weights: no decoding candidates
    monkeypatch.setattr(tune_moe, "DECODE_MIN_ROWS", 256)
    assert all(not c.decode_chunk for roles in tune_moe.plan(layer, shape, "w4a16", 20, decode_first=True).values()
               for configs in roles.values() for c in configs)
    monkeypatch.setattr(tune_moe, "DECODE_MIN_ROWS", 4)
    assert all(not c.decode_chunk for roles in tune_moe.plan(float_layer, (4, 2, 48, 40), "bf16", 20,
                                                             decode_first=True).values()
               for configs in roles.values() for c in configs)
