"""``MoELayer.from_preset`` / ``moeforge.families.preset`` keyword checks: a keyword the family does not
take, a required option left out, or a setting the family fixes itself is a ``PresetError`` (a
``TypeError``) that names the keyword and lists what the family takes. No ``transformers`` needed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moeforge as mf
from moeforge.families import FAMILIES, PresetError, preset

SIZES: dict[str, Any] = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=32)
# What each family needs besides the sizes (DeepSeek-V3's default 8 expert groups do not divide 4 experts).
REQUIRED: dict[str, dict[str, Any]] = {"qwen2_moe": dict(shared_expert_intermediate_size=16),
                                     "deepseek_v3": dict(n_group=2, topk_group=1)}


def options_line(message: str) -> str:
    return next(line for line in message.splitlines() if "own options" in line)


@pytest.mark.parametrize("name, keyword, own_options, accepted_by", [
    ("mixtral", "norm_topk_prob", "none", "deepseek_v3, olmoe, qwen2_moe, qwen3_moe"),
    ("gpt_oss", "norm_topk_prob", "swiglu_alpha=1.702, swiglu_limit=7.0", "deepseek_v3, olmoe, qwen2_moe, qwen3_moe"),
    ("qwen3_moe", "n_group", "norm_topk_prob=False", "deepseek_v3"),
    ("llama4", "swiglu_limit", "shared_intermediate_size=None", "gpt_oss"),
    ("phimoe", "shared_intermediate_size", "router_jitter_noise=0.01", "deepseek_v3, granite_moe, llama4"),
])
def test_another_familys_option_is_named_with_this_familys_options(name: str, keyword: str, own_options: str,
                                                                  accepted_by: str) -> None:
    with pytest.raises(PresetError) as info:
        mf.MoELayer.from_preset(name, **SIZES, **REQUIRED.get(name, {}), **{keyword: 1})
    message = str(info.value)
    assert isinstance(info.value, TypeError)
    assert message.startswith(f"the {name} preset does not take the keyword argument(s) '{keyword}'")
    assert options_line(message) == f"  {name}'s own options: {own_options}" + (
        " (its routing and activation are fixed)" if own_options == "none" else "")
    assert f"'{keyword}' is an option of {accepted_by}, not of {name}" in message


def test_a_misspelt_option_gets_a_suggestion() -> None:
    with pytest.raises(PresetError, match=r"'n_groups': did you mean 'n_group'\?"):
        mf.MoELayer.from_preset("deepseek_v3", **SIZES, n_groups=4)
    with pytest.raises(PresetError, match=r"'dispatch_dypte': did you mean 'dispatch_dtype'\?"):
        mf.MoELayer.from_preset("olmoe", **SIZES, dispatch_dypte="bf16")


def test_the_message_lists_the_layer_arguments_the_family_leaves_open() -> None:
    with pytest.raises(PresetError) as info:
        preset("mixtral", **SIZES, bogus=1)
    leaves = next(line for line in str(info.value).splitlines() if "leaves to you" in line)
    listed = leaves.split("leaves to you: ")[1].split(", ")
    assert "routing" not in listed and "activation" not in listed  # mixtral fixes those
    assert {"quant", "backend", "dtype", "device", "dispatch_dtype", "expert_parallel"} <= set(listed)


@pytest.mark.parametrize("name, keyword", [("mixtral", "routing"), ("gpt_oss", "expert_bias"),
                                           ("deepseek_v3", "shared_experts"), ("llama4", "activation")])
def test_a_setting_the_family_fixes_is_refused_with_the_way_to_override_it(name: str, keyword: str) -> None:
    with pytest.raises(PresetError, match=rf"the {name} preset sets '{keyword}' itself .*"
                                          rf"MoELayer\(\*\*\{{\*\*settings, '{keyword}': \.\.\.\}}\)"):
        mf.MoELayer.from_preset(name, **SIZES, **{keyword: None})


def test_a_missing_required_option_is_named() -> None:
    with pytest.raises(PresetError, match=r"the qwen2_moe preset needs 'shared_expert_intermediate_size' \(its "
                                          r"options: shared_expert_intermediate_size, norm_topk_prob=False\)"):
        mf.MoELayer.from_preset("qwen2_moe", **SIZES)
    with pytest.raises(PresetError, match=r"the mixtral preset needs 'hidden_size'"):
        mf.MoELayer.from_preset("mixtral", num_experts=4, top_k=2, intermediate_size=32)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_valid_keywords_still_build_the_family(name: str) -> None:
    """Every family takes its sizes, its required options and MoELayer's own arguments."""
    layer = mf.MoELayer.from_preset(name, **SIZES, **REQUIRED.get(name, {}), dtype=torch.float32, backend="torch",
                                    environ={}, debug=True)
    assert (layer.num_experts, layer.top_k, layer.hidden_size) == (4, 2, 32)
    assert layer.dtype == torch.float32 and layer.debug
    settings = preset(name, **SIZES, **REQUIRED.get(name, {}), dtype=torch.float32)
    assert settings["dtype"] == torch.float32 and "routing" in settings
