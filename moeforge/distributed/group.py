"""``ExpertParallel``: which experts this rank owns in an expert-parallel process group."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.distributed as dist

from moeforge.errors import InputError


@attrs.frozen(eq=False)
class ExpertParallel:
    """The experts of one layer sharded over the ranks of a ``torch.distributed`` process group.

    Rank ``r`` of ``W`` owns the ``L = num_experts / W`` consecutive global experts
    ``[r * L, (r + 1) * L)``; its local expert ``l`` is global expert ``r * L + l``. ``group=None``
    is the default process group, which must be initialised (``torch.distributed.init_process_group``,
    NCCL on GPUs, gloo on CPU).
    """

    num_experts: int
    group: Optional[dist.ProcessGroup] = None
    rank: int = attrs.field(init=False)
    world_size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InputError("ExpertParallel needs an initialised torch.distributed process group: call "
                             "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
        world = dist.get_world_size(self.group)
        if not isinstance(self.num_experts, int) or self.num_experts < 1 or self.num_experts % world:
            raise InputError(f"num_experts={self.num_experts!r} must be a positive multiple of the expert-parallel "
                             f"world size {world}")
        object.__setattr__(self, "rank", dist.get_rank(self.group))
        object.__setattr__(self, "world_size", world)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.local_experts

    @property
    def expert_range(self) -> range:
        return range(self.first_expert, self.first_expert + self.local_experts)

    def owner(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The rank that owns each global expert id."""
        return torch.div(expert_ids, self.local_experts, rounding_mode="floor")

    def summary(self) -> str:
        last = self.first_expert + self.local_experts - 1
        return (f"expert parallel: rank {self.rank} of {self.world_size}, experts {self.first_expert}..{last} "
                f"of {self.num_experts}")
