"""Table tests for :func:`moeforge.selector.select`: layer configurations x devices x preferences -> the
chosen router, dispatcher, experts and row layout, and why each candidate tried before them was skipped;
and the "nothing can run this layer" error, which must name the method, the backend and every candidate.

Each row is one line: a :class:`Layer` (a :class:`LayerConfig` in a few words: the shorthand is read by
:meth:`Layer.config`), the expected choice ``"router dispatcher experts layout backend"`` and the skipped
candidates, in order, as ``"Name: a substring of its reason"``. ``select`` makes no tensor, so a CUDA
layer's choice is asked on any machine; whether Triton is installed is the row's (``triton=False``
monkeypatches ``moeforge.backend.triton_installed``). The dispatch dtype is decided as ``MoELayer`` decides
it (:func:`resolve_dispatch_dtype`), for an H100 on ``"cuda"``.

The last tests hold behaviours the table first found wrong: a spanning dispatcher chosen against the backend
asked for, torch experts for a batch-invariant layer, an error listing no candidate for a method from outside
moeforge, a reason said twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

import attrs
import pytest
import torch

import moeforge as mf
import moeforge.backend
from moeforge.dispatch_dtype import ENV_VAR, DeviceDispatchSupport, resolve_dispatch_dtype
from moeforge.distributed import AllToAllDispatch, ExpertParallel, LowLatencyDispatch
from moeforge.kernels.config import ConfigTable
from moeforge.roles.base import LayerConfig
from moeforge.selector import DISPATCHERS, EXPERTS, KEYWORDS, ROUTERS, Selection, select
from moeforge.spec import ScaleLayout
from moeforge.stage import Stage

E, K, H, I = 4, 2, 128, 128


# -- the shorthand of the rows -------------------------------------------------------------------------------

class OwnStages(mf.QuantMethod):
    """A quant method written outside moeforge that builds its own expert stages (-> MethodOwnExperts)."""

    accepts = frozenset({mf.DType.BF16})
    accepts_scales = frozenset({ScaleLayout.NONE})

    def create_weights(self, layer: torch.nn.Module, **sizes: Any) -> None:
        pass

    def expert_stages(self, layer: torch.nn.Module, *, activation: mf.ActivationConfig,
                      routing_weights_in_epilogue: bool, backend: mf.Backend = mf.Backend.TORCH,
                      configs: Optional[ConfigTable] = None,
                      dispatch: Optional[mf.DispatchDtype] = None) -> list[Stage[Any, Any]]:
        return []


class OwnUnquantizedStages(mf.UnquantizedMethod):
    """moeforge's unquantized format with the stages of a method of its own (-> MethodOwnExperts)."""

    expert_stages = OwnStages.expert_stages


class NoStages(mf.QuantMethod):
    """A quant method from outside moeforge that builds no expert stages: no experts compute it."""

    accepts = frozenset({mf.DType.BF16})
    accepts_scales = frozenset({ScaleLayout.NONE})

    def create_weights(self, layer: torch.nn.Module, **sizes: Any) -> None:
        pass


METHODS: dict[str, Callable[[], mf.QuantMethod]] = {
    "unquantized": mf.UnquantizedMethod,
    "fp8": mf.Fp8W8A8Method,  # per-channel weights, per-token activations
    "fp8-group": lambda: mf.Fp8W8A8Method(activation_scales="group"),
    "fp8-block": lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),  # DeepSeek-V3
    "fp8-block-token": lambda: mf.Fp8W8A8Method(weight_scales="block"),
    "int8": mf.Int8W8A8Method,
    "w4a16": lambda: mf.W4A16Method(group_size=64),
    "mxfp4": mf.Mxfp4Method,
    "mxfp4-shuffled": lambda: mf.Mxfp4Method(shuffled=True),
    "nvfp4": mf.Nvfp4Method,  # float activations
    "nvfp4-rows": lambda: mf.Nvfp4Method(input_global_scale=448.0 * 6.0),  # NVFP4 activations (rule 3)
    "w4a4-npu": mf.W4A4NpuMethod,
    "own": OwnStages,
    "own-unquantized": OwnUnquantizedStages,
    "no-stages": NoStages,
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

ROUTINGS = {
    "default": mf.RoutingConfig(),
    "deepseek": mf.RoutingConfig(scoring="sigmoid", selection_bias=True, n_group=2, topk_group=1,
                                 routed_scaling_factor=2.5),
    "sparsemixer": mf.RoutingConfig(sparsemixer_eps=0.01, renormalize=False),  # PhiMoE
    "on_input": mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT),  # Llama-4
    "epilogue": mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE),
}


@attrs.frozen(eq=False)
class RankOf(ExpertParallel):
    """``ExpertParallel(num_experts)`` as rank 0 of ``given_world`` sees it, without a process group (the
    selector runs no collective; as in test_checkpoint_expert_parallel)."""

    given_world: int = 2

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "rank", 0)
        object.__setattr__(self, "world_size", self.given_world)


EP = RankOf(E)
# Dispatch stages a user built (dispatcher=<stage>: GivenDispatcher).
GIVEN: dict[str, Stage[Any, Any]] = {
    "sorted": mf.SortedDispatch(E),
    "padded": mf.PaddedDispatch(E, capacity=8),
    "low_latency": LowLatencyDispatch(EP, max_tokens=8),
    "all_to_all": AllToAllDispatch(EP),
    "all_to_all-other-ep": AllToAllDispatch(RankOf(E)),  # not the layer's ExpertParallel
}
# An H100 (sm_90): carries FP8, INT8 and NVFP4 (DeviceDispatchSupport.for_device asks the GPU for this).
CUDA_WIRES = DeviceDispatchSupport(fp8=True, int8=True, nvfp4=True)


@attrs.frozen
class Layer:
    """A layer in a few words; :meth:`config` is the :class:`LayerConfig` ``MoELayer`` would give ``select``
    (``backend``: ``None`` is "auto"; ``dispatcher``: a keyword, or ``"given:<GIVEN key>"``; ``wire``: the
    ``dispatch_dtype`` setting; ``env``: the value of MOEFORGE_DISPATCH_DTYPE)."""

    method: str = "unquantized"
    device: str = "cpu"
    dtype: str = "bf16"
    wire: str = "auto"
    backend: Optional[str] = None
    dispatcher: str = "auto"
    batch_invariant: bool = False
    routing: str = "default"
    ep: bool = False
    triton: bool = True
    env: Optional[str] = None

    def config(self) -> LayerConfig:
        method = METHODS[self.method]()
        dtype = DTYPES[self.dtype]
        routing = ROUTINGS[self.routing]
        with warnings.catch_warnings():  # rule 2 warns, naming the variable
            warnings.simplefilter("ignore")
            decision = resolve_dispatch_dtype(
                self.wire, experts_accept=method.accepts, activation_dtype=dtype,
                quant_requires=method.required_dispatch_dtype(), quant_prefers=method.prefers,
                device=CUDA_WIRES if self.device == "cuda" else torch.device(self.device),
                environ={ENV_VAR: self.env} if self.env else {}, experts_name=f"experts ({method.name})",
                weights_on_input=routing.apply_weights is mf.RoutingWeights.ON_INPUT)
        dispatcher: Any = GIVEN[self.dispatcher[6:]] if self.dispatcher.startswith("given:") else self.dispatcher
        return LayerConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, routing=routing,
                           activation=mf.ActivationConfig(), quant=method, dtype=dtype,
                           device=torch.device(self.device), dispatch=decision,
                           expert_parallel=EP if self.ep else None,
                           backend=mf.Backend(self.backend) if self.backend else None, dispatcher=dispatcher,
                           batch_invariant=self.batch_invariant)


L = Layer
CUDA = "cuda"
# Reasons, shortened to what identifies them.
ON_CPU = "the layer is on cpu, the triton kernels need a CUDA device"
NO_TRITON = "the 'triton' package is not installed"
FP64 = "the triton kernels compute in bf16, fp16 or fp32, not float64"
ASKED_TORCH = "backend='torch' was asked for"
ASKED_TRITON = "backend='triton' was asked for"
NO_EP = "it exchanges rows between expert-parallel ranks: build the layer with expert_parallel="
LOCAL_ONLY = "it does not exchange rows between expert-parallel ranks"
OWN_STAGES = "the quant method builds its own expert stages (it overrides expert_stages)"
BATCH_INVARIANT = "batch_invariant=True runs on the triton backend"


def row(name: str, layer: Layer, chosen: str, *skipped: str, marks: Any = ()) -> Any:
    return pytest.param(layer, chosen, skipped, id=name, marks=marks)


# -- the table: what select() chooses ------------------------------------------------------------------------
# chosen: "router dispatcher experts layout backend" ("-": none: a dispatcher that spans the experts)

ROWS = [
    # every quant method moeforge ships, on the CPU and on a CUDA device (auto: backend, dispatcher, wire)
    row("cpu-unquantized", L(), "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-unquantized", L(device=CUDA),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cpu-fp8", L("fp8"), "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonW8A8Experts: {ON_CPU}"),
    row("cuda-fp8", L("fp8", CUDA), "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cpu-fp8-group", L("fp8-group"), "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonW8A8Experts: {ON_CPU}"),
    row("cuda-fp8-group", L("fp8-group", CUDA),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cpu-fp8-block", L("fp8-block"), "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonW8A8Experts: {ON_CPU}"),
    row("cuda-fp8-block", L("fp8-block", CUDA),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-fp8-block-token", L("fp8-block-token", CUDA),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cpu-int8", L("int8"), "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonW8A8Experts: {ON_CPU}"),
    row("cuda-int8", L("int8", CUDA), "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cpu-w4a16", L("w4a16"), "TorchRouter SortedDispatcher TorchW4A16Experts expert_sorted torch",
        f"TritonW4A16Experts: {ON_CPU}"),
    row("cuda-w4a16", L("w4a16", CUDA), "TritonRouter AlignedDispatcher TritonW4A16Experts block_aligned triton"),
    row("cpu-mxfp4", L("mxfp4"), "TorchRouter SortedDispatcher EmulatedMxfp4Experts expert_sorted torch",
        f"TritonMxfp4Experts: {ON_CPU}"),
    row("cuda-mxfp4", L("mxfp4", CUDA), "TritonRouter AlignedDispatcher TritonMxfp4Experts block_aligned triton"),
    row("cpu-mxfp4-shuffled", L("mxfp4-shuffled"),
        "TorchRouter SortedDispatcher EmulatedMxfp4Experts expert_sorted torch", f"TritonMxfp4Experts: {ON_CPU}"),
    row("cuda-mxfp4-shuffled", L("mxfp4-shuffled", CUDA),
        "TritonRouter AlignedDispatcher TritonMxfp4Experts block_aligned triton"),
    row("cpu-nvfp4", L("nvfp4"), "TorchRouter SortedDispatcher EmulatedNvfp4Experts expert_sorted torch",
        f"TritonNvfp4Experts: {ON_CPU}"),
    row("cuda-nvfp4", L("nvfp4", CUDA), "TritonRouter AlignedDispatcher TritonNvfp4Experts block_aligned triton"),
    row("cpu-nvfp4-rows", L("nvfp4-rows"), "TorchRouter SortedDispatcher EmulatedNvfp4Experts expert_sorted torch",
        f"TritonNvfp4Experts: {ON_CPU}"),
    row("cuda-nvfp4-rows", L("nvfp4-rows", CUDA),
        "TritonRouter AlignedDispatcher TritonNvfp4Experts block_aligned triton"),
    row("cpu-w4a4-npu", L("w4a4-npu"), "TorchRouter SortedDispatcher W4A4NpuExperts expert_sorted torch"),
    row("cuda-w4a4-npu", L("w4a4-npu", CUDA), "TritonRouter SortedDispatcher W4A4NpuExperts expert_sorted torch"),
    # a quant method from outside moeforge that overrides expert_stages
    row("cpu-own", L("own"), "TorchRouter SortedDispatcher MethodOwnExperts expert_sorted torch"),
    row("cuda-own", L("own", CUDA), "TritonRouter SortedDispatcher MethodOwnExperts expert_sorted torch"),
    row("cuda-own-unquantized", L("own-unquantized", CUDA),
        "TritonRouter SortedDispatcher MethodOwnExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {OWN_STAGES}", f"TorchUnquantizedExperts: {OWN_STAGES}"),
    row("cuda-own-padded", L("own", CUDA, dispatcher="padded"),
        "TritonRouter PaddedDispatcher MethodOwnExperts expert_padded torch"),
    # devices: meta is a device like the CPU; CUDA without triton
    row("meta-unquantized", L(device="meta"),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        "TritonUnquantizedExperts: the layer is on meta, the triton kernels need a CUDA device"),
    row("meta-fp8", L("fp8", "meta"), "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        "TritonW8A8Experts: the layer is on meta"),
    row("cuda-no-triton-unquantized", L(device=CUDA, triton=False),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonRouter: {NO_TRITON}", f"TritonUnquantizedExperts: {NO_TRITON}"),
    row("cuda-no-triton-fp8", L("fp8", CUDA, triton=False),
        "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonRouter: {NO_TRITON}", f"TritonW8A8Experts: {NO_TRITON}"),
    row("cuda-no-triton-nvfp4-rows", L("nvfp4-rows", CUDA, triton=False),
        "TorchRouter SortedDispatcher EmulatedNvfp4Experts expert_sorted torch",
        f"TritonRouter: {NO_TRITON}", f"TritonNvfp4Experts: {NO_TRITON}"),
    row("cpu-no-triton", L(triton=False), "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),  # the device is the first reason
    # dtypes and dispatch dtypes
    row("cuda-fp16", L(device=CUDA, dtype="fp16"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-fp32", L(device=CUDA, dtype="fp32"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cpu-fp64", L(dtype="fp64"), "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-fp64", L(device=CUDA, dtype="fp64"),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonRouter: {FP64}", f"TritonUnquantizedExperts: {FP64}"),
    row("cuda-fp32-wire-bf16", L(device=CUDA, dtype="fp32", wire="bf16"),
        "TritonRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        "TritonUnquantizedExperts: its GEMMs read fp32 rows (the layer's dtype), not bf16: dispatch bf16 "
        "(rule 1: explicit setting); dispatch_dtype='fp32' lets them run"),
    row("cuda-fp32-env-bf16", L(device=CUDA, dtype="fp32", env="bf16"),
        "TritonRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: not bf16: dispatch bf16 (rule 2: process default {ENV_VAR})"),
    row("cuda-bf16-env-bf16", L(device=CUDA, env="bf16"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-fp16-wire-fp16", L(device=CUDA, dtype="fp16", wire="fp16"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-w4a16-fp16-wire-fp32", L("w4a16", CUDA, dtype="fp16", wire="fp32"),
        "TritonRouter SortedDispatcher TorchW4A16Experts expert_sorted torch",
        "TritonW4A16Experts: its GEMMs read fp16 rows (the layer's dtype), not fp32"),
    row("cuda-mxfp4-fp16-wire-bf16", L("mxfp4", CUDA, dtype="fp16", wire="bf16"),
        "TritonRouter SortedDispatcher EmulatedMxfp4Experts expert_sorted torch",
        "TritonMxfp4Experts: its GEMMs read fp16 rows (the layer's dtype), not bf16"),
    row("cuda-nvfp4-fp32-wire-bf16", L("nvfp4", CUDA, dtype="fp32", wire="bf16"),
        "TritonRouter SortedDispatcher EmulatedNvfp4Experts expert_sorted torch",
        "TritonNvfp4Experts: its GEMMs read fp32 rows (the layer's dtype), not bf16"),
    row("cuda-nvfp4-rows-fp16", L("nvfp4-rows", CUDA, dtype="fp16"),  # quantized rows: any layer dtype
        "TritonRouter AlignedDispatcher TritonNvfp4Experts block_aligned triton"),
    row("cuda-fp8-wire-bf16", L("fp8", CUDA, wire="bf16"),  # quantized after the dispatch
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-fp8-fp16-wire-fp32", L("fp8", CUDA, dtype="fp16", wire="fp32"),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-int8-wire-int8", L("int8", CUDA, wire="int8"),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-w4a4-npu-fp32", L("w4a4-npu", CUDA, dtype="fp32"),  # bf16 rows (rule 3) into an fp32 layer
        "TritonRouter SortedDispatcher W4A4NpuExperts expert_sorted torch"),
    # backend preference
    row("cuda-backend-torch", L(device=CUDA, backend="torch"),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonRouter: {ASKED_TORCH}", f"TritonUnquantizedExperts: {ASKED_TORCH}"),
    row("cuda-backend-torch-fp8", L("fp8", CUDA, backend="torch"),
        "TorchRouter SortedDispatcher TorchW8A8Experts expert_sorted torch",
        f"TritonRouter: {ASKED_TORCH}", f"TritonW8A8Experts: {ASKED_TORCH}"),
    row("cpu-backend-torch", L(backend="torch"),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),  # the device is the first reason
    row("cuda-backend-triton", L(device=CUDA, backend="triton"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-backend-triton-nvfp4-rows", L("nvfp4-rows", CUDA, backend="triton"),
        "TritonRouter AlignedDispatcher TritonNvfp4Experts block_aligned triton"),
    # batch_invariant=True (MoELayer pairs it with backend='triton')
    row("cuda-batch-invariant", L(device=CUDA, backend="triton", batch_invariant=True),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-batch-invariant-fp8", L("fp8", CUDA, backend="triton", batch_invariant=True),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-batch-invariant-sparsemixer", L(device=CUDA, backend="triton", batch_invariant=True,
                                              routing="sparsemixer"),
        "TorchRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton",
        "TritonRouter: the routing kernel does not compute sparsemixer routing"),
    # routing: what the triton router cannot compute, and where the routing weights go
    row("cuda-deepseek-routing", L("fp8-block", CUDA, routing="deepseek"),
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-sparsemixer", L(device=CUDA, routing="sparsemixer"),
        "TorchRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton",
        "TritonRouter: the routing kernel does not compute sparsemixer routing"),
    row("cuda-sparsemixer-backend-triton", L(device=CUDA, backend="triton", routing="sparsemixer"),
        "TorchRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton",
        "TritonRouter: the routing kernel does not compute sparsemixer routing"),
    row("cpu-sparsemixer", L(routing="sparsemixer"),  # a router skipped off CUDA is no news
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-weights-on-input", L(device=CUDA, routing="on_input"),  # the dispatch scales each copy's row
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-weights-on-input-fp8", L("fp8", CUDA, routing="on_input"),  # float rows on the wire (rule 6)
        "TritonRouter AlignedDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-backend-triton-weights-on-input", L(device=CUDA, backend="triton", routing="on_input"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-weights-in-epilogue", L(device=CUDA, routing="epilogue"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    # dispatcher= keywords
    row("cuda-aligned", L(device=CUDA, dispatcher="aligned"),
        "TritonRouter AlignedDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cpu-sorted", L(dispatcher="sorted"),
        "TorchRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-sorted", L(device=CUDA, dispatcher="sorted"),
        "TritonRouter SortedDispatcher TorchUnquantizedExperts expert_sorted torch",
        "TritonUnquantizedExperts: no dispatcher delivers its rows: SortedDispatcher: it delivers expert_sorted rows "
        "(TritonUnquantizedExperts reads block_aligned rows: use dispatcher='auto' or another backend)"),
    row("cpu-padded", L(dispatcher="padded"),
        "TorchRouter PaddedDispatcher TorchUnquantizedExperts expert_padded torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-padded-fp8", L("fp8", CUDA, dispatcher="padded"),
        "TritonRouter PaddedDispatcher TorchW8A8Experts expert_padded torch",
        "TritonW8A8Experts: PaddedDispatcher: it delivers expert_padded rows"),
    row("cpu-padded-w4a4-npu", L("w4a4-npu", dispatcher="padded"),
        "TorchRouter PaddedDispatcher W4A4NpuExperts expert_padded torch"),
    # fused_ep: the method's stage spans dispatch -> combine (a method without one refuses when the layer is built)
    row("cpu-fused-ep-w4a4-npu", L("w4a4-npu", dispatcher="fused_ep"), "TorchRouter FusedEpDispatcher - - torch"),
    row("cuda-fused-ep-w4a4-npu", L("w4a4-npu", CUDA, dispatcher="fused_ep"),
        "TritonRouter FusedEpDispatcher - - torch"),
    row("cuda-fused-ep-unquantized", L(device=CUDA, dispatcher="fused_ep"),  # ContractError at build time
        "TritonRouter FusedEpDispatcher - - torch"),
    # a dispatch stage the user built
    row("cpu-given-sorted", L(dispatcher="given:sorted"),
        "TorchRouter GivenDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-given-sorted", L(device=CUDA, dispatcher="given:sorted"),
        "TritonRouter GivenDispatcher TorchUnquantizedExperts expert_sorted torch",
        "TritonUnquantizedExperts: no dispatcher delivers its rows: GivenDispatcher: SortedDispatch delivers "
        "expert_sorted rows (TritonUnquantizedExperts reads block_aligned rows: use dispatcher='auto' or another "
        "backend)"),
    row("cuda-given-padded-fp8", L("fp8", CUDA, dispatcher="given:padded"),
        "TritonRouter GivenDispatcher TorchW8A8Experts expert_padded torch",
        "TritonW8A8Experts: GivenDispatcher: PaddedDispatch delivers expert_padded rows"),
    # expert parallelism (an ExpertParallel that states its rank: no process group)
    row("cuda-ep", L(device=CUDA, ep=True),
        "TritonRouter AllToAllDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cpu-ep", L(ep=True), "TorchRouter AllToAllDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonUnquantizedExperts: {ON_CPU}"),
    row("cuda-ep-fp8", L("fp8", CUDA, ep=True),
        "TritonRouter AllToAllDispatcher TritonW8A8Experts block_aligned triton"),
    row("cuda-ep-all-to-all", L("nvfp4-rows", CUDA, ep=True, dispatcher="all_to_all"),
        "TritonRouter AllToAllDispatcher TritonNvfp4Experts block_aligned triton"),
    row("cuda-ep-backend-torch", L(device=CUDA, ep=True, backend="torch"),
        "TorchRouter AllToAllDispatcher TorchUnquantizedExperts expert_sorted torch",
        f"TritonRouter: {ASKED_TORCH}", f"TritonUnquantizedExperts: {ASKED_TORCH}"),
    row("cuda-ep-weights-on-input", L(device=CUDA, ep=True, routing="on_input"),  # scaled before they are sent
        "TritonRouter AllToAllDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cuda-ep-fused-ep", L("w4a4-npu", CUDA, ep=True, dispatcher="fused_ep"),
        "TritonRouter FusedEpDispatcher - - torch"),
    row("cuda-ep-given-low-latency", L(device=CUDA, ep=True, dispatcher="given:low_latency"),
        "TritonRouter GivenDispatcher TritonUnquantizedExperts block_aligned triton"),
    row("cpu-ep-given-all-to-all", L("int8", ep=True, dispatcher="given:all_to_all"),
        "TorchRouter GivenDispatcher TorchW8A8Experts expert_sorted torch", f"TritonW8A8Experts: {ON_CPU}"),
]


# -- the table: "no implementation can run this layer" ----------------------------------------------------
# head: what the message says of the layer; then every candidate, in order, as "Name: a substring of its reason"

def error(name: str, layer: Layer, head: str, *candidates: str, marks: Any = ()) -> Any:
    return pytest.param(layer, head, candidates, id=name, marks=marks)


ERRORS = [
    error("cpu-backend-triton", L(backend="triton"), "UnquantizedMethod, backend=triton, dispatcher='auto' on cpu",
          f"TritonUnquantizedExperts: {ON_CPU}", f"TorchUnquantizedExperts: {ASKED_TRITON}"),
    error("meta-backend-triton-fp8-block", L("fp8-block", "meta", backend="triton"),
          "Fp8W8A8Method(weights=block, activations=group), backend=triton, dispatcher='auto' on meta",
          "TritonW8A8Experts: the layer is on meta", f"TorchW8A8Experts: {ASKED_TRITON}"),
    error("cpu-batch-invariant", L(backend="triton", batch_invariant=True),
          f"UnquantizedMethod, backend=triton ({BATCH_INVARIANT}), dispatcher='auto' on cpu",
          f"TritonUnquantizedExperts: {ON_CPU}", f"TorchUnquantizedExperts: {BATCH_INVARIANT}"),
    error("cuda-no-triton-backend-triton", L("mxfp4", CUDA, backend="triton", triton=False),
          "Mxfp4Method, backend=triton, dispatcher='auto' on cuda",
          f"TritonRouter: {NO_TRITON}", f"TritonMxfp4Experts: {NO_TRITON}", f"EmulatedMxfp4Experts: {ASKED_TRITON}"),
    error("cuda-fp64-backend-triton", L(device=CUDA, dtype="fp64", backend="triton"),
          "UnquantizedMethod, backend=triton, dispatcher='auto' on cuda",
          f"TritonRouter: {FP64}", f"TritonUnquantizedExperts: {FP64}", f"TorchUnquantizedExperts: {ASKED_TRITON}"),
    error("cuda-w4a4-npu-backend-triton", L("w4a4-npu", CUDA, backend="triton"),
          "W4A4NpuMethod, backend=triton, dispatcher='auto' on cuda", f"W4A4NpuExperts: {ASKED_TRITON}"),
    error("cuda-batch-invariant-wire-fp16", L("nvfp4", CUDA, wire="fp16", backend="triton", batch_invariant=True),
          f"Nvfp4Method, backend=triton ({BATCH_INVARIANT}), dispatcher='auto' on cuda",
          "TritonNvfp4Experts: its GEMMs read bf16 rows (the layer's dtype), not fp16",
          f"EmulatedNvfp4Experts: {BATCH_INVARIANT}"),
    # a dispatcher keyword that cannot deliver any layout the experts read
    error("cuda-backend-torch-aligned", L(device=CUDA, backend="torch", dispatcher="aligned"),
          "UnquantizedMethod, backend=torch, dispatcher='aligned' on cuda",
          f"TritonRouter: {ASKED_TORCH}", f"TritonUnquantizedExperts: {ASKED_TORCH}",
          "TorchUnquantizedExperts: no dispatcher delivers its rows: AlignedDispatcher: it delivers block_aligned rows"
          " ... (TorchUnquantizedExperts reads expert_padded, expert_sorted rows: use dispatcher='auto' or another "
          "backend)"),  # the reason is said twice: test_a_wrong_layout_is_said_once
    error("cuda-backend-triton-padded", L(device=CUDA, backend="triton", dispatcher="padded"),
          "UnquantizedMethod, backend=triton, dispatcher='padded' on cuda",
          "TritonUnquantizedExperts: no dispatcher delivers its rows: PaddedDispatcher: it delivers expert_padded rows "
          "(TritonUnquantizedExperts reads block_aligned rows: use dispatcher='auto' or another backend)",
          f"TorchUnquantizedExperts: {ASKED_TRITON}"),
    error("cpu-aligned", L("w4a16", dispatcher="aligned"), "W4A16Method, backend=auto, dispatcher='aligned' on cpu",
          f"TritonW4A16Experts: {ON_CPU}", f"TorchW4A16Experts: no dispatcher delivers its rows: AlignedDispatcher: "
          f"{ON_CPU}"),
    error("cuda-no-triton-aligned", L(device=CUDA, dispatcher="aligned", triton=False),
          "UnquantizedMethod, backend=auto, dispatcher='aligned' on cuda", f"TritonRouter: {NO_TRITON}",
          f"TritonUnquantizedExperts: {NO_TRITON}", f"TorchUnquantizedExperts: AlignedDispatcher: {NO_TRITON}"),
    error("cuda-batch-invariant-given-sorted", L(device=CUDA, backend="triton", batch_invariant=True,
                                                 dispatcher="given:sorted"),
          f"UnquantizedMethod, backend=triton ({BATCH_INVARIANT}), dispatcher='SortedDispatch' on cuda",
          "TritonUnquantizedExperts: GivenDispatcher: SortedDispatch delivers expert_sorted rows",
          f"TorchUnquantizedExperts: {BATCH_INVARIANT}"),
    # expert parallelism and the dispatchers
    error("cpu-all-to-all-without-ep", L(dispatcher="all_to_all"),
          "UnquantizedMethod, backend=auto, dispatcher='all_to_all' on cpu",
          f"TritonUnquantizedExperts: {ON_CPU}", f"TorchUnquantizedExperts: AllToAllDispatcher: {NO_EP}"),
    error("cuda-ep-sorted", L(device=CUDA, ep=True, dispatcher="sorted"),
          "UnquantizedMethod, backend=auto, dispatcher='sorted' on cuda",
          f"TritonUnquantizedExperts: SortedDispatcher: {LOCAL_ONLY}", f"TorchUnquantizedExperts: SortedDispatcher: "
          f"{LOCAL_ONLY}"),
    error("cpu-ep-padded", L("fp8", ep=True, dispatcher="padded"),
          "Fp8W8A8Method(weights=channel, activations=token), backend=auto, dispatcher='padded' on cpu",
          f"TritonW8A8Experts: {ON_CPU}", f"TorchW8A8Experts: PaddedDispatcher: {LOCAL_ONLY}"),
    error("cuda-ep-aligned", L(device=CUDA, ep=True, dispatcher="aligned"),
          "UnquantizedMethod, backend=auto, dispatcher='aligned' on cuda",
          f"TritonUnquantizedExperts: AlignedDispatcher: {LOCAL_ONLY}",
          f"TorchUnquantizedExperts: AlignedDispatcher: {LOCAL_ONLY}"),
    error("cpu-ep-given-sorted", L(ep=True, dispatcher="given:sorted"),
          "UnquantizedMethod, backend=auto, dispatcher='SortedDispatch' on cpu", f"TritonUnquantizedExperts: {ON_CPU}",
          "TorchUnquantizedExperts: GivenDispatcher: an expert-parallel layer needs an expert-parallel dispatcher "
          "(AllToAllDispatch, LowLatencyDispatch or SymmetricDispatch), got SortedDispatch"),
    error("cpu-given-low-latency-without-ep", L(dispatcher="given:low_latency"),
          "UnquantizedMethod, backend=auto, dispatcher='LowLatencyDispatch' on cpu",
          f"TritonUnquantizedExperts: {ON_CPU}",
          "TorchUnquantizedExperts: GivenDispatcher: LowLatencyDispatch exchanges rows between ranks: build the layer "
          "with expert_parallel=ExpertParallel(num_experts, group)"),
    error("cpu-ep-given-other-ep", L(ep=True, dispatcher="given:all_to_all-other-ep"),
          "UnquantizedMethod, backend=auto, dispatcher='AllToAllDispatch' on cpu",
          f"TritonUnquantizedExperts: {ON_CPU}",
          "TorchUnquantizedExperts: GivenDispatcher: the dispatcher's ExpertParallel differs from the layer's "
          "expert_parallel: pass the same one"),
    # quant methods from outside moeforge: MethodOwnExperts is their only candidate
    error("cuda-own-backend-triton", L("own", CUDA, backend="triton"),
          "OwnStages, backend=triton, dispatcher='auto' on cuda", f"MethodOwnExperts: {ASKED_TRITON}"),
    error("cuda-no-stages", L("no-stages", CUDA), "NoStages, backend=auto, dispatcher='auto' on cuda",
          "MethodOwnExperts: the quant method builds no expert stages of its own"),
]


# -- helpers ---------------------------------------------------------------------------------------------------

@pytest.fixture
def triton_installed(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Set whether the triton package counts as installed (what LayerConfig.triton_problem reads)."""
    def setting(installed: bool) -> None:
        monkeypatch.setattr(moeforge.backend, "triton_installed", lambda: installed)
    return setting


def chosen(selection: Selection) -> str:
    experts = selection.experts.name() if selection.experts is not None else "-"
    layout = selection.layout.value if selection.layout is not None else "-"
    return (f"{selection.router.name()} {selection.dispatcher.name()} {experts} {layout} "
            f"{selection.backend.value}")


def check_reasons(found: list[tuple[str, str]], expected: tuple[str, ...]) -> None:
    """``found`` names exactly the candidates of ``expected`` ("Name: substring"), in order, each with the
    substring in its reason (" ... " separates substrings that must appear in this order)."""
    want = [item.split(": ", 1) for item in expected]
    assert [name for name, _ in found] == [name for name, _ in want], found
    for (name, reason), (_, parts) in zip(found, want):
        start = 0
        for part in parts.split(" ... "):
            at = reason.find(part, start)
            assert at >= 0, f"{name}: {reason!r} lacks {part!r}"
            start = at + len(part)


# -- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer, expected, skipped", ROWS)
def test_select(layer: Layer, expected: str, skipped: tuple[str, ...],
                triton_installed: Callable[[bool], None]) -> None:
    triton_installed(layer.triton)
    selection = select(layer.config())
    assert chosen(selection) == expected, selection.describe()
    check_reasons(list(selection.skipped), skipped)
    # describe() says the same: the roles, then one line per skipped candidate with its whole reason
    experts = f", experts {selection.experts.name()}" if selection.experts is not None else ""
    assert selection.describe() == [
        f"roles: router {selection.router.name()}, dispatcher {selection.dispatcher.name()}{experts}",
        *(f"  skipped {name}: {reason}" for name, reason in selection.skipped)]


@pytest.mark.parametrize("layer, head, candidates", ERRORS)
def test_nothing_fits(layer: Layer, head: str, candidates: tuple[str, ...],
                      triton_installed: Callable[[bool], None]) -> None:
    triton_installed(layer.triton)
    with pytest.raises(mf.InputError) as info:
        select(layer.config())
    first, *lines = str(info.value).split("\n")
    assert first == f"no implementation can run this layer ({head}):"
    assert all(line.startswith("  ") and ": " in line for line in lines), lines
    parts = [line[2:].split(": ", 1) for line in lines]
    check_reasons([(part[0], part[-1]) for part in parts], candidates)


@pytest.mark.parametrize("asked", ["bogus", "Sorted", "", "low_latency", None, 3])
def test_an_unknown_dispatcher_keyword(asked: Any) -> None:
    config = attrs.evolve(L().config(), dispatcher=asked)
    with pytest.raises(mf.InputError) as info:
        select(config)
    assert str(info.value) == ("dispatcher must be one of 'auto', 'fused_ep', 'all_to_all', 'aligned', 'sorted', "
                               f"'padded', a dispatch Stage or a Dispatcher instance, got {asked!r}")


def test_describe_lines(triton_installed: Callable[[bool], None]) -> None:
    triton_installed(True)
    assert select(L().config()).describe() == [
        "roles: router TorchRouter, dispatcher SortedDispatcher, experts TorchUnquantizedExperts",
        "  skipped TritonUnquantizedExperts: the layer is on cpu, the triton kernels need a CUDA device"]
    # CUDA, an fp32 layer dispatching bf16 rows, PhiMoE's routing: both triton roles skipped, with their reasons
    layer = L(device=CUDA, dtype="fp32", wire="bf16", routing="sparsemixer")
    assert select(layer.config()).describe() == [
        "roles: router TorchRouter, dispatcher SortedDispatcher, experts TorchUnquantizedExperts",
        "  skipped TritonRouter: the routing kernel does not compute sparsemixer routing",
        "  skipped TritonUnquantizedExperts: its GEMMs read fp32 rows (the layer's dtype), not bf16: dispatch bf16 "
        "(rule 1: explicit setting); dispatch_dtype='fp32' lets them run"]
    assert select(L("w4a4-npu", CUDA, dispatcher="fused_ep").config()).describe() == [
        "roles: router TritonRouter, dispatcher FusedEpDispatcher"]


def test_the_table_covers_every_candidate_and_method(triton_installed: Callable[[bool], None]) -> None:
    """A new quant method, Experts, dispatcher or router gets its rows: every shipped method is in METHODS,
    and every candidate of the selector's lists is chosen by some row."""
    shipped = {value for value in vars(mf).values()
               if isinstance(value, type) and issubclass(value, mf.QuantMethod) and value is not mf.QuantMethod}
    assert shipped <= {type(make()) for make in METHODS.values()}
    picked: set[str] = set()
    for param in ROWS:
        layer = param.values[0]
        triton_installed(layer.triton)
        selection = select(layer.config())
        picked |= {selection.router.name(), selection.dispatcher.name()}
        if selection.experts is not None:
            picked.add(selection.experts.name())
    candidates = {role.name() for role in (*ROUTERS, *EXPERTS, *DISPATCHERS)}
    assert candidates <= picked, f"no row chooses {sorted(candidates - picked)}"
    assert KEYWORDS == ("auto", "fused_ep", "all_to_all", "aligned", "sorted", "padded")


# -- behaviours the table found wrong (fixed) -----------------------------------------------------------------

@pytest.mark.parametrize("batch_invariant", [False, True], ids=["backend-triton", "batch-invariant"])
def test_fused_ep_honours_the_triton_backend(batch_invariant: bool, triton_installed: Callable[[bool], None]) -> None:
    triton_installed(True)
    layer = L("w4a4-npu", CUDA, backend="triton", batch_invariant=batch_invariant, dispatcher="fused_ep")
    with pytest.raises(mf.InputError) as info:
        select(layer.config())
    assert "FusedEpDispatcher" in str(info.value) and "triton" in str(info.value)


@pytest.mark.parametrize("layer", [
    L(backend=None, batch_invariant=True),
    L(device=CUDA, dtype="fp32", wire="bf16", backend=None, batch_invariant=True),
    L(device=CUDA, backend="torch", batch_invariant=True),
], ids=["cpu-auto", "cuda-auto-rows-for-torch", "cuda-torch"])
def test_batch_invariant_never_gets_torch_experts(layer: Layer, triton_installed: Callable[[bool], None]) -> None:
    triton_installed(True)
    try:
        selection = select(layer.config())
    except mf.InputError as error:
        assert "batch_invariant=True" in str(error)
        return
    assert selection.backend is mf.Backend.TRITON, selection.describe()


def test_a_wrong_layout_is_said_once(triton_installed: Callable[[bool], None]) -> None:
    triton_installed(True)
    with pytest.raises(mf.InputError) as info:
        select(L(device=CUDA, backend="torch", dispatcher="aligned").config())
    assert str(info.value).count("it delivers block_aligned rows") == 1, str(info.value)
