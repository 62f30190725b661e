"""The one caller of the ``moeforge::moe_gemm`` custom op (:mod:`moeforge.kernels.grouped_gemm_call`).

* No other module of the package reaches the op: an ``ast`` scan of ``moeforge/`` (outside ``kernels/ops.py``,
  which defines it) for every way of naming it, itself checked on the forms the old callers used.
* The launch configuration crosses the op as one fixed-length list: every ``GemmConfig`` field is encoded,
  and a list of another length is refused with a clear error.
* The wrapper computes what the kernel's launcher computes on the same operands (under Triton's interpreter
  without a GPU): float weights with the fused activation and bias, the routing weights on rows aligned by a
  larger block, INT4 weights with zero points, FP8 with the epilogue's FP8 output.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Optional

import attrs
import pytest
import torch

from moeforge.kernels.config import GemmConfig
from moeforge.kernels.grouped_gemm_call import (
    CONFIG_FIELDS,
    GemmEpilogue,
    GemmRoute,
    GemmRows,
    GemmWeight,
    decode_config,
    encode_config,
    grouped_gemm,
)

PACKAGE = Path(__file__).resolve().parent.parent / "moeforge"
OP = "moe_gemm"
OP_NAMES = {"moeforge::moe_gemm", "moeforge.moe_gemm"}


# -- one caller ------------------------------------------------------------------------------------


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _is_namespace(node: ast.AST, aliases: set[str]) -> bool:
    """Whether ``node`` stands for the ops' namespace: ``torch.ops.moeforge``, the module that registers
    them (``moeforge.kernels.ops``, or what ``kernel_ops()`` returns), or a name bound to either."""
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        return name is not None and name.split(".")[-1] == "kernel_ops"
    return _dotted(node) in aliases


def op_references(source: str) -> list[int]:
    """The lines of ``source`` that name the ``moeforge::moe_gemm`` op (its name in strings and docstrings
    aside)."""
    tree = ast.parse(source)
    aliases = {"torch.ops.moeforge", "moeforge.kernels.ops"}
    found: list[int] = []
    for _ in range(2):  # an alias of an alias
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _is_namespace(node.value, aliases):
                aliases |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.ImportFrom) and node.module == "moeforge.kernels":
                aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "ops"}
            elif isinstance(node, ast.Import):
                aliases |= {alias.asname for alias in node.names
                            if alias.name == "moeforge.kernels.ops" and alias.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == OP and _is_namespace(node.value, aliases):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) >= 2 and (
                _is_namespace(node.args[0], aliases) and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == OP):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "moeforge.kernels.ops" and any(
                alias.name == OP for alias in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.Constant) and node.value in OP_NAMES:
            found.append(node.lineno)
    return sorted(found)


@pytest.mark.parametrize("source", [
    "torch.ops.moeforge.moe_gemm(a, None, w)",
    "torch.ops.moeforge.moe_gemm.default(a, None, w)",
    "ops = torch.ops.moeforge\nout, _ = ops.moe_gemm(a, None, w)",
    "lib = torch.ops.moeforge\nops = lib\nops.moe_gemm(a)",
    "from moeforge.kernels import ops\nops.moe_gemm(a)",
    "from moeforge.kernels import ops as registered\nregistered.moe_gemm(a)",
    "import moeforge.kernels.ops\nmoeforge.kernels.ops.moe_gemm(a)",
    "from moeforge.kernels.ops import moe_gemm",
    "kernel_ops().moe_gemm(a)",
    "ops = kernel_ops()\nops.moe_gemm(a)",
    "getattr(torch.ops.moeforge, 'moe_gemm')(a)",
    "torch.library.opcheck('moeforge::moe_gemm', args)",
])
def test_the_scan_finds_each_way_of_calling_the_op(source: str) -> None:
    assert op_references(source)


@pytest.mark.parametrize("source", [
    "from moeforge.kernels import moe_gemm as kernel\nkernel.moe_gemm(a, w, out)",  # the launcher, not the op
    "from moeforge.kernels import moe_gemm\nmoe_gemm.moe_gemm(a, w, out)",
    "from moeforge.kernels.moe_gemm import moe_gemm\nmoe_gemm(a, w, out)",
    '"""Calls torch.ops.moeforge.moe_gemm (``moeforge::moe_gemm``)."""',
    "ops = torch.ops.moeforge\nops.quantize_rows(x)\nops.expert_weight_grad(x)",
])
def test_the_scan_leaves_the_launcher_and_prose_alone(source: str) -> None:
    assert not op_references(source)


def test_only_the_wrapper_calls_the_op() -> None:
    """``grouped_gemm`` is the op's one caller in the package: a module that needs the grouped GEMM builds
    the operand records and calls it (``kernels/ops.py`` defines the op and registers its backward)."""
    callers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        lines = op_references(path.read_text())
        if lines and relative != "moeforge/kernels/ops.py":
            callers[relative] = lines
    assert list(callers) == ["moeforge/kernels/grouped_gemm_call.py"], callers
    assert len(callers["moeforge/kernels/grouped_gemm_call.py"]) == 1


# -- the configuration's encoding ------------------------------------------------------------------------


def test_every_configuration_field_crosses_the_op_in_order() -> None:
    assert CONFIG_FIELDS == tuple(field.name for field in attrs.fields(GemmConfig))


@pytest.mark.parametrize("config", [
    GemmConfig(16, 32, 64),
    GemmConfig(64, 128, 64, group_m=1, num_warps=8, num_stages=4, tma=True, split_k=1),
    GemmConfig(16, 32, 128, tma=False, split_k=3),
    GemmConfig(128, 128, 64, swap=True, half_tail=True, decode_chunk=4),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, warp_specialized=True),
])
def test_the_configuration_round_trips(config: GemmConfig) -> None:
    encoded = encode_config(config)
    assert len(encoded) == len(CONFIG_FIELDS) and all(type(value) is int for value in encoded)
    assert decode_config(encoded) == config


@pytest.mark.parametrize("values", [[16, 32, 64, 1, 4, 2], [16, 32, 64, 1, 4, 2, -1, 0, 0, 0], list(range(1, 14))])
def test_a_configuration_list_of_another_length_is_refused(values: list[int]) -> None:
    with pytest.raises(ValueError, match=f"is {len(CONFIG_FIELDS)} integers .*got {len(values)}"):
        decode_config(values)


# -- the wrapper computes what the launcher computes ------------------------------------------------------

pytest.importorskip("triton")

from moeforge.kernels import align, moe_gemm  # noqa: E402
from moeforge.kernels import ops as _registers_the_ops  # noqa: E402,F401
from moeforge.kernels.activations import ACT_SILU  # noqa: E402
from moeforge.kernels.formats import WeightFormat  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemmConfig(16, 16, 32, group_m=2, num_warps=1, num_stages=1)


def _plan(tokens: int, experts: int, top_k: int, block_m: int, gen: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = align.align_block_size(
        ids.to(torch.int32).to(DEVICE), experts, block_m)
    return plan


def _launched(rows: GemmRows, weight: GemmWeight, route: GemmRoute, epilogue: GemmEpilogue, config: GemmConfig,
              out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The launcher (:func:`moeforge.kernels.moe_gemm.moe_gemm`) on the records' operands, NaN-poisoned out."""
    n_out = weight.data.shape[1] // (2 if epilogue.glu else 1)
    dtype = torch.float8_e4m3fn if epilogue.fp8_out else epilogue.out_dtype
    out = torch.full((route.num_copies, n_out), float("nan"), device=DEVICE).to(dtype)
    moe_gemm.moe_gemm(rows.data, weight.data, out, route.sorted_ids, route.block_expert, route.num_padded,
                      rows_per_a=rows.rows_per_a, config=config, weight_format=weight.format, a_scale=rows.scale,
                      a_global=rows.global_scale, weight_scale=weight.scale, weight_zero=weight.zero,
                      weight_global=weight.global_scale, bias=epilogue.bias, topk_weights=epilogue.routing_weights,
                      act=epilogue.act, glu=epilogue.glu, interleaved=epilogue.interleaved, alpha=epilogue.alpha,
                      limit=epilogue.limit, out_scale=out_scale, aligned_block_m=route.aligned_block_m,
                      weight_scale_max=weight.scale_max, weight_shuffled=weight.shuffled)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert not torch.isnan(a.float()).any()
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "not bitwise the same"


def test_the_wrapper_equals_the_launcher_on_a_fused_gate_up_gemm() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, experts, top_k, hidden, inter = 5, 4, 2, 32, 16
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE) / hidden ** 0.5
    bias = torch.randn(experts, 2 * inter, generator=gen).to(DEVICE)
    rows, weight = GemmRows(x, rows_per_a=top_k), GemmWeight(w13)
    route = GemmRoute(*_plan(tokens, experts, top_k, SMALL.block_m, gen), tokens * top_k)
    epilogue = GemmEpilogue(torch.float32, bias=bias, act=ACT_SILU, glu=True)
    out, out_scale = grouped_gemm(rows, weight, route, epilogue, SMALL)
    assert out.shape == (tokens * top_k, inter) and out_scale is None
    _same(out, _launched(rows, weight, route, epilogue, SMALL))


def test_the_wrapper_equals_the_launcher_with_routing_weights_on_a_larger_alignment() -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, experts, top_k, hidden, inter = 6, 4, 2, 16, 32
    copies = torch.randn(tokens * top_k, inter, generator=gen).to(DEVICE).half()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE).half()
    weights = torch.rand(tokens * top_k, generator=gen).to(DEVICE)
    rows, weight = GemmRows(copies), GemmWeight(w2)
    route = GemmRoute(*_plan(tokens, experts, top_k, 2 * SMALL.block_m, gen), tokens * top_k,
                      aligned_block_m=2 * SMALL.block_m)
    epilogue = GemmEpilogue(torch.float16, routing_weights=weights)
    out, _ = grouped_gemm(rows, weight, route, epilogue, SMALL)
    _same(out, _launched(rows, weight, route, epilogue, SMALL))


def test_the_wrapper_equals_the_launcher_on_int4_weights_with_zero_points() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, experts, top_k, hidden, inter, group = 3, 4, 2, 64, 16, 32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE).half()
    packed = torch.randint(0, 256, (experts, inter, hidden // 2), generator=gen, dtype=torch.uint8).to(DEVICE)
    scale = (torch.rand(experts, inter, hidden // group, generator=gen) / 8 + 0.01).to(DEVICE).half()
    zero = torch.randint(0, 16, (experts, inter, hidden // group), generator=gen, dtype=torch.uint8).to(DEVICE)
    rows = GemmRows(x, rows_per_a=top_k)
    weight = GemmWeight(packed, WeightFormat.INT4, scale, zero=zero)
    route = GemmRoute(*_plan(tokens, experts, top_k, SMALL.block_m, gen), tokens * top_k)
    epilogue = GemmEpilogue(torch.float16)
    out, _ = grouped_gemm(rows, weight, route, epilogue, SMALL)
    _same(out, _launched(rows, weight, route, epilogue, SMALL))


def test_the_wrapper_equals_the_launcher_on_fp8_with_an_fp8_output() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, experts, top_k, hidden, inter = 3, 2, 2, 128, 128
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    x_scale = x.abs().amax(1, keepdim=True) / 448
    w = torch.randn(experts, inter, hidden, generator=gen).to(DEVICE)
    w_scale = w.abs().amax(2) / 448
    rows = GemmRows((x / x_scale).to(torch.float8_e4m3fn), x_scale, rows_per_a=top_k)
    weight = GemmWeight((w / w_scale[..., None]).to(torch.float8_e4m3fn), WeightFormat.FP8, w_scale)
    route = GemmRoute(*_plan(tokens, experts, top_k, 16, gen), tokens * top_k)
    epilogue = GemmEpilogue(torch.float16, fp8_out=True)
    config = GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=1)
    out, out_scale = grouped_gemm(rows, weight, route, epilogue, config)
    assert out_scale is not None and out_scale.shape == (tokens * top_k, inter // 128)
    launched_scale = torch.full_like(out_scale, float("nan"))
    _same(out, _launched(rows, weight, route, epilogue, config, launched_scale))
    _same(out_scale, launched_scale)


def test_the_wrapper_traces_in_one_graph() -> None:
    # The stages build the records in every forward: Dynamo must trace their construction (frozen dataclasses).
    gen = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden, inter = 4, 4, 2, 32, 16
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(DEVICE) / hidden ** 0.5
    plan = _plan(tokens, experts, top_k, SMALL.block_m, gen)

    def gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                num_padded: torch.Tensor) -> torch.Tensor:
        out, _ = grouped_gemm(GemmRows(x, rows_per_a=top_k), GemmWeight(w13),
                              GemmRoute(sorted_ids, block_expert, num_padded, tokens * top_k),
                              GemmEpilogue(x.dtype, act=ACT_SILU, glu=True), SMALL)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(gate_up, fullgraph=True, backend="eager")
    _same(compiled(x, w13, *plan), gate_up(x, w13, *plan))


def test_the_op_refuses_a_configuration_list_of_another_length() -> None:
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 16).to(DEVICE), torch.randn(2, 16, 16).to(DEVICE)
    plan = _plan(2, 2, 1, 16, gen)
    args: list[Any] = [x, None, w, None, None, None, None, None, *plan, 2, 1, 0, 1.0, 0, False, False, 1.0, 0.0]
    with pytest.raises(ValueError, match=f"config is {len(CONFIG_FIELDS)} integers"):
        torch.ops.moeforge.moe_gemm(*args, [16, 16, 16, 1, 1, 1], torch.float32, False)
