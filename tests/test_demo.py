"""``python -m moeforge``: the demo's options, their errors, ``--version`` and the timing line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import moeforge
from moeforge import demo
from moeforge.__main__ import main
from moeforge.backend import Backend
from moeforge.layer import MoELayer

# On the CPU wherever the tests run (on a GPU machine the demo's default device is the GPU, its backend triton).
TINY = ["demo", "--dtype", "fp32", "--hidden", "32", "--intermediate", "16", "--tokens", "5", "--repeats", "3",
        "--device", "cpu"]


def _exit_status(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert isinstance(exited.value.code, int)
    return exited.value.code


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moeforge {moeforge.__version__} (torch {torch.__version__})"


def test_tiny_demo_runs_and_reports_the_spread(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "check vs dense float64 reference" in out and ": ok" in out
    timing = next(line for line in out.splitlines() if line.startswith("forward time"))
    assert "(5 tokens, torch backend)" in timing
    for part in ("median", "p25-p75", "min", "max", "(3 repeats)"):
        assert part in timing, timing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_demo_on_the_gpu_runs_the_triton_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY[:-2] + ["--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "check vs dense float64 reference" in out and ": ok" in out
    assert "(5 tokens, triton backend)" in out


def test_timing_line_names_the_backend_of_the_built_layer(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Only the torch backend runs on a CPU; pretend the layer chose triton to see that the line reads it.
    def layer(*args: object, **kwargs: object) -> MoELayer:
        made = MoELayer(*args, **kwargs)  # type: ignore[arg-type]
        made.backend = Backend.TRITON
        return made

    monkeypatch.setattr(demo, "MoELayer", layer)
    assert main(TINY) == 0
    assert "(5 tokens, triton backend)" in capsys.readouterr().out


def test_timing_summary() -> None:
    assert demo.timing_summary([5.0, 1.0, 3.0, 2.0, 4.0]) == (
        "median 3.00 ms, p25-p75 2.00-4.00 ms, min 1.00 ms, max 5.00 ms (5 repeats)")
    assert demo.timing_summary([1.5]) == "median 1.50 ms, p25-p75 1.50-1.50 ms, min 1.50 ms, max 1.50 ms (1 repeat)"


BAD_OPTIONS = [
    (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["--tokens", "-3"], "argument --tokens: must be at least 1, got -3"),
    (["--experts", "eight"], "argument --experts: expected a positive integer, got 'eight'"),
    (["--hidden", "0"], "argument --hidden: must be at least 1"),
    (["--top-k", "9"], "argument --top-k: 9 exceeds --experts 8"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--device", "gpu0"], "argument --device: not a device: 'gpu0'"),
    (["--seed", "x"], "argument --seed"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bad_option_exits_2_naming_it(options: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(["demo", *options]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("usage: python -m moeforge demo"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_an_option_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "argument --device:" in err and "use --device cpu" in err, err
    assert _exit_status(["demo", "--backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "--backend triton" in err and "needs a CUDA device" in err, err


def test_every_option_has_help() -> None:
    parser = demo.add_arguments(argparse.ArgumentParser())
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings


def test_command_line_exit_status() -> None:
    """Through ``python -m moeforge`` itself: a bad option is exit status 2 and one clear line."""
    done = subprocess.run([sys.executable, "-m", "moeforge", "demo", "--repeats", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "error: argument --repeats: must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
