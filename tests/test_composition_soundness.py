"""Soundness of the contract checker: every composition of the built-in torch stages that it accepts
computes the MoE forward its stages declare, and every one it rejects gets a ContractError that names
a field and says what to do.

The compositions are products of choices for each slot of the forward — router (where it declares the
routing weights applied, its scaling factor), quantization before the dispatch, dispatch (layout,
group-list type, weights on the input), quantization after it, gate/up GEMM (width, bias, weights in
its epilogue, out dtype), the activations between the GEMMs (none, one, two, quantizing, with an
integer out dtype), down GEMM (bias, weights in its epilogue, out dtype), combine (weighted or not,
scaling factor, out dtype) — plus every deletion, duplication and swap of the stages of a valid
pipeline.

Two things here are written from first principles, without ``moeforge``'s own checker or reference:
``problem()``, which says whether a composition is an MoE forward (and why not), and ``reference()``,
a dense float64 forward (routing, quantization and all). The test holds that the checker accepts
exactly the compositions ``problem()`` finds none in, that each accepted one matches ``reference()``
on random inputs, and prints the counts.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from typing import Any, Optional

import pytest
import torch

import moeforge as mf
from moeforge.stages import ActivateQuantize

E, K, H, I, T = 4, 2, 32, 16, 7
FACTOR, OTHER_FACTOR = 2.5, 3.0
FP8_MAX, INT8_MAX = 448.0, 127.0

ON_INPUT, EPILOGUE, IN_COMBINE = (mf.RoutingWeights.ON_INPUT, mf.RoutingWeights.IN_GEMM_EPILOGUE,
                                  mf.RoutingWeights.IN_COMBINE)
NO_SCALE, FOLDED, PENDING = "none", "folded", "pending"
GATED, PLAIN, TWICE_GATED = "swiglu", "silu", "swiglu x2"
ACTIVATIONS = ["none", GATED, PLAIN, "identity", TWICE_GATED, "swiglu -> int8 (no scales)", "swiglu + quantize int8"]
WIDTHS = {"2I": 2 * I, "I": I, "4I": 4 * I}

_gen = torch.Generator().manual_seed(0)
W13 = {name: torch.randn(E, width, H, generator=_gen) * H**-0.5 for name, width in WIDTHS.items()}
B13 = {name: torch.randn(E, width, generator=_gen) * 0.1 for name, width in WIDTHS.items()}
W2 = torch.randn(E, H, I, generator=_gen) * I**-0.5
B2 = torch.randn(E, H, generator=_gen) * 0.1


@dataclasses.dataclass(frozen=True)
class Composition:
    weights_at: mf.RoutingWeights = IN_COMBINE  # where the router declares the routing weights applied
    scaling: str = NO_SCALE  # the routed scaling factor: none, folded into the weights, or left pending
    quantize_tokens: bool = False  # FP8 per token before the dispatch
    layout: str = "sorted-count"  # sorted-count, sorted-cumsum, padded
    dispatch_weights: bool = False
    quantize_rows: bool = False  # INT8 per row after the dispatch
    gate_width: str = "2I"
    gate_bias: bool = False
    gate_weights: bool = False
    gate_out: Optional[mf.DType] = None
    activation: str = GATED
    down_bias: bool = False
    down_weights: bool = False
    down_out: Optional[mf.DType] = None
    combine_weights: bool = True
    combine_factor: Optional[float] = None
    combine_out: Optional[mf.DType] = None

    # -- the stages ---------------------------------------------------------------------------------

    def stages(self) -> list[mf.Stage[Any, Any]]:
        scaled = self.scaling != NO_SCALE
        routing = mf.RoutingConfig(apply_weights=self.weights_at, routed_scaling_factor=FACTOR if scaled else 1.0,
                                   scaling_in_weights=self.scaling != PENDING)
        stages: list[mf.Stage[Any, Any]] = [mf.TopK(E, K, routing)]
        if self.quantize_tokens:
            stages.append(mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.FP8_E4M3)))
        if self.layout == "padded":
            stages.append(mf.PaddedDispatch(E, apply_routing_weights=self.dispatch_weights))
        else:
            kind = mf.GroupListType.COUNT if self.layout == "sorted-count" else mf.GroupListType.CUMSUM
            stages.append(mf.SortedDispatch(E, kind, apply_routing_weights=self.dispatch_weights))
        if self.quantize_rows:
            stages.append(mf.QuantizeRows(mf.PerTokenQuantizer(mf.DType.INT8)))
        stages.append(mf.GroupedGemm(mf.GemmRole.GATE_UP, W13[self.gate_width],
                                     B13[self.gate_width] if self.gate_bias else None,
                                     apply_routing_weights=self.gate_weights, out_dtype=self.gate_out))
        stages += _activation_stages(self.activation)
        stages.append(mf.GroupedGemm(mf.GemmRole.DOWN, W2, B2 if self.down_bias else None,
                                     apply_routing_weights=self.down_weights, out_dtype=self.down_out))
        stages.append(mf.Combine(apply_routing_weights=self.combine_weights,
                                 routed_scaling_factor=self.combine_factor, out_dtype=self.combine_out))
        return stages

    # -- what an MoE forward is -----------------------------------------------------------------------

    def problem(self) -> Optional[str]:
        """Why this composition is not an MoE forward, or ``None``."""
        applied = {ON_INPUT: self.dispatch_weights, EPILOGUE: self.down_weights, IN_COMBINE: self.combine_weights}
        if self.gate_weights:
            return "routing weights before the activation"
        if sum(applied.values()) != 1:
            return "routing weights not applied exactly once"
        if not applied[self.weights_at]:
            return "routing weights applied elsewhere than the router declares"
        wanted_factor = FACTOR if self.scaling == PENDING else None
        if self.combine_factor != wanted_factor:
            return "scaling factor not applied exactly once, with its value"
        if self.quantize_tokens and (self.dispatch_weights or self.quantize_rows):
            return "scaling or re-quantizing quantized rows"
        if (self.quantize_tokens or self.quantize_rows) and self.gate_out is None:
            return "a GEMM of quantized rows without a float out dtype"
        if mf.DType.INT8 in (self.gate_out, self.down_out, self.combine_out):
            return "an integer dtype without scales"
        activations = {"none": 0, TWICE_GATED: 2}.get(self.activation, 1)
        if activations != 1:
            return f"{activations} activations between the GEMMs"
        if self.activation == "swiglu -> int8 (no scales)":
            return "an integer dtype without scales"
        if self.activation == "swiglu + quantize int8" and self.down_out is None:
            return "a GEMM of quantized rows without a float out dtype"
        gated = self.activation in (GATED, "swiglu + quantize int8")
        if WIDTHS[self.gate_width] != (2 * I if gated else I):
            return "the widths of the GEMMs and the activation disagree"
        return None

    # -- the forward it computes, densely, in float64 ---------------------------------------------------

    def reference(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs = logits.double().softmax(-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :K]
        weights = probs.gather(-1, order)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling == FOLDED:
            weights = weights * FACTOR
        tokens = x.double()
        if self.quantize_tokens:
            tokens = _fake_quantize(tokens, FP8_MAX, torch.float8_e4m3fn)
        out = torch.zeros_like(tokens)
        w13, b13 = W13[self.gate_width].double(), B13[self.gate_width].double()
        for t, k in itertools.product(range(x.shape[0]), range(K)):
            expert, weight = int(order[t, k]), weights[t, k]
            row = tokens[t] * weight if self.weights_at is ON_INPUT else tokens[t]
            if self.quantize_rows:
                row = _fake_quantize(row, INT8_MAX, torch.int8)
            hidden = row @ w13[expert].t() + (b13[expert] if self.gate_bias else 0.0)
            activated = _activate(hidden, self.activation)
            if self.activation == "swiglu + quantize int8":
                activated = _fake_quantize(activated, INT8_MAX, torch.int8)
            y = activated @ W2[expert].double().t() + (B2[expert].double() if self.down_bias else 0.0)
            out[t] += y if self.weights_at is ON_INPUT else y * weight
        return out * FACTOR if self.scaling == PENDING else out


def _activation_stages(name: str) -> list[mf.Stage[Any, Any]]:
    kinds = {GATED: mf.ActivationKind.SWIGLU, PLAIN: mf.ActivationKind.SILU, "identity": mf.ActivationKind.IDENTITY}
    if name == "none":
        return []
    if name == TWICE_GATED:
        return [mf.Activate(), mf.Activate()]
    if name == "swiglu -> int8 (no scales)":
        return [mf.Activate(out_dtype=mf.DType.INT8)]
    if name == "swiglu + quantize int8":
        return [ActivateQuantize(mf.ActivationConfig(), mf.PerTokenQuantizer(mf.DType.INT8))]
    return [mf.Activate(mf.ActivationConfig(kinds[name]))]


def _activate(hidden: torch.Tensor, name: str) -> torch.Tensor:
    if name in (GATED, "swiglu + quantize int8"):
        gate, up = hidden[: hidden.shape[-1] // 2], hidden[hidden.shape[-1] // 2:]
        return gate * torch.sigmoid(gate) * up
    if name == PLAIN:
        return hidden * torch.sigmoid(hidden)
    return hidden


def _fake_quantize(row: torch.Tensor, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    """Symmetric quantization of the last dimension, one scale per row, and back (float64)."""
    scale = row.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    scaled = (row.float() / scale).clamp(-qmax, qmax)
    values = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return values.double() * scale.double()


# -- the compositions -----------------------------------------------------------------------------------

MATH_AXES: dict[str, list[Any]] = {
    "weights_at": [ON_INPUT, EPILOGUE, IN_COMBINE],
    "scaling": [NO_SCALE, FOLDED, PENDING],
    "dispatch_weights": [False, True],
    "gate_weights": [False, True],
    "down_weights": [False, True],
    "combine_weights": [False, True],
    "combine_factor": [None, FACTOR, OTHER_FACTOR],
    "activation": ACTIVATIONS,
}
FORMAT_AXES: dict[str, list[Any]] = {
    "quantize_tokens": [False, True],
    "layout": ["sorted-count", "sorted-cumsum", "padded"],
    "quantize_rows": [False, True],
    "gate_width": list(WIDTHS),
    "gate_bias": [False, True],
    "gate_out": [None, mf.DType.FP32, mf.DType.INT8],
    "down_bias": [False, True],
    "down_out": [None, mf.DType.FP32, mf.DType.INT8],
    "combine_out": [None, mf.DType.FP32, mf.DType.INT8],
}


def _product(axes: dict[str, list[Any]], base: Composition) -> list[Composition]:
    return [dataclasses.replace(base, **dict(zip(axes, values))) for values in itertools.product(*axes.values())]


def compositions() -> list[Composition]:
    """Every combination of the math axes (the formats drawn per composition, reproducibly), and every
    combination of the format axes for a few valid routings."""
    draw = random.Random(0)
    found = []
    for math in _product(MATH_AXES, Composition()):
        formats = {name: draw.choice(values) for name, values in FORMAT_AXES.items()}
        if math.activation in (GATED, "swiglu + quantize int8") and draw.random() < 0.7:
            formats["gate_width"] = "2I"  # keep the widths agreeing often enough to reach the other rules
        elif math.activation in (PLAIN, "identity") and draw.random() < 0.7:
            formats["gate_width"] = "I"
        found.append(dataclasses.replace(math, **formats))
    for routing in (Composition(), Composition(weights_at=ON_INPUT, dispatch_weights=True, combine_weights=False),
                    Composition(weights_at=EPILOGUE, scaling=PENDING, down_weights=True, combine_weights=False,
                                combine_factor=FACTOR)):
        found += _product(FORMAT_AXES, routing)
    return found


# -- the tests ------------------------------------------------------------------------------------------

SPEC = mf.input_spec(H, torch.float32, E)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=gen), torch.randn(T, E, generator=gen) * 2


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).norm() / reference.norm())


def _tolerance(composition: Composition) -> float:
    # Rounding to FP8 / INT8 between the stages: an element one step apart where the float64 and fp32
    # paths disagree in the last bits before it; elsewhere fp32 sums against float64 ones.
    quantized = composition.quantize_tokens or composition.quantize_rows or "quantize" in composition.activation
    return 3e-2 if quantized else 1e-5


def test_the_checker_accepts_exactly_the_moe_forwards(capsys: pytest.CaptureFixture[str]) -> None:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    failures: list[str] = []
    for index, composition in enumerate(compositions()):
        problem = composition.problem()
        try:
            pipeline = mf.Pipeline(composition.stages(), SPEC)
        except mf.ContractError as error:
            counts["rejected"] += 1
            reasons[error.field] += 1
            if problem is None:
                failures.append(f"valid composition rejected ({error.field}): {composition}\n{error}")
            elif not (error.field and error.hint and error.producer and error.consumer):
                failures.append(f"rejected without a field or hint: {composition}\n{error}")
            elif error.consumer == "pipeline output" and error.field == "scale_layout":
                # An integer layer output needs a float dtype, not the scales no quantizer can give it.
                failures.append(f"an output dtype reported as missing scales: {composition}\n{error}")
            continue
        if problem is not None:
            counts["accepted-wrong"] += 1
            failures.append(f"accepted although {problem}: {composition}")
            continue
        x, logits = _inputs(index)
        out = pipeline(mf.MoEInput(x, logits)).hidden_states
        error_ = _relative_error(out, composition.reference(x, logits))
        if error_ <= _tolerance(composition):
            counts["accepted-correct"] += 1
        else:
            counts["accepted-wrong"] += 1
            failures.append(f"accepted, relative error {error_:.2e} against the reference: {composition}")
    with capsys.disabled():
        print(f"\ncomposition soundness: {sum(counts.values())} compositions: {counts['accepted-correct']} "
              f"accepted-correct, {counts['accepted-wrong']} accepted-wrong, {counts['rejected']} rejected "
              f"(by field: {dict(reasons.most_common())})")
    assert not failures, f"{len(failures)} failures; first ones:\n" + "\n\n".join(failures[:5])
    assert counts["accepted-wrong"] == 0
    assert counts["accepted-correct"] > 100 and counts["rejected"] > 1000  # both sides are exercised


VALID_BASES = {
    "mixtral": Composition(),
    "llama4 on input, plain": Composition(weights_at=ON_INPUT, dispatch_weights=True, combine_weights=False,
                                          activation=PLAIN, gate_width="I"),
    "gpt-oss-like epilogue, biases": Composition(weights_at=EPILOGUE, down_weights=True, combine_weights=False,
                                                  gate_bias=True, down_bias=True),
    "deepseek-like pending factor, quantized": Composition(scaling=PENDING, combine_factor=FACTOR,
                                                           quantize_tokens=True, gate_out=mf.DType.FP32,
                                                           activation="swiglu + quantize int8",
                                                           down_out=mf.DType.FP32),
}


@pytest.mark.parametrize("name", list(VALID_BASES))
def test_every_deletion_duplication_and_swap_of_a_valid_pipeline_is_rejected(name: str) -> None:
    """Structure: a stage missing, repeated, or out of order. The only accepted variants are the one
    without the combine, a partial pipeline that stops at the expert outputs (a legal building block:
    it does not claim to be a layer's output), and those without a quantization before the dispatch
    (the GEMM then takes the float rows: still the same forward, unquantized)."""
    stages = VALID_BASES[name].stages()
    assert mf.Pipeline(stages, SPEC).output_spec.kind is mf.PayloadKind.OUTPUT
    variants: dict[str, list[mf.Stage[Any, Any]]] = {}
    for i in range(len(stages)):
        variants[f"without {i}"] = stages[:i] + stages[i + 1:]
        variants[f"{i} twice"] = stages[:i + 1] + stages[i:]
        if i + 1 < len(stages):
            variants[f"{i} <-> {i + 1}"] = stages[:i] + [stages[i + 1], stages[i]] + stages[i + 2:]
    accepted = []
    for label, variant in variants.items():
        try:
            pipeline = mf.Pipeline(variant, SPEC)
        except mf.ContractError as error:
            assert error.field and error.hint, label
            continue
        accepted.append((label, pipeline.output_spec.kind))
    optional = [(f"without {i}", mf.PayloadKind.OUTPUT) for i, stage in enumerate(stages)
                if isinstance(stage, mf.QuantizeTokens)]
    assert accepted == optional + [(f"without {len(stages) - 1}", mf.PayloadKind.EXPERT_OUTPUT)]


def test_a_custom_router_declares_its_placement_and_factor() -> None:
    def route(x: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = logits.softmax(-1).topk(k)
        return weights / weights.sum(-1, keepdim=True), ids

    tail = Composition(weights_at=ON_INPUT, dispatch_weights=True, combine_weights=False).stages()[1:]
    declared = mf.CustomTopK(E, K, route, apply_weights=ON_INPUT)
    x, logits = _inputs(1)
    out = mf.Pipeline([declared] + tail, SPEC)(mf.MoEInput(x, logits)).hidden_states
    reference = Composition(weights_at=ON_INPUT, dispatch_weights=True, combine_weights=False).reference(x, logits)
    assert _relative_error(out, reference) < 1e-5
    with pytest.raises(mf.ContractError) as error:  # the default placement is the combine
        mf.Pipeline([mf.CustomTopK(E, K, route)] + tail, SPEC)
    assert error.value.field == "weights_at"
    pending = mf.CustomTopK(E, K, route, scaling_factor=mf.ScalingFactor.PENDING, routed_scaling_factor=FACTOR)
    with pytest.raises(mf.ContractError) as error:
        mf.Pipeline([pending] + Composition(combine_factor=OTHER_FACTOR).stages()[1:], SPEC)
    assert error.value.field == "pending_scale" and f"routed_scaling_factor={FACTOR:g}" in error.value.hint
    with pytest.raises(mf.InputError, match="routed_scaling_factor"):
        mf.CustomTopK(E, K, route, scaling_factor=mf.ScalingFactor.PENDING)
