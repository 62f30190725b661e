"""Every entry of every bf16 table shipped for this GPU launches, forward and backward, with the grid the
layer would choose at the entry's token count: the kernel fits the GPU's shared memory (a launch that does
not raises ``OutOfResources`` when Triton loads it). The backward's launches write fp32 (the recomputed
pre-activation, the input gradient) where the forward writes bf16: a forward tile reused there once asked for
327712 bytes of shared memory on an H100 (the flattened grid stages its fp32 output tile).

Tiny operands (two experts, a few hundred rows) compile the same kernel the real shapes do: tile, stages,
warps, grid, dtypes and flags are what specialise it. Skipped without a Hopper GPU (the shipped tables are
Hopper's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moeforge.kernels import align, launch_plan, moe_gemm, weight_grad
from moeforge.kernels.config import GemmConfig, MoEConfig, device_tables
from moeforge.kernels.formats import WeightFormat

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the shipped tables are Hopper's)")


def _launches() -> list[tuple[str, GemmConfig, bool, float, str]]:
    """(what, config, glu, rows per expert, out dtype) for every launch the layer makes from the device's
    bf16 tables and the fallbacks of an untuned shape: each GEMM's forward (bf16 out), its recomputation (fp32 out), the training forward's unfused
    gate/up GEMM (``GemmConfig.unfused_gate_up``) and the input gradients (fp32 for rows shared by top_k copies,
    bf16 for the down GEMM's own rows)."""
    if not HOPPER:
        return []
    from moeforge.kernels.config import _DEFAULTS  # an untuned shape's fallbacks, launched the same way

    found: dict[tuple[Any, ...], tuple[str, GemmConfig, bool, float, str]] = {}
    tables: list[tuple[str, float, MoEConfig]] = [(f"default <= {bound} rows per expert", min(bound, 1e6), config)
                                                   for bound, config in _DEFAULTS]
    for key, entries in device_tables(torch.cuda.get_device_name()).items():
        fields = dict(part.split("=") for part in key.split(",") if "=" in part)
        if not key.endswith(",bf16"):
            continue
        experts, top_k = int(fields["E"]), int(fields["k"])
        tables += [(f"{key} M={tokens}", int(tokens) * top_k / experts,
                    MoEConfig(GemmConfig(**entry["gate_up"]), GemmConfig(**entry["down"])))
                   for tokens, entry in entries.items()]
    for where, rows_per_expert, moe_config in tables:
        for gemm in ("gate_up", "down"):
            fused = getattr(moe_config, gemm)
            training = fused.unfused_gate_up() if gemm == "gate_up" else fused
            for what, config, glu, out in ((f"{gemm} forward", fused, gemm == "gate_up", "bf16"),
                                           (f"{gemm} recomputed", fused, False, "fp32"),
                                           (f"{gemm} training forward", training, False, "bf16"),
                                           (f"{gemm} input gradient", training, False, "fp32"),
                                           (f"{gemm} input gradient", training, False, "bf16")):
                grid = launch_plan.default_grid((9, 0), WeightFormat.FLOAT, config, glu, rows_per_expert,
                                             4 if out == "fp32" else 2)
                found.setdefault((config, glu, out, grid, "gradient" in what),
                                 (f"{what} ({out}) {where}", config, glu, rows_per_expert, out))
    return list(found.values())


@pytest.mark.parametrize("what, config, glu, rows_per_expert, out",
                         [pytest.param(*launch, id=launch[0]) for launch in _launches()])
def test_every_shipped_launch_fits(what: str, config: GemmConfig, glu: bool, rows_per_expert: float,
                                   out: str) -> None:
    torch.manual_seed(0)
    experts, rows, k_dim = 2, 512, 512
    n_out = 512
    n_w = 2 * n_out if glu else n_out
    out_dtype = torch.float32 if out == "fp32" else torch.bfloat16
    ids = torch.randint(0, experts, (rows, 1), device="cuda", dtype=torch.int32)
    aligned = config.block_m
    sorted_ids, block_expert, num_padded = align.align_block_size(ids, experts, aligned)
    transposed = "gradient" in what
    weight = torch.randn(experts, k_dim, n_w, device="cuda", dtype=torch.bfloat16).transpose(1, 2) if transposed \
        else torch.randn(experts, n_w, k_dim, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
    result = torch.empty(rows, n_out, device="cuda", dtype=out_dtype)
    grid = launch_plan.default_grid((9, 0), WeightFormat.FLOAT, config, glu, rows_per_expert, result.element_size())
    moe_gemm.moe_gemm(a, weight, result, sorted_ids, block_expert, num_padded, rows_per_a=1, config=config,
                      glu=glu, act=1 if glu else 0, grid=grid, split_k=1)
    torch.cuda.synchronize()
    assert torch.isfinite(result).all()  # the values are the forward tests' business; this one's is the launch


def test_the_weight_gradient_kernel_fits_for_every_alignment_block() -> None:
    for block_m in (16, 32, 64, 128, 256):
        ids = torch.randint(0, 4, (600, 2), device="cuda", dtype=torch.int32)
        sorted_ids, block_expert, num_padded = align.align_block_size(ids, 4, block_m)
        d_rows = torch.randn(1200, 384, device="cuda", dtype=torch.bfloat16)
        rows = torch.randn(600, 256, device="cuda", dtype=torch.bfloat16)
        dw, db = weight_grad.expert_weight_grad(d_rows, rows, 2, sorted_ids, block_expert, num_padded, 4, block_m, True)
        torch.cuda.synchronize()
        assert dw.shape == (4, 384, 256) and db is not None and torch.isfinite(dw).all()


def _warp_specialized_entries() -> list[tuple[str, GemmConfig, bool]]:
    """(what, config, glu) for every entry of this GPU's shipped tables that launches the Gluon kernel."""
    if not HOPPER:
        return []
    found: dict[tuple[GemmConfig, bool], str] = {}
    for key, entries in device_tables(torch.cuda.get_device_name()).items():
        for tokens, entry in entries.items():
            for gemm in ("gate_up", "down"):
                config = GemmConfig(**entry[gemm])
                if config.warp_specialized:
                    found.setdefault((config, gemm == "gate_up"), f"{gemm} {key} M={tokens}")
    return [(what, config, glu) for (config, glu), what in found.items()]


@pytest.mark.parametrize("what, config, glu", [pytest.param(*entry, id=entry[0])
                                               for entry in _warp_specialized_entries()])
def test_every_shipped_warp_specialized_entry_launches_the_gluon_kernel(what: str, config: GemmConfig,
                                                                        glu: bool) -> None:
    from moeforge.kernels import warp_specialized

    torch.manual_seed(0)
    experts, rows, k_dim, n_out = 2, 512, 512, 512
    ids = torch.randint(0, experts, (rows, 1), device="cuda", dtype=torch.int32)
    plan = align.align_block_size(ids, experts, config.block_m)
    weight = torch.randn(experts, 2 * n_out if glu else n_out, k_dim, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
    assert warp_specialized.problem(a, weight, quantized=False, weight_format=WeightFormat.FLOAT, bias=False,
                                    act=1 if glu else 0, glu=glu, interleaved=False, out_dtype=torch.bfloat16,
                                    fp8_out=False, update=None, config=config,
                                    aligned_block_m=config.block_m) is None
    result = torch.full((rows, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
    warp_specialized.launch(a, weight, result, *plan, rows_per_a=1, config=config, glu=glu, topk_weights=None,
                            aligned_block_m=config.block_m)
    torch.cuda.synchronize()
    assert torch.isfinite(result).all()
