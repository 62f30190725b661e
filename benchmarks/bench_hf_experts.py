"""Time ``experts_implementation="moeforge"`` against ``transformers``' own experts implementations (CUDA only).

    python benchmarks/bench_hf_experts.py [--models small,medium] [--tokens 1,16,...] [--out FILE]

Tiny-to-medium random ``Qwen3MoeForCausalLM`` models in bf16 (``small``: 64 experts, top-8, H=1024, I=512, 4
layers; ``medium``: Qwen3-30B-A3B's MoE layer, 128 experts, top-8, H=2048, I=768, 4 layers), for each token
count M (M tokens as sequences of at most 128):

* ``model``: the whole forward (``model(ids)``, no KV cache), attention and router included;
* ``experts``: one experts module's call on fixed routing (``experts(hidden, top_k_index, top_k_weights)``):
  what the experts implementation alone costs;
* ``experts_graph``: the same call captured in a CUDA graph and replayed (no host work: the GPU time alone;
  ``None`` where the implementation cannot be captured);
* ``pipeline`` (moeforge only): its pipeline run directly, without the experts function around it (the
  function's own cost is ``experts - pipeline``).

for ``experts_implementation`` ``grouped_mm`` (``transformers``' default: ``torch.nn.functional.grouped_mm``),
``moeforge`` (the triton pipeline) and, up to 16 tokens, ``batched_mm``. Times are medians of eager calls
(no CUDA graph: how ``transformers`` runs them), between CUDA events, after warm-up. It also checks that
``moeforge``'s output agrees with ``grouped_mm``'s (relative L2 difference, printed). Prints a table and writes
JSON (device, versions, commit, date, records).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import time_graph  # noqa: E402
from provenance import measured_commit  # noqa: E402

from moeforge import hf_experts  # noqa: E402
from moeforge.payloads import Activations, RoutedTokens, TopKOutput  # noqa: E402

MODELS = {  # name -> (experts, top_k, hidden, moe intermediate, layers)
    "small": (64, 8, 1024, 512, 4),
    "medium": (128, 8, 2048, 768, 4),
}
TOKENS = (1, 16, 256, 2048, 8192)
IMPLEMENTATIONS = ("grouped_mm", "moeforge", "batched_mm")


def build(name: str) -> Any:
    import transformers

    experts, top_k, hidden, inter, layers = MODELS[name]
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    return model


def median_us(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fn: Callable[[], Any], reps: int) -> Optional[float]:
    """Median microseconds of a CUDA-graph replay of ``fn`` (``None`` if it cannot be captured)."""
    try:
        return time_graph(fn, reps, None)
    except Exception:  # noqa: BLE001 - any capture failure means "not capturable"
        torch.cuda.synchronize()
        return None


def _us(value: Optional[float]) -> str:
    return "   n/a   " if value is None else f"{value:7.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None, help="the commit measured, when run from a copy without its git")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hf_experts.py needs a CUDA device")
    import transformers

    function = hf_experts.register()
    records: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model = build(name)
        experts_count, top_k, hidden = MODELS[name][:3]
        experts = model.model.layers[0].mlp.experts
        for tokens in (int(t) for t in args.tokens.split(",")):
            seq = min(tokens, 128)
            ids = torch.randint(0, 1024, (tokens // seq, seq), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(tokens))
            hidden_states = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(tokens, experts_count, device="cuda")
            weights, index = logits.softmax(-1).topk(top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
            outputs = {}
            for implementation in IMPLEMENTATIONS:
                if implementation == "batched_mm" and tokens > 16:  # it gathers one weight copy per (token, k)
                    continue
                model.set_experts_implementation(implementation)
                with torch.no_grad():
                    outputs[implementation] = experts(hidden_states, index, weights).float()
                    record = dict(model=name, tokens=tokens, implementation=implementation,
                                  model_us=median_us(lambda: model(ids), args.reps),
                                  experts_us=median_us(lambda: experts(hidden_states, index, weights), args.reps),
                                  experts_graph_us=graph_us(lambda: experts(hidden_states, index, weights), args.reps))
                    if implementation == "moeforge":
                        pipeline = function.pipeline(experts, hidden_states, top_k)
                        routed = RoutedTokens(x=Activations(hidden_states), topk=TopKOutput(
                            weights=weights.float(), ids=index.to(torch.int32)))
                        record["pipeline_us"] = median_us(lambda: pipeline.run(routed), args.reps)
                records.append(record)
            want = outputs["grouped_mm"]
            difference = float((outputs["moeforge"] - want).norm() / want.norm())
            by = {r["implementation"]: r for r in records if r["model"] == name and r["tokens"] == tokens}
            theirs, ours = by["grouped_mm"], by["moeforge"]
            print(f"{name:6s} M={tokens:5d}  model: grouped_mm {theirs['model_us']:9.1f} us  moeforge "
                  f"{ours['model_us']:9.1f} us ({theirs['model_us'] / ours['model_us']:.2f}x)"
                  f"  | experts: grouped_mm {theirs['experts_us']:8.1f} us  moeforge {ours['experts_us']:8.1f} us "
                  f"({theirs['experts_us'] / ours['experts_us']:.2f}x; pipeline alone {ours['pipeline_us']:7.1f} us)"
                  f"  | graphs: grouped_mm {_us(theirs['experts_graph_us'])}  moeforge {_us(ours['experts_graph_us'])}"
                  + (f"  batched_mm {by['batched_mm']['experts_us']:8.1f} us" if "batched_mm" in by else "")
                  + f"  | rel. diff {difference:.1e}", flush=True)
            by["moeforge"]["rel_diff_vs_grouped_mm"] = difference
        del model
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    result = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
                  commit=args.commit or measured_commit(),
                  date=datetime.date.today().isoformat(), records=records)
    out = args.out or (Path(__file__).resolve().parent / "results" /
                       f"bench_hf_experts-{re.sub(r'[^a-z0-9]+', '_', device.lower()).strip('_')}-"
                       f"{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
