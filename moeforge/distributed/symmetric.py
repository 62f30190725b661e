"""The symmetric-memory expert-parallel dispatcher: rows written straight into the owning GPU's expert buffers.

Within one host, PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) maps each rank's buffer into
every other rank's address space over NVLink. :class:`SymmetricDispatch` uses it in place of NCCL's all-to-all:

* **dispatch**: one kernel gives each copy its position among the rank's copies of its expert and writes the rank's
  copies-per-expert counts into a ``[W, E]`` table on every rank (:func:`~moeforge.kernels.symmetric_rows.route`),
  all ranks meet at a device barrier, then one kernel writes each routed copy's row (scales, routing weight, origin,
  adapter id) into the expert buffer of the rank owning its expert, at the slot the table gives it
  (:func:`~moeforge.kernels.symmetric_rows.put_rows`), and a second barrier — or, at larger batches, each token's
  row once per rank owning some of its copies, which that rank copies into its copies' slots
  (``send_tokens_once``, :func:`~moeforge.kernels.symmetric_rows.fan_out`: the same bits, fewer rows over NVLink);
* **combine**: each rank writes every valid expert-output row back to its source rank, at the slot of the copy it
  came from (:func:`~moeforge.kernels.symmetric_rows.return_rows`), a barrier, and each rank sums its tokens' copies
  in the fixed order ``k = 0 .. top_k - 1`` (deterministic, as every moeforge combine).

Only routed rows cross NVLink (the NCCL low-latency dispatcher sends its whole fixed-capacity buffers), nothing waits
for the host (the counts stay on the device), and every shape is fixed by ``max_tokens`` and ``capacity``, so a step
can be captured in a CUDA graph. The experts read the layout :class:`~moeforge.distributed.LowLatencyDispatch` gives
them (``EXPERT_PADDED``: ``[L, W * capacity, H]``, ``masked_m`` valid rows per expert, source ranks in rank order,
each rank's copies in copy order), with the same ``capacity`` and ``overflow`` rules, so the two compute the same
bits.

Where this transport cannot serve, the dispatcher runs :class:`~moeforge.distributed.LowLatencyDispatch` (NCCL or
gloo) and :meth:`SymmetricDispatch.summary` (``describe()``) says why: rows off the GPU, a process group other than
NCCL, ranks on more than one host, a PyTorch without symmetric memory, no Triton, rows whose bytes are not whole
32-bit words; and a call that records gradients (the NCCL transport carries the backward). The first call on a GPU
allocates the buffers and exchanges their addresses (collective): make it before capturing a graph.

The returned rows are views of this dispatcher's buffers: they stay valid until its next dispatch (each layer has its
own dispatcher, the combine consumes them first). A rank that stops answering makes the others' barrier fail after
``timeout_ms`` (a device error: the process cannot continue).
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, ClassVar, Optional, Union

import attrs
import torch
import torch.distributed as dist

from moeforge.distributed.exchange import ExchangeDispatch, combine_on_source, count_per_expert, scaled_rows
from moeforge.distributed.group import ExpertParallel
from moeforge.distributed.low_latency import LowLatencyDispatch
from moeforge.distributed.symmetric_window import SymmetricWindow, regions, words_needed
from moeforge.errors import InputError
from moeforge.no_backward import records_grad
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, AlignedRows, ExpertRows, PaddedRows, Plan, RoutedTokens
from moeforge.spec import Spec
from moeforge.stage import Stage, StageKind
from moeforge.stages.dispatch import Overflow, overflow_choice

def _word_width(tensor: torch.Tensor) -> Optional[int]:
    """32-bit words per row of ``tensor`` (last dimension), or ``None`` where its bytes are not whole words."""
    row_bytes = tensor.shape[-1] * tensor.element_size()
    return row_bytes // 4 if row_bytes % 4 == 0 else None


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class SymmetricPlan(Plan):
    """The way back from :class:`SymmetricDispatch`'s rows: each valid expert-output row written to its source
    rank's return buffer at its copy's slot, a barrier, and each token's copies summed on its own rank.

    ``token_copies [T, K]``: each copy's slot in the return buffer (its index ``t * K + k``), -1 if dropped;
    ``masked_m [L]`` and ``origins`` (one per buffer row: ``source rank * max copies + copy``) of the rows this rank
    received, ``starts [L]`` each expert's first row in compact buffers (``None``: ``[L, slots]`` buffers);
    ``dropped`` (0-d) the copies this rank could not send. Where the dispatcher sums copies on their owner
    (``sum_on_owner``): ``experts [T, K]`` the copies' global experts, ``slot_map`` and ``slot_weights`` (one per
    buffer row) what the dispatch wrote."""

    dispatch: SymmetricDispatch
    token_copies: torch.Tensor
    copy_weights: torch.Tensor
    masked_m: torch.Tensor
    origins: torch.Tensor
    dropped: torch.Tensor
    starts: Optional[torch.Tensor] = None
    experts: Optional[torch.Tensor] = None
    slot_map: Optional[torch.Tensor] = None
    slot_weights: Optional[torch.Tensor] = None

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        from moeforge.kernels.symmetric_rows import return_rows, words

        dispatch, top_k = self.dispatch, self.token_copies.shape[1]
        rows = rows.reshape(-1, rows.shape[-1]).contiguous()  # [L, S, H] buffers, or flat: one copy per row
        slots = rows.shape[0] // self.masked_m.shape[0]
        if self.slot_map is not None:
            return self._sum_on_owners(rows, weighted, scaling_factor, out_dtype, slots)
        width = _word_width(rows)
        if width is None:  # (an odd width of fp16 rows): the buffers carry whole words only
            raise InputError(f"SymmetricDispatch returns rows as 32-bit words: rows of {rows.shape[-1]} "
                             f"{rows.dtype} do not fill them; use LowLatencyDispatch")
        copies = dispatch.max_tokens * top_k
        window, parts = dispatch.window(("return", width, copies), {"ret": copies * width}, rows.device)
        ret = parts["ret"].view(copies, width)
        return_rows(words(rows), self.masked_m, self.origins, ret, window.deltas, slots=slots, copies_per_rank=copies,
                    starts=self.starts, aligned=window.aligned)
        window.barrier()
        returned = ret.view(rows.dtype).view(copies, rows.shape[-1])
        weights = self.copy_weights if weighted else None
        return combine_on_source(returned, self.token_copies, weights, out_dtype, scaling_factor)

    def _sum_on_owners(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                       out_dtype: torch.dtype, slots: int) -> torch.Tensor:
        """Each owner sums the copies it holds of each token (in fp32) into one partial (``partial_dtype``) at the
        token's rank; a barrier; each rank adds its tokens' partials in rank order."""
        from moeforge.kernels.symmetric_rows import sum_on_owner, sum_partials

        assert self.slot_map is not None and self.experts is not None and self.slot_weights is not None
        dispatch, (tokens, top_k), hidden = self.dispatch, self.token_copies.shape, rows.shape[-1]
        ep = dispatch.ep
        rows_total, dtype = ep.world_size * dispatch.max_tokens, dispatch.partial_dtype
        assert dtype is not None
        if hidden * dtype.itemsize % 4:
            raise InputError(f"SymmetricDispatch returns partials as 32-bit words: rows of {hidden} {dtype} do not "
                             "fill them; sum_on_owner=torch.float32 does")
        window, parts = dispatch.window(("partials", hidden, dtype),
                                        {"partials": rows_total * hidden * dtype.itemsize // 4}, rows.device)
        partials = parts["partials"].view(dtype).view(rows_total, hidden)
        sum_on_owner(rows, self.slot_weights if weighted else None, self.slot_map, self.masked_m, self.origins,
                     partials, window.deltas, slots=slots, top_k=top_k, max_tokens=dispatch.max_tokens,
                     rank=ep.rank, starts=self.starts, aligned=window.aligned)
        window.barrier()
        out = torch.empty(tokens, hidden, dtype=out_dtype, device=rows.device)
        return sum_partials(partials, self.experts, self.token_copies, out, local=ep.local_experts,
                            max_tokens=dispatch.max_tokens, world=ep.world_size,
                            scaling=1.0 if scaling_factor is None else scaling_factor)

    def kept(self) -> torch.Tensor:
        return self.token_copies >= 0


@attrs.frozen(eq=False)
class SymmetricDispatch(ExchangeDispatch, Stage[RoutedTokens, ExpertRows]):
    """Fixed-capacity exchange over symmetric memory (see the module docstring). ``max_tokens``: the most tokens a
    rank passes per call (a larger batch is an ``InputError``); ``capacity``: rows per (source rank, expert), default
    ``max_tokens`` (never overflows); ``overflow``: what happens to the copies beyond it (as
    :class:`~moeforge.distributed.LowLatencyDispatch`); ``timeout_ms``: how long a barrier waits for the other ranks
    before it fails the process; ``configs`` (the triton expert GEMMs' launch table): the rows leave ``BLOCK_ALIGNED``
    (each slot one copy, the valid ones aligned on the device) for the triton GEMMs instead of ``EXPERT_PADDED``.
    A layer given this dispatcher with the triton backend sets ``configs`` itself.

    ``max_rows`` (compact buffers, for prefill batches): instead of ``W × capacity`` slots per local expert, one
    buffer of ``max_rows`` rows per rank holding the experts' rows one after another (expert, then source rank, then
    copy order), placed from the exchanged counts with no host sync; only the triton expert GEMMs read it (without
    ``configs`` the all-to-all exchange serves, with its host sync). A batch sending a rank more than ``max_rows``
    rows: ``overflow=ERROR`` raises on every rank before any row moves (reading one flag on the host: outside a CUDA
    graph only; inside one the overflowing rows are dropped and counted in the plan's ``dropped``), ``DROP`` drops
    them. ``capacity`` does not apply to compact buffers. A ``max_rows`` of at least ``W × max_tokens × min(top_k,
    local experts)`` (every copy of every rank's largest batch) can never overflow: no check, no host read, and an
    eager call never waits for the GPU.

    ``send_tokens_once``: a token's row crosses to each rank owning one of its experts once, however many of its
    ``top_k`` copies that rank's experts take, into a region of ``W × max_tokens`` token rows on the owner, which then
    copies each of its expert-buffer rows from there (:func:`~moeforge.kernels.symmetric_rows.fan_out`): the same
    rows in the same slots, fewer bytes over NVLink (DeepSeek-V3's top-8 on 2 ranks: about a quarter of the
    dispatch's rows), one more launch and a local pass over the received rows. ``None`` (default): where the rows
    a batch of ``max_tokens`` saves (:func:`rows_saved_bytes`) reach :data:`TOKENS_ONCE_MIN_BYTES` — a choice of
    the dispatcher, not of a call, since every rank must make the same one whatever its own batch (so a decode
    dispatcher sized for far more tokens than it mostly carries pays the extra launch on every call: ``False``
    there; docs/expert-parallel.md has the figures); ``True`` always, ``False`` never (one row per copy, as the NCCL
    dispatchers send). Rows scaled per copy (``apply_routing_weights``) and top-1 routing send one row per copy
    either way. The token rows' region is allocated only where tokens go once.

    ``sum_on_owner``: the combine sums, on the rank owning the experts, each token's copies it computed (in ``k``
    order, fp32, weighted where the combine weighs) into one partial per (token, owning rank), returns those over
    NVLink, and the token's rank adds its partials in rank order: one fp32 row per owning rank crosses back
    instead of one row of the experts' dtype per copy (DeepSeek-V3's top-8 bf16 on 2 ranks: half the bytes). The
    sum's order is not the single-GPU layer's ``k = 0 .. top_k - 1``, so the output is close to it, not the same
    bits (still the same bits from run to run). Off by default. A dtype (``torch.bfloat16``, ``torch.float16``)
    instead of ``True`` (``torch.float32``) returns the partials rounded to it: half of fp32's bytes again, one
    more rounding (each partial to the dtype, as the experts' rows already are), and no more bytes than one row per
    copy at any number of ranks."""

    kinds: ClassVar = (StageKind.DISPATCH,)
    ep: ExpertParallel
    max_tokens: int
    capacity: Optional[int] = None
    overflow: Overflow = attrs.field(default=Overflow.ERROR, converter=overflow_choice)
    apply_routing_weights: bool = False
    timeout_ms: int = 30_000
    configs: Optional[ConfigTable] = None
    max_rows: Optional[int] = None
    send_tokens_once: Optional[bool] = None
    sum_on_owner: Union[bool, torch.dtype] = False
    fallback: Stage[RoutedTokens, Any] = attrs.field(init=False, repr=False)  # (an ExchangeDispatch)
    _state: dict[Any, Any] = attrs.field(init=False, factory=dict, repr=False)
    _padded: LowLatencyDispatch = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.send_tokens_once not in (None, True, False):
            raise InputError(f"send_tokens_once takes None (chosen from max_tokens), True or False, got "
                             f"{self.send_tokens_once!r}")
        if not (isinstance(self.sum_on_owner, bool)
                or self.sum_on_owner in (torch.float32, torch.bfloat16, torch.float16)):
            raise InputError(f"sum_on_owner takes True, False or the partials' dtype (torch.float32, torch.bfloat16, "
                             f"torch.float16), got {self.sum_on_owner!r}")
        if not isinstance(self.timeout_ms, int) or self.timeout_ms < 1:
            raise InputError(f"timeout_ms must be a positive int, got {self.timeout_ms!r}")
        padded = LowLatencyDispatch(self.ep, self.max_tokens, self.capacity, self.overflow, self.apply_routing_weights)
        fallback: Stage[RoutedTokens, Any] = padded
        if self.max_rows is not None:
            if not isinstance(self.max_rows, int) or self.max_rows < 1:
                raise InputError(f"max_rows must be a positive int (or None), got {self.max_rows!r}")
            if self.capacity is not None:
                raise InputError("capacity bounds the rows per (source rank, expert) of fixed-capacity buffers; "
                                 "compact buffers (max_rows) hold any mix up to max_rows rows: give one of the two")
            from moeforge.distributed.all_to_all import AllToAllDispatch

            fallback = AllToAllDispatch(self.ep, apply_routing_weights=self.apply_routing_weights, configs=self.configs)
        object.__setattr__(self, "fallback", fallback)
        object.__setattr__(self, "_padded", padded)

    @property
    def slots(self) -> int:
        """Rows per (source rank, expert) of fixed-capacity buffers."""
        return self.capacity if self.capacity is not None else self.max_tokens

    @property
    def partial_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the partial sums the owners return (``sum_on_owner``), ``None`` where copies return one by
        one."""
        if isinstance(self.sum_on_owner, bool):
            return torch.float32 if self.sum_on_owner else None
        return self.sum_on_owner

    @property
    def compact(self) -> bool:
        return self.max_rows is not None

    def transport(self, device: torch.device) -> Optional[str]:
        """``None`` where symmetric memory serves rows on ``device``, else why not (then the NCCL/gloo low-latency
        dispatcher serves). Collective at its first call on a GPU (the ranks compare their hosts)."""
        key = ("transport", device.type)
        if key not in self._state:
            self._state[key] = self._why_not(device)
        reason: Optional[str] = self._state[key]
        return reason

    def _why_not(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "the rows are not on a CUDA device"
        if dist.get_backend(self.ep.group) != "nccl":
            return f"the process group's backend is {dist.get_backend(self.ep.group)}, not nccl"
        import importlib.util

        for module in ("torch.distributed._symmetric_memory", "triton"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not available here"
        hosts: list[Any] = [None] * self.ep.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.ep.group)
        if len(set(hosts)) > 1:
            return "the ranks span more than one host (symmetric memory maps one host's GPUs)"
        return None

    def window(self, key: Any, sizes: dict[str, int], device: torch.device, floats: tuple[str, ...] = ()
               ) -> tuple[SymmetricWindow, dict[str, torch.Tensor]]:
        """The window of ``key`` (allocated, collectively, at its first use) and its regions of ``sizes`` (one
        key, one set of sizes: the key names every size that varies), those named in ``floats`` float32."""
        found: Optional[tuple[SymmetricWindow, dict[str, torch.Tensor]]] = self._state.get(key)
        if found is None:
            window = SymmetricWindow.allocate(words_needed(sizes), device, self.ep.group, self.timeout_ms)
            found = window, regions(window.buffer, sizes, floats)
            self._state[key] = found
        return found

    def summary(self) -> str:
        extra = ", weights on input" if self.apply_routing_weights else ""
        chosen = [reason for key, reason in self._state.items() if isinstance(key, tuple) and key[0] == "transport"]
        other = "all-to-all" if self.compact else "NCCL low-latency"
        how = ("transport chosen at the first call" if not chosen else
               "symmetric memory (NVLink)" if chosen[-1] is None else f"{other} exchange: {chosen[-1]}")
        if self.compact and self.configs is None:
            how = "all-to-all exchange: compact rows are read by the triton expert GEMMs only (backend='triton')"
        layout = "block-aligned, " if self.configs is not None else ""
        bound = f"max_rows={self.max_rows}" if self.compact else f"capacity={self.slots}"
        rows = (", rows per copy" if self.send_tokens_once is False or self.apply_routing_weights
                else ", tokens sent once per rank" if self.send_tokens_once
                else f", tokens sent once per rank where max_tokens saves {TOKENS_ONCE_MIN_BYTES >> 20} MiB of rows")
        summed = (f", copies summed on their owner ({str(self.partial_dtype)[6:]} partials)"
                  if self.partial_dtype is not None else "")
        return (f"SymmetricDispatch({layout}rank {self.ep.rank}/{self.ep.world_size}, max_tokens={self.max_tokens}, "
                f"{bound}, overflow={self.overflow.value}{extra}{rows}{summed}; {how})")

    def output_spec(self, spec: Spec) -> Spec:
        dtype = self.partial_dtype
        if dtype is not None and spec.width * dtype.itemsize % 4:  # (told when the pipeline is built, not mid-step)
            raise InputError(f"sum_on_owner={dtype}: partials cross as 32-bit words, and rows of {spec.width} "
                             f"{str(dtype)[6:]} do not fill them; use sum_on_owner=True (fp32 partials)")
        rows: Spec = self.fallback.output_spec(spec)  # the same rows, whichever transport carries them
        return rows if self.compact else self.aligned_spec(rows)  # (compact: the all-to-all's spec, aligned by it)

    def __call__(self, x: RoutedTokens) -> ExpertRows:
        tokens, top_k = x.topk.ids.shape
        if tokens > self.max_tokens:
            raise InputError(f"SymmetricDispatch got {tokens} tokens; its buffers hold max_tokens={self.max_tokens} "
                             "per rank: split the batch or build the dispatcher with a larger max_tokens")
        data = x.x.data
        if (records_grad(data, x.topk.weights) or (self.compact and self.configs is None)
                or self.transport(data.device) is not None
                or _word_width(data) is None or (x.x.scale is not None and _word_width(x.x.scale) is None)):
            out: ExpertRows = self.fallback(x)
            self._state[("replay", data.device.type)] = "fallback"
        else:
            out = self._exchange(x)
        if self.compact or self.configs is None:
            return out
        from moeforge.distributed.padded_alignment import aligned_padded_rows

        assert isinstance(out, PaddedRows)  # (the tile chosen for this rank's own copies: what a rank gets on average)
        return aligned_padded_rows(out, self.configs.lookup(max(tokens * top_k, 1)))

    def _exchange(self, x: RoutedTokens) -> ExpertRows:
        from moeforge.kernels import symmetric_rows as kernels

        ep, compact = self.ep, self.compact
        cap = _NO_CAPACITY if compact else self.slots
        world, local, experts, rank = ep.world_size, ep.local_experts, ep.num_experts, ep.rank
        tokens, top_k = x.topk.ids.shape
        device = x.topk.ids.device
        flat = x.topk.ids.reshape(-1).to(torch.int32).contiguous()
        counts = None
        if flat.numel() > kernels.ROUTE_MAX_COPIES:  # a prefill batch: positions by a sort and scans
            wide = flat.long()
            order = torch.sort(wide, stable=True).indices
            counts = count_per_expert(wide, experts)
            sorted_position = torch.arange(order.numel(), device=device) - (counts.cumsum(0) - counts)[wide[order]]
            positions = torch.empty_like(sorted_position).index_copy_(0, order, sorted_position)
            token_copies = torch.where(positions < cap, torch.arange(flat.numel(), device=device), -1)
            dropped = (positions >= cap).sum()
            positions = positions.to(torch.int32)

        weights = x.topk.weights.reshape(-1).float().contiguous()
        if self.apply_routing_weights:  # one row per copy, scaled by its weight
            rows = scaled_rows(x.x, torch.arange(tokens * top_k, device=device) // top_k, weights, True)
        else:
            rows = x.x
        data = rows.data.contiguous()
        scale = None
        if rows.scale is not None:  # per token [T] or [T, 1], per group [T, H / 128], ...: [T, words]
            scale = (rows.scale.flatten(1) if rows.scale.dim() > 1 else rows.scale.unsqueeze(1)).contiguous()
        width, hidden = _word_width(data), data.shape[-1]
        scale_width = _word_width(scale) if scale is not None else 0
        assert width is not None and scale_width is not None
        slots = world * self.slots
        buffer_rows = self.max_rows if self.max_rows is not None else local * slots
        adapter_ids = x.adapter_ids.to(torch.int32).contiguous() if x.adapter_ids is not None else None
        has_adapters = adapter_ids is not None
        once = self.sends_tokens_once(top_k, (width + scale_width) * 4)
        token_rows = world * self.max_tokens if once else 0
        sizes = {"table": world * experts, "rows": buffer_rows * width, "scales": buffer_rows * scale_width,
                 "weights": buffer_rows, "origins": buffer_rows, "adapters": buffer_rows if has_adapters else 0,
                 "tokens": token_rows * width, "token_scales": token_rows * scale_width,
                 "slot_map": world * self.max_tokens * top_k if self.partial_dtype is not None else 0}
        window, parts = self.window(("dispatch", compact, width, scale_width, has_adapters, token_rows), sizes, device,
                                    floats=("weights",))

        if counts is None:
            positions, token_copies, dropped = kernels.route(flat, parts["table"], window.deltas, rank, cap)
        else:
            kernels.publish_counts(counts.to(torch.int32), parts["table"], window.deltas, rank)
        # A bound that can overflow under overflow=ERROR is checked on the host (a CUDA graph would drop instead).
        checks = ((self.overflow is Overflow.ERROR and buffer_rows < world * self.max_tokens * min(top_k, local))
                  if compact else self._padded.checks_overflow)
        self._state[("replay", device.type)] = "checks" if checks else "replays"
        if checks and not compact:
            # (every rank raises together, before any row moves and before the barrier every rank pairs with)
            self._padded._raise_on_overflow(dropped, count_per_expert(flat.long(), experts))
        window.barrier()
        table = parts["table"].view(world, experts)
        offsets = runs = None
        if compact:  # (every rank holds every rank's counts now: each places its copies, and reads its own runs)
            offsets, valid, starts, dropped, most = kernels.place(table, rank=rank, local=local, rows=buffer_rows)
            runs = valid, starts
            if checks:  # (else no rank can be sent more than max_rows rows: no host read)
                self._check_rows(most, device)
        kernels.put_rows(kernels.words(data), kernels.words(scale) if scale is not None else None, weights, flat,
                         positions, table, adapter_ids, parts["rows"], parts["scales"] if scale is not None else None,
                         parts["weights"], parts["origins"],
                         parts["adapters"] if has_adapters else None,
                         window.deltas, rank=rank, top_k=top_k, local=local, slots=slots, capacity=cap,
                         origin_base=rank * self.max_tokens * top_k, offsets=offsets, limit=buffer_rows,
                         kept=token_copies if compact else None, aligned=window.aligned,
                         recv_tokens=parts["tokens"] if once else None,
                         recv_token_scales=parts["token_scales"] if once and scale is not None else None,
                         max_tokens=self.max_tokens,
                         slot_map=parts["slot_map"] if self.partial_dtype is not None else None)
        window.barrier()

        def fan_out(masked: torch.Tensor, starts: Optional[torch.Tensor]) -> None:
            if once:  # each received copy's row from its token's row
                kernels.fan_out(parts["tokens"].view(token_rows, width),
                                parts["token_scales"].view(token_rows, scale_width) if scale is not None else None,
                                parts["rows"].view(buffer_rows, width),
                                parts["scales"].view(buffer_rows, scale_width) if scale is not None else None,
                                masked, parts["origins"], slots=slots if starts is None else buffer_rows,
                                top_k=top_k, starts=starts)

        received = parts["rows"].view(data.dtype).view(buffer_rows, hidden)
        received_scale = None
        if scale is not None:
            assert rows.scale is not None
            received_scale = parts["scales"].view(scale.dtype).view(buffer_rows, *rows.scale.shape[1:])
        if runs is not None:
            fan_out(*runs)
            return self._compact_rows(x, runs, Activations(received, received_scale), parts, token_copies, dropped,
                                      has_adapters)
        masked_m, slot_weights, received_ids = kernels.receive(
            table, parts["weights"], parts["adapters"] if has_adapters else None, rank=rank,
            local=local, slots=slots, capacity=cap)
        fan_out(masked_m, None)
        if received_scale is not None:
            received_scale = received_scale.view(local, slots, *received_scale.shape[1:])
        plan = SymmetricPlan(self, token_copies.view(tokens, top_k), x.topk.weights, masked_m, parts["origins"],
                             dropped, **self._owner_sums(x, parts))
        return PaddedRows(Activations(received.view(local, slots, hidden), received_scale), masked_m, slot_weights,
                          plan=plan, adapter_ids=received_ids)

    def _owner_sums(self, x: RoutedTokens, parts: dict[str, torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
        """What a plan needs to sum copies on their owners (:class:`SymmetricPlan`), where this dispatcher does."""
        if self.partial_dtype is None:
            return {}
        return dict(experts=x.topk.ids.to(torch.int32).contiguous(), slot_map=parts["slot_map"],
                    slot_weights=parts["weights"])

    def replay_refusal(self, device: torch.device) -> Optional[str]:
        """(See :meth:`ExchangeDispatch.replay_refusal`.) By what the last call on a ``device`` of that type did: the
        exchange it took (the fallback's answer where that served), and whether it read an overflow on the host."""
        last = self._state.get(("replay", device.type))
        if last is None:
            return "SymmetricDispatch has not been called yet"
        if last == "fallback":
            assert isinstance(self.fallback, ExchangeDispatch)
            return self.fallback.replay_refusal(device)
        if last == "checks":
            bound = f"max_rows={self.max_rows}" if self.compact else f"capacity={self.slots}"
            return (f"SymmetricDispatch({bound}, overflow=error) reads on the host whether a rank overflows, to raise "
                    "(overflow=Overflow.DROP, or a bound no batch of max_tokens exceeds, replay)")
        return None

    def sends_tokens_once(self, top_k: int, row_bytes: int) -> bool:
        """Whether this dispatcher sends each token's row once per owning rank (see the class docstring) for rows of
        ``row_bytes`` (scales included) routed to ``top_k`` experts: rows per token (not scaled per copy), more than
        one copy each, and ``send_tokens_once`` — ``None`` deciding by what a batch of ``max_tokens`` saves. A
        function of the dispatcher and the layer's shape, never of a call's batch: every rank makes the same choice
        (an owner fans out only where its sources sent token rows)."""
        if self.send_tokens_once is False or self.apply_routing_weights or top_k < 2:
            return False
        return self.send_tokens_once is True or rows_saved_bytes(
            self.max_tokens, top_k, self.ep.world_size, row_bytes) >= TOKENS_ONCE_MIN_BYTES

    def _check_rows(self, most_rows: torch.Tensor, device: torch.device) -> None:
        """Compact buffers, ``overflow=ERROR``: raise where a rank would receive more than ``max_rows`` rows
        (``most_rows``: the most any rank is sent; every rank reads the same table, so all raise together, before any
        row moves). Not inside a CUDA graph's capture (no host read there: the rows beyond are dropped and counted)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        most = int(most_rows)
        if most > (self.max_rows or 0):
            raise InputError(f"SymmetricDispatch: a rank would receive {most} rows, its compact buffer holds "
                             f"max_rows={self.max_rows}: raise max_rows or use overflow=Overflow.DROP (dropped copies "
                             "are then counted in the plan's 'dropped')")

    def _compact_rows(self, x: RoutedTokens, runs: tuple[torch.Tensor, torch.Tensor], received: Activations,
                      parts: dict[str, torch.Tensor],
                      token_copies: torch.Tensor, dropped: torch.Tensor, has_adapters: bool) -> AlignedRows:
        """The compact buffer's rows block-aligned for the triton GEMMs: ``runs`` (``valid [L]`` rows of each local
        expert from row ``starts [L]``, one expert after another, cut at ``max_rows``), each row one copy."""
        from moeforge.distributed.padded_alignment import grouped_alignment

        assert self.configs is not None and self.max_rows is not None
        tokens, top_k = x.topk.ids.shape
        valid, starts = runs
        rows, local = self.max_rows, valid.shape[0]
        config = self.configs.lookup(max(tokens * top_k, 1))
        alignment = grouped_alignment(valid, starts, rows, -(-rows // config.block_m) + local, config)
        adapter_ids = parts["adapters"] if has_adapters else None
        copy_experts = None
        if adapter_ids is not None:  # each row's local expert, from the runs (rows past them: any expert)
            ends = starts + valid
            copy_experts = (torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)
                            .clamp(max=local - 1).to(torch.int32))
        plan = SymmetricPlan(self, token_copies.view(tokens, top_k), x.topk.weights, valid, parts["origins"], dropped,
                             starts=starts, **self._owner_sums(x, parts))
        return AlignedRows(received, alignment, copy_major=False, copy_weights=parts["weights"],
                           plan=plan, adapter_ids=adapter_ids, copy_experts=copy_experts)


def rows_saved_bytes(tokens: int, top_k: int, world: int, row_bytes: int) -> int:
    """The bytes over NVLink a dispatch of ``tokens`` tokens' ``top_k`` copies over ``world`` ranks saves by sending
    each token's row once per owning rank, for routing spread evenly over the ranks: one row per copy sends
    ``top_k · (W - 1) / W`` rows a token to other ranks, once per rank ``(W - 1) · (1 - (1 - 1/W)^top_k)`` (the
    expected number of other ranks among the owners of ``top_k`` picks)."""
    if world < 2:
        return 0
    per_copy = top_k * (world - 1) / world
    once = (world - 1) * (1 - (1 - 1 / world) ** top_k)
    return int(tokens * (per_copy - once) * row_bytes)


# Sending tokens once costs a launch and a local pass over the received rows; below about 2 MiB of rows saved that
# is more than the NVLink time saved (the measurement that set it: docs/expert-parallel.md, "Each token once per
# owning rank").
TOKENS_ONCE_MIN_BYTES = 2 << 20


_NO_CAPACITY = 2**31 - 1  # compact buffers: no bound per (source rank, expert)
