"""moeforge: Mixture-of-Experts forward passes assembled from typed, build-time-checked stages."""

from moeforge.backend import Backend
from moeforge.dispatch_dtype import (
    ENV_VAR,
    DeviceDispatchSupport,
    DispatchDecision,
    DispatchDtype,
    DispatchRule,
    resolve_dispatch_dtype,
)
from moeforge.errors import (
    BackendUnavailableError,
    CheckpointError,
    ContractError,
    DispatchDtypeError,
    InputError,
    MissingPackageError,
    MoEForgeError,
    PayloadError,
    PresetError,
)
from moeforge.layer import MoELayer
from moeforge.payloads import (
    Activations,
    AlignedRows,
    ExpertRows,
    MoEInput,
    MoEOutput,
    PaddedRows,
    RoutedTokens,
    SortedRows,
    TopKOutput,
)
from moeforge.pipeline import Chain, Pipeline, chain
from moeforge.quant import (
    ActivationScales,
    CheckpointFormat,
    Fp8W8A8Method,
    Int8W8A8Method,
    WeightScales,
    Mxfp4Method,
    Nvfp4Method,
    Nvfp4Quantizer,
    QuantMethod,
    UnquantizedMethod,
    W4A4NpuMethod,
    W4A16Method,
)
from moeforge.shared_experts import SharedExperts, SharedExpertsConfig, SharedGate
from moeforge.spec import (
    Accepts,
    DType,
    ExpertIds,
    GroupListType,
    Layout,
    PayloadKind,
    RoutingWeights,
    ScaleLayout,
    ScalingFactor,
    Spec,
    input_spec,
)
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages import (
    Activate,
    AlignDispatch,
    FusedGroupedGemm,
    TritonTopK,
    ActivationConfig,
    ActivationKind,
    Cast,
    Combine,
    CustomTopK,
    GateUpLayout,
    GemmRole,
    GroupedGemm,
    GroupScore,
    Overflow,
    PaddedDispatch,
    PerGroupQuantizer,
    PerTensorQuantizer,
    PerTokenQuantizer,
    QuantizeRows,
    QuantizeTokens,
    RoutingConfig,
    ScoreOrder,
    Scoring,
    SortedDispatch,
    TopK,
)
from moeforge.tensor_ref import ParamRef
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionNames, ProjectionWeights

# Submodules reachable as attributes after `import moeforge` (moeforge.hf is not: it needs transformers).
from moeforge import checkpoint as checkpoint, families as families

__version__ = "0.1.0"

# The user's API: building, configuring and running layers and pipelines, the quant methods, the
# errors a caller handles (moeforge.errors has the narrower ones: PayloadError, BackendUnavailableError,
# DispatchDtypeError, MissingPackageError, PresetError). The stage-authoring kit (the Stage interface, payloads, specs, every built-in stage) lives in
# moeforge.stages and moeforge.spec; the names above that are not listed here stay importable from
# moeforge for code written against 0.1 (type checkers treat them as not exported).
__all__ = [
    # layers and their configuration
    "MoELayer", "RoutingConfig", "Scoring", "ScoreOrder", "GroupScore", "RoutingWeights", "ActivationConfig",
    "ActivationKind", "GateUpLayout", "SharedExpertsConfig", "SharedGate", "Backend", "DispatchDtype", "DType",
    # weight formats
    "QuantMethod", "UnquantizedMethod", "Fp8W8A8Method", "Int8W8A8Method", "W4A16Method", "Mxfp4Method",
    "Nvfp4Method", "W4A4NpuMethod",
    # pipelines composed by hand
    "Pipeline", "chain", "input_spec", "MoEInput", "MoEOutput", "TopK", "CustomTopK", "SortedDispatch",
    "PaddedDispatch", "GroupedGemm", "GemmRole", "Activate", "Combine", "QuantizeTokens",
    # errors (the narrower ones, each also a standard exception, are in moeforge.errors)
    "MoEForgeError", "ContractError", "InputError", "CheckpointError",
    # submodules
    "checkpoint", "families",
]
