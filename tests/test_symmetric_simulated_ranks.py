"""The symmetric exchange's kernels over simulated ranks: sending each token's row once per owning rank (``put_rows``
with ``recv_tokens``, then ``fan_out`` on the owner) fills the expert buffers with the bits the one-row-per-copy
exchange writes there; summing each token's copies on their owner (``sum_on_owner``, then ``sum_partials`` on the
source) gives the combine of the rows returned one per copy (``return_rows``, then the source's sum), in another
order of the same fp32 additions.

The ranks are simulated in one process: every rank's window is a slice of one int32 allocation, and a rank reaches
rank ``r``'s at the distance between the slices, as over symmetric memory (Triton's interpreter on the CPU, the
compiled kernels on a GPU)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.distributed.symmetric_window import regions, words_needed
from moeforge.kernels import symmetric_rows as kernels


def _exchange(ids: list[torch.Tensor], rows: list[torch.Tensor], scales: list[Optional[torch.Tensor]],
              weights: list[torch.Tensor], adapters: list[Optional[torch.Tensor]], *, local: int, capacity: int,
              max_tokens: int, compact_rows: Optional[int], once: bool, device: str,
              with_map: bool = False) -> list[dict[str, torch.Tensor]]:
    """Every rank's route, (place,) put_rows — and with ``once`` fan_out — on windows carved from one allocation;
    returns each rank's regions and what the kernels returned."""
    world = len(ids)
    experts = world * local
    width = rows[0].shape[1]
    scale_width = scales[0].shape[1] if scales[0] is not None else 0
    top_k = ids[0].shape[1]
    slots = world * capacity
    buffer_rows = compact_rows if compact_rows is not None else local * slots
    sizes = {"table": world * experts, "rows": buffer_rows * width, "scales": buffer_rows * scale_width,
             "weights": buffer_rows, "origins": buffer_rows, "adapters": buffer_rows,
             "tokens": world * max_tokens * width if once else 0,
             "token_scales": world * max_tokens * scale_width if once else 0,
             "slot_map": world * max_tokens * top_k if with_map else 0}
    size = words_needed(sizes)
    memory = torch.full((world * size,), -7, dtype=torch.int32, device=device)  # (stale words: never compared)
    windows = [regions(memory[r * size:(r + 1) * size], sizes, floats=("weights",)) for r in range(world)]
    cap = 2**31 - 1 if compact_rows is not None else capacity
    state: list[dict[str, torch.Tensor]] = []
    for rank in range(world):
        deltas = torch.tensor([(r - rank) * size for r in range(world)], dtype=torch.int64, device=device)
        flat = ids[rank].reshape(-1).to(torch.int32).contiguous()
        positions, kept, dropped = kernels.route(flat, windows[rank]["table"], deltas, rank, cap)
        state.append(dict(deltas=deltas, flat=flat, positions=positions, kept=kept, dropped=dropped))
    for rank in range(world):  # (after the first barrier: every table complete)
        own, st_ = windows[rank], state[rank]
        table = own["table"].view(world, experts)
        offsets = None
        if compact_rows is not None:
            offsets, valid, starts, dropped, _ = kernels.place(table, rank=rank, local=local, rows=buffer_rows)
            st_.update(valid=valid, starts=starts, dropped=dropped)
        kernels.put_rows(
            kernels.words(rows[rank]), kernels.words(scales[rank]) if scales[rank] is not None else None,
            weights[rank].reshape(-1).float().contiguous(), st_["flat"], st_["positions"], table, adapters[rank],
            own["rows"], own["scales"] if scale_width else None, own["weights"], own["origins"],
            own["adapters"] if adapters[rank] is not None else None, st_["deltas"], rank=rank, top_k=top_k,
            local=local, slots=slots, capacity=cap, origin_base=rank * max_tokens * top_k, offsets=offsets,
            limit=buffer_rows, kept=st_["kept"] if compact_rows is not None else None,
            recv_tokens=own["tokens"] if once else None,
            recv_token_scales=own["token_scales"] if once and scale_width else None, max_tokens=max_tokens,
            slot_map=own["slot_map"] if with_map else None)
    for rank in range(world):  # (after the second barrier: every row in place)
        own, st_ = windows[rank], state[rank]
        table = own["table"].view(world, experts)
        if compact_rows is None:
            masked, _, _ = kernels.receive(table, own["weights"], None, rank=rank, local=local,
                                           slots=slots, capacity=cap)
            st_.update(valid=masked, starts=torch.arange(local, device=device) * slots)
        if once:
            kernels.fan_out(own["tokens"].view(-1, width), own["token_scales"].view(-1, scale_width)
                            if scale_width else None, own["rows"].view(-1, width),
                            own["scales"].view(-1, scale_width) if scale_width else None, st_["valid"],
                            own["origins"], slots=slots, top_k=top_k,
                            starts=st_["starts"] if compact_rows is not None else None)
        st_.update({name: region.clone() for name, region in own.items()})
        st_["windows"] = own  # (the live regions, for a combine after it)
    return state


def _valid_rows(state: dict[str, torch.Tensor], local: int) -> torch.Tensor:
    index = [torch.arange(int(s), int(s) + int(v)) for s, v in zip(state["starts"].tolist(), state["valid"].tolist())]
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), world=st.integers(1, 3), local=st.integers(1, 3), top_k=st.integers(1, 4),
       tokens=st.integers(0, 6), compact=st.booleans(), with_scales=st.booleans(), with_adapters=st.booleans())
def test_token_rows_fanned_out_equal_the_rows_sent_per_copy(data: st.DataObject, world: int, local: int, top_k: int,
                                                              tokens: int, compact: bool, with_scales: bool,
                                                              with_adapters: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = world * local
    top_k = min(top_k, experts)
    max_tokens = tokens + data.draw(st.integers(0, 2))
    capacity = data.draw(st.integers(1, max(tokens, 1)))  # (fixed buffers: copies past it drop)
    compact_rows = data.draw(st.integers(1, max(world * tokens * top_k, 1))) if compact else None
    width, scale_width = 6, 2
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    ids, rows, scales, weights, adapters = [], [], [], [], []
    for _ in range(world):
        picks = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]
        ids.append((torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.int64)).to(device))
        rows.append(torch.randint(-2**30, 2**30, (tokens, width), generator=generator, dtype=torch.int32).to(device))
        scales.append(torch.randint(-2**30, 2**30, (tokens, scale_width), generator=generator, dtype=torch.int32)
                      .to(device) if with_scales else None)
        weights.append(torch.rand(tokens, top_k, generator=generator).to(device))
        adapters.append(torch.randint(-1, 3, (tokens,), generator=generator, dtype=torch.int32).to(device)
                        if with_adapters else None)
    kwargs = dict(local=local, capacity=capacity, max_tokens=max_tokens, compact_rows=compact_rows, device=device)
    per_copy = _exchange(ids, rows, scales, weights, adapters, once=False, **kwargs)
    once = _exchange(ids, rows, scales, weights, adapters, once=True, **kwargs)
    for rank in range(world):
        a, b = per_copy[rank], once[rank]
        for name in ("positions", "kept", "dropped", "valid", "starts", "table"):
            assert torch.equal(a[name], b[name]), name
        valid = _valid_rows(a, local).to(device)
        assert valid.numel() == int(a["valid"].sum())
        for name, per_row in (("rows", width), ("scales", scale_width if with_scales else 0), ("weights", 1),
                              ("origins", 1), ("adapters", 1 if with_adapters else 0)):
            if per_row:
                assert torch.equal(a[name].view(-1, per_row)[valid], b[name].view(-1, per_row)[valid]), name
        # and the rows are the tokens' (the per-copy exchange checked against the inputs themselves)
        origins = a["origins"][valid].long()
        source, token = origins // (max_tokens * top_k), origins % (max_tokens * top_k) // top_k
        want = torch.stack([rows[s][t] for s, t in zip(source.tolist(), token.tolist())]) if valid.numel() else None
        if want is not None:
            assert torch.equal(b["rows"].view(-1, width)[valid], want)
            # each slot's routing weight is its copy's, as a float (an int32 region stored into converts it)
            copy = origins % (max_tokens * top_k)
            want_weights = torch.stack([weights[s].reshape(-1)[c] for s, c in zip(source.tolist(), copy.tolist())])
            assert torch.equal(b["weights"][valid], want_weights.float())


def test_token_rows_refuse_rows_per_copy() -> None:
    ids = torch.zeros(4, dtype=torch.int32)
    rows = torch.zeros(4, 2, dtype=torch.int32)  # one row per copy of 2 tokens, top-2
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one row per token"):
        kernels.put_rows(rows, None, torch.zeros(4), ids, ids, table, None, rows, None, ids, ids, None,
                         torch.zeros(1, dtype=torch.int64), rank=0, top_k=2, local=1, slots=4, capacity=4,
                         origin_base=0, recv_tokens=rows, max_tokens=2)


def test_the_default_sends_tokens_once_where_the_rows_saved_pay_for_the_extra_pass() -> None:
    from moeforge.distributed.symmetric import TOKENS_ONCE_MIN_BYTES, rows_saved_bytes

    row = 7168 * 2  # DeepSeek-V3's bf16 rows
    assert rows_saved_bytes(16, 8, 2, row) < TOKENS_ONCE_MIN_BYTES <= rows_saved_bytes(128, 8, 2, row)
    assert rows_saved_bytes(4096, 8, 1, row) == 0  # one rank: no row crosses
    assert rows_saved_bytes(4096, 1, 8, row) == 0  # top-1: one row per token either way
    # 2 ranks, top-8: 4 rows a token cross one by copy, 1 - 2^-8 once
    assert abs(rows_saved_bytes(1000, 8, 2, 1) / 1000 - (4 - (1 - 0.5 ** 8))) < 1e-2


def _combine_both_ways(state: list[dict[str, torch.Tensor]], ids: list[torch.Tensor], weights: list[torch.Tensor],
                       outputs: list[torch.Tensor], *, local: int, slots: int, max_tokens: int, compact: bool,
                       weighted: bool, scaling: float, partial_dtype: torch.dtype = torch.float32
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each source's combined rows, from the owners' ``outputs`` (fp32, one row per buffer row), returned one row
    per copy and summed on the source (``return_rows``, then the combine's sum), and summed on the owners
    (``sum_on_owner``, then ``sum_partials``)."""
    from moeforge.distributed.exchange import combine_on_source

    world, top_k, hidden = len(ids), ids[0].shape[1], outputs[0].shape[1]
    device = outputs[0].device
    copies = max_tokens * top_k
    sizes = {"ret": copies * hidden, "partials": world * max_tokens * hidden * partial_dtype.itemsize // 4}
    size = words_needed(sizes)
    memory = torch.full((world * size,), -7, dtype=torch.int32, device=device)
    windows = [regions(memory[r * size:(r + 1) * size], sizes) for r in range(world)]
    for owner in range(world):
        st_ = state[owner]
        starts = st_["starts"] if compact else None
        deltas = torch.tensor([(r - owner) * size for r in range(world)], dtype=torch.int64, device=device)
        kernels.return_rows(kernels.words(outputs[owner]), st_["valid"], st_["windows"]["origins"],
                            windows[owner]["ret"].view(copies, hidden), deltas, slots=slots,
                            copies_per_rank=copies, starts=starts)
        kernels.sum_on_owner(outputs[owner], st_["windows"]["weights"] if weighted else None,
                             st_["windows"]["slot_map"], st_["valid"], st_["windows"]["origins"],
                             windows[owner]["partials"].view(partial_dtype), deltas, slots=slots,
                             top_k=top_k, max_tokens=max_tokens, rank=owner, starts=starts)
    per_copy, on_owner = [], []
    for source in range(world):
        tokens = ids[source].shape[0]
        kept = state[source]["kept"].view(tokens, top_k)
        returned = windows[source]["ret"].view(torch.float32).view(copies, hidden)
        per_copy.append(combine_on_source(returned, kept, weights[source] if weighted else None, torch.float32,
                                          scaling))
        out = torch.empty(tokens, hidden, device=device)
        on_owner.append(kernels.sum_partials(windows[source]["partials"].view(partial_dtype).view(-1, hidden),
                                             ids[source].to(torch.int32), kept, out, local=local,
                                             max_tokens=max_tokens, world=world, scaling=scaling))
    return per_copy, on_owner


@settings(max_examples=12, deadline=None)
@given(data=st.data(), world=st.integers(1, 3), local=st.integers(1, 3), top_k=st.integers(1, 4),
       tokens=st.integers(0, 6), compact=st.booleans(), weighted=st.booleans(), once=st.booleans(),
       partial_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_copies_summed_on_their_owner_equal_the_copies_returned_one_by_one(
        data: st.DataObject, world: int, local: int, top_k: int, tokens: int, compact: bool, weighted: bool,
        once: bool, partial_dtype: torch.dtype) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = world * local
    top_k = min(top_k, experts)
    max_tokens = tokens + data.draw(st.integers(0, 2))
    capacity = data.draw(st.integers(1, max(tokens, 1)))
    compact_rows = data.draw(st.integers(1, max(world * tokens * top_k, 1))) if compact else None
    hidden = 6
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    ids, rows, weights = [], [], []
    for _ in range(world):
        picks = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]
        ids.append((torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.int64)).to(device))
        rows.append(torch.randint(-9, 9, (tokens, 4), generator=generator, dtype=torch.int32).to(device))
        weights.append(torch.rand(tokens, top_k, generator=generator).to(device))
    state = _exchange(ids, rows, [None] * world, weights, [None] * world, local=local, capacity=capacity,
                      max_tokens=max_tokens, compact_rows=compact_rows, once=once, device=device, with_map=True)
    buffer_rows = compact_rows if compact else local * world * capacity
    outputs = [torch.randn(buffer_rows, hidden, generator=generator).to(device) for _ in range(world)]
    scaling = data.draw(st.sampled_from([1.0, 2.5]))
    per_copy, on_owner = _combine_both_ways(state, ids, weights, outputs, local=local, slots=world * capacity,
                                            max_tokens=max_tokens, compact=compact, weighted=weighted,
                                            scaling=scaling, partial_dtype=partial_dtype)
    tolerance = 1e-5 if partial_dtype == torch.float32 else 3e-2  # (bf16 partials: each rounded once more)
    for source in range(world):
        assert per_copy[source].shape == on_owner[source].shape == (ids[source].shape[0], hidden)
        torch.testing.assert_close(on_owner[source], per_copy[source], rtol=tolerance, atol=tolerance)
        # and the sum itself, in float64 from the copies' owners' rows
        kept = state[source]["kept"].view(-1, top_k)
        want = torch.zeros(ids[source].shape[0], hidden, dtype=torch.float64)
        for t in range(ids[source].shape[0]):
            for j in range(top_k):
                if int(kept[t, j]) < 0:
                    continue
                owner = int(ids[source][t, j]) // local
                origin = source * max_tokens * top_k + t * top_k + j
                slot = int((state[owner]["origins"].long() == origin).nonzero()[0])
                weight = float(weights[source][t, j]) if weighted else 1.0
                want[t] += outputs[owner][slot].double().cpu() * weight
        torch.testing.assert_close(on_owner[source].double().cpu(), want * scaling, rtol=tolerance, atol=tolerance)
