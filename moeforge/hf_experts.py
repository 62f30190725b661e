"""``experts_implementation="moeforge"``: moeforge's pipeline as a ``transformers`` experts implementation.

``transformers`` 5 runs the experts of most of its MoE models — every experts class decorated with
``@use_experts_implementation`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, PhiMoE, Granite-MoE
and some fifty more in 5.23) — through a function it looks up by name in
``transformers.integrations.moe.ExpertsInterface``. After :func:`register`,
``from_pretrained(..., experts_implementation="moeforge")`` and
``model.set_experts_implementation("moeforge")`` run those experts through moeforge::

    import moeforge.hf_experts
    moeforge.hf_experts.register()        # explicit and idempotent: importing this module registers nothing
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moeforge")

What runs
---------
``transformers`` keeps its router: the experts function receives ``hidden_states [T, H]``,
``top_k_index [T, k]`` and ``top_k_weights [T, k]``. It runs a moeforge :class:`~moeforge.Pipeline` that
starts from these routed tokens — dispatch, gate/up GEMM, activation, down GEMM, combine (the routing
weights applied in the combine, summed in fp32 in a fixed order) — validated by the contract checker, its
implementations picked by moeforge's selector as for a :class:`~moeforge.MoELayer` with
``backend="auto"``: the triton kernels on a CUDA device when Triton is installed, the torch reference
elsewhere. The torch reference differentiates, so models train through it.

The GEMMs read the experts module's own ``gate_up_proj`` (``up_proj`` without a gate), ``down_proj`` and
biases when they run: nothing is copied, and a module storing ``[E, in, out]`` (``is_transposed``) is
read through a transposed view; training, ``load_state_dict`` and ``model.to(...)`` are seen by the next
call. The activation is the module's own: ``act_fn`` mapped onto moeforge's activations (SiLU, GELU with
erf or tanh, ReLU², identity; with a gate: SwiGLU, GeGLU), or GPT-OSS's clamped SwiGLU for a module with
``alpha`` and ``limit`` (gate and up interleaved when ``is_concatenated`` is false). Before a pipeline is
built, the mapping is checked against the module's own gating (``_apply_gate``, or ``act_fn`` without a
gate) on probe values. What moeforge does not compute — another activation or gating, a post-expert
norm, ``transformers``' expert-parallel sentinel ids — raises
:class:`~moeforge.errors.UnsupportedExpertsError` naming it.

FP8 checkpoints: ``transformers`` replaces their experts by ``FP8Experts``, which look functions up in a
registry of their own (``ALL_FP8_EXPERTS_FUNCTIONS``); :func:`register` registers the same function there.
It runs DeepSeek-V3's format — e4m3 weights with one fp32 multiplier per 128 x 128 block
(``*_scale_inv``), activations quantized per 128-element group as the experts run
(``activation_scheme="dynamic"``) — on moeforge's W8A8 stages
(:class:`~moeforge.Fp8W8A8Method` with block weight scales and group activation scales), and refuses the
other formats (another block size, static activation scales, UE8M0 scales, FP4 weights) by name.

The registered function builds one pipeline per experts module, dtype, device, top-k and layout, and
keeps it on the module itself (:class:`ModulePipelines`): a pipeline refers to the module's parameter table,
not to the module, so ``del model`` frees the weights at once, and a compiled model's guards never read
another model's pipelines. Under ``torch.compile`` the pipeline is built before the traced code runs
(``fullgraph=True`` works before any eager call). Nothing here imports ``transformers`` until
:func:`register` is called.
"""

from __future__ import annotations

import enum
import importlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Optional

import attrs
import torch
from torch import nn

from moeforge.decode_graphs import DecodeGraphs, DecodeGraphSettings
from moeforge.device_guard import on_device_of
from moeforge.dispatch_dtype import resolve_dispatch_dtype
from moeforge.errors import BackendUnavailableError, InputError, MissingPackageError, UnsupportedExpertsError
from moeforge.expert_weights import ExpertNames, ProjectionNames
from moeforge.payloads import Activations, MoEOutput, RoutedTokens, TopKOutput
from moeforge.pipeline import Pipeline
from moeforge.quant.base import QuantMethod
from moeforge.quant.fp8 import Fp8W8A8Method
from moeforge.quant.unquantized import UnquantizedMethod
from moeforge.roles.base import LayerConfig
from moeforge.selector import ROUTERS, select
from moeforge.spec import PayloadKind, RoutingWeights, Spec, input_spec
from moeforge.stages.activation import ActivationConfig, ActivationKind, GateUpLayout, apply_activation
from moeforge.stages.topk import RoutingConfig
from moeforge.tensor_ref import parametrized

NAME = "moeforge"  # the experts_implementation name

# transformers' router gives the routing; the combine applies its weights (the experts functions of
# transformers multiply after the down projection, and so does every experts class's eager forward).
_GIVEN_ROUTING = RoutingConfig(apply_weights=RoutingWeights.IN_COMBINE)

# act_fn (its class name, as transformers' ACT2FN and torch.nn name them) -> moeforge's plain activation
# and its GELU approximation. Recognised by name: this module imports no transformers class.
_ACTIVATIONS: dict[str, tuple[ActivationKind, str]] = {
    "SiLUActivation": (ActivationKind.SILU, "none"),
    "SiLU": (ActivationKind.SILU, "none"),
    "GELUActivation": (ActivationKind.GELU, "none"),
    "GELUTanh": (ActivationKind.GELU, "tanh"),
    "PytorchGELUTanh": (ActivationKind.GELU, "tanh"),
    "NewGELUActivation": (ActivationKind.GELU, "tanh"),
    "FastGELUActivation": (ActivationKind.GELU, "tanh"),
    "ReLUSquaredActivation": (ActivationKind.RELU2, "none"),
    "LinearActivation": (ActivationKind.IDENTITY, "none"),
    "Identity": (ActivationKind.IDENTITY, "none"),
}
_FUNCTIONS: dict[Callable[..., Any], tuple[ActivationKind, str]] = {
    torch.nn.functional.silu: (ActivationKind.SILU, "none"),
    torch.nn.functional.gelu: (ActivationKind.GELU, "none"),
}
_GATED = {ActivationKind.SILU: ActivationKind.SWIGLU, ActivationKind.GELU: ActivationKind.GEGLU}
_COMPUTED = ("SiLU, GELU (erf or tanh), ReLU\u00b2 and the identity; with a gate SwiGLU, GeGLU, GPT-OSS's "
             "clamped SwiGLU, the clamped SwiGLU of DeepSeek-V4 and HY-V4 and Inkling2's softcapped SwiGLU")


class ExpertsWeights(enum.Enum):
    """The expert weight formats moeforge computes for a ``transformers`` experts module."""

    FLOAT = "float"  # bf16 / fp16 / fp32 weights
    # transformers' FP8Experts with DeepSeek-V3's format: e4m3 weights, one fp32 multiplier per 128 x 128
    # block (``*_scale_inv``), activations quantized per 128-element group when the experts run
    # (``activation_scheme="dynamic"``): moeforge's Fp8W8A8Method(weight_scales="block", activation_scales="group").
    FP8_BLOCK128 = "fp8_block128"


@attrs.frozen
class ExpertsLayout:
    """How a ``transformers`` experts module stores its experts and what its activation is: the flags
    ``@use_experts_implementation`` sets, the sizes read from the weights (in moeforge's ``[E, N, K]``
    orientation), their dtype and device, and the activation moeforge computes for it."""

    module_class: str
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    num_experts: int
    hidden_size: int
    intermediate_size: int
    weight_dtype: torch.dtype
    device: torch.device
    activation: ActivationConfig
    weight_format: ExpertsWeights = ExpertsWeights.FLOAT

    @property
    def up_name(self) -> str:
        """The first projection's parameter: gate and up rows together, or up rows alone."""
        return "gate_up_proj" if self.has_gate else "up_proj"

    def quant_method(self) -> QuantMethod:
        """moeforge's quant method for this format."""
        if self.weight_format is ExpertsWeights.FP8_BLOCK128:
            return Fp8W8A8Method(weight_scales="block", activation_scales="group")
        return UnquantizedMethod()


def _flag(module: nn.Module, name: str, default: Optional[bool] = None) -> bool:
    value = getattr(module, name, default)
    if not isinstance(value, bool):
        raise UnsupportedExpertsError(
            f"{type(module).__name__} has no boolean '{name}' attribute: moeforge runs experts classes decorated "
            "with transformers' @use_experts_implementation (transformers >= 5.17 sets has_gate, has_bias, "
            "is_transposed and is_concatenated on them)")
    return value


def _parameter(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise UnsupportedExpertsError(f"{type(module).__name__} has no tensor '{name}' (its layout flags say it "
                                      "has one)")
    if name not in module._parameters and name not in module._buffers and not parametrized(module, name):
        raise UnsupportedExpertsError(f"{type(module).__name__}.{name} is neither a parameter nor a buffer of the "
                                      "module, nor a parametrization of one")
    return value


def read_layout(module: nn.Module, hidden_states: torch.Tensor) -> ExpertsLayout:
    """The layout of ``module`` (an experts module of ``transformers``) for ``hidden_states [T, H]``.

    Raises :class:`UnsupportedExpertsError` for what moeforge does not compute and :class:`InputError`
    when the hidden states do not fit the weights."""
    cls = type(module).__name__
    has_gate, has_bias = _flag(module, "has_gate"), _flag(module, "has_bias")
    is_transposed, is_concatenated = _flag(module, "is_transposed"), _flag(module, "is_concatenated")
    # transformers 5.17 sets neither flag: its experts have no post-expert norm and no EP sentinels.
    if _flag(module, "has_post_expert_norm", False):
        raise UnsupportedExpertsError(f"{cls} applies a norm after each expert (has_post_expert_norm): moeforge's "
                                      "experts pipeline has no such stage; use experts_implementation='grouped_mm'")
    if _flag(module, "_is_expert_parallel", False):
        raise UnsupportedExpertsError(f"{cls} runs under transformers' expert parallelism (its routing carries "
                                      "sentinel ids for experts on other ranks): moeforge's experts implementation "
                                      "runs one process's experts; use moeforge.distributed for expert parallelism")
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up, down = _parameter(module, up_name), _parameter(module, "down_proj")
    weight_format = ExpertsWeights.FP8_BLOCK128 if up.dtype == torch.float8_e4m3fn else ExpertsWeights.FLOAT
    for name, weight in ((up_name, up), ("down_proj", down)):
        if weight.dim() != 3 or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32, up.dtype) or (
                weight_format is ExpertsWeights.FLOAT and weight.dtype == torch.float8_e4m3fn):
            raise UnsupportedExpertsError(
                f"{cls}.{name} is a {weight.dtype} tensor of shape {tuple(weight.shape)}: moeforge's experts "
                "implementation takes [num_experts, out, in] (or [num_experts, in, out] when is_transposed) "
                "bf16/fp16/fp32 weights, or e4m3 weights with 128x128 block scales (FP8Experts)"
                + ("; int8 expert weights are transformers' packed FP4 (expert_dtype='fp4'), which it does not "
                   "compute" if weight.dtype == torch.int8 else ""))
    up_shape = (up.shape[0], up.shape[2], up.shape[1]) if is_transposed else tuple(up.shape)
    down_shape = (down.shape[0], down.shape[2], down.shape[1]) if is_transposed else tuple(down.shape)
    num_experts, up_rows, hidden = up_shape
    intermediate = down_shape[2]
    width = 2 * intermediate if has_gate else intermediate
    if down_shape[:2] != (num_experts, hidden) or up_rows != width:
        orientation = "[E, in, out] (is_transposed)" if is_transposed else "[E, out, in]"
        raise UnsupportedExpertsError(
            f"{cls}: {'gate_up_proj' if has_gate else 'up_proj'} {tuple(up.shape)} and down_proj "
            f"{tuple(down.shape)} are not one expert MLP stored {orientation}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise InputError(f"{cls} (experts_implementation='moeforge'): hidden_states must be [tokens, {hidden}], "
                         f"got {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{cls} (experts_implementation='moeforge'): hidden_states are {hidden_states.dtype}; "
                         "moeforge computes in torch.bfloat16, torch.float16 or torch.float32")
    if hidden_states.device != up.device:
        raise InputError(f"{cls} (experts_implementation='moeforge'): hidden_states on {hidden_states.device}, "
                         f"the expert weights on {up.device}")
    if weight_format is ExpertsWeights.FP8_BLOCK128:
        _check_fp8(module, up_name, has_bias, is_transposed)
    return ExpertsLayout(
        module_class=cls, has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed,
        is_concatenated=is_concatenated, num_experts=int(num_experts), hidden_size=int(hidden),
        intermediate_size=int(intermediate), weight_dtype=up.dtype, device=up.device,
        activation=activation_of(module, has_gate, is_concatenated), weight_format=weight_format)


_FP8_BLOCK = 128


def _check_fp8(module: nn.Module, up_name: str, has_bias: bool, is_transposed: bool) -> None:
    """Raise :class:`UnsupportedExpertsError` unless an FP8 experts module (``transformers``' FP8Experts) has
    the one FP8 format moeforge computes: 128 x 128 fp32 block scales, activations quantized dynamically."""
    cls = type(module).__name__
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (_FP8_BLOCK, _FP8_BLOCK):
        raise UnsupportedExpertsError(f"{cls} holds FP8 weights with block_size={block!r}: moeforge computes FP8 "
                                      "experts with 128x128 weight blocks (DeepSeek-V3's format) only")
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedExpertsError(f"{cls} quantizes its activations with activation_scheme={scheme!r}: moeforge "
                                      "quantizes them per 128-element group when the experts run ('dynamic') only")
    if has_bias or is_transposed:
        raise UnsupportedExpertsError(f"{cls} holds FP8 weights with has_bias={has_bias}, is_transposed="
                                      f"{is_transposed}: moeforge's FP8 experts read [E, out, in] weights without "
                                      "biases")
    for name in (up_name, "down_proj"):
        weight, scale = _parameter(module, name), _parameter(module, f"{name}_scale_inv")
        blocks = (weight.shape[0], -(-weight.shape[1] // _FP8_BLOCK), -(-weight.shape[2] // _FP8_BLOCK))
        if scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
            raise UnsupportedExpertsError(
                f"{cls}.{name}_scale_inv is a {scale.dtype} tensor of shape {tuple(scale.shape)}: moeforge reads one "
                f"fp32 multiplier per 128x128 block, {blocks}"
                + (" (UE8M0 scales, scale_fmt='ue8m0', are not computed)" if scale.dtype != torch.float32 else ""))


# -- the activation -----------------------------------------------------------------------------------

def _number(module: object, *names: str) -> Optional[float]:
    """The first of the attributes ``names`` that is a number (``None``: none is)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _own_gating(module: nn.Module) -> bool:
    """Whether ``module``'s gated experts compute their own ``_apply_gate`` (``transformers``' decorator gives a class
    without one ``act_fn(gate) * up``, its ``_default_apply_gate``)."""
    gating = getattr(module, "_apply_gate", None)
    return gating is not None and getattr(getattr(gating, "__func__", gating), "__name__", "") != "_default_apply_gate"


def activation_of(module: nn.Module, has_gate: bool, is_concatenated: bool) -> ActivationConfig:
    """moeforge's activation for ``module``, from its ``act_fn`` (or GPT-OSS's ``alpha`` / ``limit``; a ``limit``
    without ``alpha`` on gated experts whose class writes its own ``_apply_gate``, SiLU or no ``act_fn``: the clamped
    SwiGLU of DeepSeek-V4 and HY-V4; with ``transformers``' default gating a ``limit`` clamps nothing; an ``act_fn``
    with a ``gate_softcap`` and an ``up_softcap``: Inkling2's softcapped SwiGLU).

    Only the declared attributes are read here (cheaply, on every call); :func:`check_activation` checks
    the result against what the module computes, once, before a pipeline is built."""
    cls = type(module).__name__
    gate_up = GateUpLayout.CONCATENATED if is_concatenated else GateUpLayout.INTERLEAVED
    # GPT-OSS's experts call them alpha and limit; transformers' FP8Experts swiglu_alpha and swiglu_limit.
    alpha, limit = _number(module, "alpha", "swiglu_alpha"), _number(module, "limit", "swiglu_limit")
    if has_gate and alpha is not None and limit is not None:
        return ActivationConfig(ActivationKind.GPT_OSS_SWIGLU, gate_up, alpha=alpha, limit=limit)
    act_fn = getattr(module, "act_fn", None)
    # the clamped SwiGLU's limit: a limit without alpha, on gated experts of a class with its own gating
    clamp = limit if has_gate and limit is not None and _own_gating(module) else None
    if clamp is not None and act_fn is None:  # HY-V4's experts: SiLU in their _apply_gate
        return ActivationConfig(ActivationKind.CLAMPED_SWIGLU, gate_up, limit=clamp)
    if act_fn is None:
        raise UnsupportedExpertsError(f"{cls} has no act_fn (and no GPT-OSS alpha / limit): moeforge cannot tell its "
                                      "activation")
    caps = (_number(getattr(act_fn, "gate_softcap", None), "softcap"),
            _number(getattr(act_fn, "up_softcap", None), "softcap"))
    if has_gate and caps[0] is not None and caps[1] is not None:  # Inkling2's act_fn(gate, up)
        return ActivationConfig(ActivationKind.SOFTCAPPED_SWIGLU, gate_up, gate_softcap=caps[0], up_softcap=caps[1])
    name = type(act_fn).__name__
    found: Optional[tuple[ActivationKind, str]]
    if isinstance(act_fn, nn.GELU):
        found = (ActivationKind.GELU, act_fn.approximate)
    elif isinstance(act_fn, nn.Module):
        found = _ACTIVATIONS.get(name)
    else:
        found = next((value for function, value in _FUNCTIONS.items() if act_fn is function), None)
    shown = getattr(act_fn, "__qualname__", name)
    if found is None:
        raise UnsupportedExpertsError(f"{cls}.act_fn is {shown}, an activation moeforge does not compute (it "
                                      f"computes {_COMPUTED}); use experts_implementation='eager' or 'grouped_mm' "
                                      "for this model")
    kind, approximate = found
    if clamp is not None and kind is ActivationKind.SILU:  # DeepSeek-V4's experts
        return ActivationConfig(ActivationKind.CLAMPED_SWIGLU, gate_up, limit=clamp)
    if has_gate:
        gated = _GATED.get(kind)
        if gated is None:
            raise UnsupportedExpertsError(f"{cls} gates with act_fn={shown} ({kind.value}(gate) * up), which moeforge "
                                          f"does not compute (it computes {_COMPUTED}); use "
                                          "experts_implementation='eager' or 'grouped_mm' for this model")
        kind = gated
    return ActivationConfig(kind, gate_up, gelu_approximate=approximate)


def check_activation(module: nn.Module, layout: ExpertsLayout) -> None:
    """Raise :class:`UnsupportedExpertsError` unless moeforge's activation for ``module`` computes what the
    module's own gating computes (``_apply_gate`` for gated experts — a class may override it — else
    ``act_fn``) on probe values in fp32, spread past any clamp ``limit`` the module declares."""
    config = layout.activation
    limits = [value for value in (_number(module, "limit"), _number(module, "swiglu_limit")) if value is not None]
    reach = 2.0 * max([8.0, *limits])
    width = 16
    columns = 2 * width if layout.has_gate else width
    # Fixed probe values: every gate meets every up value across the range, in a scrambled order.
    values = torch.linspace(-reach, reach, 8 * columns, dtype=torch.float32)
    order = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))
    probe = values[order].reshape(8, columns).to(layout.device)
    gating: Callable[[torch.Tensor], object] = getattr(module, "_apply_gate" if layout.has_gate else "act_fn")
    with torch.no_grad():
        try:
            theirs = gating(probe)
        except Exception as error:  # noqa: BLE001 - whatever the module's own code raises, said as such
            raise UnsupportedExpertsError(f"{layout.module_class}: its gating failed on a probe of fp32 values "
                                          f"({type(error).__name__}: {error}); moeforge cannot check it computes "
                                          f"{config.summary()}") from error
        ours = apply_activation(probe, config)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape or not torch.allclose(
            theirs.float(), ours, rtol=1e-5, atol=1e-5):
        difference = (theirs.float() - ours).abs().max().item() if isinstance(theirs, torch.Tensor) and \
            theirs.shape == ours.shape else "a different shape"
        gating_name = "_apply_gate" if layout.has_gate else "act_fn"
        raise UnsupportedExpertsError(
            f"{layout.module_class}'s {gating_name} does not compute {config.summary()} (largest difference on "
            f"probe values: {difference}): its gating is not one moeforge computes ({_COMPUTED}); use "
            "experts_implementation='eager' or 'grouped_mm' for this model")


# -- the pipeline ---------------------------------------------------------------------------------------

def routed_spec(layout: ExpertsLayout, dtype: torch.dtype, top_k: int) -> Spec:
    """The spec of the pipeline's input: token-major hidden states with the routing ``transformers`` gave,
    whose weights the combine applies."""
    return input_spec(layout.hidden_size, dtype, layout.num_experts).evolve(
        kind=PayloadKind.ROUTED, top_k=top_k, routing_weights=RoutingWeights.PENDING,
        weights_at=RoutingWeights.IN_COMBINE)


def expert_names(module: nn.Module, layout: ExpertsLayout) -> ExpertNames:
    """Where a transformers experts module keeps its tensors, for its quant method to read
    (:meth:`~moeforge.QuantMethod.expert_weights`): ``gate_up_proj`` (or ``up_proj``) and ``down_proj``, held
    ``[E, K, N]`` when the module is transposed; their FP8 scales ``*_scale_inv`` where the module has them;
    biases ``*_bias`` ``[E, N]`` (in every layout) where its flags say it has them."""

    def projection(name: str) -> ProjectionNames:
        scale = f"{name}_scale_inv"
        bias = f"{name}_bias" if layout.has_bias else None
        if bias is not None:
            _parameter(module, bias)
        has_scale = scale in module._parameters or scale in module._buffers
        return ProjectionNames(name, scale=scale if has_scale else None, bias=bias, transposed=layout.is_transposed)

    return ExpertNames(projection(layout.up_name), projection("down_proj"))


def build_pipeline(module: nn.Module, layout: ExpertsLayout, dtype: torch.dtype,
                   top_k: int) -> Pipeline[RoutedTokens, MoEOutput]:
    """The validated pipeline from routed tokens to the combined output for ``module``'s experts."""
    check_activation(module, layout)
    method = layout.quant_method()
    if isinstance(method, Fp8W8A8Method):
        try:
            method.check_sizes(layout.hidden_size, layout.intermediate_size, layout.has_gate)
        except InputError as error:
            raise UnsupportedExpertsError(f"{layout.module_class}: {error}") from None
    dispatch = resolve_dispatch_dtype("auto", experts_accept=method.accepts, activation_dtype=dtype,
                                      quant_requires=method.required_dispatch_dtype(), quant_prefers=method.prefers,
                                      device=layout.device, experts_name=f"experts ({layout.module_class})")
    config = LayerConfig(num_experts=layout.num_experts, top_k=top_k, hidden_size=layout.hidden_size,
                         intermediate_size=layout.intermediate_size, routing=_GIVEN_ROUTING,
                         activation=layout.activation, quant=method, dtype=dtype, device=layout.device,
                         dispatch=dispatch)
    selection = select(config)
    assert selection.experts is not None and selection.layout is not None, "dispatcher='auto' spans no experts"
    weights = method.expert_weights(module, expert_names(module, layout), dtype=config.compute_dtype)
    stages = selection.routed_stages(module, config, weights)
    routers = {router.name() for router in ROUTERS}
    notes = [f"routing: given by transformers (the router of {layout.module_class}'s block)",
             dispatch.explain(), f"backend {selection.backend.value}",
             f"roles: dispatcher {selection.dispatcher.name()}, experts {selection.experts.name()}"]
    notes += [f"  skipped {name}: {reason}" for name, reason in selection.skipped if name not in routers]
    return Pipeline(stages, routed_spec(layout, dtype, top_k), notes=notes)


def _check_routing(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> None:
    cls = type(module).__name__
    for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{cls} (experts_implementation='moeforge'): {name} must be a tensor, got "
                             f"{type(value).__name__}")
    tokens = hidden_states.shape[0] if hidden_states.dim() else 0
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_weights.shape != top_k_index.shape:
        raise InputError(f"{cls} (experts_implementation='moeforge'): top_k_index and top_k_weights must both be "
                         f"[tokens={tokens}, top_k], got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise InputError(f"{cls} (experts_implementation='moeforge'): top_k_index must hold integer expert ids, got "
                         f"{top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise InputError(f"{cls} (experts_implementation='moeforge'): top_k_weights must be float, got "
                         f"{top_k_weights.dtype}")


_KEY_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm",
              "_is_expert_parallel", "alpha", "limit", "swiglu_alpha", "swiglu_limit", "activation_scheme")
_KEY_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias",
                "gate_up_proj_scale_inv", "up_proj_scale_inv", "down_proj_scale_inv")


def _code(function: object) -> object:
    """What identifies a gating function without holding what it is bound to (a bound method's instance)."""
    function = getattr(function, "__func__", function)
    return getattr(function, "__code__", type(function))


def pipeline_key(module: nn.Module, hidden_states: torch.Tensor, top_k: int) -> tuple[object, ...]:
    """Everything a built pipeline depends on besides its module, as a plain tuple, read on every call
    (cheaply: the module's attribute and tensor tables, never a copy): the hidden states' dtype, device and
    width, ``top_k``, the layout flags and activation settings, the class and shape of ``act_fn``, the gating
    code, and the shape, dtype and device of every expert tensor. A pipeline reads the tensors themselves by
    name when it runs, so new values (training, ``load_state_dict``, a new parameter of the same kind) keep
    their pipeline; anything else builds (and checks) a new one."""
    attributes, cls = module.__dict__, type(module)

    def setting(name: str) -> object:  # an instance attribute, else the class's (nn.Module's own lookup is slow)
        return attributes[name] if name in attributes else getattr(cls, name, None)

    tensors = (_stored(module, name) for name in _KEY_TENSORS)
    act_fn = module._modules.get("act_fn", setting("act_fn"))
    block = setting("block_size")
    # A plain function as act_fn is keyed by identity: only torch's own functions are mapped, and they live on.
    return (hidden_states.dtype, hidden_states.device, hidden_states.shape[-1], hidden_states.dim(), top_k,
            tuple(setting(name) for name in _KEY_FLAGS), tuple(block) if isinstance(block, (tuple, list)) else block,
            type(act_fn), getattr(act_fn, "approximate", None),
            None if act_fn is None or isinstance(act_fn, nn.Module) else id(act_fn),
            _code(setting("_apply_gate")),
            tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors),
            tuple(getattr(module, "parametrizations", {})))


def _stored(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The tensor ``module`` stores under ``name``: its parameter or buffer, or the original of a parametrized
    one."""
    found = module._parameters.get(name, module._buffers.get(name))
    if found is None and parametrized(module, name):
        original = getattr(module, "parametrizations")[name].original
        found = original if isinstance(original, torch.Tensor) else None
    return found


class ModulePipelines:
    """The pipelines built for one experts module, keyed by :func:`pipeline_key`; kept on the module itself
    (attribute ``_moeforge_pipelines``), so they live and die with it and a compiled model's guards read
    only its own modules' pipelines, never another model's.

    A copy of the module (``copy.deepcopy``, pickling) starts with none: a pipeline reads the tensors of the
    module it was built for."""

    __slots__ = ("by_key",)

    def __init__(self) -> None:
        self.by_key: dict[tuple[object, ...], Pipeline[RoutedTokens, MoEOutput]] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> ModulePipelines:
        return ModulePipelines()

    def __reduce__(self) -> tuple[type[ModulePipelines], tuple[()]]:
        return ModulePipelines, ()

    def __repr__(self) -> str:
        return f"ModulePipelines({len(self.by_key)})"


_ATTRIBUTE = "_moeforge_pipelines"


def module_pipelines(module: nn.Module) -> Optional[ModulePipelines]:
    """The pipelines kept on ``module`` (``None``: none was built for it)."""
    found = module.__dict__.get(_ATTRIBUTE)
    return found if isinstance(found, ModulePipelines) else None


class ExpertsFunction:
    """The experts implementation :func:`register` gives ``transformers``: called as
    ``fn(experts_module, hidden_states, top_k_index, top_k_weights)``, returns ``[T, H]`` in the hidden
    states' dtype.

    The pipelines it builds are kept on each experts module (:class:`ModulePipelines`); the function
    itself remembers, weakly, which modules it ran (:meth:`cached_modules`).

    Under ``torch.compile`` the pipeline is built outside the traced code (a pipeline's build reads the
    module and checks its activation on probe values, which is no graph), before the traced code looks it
    up on the module: a model compiles with ``fullgraph=True`` before its first eager call (torch 2.13; on
    torch 2.11 after one eager call, an error saying so otherwise), and its guards depend on its own
    modules only."""

    def __init__(self) -> None:
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __call__(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_routing(module, hidden_states, top_k_index, top_k_weights)
        top_k = int(top_k_index.shape[1])
        if torch.compiler.is_compiling():
            # (Dynamo must not read the module's pipelines before the build adds one: it would keep what it read.)
            if not _DYNAMO_PASSES_OBJECTS and self.kept(module, hidden_states, top_k) is None:
                raise UnsupportedExpertsError(
                    f"{type(module).__name__} (experts_implementation='moeforge'): torch.compile reached these "
                    f"experts before their pipeline was built, and torch {torch.__version__}'s Dynamo cannot build "
                    "it outside the traced code (it passes a constant-result function no objects; torch 2.13 "
                    "does): run the model once without compiling (a forward on a few tokens) before "
                    "torch.compile, or use torch >= 2.13")
            if _DYNAMO_PASSES_OBJECTS:
                _build_before_tracing(self, module, hidden_states.dtype, hidden_states.device, hidden_states.dim(),
                                      int(hidden_states.shape[-1]), top_k)
        pipeline = self.pipeline(module, hidden_states, top_k)

        def experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            topk = TopKOutput(weights=weights.float().contiguous(), ids=index.to(torch.int32).contiguous())
            result: torch.Tensor = pipeline.run(RoutedTokens(x=Activations(hidden), topk=topk)).hidden_states
            return result

        graphs = module.__dict__.get(_GRAPHS)
        if isinstance(graphs, DecodeGraphs) and not torch.compiler.is_compiling():
            tensors = [t for t in itertools.chain(module._parameters.values(), module._buffers.values())
                       if t is not None]
            with on_device_of(hidden_states):  # a graph is captured and replayed on its tensors' device
                out = graphs.run(experts, (hidden_states, top_k_index, top_k_weights), tensors, owner=pipeline)
            if out is not None:
                return out
        return experts(hidden_states, top_k_index, top_k_weights)

    def pipeline(self, module: nn.Module, hidden_states: torch.Tensor,
                 top_k: int) -> Pipeline[RoutedTokens, MoEOutput]:
        """The pipeline that runs ``module``'s experts on ``hidden_states`` routed to ``top_k`` experts each
        (built on first use; ``describe()`` tells what it runs and why)."""
        pipeline = self.kept(module, hidden_states, top_k)
        if pipeline is None:
            pipeline = self._build(module, hidden_states, top_k, pipeline_key(module, hidden_states, top_k))
        return pipeline

    @staticmethod
    def kept(module: nn.Module, hidden_states: torch.Tensor, top_k: int) -> Optional[Pipeline[RoutedTokens, MoEOutput]]:
        """The pipeline already built for these arguments, or ``None``."""
        kept = module_pipelines(module)
        return None if kept is None else kept.by_key.get(pipeline_key(module, hidden_states, top_k))

    def _build(self, module: nn.Module, hidden_states: torch.Tensor, top_k: int,
               key: tuple[object, ...]) -> Pipeline[RoutedTokens, MoEOutput]:
        # the layout is read (and checked, with the errors' words) only here
        pipeline = build_pipeline(module, read_layout(module, hidden_states), hidden_states.dtype, top_k)
        kept = module_pipelines(module)
        if kept is None:
            kept = ModulePipelines()
            module.__dict__[_ATTRIBUTE] = kept  # not nn.Module.__setattr__: no hooks, no submodule
        kept.by_key[key] = pipeline
        self._modules.add(module)
        return pipeline

    def pipelines_for(self, module: nn.Module) -> tuple[Pipeline[RoutedTokens, MoEOutput], ...]:
        """The pipelines built for ``module`` (none: its experts never ran through moeforge)."""
        kept = module_pipelines(module)
        return () if kept is None else tuple(kept.by_key.values())

    def cached_modules(self) -> int:
        """How many live experts modules this function built pipelines for (deleted modules are gone)."""
        return len(self._modules)

    def __repr__(self) -> str:
        return f"moeforge.hf_experts.ExpertsFunction({self.cached_modules()} experts modules)"


# Dynamo calls a constant-result function with the objects it is given (the experts module) from torch 2.13 on;
# torch 2.11's converts every argument to a Python constant or a tensor, and refuses a module.
_DYNAMO_PASSES_OBJECTS = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator,misc]
def _build_before_tracing(function: ExpertsFunction, module: nn.Module, dtype: torch.dtype, device: torch.device,
                          dims: int, width: int, top_k: int) -> bool:
    """Build (if it is not kept yet) the pipeline for ``module`` and hidden states of this dtype, device,
    rank and width, routed to ``top_k`` experts. ``torch.compile`` runs it as plain Python while it traces
    (a function whose result is a constant), so the build never enters the graph; the traced code then
    finds the pipeline on the module. Returns ``True`` (the constant)."""
    shape = (0,) * (dims - 1) + (width,)
    function.pipeline(module, torch.empty(shape, dtype=dtype, device=device), top_k)
    return True


# -- registration -------------------------------------------------------------------------------------

@attrs.frozen
class ExpertsRegistry:
    """One of ``transformers``' registries of experts functions: its interface class (whose ``register``
    adds a name for every model) and the mapping the models look names up in."""

    label: str
    interface: Any
    functions: Any

    def get(self) -> object:
        return self.functions.get(NAME)


def _registries() -> list[ExpertsRegistry]:
    """``transformers``' experts registries: the float experts' and, where it has one, FP8Experts'."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as error:
        raise MissingPackageError("moeforge.hf_experts.register() needs transformers >= 5.17 (pip install "
                                  "'moeforge[hf]' 'transformers>=5.17')") from error
    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError:
        moe = None
    if moe is None or not hasattr(moe, "ExpertsInterface") or not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        raise BackendUnavailableError(
            f"transformers {transformers.__version__} has no experts interface (transformers.integrations.moe."
            "ExpertsInterface, transformers >= 5): moeforge cannot be its experts_implementation; use "
            "moeforge.hf.patch_model(model) instead")
    registries = [ExpertsRegistry("experts", moe.ExpertsInterface, moe.ALL_EXPERTS_FUNCTIONS)]
    try:
        fp8 = importlib.import_module("transformers.integrations.finegrained_fp8")
    except ImportError:
        fp8 = None
    if fp8 is not None and hasattr(fp8, "FP8ExpertsInterface") and hasattr(fp8, "ALL_FP8_EXPERTS_FUNCTIONS"):
        registries.append(ExpertsRegistry("FP8 experts", fp8.FP8ExpertsInterface, fp8.ALL_FP8_EXPERTS_FUNCTIONS))
    return registries


def _refusal(name: str) -> Optional[str]:
    """Why the installed ``transformers`` refuses ``experts_implementation=name`` although it is
    registered (``None``: it accepts it). Asked of ``transformers``' own check: early 5.x releases
    compare the name with a fixed list instead of the registry."""
    modeling_utils = importlib.import_module("transformers.modeling_utils")
    check = getattr(modeling_utils.PreTrainedModel, "get_correct_experts_implementation", None)
    if check is None:
        return "it has no experts_implementation setting"
    try:
        # The check reads the model only for "grouped_mm" (whether the kernel can run): no model is needed.
        check(None, name)
    except ValueError as error:
        return str(error)
    except (AttributeError, TypeError):
        return None  # a check that reads the model: it answers when a model is built
    return None


_GRAPHS = "_moeforge_decode_graphs"


def capture_decode_graphs(model: nn.Module, settings: Optional[DecodeGraphSettings] = DecodeGraphSettings()) -> int:
    """Replay the experts of ``model`` (each ``transformers`` experts module in it) as CUDA graphs at decode batch
    sizes when they run with ``experts_implementation="moeforge"``: each module keeps a
    :class:`~moeforge.decode_graphs.DecodeGraphs` of ``settings`` (see :mod:`moeforge.decode_graphs`: eager calls of
    at most ``settings.max_tokens`` tokens that record no gradient, captured once per batch size). ``settings=None``
    releases them. Returns how many experts modules it set. Kept on each module (attribute
    ``_moeforge_decode_graphs``), so they live and die with the model; a copy of the model starts without graphs of
    its own until it is given them."""
    if settings is not None and not isinstance(settings, DecodeGraphSettings):
        raise InputError(f"capture_decode_graphs takes a DecodeGraphSettings or None, got {settings!r}")
    count = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("has_gate", "is_concatenated", "is_transposed")):
            if settings is None:
                module.__dict__.pop(_GRAPHS, None)
            else:
                module.__dict__[_GRAPHS] = DecodeGraphs(settings)  # not nn.Module.__setattr__: no hooks
            count += 1
    return count


def register() -> ExpertsFunction:
    """Register ``"moeforge"`` as an experts implementation of ``transformers`` — for float experts, and for
    ``transformers``' FP8Experts (FP8 checkpoints) where it has them — and return the registered function.
    Idempotent: a second call returns the function registered by the first.

    Raises :class:`~moeforge.errors.MissingPackageError` without ``transformers``,
    :class:`~moeforge.errors.BackendUnavailableError` where the installed ``transformers`` has no experts
    interface or refuses registered names (moeforge does not patch ``transformers``: use
    :func:`moeforge.hf.patch_model` there), or where another library registered ``"moeforge"``."""
    registries = _registries()
    found = [(registry, registry.get()) for registry in registries]
    for registry, registered in found:
        if registered is not None and not isinstance(registered, ExpertsFunction):
            raise BackendUnavailableError(f"transformers' {registry.label} implementation {NAME!r} is already "
                                          f"registered to {registered!r}, not by moeforge.hf_experts.register(); "
                                          "moeforge leaves it as it is")
    ours = [registered for _, registered in found if isinstance(registered, ExpertsFunction)]
    function = ours[0] if ours else ExpertsFunction()
    for registry, registered in found:
        if registered is not function:
            registry.interface.register(NAME, function)
    refusal = _refusal(NAME)
    if refusal is not None:
        version = importlib.import_module("transformers").__version__
        raise BackendUnavailableError(
            f"transformers {version} refuses experts_implementation={NAME!r} although it is registered: its model "
            f"check accepts only a fixed list of names ({refusal.strip()}). moeforge does not patch transformers: "
            "upgrade transformers (5.17 and later accept registered names), or convert the model's MoE blocks with "
            "moeforge.hf.patch_model(model)")
    return function


def registered_function() -> Optional[ExpertsFunction]:
    """The function registered as ``"moeforge"`` in ``transformers`` (``None`` before :func:`register`)."""
    registered = _registries()[0].get()
    return registered if isinstance(registered, ExpertsFunction) else None
