# Triton kernels (@triton.jit bodies) are not annotatable.
# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False
# mypy: disallow-untyped-decorators=False, disallow-untyped-calls=False
"""The expert activations as Triton functions, shared by the GEMM epilogue
(:mod:`moeforge.kernels.moe_gemm`) and the fused activation-quantization kernel
(:mod:`moeforge.kernels.quantize`). Codes are ``tl.constexpr`` ints chosen by the launchers
(:func:`moeforge.stages.triton.act_code`)."""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from moeforge.activation import ActivationConfig, ActivationKind, GateUpLayout

ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU2, ACT_GPT_OSS, ACT_CLAMPED_SILU, ACT_SOFTCAPPED_SILU = range(8)
GATED_ONLY = (ACT_GPT_OSS, ACT_CLAMPED_SILU, ACT_SOFTCAPPED_SILU)  # codes with no ungated form

# Each kind's code; whether it is gated travels beside it (``glu``), and GELU's tanh form has its own code.
_CODES = {ActivationKind.SWIGLU: ACT_SILU, ActivationKind.SILU: ACT_SILU, ActivationKind.GEGLU: ACT_GELU,
          ActivationKind.GELU: ACT_GELU, ActivationKind.RELU2: ACT_RELU2, ActivationKind.GPT_OSS_SWIGLU: ACT_GPT_OSS,
          ActivationKind.CLAMPED_SWIGLU: ACT_CLAMPED_SILU, ActivationKind.SOFTCAPPED_SWIGLU: ACT_SOFTCAPPED_SILU,
          ActivationKind.IDENTITY: ACT_NONE}


def code_of(config: ActivationConfig) -> int:
    """The kernels' code of an activation (``config.gated`` is passed beside it as ``glu``)."""
    code = _CODES[config.kind]
    return ACT_GELU_TANH if code == ACT_GELU and config.gelu_approximate == "tanh" else code


def parameters_of(config: ActivationConfig) -> tuple[float, float]:
    """The two numbers the kernels take beside the code (their ``alpha`` and ``limit``): GPT-OSS's alpha and limit
    (the clamped SwiGLU's limit), or the softcapped SwiGLU's gate and up softcaps."""
    if config.kind is ActivationKind.SOFTCAPPED_SWIGLU:
        return config.gate_softcap, config.up_softcap
    return config.alpha, config.limit


def config_of(code: int, glu: bool, interleaved: bool, alpha: float, limit: float) -> Optional[ActivationConfig]:
    """The activation the kernels' arguments describe (``None``: the identity of an ungated GEMM): the
    inverse of :func:`code_of` and :func:`parameters_of`."""
    tanh = code == ACT_GELU_TANH
    base = ACT_GELU if tanh else code
    kind = next(kind for kind, kind_code in _CODES.items() if kind_code == base and kind.gated == glu)
    if kind is ActivationKind.IDENTITY:
        return None
    layout = GateUpLayout.INTERLEAVED if interleaved else GateUpLayout.CONCATENATED
    if kind is ActivationKind.SOFTCAPPED_SWIGLU:
        return ActivationConfig(kind, layout, gate_softcap=alpha, up_softcap=limit)
    return ActivationConfig(kind, layout, alpha, limit, "tanh" if tanh else "none")


@triton.jit
def _gelu(x, TANH: tl.constexpr):
    if TANH:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh(y) = 2 * sigmoid(2y) - 1
        return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def tanh(y):
    """``tanh`` of fp32 ``y`` to about 5e-7 relative (Triton's interpreter has no libdevice): its odd series up to
    ``y^5`` below |y| = 1/16, ``(1 - e) / (1 + e)`` with ``e = exp(-2|y|)`` (which never overflows) above."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    y2 = y * y
    t = tl.where(a < 0.0625, a * (1.0 - y2 * (0.3333333333333333 - y2 * 0.13333333333333333)), (1.0 - e) / (1.0 + e))
    return tl.where(y < 0.0, -t, t)


@triton.jit
def softcap(x, cap):
    """``cap * tanh(x / cap)`` of fp32 ``x``."""
    return cap * tanh(x / cap)


@triton.jit
def activate(x, ACT: tl.constexpr):
    """An ungated activation of fp32 ``x`` (``ACT_NONE``: the identity)."""
    if ACT == 1:
        return x * tl.sigmoid(x)
    elif ACT == 2:
        return _gelu(x, False)
    elif ACT == 3:
        return _gelu(x, True)
    elif ACT == 4:
        r = tl.maximum(x, 0.0)
        return r * r
    else:
        return x


@triton.jit
def gated(gate, up, ACT: tl.constexpr, alpha, limit):
    """A gated activation of fp32 ``gate`` and ``up``: ``act(gate) * up``, GPT-OSS's clamped SwiGLU
    (``ACT_GPT_OSS``), the clamped SwiGLU (``ACT_CLAMPED_SILU``: the same clamps, ``silu(gate) * up``) or the
    softcapped SwiGLU (``ACT_SOFTCAPPED_SILU``: ``alpha`` and ``limit`` are the gate's and up's softcaps)."""
    if ACT == 5:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    elif ACT == 6:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(gate) * up
    elif ACT == 7:
        return softcap(gate, alpha) * tl.sigmoid(gate) * softcap(up, limit)
    else:
        return activate(gate, ACT) * up
