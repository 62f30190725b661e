"""How a checkpoint names one MoE block's experts: the one detector that the float loader
(:func:`moeforge.checkpoint.load_weights`) and the quant methods' checkpoint hooks
(``QuantMethod.load_checkpoint_experts``) share.

Names are relative to the block's prefix (``"experts.3.gate_proj.weight"``). Per-expert namings
are recognised by their projection name whatever follows it (``weight``, ``weight_scale_inv``,
``qweight``, ``scales`` ...), so a quantized checkpoint is detected the same way as a float one, and
from any expert present (an expert-parallel rank may read a checkpoint holding only its experts).

This module imports nothing of moeforge but its errors, so the quant methods can use it without
importing the loader (which imports the layer, which imports them).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import Optional

from moeforge.errors import CheckpointError


class ExpertNaming(enum.Enum):
    W1_W3_W2 = "experts.{i}.w1/w3/w2.weight"
    PROJ = "experts.{i}.gate_proj/up_proj/down_proj.weight"
    FUSED = "experts.gate_up_proj / experts.down_proj"
    QUANT_METHOD = "the quant method's own format (QuantMethod.load_checkpoint_experts)"


# (gate, up, down) projection names of the per-expert namings.
PROJECTIONS: dict[ExpertNaming, tuple[str, str, str]] = {
    ExpertNaming.W1_W3_W2: ("w1", "w3", "w2"),
    ExpertNaming.PROJ: ("gate_proj", "up_proj", "down_proj"),
}
FUSED_NAMES = ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")
_PER_EXPERT = re.compile(r"experts\.(\d+)\.([A-Za-z0-9_]+)\.")


def detect_naming(names: Iterable[str], prefix: str = "") -> Optional[ExpertNaming]:
    """The naming of the expert tensors among ``names`` (relative to ``prefix``, which only the
    messages show), or ``None`` when there is no expert tensor. A mix of namings is a
    :class:`~moeforge.errors.CheckpointError` naming one key of each."""
    found: dict[ExpertNaming, str] = {}
    for name in sorted(names):
        match = _PER_EXPERT.match(name)
        if match is not None:
            for naming, projections in PROJECTIONS.items():
                if match.group(2) in projections:
                    found.setdefault(naming, name)
        elif name in FUSED_NAMES:
            found.setdefault(ExpertNaming.FUSED, name)
    if len(found) > 1:
        examples = ", ".join(f"'{prefix}{key}' ({naming.name})" for naming, key in found.items())
        where = f" under '{prefix}'" if prefix else ""
        raise CheckpointError(f"the experts{where} mix naming schemes: {examples}")
    return next(iter(found), None)


# A name of one MoE block of a Hugging Face checkpoint, after the block's prefix (whole dotted components):
# per-expert or fused experts, the router ``gate`` (not a MoELayer's ``shared_experts.gate``), and shared
# experts named as checkpoints name them (a MoELayer's are ``shared_experts.gate_up_proj`` / ``down_proj``).
_CHECKPOINT_NAME = re.compile(
    r"(?P<prefix>(?:[^.]*\.)*?)"
    r"(?:experts\.\d+\.[^.]+\.|experts\.(?:gate_up_proj|up_proj|down_proj)(?:$|\.)"
    r"|(?<!shared_experts\.)gate\.(?:weight|bias|e_score_correction_bias)$"
    r"|shared_experts?\.(?:gate_proj|up_proj)\.|shared_expert\.down_proj\.|shared_expert_gate\.)")


def checkpoint_names(names: Iterable[str]) -> tuple[list[str], str]:
    """Those of ``names`` that a Hugging Face checkpoint gives one MoE block's tensors (the names
    :func:`moeforge.checkpoint.load_weights` reads), in their order, and the block prefix of the first."""
    found: list[str] = []
    prefix = ""
    for name in names:
        match = _CHECKPOINT_NAME.match(name)
        if match is not None:
            if not found:
                prefix = match.group("prefix")
            found.append(name)
    return found, prefix


def projection_names(naming: ExpertNaming, gated: bool) -> tuple[str, str, str]:
    """``(gate, up, down)`` projection names of a per-expert ``naming`` for a layer whose activation
    is ``gated`` (or not: then only ``up`` and ``down`` are read)."""
    if naming is ExpertNaming.W1_W3_W2 and not gated:
        raise CheckpointError("the w1/w3/w2 naming is for gated experts (w1 = gate, w3 = up); this layer's "
                              "activation is not gated")
    if naming not in PROJECTIONS:
        raise CheckpointError(f"the experts are stored as {naming.value}; this reader takes per-expert tensors "
                              "('experts.{i}.gate_proj.*' or 'experts.{i}.w1.*')")
    return PROJECTIONS[naming]


def per_expert_projections(names: Iterable[str], gated: bool) -> tuple[str, str, str]:
    """``(gate, up, down)`` for a reader of per-expert tensors: the detected naming, ``gate_proj`` /
    ``up_proj`` / ``down_proj`` when there is no expert tensor (the reader then reports the first key
    it misses)."""
    return projection_names(detect_naming(names) or ExpertNaming.PROJ, gated)
