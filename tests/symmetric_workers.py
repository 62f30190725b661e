"""What the symmetric-memory dispatcher's tests run on every rank (module level, so spawned ranks import them).

On GPUs (NCCL ranks, one GPU each) the dispatcher uses PyTorch's symmetric memory. On CPU ranks (gloo) the tests
stand in for it with files every rank maps (:func:`emulate_symmetric_memory`): rank ``r``'s window is a shared file,
each rank maps every peer's, and the distance from its own mapping to a peer's is what the kernels add, as on GPUs;
``barrier`` is the process group's. The kernels then run in Triton's interpreter and write into the other processes'
memory, so the exchange itself is exercised on a CPU.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import moeforge as mf
from moeforge.distributed import ExpertParallel, LowLatencyDispatch, SymmetricDispatch, shard_state_dict
from moeforge.distributed.symmetric_window import SymmetricWindow
from moeforge.errors import InputError
from moeforge.stages.dispatch import Overflow

if importlib.util.find_spec("triton") is not None:  # this rank's interpreted kernels lowered too (conftest.py)
    import triton_front_end

    triton_front_end.install()

E, H, I = 8, 32, 16
TOKENS = (5, 0, 3, 1)  # per rank (mod 4): rank 1 sends nothing


class _FileHandle:
    """Stands in for a symmetric-memory handle: the process group's barrier; keeps the peers' mappings alive."""

    def __init__(self, mappings: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
        self.mappings, self.group = mappings, group

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        dist.barrier(group=self.group)


def emulate_symmetric_memory(folder: str) -> None:
    """In this (CPU) process: symmetric windows as shared files under ``folder``, and the transport chosen."""
    counter = itertools.count()

    def allocate(cls: Any, words: int, device: torch.device, group: Optional[dist.ProcessGroup],
                 timeout_ms: int) -> SymmetricWindow:
        index, rank, world = next(counter), dist.get_rank(group), dist.get_world_size(group)
        paths = [os.path.join(folder, f"window-{index}-{r}") for r in range(world)]
        own = torch.from_file(paths[rank], shared=True, size=words, dtype=torch.int32)
        own.zero_()
        dist.barrier(group=group)
        mappings = [own if r == rank else torch.from_file(paths[r], shared=True, size=words, dtype=torch.int32)
                    for r in range(world)]
        deltas = torch.tensor([(m.data_ptr() - own.data_ptr()) // 4 for m in mappings], dtype=torch.int64)
        window: SymmetricWindow = cls(own, deltas, _FileHandle(mappings, group), timeout_ms)
        return window

    SymmetricWindow.allocate = classmethod(allocate)  # type: ignore[method-assign, assignment]
    SymmetricDispatch._why_not = lambda self, device: None  # type: ignore[method-assign]


def _rank_device(rank: int, device_type: str, folder: str) -> torch.device:
    """This rank's GPU (``"cuda"``), or the CPU with symmetric memory emulated under ``folder``."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    emulate_symmetric_memory(folder)
    return torch.device("cpu")


def _randomised(layer: mf.MoELayer, seed: int) -> mf.MoELayer:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(layer.parameters()) + list(layer.buffers()):
            tensor.copy_((torch.randn(tensor.shape, generator=generator) * 0.5).to(tensor.dtype))
    return layer


def _layers(kwargs: dict[str, Any], device: torch.device, dispatchers: dict[str, Any],
            family: Optional[str] = None) -> tuple[mf.MoELayer, dict[str, mf.MoELayer]]:
    """(the whole layer, {name: an expert-parallel layer with this rank's slice, built with that dispatcher})."""
    def build(**extra: Any) -> mf.MoELayer:
        if family is not None:
            return mf.MoELayer.from_preset(family, **kwargs, **extra, device=device)
        return mf.MoELayer(**kwargs, **extra, device=device)

    torch.manual_seed(0)
    whole = _randomised(build(backend="torch").cpu(), 0).to(device)
    ep = ExpertParallel(kwargs["num_experts"])
    parallel = {}
    for name, make in dispatchers.items():
        layer = build(backend="torch", expert_parallel=ep, dispatcher=make(ep))
        layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
        parallel[name] = layer
    return whole, parallel


def _tokens(rank: int, device: torch.device, dtype: torch.dtype = torch.float32, count: Optional[int] = None,
            seed: int = 0) -> torch.Tensor:
    count = TOKENS[rank % len(TOKENS)] if count is None else count
    generator = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    return torch.randn(count, H, generator=generator).to(dtype).to(device)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if not want.numel():
        return 0.0
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def symmetric_layers_match(rank: int, world: int, device_type: str, folder: str = "") -> dict[str, Any]:
    """The symmetric dispatcher's layer against the whole layer and, bit for bit, the NCCL low-latency one: float
    rows, routing weights on the input (Llama 4), FP8 rows with their per-128-group scales, a capacity that drops,
    three calls in a row (the buffers reused), a rank with no tokens, a training step (the NCCL transport's
    backward)."""
    device = _rank_device(rank, device_type, folder)
    out: dict[str, Any] = {"errors": {}, "describe": ""}
    errors = out["errors"]
    cases: dict[str, tuple[dict[str, Any], Optional[str], dict[str, Any]]] = {
        "float": (dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32), None, {}),
        "top-k = experts": (dict(num_experts=E, top_k=E, hidden_size=H, intermediate_size=I, dtype=torch.float32),
                            None, {}),
        "llama4": (dict(num_experts=E, top_k=1, hidden_size=H, intermediate_size=I, dtype=torch.float32), "llama4",
                   {"apply_routing_weights": True}),
        # the down GEMM weighs its rows by the slots' routing weights, which travel beside the rows
        "weights in the epilogue": (dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                                         dtype=torch.float32,
                                         routing=mf.RoutingConfig(apply_weights="in_gemm_epilogue")), None, {}),
    }
    for name, (kwargs, family, options) in cases.items():
        whole, parallel = _layers(kwargs, device, {
            "symmetric": lambda ep, options=options: SymmetricDispatch(ep, max_tokens=8, **options),
            "per copy": lambda ep, options=options: SymmetricDispatch(ep, max_tokens=8, send_tokens_once=False,
                                                                      **options),
            "once": lambda ep, options=options: SymmetricDispatch(ep, max_tokens=8, send_tokens_once=True, **options),
            "summed": lambda ep, options=options: SymmetricDispatch(ep, max_tokens=8, sum_on_owner=True, **options),
            "summed bf16": lambda ep, options=options: SymmetricDispatch(ep, max_tokens=8,
                                                                         sum_on_owner=torch.bfloat16, **options),
            "low_latency": lambda ep, options=options: LowLatencyDispatch(ep, max_tokens=8, **options)}, family)
        for call in range(3):  # the windows reused; each call its own tokens
            x = _tokens(rank, device, seed=call, count=8 if call == 2 else None)
            with torch.no_grad():
                want, got, same = whole(x), parallel["symmetric"](x), parallel["low_latency"](x)
            errors[f"{name}/{call}"] = _rel(got, want)
            assert torch.equal(got, same), f"{name} call {call}: the two transports differ"
            if call != 1:  # (the variants on one call: the interpreter's time)
                continue
            with torch.no_grad():
                per_copy, once, summed = parallel["per copy"](x), parallel["once"](x), parallel["summed"](x)
                errors[f"{name}/{call} bf16 partials"] = _rel(parallel["summed bf16"](x), got)
            errors[f"{name}/{call} summed on the owners"] = _rel(summed, got)  # (another order of the same sums)
            assert torch.equal(once, per_copy), f"{name} call {call}: tokens sent once differ from rows per copy"
            assert torch.equal(got, per_copy), f"{name} call {call}: the default differs from rows per copy"
        if name == "float":
            out["describe"] = parallel["symmetric"].describe()
            out["once describe"] = parallel["once"].describe()
            out["summed describe"] = parallel["summed"].describe()
            try:
                SymmetricDispatch(ExpertParallel(E), max_tokens=8, sum_on_owner=torch.int32)
            except InputError as error:
                out["bad partials"] = str(error)
            try:
                SymmetricDispatch(ExpertParallel(E), max_tokens=8, send_tokens_once="yes")  # type: ignore[arg-type]
            except InputError as error:
                out["bad once"] = str(error)
            try:  # bf16 partials of an odd width: refused when the layer is built, not in the middle of a step
                ep = ExpertParallel(E)
                mf.MoELayer(num_experts=E, top_k=2, hidden_size=33, intermediate_size=I, dtype=torch.float32,
                            expert_parallel=ep, device=device,
                            dispatcher=SymmetricDispatch(ep, max_tokens=8, sum_on_owner=torch.bfloat16))
            except InputError as error:
                out["odd partials"] = str(error)

    # whether tokens go once is the dispatcher's choice, the same on every rank whatever its batch (were it a call's,
    # a rank whose batch is past the threshold would send token rows its owner, below it, never fans out): the
    # threshold set to what max_tokens saves, the ranks' batches on both sides of it
    from moeforge.distributed import symmetric as symmetric_module

    threshold = symmetric_module.TOKENS_ONCE_MIN_BYTES
    symmetric_module.TOKENS_ONCE_MIN_BYTES = symmetric_module.rows_saved_bytes(8, 2, world, H * 4)
    try:
        whole, parallel = _layers(cases["float"][0], device, {
            "symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8),
            "low_latency": lambda ep: LowLatencyDispatch(ep, max_tokens=8)})
        agree = True
        for count in (8 if rank == 0 else TOKENS[rank % 4], TOKENS[rank % 4] if rank == 0 else 8):
            x = _tokens(rank, device, count=count, seed=4)
            with torch.no_grad():
                agree &= torch.equal(parallel["symmetric"](x), parallel["low_latency"](x))
        out["ranks agree to send tokens once"] = agree
    finally:
        symmetric_module.TOKENS_ONCE_MIN_BYTES = threshold

    # every token on the same experts (a zero router: every score ties), and a call where no rank has a token
    whole, parallel = _layers(cases["float"][0], device, {
        "symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8),
        "low_latency": lambda ep: LowLatencyDispatch(ep, max_tokens=8),
        "once, summed": lambda ep: SymmetricDispatch(ep, max_tokens=8, send_tokens_once=True, sum_on_owner=True)})
    with torch.no_grad():
        for layer in (whole, *parallel.values()):
            assert layer.router is not None
            layer.router.weight.zero_()
            if layer.router.bias is not None:
                layer.router.bias.zero_()
        for name, count in (("one expert", 8), ("empty everywhere", 0)):
            x = _tokens(rank, device, count=count)
            got, same = parallel["symmetric"](x), parallel["low_latency"](x)
            assert torch.equal(got, same), f"{name}: the two transports differ"
            errors[name] = _rel(got, whole(x))
            errors[f"{name}, summed on the owners"] = _rel(parallel["once, summed"](x), got)

    # a stack of expert adapters: each copy's adapter id travels beside its row
    from moeforge.adapters import ExpertAdapter

    kwargs = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32,
                  adapter=ExpertAdapter(rank=2, alpha=4, count=3))
    whole, parallel = _layers(kwargs, device, {
        "symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8, send_tokens_once=True),
        "low_latency": lambda ep: LowLatencyDispatch(ep, max_tokens=8)})
    x = _tokens(rank, device)
    ids = ((torch.arange(x.shape[0]) + rank) % 4 - 1).to(device)  # every adapter and none
    with torch.no_grad():
        got, same = parallel["symmetric"](x, adapter_ids=ids), parallel["low_latency"](x, adapter_ids=ids)
        want = whole(x, adapter_ids=ids)
    assert torch.equal(got, same), "adapters: the two transports differ"
    errors["adapters"] = _rel(got, want)

    # the rows block-aligned for the triton expert GEMMs (the layer sets the launch table where its backend is triton;
    # on CPU ranks the pipeline is built by hand, the kernels in the interpreter)
    errors.update(_triton_experts_behind_it(rank, device))

    # FP8 rows and their per-128-group scales on the wire (scales are words too)
    fp8 = lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")  # noqa: E731
    errors["fp8"] = _quantized_rows_match(rank, device, fp8, "fp8", seed=7)
    # NVFP4 rows on the wire: packed 4-bit data and their fp8 block-16 scales (whole 32-bit words at H = 128)
    nvfp4 = lambda: mf.Nvfp4Method(input_global_scale=4.0 / (6 * 448))  # noqa: E731
    errors["nvfp4"] = _quantized_rows_match(rank, device, nvfp4, "nvfp4", seed=8, dispatch_dtype="nvfp4")

    # a capacity that drops copies (8 tokens' 16 copies over 8 experts: one expert gets two): the same copies as the
    # NCCL transport drops; with the copies placed by the routing kernel (decode batches) and by the sort and scans
    # (prefill batches, here with the kernel's limit at 0)
    from moeforge.kernels import symmetric_rows

    limit = symmetric_rows.ROUTE_MAX_COPIES
    kwargs = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32)
    for route_limit in (limit, 0):
        symmetric_rows.ROUTE_MAX_COPIES = route_limit
        for capacity in (None, 1):
            whole, parallel = _layers(kwargs, device, {
                "symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8, capacity=capacity, overflow=Overflow.DROP,
                                                          send_tokens_once=route_limit == 0),
                "low_latency": lambda ep: LowLatencyDispatch(ep, max_tokens=8, capacity=capacity,
                                                             overflow=Overflow.DROP),
                "summed": lambda ep: SymmetricDispatch(ep, max_tokens=8, capacity=capacity, overflow=Overflow.DROP,
                                                       sum_on_owner=True)})
            x = _tokens(rank, device, count=8)
            with torch.no_grad():
                got, same, want = parallel["symmetric"](x), parallel["low_latency"](x), whole(x)
                summed = parallel["summed"](x)  # (dropped copies: no partial from their owner)
            assert torch.equal(got, same), f"capacity {capacity}, route limit {route_limit}: the transports differ"
            errors[f"capacity {capacity}, route limit {route_limit} summed on the owners"] = _rel(summed, got)
            if capacity is None:
                errors[f"route limit {route_limit}"] = _rel(got, want)
            else:
                out["dropped_changes_output"] = _rel(got, want) > 1e-3
    symmetric_rows.ROUTE_MAX_COPIES = limit

    # overflow=ERROR: every rank raises together (rank 1 sends nothing, yet learns of the others' overflow)
    parallel = _layers(kwargs, device, {"symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8, capacity=1)})[1]
    try:
        with torch.no_grad():
            parallel["symmetric"](_tokens(rank, device, count=8 if rank != 1 else 0))
    except InputError as error:
        out["overflow_raised"] = "capacity overflow" in str(error)

    # a call larger than max_tokens is refused before any exchange, on every rank alike
    try:
        with torch.no_grad():
            parallel["symmetric"](_tokens(rank, device, count=9))
    except InputError as error:
        out["too_many"] = "max_tokens=8" in str(error)

    # training: the NCCL transport carries the backward; the gradients equal the whole layer's
    whole, parallel = _layers(cases["float"][0], device, {
        "symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8)})
    x = _tokens(rank, device, count=5)
    rows = x.clone().requires_grad_()
    got = parallel["symmetric"](rows)
    (grad,) = torch.autograd.grad((got * (1 + torch.arange(H, device=device))).sum(), [rows])
    rows = x.clone().requires_grad_()
    want = whole(rows)
    (want_grad,) = torch.autograd.grad((want * (1 + torch.arange(H, device=device))).sum(), [rows])
    errors["train/output"] = _rel(got, want)
    errors["train/grad"] = _rel(grad, want_grad)

    # what a decode graph is told (moeforge.decode_graphs), before a call and after one: nothing read on the host at
    # the default capacity; a capacity that can overflow under overflow=ERROR reads it
    _, answering = _layers(cases["float"][0], device, {
        "default": lambda ep: SymmetricDispatch(ep, max_tokens=8),
        "capacity 7": lambda ep: SymmetricDispatch(ep, max_tokens=8, capacity=7)})
    for name, layer in answering.items():
        stage = next(stage for stage in layer.pipeline.stages if isinstance(stage, SymmetricDispatch))
        before = stage.replay_refusal(device)
        with torch.no_grad():
            layer(_tokens(rank, device, count=4))
        out[f"replay {name}"] = (before, stage.replay_refusal(device))
    return out



def _quantized_rows_match(rank: int, device: torch.device, method: Any, name: str, *, seed: int,
                          **layer_kwargs: Any) -> float:
    """A quantized layer behind ``SymmetricDispatch`` and behind ``LowLatencyDispatch``: bit-equal to each other,
    and the error against the whole layer on one process (returned)."""
    kwargs = dict(num_experts=E, top_k=2, hidden_size=128, intermediate_size=128, dtype=torch.float32, **layer_kwargs)
    torch.manual_seed(0)
    whole = mf.MoELayer(**kwargs, quant=method(), backend="torch", environ={}, device=device)
    ep = ExpertParallel(E)
    layers = {}
    for kind, dispatcher in (("symmetric", SymmetricDispatch(ep, max_tokens=8, send_tokens_once=True)),
                             ("low_latency", LowLatencyDispatch(ep, max_tokens=8))):  # (scales on the token rows)
        layer = mf.MoELayer(**kwargs, quant=method(), backend="torch", environ={}, expert_parallel=ep,
                            dispatcher=dispatcher, device=device)
        layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
        layer.process_weights_after_loading()
        layers[kind] = layer
    x = torch.randn(TOKENS[rank % 4], 128, generator=torch.Generator().manual_seed(seed + rank)).to(device)
    with torch.no_grad():
        got, same, want = layers["symmetric"](x), layers["low_latency"](x), whole(x)
    assert torch.equal(got, same), f"{name}: the two transports differ"
    assert "symmetric memory (NVLink)" in layers["symmetric"].describe(), layers["symmetric"].describe()
    return _rel(got, want)

def symmetric_without_its_transport(rank: int, world: int) -> dict[str, Any]:
    """CPU ranks without the emulation: the dispatcher serves through the NCCL/gloo low-latency exchange and says
    why."""
    kwargs = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32)
    whole, parallel = _layers(kwargs, torch.device("cpu"),
                              {"symmetric": lambda ep: SymmetricDispatch(ep, max_tokens=8)})
    described_before = parallel["symmetric"].describe()
    x = _tokens(rank, torch.device("cpu"))
    with torch.no_grad():
        error = _rel(parallel["symmetric"](x), whole(x))
    stage = next(stage for stage in parallel["symmetric"].pipeline.stages if isinstance(stage, SymmetricDispatch))
    return {"error": error, "before": described_before, "after": parallel["symmetric"].describe(),
            "replay": stage.replay_refusal(torch.device("cpu"))}


def _triton_experts_behind_it(rank: int, device: torch.device) -> dict[str, float]:
    """fp16 rows through ``SymmetricDispatch`` aligned for the triton GEMMs: equal to the whole layer (and, on a GPU,
    the layer picks the triton experts behind it by itself)."""
    from moeforge.kernels.config import ConfigTable
    from moeforge.stages.triton import FusedGroupedGemm

    kwargs = dict(num_experts=E, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float16)
    torch.manual_seed(0)
    whole = _randomised(mf.MoELayer(**kwargs, backend="torch").cpu(), 0).to(device)
    ep = ExpertParallel(E)
    x = torch.randn(TOKENS[rank % 4] + 2, 128, generator=torch.Generator().manual_seed(9 + rank)).half().to(device)
    errors = {}
    if device.type == "cuda":
        for kind, dispatcher in (("symmetric", SymmetricDispatch(ep, max_tokens=8)),
                                 ("low_latency", LowLatencyDispatch(ep, max_tokens=8))):
            layer = mf.MoELayer(**kwargs, backend="triton", expert_parallel=ep, device=device, dispatcher=dispatcher)
            layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
            described = layer.describe()
            assert "FusedGroupedGemm" in described and "block-aligned" in described, described
            with torch.no_grad():
                errors[f"triton layer/{kind}"] = _rel(layer(x), whole(x))
        return errors
    parallel = mf.MoELayer(**kwargs, backend="torch", expert_parallel=ep)
    parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
    table = ConfigTable(E, 2)
    dispatch = SymmetricDispatch(ep, max_tokens=8, configs=table)
    stages: list[mf.Stage[Any, Any]] = [
        mf.TopK(E, 2, parallel.routing), dispatch,
        FusedGroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(parallel, "w13_weight"), table, None, mf.ActivationConfig()),
        FusedGroupedGemm(mf.GemmRole.DOWN, mf.ParamRef(parallel, "w2_weight"), table),
        dispatch.combine_stage(out_dtype=mf.DType.FP16)]
    pipeline = mf.Pipeline(stages, mf.input_spec(128, torch.float16, E), debug=True)
    assert "block-aligned" in pipeline.describe(), pipeline.describe()
    with torch.no_grad():
        got = pipeline(mf.MoEInput(x, whole.router_logits(x))).hidden_states
        errors["triton pipeline"] = _rel(got, whole(x))
    return errors


def compact_buffers_match(rank: int, world: int, device_type: str, folder: str = "") -> dict[str, Any]:
    """Compact buffers (``max_rows``): the triton GEMMs behind them equal the whole layer; without the triton GEMMs
    the all-to-all exchange serves and says why; a rank receiving more than ``max_rows`` rows raises on every rank
    (``ERROR``) or drops and counts (``DROP``)."""
    from moeforge.kernels.config import ConfigTable
    from moeforge.stages.triton import FusedGroupedGemm

    device = _rank_device(rank, device_type, folder)
    out: dict[str, Any] = {"errors": {}}
    kwargs = dict(num_experts=E, top_k=2, hidden_size=128, intermediate_size=64, dtype=torch.float16)
    torch.manual_seed(0)
    whole = _randomised(mf.MoELayer(**kwargs, backend="torch").cpu(), 0).to(device)
    ep = ExpertParallel(E)

    def tokens(count: int, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(9 + rank + 100 * seed)
        return torch.randn(count, 128, generator=generator).half().to(device)

    # without the triton GEMMs (torch backend): the all-to-all exchange, and describe() says why
    torched = mf.MoELayer(**kwargs, backend="torch", expert_parallel=ep, device=device,
                          dispatcher=SymmetricDispatch(ep, max_tokens=8, max_rows=world * 16))
    torched.load_state_dict(shard_state_dict(whole.state_dict(), torched))
    x = tokens(TOKENS[rank % 4])
    with torch.no_grad():
        out["errors"]["torch layer"] = _rel(torched(x), whole(x))
    out["torch describe"] = torched.describe()

    def triton_layer(reference: Any = whole, **options: Any) -> Any:
        """The triton GEMMs behind compact buffers, ``reference``'s shape, top-k, adapter and weights: a callable of
        the tokens (and adapter ids) and the pipeline's ``describe``."""
        shape = dict(kwargs, top_k=reference.top_k, adapter=reference.adapter)
        if device.type == "cuda":
            layer = mf.MoELayer(**shape, backend="triton", expert_parallel=ep, device=device,
                                dispatcher=SymmetricDispatch(ep, max_tokens=8, **options))
            layer.load_state_dict(shard_state_dict(reference.state_dict(), layer))
            return (lambda x, ids=None: layer(x, adapter_ids=ids)), layer.describe
        from moeforge.adapters import adapt

        parallel = mf.MoELayer(**shape, backend="torch", expert_parallel=ep)
        parallel.load_state_dict(shard_state_dict(reference.state_dict(), parallel))
        table = ConfigTable(E, reference.top_k)
        dispatch = SymmetricDispatch(ep, max_tokens=8, configs=table, **options)
        stages: list[mf.Stage[Any, Any]] = [
            mf.TopK(E, reference.top_k, parallel.routing), dispatch,
            FusedGroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(parallel, "w13_weight"), table, None,
                             mf.ActivationConfig()),
            FusedGroupedGemm(mf.GemmRole.DOWN, mf.ParamRef(parallel, "w2_weight"), table),
            dispatch.combine_stage(out_dtype=mf.DType.FP16)]
        if reference.adapter is not None:
            stages = adapt(stages, parallel, reference.adapter)
        pipeline = mf.Pipeline(stages, mf.input_spec(128, torch.float16, E), debug=True)
        return (lambda x, ids=None: pipeline(mf.MoEInput(x, reference.router_logits(x), ids)).hidden_states,
                pipeline.describe)

    layer, describe = triton_layer(max_rows=world * 16, send_tokens_once=True)  # never overflows: 8 tokens x 2
    per_copy, _ = triton_layer(max_rows=world * 16, send_tokens_once=False)  # copies from each rank
    summed, _ = triton_layer(max_rows=world * 16, sum_on_owner=True)
    for call in range(2):
        x = tokens(TOKENS[rank % 4] + 2 * call, seed=call)
        with torch.no_grad():
            got = layer(x)
            out["errors"][f"triton/{call}"] = _rel(got, whole(x))
            assert torch.equal(got, per_copy(x)), f"call {call}: tokens sent once differ from rows per copy"
            out["errors"][f"triton/{call} summed on the owners"] = _rel(summed(x), got)
    out["triton describe"] = describe()

    # Only a buffer that can overflow is checked (a host read): one holding every copy of every rank's largest batch
    # (8 tokens x top-2 from each rank) is not, one row less is.
    checked: list[Optional[int]] = []
    check = SymmetricDispatch._check_rows

    def counted(self: SymmetricDispatch, *args: Any) -> None:
        checked.append(self.max_rows)
        check(self, *args)

    below, _ = triton_layer(max_rows=world * 16 - 1)
    setattr(SymmetricDispatch, "_check_rows", counted)
    try:
        x = tokens(2, seed=4)  # fits either buffer
        with torch.no_grad():
            out["errors"]["triton/checked buffer"] = _rel(below(x), layer(x))
    finally:
        setattr(SymmetricDispatch, "_check_rows", check)
    out["checked"] = checked

    out["errors"]["triton fp8"] = _fp8_compact(rank, world, device, tokens(TOKENS[rank % 4] + 1, seed=3))

    # every token on the same experts (one token repeated), no token on any rank, and top-k = every expert
    same = tokens(1, seed=6).expand(8, -1).contiguous()
    with torch.no_grad():
        out["errors"]["triton same experts"] = _rel(layer(same), whole(same))
        empty = layer(tokens(0))
    out["empty everywhere"] = tuple(empty.shape)
    torch.manual_seed(0)
    every = _randomised(mf.MoELayer(**dict(kwargs, top_k=E), backend="torch").cpu(), 1).to(device)
    all_experts, _ = triton_layer(every, max_rows=world * 8 * E)
    x = tokens(TOKENS[rank % 4] + 1, seed=7)
    with torch.no_grad():
        out["errors"]["triton top-k = experts"] = _rel(all_experts(x), every(x))

    # a stack of adapters, each copy's id beside its row into the compact buffer
    from moeforge.adapters import ExpertAdapter

    torch.manual_seed(0)
    stacked = _randomised(mf.MoELayer(**kwargs, adapter=ExpertAdapter(rank=2, alpha=4, count=3),
                                      backend="torch").cpu(), 2).to(device)
    adapted, _ = triton_layer(stacked, max_rows=world * 16)
    x = tokens(TOKENS[rank % 4] + 1, seed=8)
    ids = ((torch.arange(x.shape[0]) + rank) % 4 - 1).to(device)  # every adapter and none
    with torch.no_grad():
        out["errors"]["triton adapters"] = _rel(adapted(x, ids), stacked(x, adapter_ids=ids))
        out["adapters change the output"] = _rel(stacked(x, adapter_ids=ids), stacked(x, adapter_ids=ids * 0 - 1)) > 1e-2

    # max_rows = 2: with every rank's 8 tokens, some rank receives more
    x = tokens(8, seed=5)
    layer, _ = triton_layer(max_rows=2)
    try:
        with torch.no_grad():
            layer(x)
    except InputError as error:
        out["overflow raised"] = "max_rows=2" in str(error)
    layer, _ = triton_layer(max_rows=2, overflow=Overflow.DROP)
    with torch.no_grad():
        dropped = layer(x)
    out["dropped changes output"] = bool(torch.isfinite(dropped).all()) and _rel(dropped, whole(x)) > 1e-3
    return out


def _fp8_compact(rank: int, world: int, device: torch.device, x: torch.Tensor) -> float:
    """FP8 rows with their per-128-group scales through compact buffers to the triton FP8 GEMMs, against the whole
    FP8 layer on the torch stages."""
    from moeforge.kernels.config import ConfigTable
    from moeforge.selector import expert_stages
    from moeforge.stages.triton_quant import TritonQuantizeTokens

    kwargs = dict(num_experts=E, top_k=2, hidden_size=128, intermediate_size=128, dtype=torch.float16)
    method = lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")  # noqa: E731
    torch.manual_seed(0)
    whole = mf.MoELayer(**kwargs, quant=method(), backend="torch", environ={}, device=device)
    ep = ExpertParallel(E)
    if device.type == "cuda":
        layer = mf.MoELayer(**kwargs, quant=method(), backend="triton", environ={}, expert_parallel=ep, device=device,
                            dispatcher=SymmetricDispatch(ep, max_tokens=8, max_rows=world * 16))
        layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
        layer.process_weights_after_loading()
        with torch.no_grad():
            return _rel(layer(x), whole(x))
    parallel = mf.MoELayer(**kwargs, quant=method(), backend="torch", environ={}, expert_parallel=ep)
    parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
    parallel.process_weights_after_loading()
    table = ConfigTable(E, 2)
    dispatch = SymmetricDispatch(ep, max_tokens=8, max_rows=world * 16, configs=table)
    decision = parallel.dispatch_decision.dtype
    stages: list[mf.Stage[Any, Any]] = [mf.TopK(E, 2, parallel.routing)]
    quantize = parallel.quant.quantize_stage(decision, mf.DType.FP16)
    if isinstance(quantize, mf.QuantizeTokens):
        stages.append(TritonQuantizeTokens(quantize.quantizer))
    stages.append(dispatch)
    stages += expert_stages(parallel.quant, parallel, activation=parallel.activation, routing_weights_in_epilogue=False,
                            backend=mf.Backend.TRITON, configs=table, dispatch=decision)
    stages.append(dispatch.combine_stage(out_dtype=mf.DType.FP16))
    pipeline = mf.Pipeline(stages, mf.input_spec(128, torch.float16, E), debug=True)
    with torch.no_grad():
        got = pipeline(mf.MoEInput(x, whole.router_logits(x))).hidden_states
    assert "symmetric memory (NVLink)" in dispatch.summary(), dispatch.summary()
    return _rel(got, whole(x))


def a_rank_stops_answering(rank: int, world: int) -> None:
    """GPUs: after one exchange together, rank 1 stops calling the dispatcher; rank 0's next exchange must fail at its
    barrier's timeout (a device error), not wait for ever."""
    import time

    from moeforge.payloads import Activations, RoutedTokens, TopKOutput

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dispatch = SymmetricDispatch(ExpertParallel(E), max_tokens=8, timeout_ms=2000)
    ids = torch.randint(0, E, (4, 2), device=device, dtype=torch.int32)
    routed = RoutedTokens(Activations(torch.randn(4, H, device=device)), TopKOutput(torch.rand(4, 2, device=device),
                                                                                    ids))
    dispatch(routed)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(3600)
    dispatch(routed)
    torch.cuda.synchronize()



def decode_graphs_match(rank: int, world: int) -> dict[str, Any]:
    """Decode graphs on expert-parallel layers (each rank's GPU): every rank captures when its own batch size is new —
    the ranks' sizes differ call by call, and the ranks evict graphs at different calls — and every output equals,
    bit for bit, the same layer launched without graphs; a dispatcher that reads a count on the host runs eagerly
    and says why."""
    from moeforge.decode_graphs import DecodeGraphSettings
    from moeforge.distributed import AllToAllDispatch

    device = _rank_device(rank, "cuda", "")
    kwargs = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16, device=device)
    torch.manual_seed(0)
    whole = _randomised(mf.MoELayer(**{**kwargs, "device": "cpu"}, backend="torch"), 0).to(device)
    ep = ExpertParallel(E)
    makers: dict[str, tuple[str, Any]] = {
        "symmetric": ("torch", lambda: SymmetricDispatch(ep, max_tokens=8)),
        "symmetric, triton": ("triton", lambda: SymmetricDispatch(ep, max_tokens=8)),
        "compact, triton": ("triton", lambda: SymmetricDispatch(ep, max_tokens=8, max_rows=world * 16,
                                                                sum_on_owner=torch.bfloat16)),
        "low latency": ("torch", lambda: LowLatencyDispatch(ep, max_tokens=8)),
        "capacity 7": ("torch", lambda: SymmetricDispatch(ep, max_tokens=8, capacity=7)),  # (no batch of 7 overflows)
        "all-to-all": ("torch", lambda: AllToAllDispatch(ep)),
    }
    sizes = [(3, 7), (3, 2), (5, 2), (1, 6), (3, 1), (7, 7), (2, 4), (3, 2)]  # (rank 0, rank 1) per call
    out: dict[str, Any] = {"equal": {}, "graphs": {}, "refusals": {}}
    for name, (backend, make) in makers.items():
        layers = []
        for graphs in (DecodeGraphSettings(max_tokens=8, max_graphs=3), None):
            layer = mf.MoELayer(**kwargs, backend=backend, expert_parallel=ep, dispatcher=make(),
                                decode_graphs=graphs)
            layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
            layers.append(layer)
        graphed, plain = layers
        equal = True
        for call, counts in enumerate(sizes):
            x = _tokens(rank, device, torch.bfloat16, count=counts[rank % 2], seed=call)
            with torch.no_grad():
                got = graphed(x)
                equal = equal and torch.equal(got, plain(x))
        assert graphed.decode_graphs is not None
        out["equal"][name] = equal
        out["graphs"][name] = len(graphed.decode_graphs)
        out["refusals"][name] = graphed.decode_graphs.refusals()
    return out
