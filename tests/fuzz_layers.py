"""Random ``MoELayer`` compositions built the way users build them, the triton backend against the torch backend.

Each case (one seed) draws a layer — a family preset at a released model's sizes or a plain layer of random sizes,
activation, gate/up layout, expert biases, routing, shared experts; a dtype; a batch (empty, one token, thousands;
sometimes with the router's logits given so that every token picks one expert, or half the experts get none);
training or inference; for inference sometimes a quant method; for training sometimes an expert adapter — builds it
on the torch backend (the weights drawn there) and on the triton backend (the same state dict), and checks:

* the forward: the triton layer's output no further from an fp32 torch reference than ``3 ×`` the torch layer's of
  the same dtype (or a floor per dtype); quantized layers against the torch layer of the same method;
* a training step: every gradient (input, router, experts, biases, shared experts, adapters) judged the same way,
  and the triton step's gradients bitwise the same on a second run (determinism);
* on a GPU, for some inference cases, that the same triton layer built with decode graphs
  (:class:`~moeforge.decode_graphs.DecodeGraphSettings`) gives the launched layer's bits at every call: a batch size's first call,
  its replays on new rows, a second batch size, the first again;
* that a layer the torch backend builds is not refused by the triton backend (a refusal is reported with its
  reason: a gap, not necessarily a bug).

On a GPU the shapes are real (``REAL``: Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3/V2-Lite, GPT-OSS, Llama-4,
Granite-MoE, PhiMoE sizes, some with fewer experts to fit beside the fp32 reference); on CPU (``--cpu``, with
``TRITON_INTERPRET=1`` set by the caller) tiny shapes in fp16 / fp32 (the interpreter mis-computes bf16 dots), the
triton stages built with the selector told the kernels can run there. Cases run in ``--workers`` processes until
``--seconds`` have passed (the run ends up to a minute later, when the last cases finish); a CUDA error that
poisons a process's context ends that worker (its case reported as ``STICKY``) and another takes its place. Writes
one JSON (counts, the failing and refused cases with their layers, the worker and the seeds it ran before, and a
failing case's outcome when run again at once in the same process; every passing case's sizes) and prints a summary.
Results of GPU runs: ``benchmarks/results/fuzz_layers-*.json``.

    python3 tests/fuzz_layers.py --out fuzz.json --workers 8 --seconds 300            # a GPU
    TRITON_INTERPRET=1 python3 tests/fuzz_layers.py --cpu --out fuzz.json --workers 2 --seconds 120
    python3 tests/fuzz_layers.py --out again.json --seeds 3,336,337                   # cases again, by seed
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import multiprocessing
import random
import time
import traceback
from typing import Any, Callable, Optional

REAL: list[tuple[str, dict[str, Any]]] = [  # (family, preset sizes)
    ("mixtral", dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)),
    ("qwen2_moe", dict(num_experts=60, top_k=4, hidden_size=2048, intermediate_size=1408,
                       shared_expert_intermediate_size=5632)),
    ("qwen3_moe", dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=64, top_k=8, hidden_size=4096, intermediate_size=1536, norm_topk_prob=True)),
    ("olmoe", dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=1024)),
    ("deepseek_v3", dict(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408, n_group=1,
                         topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)),  # V2-Lite's sizes
    ("deepseek_v3", dict(num_experts=64, top_k=8, hidden_size=7168, intermediate_size=2048, n_group=8,
                         topk_group=4)),
    ("gpt_oss", dict(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880)),
    ("llama4", dict(num_experts=16, top_k=1, hidden_size=2048, intermediate_size=4096)),
    ("granite_moe", dict(num_experts=40, top_k=8, hidden_size=1536, intermediate_size=512)),
    ("phimoe", dict(num_experts=16, top_k=2, hidden_size=2048, intermediate_size=3200)),
]
QUANT = ("fp8_channel", "fp8_block", "int8", "w4a16", "mxfp4", "nvfp4", "mxfp4_shuffled", "nvfp4_shuffled")
# Errors after which a process's CUDA context is unusable.
STICKY = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
          "misaligned address", "illegal instruction")
# Triton's error where loading a kernel's module finds the GPU full (not sticky): what several workers sharing one GPU
# run into, as torch's OutOfMemoryError — counted with it, not as a failure
TRITON_OUT_OF_MEMORY = "Triton Error [CUDA]: out of memory"


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def _quant(name: str) -> Any:
    import moeforge as mf

    makers: dict[str, Callable[[], Any]] = {
        "fp8_channel": lambda: mf.Fp8W8A8Method(), "fp8_block": lambda: mf.Fp8W8A8Method("block", "group"),
        "int8": mf.Int8W8A8Method, "w4a16": mf.W4A16Method, "mxfp4": mf.Mxfp4Method, "nvfp4": mf.Nvfp4Method,
        "mxfp4_shuffled": lambda: mf.Mxfp4Method(shuffled=True),
        "nvfp4_shuffled": lambda: mf.Nvfp4Method(shuffled=True)}
    return makers[name]()


def draw(seed: int, cpu: bool) -> dict[str, Any]:
    """The case of ``seed``: family (``None``: a plain layer), sizes, tokens, dtype, training, quant, options."""
    import torch

    import moeforge as mf
    from moeforge.adapters import ExpertAdapter

    rng = random.Random(seed)
    family: Optional[str] = None
    if cpu:
        experts = rng.choice([2, 4, 6])
        sizes = dict(num_experts=experts, top_k=rng.randint(1, experts), hidden_size=rng.choice([32, 64]),
                     intermediate_size=rng.choice([32, 48]))
        tokens = rng.choice([0, 1, 5, 40])
    elif rng.random() < 0.55:
        family, sizes = rng.choice(REAL)
        sizes = dict(sizes)
        big = sizes["num_experts"] * sizes["hidden_size"] * sizes["intermediate_size"] > 4e8
        tokens = rng.choice([0, 1, 3, 16, 100, 512, 1024, 2048] + ([] if big else [4096, 8192]))
    else:
        experts = rng.choice([3, 4, 8, 12, 16, 32, 60, 64, 128, 160, 256])
        sizes = dict(num_experts=experts, top_k=min(experts, rng.choice([1, 2, 3, 4, 6, 8, experts])),
                     hidden_size=rng.choice([128, 256, 320, 512, 576, 1000, 1024, 1536, 2048, 2880]),
                     intermediate_size=rng.choice([64, 96, 200, 256, 384, 640, 768, 1000, 1408, 2048]))
        tokens = rng.choice([0, 1, 2, 7, 33, 129, 600, 1024, 3000, 4096])
    dtype = rng.choice([torch.bfloat16] * 6 + [torch.float16] * 2 + [torch.float32])
    if cpu:
        dtype = rng.choice([torch.float16, torch.float32])
    train = rng.random() < 0.6
    quant = rng.choice(QUANT) if not train and rng.random() < 0.4 else None
    options: dict[str, Any] = dict(dtype=dtype, environ={})
    if family is None:
        options["activation"] = mf.ActivationConfig(rng.choice(list(mf.ActivationKind)),
                                                    gate_up=rng.choice(list(mf.GateUpLayout)))
        options["expert_bias"] = rng.random() < 0.3
        options["routing"] = mf.RoutingConfig(
            scoring=rng.choice(list(mf.Scoring)), renormalize=rng.random() < 0.6,
            apply_weights=rng.choice([mf.RoutingWeights.IN_COMBINE] * 3 + [mf.RoutingWeights.IN_GEMM_EPILOGUE,
                                                                            mf.RoutingWeights.ON_INPUT]),
            routed_scaling_factor=rng.choice([1.0, 2.5]))
        if rng.random() < 0.15:
            options["shared_experts"] = mf.SharedExpertsConfig(rng.choice([128, 512]))
    if train and rng.random() < 0.15:
        options["adapter"] = ExpertAdapter(rank=rng.choice([2, 4] if cpu else [8, 16, 64]), alpha=16.0)
    # the router's logits given, pushed so that every token picks expert 0, or so that half the experts get nothing
    skew = rng.choice([None] * 8 + ["every token on expert 0", "half the experts idle"])
    if skew == "half the experts idle" and sizes["num_experts"] // 2 < sizes["top_k"]:
        skew = None
    # (drawn last, so that every earlier draw of a seed stays what it was) an inference case on a GPU sometimes also
    # runs a layer with decode graphs: the most tokens a graph takes, or None
    decode_graphs = rng.choice([None, tokens, 2 * tokens, 1024]) if not (train or cpu) and 0 < tokens <= 1024 \
        else None
    return dict(seed=seed, family=family, sizes=sizes, tokens=tokens, dtype=dtype, train=train, quant=quant,
                options=options, skew=skew, decode_graphs=decode_graphs)


def _build(case: dict[str, Any], backend: str, device: str, **override: Any) -> Any:
    import moeforge as mf

    options = dict(case["options"], **override)
    if case["quant"] is not None and "dtype" not in override:
        options["quant"] = _quant(case["quant"])
    if device == "cpu" and backend == "triton":  # (the selector wants a GPU for them; the interpreter runs them)
        import pytest

        from moeforge.roles import LayerConfig
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LayerConfig, "triton_problem", lambda self: None)
            layer = _build(case, "auto", device, **override)
        if layer.backend is not mf.Backend.TRITON:
            raise mf.InputError(f"the selector took the {layer.backend.value} backend: {layer.describe()}")
        return layer
    if case["family"] is None:
        s = case["sizes"]
        layer = mf.MoELayer(s["num_experts"], s["top_k"], s["hidden_size"], s["intermediate_size"],
                            backend=backend, device=device, **options)
    else:
        layer = mf.MoELayer.from_preset(case["family"], **case["sizes"], backend=backend, device=device, **options)
    _ = layer.pipeline  # (built now: a refusal is the case's outcome)
    return layer


def _draw_weights(layer: Any) -> None:
    import torch

    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                continue  # (quantized storage)
            if "scale" in name:
                p.copy_(torch.rand_like(p) * 0.5 + 0.75)
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def triton_layer(case: dict[str, Any], device: str, **override: Any) -> Any:
    """The case's triton layer holding the weights :func:`run_case` draws for it (its torch layer's, drawn after
    seeding with the case's seed): what the race-hunting benchmarks call the same layers with."""
    import torch

    torch.manual_seed(case["seed"])
    reference = _build(case, "torch", device)
    _draw_weights(reference)
    layer = _build(case, "triton", device, **override)
    layer.load_state_dict(reference.state_dict())
    return layer


def run_case(case: dict[str, Any], device: str) -> tuple[str, str, dict[str, Any]]:
    """``(outcome, reason, measurements)`` of one case; raises ``AssertionError`` where the triton layer is wrong."""
    import torch

    torch.manual_seed(case["seed"])
    try:
        torch_layer = _build(case, "torch", device)
    except Exception as error:
        return "torch refused", f"{type(error).__name__}: {str(error)[:160]}", {}
    _draw_weights(torch_layer)
    try:
        triton_layer = _build(case, "triton", device)
        triton_layer.load_state_dict(torch_layer.state_dict())
    except Exception as error:
        return "triton refused", f"{type(error).__name__}: {str(error)[:600]}", {}
    dtype = case["dtype"]
    seen: dict[str, Any] = {}
    x = torch.randn(case["tokens"], case["sizes"]["hidden_size"], device=device, dtype=dtype)
    logits: Optional[Any] = None
    if case["skew"] is not None:
        experts = case["sizes"]["num_experts"]
        logits = torch.randn(case["tokens"], experts, device=device)
        if case["skew"] == "every token on expert 0":
            logits[:, 0] += 30.0
        else:
            logits[:, experts // 2:] -= 30.0
    with torch.no_grad():
        got, want = triton_layer(x, logits), torch_layer(x, logits)
    assert got.shape == want.shape, (got.shape, want.shape)
    if case["tokens"] == 0:
        return "ok empty", "", seen
    if case.get("decode_graphs"):
        seen["decode graphs"] = _check_decode_graphs(case, torch_layer, triton_layer, x, logits, device)
    if not torch.isfinite(got.float()).all():
        assert not torch.isfinite(want.float()).all(), "the triton output is not finite where the torch one is"
        return "not finite on both backends", "", seen
    if case["quant"] is not None:
        seen["forward"] = _rel(got, want)
        assert seen["forward"] < 6e-2, f"quantized forward {seen['forward']:.3g} from the torch layer's"
        return "ok quantized", "", seen
    reference = _build(case, "torch", device, dtype=torch.float32)
    reference.load_state_dict(torch_layer.state_dict())
    floor = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        exact = reference(x.float(), logits)
    seen["forward"] = (_rel(got, exact), _rel(want, exact))
    assert seen["forward"][0] <= max(3 * seen["forward"][1], floor), f"forward {seen['forward']}"
    if not case["train"]:
        return "ok inference", "", seen
    grad = torch.randn_like(x)

    def gradients(layer: Any, rows: Any, upstream: Any) -> dict[str, Any]:
        rows = rows.clone().requires_grad_()
        params = [p for p in layer.parameters() if p.requires_grad]
        found = torch.autograd.grad((layer(rows, logits).float() * upstream.float()).sum(), [rows] + params,
                                    allow_unused=True)
        return dict(zip(["x"] + [n for n, p in layer.named_parameters() if p.requires_grad], found))

    mine, again = gradients(triton_layer, x, grad), gradients(triton_layer, x, grad)
    theirs, exact_grads = gradients(torch_layer, x, grad), gradients(reference, x.float(), grad.float())
    for name, g in mine.items():
        assert (g is None) == (again[name] is None) and (g is None or torch.equal(g, again[name])), (
            f"the gradient of {name} differs between two identical steps")
        r = exact_grads.get(name)
        if r is None or r.float().norm() < 1e-6 or (name.startswith("router") and case["sizes"]["top_k"] == 1):
            continue  # (top-1 renormalised or not: the router's gradient may be rounding noise on both sides)
        g = torch.zeros_like(r) if g is None else g
        t = theirs.get(name)
        t = torch.zeros_like(r) if t is None else t
        seen[name] = (_rel(g, r), _rel(t, r))
        assert seen[name][0] <= max(3 * seen[name][1], 2 * floor), f"gradient of {name}: {seen[name]}"
    return "ok training", "", seen


def _bits(t: Any) -> Any:
    import torch

    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check_decode_graphs(case: dict[str, Any], torch_layer: Any, triton_layer: Any, x: Any, logits: Any,
                         device: str) -> tuple[int, list[str]]:
    """The triton layer built with decode graphs (``case["decode_graphs"]`` tokens at most, two graphs kept) gives the
    launched layer's bits at every call: a key's first call (eager, then captured), its replays on new rows, a second
    batch size's first call and replay, and the first size again (``(graphs kept, refusals)``)."""
    import torch

    from moeforge.decode_graphs import DecodeGraphSettings

    graphed = _build(case, "triton", device,
                     decode_graphs=DecodeGraphSettings(max_tokens=case["decode_graphs"], max_graphs=2))
    graphed.load_state_dict(torch_layer.state_dict())
    tokens = case["tokens"]
    calls = [x, torch.randn_like(x), torch.randn_like(x)]
    if tokens > 1 and logits is None:  # (given logits fix the batch size)
        fewer = torch.randn_like(x[:max(1, tokens // 2)])
        calls += [fewer, torch.randn_like(fewer), torch.randn_like(x)]
    for index, rows in enumerate(calls):
        with torch.no_grad():
            got, launched = graphed(rows, logits), triton_layer(rows, logits)
        assert torch.equal(_bits(got), _bits(launched)), (
            f"the layer with decode graphs differs from the launched layer at call {index} ({rows.shape[0]} tokens; "
            f"{len(graphed.decode_graphs)} graphs kept, refusals {graphed.decode_graphs.refusals()})")
    return len(graphed.decode_graphs), graphed.decode_graphs.refusals()


def _describe(case: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if k in ("dtype", "options") else v) for k, v in case.items()}


def _worker(slot: int, seeds: Any, deadline: float, out: str, cpu: bool) -> None:
    import os

    import torch

    device = "cpu" if cpu else "cuda"
    history: list[int] = []  # the seeds this worker ran, in order (a failure may depend on what ran before it)
    with open(f"{out}.w{slot}.jsonl", "a") as log:
        while time.time() < deadline:
            try:
                seed = seeds.get(timeout=1)
            except Exception:
                return
            start, sticky = time.time(), False
            case = draw(seed, cpu)
            record: dict[str, Any] = dict(seed=seed, case=_describe(case))
            try:
                record["outcome"], record["reason"], record["seen"] = run_case(case, device)
            except torch.cuda.OutOfMemoryError as error:  # (several workers share the GPU)
                record.update(outcome="out of memory", reason=str(error)[:200])
            except Exception as error:
                reason = f"{type(error).__name__}: {str(error)[:1200]}"
                if TRITON_OUT_OF_MEMORY in reason:  # (a kernel's module not loaded: the workers filled the GPU)
                    record.update(outcome="out of memory", reason=reason[:200])
                else:
                    sticky = any(s in reason for s in STICKY)
                    record.update(outcome="STICKY" if sticky else "FAIL", reason=reason,
                                  traceback=traceback.format_exc(limit=8)[-2500:])
            record["seconds"] = round(time.time() - start, 2)
            record["worker"], record["after"] = slot, history[-8:]
            history.append(seed)
            if record["outcome"] == "FAIL":  # the same case again at once, in this process: a transient failure?
                try:
                    record["again"] = run_case(case, device)[0]
                except Exception as error:
                    record["again"] = f"{type(error).__name__}: {str(error)[:300]}"
            log.write(json.dumps(record, default=str) + "\n")
            log.flush()
            if sticky:
                os._exit(3)  # (a poisoned CUDA context: the parent starts another worker)
            if not cpu:
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--first", type=int, default=0, help="the first seed (then every seed after it)")
    parser.add_argument("--seeds", default="", help="these seeds only, comma-separated")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0, help="no case starts after this many seconds")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (set TRITON_INTERPRET=1)")
    args = parser.parse_args()
    importlib.import_module("moeforge")  # (fails here, once, where the package cannot be imported)

    deadline = time.time() + args.seconds
    context = multiprocessing.get_context("spawn")
    seeds = context.Queue()
    for seed in ([int(s) for s in args.seeds.split(",")] if args.seeds else range(args.first, args.first + 100000)):
        seeds.put(seed)
    seeds.cancel_join_thread()  # (the seeds left in the queue must not hold this process's exit)
    workers: dict[int, Any] = {}
    started = 0
    while time.time() < deadline + 60:
        for slot in range(args.workers):
            if (slot not in workers or not workers[slot].is_alive()) and time.time() < deadline - 30 \
                    and started < 4 * args.workers:
                workers[slot] = context.Process(target=_worker, args=(slot, seeds, deadline, args.out, args.cpu))
                workers[slot].start()
                started += 1
        if all(not w.is_alive() for w in workers.values()):
            break
        time.sleep(1)
    for w in workers.values():
        if w.is_alive():
            w.kill()
    records = []
    for slot in range(args.workers):
        try:
            with open(f"{args.out}.w{slot}.jsonl") as log:
                records += [json.loads(line) for line in log]
        except (FileNotFoundError, ValueError):
            pass
    counts = collections.Counter(r["outcome"] for r in records)
    bad = [r for r in records if r["outcome"] in ("FAIL", "STICKY", "out of memory", "triton refused")]
    passed = [dict(seed=r["seed"], outcome=r["outcome"], family=r["case"]["family"], sizes=r["case"]["sizes"],
                   tokens=r["case"]["tokens"], dtype=r["case"]["dtype"], seconds=r["seconds"])
              for r in records if r not in bad]
    with open(args.out, "w") as f:
        json.dump(dict(counts=counts, cases=len(records), bad=bad, passed=passed), f, indent=1, default=str)
    print(dict(counts))
    for r in bad:
        print(r["seed"], r["outcome"], r["reason"][:300], *(["again:", r["again"][:200]] if "again" in r else []))


if __name__ == "__main__":
    main()
