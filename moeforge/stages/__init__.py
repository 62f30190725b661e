"""The stage-authoring kit: the built-in stages (one module per stage kind; ``triton`` /
``triton_quant``: the triton backend's), the :class:`Stage` interface, and the payloads stages pass
each other. What a stage declares it accepts and produces is in :mod:`moeforge.spec`."""

from moeforge.payloads import (
    Activations,
    AlignedRows,
    BlockAlignment,
    ExpertRows,
    MoEInput,
    MoEOutput,
    PaddedRows,
    Plan,
    RoutedTokens,
    SortedRows,
    TopKOutput,
)
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.tensor_ref import ParamRef, optional_ref

from moeforge.stages.activation import (
    Activate,
    ActivationConfig,
    ActivationKind,
    GateUpLayout,
    apply_activation,
)
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK
from moeforge.stages.triton_quant import (
    ActivateQuantizeAligned,
    FusedQuantGroupedGemm,
    QuantizeAligned,
    TritonQuantizeTokens,
)
from moeforge.expert_weights import ExpertNames, ExpertWeights, ProjectionNames, ProjectionWeights
from moeforge.kernels.formats import WeightFormat
from moeforge.stages.combine import Combine, combine_rows
from moeforge.stages.dispatch import Overflow, PaddedDispatch, SortedDispatch
from moeforge.stages.gemm import GemmRole, GroupedGemm, grouped_gemm_padded, grouped_gemm_sorted
from moeforge.stages.quantize import (
    Cast,
    PerGroupQuantizer,
    PerTensorQuantizer,
    PerTokenQuantizer,
    Quantizer,
    QuantizeRows,
    QuantizeTokens,
    dequantize,
    quantizer_for,
)
from moeforge.stages.topk import (
    CustomTopK,
    GroupScore,
    RoutingConfig,
    Scoring,
    ScoreOrder,
    TopK,
    select_experts,
)

__all__ = [
    "Stage", "StageKind", "Mismatch", "ParamRef", "optional_ref",
    "ExpertWeights", "ProjectionWeights", "ExpertNames", "ProjectionNames",
    "Activations", "AlignedRows", "BlockAlignment", "ExpertRows", "MoEInput", "MoEOutput", "PaddedRows", "Plan",
    "RoutedTokens", "SortedRows", "TopKOutput",
    "Activate", "ActivationConfig", "ActivationKind", "GateUpLayout", "apply_activation",
    "ActivateQuantize",
    "AlignDispatch", "FusedGroupedGemm", "TritonTopK",
    "ActivateQuantizeAligned", "FusedQuantGroupedGemm", "QuantizeAligned", "TritonQuantizeTokens", "WeightFormat",
    "Combine", "combine_rows",
    "Overflow", "PaddedDispatch", "SortedDispatch",
    "GemmRole", "GroupedGemm", "grouped_gemm_padded", "grouped_gemm_sorted",
    "Cast", "PerGroupQuantizer", "PerTensorQuantizer", "PerTokenQuantizer", "Quantizer", "QuantizeRows", "QuantizeTokens",
    "dequantize", "quantizer_for",
    "CustomTopK", "GroupScore", "RoutingConfig", "Scoring", "ScoreOrder", "TopK", "select_experts",
]
