"""Built-in stages, one module per stage kind (``triton`` / ``triton_quant``: the triton backend's stages)."""

from moeforge.stages.activation import (
    Activate,
    ActivationConfig,
    ActivationKind,
    GateUpLayout,
    apply_activation,
)
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.triton import AlignDispatch, AlignedCombine, FusedGroupedGemm, TritonTopK
from moeforge.stages.triton_quant import (
    ActivateQuantizeAligned,
    FusedQuantGroupedGemm,
    QuantizeAligned,
    QuantScheme,
    TritonQuantizeTokens,
)
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
    "Activate", "ActivationConfig", "ActivationKind", "GateUpLayout", "apply_activation",
    "ActivateQuantize",
    "AlignDispatch", "AlignedCombine", "FusedGroupedGemm", "TritonTopK",
    "ActivateQuantizeAligned", "FusedQuantGroupedGemm", "QuantizeAligned", "QuantScheme", "TritonQuantizeTokens",
    "Combine", "combine_rows",
    "Overflow", "PaddedDispatch", "SortedDispatch",
    "GemmRole", "GroupedGemm", "grouped_gemm_padded", "grouped_gemm_sorted",
    "Cast", "PerGroupQuantizer", "PerTensorQuantizer", "PerTokenQuantizer", "Quantizer", "QuantizeRows", "QuantizeTokens",
    "dequantize", "quantizer_for",
    "CustomTopK", "GroupScore", "RoutingConfig", "Scoring", "ScoreOrder", "TopK", "select_experts",
]
