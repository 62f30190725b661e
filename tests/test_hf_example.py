"""``examples/hf_patch_qwen3.py`` runs and keeps its promise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_patch_qwen3.py"


def test_hf_patch_qwen3_example(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("example_hf_patch_qwen3", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    report = module.main()

    out = capsys.readouterr().out
    assert [entry.path for entry in report.replaced] == ["model.layers.0.mlp", "model.layers.2.mlp"]
    assert {entry.block_class for entry in report.replaced} == {"Qwen3MoeSparseMoeBlock"}
    assert report.skipped == ()
    assert "replaced 2 MoE block(s)" in out
    assert "model.layers.0.mlp: Qwen3MoeSparseMoeBlock -> moeforge (qwen3_moe)" in out
    assert "generated tokens: the same" in out
    assert "the patched model matches the original" in out


FINETUNE = Path(__file__).resolve().parent.parent / "examples" / "finetune_tiny_moe.py"


def test_finetune_tiny_moe_example(capsys: pytest.CaptureFixture[str]) -> None:
    """Training through ``experts_implementation="moeforge"`` (moeforge's torch stages differentiate) follows
    the eager experts' loss curve step by step, and the loss goes down."""
    spec = importlib.util.spec_from_file_location("example_finetune_tiny_moe", FINETUNE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    curves = module.main(["--steps", "8"])

    eager, ours = curves["eager"], curves["moeforge"]
    assert len(eager) == len(ours) == 8
    assert all(abs(a - b) <= module.TOLERANCE * abs(a) for a, b in zip(eager, ours))
    assert ours[-1] < ours[0]
    out = capsys.readouterr().out
    assert "routing: given by transformers" in out and "experts TorchUnquantizedExperts" in out
    assert "the loss curves agree" in out
