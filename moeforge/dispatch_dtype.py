"""The dispatch dtype: which format activations travel in from the top-k to the experts.

:func:`resolve_dispatch_dtype` is the one place that decides it, by a fixed priority (first rule
that gives an answer wins):

1. an explicit per-layer / per-pipeline setting (anything but ``"auto"``);
2. the process default in the environment variable ``MOEFORGE_DISPATCH_DTYPE`` (read, never
   written; a warning names the variable; ignored, with a warning, for a layer whose experts
   cannot consume it, so a BF16 draft model survives an FP8 default meant for its target model);
3. what the quant method requires;
4. what the expert backend requires (e.g. a kernel that quantizes internally wants unquantized input);
5. the device's default;
6. the library default: the quant method's preference (``QuantMethod.prefers``) when the experts
   accept it and the device carries it, else FP8 when the experts accept FP8, else the layer's own
   activation dtype, else BF16.

When the routing weights are applied on the input (``RoutingWeights.ON_INPUT``, Llama-4), the dispatch
scales its rows by them, which needs float rows: rules 2, 5 and 6 then consider only the float dtypes
the experts accept (rule 6 records why), and an explicit or required quantized dtype is a
:class:`~moeforge.ContractError` that names the settings to change.

The answer is then validated against the device: FP8 where the device has no FP8 becomes INT8 (with a
warning), INT8 where INT8 dispatch is unsupported becomes FP8, NVFP4 where unsupported is rejected.
The returned :class:`DispatchDecision` records the rule that decided, for ``describe()``.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Collection, Mapping
from typing import Optional, Union

import attrs
import torch

from moeforge.errors import ContractError, DispatchDtypeError
from moeforge.spec import REFERENCE_FLOAT_DTYPES, DType

ENV_VAR = "MOEFORGE_DISPATCH_DTYPE"


class DispatchDtype(enum.Enum):
    """Format of activations on the wire between the top-k and the experts."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP64 = "fp64"  # a float64 layer's own rows (torch reference only)
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"

    @property
    def params_bytes(self) -> float:
        """Bytes per element on the wire (scales not counted); sizes communication buffers."""
        return _BYTES[self]

    @property
    def activation_dtype(self) -> DType:
        return _AS_DTYPE[self]

    @property
    def is_quantized(self) -> bool:
        return self.activation_dtype.is_quantized

    @classmethod
    def parse(cls, value: Union[DispatchDtype, str]) -> DispatchDtype:
        if isinstance(value, DispatchDtype):
            return value
        if not isinstance(value, str):  # e.g. a torch.dtype: say so instead of an AttributeError
            raise DispatchDtypeError(
                f"a dispatch dtype must be a DispatchDtype or its name (e.g. 'bf16'), got "
                f"{type(value).__name__} {value!r}")
        key = value.strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        for member in cls:
            if member.value == key:
                return member
        names = ", ".join(m.value for m in cls)
        raise DispatchDtypeError(f"unknown dispatch dtype {value!r}; expected 'auto' or one of {names}")

    @classmethod
    def from_dtype(cls, dtype: DType) -> DispatchDtype:
        for member, as_dtype in _AS_DTYPE.items():
            if as_dtype is dtype:
                return member
        raise DispatchDtypeError(f"no dispatch dtype carries {dtype.value}")


_BYTES = {
    DispatchDtype.BF16: 2.0,
    DispatchDtype.FP16: 2.0,
    DispatchDtype.FP32: 4.0,
    DispatchDtype.FP64: 8.0,
    DispatchDtype.FP8: 1.0,
    DispatchDtype.INT8: 1.0,
    DispatchDtype.NVFP4: 0.5,
}
_AS_DTYPE = {
    DispatchDtype.BF16: DType.BF16,
    DispatchDtype.FP16: DType.FP16,
    DispatchDtype.FP32: DType.FP32,
    DispatchDtype.FP64: DType.FP64,
    DispatchDtype.FP8: DType.FP8_E4M3,
    DispatchDtype.INT8: DType.INT8,
    DispatchDtype.NVFP4: DType.NVFP4,
}
_ALIASES = {"fp8_e4m3": "fp8", "e4m3": "fp8", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
            "half": "fp16", "float": "fp32", "float64": "fp64", "double": "fp64"}


class DispatchRule(enum.IntEnum):
    EXPLICIT = 1
    PROCESS_DEFAULT = 2
    QUANT_METHOD = 3
    EXPERT_BACKEND = 4
    DEVICE_DEFAULT = 5
    LIBRARY_DEFAULT = 6

    @property
    def label(self) -> str:
        return _RULE_LABELS[self]


_RULE_LABELS = {
    DispatchRule.EXPLICIT: "explicit setting",
    DispatchRule.PROCESS_DEFAULT: f"process default {ENV_VAR}",
    DispatchRule.QUANT_METHOD: "quant method",
    DispatchRule.EXPERT_BACKEND: "expert backend",
    DispatchRule.DEVICE_DEFAULT: "device default",
    DispatchRule.LIBRARY_DEFAULT: "library default",
}


@attrs.frozen
class DeviceDispatchSupport:
    """Which dispatch dtypes a device can carry, and its own default (rule 5), if any."""

    fp8: bool = True
    int8: bool = True
    nvfp4: bool = False
    default: Optional[DispatchDtype] = None

    @classmethod
    def for_device(cls, device: Union[torch.device, str, None]) -> DeviceDispatchSupport:
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            # NVFP4 is quantized and its GEMMs emulated by the torch reference (moeforge.quant.nvfp4) on
            # any GPU; sm_100's FP4 tensor cores are not used yet.
            return cls(fp8=(major, minor) >= (8, 9), int8=True, nvfp4=True)
        # The torch reference carries FP8, INT8 and NVFP4 (moeforge.quant.nvfp4.Nvfp4Quantizer) as
        # plain tensors on any device.
        return cls(fp8=True, int8=True, nvfp4=True)

    def carries(self, dtype: DispatchDtype) -> bool:
        if dtype is DispatchDtype.FP8:
            return self.fp8
        if dtype is DispatchDtype.INT8:
            return self.int8
        if dtype is DispatchDtype.NVFP4:
            return self.nvfp4
        return True


@attrs.frozen
class DispatchDecision:
    """The resolved dispatch dtype, the rule that decided it, and any hardware conversion."""

    dtype: DispatchDtype
    rule: DispatchRule
    converted_from: Optional[DispatchDtype] = None
    preferred: bool = False  # rule 6 took the quant method's preference
    reason: Optional[str] = None  # what narrowed the choice, e.g. routing weights on the input

    def explain(self) -> str:
        label = self.rule.label + (", the quant method's preference" if self.preferred else "")
        if self.reason is not None:
            label += f"; {self.reason}"
        text = f"dispatch {self.dtype.value} (rule {int(self.rule)}: {label})"
        if self.converted_from is not None:
            text += f", converted from {self.converted_from.value}: the device cannot carry it"
        return text


def resolve_dispatch_dtype(
    setting: Union[DispatchDtype, str, None] = "auto",
    *,
    experts_accept: Collection[DType],
    activation_dtype: torch.dtype = torch.bfloat16,
    quant_requires: Optional[DispatchDtype] = None,
    backend_requires: Optional[DispatchDtype] = None,
    device: Union[DeviceDispatchSupport, torch.device, str, None] = None,
    environ: Optional[Mapping[str, str]] = None,
    experts_name: str = "experts",
    quant_prefers: Optional[DispatchDtype] = None,
    weights_on_input: bool = False,
) -> DispatchDecision:
    """Decide the dispatch dtype of one layer (see the module docstring for the priority).

    ``environ`` defaults to ``os.environ``, which is only read. ``weights_on_input``: the dispatch
    scales the rows by their routing weights, so they must travel in a float dtype. Raises
    :class:`ContractError` when the explicit setting or the rule that decided names a dtype the
    experts cannot consume (or a quantized one for rows scaled on the input), and
    :class:`DispatchDtypeError` when the device cannot carry it and no conversion applies.
    """
    support = device if isinstance(device, DeviceDispatchSupport) else DeviceDispatchSupport.for_device(device)
    accept = frozenset(experts_accept)
    environ = os.environ if environ is None else environ
    # Rows scaled by their routing weights before the experts must be float on the wire.
    wire = accept & REFERENCE_FLOAT_DTYPES if weights_on_input else accept
    if not wire:
        raise ContractError(
            producer="dispatch with the routing weights on the input", consumer=experts_name, field="dtype",
            have=REFERENCE_FLOAT_DTYPES, want=accept,
            hint="the dispatch scales float rows by the routing weights (RoutingWeights.ON_INPUT) but these "
            "experts take only quantized rows: apply the weights in the combine "
            "(apply_weights=RoutingWeights.IN_COMBINE), or use a quant method that accepts float rows")
    wire_name = f"{experts_name} behind a dispatch that scales rows on the input" if wire != accept else experts_name
    decision = _by_priority(setting, wire, activation_dtype, quant_requires, backend_requires,
                            support, environ, wire_name, quant_prefers, float_rows=weights_on_input)
    if weights_on_input and wire != accept and decision.rule is DispatchRule.LIBRARY_DEFAULT:
        decision = attrs.evolve(decision, reason="routing weights on the input need float rows")
    decision = _validate_on_device(decision, support)
    if weights_on_input and decision.dtype.activation_dtype not in REFERENCE_FLOAT_DTYPES:
        raise ContractError(
            producer=decision.explain(),
            consumer="dispatch with the routing weights on the input",
            field="dtype",
            have=decision.dtype.activation_dtype,
            want=wire,
            hint="the routing weights are applied on the input (RoutingConfig(apply_weights=RoutingWeights."
            "ON_INPUT)): the dispatch scales float rows, so set dispatch_dtype to 'auto' or one of "
            f"{_names(wire)} (the experts quantize after the dispatch), or apply the weights in the combine "
            "(apply_weights=RoutingWeights.IN_COMBINE)",
        )
    if decision.dtype.activation_dtype not in accept:
        raise ContractError(
            producer=decision.explain(),
            consumer=experts_name,
            field="dtype",
            have=decision.dtype.activation_dtype,
            want=accept,
            hint=f"choose a dispatch dtype among {_names(accept)}, or a quant method that accepts "
            f"{decision.dtype.value} after dispatch",
        )
    return decision


def _by_priority(
    setting: Union[DispatchDtype, str, None],
    accept: frozenset[DType],
    activation_dtype: torch.dtype,
    quant_requires: Optional[DispatchDtype],
    backend_requires: Optional[DispatchDtype],
    support: DeviceDispatchSupport,
    environ: Mapping[str, str],
    experts_name: str,
    quant_prefers: Optional[DispatchDtype] = None,
    float_rows: bool = False,
) -> DispatchDecision:
    if setting is not None and not (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return DispatchDecision(DispatchDtype.parse(setting), DispatchRule.EXPLICIT)
    from_env = environ.get(ENV_VAR, "").strip()
    if from_env and from_env.lower() != "auto":
        try:
            wanted = DispatchDtype.parse(from_env)
        except DispatchDtypeError as error:
            raise DispatchDtypeError(f"environment variable {ENV_VAR}: {error}") from None
        if wanted.activation_dtype in accept:
            warnings.warn(f"dispatch dtype {wanted.value} taken from the environment variable {ENV_VAR}",
                          stacklevel=3)
            return DispatchDecision(wanted, DispatchRule.PROCESS_DEFAULT)
        warnings.warn(
            f"{ENV_VAR}={from_env} ignored for this layer: {experts_name} accept only {_names(accept)}",
            stacklevel=3,
        )
    if quant_requires is not None:
        return DispatchDecision(quant_requires, DispatchRule.QUANT_METHOD)
    if backend_requires is not None:
        return DispatchDecision(backend_requires, DispatchRule.EXPERT_BACKEND)
    if support.default is not None and not (float_rows and support.default.is_quantized):
        return DispatchDecision(support.default, DispatchRule.DEVICE_DEFAULT)
    if quant_prefers is not None and quant_prefers.activation_dtype in accept and support.carries(quant_prefers):
        return DispatchDecision(quant_prefers, DispatchRule.LIBRARY_DEFAULT, preferred=True)
    if DType.FP8_E4M3 in accept and support.fp8:
        return DispatchDecision(DispatchDtype.FP8, DispatchRule.LIBRARY_DEFAULT)
    own = DType.from_torch(activation_dtype)
    if own in accept:
        return DispatchDecision(DispatchDtype.from_dtype(own), DispatchRule.LIBRARY_DEFAULT)
    if DType.BF16 in accept:
        return DispatchDecision(DispatchDtype.BF16, DispatchRule.LIBRARY_DEFAULT)
    raise DispatchDtypeError(
        f"no default dispatch dtype fits: {experts_name} accept {_names(accept)} and the layer computes "
        f"in {own.value}; set dispatch_dtype explicitly"
    )


def _validate_on_device(decision: DispatchDecision, support: DeviceDispatchSupport) -> DispatchDecision:
    dtype = decision.dtype
    if support.carries(dtype):
        return decision
    if dtype is DispatchDtype.FP8 and support.int8:
        replacement = DispatchDtype.INT8
    elif dtype is DispatchDtype.INT8 and support.fp8:
        replacement = DispatchDtype.FP8
    else:
        raise DispatchDtypeError(
            f"this device cannot carry {dtype.value} dispatch ({decision.explain()}); choose another "
            "dispatch dtype"
        )
    warnings.warn(f"dispatch dtype {dtype.value} is not supported on this device; using "
                  f"{replacement.value} instead", stacklevel=3)
    return attrs.evolve(decision, dtype=replacement, converted_from=dtype)


def _names(accept: frozenset[DType]) -> str:
    return "{" + ", ".join(sorted(d.value for d in accept)) + "}"
