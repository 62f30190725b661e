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

ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU2, ACT_GPT_OSS, ACT_CLAMPED_SILU = 0, 1, 2, 3, 4, 5, 6
GATED_ONLY = (ACT_GPT_OSS, ACT_CLAMPED_SILU)  # codes with no ungated form

# Each kind's code; whether it is gated travels beside it (``glu``), and GELU's tanh form has its own code.
_CODES = {ActivationKind.SWIGLU: ACT_SILU, ActivationKind.SILU: ACT_SILU, ActivationKind.GEGLU: ACT_GELU,
          ActivationKind.GELU: ACT_GELU, ActivationKind.RELU2: ACT_RELU2, ActivationKind.GPT_OSS_SWIGLU: ACT_GPT_OSS,
          ActivationKind.CLAMPED_SWIGLU: ACT_CLAMPED_SILU, ActivationKind.IDENTITY: ACT_NONE}


def code_of(config: ActivationConfig) -> int:
    """The kernels' code of an activation (``config.gated`` is passed beside it as ``glu``)."""
    code = _CODES[config.kind]
    return ACT_GELU_TANH if code == ACT_GELU and config.gelu_approximate == "tanh" else code


def config_of(code: int, glu: bool, interleaved: bool, alpha: float, limit: float) -> Optional[ActivationConfig]:
    """The activation the kernels' arguments describe (``None``: the identity of an ungated GEMM): the
    inverse of :func:`code_of`."""
    tanh = code == ACT_GELU_TANH
    base = ACT_GELU if tanh else code
    kind = next(kind for kind, kind_code in _CODES.items() if kind_code == base and kind.gated == glu)
    if kind is ActivationKind.IDENTITY:
        return None
    layout = GateUpLayout.INTERLEAVED if interleaved else GateUpLayout.CONCATENATED
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
    (``ACT_GPT_OSS``) or the clamped SwiGLU (``ACT_CLAMPED_SILU``: the same clamps, ``silu(gate) * up``)."""
    if ACT == 5:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    elif ACT == 6:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(gate) * up
    else:
        return activate(gate, ACT) * up
