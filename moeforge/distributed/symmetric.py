"""The symmetric-memory expert-parallel dispatcher: rows written straight into the owning GPU's expert buffers.

Within one host, PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) maps each rank's buffer into
every other rank's address space over NVLink. :class:`SymmetricDispatch` uses it in place of NCCL's all-to-all:

* **dispatch**: one kernel gives each copy its position among the rank's copies of its expert and writes the rank's
  copies-per-expert counts into a ``[W, E]`` table on every rank (:func:`~moeforge.kernels.symmetric_rows.route`),
  all ranks meet at a device barrier, then one kernel writes each routed copy's row (scales, routing weight, origin,
  adapter id) into the expert buffer of the rank owning its expert, at the slot the table gives it
  (:func:`~moeforge.kernels.symmetric_rows.put_rows`), and a second barrier;
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
from typing import Any, ClassVar, Optional

import attrs
import torch
import torch.distributed as dist

from moeforge.distributed.exchange import ExchangeDispatch, combine_on_source, count_per_expert, scaled_rows
from moeforge.distributed.group import ExpertParallel
from moeforge.distributed.low_latency import LowLatencyDispatch
from moeforge.errors import InputError
from moeforge.no_backward import records_grad
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import Activations, AlignedRows, ExpertRows, PaddedRows, Plan, RoutedTokens
from moeforge.spec import Layout, Spec
from moeforge.stage import Stage, StageKind
from moeforge.stages.dispatch import Overflow, overflow_choice

_ALIGN = 256  # bytes between the regions of a window


@attrs.frozen(eq=False)
class SymmetricWindow:
    """One symmetric allocation of ``words`` 32-bit words on every rank of ``group``, carved into regions.

    ``deltas [W]`` (int64, on the device): the distance in words from this rank's allocation to rank ``r``'s, as the
    kernels of :mod:`moeforge.kernels.symmetric_rows` address peers. ``barrier`` waits, on the device, until every
    rank reached its own call (a symmetric-memory signal per pair of ranks)."""

    buffer: torch.Tensor
    deltas: torch.Tensor
    handle: Any
    timeout_ms: int

    @classmethod
    def allocate(cls, words: int, device: torch.device, group: Optional[dist.ProcessGroup],
                 timeout_ms: int) -> SymmetricWindow:
        """Collective: every rank of ``group`` calls it with the same ``words``."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(words, dtype=torch.int32, device=device)
        buffer.zero_()  # no stale bit patterns: an empty slot a GEMM reads holds zeros until it is first written
        handle = symm_mem.rendezvous(buffer, (group or dist.group.WORLD).group_name)  # type: ignore[union-attr]
        own = int(handle.buffer_ptrs[handle.rank])
        offset = buffer.data_ptr() - own  # where this tensor starts in the allocation: the same on every rank
        deltas = torch.tensor([(int(base) + offset - buffer.data_ptr()) // 4 for base in handle.buffer_ptrs],
                              dtype=torch.int64, device=device)
        handle.barrier(channel=0, timeout_ms=timeout_ms)  # every rank's zeros are in place before any peer writes
        return cls(buffer, deltas, handle, timeout_ms)

    def barrier(self) -> None:
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)


def _regions(window: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Consecutive 1-D int32 views of ``window``, ``sizes`` words each, each starting on a 256-byte boundary."""
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = window[start:start + size]
        start += -(-size * 4 // _ALIGN) * _ALIGN // 4
    return out


def _words_needed(sizes: dict[str, int]) -> int:
    return sum(-(-size * 4 // _ALIGN) * _ALIGN // 4 for size in sizes.values())


def _word_width(tensor: torch.Tensor) -> Optional[int]:
    """32-bit words per row of ``tensor`` (last dimension), or ``None`` where its bytes are not whole words."""
    row_bytes = tensor.shape[-1] * tensor.element_size()
    return row_bytes // 4 if row_bytes % 4 == 0 else None


@dataclasses.dataclass(frozen=True, eq=False)  # built in the forward: a dataclass, see moeforge.payloads
class SymmetricPlan(Plan):
    """The way back from :class:`SymmetricDispatch`'s rows: each valid expert-output row written to its source
    rank's return buffer at its copy's slot, a barrier, and each token's copies summed on its own rank.

    ``token_copies [T, K]``: each copy's slot in the return buffer (its index ``t * K + k``), -1 if dropped;
    ``masked_m [L]`` and ``origins [L * slots]`` (``source rank * max copies + copy``) of the rows this rank
    received; ``dropped`` (0-d) the copies this rank could not send."""

    dispatch: SymmetricDispatch
    token_copies: torch.Tensor
    copy_weights: torch.Tensor
    masked_m: torch.Tensor
    origins: torch.Tensor
    dropped: torch.Tensor

    def combine(self, rows: torch.Tensor, weighted: bool, scaling_factor: Optional[float],
                out_dtype: torch.dtype) -> torch.Tensor:
        from moeforge.kernels.symmetric_rows import return_rows, words

        dispatch, top_k = self.dispatch, self.token_copies.shape[1]
        rows = rows.reshape(self.masked_m.shape[0], -1, rows.shape[-1]).contiguous()  # ([L * S, H]: aligned rows)
        slots = rows.shape[1]
        width = _word_width(rows)
        if width is None:  # (an odd width of fp16 rows): the buffers carry whole words only
            raise InputError(f"SymmetricDispatch returns rows as 32-bit words: rows of {rows.shape[-1]} "
                             f"{rows.dtype} do not fill them; use LowLatencyDispatch")
        copies = dispatch.max_tokens * top_k
        window = dispatch.window(("return", width, copies), {"ret": copies * width}, rows.device)
        ret = _regions(window.buffer, {"ret": copies * width})["ret"].view(copies, width)
        return_rows(words(rows), self.masked_m, self.origins, ret, window.deltas, slots=slots, copies_per_rank=copies)
        window.barrier()
        returned = ret.view(rows.dtype).view(copies, rows.shape[-1])
        weights = self.copy_weights if weighted else None
        return combine_on_source(returned, self.token_copies, weights, out_dtype, scaling_factor)

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
    A layer given this dispatcher with the triton backend sets ``configs`` itself."""

    kinds: ClassVar = (StageKind.DISPATCH,)
    ep: ExpertParallel
    max_tokens: int
    capacity: Optional[int] = None
    overflow: Overflow = attrs.field(default=Overflow.ERROR, converter=overflow_choice)
    apply_routing_weights: bool = False
    timeout_ms: int = 30_000
    configs: Optional[ConfigTable] = None
    fallback: LowLatencyDispatch = attrs.field(init=False, repr=False)
    _state: dict[Any, Any] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.timeout_ms, int) or self.timeout_ms < 1:
            raise InputError(f"timeout_ms must be a positive int, got {self.timeout_ms!r}")
        object.__setattr__(self, "fallback", LowLatencyDispatch(
            self.ep, self.max_tokens, self.capacity, self.overflow, self.apply_routing_weights))

    @property
    def slots(self) -> int:
        """Rows per (source rank, expert)."""
        return self.fallback.slots

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

    def window(self, key: Any, sizes: dict[str, int], device: torch.device) -> SymmetricWindow:
        """The window of ``key`` (allocated, collectively, at its first use)."""
        window: Optional[SymmetricWindow] = self._state.get(key)
        if window is None:
            window = SymmetricWindow.allocate(_words_needed(sizes), device, self.ep.group, self.timeout_ms)
            self._state[key] = window
        return window

    def summary(self) -> str:
        extra = ", weights on input" if self.apply_routing_weights else ""
        chosen = [reason for key, reason in self._state.items() if isinstance(key, tuple) and key[0] == "transport"]
        how = ("transport chosen at the first call" if not chosen else
               "symmetric memory (NVLink)" if chosen[-1] is None else f"NCCL low-latency exchange: {chosen[-1]}")
        layout = "block-aligned, " if self.configs is not None else ""
        return (f"SymmetricDispatch({layout}rank {self.ep.rank}/{self.ep.world_size}, max_tokens={self.max_tokens}, "
                f"capacity={self.slots}, overflow={self.overflow.value}{extra}; {how})")

    @property
    def block_aligned(self) -> bool:
        return self.configs is not None

    def output_spec(self, spec: Spec) -> Spec:
        padded = self.fallback.output_spec(spec)  # the same rows, whichever transport carries them
        if self.configs is None:
            return padded
        return padded.evolve(layout=Layout.BLOCK_ALIGNED, alignment=self.configs.alignment())

    def __call__(self, x: RoutedTokens) -> ExpertRows:
        tokens, top_k = x.topk.ids.shape
        if tokens > self.max_tokens:
            raise InputError(f"SymmetricDispatch got {tokens} tokens; its buffers hold max_tokens={self.max_tokens} "
                             "per rank: split the batch or build the dispatcher with a larger max_tokens")
        data = x.x.data
        if (records_grad(data, x.topk.weights) or self.transport(data.device) is not None
                or _word_width(data) is None or (x.x.scale is not None and _word_width(x.x.scale) is None)):
            padded = self.fallback(x)
        else:
            padded = self._exchange(x)
        return padded if self.configs is None else self._aligned(padded, tokens * top_k)

    def _aligned(self, padded: PaddedRows, copies: int) -> AlignedRows:
        """``padded`` flattened to one copy per slot (``[L * S, H]``) for the triton GEMMs, its valid rows aligned
        (:func:`~moeforge.distributed.padded_alignment.padded_alignment`; the tile chosen for this rank's own copies,
        what a rank receives on average)."""
        from moeforge.distributed.padded_alignment import padded_alignment

        assert self.configs is not None
        local, slots = padded.masked_m.shape[0], padded.x.data.shape[1]
        alignment = padded_alignment(padded.masked_m, slots, self.configs.lookup(max(copies, 1)))
        scale = padded.x.scale
        if scale is not None:
            scale = scale.reshape(local * slots, *scale.shape[2:])
        adapter_ids = padded.adapter_ids.reshape(-1) if padded.adapter_ids is not None else None
        copy_experts = None
        if adapter_ids is not None:
            copy_experts = torch.arange(local, dtype=torch.int32, device=padded.masked_m.device).repeat_interleave(slots)
        return AlignedRows(Activations(padded.x.data.reshape(local * slots, -1), scale), alignment, copy_major=False,
                           copy_weights=padded.slot_weights.reshape(-1), plan=padded.plan, adapter_ids=adapter_ids,
                           copy_experts=copy_experts)

    def _exchange(self, x: RoutedTokens) -> PaddedRows:
        from moeforge.kernels import symmetric_rows as kernels

        ep, cap = self.ep, self.slots
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
        slots = world * cap
        adapter_ids = x.adapter_ids.to(torch.int32).contiguous() if x.adapter_ids is not None else None
        has_adapters = adapter_ids is not None
        sizes = {"table": world * experts, "rows": local * slots * width, "scales": local * slots * scale_width,
                 "weights": local * slots, "origins": local * slots, "adapters": local * slots if has_adapters else 0}
        window = self.window(("dispatch", width, scale_width, has_adapters), sizes, device)
        regions = _regions(window.buffer, sizes)

        if counts is None:
            positions, token_copies, dropped = kernels.route(flat, regions["table"], window.deltas, rank, cap)
        else:
            kernels.publish_counts(counts.to(torch.int32), regions["table"], window.deltas, rank)
        if self.overflow is Overflow.ERROR and cap < self.max_tokens:  # else no overflow is possible
            # (every rank raises together, before any row moves and before the barrier every rank pairs with)
            self.fallback._raise_on_overflow(dropped, count_per_expert(flat.long(), experts))
        window.barrier()
        table = regions["table"].view(world, experts)
        kernels.put_rows(kernels.words(data), kernels.words(scale) if scale is not None else None, weights, flat,
                         positions, table, adapter_ids, regions["rows"], regions["scales"] if scale is not None else None,
                         regions["weights"], regions["origins"], regions["adapters"] if has_adapters else None,
                         window.deltas, rank=rank, top_k=top_k, local=local, slots=slots, capacity=cap,
                         origin_base=rank * self.max_tokens * top_k)
        window.barrier()

        masked_m, slot_weights, received_ids = kernels.receive(
            table, regions["weights"].view(torch.float32), regions["adapters"] if has_adapters else None, rank=rank,
            local=local, slots=slots, capacity=cap)
        received = regions["rows"].view(data.dtype).view(local, slots, hidden)
        received_scale = None
        if scale is not None:
            assert rows.scale is not None
            received_scale = regions["scales"].view(scale.dtype).view(local, slots, *rows.scale.shape[1:])
        plan = SymmetricPlan(self, token_copies.view(tokens, top_k), x.topk.weights, masked_m, regions["origins"],
                             dropped)
        return PaddedRows(Activations(received, received_scale), masked_m, slot_weights, plan=plan,
                          adapter_ids=received_ids)
