"""Launch tables tuned for a quantized weight format (``benchmarks/tune_moe.py --formats``).

A quant method names its format (``QuantMethod.table_key``); a table tuned for that format, shape and
device gives its triton GEMMs their tiles and the dispatch its ``block_m`` as tuned (no cap, no
4-bit alignment rule); without one, the compute dtype's table and the format's rules apply as before.
On the GPU, a layer reading a format table (a fake device file) still equals its torch reference.
The committed device files load and name known formats; the tuner's search space fits each format.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import moeforge as mf
from moeforge.kernels.config import ConfigTable, GemmConfig, MoEConfig, device_key, device_tables, shape_key
from moeforge.payloads import BlockAlignment
from moeforge.spec import DType
from moeforge.kernels.formats import WeightFormat
from moeforge.kernels.grouped_gemm_call import decode_config, encode_config
from moeforge.stages.triton_quant import FusedQuantGroupedGemm, default_quant_config

ENTRY: dict[str, Any] = {"gate_up": dict(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
         "down": dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3), "us": 1.0}
SMALL: dict[str, Any] = {"gate_up": dict(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4),
         "down": dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=5), "us": 1.0}


def _device_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, tables: dict[str, Any]) -> None:
    """Make ``ConfigTable.load`` read ``tables`` as the tuned file of ``device``."""
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / f"{device_key(device)}.json").write_text(json.dumps(tables))
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path)


def _methods() -> list[mf.QuantMethod]:
    """One of every built-in quantized configuration with a weight format of its own."""
    return [mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),
            mf.Fp8W8A8Method(weight_scales="channel", activation_scales="token"), mf.Int8W8A8Method(),
            *(mf.W4A16Method(group_size=g, zero_points=z) for g in (32, 64, 128) for z in (True, False)),
            mf.Mxfp4Method(), mf.Mxfp4Method(shuffled=True), mf.Nvfp4Method(), mf.Nvfp4Method(input_global_scale=1e-3),
            mf.Nvfp4Method(shuffled=True), mf.Nvfp4Method(input_global_scale=1e-3, shuffled=True)]


def test_every_quant_method_names_its_format_and_the_names_differ() -> None:
    keys = [method.table_key for method in _methods()]
    assert all(isinstance(key, str) and key and "," not in key for key in keys)
    assert len(set(keys)) == len(keys)
    assert mf.MoELayer(4, 2, 32, 64).quant.table_key is None  # unquantized: the dtype's own table
    assert shape_key(8, 2, 4096, 14336, "bf16", "mxfp4") == "E=8,k=2,H=4096,I=14336,bf16,mxfp4"
    assert shape_key(8, 2, 4096, 14336, "bf16") == "E=8,k=2,H=4096,I=14336,bf16"


def test_a_format_table_wins_and_is_used_as_tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = {"1": SMALL, "4096": ENTRY}
    _device_file(tmp_path, monkeypatch, "Test GPU", {shape_key(8, 2, 256, 128, "bf16"): plain,
                                                      shape_key(8, 2, 256, 128, "bf16", "fp8-block-group"): plain})
    steps = ((32.0, 64), (256.0, 128))
    tuned = ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16", max_block_m=64, dequant_blocks=steps,
                             weight_format="fp8-block-group")
    assert tuned.weight_format == "fp8-block-group"
    assert tuned.lookup(4096) == MoEConfig(GemmConfig(**ENTRY["gate_up"]),
                                           GemmConfig(**ENTRY["down"]))  # no cap to 64, tiles as tuned
    assert tuned.lookup(1).down == GemmConfig(**SMALL["down"])
    # another format (or none) falls back to the dtype's table, capped, with the alignment rule
    for other in ("mxfp4", None):
        fallback = ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16", max_block_m=64, weight_format=other)
        assert fallback.weight_format is None and fallback.lookup(4096).block_m == 64
        assert fallback.lookup(4096).down.block_n == 128  # the table's tiles, capped rows
        assert fallback.alignment() != tuned.alignment()
        stepped = ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16", dequant_blocks=steps, weight_format=other)
        assert stepped.lookup(1024).block_m == 128 and stepped.lookup(128).block_m == 64  # 256 / 32 rows per expert
    # no table for the shape: the defaults
    assert ConfigTable.load("Test GPU", 8, 2, 512, 128, "bf16", weight_format="fp8-block-group").tokens == ()
    assert ConfigTable.load("Other GPU", 8, 2, 256, 128, "bf16", weight_format="fp8-block-group").tokens == ()


def test_a_tables_dict_gives_what_the_device_file_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_tables`` is ``load`` on a file's contents (``benchmarks/ab_tables.py`` compares two files with it)."""
    tables = {shape_key(8, 2, 256, 128, "bf16"): {"1": SMALL, "4096": ENTRY},
              shape_key(8, 2, 256, 128, "bf16", "mxfp4"): {"1": ENTRY, "4096": SMALL}}
    _device_file(tmp_path, monkeypatch, "Test GPU", tables)
    assert device_tables("Test GPU") == tables and device_tables("Other GPU") == {} and device_tables(None) == {}
    steps = ((32.0, 64),)
    for hidden, fmt in ((256, "mxfp4"), (256, "nvfp4"), (256, None), (512, "mxfp4")):
        loaded = ConfigTable.load("Test GPU", 8, 2, hidden, 128, "bf16", 64, steps, fmt)
        assert ConfigTable.from_tables(tables, 8, 2, hidden, 128, "bf16", 64, steps, fmt) == loaded
        assert ConfigTable.from_tables({}, 8, 2, hidden, 128, "bf16", 64, steps, fmt) == \
            ConfigTable.load("Other GPU", 8, 2, hidden, 128, "bf16", 64, steps, fmt)
    assert ConfigTable.from_tables(tables, 8, 2, 256, 128, "bf16", weight_format="mxfp4").lookup(1).gate_up == \
        GemmConfig(**ENTRY["gate_up"])
    assert ConfigTable.from_tables(tables, 8, 2, 512, 128, "bf16").tokens == ()


def _fp8_gemm(table: ConfigTable, role: mf.GemmRole) -> FusedQuantGroupedGemm:
    weight = torch.randn(4, 256, 128).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2, 1) + 0.5
    return FusedQuantGroupedGemm(role, WeightFormat.FP8, weight, scale, table, out_dtype=DType.BF16)


@pytest.mark.parametrize("role", [mf.GemmRole.GATE_UP, mf.GemmRole.DOWN])
def test_quantized_gemms_take_a_format_tables_tiles(role: mf.GemmRole) -> None:
    gate_up, down = GemmConfig(64, 32, 128, group_m=4, num_warps=8, num_stages=5), GemmConfig(64, 256, 128)
    ids = torch.zeros(64, dtype=torch.int32)
    alignment = BlockAlignment(ids, ids[:1], ids[:1], MoEConfig(gate_up, down), copies_per_row=2, num_tokens=3)
    want = gate_up if role is mf.GemmRole.GATE_UP else down
    tuned = ConfigTable(4, 2, tokens=(3,), configs=(MoEConfig(gate_up, down),), weight_format="fp8-block-channel")
    assert _fp8_gemm(tuned, role).gemm_config(alignment) == want
    # a table that was not tuned for the format: the format's rules on the table's block_m
    plain = attrs.evolve(tuned, weight_format=None)
    assert _fp8_gemm(plain, role).gemm_config(alignment) == default_quant_config(WeightFormat.FP8, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", [lambda: mf.Mxfp4Method(), lambda: mf.W4A16Method(group_size=64),
                                  lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")],
                         ids=["mxfp4", "w4a16", "fp8"])
def test_a_layer_reading_a_format_table_equals_its_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             make: Any) -> None:
    experts, top_k, hidden, inter = 8, 2, 256, 128
    method = make()
    tolerance = 6e-2 if method.table_key.startswith("fp8") else 2e-2  # as tests/test_quant_methods_gpu.py
    wide = {"gate_up": dict(block_m=256, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
            "down": dict(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3), "us": 1.0}
    if method.table_key.startswith("fp8"):
        wide = {"gate_up": dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3),
                "down": dict(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3), "us": 1.0}
    _device_file(tmp_path, monkeypatch, torch.cuda.get_device_name(),
                 {shape_key(experts, top_k, hidden, inter, "bf16", method.table_key): {"1": SMALL, "1024": wide}})
    torch.manual_seed(0)
    layer = mf.MoELayer(experts, top_k, hidden, inter, quant=method, dtype=torch.bfloat16, device="cuda",
                        backend="triton", environ={})
    tables = {stage.configs for stage in layer.pipeline.stages if hasattr(stage, "configs")}
    assert len(tables) == 1 and next(iter(tables)).weight_format == method.table_key
    reference = mf.MoELayer(experts, top_k, hidden, inter, quant=make(), dtype=torch.bfloat16, device="cuda",
                            backend="torch", environ={})
    reference.load_state_dict(layer.state_dict())
    for tokens in (1, 7, 1024, 0):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got, want = layer(x), reference(x)
        assert torch.isfinite(got).all()
        error = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))
        assert error < tolerance, (tokens, error)


def test_every_committed_table_loads_and_names_a_known_format() -> None:
    """Each entry of the committed device files is a valid pair of configurations (one GEMM's ``block_m``
    divides the other's), under a key ``E=..,k=..,H=..,I=..,<dtype>[,<format>]`` whose format a built-in
    method names."""
    formats = {method.table_key for method in _methods()}
    files = sorted((Path(mf.__file__).parent / "kernels" / "configs").glob("*.json"))
    assert {f.name for f in files} >= {"nvidia_h100_80gb_hbm3.json", "nvidia_h200.json"}
    for path in files:
        for key, entries in json.loads(path.read_text()).items():
            parts = key.split(",")
            assert [p.split("=")[0] for p in parts[:4]] == ["E", "k", "H", "I"], key
            assert parts[4] in ("bf16", "fp16", "fp32") and len(parts) <= 6, key
            if len(parts) == 6:
                assert parts[5] in formats, key
            experts, top_k = int(parts[0][2:]), int(parts[1][2:])
            table = ConfigTable.from_json(experts, top_k, entries)  # raises unless one block_m divides the other
            assert table.tokens == tuple(sorted(int(m) for m in entries)), key
            for config in table.configs:
                for gemm in (config.gate_up, config.down):
                    assert gemm.block_m in (16, 32, 64, 128, 256) and gemm.num_warps in (4, 8), (key, gemm)
                    assert gemm.block_k % 16 == 0 and gemm.block_n % 16 == 0, (key, gemm)


def test_the_tuners_search_space_fits_each_format() -> None:
    """``benchmarks/tune_moe.py``: every format has candidates in every regime, FP8 steps are 128 deep
    (one scale group each), 4-bit steps at least 64 (whole scale groups), and a regime's ``block_m``
    values serve both GEMMs (they must share it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_moe

    shuffled = {"mxfp4-shuffled", "nvfp4-shuffled"}
    assert set(tune_moe.FORMATS) == {"bf16", "fp8", "fp8-channel", "int8", "w4a16", "mxfp4", "nvfp4", *shuffled}
    for fmt in tune_moe.FORMATS:
        for rows_per_expert in (0.03, 1.0, 4.0, 5.0, 48.0, 100.0, 256.0, 1000.0):
            found = list(tune_moe.candidates(fmt, rows_per_expert))
            assert found and len(set(found)) == len(found), (fmt, rows_per_expert)
            for config in found:
                if fmt in ("fp8", "fp8-channel", "int8"):
                    assert config.block_k == 128
                if fmt in ("w4a16", "mxfp4", "nvfp4", *shuffled):
                    assert config.block_k >= 64
                assert config.block_m <= 32 or rows_per_expert > 4  # decode: no padding-only blocks
                if fmt in shuffled:  # swapped tiles only, whole shuffled blocks of 64 or 128 weight rows
                    assert config.swap and config.block_n in (64, 128)
                    continue
                # both orientations of the 4-bit product from 64-row blocks, none below or for other formats
                assert not config.swap or (fmt in ("w4a16", "mxfp4", "nvfp4") and config.block_m >= 64)
            if fmt in ("w4a16", "mxfp4", "nvfp4") and rows_per_expert > 48:
                assert {c.swap for c in found} == {False, True}


def test_a_table_entry_may_choose_tma_and_the_choice_survives_the_custom_op(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune_moe.py --tma`` writes ``"tma"`` into an entry; entries without it leave the choice to the
    launcher's rule (None). The custom op carries the configuration as integers: the choice survives."""
    chosen = {"gate_up": dict(SMALL["gate_up"], tma=True), "down": dict(SMALL["down"], tma=False), "us": 1.0}
    _device_file(tmp_path, monkeypatch, "Test GPU", {shape_key(8, 2, 256, 128, "bf16", "mxfp4"): {"1": chosen},
                                                      shape_key(8, 2, 256, 128, "bf16"): {"1": SMALL}})
    tuned = ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16", weight_format="mxfp4").lookup(1)
    assert tuned.gate_up.tma is True and tuned.down.tma is False
    assert ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16").lookup(1).gate_up.tma is None
    for config in (tuned.gate_up, tuned.down, GemmConfig(16, 32, 128)):
        assert decode_config(encode_config(config)) == config


class _LaunchSpy:
    """Stands for ``moe_gemm_kernel``: records the ``SWAP`` flag of each launch instead of running it."""

    def __init__(self) -> None:
        self.swaps: list[bool] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **flags: Any) -> None:
            self.swaps.append(flags["SWAP"])
        return launch


def test_a_table_entry_may_choose_swap_and_the_launch_follows_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``"swap": true`` in a 4-bit entry (``tune_moe.py`` times both orientations from 64-row blocks) reaches
    the kernel through the table, the custom op's integers and the launcher; an entry without it launches
    ``rows @ W^T``; the ``swap`` argument overrides the entry; non-4-bit weights are never swapped; the
    batch-invariant family never swaps (one orientation for every token count)."""
    from moeforge.batch_invariant import family_member, in_family
    from moeforge.kernels import moe_gemm as kernels
    from moeforge.kernels.formats import WeightFormat

    chosen = {"gate_up": dict(ENTRY["gate_up"], swap=True), "down": ENTRY["down"], "us": 1.0}
    _device_file(tmp_path, monkeypatch, "Test GPU", {shape_key(8, 2, 256, 128, "bf16", "mxfp4"): {"4096": chosen}})
    tuned = ConfigTable.load("Test GPU", 8, 2, 256, 128, "bf16", weight_format="mxfp4").lookup(4096)
    assert tuned.gate_up.swap is True and tuned.down.swap is False
    for config in (tuned.gate_up, tuned.down):
        assert decode_config(encode_config(config)) == config

    spy = _LaunchSpy()
    monkeypatch.setattr(kernels, "moe_gemm_kernel", spy)
    # two rows, one per expert, in 16-row blocks (padding slots hold the copy count, 2): no Triton launch
    # but the spied one, so the test runs on the CPU of a machine with a GPU as well
    plan = (torch.tensor([0] + [2] * 15 + [1] + [2] * 15, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([32], dtype=torch.int32))
    rows = torch.randn(2, 64, dtype=torch.float16)
    packed = dict(weight=torch.zeros(2, 32, 32, dtype=torch.uint8), weight_format=WeightFormat.MXFP4,
                  weight_scale=torch.full((2, 32, 2), 127, dtype=torch.uint8))
    plain = dict(weight=torch.zeros(2, 32, 64, dtype=torch.float16))
    for weights, config_swap, argument, want in [
            (packed, True, None, True), (packed, False, None, False), (packed, True, False, False),
            (packed, False, True, True), (plain, True, None, False)]:
        config = GemmConfig(16, 32, 64, group_m=1, swap=config_swap)
        kernels.moe_gemm(rows, out=torch.empty(2, 32, dtype=torch.float16), sorted_ids=plan[0],
                         block_expert=plan[1], num_padded=plan[2], rows_per_a=1, config=config, swap=argument,
                         **weights)
        assert spy.swaps.pop() is want, (config_swap, argument)

    member = family_member(attrs.evolve(tuned.gate_up, block_m=128), 2, 2)
    assert member.swap is False and in_family(member)
    assert not in_family(attrs.evolve(member, swap=True))


def test_the_tuner_names_a_new_table_as_the_layer_will_look_it_up() -> None:
    """``tune_moe.table_key`` (checked before tuning: a new table must cover every default token count)
    is the key the tuner writes and the layer reads."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_moe

    shape = (4, 2, 128, 256)
    for fmt in tune_moe.FORMATS:
        quant = tune_moe.QUANT_METHODS[fmt](128, 256) if fmt != "bf16" else None
        layer = mf.MoELayer(*shape, quant=quant, backend="torch")
        want = shape_key(*shape, "bf16", layer.quant.table_key if quant is not None else None)
        assert tune_moe.table_key(shape, fmt) == want


def test_the_tuner_refuses_to_create_a_table_from_a_few_token_counts() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_moe

    key = tune_moe.table_key(tune_moe.shape_of("qwen3"), "mxfp4")
    assert tune_moe.partial_new_tables({}, ["qwen3"], ["mxfp4"], [1, 8]) == [key]
    assert tune_moe.partial_new_tables({key: {}}, ["qwen3"], ["mxfp4"], [1, 8]) == []  # refining a table: fine
    assert tune_moe.partial_new_tables({}, ["qwen3"], ["mxfp4"], list(tune_moe.TOKENS)) == []


def test_the_benchmark_scripts_skip_a_format_the_shape_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    """FP8 per-128-group activations need a hidden size that 128 divides: GPT-OSS's 2880 is not (the tuner said
    so in a traceback from its compiling processes before it checked; ``bench_moe.py --quant fp8`` on every shape,
    the README's command, stopped at GPT-OSS). The scripts skip it with this reason (``held_formats``)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe

    problem = bench_moe.format_problem(bench_moe.SHAPES["gptoss"], "fp8")
    assert problem is not None and "divisible by 128" in problem
    assert bench_moe.format_problem(bench_moe.SHAPES["gptoss"], "fp8-channel") is None
    assert bench_moe.format_problem(bench_moe.SHAPES["gptoss"], "mxfp4-shuffled") is None
    assert bench_moe.format_problem(bench_moe.SHAPES["qwen3"], "bf16") is None
    assert list(bench_moe.held_formats("gptoss", ["fp8", "bf16", "mxfp4-shuffled"])) == ["bf16", "mxfp4-shuffled"]
    assert "gptoss fp8: skipped, " in capsys.readouterr().out


def test_the_benchmarks_name_what_decides_a_launch() -> None:
    """A quantized format without a table of its own runs its rules on the entry's ``block_m``, not the entry's
    tiles: ``launch_entry`` says so instead of printing tiles that do not run (an H100 table entry copied from such a
    printout ran 1.36-1.47x slower than the rules it was meant to write down)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe

    entry = MoEConfig(GemmConfig(**ENTRY["gate_up"]), GemmConfig(**ENTRY["down"]))
    plain = ConfigTable(8, 2, tokens=(4096,), configs=(entry,))
    assert bench_moe.launch_entry(plain, "bf16", 4096) == str(entry)
    assert bench_moe.launch_entry(plain, "mxfp4-shuffled", 4096) == \
        "no mxfp4-shuffled table: the format's rules on block_m 128"
    tuned = attrs.evolve(plain, weight_format="mxfp4-shuffled")
    assert bench_moe.launch_entry(tuned, "mxfp4-shuffled", 4096) == str(entry)
    assert bench_moe.launch_entry(ConfigTable(8, 2), "w4a16", 1).startswith("no table: default rules")


def test_every_committed_float_entry_and_fallback_fits_shared_memory_forward_and_backward() -> None:
    # The backward runs each GEMM's tile again with fp32 outputs (the recomputed pre-activation, the input
    # gradient): the flattened grid stages that output tile beside the operand ring, which a 128x256 tile at
    # 4 stages could not hold on an H100 (327712 bytes asked, the training crash). Walk every entry: the
    # operand ring fits the budget after fitting, and only 2-byte outputs take the flattened grid, the one
    # measured to fit beside a 4-stage bf16 ring (229408 bytes of 232448; tests/test_launch_fit_gpu.py
    # launches them all on a Hopper GPU).
    from moeforge.kernels import launch_plan
    from moeforge.kernels.config import SHARED_MEMORY_BUDGET
    from moeforge.kernels.formats import WeightFormat

    from moeforge.kernels.config import _DEFAULTS  # the fallbacks of an untuned shape: launched the same way

    entries: list[tuple[object, float, MoEConfig]] = [
        (("default", bound), min(bound, 1e6), config) for bound, config in _DEFAULTS]
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        for key, table in device_tables(name).items():
            if not key.endswith(",bf16"):
                continue
            fields = dict(part.split("=") for part in key.split(",") if "=" in part)
            for tokens, entry in table.items():
                entries.append(((name, key, tokens), int(tokens) * int(fields["k"]) / int(fields["E"]),
                                MoEConfig(GemmConfig(**entry["gate_up"]), GemmConfig(**entry["down"]))))
    walked = 0
    for where, rows_per_expert, moe_config in entries:
        for gemm in ("gate_up", "down"):
            for glu, out_bytes in ((gemm == "gate_up", 2), (False, 4)):
                config = launch_plan.fit_config(getattr(moe_config, gemm), 2, packed=False, per_k_scales=False,
                                                glu=glu)
                ring = (config.block_m + (2 if glu else 1) * config.block_n) * config.block_k * 2
                assert ring * config.num_stages <= SHARED_MEMORY_BUDGET, (where, gemm)
                grid = launch_plan.default_grid((9, 0), WeightFormat.FLOAT, config, glu, rows_per_expert, out_bytes)
                assert grid != "flattened" or (out_bytes == 2 and ring * config.num_stages <= 4 * 49152), \
                    (where, gemm, config)
                walked += 1
    assert walked > 100


def test_every_committed_warp_specialized_entry_is_a_tile_the_gluon_kernel_takes() -> None:
    # (tests/test_launch_fit_gpu.py launches each of them on a Hopper GPU)
    pytest.importorskip("triton")
    from moeforge.kernels import gluon_grouped_gemm

    marked = 0
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        for key, entries in device_tables(name).items():
            for tokens, entry in entries.items():
                for gemm in ("gate_up", "down"):
                    config = GemmConfig(**entry[gemm])
                    if config.warp_specialized:
                        assert key.endswith((",bf16", ",fp16")), (name, key, tokens, gemm)  # float weights only
                        assert gluon_grouped_gemm.tile_problem(config, glu=gemm == "gate_up") is None, \
                            (name, key, tokens, gemm)
                        marked += 1
    assert marked >= 10  # (the H200 table's SwiGLU gate/up entries of 128 x 128 x 64 tiles)
