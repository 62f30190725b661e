"""Expert-parallel pieces that need no process group: the wire format and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeforge as mf
from moeforge.distributed import ExpertParallel, RowFormat
from moeforge.errors import InputError
from moeforge.stages.quantize import PerGroupQuantizer, PerTokenQuantizer


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 5), groups=st.integers(1, 3),
       kind=st.sampled_from(["bf16", "fp16", "fp32", "fp8", "int8", "fp8/group"]))
def test_rows_survive_the_wire_format_bit_for_bit(rows: int, groups: int, kind: str) -> None:
    width = 128 * groups
    x = torch.randn(rows, width) * 3
    weight = torch.rand(rows)
    if kind in ("bf16", "fp16", "fp32"):
        acts = mf.Activations(x.to(mf.DType(kind).torch_dtype))
    elif kind == "fp8/group":
        acts = PerGroupQuantizer()(x)
    else:
        acts = PerTokenQuantizer(mf.DType.FP8_E4M3 if kind == "fp8" else mf.DType.INT8)(x)
    wire = RowFormat.of(acts)
    assert wire.row_bytes % 16 == 0
    packet = wire.pack(acts.data, acts.scale, weight)
    assert packet.shape == (rows, wire.row_bytes) and packet.dtype == torch.uint8
    data, scale, got_weight = wire.unpack(packet)
    assert torch.equal(data.view(torch.uint8), acts.data.view(torch.uint8))
    assert (scale is None) == (acts.scale is None)
    if scale is not None and acts.scale is not None:
        assert torch.equal(scale, acts.scale)
    assert torch.equal(got_weight, weight)


@pytest.mark.parametrize("dispatch, layout, data_bytes", [
    ("bf16", mf.ScaleLayout.NONE, 2 * 7168),
    ("fp8", mf.ScaleLayout.PER_GROUP_128, 7168 + 4 * 56),
    ("fp8", mf.ScaleLayout.PER_TOKEN, 7168 + 4),
    ("int8", mf.ScaleLayout.PER_TOKEN, 7168 + 4),
    ("nvfp4", mf.ScaleLayout.NVFP4_BLOCK16, 7168 // 2 + 7168 // 16),
])
def test_buffers_are_sized_from_params_bytes(dispatch: str, layout: mf.ScaleLayout, data_bytes: int) -> None:
    wire = RowFormat.for_dispatch(mf.DispatchDtype.parse(dispatch), 7168, layout)
    # data (+ scales) + the fp32 routing weight + the flag byte, rounded up to 16 bytes
    assert wire.row_bytes == -(-(data_bytes + 5) // 16) * 16


def test_per_tensor_scales_have_no_row_format() -> None:
    with pytest.raises(ValueError, match="per_tensor"):
        RowFormat.for_dispatch(mf.DispatchDtype.FP8, 256, mf.ScaleLayout.PER_TENSOR)


def test_expert_parallel_needs_a_process_group() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(InputError, match="init_process_group"):
        ExpertParallel(8)
