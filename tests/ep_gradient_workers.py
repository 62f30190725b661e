"""The rank function of tests/test_distributed_gradients.py (module level, so spawned ranks import it).

Every rank builds the whole layer (same seed) and an expert-parallel layer holding its experts, and takes
the gradient of ``sum(out * probe)`` over its own tokens (its own probe). The expert-parallel backward
runs on all ranks together: its gradients must equal the whole layer's on one process —

* the hidden states' and the replicated parameters' (router, shared experts): those of this rank's loss
  alone (a token's output depends only on its own input);
* each expert's weights and biases: those of every rank's loss (every rank's tokens reach the expert);
  the whole layer runs each rank's tokens (each rank can make them: they are seeded by rank).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import torch

import moeforge as mf
from ep_workers import BASE, E, TOKENS, _close, _pair, _tokens
from moeforge.distributed import LowLatencyDispatch
from moeforge.stages.topk import select_experts

if importlib.util.find_spec("triton") is not None:  # this rank's interpreted kernels lowered too (conftest.py)
    import triton_front_end

    triton_front_end.install()

DispatcherFactory = Callable[[Any], Any]


def _probe(tokens: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, BASE["hidden_size"], generator=torch.Generator().manual_seed(500 + rank)).to(dtype)


def _tokens_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return _tokens(rank, dtype=dtype)


def _grads(layer: mf.MoELayer, x: torch.Tensor, logits: Optional[torch.Tensor], probe: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_()
    wrt = {"hidden_states": x, **dict(layer.named_parameters())}
    if logits is not None:
        logits = logits.detach().requires_grad_()
        wrt["router_logits"] = logits
    out = layer(x, logits)
    grads = torch.autograd.grad((out.float() * probe.float()).sum(), list(wrt.values()), allow_unused=True)
    return {name: torch.zeros_like(t) if g is None else g for (name, t), g in zip(wrt.items(), grads)}


def _compare(rank: int, world: int, name: str, kwargs: dict[str, Any], *, family: Optional[str] = None,
             dispatcher: Optional[DispatcherFactory] = None, logits: Optional[Callable[[int], torch.Tensor]] = None,
             whole_layer: Optional[Callable[[mf.MoELayer], mf.MoELayer]] = None, tol: float = 1e-5
             ) -> dict[str, float]:
    extra = {} if dispatcher is None else {"dispatcher": dispatcher}
    whole, parallel = _pair(kwargs, family=family, **extra)
    if whole_layer is not None:
        whole = whole_layer(whole)
    dtype = kwargs["dtype"]
    x = _tokens_of(rank, dtype)

    def logits_of(r: int) -> Optional[torch.Tensor]:
        return logits(r) if logits is not None else None

    got = _grads(parallel, x, logits_of(rank), _probe(x.shape[0], rank, dtype))
    mine = _grads(whole, x, logits_of(rank), _probe(x.shape[0], rank, dtype))
    everyone = [_grads(whole, _tokens_of(r, dtype), logits_of(r), _probe(TOKENS[r % len(TOKENS)], r, dtype))
                for r in range(world)]
    ep = parallel.expert_parallel
    assert ep is not None
    experts = slice(ep.first_expert, ep.first_expert + ep.local_experts)
    expert_tensors = set(parallel.quant.expert_parameter_names(parallel))
    errors = {}
    for tensor, grad in got.items():
        if tensor in expert_tensors:
            want = sum(grads[tensor] for grads in everyone)[experts]
        else:
            want = mine[tensor]
        assert isinstance(want, torch.Tensor)
        errors[f"{name}/{tensor}"] = _close(grad, want, f"{name}: gradient of {tensor} on rank {rank}", tol=tol)
    return errors


def _first_copy_per_expert(layer: mf.MoELayer) -> mf.MoELayer:
    """The whole layer keeping only the first copy (in token order) each rank sends an expert, the others'
    weights masked to zero (they add nothing, pass no gradient): what a dispatch with a capacity of one
    per (rank, expert) and ``Overflow.DROP`` computes."""
    def route(hidden: torch.Tensor, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        topk = select_experts(logits, top_k, mf.RoutingConfig())
        seen: set[int] = set()
        keep = []
        for expert in topk.ids.reshape(-1).tolist():
            keep.append(expert not in seen)
            seen.add(expert)
        return topk.weights * torch.tensor(keep).view(topk.ids.shape), topk.ids

    layer.replace_stage(0, mf.CustomTopK(E, 2, route))
    return layer


def gradients_match(rank: int, world: int) -> dict[str, float]:
    errors: dict[str, float] = {}
    errors.update(_compare(rank, world, "mixtral", BASE))
    errors.update(_compare(rank, world, "low_latency", BASE,
                           dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8)))
    # The routing weights travel with the rows and scale the down GEMM's output on the experts' rank: their
    # gradient comes home with the rows'.
    epilogue = {**BASE, "routing": mf.RoutingConfig(apply_weights=mf.RoutingWeights.IN_GEMM_EPILOGUE),
                "expert_bias": True}
    errors.update(_compare(rank, world, "epilogue", epilogue))
    errors.update(_compare(rank, world, "epilogue/low_latency", epilogue,
                           dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8)))
    for family, options in {"gpt_oss": {}, "llama4": {},
                            "deepseek_v3": dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)}.items():
        kwargs = {**BASE, **options}
        errors.update(_compare(rank, world, family, kwargs, family=family))
        errors.update(_compare(rank, world, f"{family}/low_latency", kwargs, family=family,
                               dispatcher=lambda ep, family=family: LowLatencyDispatch(
                                   ep, max_tokens=8, apply_routing_weights=family == "llama4")))

    def skewed(r: int) -> torch.Tensor:  # every token to experts 0 and 1: rank 0 receives every row
        logits = torch.full((TOKENS[r % len(TOKENS)], E), -4.0)
        logits[:, 0], logits[:, 1] = 3.0, 2.0
        return logits + 0.1 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(r))

    errors.update(_compare(rank, world, "skewed", BASE, logits=skewed))
    errors.update(_compare(rank, world, "bf16", {**BASE, "dtype": torch.bfloat16}, tol=3e-2))

    # A capacity of 1 per (source rank, expert) drops copies: they pass no gradient.
    def crowded(r: int) -> torch.Tensor:  # every token of rank r to experts r + 1 and r + 4 (one remote)
        logits = torch.full((TOKENS[r % len(TOKENS)], E), -4.0)
        logits[:, (r + 1) % E], logits[:, (r + 4) % E] = 3.0, 2.0
        return logits + 0.1 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(r))

    errors.update(_compare(rank, world, "low_latency/drop", BASE, logits=crowded, whole_layer=_first_copy_per_expert,
                           dispatcher=lambda ep: LowLatencyDispatch(ep, max_tokens=8, capacity=1,
                                                                    overflow=mf.Overflow.DROP)))

    # float64 (the gradcheck dtype) stays on one process: the wire carries fp32 routing weights.
    for dispatcher in (None, lambda ep: LowLatencyDispatch(ep, max_tokens=8)):
        try:
            _pair({**BASE, "dtype": torch.float64}, **({} if dispatcher is None else {"dispatcher": dispatcher}))
        except mf.ContractError as error:
            assert error.field == "dtype" and "float64" in error.hint, error
        else:
            raise AssertionError("an expert-parallel float64 layer was built")
    return errors
