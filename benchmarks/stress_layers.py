"""Race hunt: several processes on one GPU run the same triton layers over and over — Mixtral-8x7B's shape at 2048
tokens, Qwen3-30B-A3B's at 2048, DeepSeek-V2-Lite's at 1024, bf16, random weights — each inference output and
training step's gradients compared bit for bit with the process's first; NaN-filled tensors of random sizes churn the
caching allocator between calls; the even-numbered processes launch with programmatic dependent launch, the odd ones
without (``moeforge.kernels.pdl.GDC = False``). Prints, per process, the calls, steps and mismatches.

    PYTHONPATH=. python3 benchmarks/stress_layers.py OUT_DIR SECONDS PROCESSES

Written for a report of wrong results under a loaded GPU (docs/kernels.md, "The warp-specialised kernel's wrong rows
under load"), which it did not reproduce: results in ``benchmarks/results/stress_layers-*.json``."""
import json, sys, time, random
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

def worker(slot, pdl_on, seconds, out_dir):
    import torch
    import moeforge.kernels.pdl as pdl
    if not pdl_on:
        pdl.GDC = False
    import fuzz_layers as fz
    base = fz.draw(20410, False)
    configs = [("mixtral", dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336), 2048),
               ("qwen3_moe", dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, norm_topk_prob=True), 2048),
               ("deepseek_v3", dict(num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False), 1024)]
    rng = random.Random(slot)
    made = []
    for fam, sizes, tokens in configs:
        case = dict(base, family=fam, sizes=sizes, tokens=tokens, seed=11)
        layer = fz.triton_layer(case, "cuda")
        x = torch.randn(tokens, sizes["hidden_size"], device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(x)
        with torch.no_grad():
            ref = layer(x, None)
        xr = x.clone().requires_grad_()
        params = [p for p in layer.parameters() if p.requires_grad]
        ref_grads = torch.autograd.grad((layer(xr, None).float() * g.float()).sum(), [xr] + params)
        made.append((f"{fam}-{tokens}", layer, x, g, ref, ref_grads, params))
    stats = {name: dict(calls=0, wrong=0, nonfinite=0, steps=0, wrong_steps=0) for name, *_ in made}
    first_bad = []
    deadline = time.time() + seconds
    while time.time() < deadline:
        name, layer, x, g, ref, ref_grads, params = made[rng.randrange(len(made))]
        junk = [torch.full((rng.randrange(1, 1 << 22),), float("nan"), dtype=torch.bfloat16, device="cuda")
                for _ in range(rng.randrange(1, 6))]
        junk.clear()  # (freed: the next buffers start as NaN)
        s = stats[name]
        try:
            step(s, name, layer, x, g, ref, ref_grads, params, rng, first_bad)
        except torch.cuda.OutOfMemoryError:
            s["oom"] = s.get("oom", 0) + 1
            torch.cuda.empty_cache()
    json.dump(dict(slot=slot, pdl=pdl_on, stats=stats, first_bad=first_bad), open(f"{out_dir}/stress{slot}.json", "w"), indent=1)

def step(s, name, layer, x, g, ref, ref_grads, params, rng, first_bad):
    import torch
    if rng.random() < 0.8:
        with torch.no_grad():
            out = layer(x, None)
        s["calls"] += 1
        if not torch.equal(out, ref):
            s["wrong"] += 1
            nf = int((~torch.isfinite(out.float())).sum())
            s["nonfinite"] += int(nf > 0)
            if len(first_bad) < 5:
                diff = (out.float() - ref.float()).abs()
                rows = (diff.reshape(diff.shape[0], -1).amax(-1) > 0).nonzero().flatten()
                first_bad.append(dict(name=name, kind="forward", nonfinite=nf, rows=rows[:10].tolist(), nrows=rows.numel()))
    else:
        xr = x.clone().requires_grad_()
        grads = torch.autograd.grad((layer(xr, None).float() * g.float()).sum(), [xr] + params)
        s["steps"] += 1
        bad = [i for i, (a, b) in enumerate(zip(grads, ref_grads)) if not torch.equal(a, b)]
        if bad:
            s["wrong_steps"] += 1
            if len(first_bad) < 5:
                first_bad.append(dict(name=name, kind="step", which=bad))

if __name__ == "__main__":
    import multiprocessing as mp
    out_dir, seconds, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=worker, args=(i, i % 2 == 0, seconds, out_dir)) for i in range(n)]
    for p in ps: p.start()
    for p in ps: p.join(seconds + 200)
    for p in ps:
        if p.is_alive(): p.kill()
    for i in range(n):
        try:
            d = json.load(open(f"{out_dir}/stress{i}.json"))
            print(i, "pdl" if d["pdl"] else "nopdl", d["stats"], d["first_bad"])
        except Exception as e:
            print(i, "no result", e)
