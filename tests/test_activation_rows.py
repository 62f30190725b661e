"""The expert activation as its own kernels (``moeforge/kernels/activation_rows.py``): forward and derivative
against :func:`moeforge.activation.apply_activation` and its autograd in float64.

Every activation kind (GELU and GeGLU in both forms, the gated ones in both layouts) in fp32, bf16 and fp16; the
ops ``moeforge::activate_rows`` (differentiable) and ``moeforge::activate_rows_backward``; edge cases: no rows, one
row, widths that are not a multiple of the block, strided row views, gradients with stride 0, GPT-OSS's clamps on
and beyond their bounds, inputs of large magnitude. Without a GPU the kernels run in Triton's interpreter at tiny
shapes (no ``tl.dot`` here, so bf16 runs there too); with one the same tests run on it, plus wide rows and row
offsets past 2^31 elements. Comparisons use tolerances: nothing depends on the CPU's vector unit bit for bit.
"""

from __future__ import annotations

import math
import warnings

import attrs
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("triton")

import moeforge as mf  # noqa: E402
from moeforge.activation import apply_activation  # noqa: E402
from moeforge.errors import InputError  # noqa: E402
from moeforge.kernels import activation_rows, activations  # noqa: E402
from moeforge.stages.triton import kernel_ops  # noqa: E402

kernel_ops()  # registers the moeforge:: custom ops

# The interpreter computes the sigmoids with numpy, which warns when exp(-x) overflows to inf: by design
# (sigmoid = 1 / (1 + inf) = 0), and what test_large_magnitudes_stay_finite is about.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) of a result in each dtype against float64: one rounding of the output plus fp32 arithmetic.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}

Kind, Layout = mf.ActivationKind, mf.GateUpLayout
ACTIVATIONS = {
    "silu": mf.ActivationConfig(Kind.SILU),
    "gelu": mf.ActivationConfig(Kind.GELU),
    "gelu-tanh": mf.ActivationConfig(Kind.GELU, gelu_approximate="tanh"),
    "relu2": mf.ActivationConfig(Kind.RELU2),
    "identity": mf.ActivationConfig(Kind.IDENTITY),
}
for _layout in Layout:
    ACTIVATIONS.update({
        f"swiglu-{_layout.value}": mf.ActivationConfig(Kind.SWIGLU, _layout),
        f"geglu-{_layout.value}": mf.ActivationConfig(Kind.GEGLU, _layout),
        f"geglu-tanh-{_layout.value}": mf.ActivationConfig(Kind.GEGLU, _layout, gelu_approximate="tanh"),
        f"gpt-oss-{_layout.value}": mf.ActivationConfig(Kind.GPT_OSS_SWIGLU, _layout),
        f"clamped-swiglu-{_layout.value}": mf.ActivationConfig(Kind.CLAMPED_SWIGLU, _layout),
        # softcaps the rows' values reach (Inkling2's are 4 and 25)
        f"softcapped-swiglu-{_layout.value}": mf.ActivationConfig(Kind.SOFTCAPPED_SWIGLU, _layout, gate_softcap=1.5,
                                                                  up_softcap=2.0),
    })
CLAMPED = [name for name in ACTIVATIONS if name.startswith(("gpt-oss", "clamped"))]


def _args(config: mf.ActivationConfig) -> tuple[int, bool, bool, float, float]:
    """The kernels' arguments ``(act, glu, interleaved, alpha, limit)`` of ``config``."""
    return (activations.code_of(config), config.gated, config.gate_up is Layout.INTERLEAVED,
            *activations.parameters_of(config))


def _reference(pre: torch.Tensor, d_out: torch.Tensor,
               config: mf.ActivationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, d_pre)`` of ``apply_activation`` in float64 (its autograd for ``d_pre``)."""
    leaf = pre.detach().double().requires_grad_()
    out = apply_activation(leaf, config)
    (d_pre,) = torch.autograd.grad(out, leaf, d_out.double())
    return out.detach(), d_pre


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "a non-finite (or unwritten) element"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=rtol, atol=atol)


def _width(config: mf.ActivationConfig, columns: int) -> int:
    """The width of pre-activation rows that give ``columns`` activated columns."""
    return 2 * columns if config.gated else columns


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def _run(pre: torch.Tensor, d_out: torch.Tensor, config: mf.ActivationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, d_pre)`` of the two kernels."""
    args = _args(config)
    return activation_rows.activate_rows(pre, *args), activation_rows.activate_rows_backward(pre, d_out, *args)


def _compare(pre: torch.Tensor, d_out: torch.Tensor, config: mf.ActivationConfig) -> None:
    out, d_pre = _run(pre, d_out, config)
    ref_out, ref_d_pre = _reference(pre, d_out, config)
    _check(out, ref_out, pre.dtype)
    _check(d_pre, ref_d_pre, pre.dtype)


# -- every kind, layout and dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_forward_and_derivative_match_apply_activation(name: str, dtype: torch.dtype) -> None:
    config = ACTIVATIONS[name]
    rows, columns = (300, 1500) if CUDA else (5, 37)  # 37: not a multiple of the column block
    pre = _rows(rows, _width(config, columns), dtype, seed=1)
    d_out = _rows(rows, columns, dtype, seed=2, scale=1.0)
    _compare(pre, d_out, config)


@pytest.mark.parametrize("name", ["swiglu-concatenated", "gpt-oss-interleaved", "softcapped-swiglu-interleaved",
                                  "gelu-tanh"])
def test_a_float32_gradient_of_half_precision_rows(name: str) -> None:
    """The gradient may come in another float dtype than the rows (fp32 here); ``d_pre`` is in the rows'."""
    config = ACTIVATIONS[name]
    pre = _rows(4, _width(config, 9), torch.bfloat16, seed=3)
    d_out = _rows(4, 9, torch.float32, seed=4)
    _, ref = _reference(pre, d_out, config)
    d_pre = activation_rows.activate_rows_backward(pre, d_out, *_args(config))
    _check(d_pre, ref, torch.bfloat16)


# -- the custom ops and their autograd ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_autograd_through_the_op_in_float32(name: str) -> None:
    """``torch.ops.moeforge.activate_rows`` differentiates: its gradient is float64 autograd's, and central
    differences of the op itself agree with it (``gradcheck`` in fp32: a wide step, loose tolerances)."""
    config = ACTIVATIONS[name]
    args = _args(config)
    pre = _rows(3, _width(config, 5), torch.float32, seed=5, scale=2.0)
    assert (pre.abs() - config.limit).abs().min() > 0.05  # no clamp within the difference step
    d_out = _rows(3, 5, torch.float32, seed=6, scale=1.0)
    leaf = pre.clone().requires_grad_()
    out = torch.ops.moeforge.activate_rows(leaf, *args)
    out.backward(d_out)
    assert leaf.grad is not None
    _check(leaf.grad, _reference(pre, d_out, config)[1], torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradcheck's advice to use float64 (the op is fp32 at most)
        assert torch.autograd.gradcheck(lambda x: torch.ops.moeforge.activate_rows(x, *args),
                                        (pre.clone().requires_grad_(),), eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["gpt-oss-interleaved", "geglu-concatenated", "relu2"])
def test_the_ops_pass_opcheck(name: str) -> None:
    """Schema, fakes (sizes and dtypes of the real outputs) and the autograd registration."""
    config = ACTIVATIONS[name]
    args = _args(config)
    pre = _rows(3, _width(config, 4), torch.float32, seed=7)
    d_out = _rows(3, 4, torch.float32, seed=8)
    torch.library.opcheck(torch.ops.moeforge.activate_rows.default, (pre.clone().requires_grad_(), *args))
    torch.library.opcheck(torch.ops.moeforge.activate_rows_backward.default, (pre, d_out, *args))


def test_a_summed_output_backpropagates_its_expanded_gradient() -> None:
    """``out.sum()``'s gradient is expanded (strides 0): the backward takes it as it comes."""
    config = ACTIVATIONS["swiglu-interleaved"]
    pre = _rows(3, 10, torch.float32, seed=9).requires_grad_()
    torch.ops.moeforge.activate_rows(pre, *_args(config)).sum().backward()
    assert pre.grad is not None
    _check(pre.grad, _reference(pre, torch.ones(3, 5, dtype=torch.float64, device=pre.device), config)[1], torch.float32)


# -- edge cases ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["swiglu-interleaved", "silu"])
def test_no_rows(name: str) -> None:
    config = ACTIVATIONS[name]
    pre = torch.empty(0, _width(config, 6), device=DEVICE, requires_grad=True)
    out = torch.ops.moeforge.activate_rows(pre, *_args(config))
    assert out.shape == (0, 6)
    out.sum().backward()
    assert pre.grad is not None and pre.grad.shape == pre.shape
    d_pre = activation_rows.activate_rows_backward(pre.detach(), out.detach(), *_args(config))
    assert d_pre.shape == pre.shape


@pytest.mark.parametrize("columns", [1, 3, 1025])  # 1025: two column blocks, the second one column wide
@pytest.mark.parametrize("name", ["geglu-tanh-interleaved", "gpt-oss-concatenated", "gelu"])
def test_one_row_and_odd_widths(name: str, columns: int) -> None:
    config = ACTIVATIONS[name]
    for rows in (1, 3):
        pre = _rows(rows, _width(config, columns), torch.float32, seed=columns + rows)
        _compare(pre, _rows(rows, columns, torch.float32, seed=10), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["swiglu-concatenated", "gpt-oss-interleaved", "clamped-swiglu-interleaved", "relu2"])
def test_strided_row_views(name: str, dtype: torch.dtype) -> None:
    """Rows of a wider tensor (a row stride larger than the width, an offset) and every other row; columns
    that are not contiguous are copied first."""
    config = ACTIVATIONS[name]
    width = _width(config, 7)
    wide = _rows(9, width + 5, dtype, seed=11)
    d_wide = _rows(10, 12, dtype, seed=12, scale=1.0)
    _compare(wide[:, 3:3 + width], d_wide[:9, 2:9], config)
    _compare(wide[::2, 1:1 + width], d_wide[1::2, :7], config)
    every_other_column = _rows(4, 2 * width, dtype, seed=13)[:, ::2]
    _compare(every_other_column, d_wide[:4, 5:], config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("limit", [7.0, 0.5, math.inf])
@pytest.mark.parametrize("name", CLAMPED)
def test_the_clamped_swiglus_clamp_on_and_beyond_their_bounds(name: str, limit: float, dtype: torch.dtype) -> None:
    """GPT-OSS's and the clamped SwiGLU: the gate is clamped above only, up on both sides: the gradient passes on the
    bounds (``torch.clamp``'s convention) and is 0 beyond them; a gate below ``-limit`` is not clamped."""
    config = attrs.evolve(ACTIVATIONS[name], limit=limit)
    bound = limit if math.isfinite(limit) else 7.0
    values = [-100.0, -bound - 1.0, -bound, -bound + 0.25, 0.0, bound - 0.25, bound, bound + 0.25, 100.0]
    gate = torch.tensor(values, dtype=torch.float64).repeat_interleave(len(values))  # every (gate, up) pair
    up = torch.tensor(values, dtype=torch.float64).repeat(len(values))
    pairs = torch.stack([gate, up], -1).reshape(1, -1) if config.gate_up is Layout.INTERLEAVED else \
        torch.cat([gate, up]).reshape(1, -1)
    pre = pairs.to(dtype).to(DEVICE)
    d_out = torch.ones(1, len(values) ** 2, dtype=dtype, device=DEVICE)
    _compare(pre, d_out, config)
    d_pre = activation_rows.activate_rows_backward(pre, d_out, *_args(config)).double().cpu()
    d_gate, d_up = mf.activation.split_gate_up(d_pre[0], config.gate_up)
    assert (d_gate[gate > limit] == 0).all() and (d_up[(up > limit) | (up < -limit)] == 0).all()
    on_bounds = ((up == limit) | (up == -limit)) & (gate != 0) & (gate.abs() < 50)  # gate * sigmoid(alpha gate) != 0
    assert (d_up[on_bounds] != 0).all()
    up_factor_nonzero = (up > -1) if config.kind is Kind.GPT_OSS_SWIGLU else (up != 0)  # clamp(up) + 1, or clamp(up)
    assert (d_gate[(gate == limit) & up_factor_nonzero] != 0).all()


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_large_magnitudes_stay_finite(name: str) -> None:
    """|x| of 80 and more in fp32: the sigmoids' exponentials overflow to inf, erf saturates, exp(-x^2 / 2)
    underflows; no NaN or inf comes of it."""
    config = ACTIVATIONS[name]
    values = torch.tensor([-1e4, -200.0, -88.0, -80.0, -30.0, -1.0, 0.0, 1.0, 30.0, 80.0, 88.0, 200.0, 1e4],
                          dtype=torch.float64)
    if config.gated:  # every large gate against a moderate up, and every up against a large gate
        gate = torch.cat([values, torch.full_like(values, 80.0), torch.full_like(values, -80.0)])
        up = torch.cat([torch.full_like(values, 1.5), values, values])
        both = torch.stack([gate, up], -1) if config.gate_up is Layout.INTERLEAVED else torch.cat([gate, up])
        pre = both.reshape(1, -1)
    else:
        pre = values.reshape(1, -1)
    pre = pre.float().to(DEVICE)
    d_out = torch.full((1, pre.shape[1] // (2 if config.gated else 1)), 0.5, device=DEVICE)
    out, d_pre = _run(pre, d_out, config)
    assert torch.isfinite(out).all() and torch.isfinite(d_pre).all()
    ref_out, ref_d_pre = _reference(pre, d_out, config)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), rtol=rtol, atol=atol)
    torch.testing.assert_close(d_pre.double().cpu(), ref_d_pre.cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["3-D", "int rows", "odd gated width", "ungated gpt-oss", "ungated clamped swiglu",
                                  "unknown code", "gradient shape", "int gradient"])
def test_bad_arguments_raise_input_error(case: str) -> None:
    pre = torch.zeros(2, 6, device=DEVICE)
    silu = (activations.ACT_SILU, False, False, 1.702, 7.0)
    bad: dict[str, tuple[torch.Tensor, Optional[torch.Tensor], tuple[Any, ...]]] = {
        "3-D": (pre[None], None, silu),
        "int rows": (pre.int(), None, silu),
        "odd gated width": (pre[:, :5], None, (activations.ACT_SILU, True, False, 1.702, 7.0)),
        "ungated gpt-oss": (pre, None, (activations.ACT_GPT_OSS, False, False, 1.702, 7.0)),
        "ungated clamped swiglu": (pre, None, (activations.ACT_CLAMPED_SILU, False, False, 1.702, 7.0)),
        "unknown code": (pre, None, (9, False, False, 1.702, 7.0)),
        "gradient shape": (pre, torch.zeros(2, 3, device=DEVICE), silu),
        "int gradient": (pre, torch.zeros(2, 6, dtype=torch.int32, device=DEVICE), silu),
    }
    rows, d_out, args = bad[case]
    with pytest.raises(InputError):
        if d_out is None:
            activation_rows.activate_rows(rows, *args)
        else:
            activation_rows.activate_rows_backward(rows, d_out, *args)


# -- on a GPU: wide rows, many rows ---------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["swiglu-concatenated", "gpt-oss-interleaved", "gelu-tanh"])
def test_wide_rows_on_the_gpu(name: str) -> None:
    config = ACTIVATIONS[name]
    columns = 14336 + 7
    pre = _rows(64, _width(config, columns), torch.bfloat16, seed=14)
    _compare(pre, _rows(64, columns, torch.bfloat16, seed=15, scale=1.0), config)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_row_offsets_past_2_to_the_31_on_the_gpu() -> None:
    """``row * stride`` passes 2^31 elements: the last rows are right (the kernels' row offsets are int64)."""
    config = ACTIVATIONS["swiglu-interleaved"]
    rows, columns = 66_000, 16_384  # 2.16e9 pre-activation elements
    pre = torch.empty(rows, 2 * columns, dtype=torch.bfloat16, device=DEVICE).normal_(0, 3)
    d_out = torch.empty(rows, columns, dtype=torch.bfloat16, device=DEVICE).normal_()
    out, d_pre = _run(pre, d_out, config)
    tail = slice(rows - 3, rows)
    ref_out, ref_d_pre = _reference(pre[tail], d_out[tail], config)
    _check(out[tail], ref_out, torch.bfloat16)
    _check(d_pre[tail], ref_d_pre, torch.bfloat16)
