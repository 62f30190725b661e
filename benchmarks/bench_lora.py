"""Benchmark a LoRA training step on the experts: moeforge's triton pipeline with an expert adapter against the same
pipeline without one, and against LoRA the way peft applies it to fused experts (the merged weight ``W + s·B A``
computed in every forward, then ``torch._grouped_mm`` and autograd), CUDA only.

    python benchmarks/bench_lora.py [--shapes mixtral,qwen3] [--tokens 1024,4096,16384] [--rank 16]

For each shape and token count M, on random (never zero) bf16 data with the routing fixed and the base weights
frozen: the time of ``forward + backward`` as the median of CUDA-graph replays with the L2 flushed, for

* ``base``: moeforge's experts without an adapter, the gradient of the hidden states only (what a frozen layer in
  a fine-tuned model costs);
* ``lora``: moeforge's experts with a rank-``r`` adapter on gate/up and down, the gradients of the hidden states and
  of the adapter's four matrices;
* ``grouped_mm_lora``: peft's way, the merged weights per forward, ``torch._grouped_mm``, the same gradients;
* ``grouped_mm_base``: ``torch._grouped_mm`` without an adapter, the hidden states' gradient;

with ``lora / base`` (the issue's bar: at most 1.2) and ``grouped_mm_lora / lora`` (above 1: moeforge is faster), the
step's peak memory above what was allocated before it, and whether two eager steps give bitwise the same gradients.
``--serving``: inference instead (the experts' forward under ``torch.no_grad``), the base layer against the same
layer with a stack of ``--adapters`` adapters (rank ``--rank``) each token picking one at random, at
``--serving-tokens``: the issue's serving bar is 1.15× the base at M ≤ 64 and 1.3× at M = 4096.
Prints a table and writes JSON (device, commit, date). ``--profile`` also prints, for ``base`` and ``lora`` of each
cell (with ``--serving``: the base and the stack), the GPU time per step of each kernel launch in the step's order (and
for training, of each op by its input shapes; ``torch.profiler``, a few eager steps after warm-up), so the adapter's
GEMMs (rank-wide operands) stand apart from the base's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import FLUSH_BYTES, SHAPES, time_graph  # noqa: E402
from bench_train import kernel_times, print_kernel_times, step_memory_and_determinism  # noqa: E402
from provenance import measured_commit  # noqa: E402

import moeforge as mf  # noqa: E402
from moeforge.adapters import ExpertAdapter  # noqa: E402
from moeforge.kernels.config import device_key  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402

ADAPTER_PARAMETERS = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")


def moeforge_step(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput, grad: torch.Tensor) -> Callable[[], Any]:
    """The layer's experts (top-k given) forward and backward: the hidden states' gradient and the adapter's."""
    experts_only = mf.Pipeline(layer.pipeline.stages[1:], layer.pipeline.specs[0])
    params = [getattr(layer, name) for name in ADAPTER_PARAMETERS if hasattr(layer, name)]

    def run() -> Any:
        rows = x.detach().requires_grad_()
        out = experts_only(RoutedTokens(Activations(rows), topk)).hidden_states
        return torch.autograd.grad(out, [rows, *params], grad)

    return run


def grouped_mm_step(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput, grad: torch.Tensor,
                    adapter: ExpertAdapter | None) -> Callable[[], Any]:
    """The same experts with ``torch._grouped_mm`` and autograd; with ``adapter``, peft's merged weights
    ``W + scale · B A`` computed in the forward (``layer``'s adapter matrices)."""
    tokens, top_k = topk.ids.shape
    w13, w2 = layer.w13_weight, layer.w2_weight
    ones = torch.ones(tokens * top_k, dtype=torch.int32, device=x.device)
    params = [getattr(layer, name) for name in ADAPTER_PARAMETERS] if adapter is not None else []

    def run() -> Any:
        rows = x.detach().requires_grad_()
        up_w, down_w = w13, w2
        if adapter is not None:
            a13, b13, a2, b2 = params
            up_w = w13 + adapter.scale * torch.bmm(b13, a13)
            down_w = w2 + adapter.scale * torch.bmm(b2, a2)
        flat = topk.ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(layer.num_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        source = order // top_k
        hidden = torch._grouped_mm(rows[source], up_w.transpose(1, 2), offs=offs)
        gate, up = hidden.chunk(2, dim=-1)
        out_rows = torch._grouped_mm(torch.nn.functional.silu(gate) * up, down_w.transpose(1, 2), offs=offs)
        out_rows = out_rows * topk.weights.reshape(-1)[order, None].to(out_rows.dtype)
        out = torch.zeros_like(rows).index_add(0, source, out_rows)
        return torch.autograd.grad(out, [rows, *params], grad)

    return run


def layer_pair(name: str, adapter: ExpertAdapter) -> tuple[mf.MoELayer, mf.MoELayer]:
    """``(the layer with adapter, the same base layer without)`` of shape ``name`` on the triton GEMMs, bf16, the
    adapter's matrices random (never zero: ``B`` too)."""
    experts, top_k, hidden, inter = SHAPES[name]
    adapted = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton",
                          adapter=adapter)
    base = mf.MoELayer(experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda", backend="triton")
    base.load_state_dict({k: v for k, v in adapted.state_dict().items() if "lora" not in k})
    with torch.no_grad():
        for param_name in ADAPTER_PARAMETERS:
            param = getattr(adapted, param_name)
            param.copy_(torch.randn_like(param) * (0.02 if param_name.endswith("_b") else 1.0 / hidden ** 0.5))
    return adapted, base


def serving_step(layer: mf.MoELayer, x: torch.Tensor, topk: TopKOutput,
                 adapter_ids: torch.Tensor | None) -> Callable[[], Any]:
    """The layer's experts (top-k given) forward without a backward, with each token's adapter where given."""
    experts_only = mf.Pipeline(layer.pipeline.stages[1:], layer.pipeline.specs[0])

    def run() -> Any:
        with torch.no_grad():
            return experts_only(RoutedTokens(Activations(x), topk, adapter_ids)).hidden_states

    return run


def bench_serving(args: argparse.Namespace, flush: torch.Tensor) -> list[dict[str, Any]]:
    """Inference of the base layer and of the same layer with a stack of adapters, tokens choosing at random."""
    records: list[dict[str, Any]] = []
    adapter = ExpertAdapter(rank=args.rank, alpha=2 * args.rank, count=args.adapters)
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = SHAPES[name]
        adapted, base = layer_pair(name, adapter)
        for tokens in (int(t) for t in args.serving_tokens.split(",")):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            topk = mf.stages.select_experts(torch.randn(tokens, experts, device="cuda"), top_k, adapted.routing)
            ids = torch.randint(0, args.adapters, (tokens,), device="cuda")
            timed = {what: time_graph(step, args.reps, flush) for what, step in (
                ("base", serving_step(base, x, topk, None)), ("adapters", serving_step(adapted, x, topk, ids)))}
            ratio = timed["adapters"] / timed["base"]
            if args.profile:
                for label, step in ((f"{name} M={tokens} base", serving_step(base, x, topk, None)),
                                    (f"{name} M={tokens} {args.adapters} adapters", serving_step(adapted, x, topk, ids))):
                    print_kernel_times(label, kernel_times(step))
            records.append(dict(shape=name, M=tokens, what="serving", adapters=args.adapters, rank=args.rank,
                                base_us=round(timed["base"], 2), adapters_us=round(timed["adapters"], 2),
                                ratio=round(ratio, 3)))
            print(f"{name:8s} M={tokens:6d} serving: base {timed['base']:9.1f} us, {args.adapters} adapters "
                  f"{timed['adapters']:9.1f} us ({ratio:.2f}x)", flush=True)
        del adapted, base
        torch.cuda.empty_cache()
    return records


def print_op_times(label: str, fn: Callable[[], Any], steps: int = 3) -> None:
    """The GPU time per step of ``fn``'s ops grouped by input shapes (``torch.profiler``), the costliest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    print(f"  {label}: GPU time per step by op and input shapes")
    rows = [event for event in prof.key_averages(group_by_input_shape=True) if event.device_time_total > 0]
    rows.sort(key=lambda event: -event.self_device_time_total)
    total = sum(event.self_device_time_total for event in rows) / steps
    print(f"    {total:9.1f} us in all")
    for event in rows[:24]:
        us = event.self_device_time_total / steps
        print(f"    {us:9.1f} us x{event.count // steps:<3d} {event.key[:40]:40s} {str(event.input_shapes)[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,qwen3")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--profile", action="store_true", help="print each op's GPU time by input shapes too")
    parser.add_argument("--serving", action="store_true", help="inference with a stack of adapters instead")
    parser.add_argument("--adapters", type=int, default=8, help="adapters in the stack (--serving)")
    parser.add_argument("--serving-tokens", default="1,16,64,4096")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lora.py needs a CUDA device")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    device = torch.cuda.get_device_name()
    adapter = ExpertAdapter(rank=args.rank, alpha=2 * args.rank)
    records: list[dict[str, Any]] = []
    if args.serving:
        print(f"{device}: inference, a stack of {args.adapters} rank-{args.rank} adapters")
        records = bench_serving(args, flush)
    else:
        print(f"{device}: rank {args.rank} adapter on gate/up and down, base weights frozen")
    for name in args.shapes.split(",") if not args.serving else []:
        experts, top_k, hidden, inter = SHAPES[name]
        adapted, base = layer_pair(name, adapter)
        for layer in (adapted, base):
            for param_name, param in layer.named_parameters():
                param.requires_grad_("lora" in param_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            topk = mf.stages.select_experts(torch.randn(tokens, experts, device="cuda"), top_k, adapted.routing)
            grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            steps = {
                "base": moeforge_step(base, x, topk, grad),
                "lora": moeforge_step(adapted, x, topk, grad),
                "grouped_mm_lora": grouped_mm_step(adapted, x, topk, grad, adapter),
                "grouped_mm_base": grouped_mm_step(base, x, topk, grad, None),
            }
            timed: dict[str, float] = {}
            for what, step in steps.items():
                try:
                    memory, same = step_memory_and_determinism(step)
                    timed[what] = us = time_graph(step, args.reps, flush)
                except Exception as error:  # e.g. out of memory at the largest shapes
                    print(f"{name:8s} M={tokens:6d} {what}: {type(error).__name__}: {str(error)[:160]}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                records.append(dict(shape=name, E=experts, k=top_k, H=hidden, I=inter, M=tokens, rank=args.rank,
                                    what=what, median_us=round(us, 2), peak_mib=round(memory / 2**20),
                                    deterministic=same))
                print(f"{name:8s} M={tokens:6d} {what:16s} {us:10.1f} us  peak memory {memory / 2**30:6.2f} GiB"
                      f"{'' if same else ', gradients differ between two runs'}", flush=True)
            if args.profile:
                for what in ("base", "lora"):
                    print_kernel_times(f"{name} M={tokens} {what}", kernel_times(steps[what]))
                    print_op_times(f"{name} M={tokens} {what}", steps[what])
            if "lora" in timed and "base" in timed:
                line = f"{'':8s} lora / base {timed['lora'] / timed['base']:.2f}"
                summary: dict[str, Any] = dict(shape=name, M=tokens, what="ratios",
                                               lora_over_base=round(timed["lora"] / timed["base"], 3))
                if "grouped_mm_lora" in timed:
                    summary["grouped_mm_lora_over_lora"] = round(timed["grouped_mm_lora"] / timed["lora"], 3)
                    line += f", grouped_mm_lora / lora {summary['grouped_mm_lora_over_lora']:.2f}"
                records.append(summary)
                print(line, flush=True)
        del adapted, base
        torch.cuda.empty_cache()
    result = dict(device=device, commit=args.commit or measured_commit(), date=datetime.date.today().isoformat(),
                  torch=torch.__version__, rank=args.rank, serving=args.serving, records=records)
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"bench_lora-{device_key(device)}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
