"""A symmetric-memory window: one allocation on every rank of a group, its peers' addresses, a device barrier.

PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) maps each rank's allocation into every other
rank's address space (over NVLink, within one host). A :class:`SymmetricWindow` holds one such allocation of 32-bit
words, the distance from this rank's copy to each peer's (what :mod:`moeforge.kernels.symmetric_rows` adds to reach
a peer) and the barrier that orders the ranks' writes and reads; :func:`regions` carves it into named 1-D views.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Optional

import attrs
import torch
import torch.distributed as dist

_ALIGN = 256  # bytes between the regions of a window


@attrs.frozen(eq=False)
class SymmetricWindow:
    """One symmetric allocation of ``words`` 32-bit words on every rank of ``group``, carved into regions.

    ``deltas [W]`` (int64, on the device): the distance in words from this rank's allocation to rank ``r``'s, as the
    kernels of :mod:`moeforge.kernels.symmetric_rows` address peers. ``barrier`` waits, on the device, until every
    rank reached its own call (a symmetric-memory signal per pair of ranks). ``aligned``: every distance is a multiple
    of 4 words, so the kernels may store 16 bytes at a time (read once, when the window is made)."""

    buffer: torch.Tensor
    deltas: torch.Tensor
    handle: Any
    timeout_ms: int
    aligned: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "aligned", bool((self.deltas % 4 == 0).all()))

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


def regions(window: torch.Tensor, sizes: dict[str, int], floats: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Consecutive 1-D views of ``window``, ``sizes`` words each, each starting on a 256-byte boundary: int32, or
    float32 for the regions named in ``floats`` (a kernel storing a float through an int32 view converts its value,
    so a region holding floats is one from the start)."""
    out, start = {}, 0
    for name, size in sizes.items():
        region = window[start:start + size]
        out[name] = region.view(torch.float32) if name in floats else region
        start += -(-size * 4 // _ALIGN) * _ALIGN // 4
    return out


def words_needed(sizes: dict[str, int]) -> int:
    return sum(-(-size * 4 // _ALIGN) * _ALIGN // 4 for size in sizes.values())
