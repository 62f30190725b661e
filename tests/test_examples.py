"""The examples run and say what they promise."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_routing(capsys: pytest.CaptureFixture[str]) -> None:
    _load("custom_routing").main()
    out = capsys.readouterr().out
    assert "HashRouting honours its contract" in out
    assert "0   HashRouting(k=2)" in out
    assert "matches the dense computation" in out
    assert "token-permutation equivariant" in out


def test_custom_activation(capsys: pytest.CaptureFixture[str]) -> None:
    _load("custom_activation").main()
    out = capsys.readouterr().out
    assert "sorted: matches the hand-written reference" in out
    assert "padded: matches the hand-written reference" in out
    assert "float64: torch.autograd.gradcheck passes" in out
    assert "stage 3 (ScaledSwiGLU): field 'width' does not match" in out


def test_contract_error(capsys: pytest.CaptureFixture[str]) -> None:
    _load("contract_error").main()
    out = capsys.readouterr().out
    assert out.count("does not match") == 5
    assert "stage 2 (SortedDispatch) -> stage 3 (GroupedGemm): field 'dtype'" in out
    assert "produces: fp8_e4m3" in out
    assert "dispatch fp8 (rule 1: explicit setting) -> experts (UnquantizedMethod)" in out
    assert "stage 5 (Combine): field 'routing_weights'" in out
    assert "use Combine(apply_routing_weights=False)" in out
    assert "pipeline output: field 'scaling_factor'" in out
    assert "field 'group_list_type'" in out


def test_the_custom_activation_stage_gradchecks_in_a_float64_layer() -> None:
    # What the example teaches must hold for a float64 layer too: accepted there, and computed in float64
    # (a stage computing in fp32 fails gradcheck).
    import torch

    import moeforge as mf

    example = _load("custom_activation")
    torch.manual_seed(0)
    layer = mf.MoELayer(4, 2, 8, 6, dtype=torch.float64, environ={})
    layer.register_parameter("act_scale", torch.nn.Parameter(torch.rand(4, dtype=torch.float64) + 0.5))
    layer.replace_stage("Activate", example.ScaledSwiGLU(mf.stages.ParamRef(layer, "act_scale")))
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))


def test_lora_finetune_moe(capsys: pytest.CaptureFixture[str]) -> None:
    _load("lora_finetune_moe").main(steps=4)
    out = capsys.readouterr().out
    assert "W4A16GroupedGemm(gate_up, 64->64, int4 g32" in out and "LoRA r=4 x2" in out
    assert "the loss curves agree" in out and "the int4 weights stayed frozen" in out
