"""Int4 layouts: moeforge's uint8 packing, the int32 checkpoint packings, and the GPTQ / AWQ converters.

The converters are checked against packers and unpackers written here as plain bit loops over Python
ints (independent of the library's vectorised code), and against words computed by hand from the
formats' documentation."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.errors import CheckpointError, InputError
from moeforge.quant.int4_packing import (
    AWQ_PACK_ORDER,
    CheckpointFormat,
    Int4Weight,
    awq_to_int4,
    dequantize_int4,
    gptq_to_int4,
    int4_to_awq,
    int4_to_gptq,
    pack_int4,
    pack_int32,
    unpack_int4,
    unpack_int32,
)

FAST = settings(max_examples=25, deadline=None)


# -- independent bit loops -------------------------------------------------------------------------------


def _word(nibbles: list[int]) -> int:
    """Eight 4-bit values -> the int32 whose nibble i (bits 4i..4i+3) is nibbles[i]."""
    word = 0
    for i, value in enumerate(nibbles):
        assert 0 <= value <= 15
        word |= value << (4 * i)
    return word - (1 << 32) if word >= 1 << 31 else word


def _nibbles(word: int) -> list[int]:
    word &= 0xFFFFFFFF
    return [(word >> (4 * i)) & 0xF for i in range(8)]


def loop_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, v1: bool) -> dict[str, torch.Tensor]:
    """q [N, K], zeros [N, K // G] (real zero points), scales [N, K // G] -> GPTQ tensors."""
    n, k = q.shape
    groups = scales.shape[1]
    qweight = [[_word([int(q[c, 8 * r + j]) for j in range(8)]) for c in range(n)] for r in range(k // 8)]
    stored = zeros.long() - (1 if v1 else 0)
    qzeros = [[_word([int(stored[8 * c + j, g]) for j in range(8)]) for c in range(n // 8)] for g in range(groups)]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": scales.t().half().contiguous()}


def loop_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing: along N, nibble i of a word holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    n, k = q.shape
    qweight = [[_word([int(q[8 * c + order[i], row]) for i in range(8)]) for c in range(n // 8)] for row in range(k)]
    qzeros = [[_word([int(zeros[8 * c + order[i], g]) for i in range(8)]) for c in range(n // 8)]
              for g in range(scales.shape[1])]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": scales.t().half().contiguous()}


def loop_unpack_ours(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> [N, K]: byte b holds input 2b (low nibble) and 2b + 1 (high nibble)."""
    n, half = qweight.shape
    out = torch.zeros(n, 2 * half, dtype=torch.int64)
    for row in range(n):
        for b in range(half):
            byte = int(qweight[row, b])
            out[row, 2 * b], out[row, 2 * b + 1] = byte & 0xF, byte >> 4
    return out


def random_int4(n: int, k: int, g: int, seed: int = 0, zero_low: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(zero_low, 16, (n, k // g), generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) + 0.1).half().float()  # exact in fp16
    return q, zeros, scales


# -- moeforge's layout -----------------------------------------------------------------------------------


@FAST
@given(lead=st.lists(st.integers(1, 3), max_size=2), half=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_pack_int4_round_trips_and_matches_the_bit_layout(lead: list[int], half: int, seed: int) -> None:
    values = torch.randint(0, 16, (*lead, 2 * half), generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, half)
    assert torch.equal(unpack_int4(packed).long(), values)
    if not values.numel():
        return
    flat_values, flat_packed = values.reshape(-1, 2 * half), packed.reshape(-1, half)
    for row in range(flat_values.shape[0]):
        for b in range(half):
            assert int(flat_packed[row, b]) == int(flat_values[row, 2 * b]) | (int(flat_values[row, 2 * b + 1]) << 4)


def test_pack_int4_by_hand() -> None:
    assert pack_int4(torch.tensor([1, 2, 15, 0, 0, 15])).tolist() == [0x21, 0x0F, 0xF0]


@pytest.mark.parametrize("values, match", [
    (torch.tensor([1, 2, 3]), "even"),
    (torch.tensor([1, 16]), "0..15"),
    (torch.tensor([-1, 2]), "0..15"),
    (torch.tensor([1.0, 2.0]), "integer"),
])
def test_pack_int4_rejects_bad_values(values: torch.Tensor, match: str) -> None:
    with pytest.raises(InputError, match=match):
        pack_int4(values)


def test_unpack_int4_needs_bytes() -> None:
    with pytest.raises(InputError, match="uint8"):
        unpack_int4(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantize_int4_matches_a_loop(symmetric: bool) -> None:
    q, zeros, scales = random_int4(8, 64, 32, seed=1, zero_low=0)
    weight = Int4Weight(pack_int4(q), scales.bfloat16(), None if symmetric else zeros.to(torch.uint8))
    out = weight.dequantize()
    assert weight.group_size == 32 and weight.in_features == 64 and weight.out_features == 8
    for n in range(8):
        for k in range(64):
            z = 8 if symmetric else int(zeros[n, k // 32])
            assert float(out[n, k]) == (int(q[n, k]) - z) * float(scales.bfloat16()[n, k // 32])


def test_int4_weight_rejects_inconsistent_tensors() -> None:
    q = pack_int4(torch.zeros(4, 64, dtype=torch.long))
    with pytest.raises(InputError, match="scales"):
        Int4Weight(q, torch.ones(4, 3))  # 3 groups do not divide 64 inputs
    with pytest.raises(InputError, match="qzeros"):
        Int4Weight(q, torch.ones(4, 2), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(InputError, match="qweight"):
        Int4Weight(q.int(), torch.ones(4, 2))
    with pytest.raises(InputError, match="groups"):
        dequantize_int4(q, torch.ones(4, 3))


# -- int32 packing -----------------------------------------------------------------------------------------


def test_int32_words_by_hand() -> None:
    # GPTQ: element j at bits 4j, so [1..8] reads 0x87654321 (bit 31 set: negative as int32).
    assert pack_int32(torch.arange(1, 9).reshape(8, 1), dim=0).item() == 0x87654321 - (1 << 32)
    # AWQ: nibble i holds element [0, 2, 4, 6, 1, 3, 5, 7][i], so [0..7] reads 0x75316420.
    assert pack_int32(torch.arange(8).reshape(1, 8), dim=1, order=AWQ_PACK_ORDER).item() == 0x75316420
    assert unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), dim=1,
                        order=AWQ_PACK_ORDER).tolist() == [list(range(8))]


@FAST
@given(rows=st.integers(1, 3), words=st.integers(1, 3), dim=st.sampled_from([0, 1]),
       awq=st.booleans(), seed=st.integers(0, 2**16))
def test_int32_packing_round_trips_and_matches_the_loop(rows: int, words: int, dim: int, awq: bool,
                                                        seed: int) -> None:
    order = AWQ_PACK_ORDER if awq else tuple(range(8))
    shape = (8 * words, rows) if dim == 0 else (rows, 8 * words)
    values = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed))
    packed = pack_int32(values, dim=dim, order=order)
    assert packed.dtype == torch.int32
    assert packed.shape == ((words, rows) if dim == 0 else (rows, words))
    assert torch.equal(unpack_int32(packed, dim=dim, order=order).long(), values)
    along = values if dim == 1 else values.t()
    packed_along = packed if dim == 1 else packed.t()
    for r in range(rows):
        for w in range(words):
            assert int(packed_along[r, w]) == _word([int(along[r, 8 * w + order[i]]) for i in range(8)])


def test_int32_packing_rejects_bad_input() -> None:
    with pytest.raises(InputError, match="divisible by 8"):
        pack_int32(torch.zeros(7, 2, dtype=torch.long), dim=0)
    with pytest.raises(InputError, match="0..15"):
        pack_int32(torch.full((8, 1), 16), dim=0)
    with pytest.raises(InputError, match="permutation"):
        pack_int32(torch.zeros(8, 1, dtype=torch.long), dim=0, order=(0, 0, 1, 2, 3, 4, 5, 6))
    with pytest.raises(InputError, match="int32"):
        unpack_int32(torch.zeros(1, 1, dtype=torch.int64), dim=0)


# -- GPTQ ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_conversion_matches_the_bit_loops(v1: bool, group_size: int) -> None:
    n, k = 16, 128
    q, zeros, scales = random_int4(n, k, group_size, seed=group_size + v1, zero_low=1 if v1 else 0)
    ckpt = loop_gptq(q, zeros, scales, v1)
    g_idx = (torch.arange(k) // group_size).int()
    weight = gptq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx, out_features=n,
                          in_features=k, group_size=group_size, v1_zeros=v1, dtype=torch.bfloat16)
    assert weight.qweight.shape == (n, k // 2) and weight.qweight.dtype == torch.uint8
    assert torch.equal(loop_unpack_ours(weight.qweight), q)
    assert weight.qzeros is not None and torch.equal(weight.qzeros.long(), zeros)
    assert weight.scales.dtype == torch.bfloat16 and torch.equal(weight.scales, scales.bfloat16())
    # the inverse packer writes the same bits as the loop
    back = int4_to_gptq(Int4Weight(weight.qweight, scales, weight.qzeros), v1_zeros=v1)
    for name in ("qweight", "qzeros", "scales"):
        assert torch.equal(back[name], ckpt[name]), name
    assert torch.equal(back["g_idx"], g_idx)


def test_gptq_symmetric_checkpoint_has_zero_8() -> None:
    n, k, g = 8, 64, 32
    q, _, scales = random_int4(n, k, g, seed=3)
    eights = torch.full((n, k // g), 8)
    ckpt = loop_gptq(q, eights, scales, v1=True)
    assert set(_nibbles(int(ckpt["qzeros"][0, 0]))) == {7}  # v1 stores 8 - 1
    weight = gptq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], out_features=n, in_features=k,
                          group_size=g)
    assert weight.qzeros is not None and bool((weight.qzeros == 8).all())
    symmetric = gptq_to_int4(ckpt["qweight"], None, ckpt["scales"], out_features=n, in_features=k, group_size=g)
    assert symmetric.qzeros is None
    torch.testing.assert_close(symmetric.dequantize(), weight.dequantize(), rtol=0, atol=0)
    assert torch.equal(int4_to_gptq(symmetric)["qzeros"], ckpt["qzeros"])


def test_gptq_v1_zero_16_is_refused() -> None:
    n, k, g = 8, 32, 32
    q, zeros, scales = random_int4(n, k, g)
    ckpt = loop_gptq(q, zeros, scales, v1=False)
    ckpt["qzeros"][0, 0] = _word([15] + [7] * 7)  # read as v1: a zero point of 16
    with pytest.raises(CheckpointError, match=r"'experts\.0\.gate_proj\.qzeros'.*16"):
        gptq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], out_features=n, in_features=k,
                     group_size=g, where="experts.0.gate_proj.")
    with pytest.raises(InputError, match="zero point of 0"):
        int4_to_gptq(Int4Weight(pack_int4(q), scales, torch.zeros(n, 1, dtype=torch.uint8)))


def test_gptq_act_order_g_idx_is_refused() -> None:
    n, k, g = 8, 64, 32
    ckpt = loop_gptq(*random_int4(n, k, g), v1=True)
    g_idx = (torch.arange(k) % 2).int()  # desc_act: inputs assigned to groups out of order
    with pytest.raises(CheckpointError, match=r"'p\.g_idx'.*act-order"):
        gptq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx, out_features=n, in_features=k,
                     group_size=g, where="p.")
    with pytest.raises(CheckpointError, match=r"'p\.g_idx'"):
        gptq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx[:-1], out_features=n,
                     in_features=k, group_size=g, where="p.")


def test_gptq_shape_errors_name_the_tensor_and_guess_the_cause() -> None:
    n, k, g = 16, 64, 32
    q, zeros, scales = random_int4(n, k, g)
    gptq, awq = loop_gptq(q, zeros, scales, v1=True), loop_awq(q, zeros, scales)

    def convert(qweight: torch.Tensor, qzeros: Optional[torch.Tensor], s: torch.Tensor, group: int = g) -> None:
        gptq_to_int4(qweight, qzeros, s, out_features=n, in_features=k, group_size=group, where="x.")

    with pytest.raises(CheckpointError, match=r"'x\.qweight'.*\(64, 2\).*checkpoint_format='awq'"):
        convert(awq["qweight"], awq["qzeros"], awq["scales"])
    with pytest.raises(CheckpointError, match=r"'x\.scales'.*group size looks like 32, not 64"):
        convert(gptq["qweight"], gptq["qzeros"], gptq["scales"], group=64)
    with pytest.raises(CheckpointError, match=r"'x\.qweight'.*int32"):
        convert(gptq["qweight"].long(), gptq["qzeros"], gptq["scales"])
    with pytest.raises(CheckpointError, match=r"'x\.scales'.*float"):
        convert(gptq["qweight"], gptq["qzeros"], gptq["scales"].int())
    with pytest.raises(CheckpointError, match=r"'x\.qzeros'"):
        convert(gptq["qweight"], gptq["qzeros"][:, :1], gptq["scales"])


# -- AWQ ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_conversion_matches_the_bit_loops(group_size: int) -> None:
    n, k = 24, 128
    q, zeros, scales = random_int4(n, k, group_size, seed=group_size, zero_low=0)
    ckpt = loop_awq(q, zeros, scales)
    weight = awq_to_int4(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], out_features=n, in_features=k,
                         group_size=group_size, dtype=torch.float32)
    assert torch.equal(loop_unpack_ours(weight.qweight), q)
    assert weight.qzeros is not None and torch.equal(weight.qzeros.long(), zeros)
    assert torch.equal(weight.scales, scales)
    back = int4_to_awq(weight)
    for name in ("qweight", "qzeros", "scales"):
        assert torch.equal(back[name], ckpt[name]), name


def test_awq_is_not_read_in_natural_order() -> None:
    """Reading AWQ words in GPTQ's natural nibble order would permute the outputs of each run of 8."""
    n, k, g = 8, 32, 32
    q, zeros, scales = random_int4(n, k, g, seed=5)
    ckpt = loop_awq(q, zeros, scales)
    natural = unpack_int32(ckpt["qweight"], dim=1).t().long()
    assert torch.equal(natural, q[[0, 2, 4, 6, 1, 3, 5, 7]])  # nibble i holds output order[i]
    assert not torch.equal(natural, q)


def test_awq_shape_error_suggests_gptq() -> None:
    n, k, g = 16, 64, 32
    gptq = loop_gptq(*random_int4(n, k, g), v1=True)
    with pytest.raises(CheckpointError, match=r"'y\.qweight'.*checkpoint_format='gptq'"):
        awq_to_int4(gptq["qweight"], gptq["qzeros"], gptq["scales"], out_features=n, in_features=k,
                    group_size=g, where="y.")


@FAST
@given(words_n=st.integers(1, 2), groups=st.integers(1, 2), group_size=st.sampled_from([32, 64]),
       symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_checkpoint_round_trips(words_n: int, groups: int, group_size: int, symmetric: bool, seed: int) -> None:
    n, k = 8 * words_n, groups * group_size
    q, zeros, scales = random_int4(n, k, group_size, seed=seed)
    weight = Int4Weight(pack_int4(q), scales.half(), None if symmetric else zeros.to(torch.uint8))
    for fmt in CheckpointFormat:
        if fmt is CheckpointFormat.AWQ:
            ckpt = int4_to_awq(weight)
            back = awq_to_int4(ckpt["qweight"], None if symmetric else ckpt["qzeros"], ckpt["scales"],
                               out_features=n, in_features=k, group_size=group_size)
        else:
            v1 = fmt is CheckpointFormat.GPTQ
            ckpt = int4_to_gptq(weight, v1_zeros=v1)
            back = gptq_to_int4(ckpt["qweight"], None if symmetric else ckpt["qzeros"], ckpt["scales"],
                                ckpt["g_idx"], out_features=n, in_features=k, group_size=group_size, v1_zeros=v1)
        assert torch.equal(back.qweight, weight.qweight) and torch.equal(back.scales, weight.scales)
        assert (back.qzeros is None) == symmetric
        if back.qzeros is not None and weight.qzeros is not None:
            assert torch.equal(back.qzeros, weight.qzeros)


def test_checkpoint_format_parse() -> None:
    assert CheckpointFormat.parse("GPTQ") is CheckpointFormat.GPTQ
    assert CheckpointFormat.parse("gptq_v2") is CheckpointFormat.GPTQ_V2
    assert CheckpointFormat.parse(CheckpointFormat.AWQ) is CheckpointFormat.AWQ
    with pytest.raises(InputError, match="checkpoint_format"):
        CheckpointFormat.parse("exl2")
