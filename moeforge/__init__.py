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
    AlignedCombine,
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

# Submodules reachable as attributes after `import moeforge` (moeforge.hf is not: it needs transformers).
from moeforge import checkpoint as checkpoint, families as families

__version__ = "0.1.0"

__all__ = [
    "AlignDispatch", "AlignedCombine", "AlignedRows", "FusedGroupedGemm", "TritonTopK",
    "Accepts", "Activate", "ActivationConfig", "ActivationKind", "Activations", "Backend",
    "BackendUnavailableError", "Cast", "CheckpointError", "CheckpointFormat", "Mxfp4Method", "Nvfp4Method",
    "Nvfp4Quantizer", "W4A16Method", "W4A4NpuMethod", "ActivationScales", "Fp8W8A8Method", "Int8W8A8Method",
    "WeightScales", "Chain", "Combine", "ContractError", "CustomTopK",
    "DType", "DeviceDispatchSupport", "DispatchDecision", "DispatchDtype", "DispatchDtypeError",
    "DispatchRule", "ENV_VAR", "ExpertIds", "ExpertRows", "GateUpLayout", "GemmRole", "GroupListType",
    "GroupScore", "GroupedGemm", "InputError", "MissingPackageError", "PresetError", "Layout", "Mismatch", "MoEForgeError", "MoEInput",
    "MoELayer", "MoEOutput", "Overflow", "PaddedDispatch", "PaddedRows", "ParamRef",
    "PayloadError", "PayloadKind", "PerGroupQuantizer", "PerTensorQuantizer", "PerTokenQuantizer", "Pipeline",
    "QuantMethod", "QuantizeRows", "QuantizeTokens", "RoutedTokens", "RoutingConfig",
    "RoutingWeights", "ScaleLayout", "ScalingFactor", "ScoreOrder", "Scoring", "SharedExperts",
    "SharedExpertsConfig", "SharedGate", "SortedDispatch", "SortedRows", "Spec",
    "Stage", "StageKind", "TopK", "TopKOutput", "UnquantizedMethod", "chain", "input_spec",
    "resolve_dispatch_dtype",
]
