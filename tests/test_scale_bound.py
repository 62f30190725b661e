"""The bound on MXFP4's E8M0 codes that lets the packed decoding fold its x 2**126 into the scales.

``ScaleCodeBound`` (``moeforge.kernels.scale_bound``) takes a scale tensor's largest code once per state of the
tensor and again after any in-place write; the MXFP4 triton stage passes it to the GEMM on every call. On CPU:
the cache and its refusals, the launcher's argument check, and what the stage hands the GEMM as the scales
change (the kernel itself runs the portable decoding there). On a CUDA GPU: the layer's output is bitwise the
same with and without the fold, stays right after a scale is raised above 128 in place, and a CUDA graph
captured with the fold replays the same output. (The decoding of every code, folded and not, is in
``test_packed_dequant.py``.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import moeforge as mf
from moeforge.kernels.scale_bound import ScaleCodeBound

sys.path.insert(0, str(Path(__file__).resolve().parent))

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _scales(high: int = 121) -> torch.Tensor:
    return torch.randint(100, high, (3, 8, 4), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def test_the_bound_follows_every_in_place_write() -> None:
    scales, bound = _scales(), ScaleCodeBound()
    assert bound.max_code(scales) == int(scales.max())
    scales[1, 2, 3] = 200
    assert bound.max_code(scales) == 200
    with torch.no_grad():
        scales.copy_(torch.full_like(scales, 7))
    assert bound.max_code(scales) == 7
    param = torch.nn.Parameter(_scales(), requires_grad=False)
    assert bound.max_code(param) == int(param.max())
    param.data = torch.full_like(param, 130)  # new storage
    assert bound.max_code(param) == 130
    assert bound.max_code(param[:, :4]) == 130  # a view: another shape
    assert bound.max_code(torch.zeros(0, 4, 2, dtype=torch.uint8)) == 0


def test_an_unchanged_tensor_is_not_reduced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    scales, bound = _scales(), ScaleCodeBound()
    first = bound.max_code(scales)

    def no_reduction(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("reduced again")

    monkeypatch.setattr(torch.Tensor, "max", no_reduction)
    assert bound.max_code(scales) == first


def test_no_bound_where_it_cannot_be_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.inference_mode():
        frozen = _scales()
    assert ScaleCodeBound().max_code(frozen) is None  # no version counter
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert ScaleCodeBound().max_code(_scales()) is None


def test_the_launcher_checks_the_bound() -> None:
    pytest.importorskip("triton")
    from moeforge.kernels import align, moe_gemm
    from moeforge.kernels.config import GemmConfig
    from moeforge.kernels.formats import WeightFormat

    device = "cuda" if CUDA else "cpu"
    packed = torch.zeros(2, 32, 32, dtype=torch.uint8, device=device)
    scales = torch.full((2, 32, 2), 127, dtype=torch.uint8, device=device)
    x = torch.randn(3, 64, device=device).to(torch.float16)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=device)
    for wrong in (-1, 256):
        with pytest.raises(ValueError, match="weight_scale_max"):
            moe_gemm.moe_gemm(x, packed, torch.empty(3, 32, dtype=torch.float16, device=device),
                              *align.align_block_size(ids, 2, 16), rows_per_a=1, config=GemmConfig(16, 32, 64),
                              weight_format=WeightFormat.MXFP4, weight_scale=scales, weight_scale_max=wrong)


def _layer(dtype: torch.dtype, backend: str) -> mf.MoELayer:
    torch.manual_seed(0)
    return mf.MoELayer(4, 2, 128, 64, quant=mf.Mxfp4Method(), backend=backend, dtype=dtype,
                       device="cuda" if CUDA else "cpu", environ={})


def test_the_stage_hands_the_gemm_the_current_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MXFP4 triton stages pass each weight's largest code, taken again after the scales change in place;
    the layer still equals the torch backend."""
    pytest.importorskip("triton")
    import moeforge.kernels.moe_gemm as kernel
    from test_quant_triton_layer import _triton_pipeline

    seen: list[Optional[int]] = []
    launch = kernel.moe_gemm

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("weight_scale_max"))
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernel, "moe_gemm", spy)
    reference = _layer(torch.float16, "torch")
    pipeline = _triton_pipeline(reference)
    x = torch.randn(5, 128, device=reference.w13_scales.device, dtype=torch.float16)
    logits = torch.randn(5, 4, device=x.device)
    for raised in (None, 131):
        if raised is not None:
            with torch.no_grad():
                reference.w2_scales[:, :, 0] = raised  # every expert: the tokens reach it
        seen.clear()
        with torch.no_grad():
            got, want = pipeline(mf.MoEInput(x, logits)).hidden_states, reference(x, logits)
        assert seen == [int(reference.w13_scales.max()), int(reference.w2_scales.max())]
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert seen[1] == 131


@gpu
def test_the_folded_layer_is_bitwise_the_unfolded_one_and_follows_its_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, reference = _layer(torch.bfloat16, "triton"), _layer(torch.bfloat16, "torch")
    reference.load_state_dict(layer.state_dict())
    assert int(layer.w13_scales.max()) <= 128 and int(layer.w2_scales.max()) <= 128  # random init: foldable
    x = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        folded = layer(x)
        with monkeypatch.context() as patch:
            patch.setattr(ScaleCodeBound, "max_code", lambda self, scales: None)
            unfolded = layer(x)
        assert torch.equal(folded, unfolded)

        # a CUDA graph captured with the fold replays the same output
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        graph.replay()
        assert torch.equal(static_out, folded)

        # scales raised above 128 in place (as a checkpoint could have them): no fold, still right
        for model in (layer, reference):
            model.w2_scales[:, :, 0] += 12
            model.w13_scales[:, 5, :] = 140
        got, want = layer(x), reference(x)
    assert torch.isfinite(got).all()
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2
