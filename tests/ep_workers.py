"""Functions the expert-parallel tests run on every rank (module level, so spawned ranks import them).

Each builds the same whole layer on every rank (same seed), an expert-parallel layer holding this
rank's experts, feeds both this rank's own tokens, and asserts they agree; the returned values let
the parent test check cross-rank facts (bytes conservation, dropped counts).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import torch

import moeforge as mf
from moeforge.selector import expert_stages as selected_stages
from moeforge.distributed import (
    AllToAllDispatch,
    ExpertParallel,
    LowLatencyDispatch,
    RowFormat,
    shard_state_dict,
)
from moeforge.errors import InputError

if importlib.util.find_spec("triton") is not None:  # this rank's interpreted kernels lowered too (conftest.py)
    import triton_front_end

    triton_front_end.install()

E, H, I = 8, 32, 16
TOKENS = (5, 0, 3, 1)  # per rank (mod 4): rank 1 sends nothing


def _randomised(layer: mf.MoELayer, seed: int) -> mf.MoELayer:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(layer.parameters()) + list(layer.buffers()):
            values = torch.randn(tensor.shape, generator=generator) * 0.5
            tensor.copy_(values.to(tensor.dtype))
    return layer


def _pair(kwargs: dict[str, Any], family: Optional[str] = None, seed: int = 0,
          **ep_kwargs: Any) -> tuple[mf.MoELayer, mf.MoELayer]:
    """(whole layer, expert-parallel layer with this rank's slice of the same weights)."""
    def build(**extra: Any) -> mf.MoELayer:
        if family is not None:
            return mf.MoELayer.from_preset(family, **kwargs, **extra)
        return mf.MoELayer(**kwargs, **extra)

    torch.manual_seed(seed)
    whole = _randomised(build(backend="torch"), seed)
    ep = ExpertParallel(kwargs["num_experts"])
    dispatcher = ep_kwargs.pop("dispatcher", None)
    parallel = build(backend="torch", expert_parallel=ep,
                     dispatcher=dispatcher(ep) if dispatcher is not None else "auto", **ep_kwargs)
    parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
    return whole, parallel


def _tokens(rank: int, dtype: torch.dtype = torch.float32, hidden: int = H, count: Optional[int] = None) -> torch.Tensor:
    count = TOKENS[rank % len(TOKENS)] if count is None else count
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> float:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.detach(), want.detach()
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)) if want.numel() else 0.0
    assert err <= tol, f"{what}: rel L2 error {err:.3g} > {tol:g}"
    return err


BASE = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32)


def layers_match(rank: int, world: int) -> dict[str, float]:
    """The expert-parallel layer equals the whole layer: plain, top_k = E, bf16, families, skewed
    routing, low-latency dispatch."""
    errors: dict[str, float] = {}
    x = _tokens(rank)
    whole, parallel = _pair(BASE)
    errors["basic"] = _close(parallel(x), whole(x), "basic")
    assert "AllToAllDispatch" in parallel.describe() and "expert parallel: rank" in parallel.describe()
    # What each dispatcher answers a decode graph (replayed only where a replay does what a call does), and a layer
    # with decode graphs on the CPU runs as without them.
    from moeforge.decode_graphs import DecodeGraphSettings

    cpu = torch.device("cpu")
    ep = ExpertParallel(E)
    assert "split sizes on the host" in (AllToAllDispatch(ep).replay_refusal(cpu) or "")
    assert LowLatencyDispatch(ep, max_tokens=8).replay_refusal(cpu) is None
    assert LowLatencyDispatch(ep, max_tokens=8, capacity=4, overflow="drop").replay_refusal(cpu) is None
    assert "capacity=4" in (LowLatencyDispatch(ep, max_tokens=8, capacity=4).replay_refusal(cpu) or "")
    _, graphed = _pair(BASE, decode_graphs=DecodeGraphSettings())
    assert torch.equal(graphed(x), parallel(x)) and graphed.decode_graphs is not None and not len(graphed.decode_graphs)

    # Every token to expert 0 (rank 0 owns it): the other ranks receive nothing.
    logits = torch.full((x.shape[0], E), -10.0)
    logits[:, 0], logits[:, 1] = 5.0, 4.0
    errors["skewed"] = _close(parallel(x, logits), whole(x, logits), "skewed")
    # Every token to the last rank's experts.
    logits = torch.full((x.shape[0], E), -10.0)
    logits[:, -1], logits[:, -2] = 5.0, 4.0
    errors["skewed_last"] = _close(parallel(x, logits), whole(x, logits), "skewed to the last rank")

    whole, parallel = _pair({**BASE, "top_k": E})
    errors["top_k=E"] = _close(parallel(x), whole(x), "top_k = num_experts")

    whole, parallel = _pair({**BASE, "dtype": torch.bfloat16})
    xb = x.to(torch.bfloat16)
    errors["bf16"] = _close(parallel(xb), whole(xb), "bf16", tol=1e-2)

    families: dict[str, dict[str, Any]] = {
        "deepseek_v3": dict(n_group=4, topk_group=2, routed_scaling_factor=2.5),
        "gpt_oss": {},  # routing weights in the GEMM epilogue, expert biases
        "llama4": {},  # routing weights on the expert input
        "mixtral": {},
    }
    for family, options in families.items():
        kwargs = {**BASE, **options}
        whole, parallel = _pair(kwargs, family=family)
        errors[family] = _close(parallel(x), whole(x), family)
        low_latency = _pair(kwargs, family=family, dispatcher=lambda ep: LowLatencyDispatch(
            ep, max_tokens=8, apply_routing_weights=family == "llama4"))[1]
        errors[family + "/low_latency"] = _close(low_latency(x), whole(x), family + " low-latency")

    whole, parallel = _pair(BASE, dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8))
    errors["low_latency"] = _close(parallel(x), whole(x), "low-latency")
    assert "LowLatencyDispatch" in parallel.describe()
    return errors


def _stages(ep_dispatch: Any, combine: Any, quantize: Optional[mf.Stage[Any, Any]], layer: mf.MoELayer) -> mf.Pipeline:
    stages: list[mf.Stage[Any, Any]] = [mf.TopK(E, 2, mf.RoutingConfig())]
    if quantize is not None:
        stages.append(quantize)
    stages += [
        ep_dispatch,
        mf.GroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(layer, "w13_weight"), out_dtype=mf.DType.FP32),
        mf.Activate(mf.ActivationConfig()),
        mf.GroupedGemm(mf.GemmRole.DOWN, mf.ParamRef(layer, "w2_weight")),
        combine,
    ]
    return mf.Pipeline(stages, mf.input_spec(layer.hidden_size, torch.float32, E))


def fp8_on_the_wire(rank: int, world: int) -> dict[str, Any]:
    """FP8 (per-token and per-128-group) and INT8 dispatch through both dispatchers: the same result as
    the same quantized pipeline on one process, and about half the bytes of 16-bit dispatch."""
    hidden = 128
    kwargs = {**BASE, "hidden_size": hidden}
    whole, parallel = _pair(kwargs)
    ep = parallel.expert_parallel
    assert ep is not None
    x = _tokens(rank, hidden=hidden, count=6)
    logits = whole.router_logits(x)
    payload = mf.MoEInput(x, logits)
    quantizers: dict[str, Optional[mf.Stage[Any, Any]]] = {
        "fp32": None,
        "bf16": mf.QuantizeTokens(mf.Cast(mf.DType.BF16)),
        "fp8": mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.FP8_E4M3)),
        "fp8/group": mf.QuantizeTokens(mf.PerGroupQuantizer()),
        "int8": mf.QuantizeTokens(mf.PerTokenQuantizer(mf.DType.INT8)),
    }
    traffic: dict[str, Any] = {}
    for name, quantize in quantizers.items():
        reference = _stages(mf.SortedDispatch(E), mf.Combine(out_dtype=mf.DType.FP32), quantize, whole)(payload)
        for kind, dispatch in (("all_to_all", AllToAllDispatch(ep)),
                               ("low_latency", LowLatencyDispatch(ep, max_tokens=8))):
            pipeline = _stages(dispatch, dispatch.combine_stage(out_dtype=mf.DType.FP32), quantize, parallel)
            out = pipeline(payload)
            _close(out.hidden_states, reference.hidden_states, f"{name} {kind}")
            # The dispatch's own record of its bytes.
            routed = payload
            for stage in pipeline.stages[: pipeline.stages.index(dispatch) + 1]:
                routed = stage(routed)
            traffic[f"{name}/{kind}"] = (routed.plan.traffic.sent, routed.plan.traffic.received)
            if kind == "all_to_all":  # the way home: the received rows, as fp32 outputs
                back = routed.plan.combine_traffic(4 * hidden)
                assert back.sent == routed.x.data.shape[0] * 4 * hidden
                traffic[f"{name}/combine"] = (back.sent, back.received)
    formats = {name: RowFormat.for_dispatch(mf.DispatchDtype.parse(name.split("/")[0]), hidden,
                                            mf.ScaleLayout.PER_GROUP_128 if "group" in name else
                                            mf.ScaleLayout.PER_TOKEN if name in ("fp8", "int8") else
                                            mf.ScaleLayout.NONE).row_bytes
               for name in quantizers}
    return {"traffic": traffic, "row_bytes": formats}


def overflow(rank: int, world: int) -> dict[str, Any]:
    """Capacity overflow: DROP leaves out the copies beyond capacity (counted), ERROR raises on every
    rank (not only the one that overflowed)."""
    whole, _ = _pair(BASE)
    x = _tokens(rank, count=6)
    logits = torch.full((6, E), -10.0)
    logits[:, rank % E] = 5.0  # every token of this rank to one expert: 6 copies for capacity 2
    logits[:, (rank + 3) % E] = 4.0
    dropping = _pair(BASE, dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8, capacity=2,
                                                                   overflow=mf.Overflow.DROP))[1]
    out = dropping(x, logits)
    # The reference: the same layer with each expert's copies beyond the first two (in token order) removed.
    routed = mf.TopK(E, 2, mf.RoutingConfig())(mf.MoEInput(x, logits))
    keep = torch.zeros_like(routed.topk.weights, dtype=torch.bool)
    seen: dict[int, int] = {}
    for t in range(6):
        for k in range(2):
            expert = int(routed.topk.ids[t, k])
            keep[t, k] = seen.get(expert, 0) < 2
            seen[expert] = seen.get(expert, 0) + 1
    reference = torch.zeros_like(x)
    for t in range(6):
        for k in range(2):
            if keep[t, k]:
                e = int(routed.topk.ids[t, k])
                hidden = x[t] @ whole.w13_weight[e].t()
                act = torch.nn.functional.silu(hidden[:I]) * hidden[I:]
                reference[t] += routed.topk.weights[t, k] * (act @ whole.w2_weight[e].t())
    _close(out, reference, "dropped copies left out")
    dispatch = dropping.pipeline.stages[1]
    dropped = int(dispatch(routed).plan.dropped)
    assert dropped == int((~keep).sum()), (dropped, int((~keep).sum()))

    erroring = _pair(BASE, dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8, capacity=2))[1]
    # Only rank 0 overflows; the other ranks spread 6 tokens x 2 copies over 8 experts (<= 2 each).
    spread = torch.full((6, E), -10.0)
    for t in range(6):
        spread[t, (2 * t) % E], spread[t, (2 * t + 1) % E] = 5.0, 4.0
    try:
        erroring(x, logits if rank == 0 else spread)
    except InputError as error:
        assert "capacity overflow" in str(error)
    else:
        raise AssertionError("Overflow.ERROR did not raise on this rank")
    too_many = _tokens(rank, count=9)
    try:
        erroring(too_many)
    except InputError as error:
        assert "max_tokens=8" in str(error)
    else:
        raise AssertionError("a batch above max_tokens did not raise")
    return {"dropped": dropped}


def contracts(rank: int, world: int) -> None:
    """Exchanged rows go home through their plan, so the plain Combine takes them (the same output
    as the dispatcher's combine_stage()); a per-tensor scale cannot travel."""
    whole, parallel = _pair(BASE)
    ep = parallel.expert_parallel
    assert ep is not None
    x = _tokens(rank)
    payload = mf.MoEInput(x, whole.router_logits(x))
    want = whole.pipeline(payload).hidden_states
    for dispatch in (AllToAllDispatch(ep), LowLatencyDispatch(ep, max_tokens=max(TOKENS))):
        for combine in (mf.Combine(), dispatch.combine_stage(), AllToAllDispatch(ep).combine_stage()):
            got = _stages(dispatch, combine, None, parallel)(payload).hidden_states
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The low-latency rows' empty slots were never sent (their bytes are whatever the buffers held: freed NaN
    # memory here): the layout still gives them a routing weight of 0.
    low_latency = LowLatencyDispatch(ep, max_tokens=max(TOKENS))
    routed = mf.TopK(E, 2, mf.RoutingConfig())(payload)
    for _ in range(3):
        stale = torch.full((4096,), float("nan"))
        del stale
        rows = low_latency(routed)
        assert isinstance(rows, mf.PaddedRows)
        used = torch.arange(rows.capacity) < rows.masked_m.unsqueeze(1)
        assert bool((rows.slot_weights[~used] == 0).all()), "an empty slot carries a routing weight"
    try:
        _stages(AllToAllDispatch(ep), AllToAllDispatch(ep).combine_stage(),
                mf.QuantizeTokens(mf.PerTensorQuantizer()), parallel)
    except mf.ContractError as error:
        assert error.field == "scale_layout" and "per-tensor" in error.hint
    else:
        raise AssertionError("a per-tensor scale was dispatched")


def fail_on_rank_one(rank: int, world: int) -> None:
    """Rank 1 fails before the exchange; the others are left waiting in it."""
    _, parallel = _pair(BASE)
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    parallel(_tokens(rank))


def fail_where_teardown_hangs(rank: int, world: int) -> None:
    """Rank 0 fails in a process whose process group cannot be torn down (an NCCL group after a device error
    never finishes destroying itself): its failure must still reach the parent. Rank 1 waits for an hour."""
    import time

    torch.distributed.destroy_process_group = lambda *args, **kwargs: time.sleep(3600)
    if rank == 0:
        raise RuntimeError("rank 0 hit a device error")
    time.sleep(3600)


def hang_on_rank_one(rank: int, world: int) -> None:
    """Rank 1 never returns (a stuck kernel, a deadlock); run_ranks' deadline must end the run."""
    if rank == 1:
        import time

        time.sleep(3600)


def quantized_layers_match(rank: int, world: int) -> dict[str, float]:
    """Expert parallelism with quant methods: FP8 (rows and per-128-group scales on the wire), INT8,
    W4A16 and NVFP4 experts, each through both dispatchers, equal the whole quantized layer."""
    hidden = 128
    methods = {
        "fp8 block/group": lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group"),
        "fp8 channel/token": lambda: mf.Fp8W8A8Method(weight_scales="channel", activation_scales="token"),
        "int8": lambda: mf.Int8W8A8Method(),
        "w4a16": lambda: mf.W4A16Method(group_size=32),
    }
    x = _tokens(rank, hidden=hidden)
    errors = {}
    for name, make in methods.items():
        kwargs = {**BASE, "hidden_size": hidden, "intermediate_size": 128}
        torch.manual_seed(0)
        whole = mf.MoELayer(**kwargs, quant=make(), backend="torch", environ={})
        ep = ExpertParallel(E)
        for kind, dispatcher in (("all_to_all", "auto"), ("low_latency", LowLatencyDispatch(ep, max_tokens=8))):
            parallel = mf.MoELayer(**kwargs, quant=make(), backend="torch", environ={}, expert_parallel=ep,
                                   dispatcher=dispatcher)
            parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
            parallel.process_weights_after_loading()
            assert parallel.dispatch_decision.dtype is whole.dispatch_decision.dtype
            errors[f"{name}/{kind}"] = _close(parallel(x), whole(x), f"{name} {kind}", tol=1e-4)
    return errors


def triton_experts_match(rank: int, world: int) -> dict[str, float]:
    """The all-to-all and the low-latency dispatchers built with the triton tables hand block-aligned rows to the
    triton expert GEMMs (bf16 kernels and the FP8 ones), under the interpreter on CPU: equal to the whole layer on
    the torch backend."""
    from moeforge.kernels.config import ConfigTable
    from moeforge.stages.triton import FusedGroupedGemm
    from moeforge.stages.triton_quant import TritonQuantizeTokens

    errors = {}
    hidden = 128
    on_input = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, order=mf.ScoreOrder.SELECT_THEN_SCORE, renormalize=False,
                                apply_weights=mf.RoutingWeights.ON_INPUT)  # Llama-4's: each copy's row scaled
    for name, make in (("fp16", lambda: None),
                       ("fp8 block/group", lambda: mf.Fp8W8A8Method(weight_scales="block", activation_scales="group")),
                       ("fp16 weights on input", lambda: None)):
        kwargs = {**BASE, "hidden_size": hidden, "intermediate_size": 128, "dtype": torch.float16}
        weights_on_input = name.endswith("on input")
        if weights_on_input:
            kwargs["routing"] = on_input
        torch.manual_seed(0)
        whole = mf.MoELayer(**kwargs, quant=make(), backend="torch", environ={})
        ep = ExpertParallel(E)
        parallel = mf.MoELayer(**kwargs, quant=make(), backend="torch", environ={}, expert_parallel=ep)
        parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
        parallel.process_weights_after_loading()
        table = ConfigTable(E, 2)
        for kind, dispatch in (("all_to_all", AllToAllDispatch(ep, apply_routing_weights=weights_on_input,
                                                                configs=table)),
                               ("low_latency", LowLatencyDispatch(ep, max_tokens=8, configs=table,
                                                                  apply_routing_weights=weights_on_input))):
            stages: list[mf.Stage[Any, Any]] = [mf.TopK(E, 2, parallel.routing)]
            decision = parallel.dispatch_decision.dtype
            quantize = parallel.quant.quantize_stage(decision, mf.DType.FP16)
            if isinstance(quantize, mf.QuantizeTokens):
                stages.append(TritonQuantizeTokens(quantize.quantizer))
            stages.append(dispatch)
            if name.startswith("fp16"):
                stages += [FusedGroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(parallel, "w13_weight"), table, None,
                                            mf.ActivationConfig()),
                           FusedGroupedGemm(mf.GemmRole.DOWN, mf.ParamRef(parallel, "w2_weight"), table)]
            else:
                stages += selected_stages(parallel.quant, parallel, activation=parallel.activation,
                                          routing_weights_in_epilogue=False, backend=mf.Backend.TRITON,
                                          configs=table, dispatch=decision)
            stages.append(dispatch.combine_stage(apply_routing_weights=not weights_on_input, out_dtype=mf.DType.FP16))
            pipeline = mf.Pipeline(stages, mf.input_spec(hidden, torch.float16, E), debug=True)
            assert "block-aligned" in pipeline.describe()
            x = _tokens(rank, dtype=torch.float16, hidden=hidden, count=5 + rank)  # tokens on every rank
            with torch.no_grad():
                got = pipeline(mf.MoEInput(x, whole.router_logits(x))).hidden_states
                errors[f"{name}/{kind}"] = _close(got, whole(x), name, tol=1e-2 if name.startswith("fp16") else 3e-2)
    return errors


def adapters_match(rank: int, world: int) -> dict[str, float]:
    """An expert-parallel layer with an expert adapter (its A and B sliced to the rank's experts by
    shard_state_dict; a shared A kept whole) equals the whole layer with the same adapter, and its adapter trains."""
    from moeforge.adapters import ExpertAdapter

    errors: dict[str, float] = {}
    x = _tokens(rank)
    for name, adapter in (("per_expert_a", ExpertAdapter(rank=2, alpha=4)),
                          ("shared_a", ExpertAdapter(rank=3, targets="down", shared_a=True))):
        whole, parallel = _pair({**BASE, "adapter": adapter})
        assert parallel.w2_lora_b.shape[0] == E // world
        errors[name] = _close(parallel(x), whole(x), name)
        for key, param in parallel.named_parameters():
            param.requires_grad_("lora" in key)
        parallel(x).square().sum().backward()  # every rank runs the backward, a rank without tokens too
        assert parallel.w2_lora_b.grad is not None
    return errors


def triton_adapters_match(rank: int, world: int) -> dict[str, float]:
    """The triton expert GEMMs with an expert adapter (AdaptedGroupedGemm) behind the all-to-all dispatcher and behind
    the low-latency one (its padded slots block-aligned), under the interpreter on CPU: equal to the whole layer with
    the same adapter on the torch backend, and the adapter's gradients on every rank equal the whole layer's for the
    rank's experts."""
    from moeforge.adapters import ExpertAdapter

    errors = {}
    hidden = 64
    adapter = ExpertAdapter(rank=2, alpha=4)
    kwargs = {**BASE, "hidden_size": hidden, "intermediate_size": 32, "dtype": torch.float32, "adapter": adapter}
    torch.manual_seed(0)
    whole = mf.MoELayer(**kwargs, backend="torch", environ={})
    with torch.no_grad():
        for key, param in whole.named_parameters():
            if "lora" in key:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    ep = ExpertParallel(E)
    parallel = mf.MoELayer(**kwargs, backend="torch", environ={}, expert_parallel=ep)
    parallel.load_state_dict(shard_state_dict(whole.state_dict(), parallel))
    x = _tokens(rank, dtype=torch.float32, hidden=hidden, count=5 + rank)
    logits = whole.router_logits(x).detach()
    want = whole.pipeline(mf.MoEInput(x, logits)).hidden_states
    names = ["w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b"]
    # the whole layer's gradients: every rank's tokens, summed as the expert-parallel ranks' backward sums them
    whole_x = torch.cat([_tokens(r, dtype=torch.float32, hidden=hidden, count=5 + r) for r in range(world)])
    whole_out = whole.pipeline(mf.MoEInput(whole_x, whole.router_logits(whole_x).detach())).hidden_states
    want_grads = torch.autograd.grad(whole_out.square().sum(), [getattr(whole, n) for n in names])
    local = slice(rank * (E // world), (rank + 1) * (E // world))
    for kind, make in (("", None),  # the all-to-all dispatcher, then the low-latency one's aligned padded slots
                       (" low_latency", lambda table: LowLatencyDispatch(ep, max_tokens=8, configs=table))):
        pipeline = _triton_adapted_pipeline(parallel, ep, adapter, hidden, make)
        assert "LoRA r=2" in pipeline.describe()
        got = pipeline(mf.MoEInput(x, logits)).hidden_states
        errors["values" + kind] = _close(got.detach(), want.detach(), "triton adapter" + kind)
        got_grads = torch.autograd.grad(got.square().sum(), [getattr(parallel, n) for n in names])
        errors["gradients" + kind] = max(_close(g, w[local], f"d{n}") for g, w, n in zip(got_grads, want_grads, names))
    return errors


def stacked_adapters_match(rank: int, world: int) -> dict[str, float]:
    """A stack of expert adapters behind both expert-parallel dispatchers (each copy's adapter travels beside its
    row; the stack's matrices sliced to the rank's experts along their expert dimension) equals the whole layer with
    the same tokens and adapter ids, torch stages, and on the triton GEMMs behind the all-to-all dispatcher under the
    interpreter; the adapters train."""
    from moeforge.adapters import ExpertAdapter

    errors: dict[str, float] = {}
    adapter = ExpertAdapter(rank=2, alpha=4, count=3)
    x = _tokens(rank)
    ids = (torch.arange(x.shape[0]) + rank) % 4 - 1  # every adapter and none
    for name, dispatcher in (("all_to_all", None), ("low_latency", lambda ep: LowLatencyDispatch(ep, max_tokens=8))):
        extra = {"dispatcher": dispatcher} if dispatcher is not None else {}
        whole, parallel = _pair({**BASE, "adapter": adapter}, **extra)
        assert parallel.w13_lora_b.shape[:2] == (3, E // world)
        errors[name] = _close(parallel(x, adapter_ids=ids), whole(x, adapter_ids=ids), name)
        for key, param in parallel.named_parameters():
            param.requires_grad_("lora" in key)
        parallel(x, adapter_ids=ids).square().sum().backward()  # every rank runs the backward
        assert parallel.w2_lora_b.grad is not None
    try:
        import triton  # noqa: F401
    except ImportError:
        return errors
    whole, parallel = _pair({**BASE, "adapter": adapter})
    ep = parallel.expert_parallel
    assert ep is not None
    logits = whole.router_logits(x).detach()
    for name, make in (("triton", lambda table: AllToAllDispatch(ep, configs=table)),  # and the padded slots aligned:
                       ("triton low_latency", lambda table: LowLatencyDispatch(ep, max_tokens=8, configs=table))):
        pipeline = _triton_adapted_pipeline(parallel, ep, adapter, H, make)
        with torch.no_grad():
            got = pipeline(mf.MoEInput(x, logits, ids)).hidden_states
            errors[name] = _close(got, whole.pipeline(mf.MoEInput(x, logits, ids)).hidden_states, name)
    return errors


def _triton_adapted_pipeline(parallel: mf.MoELayer, ep: ExpertParallel, adapter: Any, hidden: int,
                             dispatcher: Optional[Callable[[Any], Any]] = None) -> mf.Pipeline:  # type: ignore[type-arg]
    """``parallel``'s experts on the triton GEMMs behind a block-aligned dispatcher (``dispatcher(table)``; by default
    the all-to-all one), with its adapter (under the interpreter on CPU ranks), fp32."""
    from moeforge.adapters import adapt
    from moeforge.kernels.config import ConfigTable
    from moeforge.stages.triton import FusedGroupedGemm

    table = ConfigTable(E, 2)
    dispatch = dispatcher(table) if dispatcher is not None else AllToAllDispatch(ep, configs=table)
    stages: list[mf.Stage[Any, Any]] = [
        mf.TopK(E, 2, parallel.routing), dispatch,
        FusedGroupedGemm(mf.GemmRole.GATE_UP, mf.ParamRef(parallel, "w13_weight"), table, None, mf.ActivationConfig()),
        FusedGroupedGemm(mf.GemmRole.DOWN, mf.ParamRef(parallel, "w2_weight"), table),
        dispatch.combine_stage(out_dtype=mf.DType.FP32)]
    return mf.Pipeline(adapt(stages, parallel, adapter), mf.input_spec(hidden, torch.float32, E), debug=True)
