"""``benchmarks/read_bandwidth.py``: the streaming-read probe of the roofline reads every word (its XOR per
program and lane is numpy's), and refuses a size it would not cover."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from read_bandwidth import xor_read  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("programs, block, unroll", [(1, 16, 1), (4, 32, 1), (3, 64, 2), (2, 16, 4)])
def test_xor_read_reads_every_word(programs: int, block: int, unroll: int) -> None:
    words = torch.randint(-2**31, 2**31 - 1, (programs * block * unroll * 3,), dtype=torch.int32, device=DEVICE)
    got = xor_read(words, programs, block, warps=1, unroll=unroll).cpu().numpy()
    want = np.bitwise_xor.reduce(words.cpu().numpy().reshape(programs, 3 * unroll, block), axis=1)
    assert np.array_equal(got, want)


def test_xor_read_refuses_a_size_it_would_not_cover() -> None:
    with pytest.raises(ValueError, match="multiple of 4 x 32 x 1"):
        xor_read(torch.zeros(100, dtype=torch.int32, device=DEVICE), 4, 32)
    with pytest.raises(ValueError, match="int32"):
        xor_read(torch.zeros(128, dtype=torch.int64, device=DEVICE), 4, 32)


def test_the_probe_buffer_is_a_power_of_two_within_half_the_free_memory() -> None:
    from read_bandwidth import GIB, PROBES, probe_bytes

    assert probe_bytes(80 * GIB) == 16 * GIB
    assert probe_bytes(20 * GIB) == 8 * GIB
    assert probe_bytes(1 << 20) == 64 << 20  # the floor (a tiny free size: the probe may still not fit)
    for programs, block, _, unroll in PROBES:
        assert (64 << 20) // 4 % (programs * block * unroll) == 0
