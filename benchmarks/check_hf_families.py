"""Every MoE family of the installed ``transformers`` with ``experts_implementation="moeforge"``, on the CPU.

    python benchmarks/check_hf_families.py [FAMILY ...] [--out FILE]

For each model family whose experts class is decorated with ``@use_experts_implementation`` (or the families named):
a tiny random model built from the family's own configuration class with small sizes (4 layers, width 32, 4 experts
of which 2 per token; a field the class does not take is left at its default, a family whose checks need more is
named with the error), every parameter drawn at random, in fp32. It compares the logits of ``"moeforge"`` with those
of ``"eager"`` (relative error of the whole tensor) and, after one backward of a loss on the logits in train mode,
every parameter's gradient (the largest relative error, and the parameter it is in), and counts the experts modules
that ran through moeforge's pipelines. One line per family: ``OK``, or where it stopped — building the model
(``build``: the tiny configuration is the script's limit, not moeforge's), the eager forward (``eager``), moeforge's
(``moeforge``: a refusal names what moeforge does not compute) or the backward (``training``). ``tests/test_hf_experts.py``
holds the families checked in CI; this script is the wider sweep, for a new ``transformers`` release.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import sys
from typing import Any

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from hf_helpers import randomise_weights  # noqa: E402  (the tests' tiny models are drawn the same way)
from moeforge import hf_experts  # noqa: E402

TINY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, vocab_size=96, max_position_embeddings=64, num_experts=4, num_local_experts=4,
    n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2, n_group=1, topk_group=1,
    first_k_dense_replace=0, shared_expert_intermediate_size=16, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    expert_ffn_hidden_size=16, moe_ffn_hidden_size=16, n_shared_experts=1, num_shared_experts=1, sliding_window=16,
    moe_layer_freq=1, decoder_sparse_step=1, mlp_only_layers=[], linear_num_value_heads=2, linear_num_key_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=1.0)
ONE_EXPERT_PER_TOKEN = {"zaya"}  # families whose configuration takes top-1 routing only


def families() -> list[str]:
    root = pathlib.Path(transformers.__file__).parent / "models"
    return sorted({path.parent.name for path in root.glob("*/modeling_*.py")
                   if "use_experts_implementation" in path.read_text()})


def tiny_model(family: str) -> Any:
    """The family's first causal LM on a tiny configuration (its text configuration where it has one), every parameter
    random, in eval mode; ``None`` where the family has no causal LM."""
    module = importlib.import_module(f"transformers.models.{family}")
    models = [name for name in dir(module) if name.endswith("ForCausalLM")]
    texts = [name for name in dir(module) if name.endswith("TextConfig")]
    configs = texts or [name for name in dir(module) if name.endswith("Config") and not name.endswith("VisionConfig")]
    if not models or not configs:
        return None
    config_class = getattr(module, configs[0])
    taken = inspect.signature(config_class.__init__).parameters
    fields = {name: value for name, value in TINY.items() if name in taken}
    if family in ONE_EXPERT_PER_TOKEN:
        fields["num_experts_per_tok"] = 1
    torch.manual_seed(0)
    model = getattr(module, models[0])(config_class(**fields)).eval()
    randomise_weights(model, 1)
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check(family: str, function: hf_experts.ExpertsFunction) -> str:
    where = "build"
    try:
        model = tiny_model(family)
        if model is None:
            return "SKIP no causal LM with a configuration of its own"
        ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(3))
        where = "eager"
        model.set_experts_implementation("eager")
        with torch.no_grad():
            want = model(ids).logits
        where = "moeforge"
        model.set_experts_implementation("moeforge")
        with torch.no_grad():
            got = model(ids).logits
        ran = sum(1 for module in model.modules() if hf_experts.module_pipelines(module) is not None
                  and function.pipelines_for(module))
        where = "training"
        model.train()
        grads = {}
        for implementation in ("eager", "moeforge"):
            model.set_experts_implementation(implementation)
            model.zero_grad()
            torch.manual_seed(5)  # the same draws for both: a training forward may sample (PhiMoE's routing does)
            (model(ids).logits.float() ** 2).mean().backward()
            grads[implementation] = {name: param.grad.clone() for name, param in model.named_parameters()
                                     if param.grad is not None}
        worst, name = max(((relative(grads["moeforge"][n], grads["eager"][n]), n) for n in grads["eager"]
                           if n in grads["moeforge"]), default=(0.0, "-"))
        missing = sorted(set(grads["eager"]) ^ set(grads["moeforge"]))
        return (f"OK experts modules through moeforge {ran}, logits {relative(got, want):.1e}, gradients up to "
                f"{worst:.1e} ({name})" + (f", gradients of one path only: {missing[:3]}" if missing else ""))
    except Exception as error:  # noqa: BLE001 - every family's failure is a line of the report
        return f"FAIL[{where}] {type(error).__name__}: {str(error)[:240]}".replace("\n", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="families to check (default: every one with the decorator)")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args()
    function = hf_experts.register()
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, fp32"]
    print(lines[0], flush=True)
    for family in args.families or families():
        line = f"{family:24s} {check(family, function)}"
        print(line, flush=True)
        lines.append(line)
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
