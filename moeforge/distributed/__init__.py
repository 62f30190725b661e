"""Expert parallelism over ``torch.distributed`` process groups (NCCL on GPUs, gloo on CPU).

A layer built with ``expert_parallel=ExpertParallel(num_experts)`` holds only its rank's experts and
exchanges token rows with :class:`AllToAllDispatch` (normal, variable-length) or
:class:`LowLatencyDispatch` (fixed capacity, no host sync, CUDA-graph capturable) or, on the GPUs of one host,
:class:`SymmetricDispatch` (the same layout, the rows written straight into the owning GPU's buffers over NVLink). Their rows carry
the plan of the way home (:class:`AllToAllPlan`, :class:`LowLatencyPlan`), which the ordinary
:class:`~moeforge.Combine` follows.
"""

from moeforge.distributed.all_to_all import AllToAllDispatch, AllToAllPlan
from moeforge.distributed.exchange import ExchangeDispatch
from moeforge.distributed.group import ExpertParallel
from moeforge.distributed.low_latency import LowLatencyDispatch, LowLatencyPlan
from moeforge.distributed.shard import shard_state_dict
from moeforge.distributed.symmetric import SymmetricDispatch, SymmetricPlan
from moeforge.distributed.wire import RowFormat, Traffic

__all__ = [
    "AllToAllDispatch", "AllToAllPlan", "ExchangeDispatch", "ExpertParallel", "LowLatencyDispatch",
    "LowLatencyPlan", "RowFormat", "SymmetricDispatch", "SymmetricPlan", "Traffic", "shard_state_dict",
]
