"""Expert parallelism: every rank holds a slice of the experts and exchanges token rows.

    torchrun --nproc-per-node 2 examples/expert_parallel.py      # CPU (gloo) or one GPU per rank (NCCL)

Each rank builds the same whole DeepSeek-V3-style layer (same seed), an expert-parallel layer that
holds only its experts (``shard_state_dict``), runs its own tokens through both — with the normal
all-to-all dispatcher, the low-latency one, the symmetric-memory one (each token sent once to each rank owning
its experts, the copies summed there in bf16 partials: on the GPUs of one host; elsewhere it says why and the
low-latency exchange serves), and with FP8 dispatch through a pipeline built by hand — and checks that they
agree.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import moeforge as mf
from moeforge.distributed import AllToAllDispatch, ExpertParallel, LowLatencyDispatch, SymmetricDispatch, shard_state_dict
from moeforge.stages import ParamRef, PerGroupQuantizer, Stage


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sizes = dict(num_experts=8 * world, top_k=4, hidden_size=256, intermediate_size=128, n_group=4, topk_group=2,
                 dtype=torch.float32, device=device)

    torch.manual_seed(0)
    whole = mf.MoELayer.from_preset("deepseek_v3", **sizes, backend="torch")
    with torch.no_grad():  # random selection bias too, so the routing is not trivial
        whole.e_score_correction_bias.normal_()
    ep = ExpertParallel(sizes["num_experts"])
    tokens = torch.randn(3 + 5 * rank, sizes["hidden_size"], device=device)  # a different count per rank
    want = whole(tokens)

    dispatchers = {"all-to-all": "auto", "low-latency": LowLatencyDispatch(ep, max_tokens=64),
                   "symmetric": SymmetricDispatch(ep, max_tokens=64, send_tokens_once=True,
                                                  sum_on_owner=torch.bfloat16)}
    for name, dispatcher in dispatchers.items():
        layer = mf.MoELayer.from_preset("deepseek_v3", **sizes, expert_parallel=ep, dispatcher=dispatcher)
        layer.load_state_dict(shard_state_dict(whole.state_dict(), layer))
        got = layer(tokens)
        err = float((got - want).norm() / want.norm())
        if rank == 0 and name != "low-latency":
            print(layer.describe())
        print(f"rank {rank}/{world}: {tokens.shape[0]} tokens, experts {ep.first_expert}..{ep.first_expert + ep.local_experts - 1}, "
              f"{name}: rel err vs the whole layer {err:.2e}", flush=True)
        # (bf16 partials: each rounded once more, where the symmetric transport serves)
        assert err < (1e-2 if name == "symmetric" else 1e-5), err

    # FP8 on the wire: quantize per 128-group before the dispatch; the expert GEMMs dequantize.
    dispatch = AllToAllDispatch(ep)
    stages: list[Stage] = [  # type: ignore[type-arg]
        mf.TopK(sizes["num_experts"], sizes["top_k"], layer.routing, ParamRef(layer, "e_score_correction_bias")),
        mf.QuantizeTokens(PerGroupQuantizer()),
        dispatch,
        mf.GroupedGemm(mf.GemmRole.GATE_UP, ParamRef(layer, "w13_weight"), out_dtype=mf.DType.FP32),
        mf.Activate(layer.activation),
        mf.GroupedGemm(mf.GemmRole.DOWN, ParamRef(layer, "w2_weight")),
        dispatch.combine_stage(routed_scaling_factor=None, out_dtype=mf.DType.FP32),
    ]
    fp8 = mf.Pipeline(stages, mf.input_spec(sizes["hidden_size"], torch.float32, sizes["num_experts"]))
    got = fp8(mf.MoEInput(tokens, whole.router_logits(tokens))).hidden_states + whole.shared_experts(tokens)
    err = float((got - want).norm() / want.norm())
    print(f"rank {rank}/{world}: fp8 dispatch rel err vs the whole layer {err:.2e} (quantization error)", flush=True)
    assert err < 0.1, err
    dist.destroy_process_group()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
