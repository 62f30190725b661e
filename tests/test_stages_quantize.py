"""Activation quantizers and the stages that apply them (before or after the dispatch)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.stages import dequantize, quantizer_for

FP8_MAX = 448.0
FP8 = mf.DType.FP8_E4M3
INT8 = mf.DType.INT8


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _rows_with_varied_scales(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Rows whose magnitudes span several orders, so a per-row scale matters."""
    x = _randn(rows, width, seed=seed)
    magnitudes = torch.logspace(-3, 3, rows).unsqueeze(-1)
    return x * magnitudes


def _assert_fp8_error_bound(x: torch.Tensor, deq: torch.Tensor, amax: torch.Tensor) -> None:
    """e4m3 has 3 mantissa bits: round-to-nearest is within 2^-4 of |x| for normal numbers, and
    within half a subnormal step (2^-10 in scaled units, i.e. amax * 2^-10 / 448) below 2^-6."""
    x, deq = x.double(), deq.double()
    err = (deq - x).abs()
    scale = amax.double() / FP8_MAX
    bound = x.abs() * 2.0**-4 + scale * 2.0**-10 + amax.double() * 1e-7
    assert bool((err <= bound).all()), float((err - bound).max())
    # The headline bound: every element within 2^-3 of its row's amax.
    assert bool((err <= amax.double() * 2.0**-3).all())


# -- per-token quantizers --------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_fp8(in_dtype: torch.dtype) -> None:
    x = _rows_with_varied_scales(12, 64, seed=1).to(in_dtype)
    q = mf.PerTokenQuantizer(FP8)(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale is not None and q.scale.dtype == torch.float32 and q.scale.shape == (12, 1)
    amax = x.float().abs().amax(-1, keepdim=True)
    torch.testing.assert_close(q.scale, amax / FP8_MAX)
    # The largest element of each row lands on the format's largest value.
    torch.testing.assert_close(q.data.float().abs().amax(-1, keepdim=True), torch.full((12, 1), FP8_MAX))
    _assert_fp8_error_bound(x.float(), dequantize(q), amax)


def test_per_token_int8() -> None:
    x = _rows_with_varied_scales(12, 64, seed=2)
    q = mf.PerTokenQuantizer(INT8)(x)
    assert q.data.dtype == torch.int8 and q.data.shape == x.shape
    assert q.scale is not None and q.scale.shape == (12, 1) and q.scale.dtype == torch.float32
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(q.scale, amax / 127)
    assert int(q.data.abs().max()) == 127 and int(q.data.min()) >= -127
    assert bool((q.data.abs().amax(-1) == 127).all())
    err = (dequantize(q).double() - x.double()).abs()
    assert bool((err <= amax.double() / 127 / 2 + amax.double() * 1e-6).all())


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_per_token_quantization_is_symmetric(dtype: mf.DType) -> None:
    x = _randn(8, 32, seed=3)
    quantizer = mf.PerTokenQuantizer(dtype)
    pos, neg = quantizer(x), quantizer(-x)
    assert torch.equal(neg.data.float(), -pos.data.float())
    assert pos.scale is not None and neg.scale is not None
    assert torch.equal(pos.scale, neg.scale)


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_per_token_over_three_dims(dtype: mf.DType) -> None:
    """Padded buffers are [E, C, W]: one scale per row of the last axis."""
    x = _randn(3, 5, 32, seed=4)
    q = mf.PerTokenQuantizer(dtype)(x)
    assert q.scale is not None and q.scale.shape == (3, 5, 1)
    flat = mf.PerTokenQuantizer(dtype)(x.reshape(15, 32))
    assert torch.equal(q.data.reshape(15, 32).float(), flat.data.float())
    assert flat.scale is not None and torch.equal(q.scale.reshape(15, 1), flat.scale)


@pytest.mark.parametrize("quantizer", [mf.PerTokenQuantizer(FP8), mf.PerTokenQuantizer(INT8),
                                       mf.PerGroupQuantizer()])
def test_all_zero_rows_have_finite_scales_and_zero_values(quantizer: mf.stages.Quantizer) -> None:
    x = _randn(4, 256, seed=5)
    x[1] = 0.0
    x[3, 128:] = 0.0  # one all-zero 128-group in an otherwise non-zero row
    q = quantizer(x)
    assert q.scale is not None
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    assert bool(torch.isfinite(q.data.float()).all())
    assert bool((q.data[1].float() == 0).all())
    deq = dequantize(q)
    assert bool(torch.isfinite(deq).all())
    assert bool((deq[1] == 0).all()) and bool((deq[3, 128:] == 0).all())
    # The non-zero rows are unaffected by their zero neighbours.
    alone = quantizer(x[0:1])
    assert torch.equal(alone.data.float(), q.data[0:1].float())


def test_invalid_per_token_dtypes() -> None:
    for dtype in (mf.DType.BF16, mf.DType.FP32, mf.DType.NVFP4):
        with pytest.raises(ValueError):
            mf.PerTokenQuantizer(dtype)


# -- per-128-group -----------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [128, 256, 384])
def test_per_group_fp8(width: int) -> None:
    x = _randn(6, width, seed=6)
    groups = width // 128
    x = x * torch.logspace(-2, 2, groups).repeat_interleave(128)  # each group its own magnitude
    q = mf.PerGroupQuantizer()(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale is not None and q.scale.shape == (6, groups) and q.scale.dtype == torch.float32
    group_amax = x.reshape(6, groups, 128).abs().amax(-1)
    torch.testing.assert_close(q.scale, group_amax / FP8_MAX)
    deq = dequantize(q)
    amax_per_element = group_amax.repeat_interleave(128, dim=-1)
    _assert_fp8_error_bound(x, deq, amax_per_element)
    per_token = dequantize(mf.PerTokenQuantizer(FP8)(x))
    if groups == 1:  # one group per row is per-token quantization
        assert torch.equal(deq, per_token)
    else:  # on rows with uneven groups, per-group is the more accurate
        assert float((deq - x).abs().sum()) < float((per_token - x).abs().sum())


def test_per_group_over_three_dims() -> None:
    x = _randn(2, 3, 256, seed=7)
    q = mf.PerGroupQuantizer()(x)
    assert q.scale is not None and q.scale.shape == (2, 3, 2)
    flat = mf.PerGroupQuantizer()(x.reshape(6, 256))
    assert flat.scale is not None and torch.equal(q.scale.reshape(6, 2), flat.scale)
    torch.testing.assert_close(dequantize(q).reshape(6, 256), dequantize(flat))


def test_per_group_width_check() -> None:
    quantizer = mf.PerGroupQuantizer()
    assert quantizer.check_width(256) is None
    problem = quantizer.check_width(96)
    assert problem is not None and "128" in problem and "96" in problem
    assert mf.PerTokenQuantizer().check_width(96) is None


# -- cast and dequantize -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", [mf.DType.BF16, mf.DType.FP16, mf.DType.FP32])
def test_cast(target: mf.DType) -> None:
    x = _randn(5, 32, seed=8)
    out = mf.Cast(target)(x)
    assert out.scale is None and out.data.dtype == target.torch_dtype
    assert torch.equal(out.data, x.to(target.torch_dtype))
    assert torch.equal(dequantize(out), x.to(target.torch_dtype).float())
    assert dequantize(out, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("target", [FP8, INT8, mf.DType.NVFP4])
def test_cast_refuses_quantized_dtypes(target: mf.DType) -> None:
    with pytest.raises(ValueError, match="float"):
        mf.Cast(target)


def test_dequantize_per_tensor_scale() -> None:
    data = torch.tensor([[1.0, -2.0], [3.0, 0.5]]).to(torch.float8_e4m3fn)
    out = dequantize(mf.Activations(data, torch.tensor([0.25])))
    torch.testing.assert_close(out, torch.tensor([[0.25, -0.5], [0.75, 0.125]]))


@pytest.mark.parametrize("quantizer", [mf.PerTokenQuantizer(FP8), mf.PerTokenQuantizer(INT8),
                                       mf.PerGroupQuantizer()])
@pytest.mark.parametrize("lead", [(0,), (0, 4), (3, 0)])
def test_empty_batches_quantize_and_dequantize(quantizer: mf.stages.Quantizer, lead: tuple[int, ...]) -> None:
    """An expert-parallel rank (or a padded buffer) can hold no rows at all."""
    q = quantizer(torch.empty(*lead, 256))
    assert q.data.shape == (*lead, 256) and q.scale is not None
    assert q.scale.shape == (*lead, 2 if quantizer.scale_layout is mf.ScaleLayout.PER_GROUP_128 else 1)
    assert dequantize(q).shape == (*lead, 256)


def test_dequantize_output_dtype() -> None:
    q = mf.PerTokenQuantizer(FP8)(_randn(4, 16, seed=9))
    assert dequantize(q).dtype == torch.float32
    out = dequantize(q, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, dequantize(q).bfloat16())


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 16),
    groups=st.integers(1, 3),
    dtype=st.sampled_from(["fp8", "int8", "group"]),
    log_magnitude=st.floats(-4, 4),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_property(rows: int, groups: int, dtype: str, log_magnitude: float, seed: int) -> None:
    width = 128 * groups
    x = _randn(rows, width, seed=seed, scale=10.0**log_magnitude)
    if dtype == "group":
        q = mf.PerGroupQuantizer()(x)
        amax = x.reshape(rows, groups, 128).abs().amax(-1).repeat_interleave(128, dim=-1)
    else:
        q = mf.PerTokenQuantizer(FP8 if dtype == "fp8" else INT8)(x)
        amax = x.abs().amax(-1, keepdim=True)
    deq = dequantize(q)
    assert deq.shape == x.shape
    if dtype == "int8":
        err = (deq.double() - x.double()).abs()
        assert bool((err <= amax.double() / 127 / 2 + amax.double() * 1e-6).all())
    else:
        _assert_fp8_error_bound(x, deq, amax.expand_as(x))


# -- quantizer_for ---------------------------------------------------------------------------------


def test_quantizer_for() -> None:
    assert quantizer_for(mf.DispatchDtype.BF16, mf.DType.BF16) is None
    assert quantizer_for(mf.DispatchDtype.BF16, mf.DType.FP32) == mf.Cast(mf.DType.BF16)
    assert quantizer_for(mf.DispatchDtype.FP8, mf.DType.BF16) == mf.PerTokenQuantizer(FP8)
    assert quantizer_for(mf.DispatchDtype.FP8, mf.DType.BF16, per_group=True) == mf.PerGroupQuantizer()
    assert quantizer_for(mf.DispatchDtype.INT8, mf.DType.BF16) == mf.PerTokenQuantizer(INT8)
    with pytest.raises(NotImplementedError):
        quantizer_for(mf.DispatchDtype.NVFP4, mf.DType.BF16)


# -- the stages --------------------------------------------------------------------------------------

H, E, K = 256, 8, 2


def _input(tokens: int = 10, hidden: int = H, experts: int = E, seed: int = 0,
           dtype: torch.dtype = torch.bfloat16) -> mf.MoEInput:
    return mf.MoEInput(_randn(tokens, hidden, seed=seed, dtype=dtype),
                       _randn(tokens, experts, seed=seed + 100))


QUANTIZERS = [mf.PerTokenQuantizer(FP8), mf.PerTokenQuantizer(INT8), mf.PerGroupQuantizer(),
              mf.Cast(mf.DType.FP32)]
QUANTIZER_IDS = ["fp8-token", "int8-token", "fp8-group", "cast-fp32"]


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=QUANTIZER_IDS)
def test_quantize_tokens_spec_and_payload(quantizer: mf.stages.Quantizer) -> None:
    stage = mf.QuantizeTokens(quantizer)
    pipeline = mf.Pipeline([mf.TopK(E, K), stage], mf.input_spec(H, torch.bfloat16, E), debug=True)
    spec = pipeline.output_spec
    assert spec.kind is mf.PayloadKind.ROUTED and spec.layout is mf.Layout.TOKEN_MAJOR
    assert spec.dtype is quantizer.dtype and spec.scale_layout is quantizer.scale_layout
    assert spec.width == H and spec.top_k == K and spec.num_experts == E
    inputs = _input()
    out = pipeline(inputs)
    out.check(spec)
    assert out.x.data.dtype == quantizer.dtype.torch_dtype
    expected = quantizer(inputs.hidden_states)
    assert torch.equal(out.x.data.float(), expected.data.float())
    # The routing decision passes through untouched.
    routed = mf.TopK(E, K)(inputs)
    assert torch.equal(out.topk.ids, routed.topk.ids) and torch.equal(out.topk.weights, routed.topk.weights)
    assert quantizer.summary() in stage.summary()


@pytest.mark.parametrize("dispatch", [mf.SortedDispatch(E), mf.PaddedDispatch(E)], ids=["sorted", "padded"])
@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=QUANTIZER_IDS)
def test_quantize_rows_after_dispatch(dispatch: mf.Stage, quantizer: mf.stages.Quantizer) -> None:
    stage = mf.QuantizeRows(quantizer)
    pipeline = mf.Pipeline([mf.TopK(E, K), dispatch, stage], mf.input_spec(H, torch.bfloat16, E), debug=True)
    spec = pipeline.output_spec
    assert spec.kind is mf.PayloadKind.DISPATCHED
    assert spec.dtype is quantizer.dtype and spec.scale_layout is quantizer.scale_layout
    inputs = _input(seed=1)
    out = pipeline(inputs)
    out.check(spec)
    dispatched = mf.Pipeline([mf.TopK(E, K), dispatch], mf.input_spec(H, torch.bfloat16, E))(inputs)
    expected = quantizer(dispatched.x.data)
    assert torch.equal(out.x.data.float(), expected.data.float())
    if expected.scale is not None:
        assert out.x.scale is not None and torch.equal(out.x.scale, expected.scale)
    # The dispatch plan and grouping pass through.
    if isinstance(out, mf.SortedRows):
        assert isinstance(dispatched, mf.SortedRows)
        assert torch.equal(out.group_list, dispatched.group_list)
        assert torch.equal(out.plan.token_rows, dispatched.plan.token_rows)
        assert torch.equal(out.row_weights, dispatched.row_weights)
    else:
        assert isinstance(out, mf.PaddedRows) and isinstance(dispatched, mf.PaddedRows)
        assert torch.equal(out.masked_m, dispatched.masked_m)
        assert torch.equal(out.plan.token_slots, dispatched.plan.token_slots)
        assert torch.equal(out.slot_weights, dispatched.slot_weights)


@pytest.mark.parametrize("stale", [1e30, float("nan"), float("inf")], ids=["huge", "nan", "inf"])
@pytest.mark.parametrize("quantizer", [mf.PerTensorQuantizer(FP8), mf.PerTensorQuantizer(INT8)],
                         ids=["fp8-tensor", "int8-tensor"])
def test_a_whole_tensor_scale_ignores_the_unused_slots_of_padded_rows(quantizer: mf.stages.Quantizer,
                                                                      stale: float) -> None:
    """An exchange leaves padded rows' unused slots unwritten (the low-latency dispatchers' buffers hold the last
    batch's bits there, or none): one scale for the tensor must come from the used rows alone, as if the unused
    slots were zeros, in QuantizeRows and in the torch activate-quantize stage."""
    dispatch = mf.PaddedDispatch(E, capacity=8)
    rows = mf.Pipeline([mf.TopK(E, K), dispatch], mf.input_spec(H, torch.float32, E))(_input(6, dtype=torch.float32))
    assert isinstance(rows, mf.PaddedRows)
    used = torch.arange(rows.capacity) < rows.masked_m.unsqueeze(1)
    assert bool(used.any()) and not bool(used.all())  # some slots of some experts unused
    stale_rows = rows.with_x(mf.Activations(rows.x.data.masked_fill(~used.unsqueeze(-1), stale)))
    want = quantizer(rows.x.data)  # the unused slots are zeros here
    got = mf.QuantizeRows(quantizer)(stale_rows)
    assert got.x.scale is not None and want.scale is not None
    assert torch.equal(got.x.scale, want.scale)
    assert torch.equal(got.x.data[used].float(), want.data[used].float())

    activation = mf.ActivationConfig()  # SwiGLU: rows of H become rows of H / 2
    fused = mf.stages.ActivateQuantize(activation, quantizer)(stale_rows)
    hidden = mf.stages.apply_activation(rows.x.data, activation).masked_fill(~used.unsqueeze(-1), 0)
    assert torch.equal(fused.x.scale, quantizer(hidden).scale)
    # A quantizer that scales each row alone reads the slots as they are (no extra pass).
    assert mf.PerTokenQuantizer.row_local and not mf.PerTensorQuantizer.row_local


def test_quantize_rows_between_activation_and_down_gemm() -> None:
    """Quantizing the expert hidden state (W8A8 down projection) stays close to the float result."""
    inter = 128
    gen = torch.Generator().manual_seed(11)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, generator=gen) / inter**0.5
    head = [mf.TopK(E, K), mf.SortedDispatch(E),
            mf.GroupedGemm(mf.GemmRole.GATE_UP, w13), mf.Activate()]
    tail = [mf.GroupedGemm(mf.GemmRole.DOWN, w2), mf.Combine()]
    spec = mf.input_spec(H, torch.float32, E)
    plain = mf.Pipeline(head + tail, spec)
    quantized = mf.Pipeline(
        head + [mf.QuantizeRows(mf.PerTokenQuantizer(FP8)),
                mf.GroupedGemm(mf.GemmRole.DOWN, w2, out_dtype=mf.DType.FP32), mf.Combine()],
        spec, debug=True)
    assert quantized.specs[4].kind is mf.PayloadKind.EXPERT_HIDDEN
    assert quantized.specs[4].dtype is FP8
    inputs = _input(16, dtype=torch.float32, seed=2)
    want, got = plain(inputs).hidden_states, quantized(inputs).hidden_states
    assert got.dtype == torch.float32
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.06


@pytest.mark.parametrize("stage_type", [mf.QuantizeTokens, mf.QuantizeRows])
@pytest.mark.parametrize("width", [96, 200])
def test_per_group_width_not_divisible_by_128_is_a_contract_error(stage_type: type, width: int) -> None:
    stages = [mf.TopK(E, K)]
    if stage_type is mf.QuantizeRows:
        stages.append(mf.SortedDispatch(E))
    stages.append(stage_type(mf.PerGroupQuantizer()))
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline(stages, mf.input_spec(width, torch.bfloat16, E))
    assert error.value.field == "width"
    assert error.value.have == width
    assert stage_type.__name__ in error.value.consumer
    assert "128" in str(error.value)
    # Per-token quantization has no such constraint.
    stages[-1] = stage_type(mf.PerTokenQuantizer(FP8))
    mf.Pipeline(stages, mf.input_spec(width, torch.bfloat16, E))


def test_quantizing_twice_is_a_contract_error() -> None:
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(E, K), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)),
                     mf.QuantizeTokens(mf.PerTokenQuantizer(INT8))], mf.input_spec(H, torch.bfloat16, E))
    assert error.value.field == "dtype"
    assert "already quantized" in error.value.hint
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([mf.TopK(E, K), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)), mf.SortedDispatch(E),
                     mf.QuantizeRows(mf.PerGroupQuantizer())], mf.input_spec(H, torch.bfloat16, E))
    assert error.value.field == "dtype"


def test_quantize_stages_out_of_place_are_contract_errors() -> None:
    spec = mf.input_spec(H, torch.bfloat16, E)
    with pytest.raises(mf.ContractError) as error:  # before the top-k
        mf.Pipeline([mf.QuantizeTokens(mf.PerTokenQuantizer(FP8)), mf.TopK(E, K)], spec)
    assert error.value.field == "kind" and error.value.producer == "pipeline input"
    with pytest.raises(mf.ContractError) as error:  # rows stage on token-major activations
        mf.Pipeline([mf.TopK(E, K), mf.QuantizeRows(mf.PerTokenQuantizer(FP8))], spec)
    assert error.value.field == "kind"
    with pytest.raises(mf.ContractError) as error:  # tokens stage after the dispatch
        mf.Pipeline([mf.TopK(E, K), mf.SortedDispatch(E), mf.QuantizeTokens(mf.PerTokenQuantizer(FP8))],
                    spec)
    assert error.value.field == "kind"


def test_quantize_tokens_on_empty_and_single_token_batches() -> None:
    for quantizer in QUANTIZERS:
        pipeline = mf.Pipeline([mf.TopK(E, K), mf.QuantizeTokens(quantizer)],
                               mf.input_spec(H, torch.bfloat16, E), debug=True)
        for tokens in (0, 1):
            out = pipeline(_input(tokens))
            out.check(pipeline.output_spec)
            assert out.x.data.shape == (tokens, H)


def test_payload_check_catches_a_lying_scale() -> None:
    """A quantized payload whose scale does not match its spec's scale layout fails ``check``."""
    pipeline = mf.Pipeline([mf.TopK(E, K), mf.QuantizeTokens(mf.PerGroupQuantizer())],
                           mf.input_spec(H, torch.bfloat16, E))
    out = pipeline(_input())
    token_scale = mf.PerTokenQuantizer(FP8)(out.x.data.float()).scale
    with pytest.raises(mf.errors.PayloadError, match="scale shape"):
        out.with_x(mf.Activations(out.x.data, token_scale)).check(pipeline.output_spec)
    with pytest.raises(mf.errors.PayloadError, match="scale"):
        out.with_x(mf.Activations(out.x.data)).check(pipeline.output_spec)
