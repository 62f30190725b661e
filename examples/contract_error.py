"""Compositions that cannot work, and the errors moeforge gives for them when they are *built*.

Each pipeline below would, in a stack without build-time checks, either crash inside a kernel or
silently compute the wrong thing at the first forward call. Here each one raises
``mf.ContractError`` before a tensor exists, naming both stages, the field, and a hint.

Run it: ``python examples/contract_error.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import moeforge as mf
from moeforge.spec import FLOAT_DTYPES, Accepts, GroupListType, PayloadKind, ScaleLayout
from moeforge.stages import PerTokenQuantizer

E, K, H, I = 8, 2, 64, 32
W13 = torch.randn(E, 2 * I, H)
W2 = torch.randn(E, H, I)
SPEC = mf.input_spec(H, torch.bfloat16, E)


def fp8_dispatch_into_unquantized_gemm() -> Any:
    # The activations are quantized to FP8 before the dispatch, but the experts' GEMM is the
    # unquantized method's, which only reads float rows.
    return mf.Pipeline([
        mf.TopK(E, K),
        mf.QuantizeTokens(PerTokenQuantizer(mf.DType.FP8_E4M3)),
        mf.SortedDispatch(E),
        mf.GroupedGemm(mf.GemmRole.GATE_UP, W13, accepts_dtypes=FLOAT_DTYPES,
                       accepts_scales=frozenset({ScaleLayout.NONE})),
        mf.Activate(),
        mf.GroupedGemm(mf.GemmRole.DOWN, W2),
        mf.Combine(),
    ], SPEC)


def fp8_dispatch_on_a_layer() -> Any:
    # The same mistake made through a layer: the dispatch dtype resolver sees the explicit setting
    # (rule 1) and the unquantized experts, and refuses.
    return mf.MoELayer(E, K, H, I, dispatch_dtype="fp8", environ={})


def routing_weights_applied_twice() -> Any:
    # Llama-4 style: the router declares its weights applied on the input, the dispatch scales the rows
    # by them... and the default Combine weights them again. Every output would be scaled by w**2.
    return mf.Pipeline([
        mf.TopK(E, K, mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT)),
        mf.SortedDispatch(E, apply_routing_weights=True),
        mf.GroupedGemm(mf.GemmRole.GATE_UP, W13),
        mf.Activate(),
        mf.GroupedGemm(mf.GemmRole.DOWN, W2),
        mf.Combine(),
    ], SPEC)


def scaling_factor_never_applied() -> Any:
    # DeepSeek's routed_scaling_factor left to a later stage (scaling_in_weights=False), but the
    # combine was not told to apply it: the output would be 2.5x too small.
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5,
                               scaling_in_weights=False)
    return mf.Pipeline([
        mf.TopK(E, K, routing),
        mf.SortedDispatch(E),
        mf.GroupedGemm(mf.GemmRole.GATE_UP, W13),
        mf.Activate(),
        mf.GroupedGemm(mf.GemmRole.DOWN, W2),
        mf.Combine(),
    ], SPEC)


def group_list_convention_mismatch() -> Any:
    # A kernel written for cumulative group lists behind a dispatch that produces counts.
    class CumsumOnlyGemm(mf.GroupedGemm):
        def accepts(self) -> Accepts:
            return Accepts(kind=PayloadKind.DISPATCHED, group_list_type=GroupListType.CUMSUM)

    return mf.Pipeline([
        mf.TopK(E, K),
        mf.SortedDispatch(E, GroupListType.COUNT),
        CumsumOnlyGemm(mf.GemmRole.GATE_UP, W13),
    ], SPEC)


CASES: list[Callable[[], Any]] = [
    fp8_dispatch_into_unquantized_gemm,
    fp8_dispatch_on_a_layer,
    routing_weights_applied_twice,
    scaling_factor_never_applied,
    group_list_convention_mismatch,
]


def main() -> None:
    for build in CASES:
        print(f"== {build.__name__.replace('_', ' ')}")
        try:
            build()
        except mf.ContractError as error:
            print(error, end="\n\n")  # error.field, error.have, error.want are there for tools
        else:
            raise AssertionError(f"{build.__name__} was accepted")


if __name__ == "__main__":
    main()
