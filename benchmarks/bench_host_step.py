"""The host's time of an eager training step of the experts, on the CPU, with every Triton launch stubbed out.

    TRITON_INTERPRET=1 python benchmarks/bench_host_step.py [--experts 128] [--top-k 8] [--tokens 256] [--steps 200]
                                                           [--slot-rows rule|on|off] [--profile N]
                                                           [--staged] [--inference] [--floor] [--weights-on-input]

A step called without a CUDA graph is bound by the host at small batches (``bench_train.py --eager``: the Qwen3
step at M = 1024 on an H200 takes 1.9x its replay). This harness measures the Python side of that cost where no GPU
is: the triton backend's training step (``bench_train.py``'s: the experts' forward from leaves requiring
gradients, then ``torch.autograd.grad`` of the hidden states, the routing weights and both weights) on CPU tensors
of toy widths, with every kernel launch of moeforge's a no-op (``BoundLaunch.__call__``: the bound launches and the
launch sites' first calls alike; the Gluon kernels do not run on the CPU). What it times is the pipeline's and the
backward's Python, the custom ops' and autograd's dispatch and the torch allocations; not the driver's launches, nor
the GPU-only paths (TMA descriptors, the Gluon weight gradient, which the CPU's tiles never take). Prints the median
microseconds of the forward and of the step over ``--steps`` steps; ``--staged`` also times the step run stage by stage
(five autograd nodes, what the pipeline ran before the training step's one node), in alternating rounds;
``--inference`` an inference forward (no grad mode, the routing kernel included) as one unit and stage by stage, the
same way; ``--weights-on-input`` the step of experts whose dispatch scales the rows by the routing weights (Llama-4),
beside the step with the weights in the combine;
``--slot-rows`` whether the dispatch gives its
rows in slot order (``rule``: where :func:`~moeforge.stages.slot_order.slot_rows_pay` takes it); ``--profile N``
prints a ``cProfile`` listing of N steps; ``--floor`` also times the step's floor (:func:`floor_step`: the same five
autograd nodes, allocations and launch calls, without the stages, the payload records, the op's arguments and the
launchers' planning; :func:`one_node_floor_step`: the same in one node, as the pipeline runs the step) — how much
of the step's host time is moeforge's own Python. The outputs are uninitialised
memory: nothing is checked, only timed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moeforge as mf  # noqa: E402
from moeforge.kernels import bound_launch  # noqa: E402
from moeforge.kernels.config import ConfigTable  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402
from moeforge.stages.combine import Combine  # noqa: E402
from moeforge.stages.triton import AlignDispatch, FusedGroupedGemm, TritonTopK  # noqa: E402


def _zero_indices(self: Any, *args: Any) -> None:
    """A stubbed launch that zeroes its integer tensor arguments (see :func:`launches_stubbed`), through ``.data`` so
    that the tensors' version counters stay as a kernel's writes leave them (autograd checks saved tensors' versions)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and not arg.is_floating_point():
            arg.data.zero_()


@contextlib.contextmanager
def launches_stubbed(valid_indices: bool = False) -> Iterator[None]:
    """Inside, every moeforge kernel launch (through :class:`~moeforge.kernels.bound_launch.BoundLaunch`) does
    nothing; the launcher is restored on the way out. ``valid_indices``: each launch zeroes its integer tensor
    arguments instead, so that the indices a kernel would have written (the gather's ``slot_of``) are in range where
    torch reads them on the host's side of the step (the weights-on-input step's ``index_select`` of the weights'
    gradient); the zeroing is a cost of its own, so a comparison runs every variant under the same stub."""
    launch = bound_launch.BoundLaunch.__call__
    bound_launch.BoundLaunch.__call__ = (  # type: ignore[method-assign]
        _zero_indices if valid_indices else lambda self, *args: None)
    try:
        yield
    finally:
        bound_launch.BoundLaunch.__call__ = launch  # type: ignore[method-assign]


def training_step(experts: int, top_k: int, tokens: int, hidden: int, inter: int,
                  slot_rows: Optional[bool] = None, joined: bool = True,
                  weights_on_input: bool = False) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(forward, step)`` of a bf16 triton layer's experts on CPU tensors (the routing given; ``slot_rows``: the
    dispatch's, see :class:`~moeforge.stages.triton.AlignDispatch`). ``joined=False``: the stages one by one, as the
    pipeline ran them before it ran the training step as one autograd node (:mod:`moeforge.stages.triton_step`).
    ``weights_on_input``: the routing weights scale each copy's row in the dispatch and the combine sums the rows
    unweighted (Llama-4's experts); its step reads indices on the host's side, so run it under
    ``launches_stubbed(valid_indices=True)``."""
    # (the stages a triton MoELayer builds after its routing; a layer refuses the triton backend on the CPU)
    table = ConfigTable(experts, top_k)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=True)
    full = mf.Pipeline([
        TritonTopK(experts, top_k, mf.RoutingConfig(apply_weights=mf.RoutingWeights.ON_INPUT) if weights_on_input
                   else mf.RoutingConfig()),
        AlignDispatch(experts, table, slot_rows, apply_routing_weights=weights_on_input),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
        FusedGroupedGemm(mf.GemmRole.DOWN, w2, table),
        Combine(apply_routing_weights=not weights_on_input),
    ], mf.input_spec(hidden, torch.bfloat16, experts))
    experts_only = mf.Pipeline(full.stages[1:], full.specs[0])
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k)
    grad = torch.randn(tokens, hidden, dtype=torch.bfloat16)

    def forward() -> Any:
        xr = x.detach().requires_grad_()
        w = weights.detach().requires_grad_()
        payload: Any = RoutedTokens(Activations(xr), TopKOutput(w, ids))
        if joined:
            payload = experts_only(payload)
        else:
            for stage in experts_only.stages:
                payload = stage(payload)
        return payload.hidden_states, [xr, w, w13, w2]

    def step() -> Any:
        out, leaves = forward()
        return torch.autograd.grad(out, leaves, grad)

    return forward, step


def _floor_tensors(experts: int, top_k: int, tokens: int, hidden: int,
                   inter: int) -> tuple[torch.Tensor, ...]:
    """The floors' ``(w13, w2, x, routing weights, upstream gradient)``: bf16 weights requiring grad, toy widths."""
    return (torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(tokens, hidden, dtype=torch.bfloat16), torch.rand(tokens, top_k),
            torch.randn(tokens, hidden, dtype=torch.bfloat16))


def inference_forward(experts: int, top_k: int, tokens: int, hidden: int, inter: int) -> tuple[Any, Any]:
    """``(pipeline, forward)``: a bf16 triton layer's pipeline from the router's logits (the routing kernel, the
    dispatch, both GEMMs, the combine) on CPU tensors, and its forward without grad mode. The pipeline runs the experts
    as one unit (:mod:`moeforge.stages.triton_step`) while its ``joined`` runs are set, stage by stage without them."""
    table = ConfigTable(experts, top_k)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16)
    pipeline = mf.Pipeline([
        TritonTopK(experts, top_k, mf.RoutingConfig()), AlignDispatch(experts, table),
        FusedGroupedGemm(mf.GemmRole.GATE_UP, w13, table, activation=mf.ActivationConfig()),
        FusedGroupedGemm(mf.GemmRole.DOWN, w2, table), Combine(apply_routing_weights=True),
    ], mf.input_spec(hidden, torch.bfloat16, experts))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, dtype=torch.bfloat16)

    def forward() -> Any:
        with torch.no_grad():
            return pipeline(mf.MoEInput(x, logits))

    return pipeline, forward


def floor_step(experts: int, top_k: int, tokens: int, hidden: int, inter: int) -> Callable[[], Any]:
    """A training step with the autograd structure of the slot-order step (five ``autograd.Function`` nodes: the
    gather, the gate/up GEMM, the activation, the down GEMM, the combine), its allocations (each op's outputs, each
    backward's gradients, the alignment's and the runs' buffers) and its launch calls (a no-op taking each launch's
    arguments: about 40 for a GEMM), and nothing else: the host time no planning of the same launches could go
    below on this machine's Python and torch."""
    copies = tokens * top_k

    def launch(*args: Any) -> None:
        return None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> Any:  # type: ignore[override]
            xs, sw = x.new_empty(copies, hidden), w.new_empty(copies)
            slot_of = x.new_empty(copies, dtype=torch.int32)
            runs = x.new_empty(4, experts + 1, dtype=torch.int32)
            launch(x, w, xs, sw, slot_of, runs, 1, 2, 3)
            launch(runs, 1, 2)
            ctx.save_for_backward(slot_of)
            ctx.mark_non_differentiable(slot_of, runs)
            return xs, sw, slot_of, runs

        @staticmethod
        def backward(ctx: Any, d_xs: Any, d_sw: Any, *unused: Any) -> Any:  # type: ignore[override]
            # (the rows' gradient reaches x through the gate/up GEMM's backward; the weights' is read at their slots)
            (slot_of,) = ctx.saved_tensors
            d_w = d_sw.new_empty(copies)
            launch(d_sw, slot_of, d_w, 1)
            return None, d_w

    class Gemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor,  # type: ignore[override]
                    block_expert: torch.Tensor, num_padded: torch.Tensor, runs: torch.Tensor,
                    tokens_in: Optional[torch.Tensor]) -> Any:
            out = a.new_empty(copies, w.shape[1])
            launch(a, w, out, sorted_ids, block_expert, num_padded, *range(40))
            ctx.save_for_backward(a, w, sorted_ids, block_expert, num_padded, runs)
            ctx.gathered = tokens_in is not None
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            a, w, sorted_ids, block_expert, num_padded, runs = ctx.saved_tensors
            grad = grad.contiguous()
            d_rows, dw = torch.empty(copies, a.shape[1], dtype=a.dtype), torch.empty(w.shape, dtype=w.dtype)
            launch(grad, w, d_rows, sorted_ids, block_expert, num_padded, *range(40))
            d_tokens = None
            if ctx.gathered:  # (the gate/up GEMM's rows were gathered from the tokens: their copies summed into them)
                d_tokens = torch.empty(tokens, a.shape[1], dtype=a.dtype)
                launch(d_rows, d_tokens, 1, 2)
            launch(grad, a, dw, runs, *range(12))
            return None if ctx.gathered else d_rows, dw, None, None, None, None, d_tokens

    class Act(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, pre: torch.Tensor) -> Any:  # type: ignore[override]
            out = pre.new_empty(copies, pre.shape[1] // 2)
            launch(pre, out, 1, 2, 3)
            ctx.save_for_backward(pre)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            (pre,) = ctx.saved_tensors
            d_pre = torch.empty_like(pre)
            launch(grad, pre, d_pre, 1, 2)
            return d_pre

    class Combined(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, rows: torch.Tensor, w: torch.Tensor) -> Any:  # type: ignore[override]
            out = rows.new_empty(tokens, rows.shape[1])
            launch(rows, w, out, 1, 2, 3)
            ctx.save_for_backward(rows, w)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            rows, w = ctx.saved_tensors
            d_rows, d_w = torch.empty_like(rows), torch.empty_like(w)
            launch(grad, rows, w, d_rows, d_w, 1, 2)
            return d_rows, d_w

    w13, w2, x, weights, grad = _floor_tensors(experts, top_k, tokens, hidden, inter)

    def step() -> Any:
        xr, w = x.detach().requires_grad_(), weights.detach().requires_grad_()
        sorted_ids = torch.empty(copies + experts * 16, dtype=torch.int32)
        block_expert = torch.empty(copies // 16 + experts, dtype=torch.int32)
        num_padded = torch.empty(1, dtype=torch.int32)
        for buffer in (sorted_ids, block_expert, num_padded):  # (the alignment's three launches)
            launch(buffer, 1, 2)
        xs, sw, _, runs = Gather.apply(xr, w.reshape(-1))
        pre = Gemm.apply(xs, w13, sorted_ids, block_expert, num_padded, runs, xr)
        hidden_rows = Gemm.apply(Act.apply(pre), w2, sorted_ids, block_expert, num_padded, runs, None)
        out = Combined.apply(hidden_rows, sw)
        return torch.autograd.grad(out, [xr, w, w13, w2], grad)

    return step


def one_node_floor_step(experts: int, top_k: int, tokens: int, hidden: int, inter: int) -> Callable[[], Any]:
    """:func:`floor_step` with the structure of the pipeline's training step (:mod:`moeforge.stages.triton_step`):
    the same allocations and launch calls in one ``autograd.Function``."""
    copies = tokens * top_k

    def launch(*args: Any) -> None:
        return None

    class Step(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, w13: torch.Tensor,  # type: ignore[override]
                    w2: torch.Tensor) -> Any:
            sorted_ids = torch.empty(copies + experts * 16, dtype=torch.int32)
            block_expert = torch.empty(copies // 16 + experts, dtype=torch.int32)
            num_padded = torch.empty(1, dtype=torch.int32)
            for buffer in (sorted_ids, block_expert, num_padded):  # (the alignment's three launches)
                launch(buffer, 1, 2)
            xs, sw = x.new_empty(copies, hidden), w.new_empty(copies)
            slot_of = x.new_empty(copies, dtype=torch.int32)
            runs = x.new_empty(4, experts + 1, dtype=torch.int32)
            launch(x, w, xs, sw, slot_of, runs, 1, 2, 3)
            launch(runs, 1, 2)
            pre = xs.new_empty(copies, w13.shape[1])
            launch(xs, w13, pre, sorted_ids, block_expert, num_padded, *range(40))
            act = pre.new_empty(copies, pre.shape[1] // 2)
            launch(pre, act, 1, 2, 3)
            rows = act.new_empty(copies, w2.shape[1])
            launch(act, w2, rows, sorted_ids, block_expert, num_padded, *range(40))
            out = rows.new_empty(tokens, rows.shape[1])
            launch(rows, w, out, 1, 2, 3)
            ctx.save_for_backward(x, w, w13, w2)
            ctx.kept = (xs, slot_of, runs, pre, act, rows, sorted_ids, block_expert, num_padded)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            x, w, w13, w2 = ctx.saved_tensors
            xs, slot_of, runs, pre, act, rows, sorted_ids, block_expert, num_padded = ctx.kept
            d_rows, d_w = torch.empty_like(rows), torch.empty_like(w)
            launch(grad, rows, w, d_rows, d_w, 1, 2)
            d_act, dw2 = torch.empty_like(act), torch.empty_like(w2)
            launch(d_rows, w2, d_act, sorted_ids, block_expert, num_padded, *range(40))
            launch(d_rows, act, dw2, runs, *range(12))
            d_pre = torch.empty_like(pre)
            launch(d_act, pre, d_pre, 1, 2)
            d_xs, dw13 = torch.empty_like(xs), torch.empty_like(w13)
            launch(d_pre, w13, d_xs, sorted_ids, block_expert, num_padded, *range(40))
            d_x = torch.empty_like(x)
            launch(d_xs, d_x, 1, 2)
            launch(d_pre, xs, dw13, runs, *range(12))
            return d_x, d_w, dw13, dw2

    w13, w2, x, weights, grad = _floor_tensors(experts, top_k, tokens, hidden, inter)

    def step() -> Any:
        xr, w = x.detach().requires_grad_(), weights.detach().requires_grad_()
        out = Step.apply(xr, w, w13, w2)
        return torch.autograd.grad(out, [xr, w, w13, w2], grad)

    return step


def median_us(fn: Callable[[], Any], steps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slot-rows", choices=("rule", "on", "off"), default="rule")
    parser.add_argument("--profile", type=int, default=0, help="print a cProfile listing of this many steps")
    parser.add_argument("--staged", action="store_true",
                        help="also time the step run stage by stage (five autograd nodes), alternating with the "
                             "pipeline's one node, in rounds")
    parser.add_argument("--inference", action="store_true",
                        help="also time an inference forward (no grad, routing included) as one unit and stage by "
                             "stage, in alternating rounds")
    parser.add_argument("--floor", action="store_true",
                        help="also time the same autograd nodes, allocations and launch calls without moeforge")
    parser.add_argument("--weights-on-input", action="store_true",
                        help="the routing weights scale the dispatch's rows (Llama-4) instead of the combine's; "
                             "every launch zeroes its index arguments, and the step with the weights in the combine "
                             "is timed beside it in alternating rounds under the same stub")
    args = parser.parse_args()
    slot_rows = {"rule": None, "on": True, "off": False}[args.slot_rows]
    on_input = args.weights_on_input
    forward, step = training_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter, slot_rows,
                                  weights_on_input=on_input)
    with launches_stubbed(valid_indices=on_input):
        print(f"E={args.experts} k={args.top_k} M={args.tokens} (H={args.hidden}, I={args.inter}), slot rows "
              f"{args.slot_rows}, weights {'on the input' if on_input else 'in the combine'}, launches "
              f"stubbed{' (index arguments zeroed)' if on_input else ''}: forward "
              f"{median_us(forward, args.steps):.0f} us, step {median_us(step, args.steps):.0f} us "
              f"(medians of {args.steps}; torch {torch.__version__}, {torch.get_num_threads()} threads)")
        if on_input:
            _, in_combine = training_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter, slot_rows)
            rounds = {"weights on the input": [], "weights in the combine": []}
            for _ in range(5):
                rounds["weights on the input"].append(median_us(step, args.steps // 5 + 1))
                rounds["weights in the combine"].append(median_us(in_combine, args.steps // 5 + 1))
            print("the step in one node, alternating rounds of " + str(args.steps // 5 + 1) + ": " + ", ".join(
                f"{name} {statistics.median(times):.0f} us" for name, times in rounds.items()))
        if args.staged:
            _, staged = training_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter, slot_rows,
                                      joined=False, weights_on_input=on_input)
            rounds: dict[str, list[float]] = {"one node": [], "stage by stage": []}
            for _ in range(5):
                rounds["one node"].append(median_us(step, args.steps // 5 + 1))
                rounds["stage by stage"].append(median_us(staged, args.steps // 5 + 1))
            print("the step, alternating rounds of " + str(args.steps // 5 + 1) + ": " + ", ".join(
                f"{name} {statistics.median(times):.0f} us" for name, times in rounds.items()))
        if args.inference:
            pipeline, inference = inference_forward(args.experts, args.top_k, args.tokens, args.hidden, args.inter)
            joined, rounds = pipeline.joined, {"one unit": [], "stage by stage": []}
            for _ in range(5):
                for name, runs in (("one unit", joined), ("stage by stage", (None,) * len(joined))):
                    pipeline.joined = runs
                    rounds[name].append(median_us(inference, args.steps // 5 + 1))
            pipeline.joined = joined
            print(f"an inference forward (no grad, routing included), alternating rounds of {args.steps // 5 + 1}: "
                  + ", ".join(f"{name} {statistics.median(times):.0f} us" for name, times in rounds.items()))
        if args.floor:
            floor = floor_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter)
            print(f"the floor (the same five autograd nodes, allocations and launch calls, nothing else): step "
                  f"{median_us(floor, args.steps):.0f} us")
            one_node = one_node_floor_step(args.experts, args.top_k, args.tokens, args.hidden, args.inter)
            print(f"the floor in one autograd node (the training step's structure): step "
                  f"{median_us(one_node, args.steps):.0f} us")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.profile):
                step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(50)


if __name__ == "__main__":
    main()
