"""``torch.compile`` of ``transformers`` models whose experts run through moeforge: a model compiles with
``fullgraph=True`` before its first eager call, a compiled model does not recompile when other models are
built, run and freed (its guards read only its own experts modules), and a compiled static-cache
``generate()`` gives the eager tokens — for several families.

The ``aot_eager`` backend runs Dynamo (where the failures were) and AOT autograd on fake tensors without
Inductor's code generation, which takes tens of seconds per graph on a CPU."""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(moe, "ExpertsInterface"):
    pytest.skip("this transformers has no experts interface", allow_module_level=True)

from moeforge import hf_experts  # noqa: E402

from test_hf_experts import build, experts_modules, logits, tokens  # noqa: E402

BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def function() -> hf_experts.ExpertsFunction:
    return hf_experts.register()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen2_moe", "olmoe"])
def test_a_model_compiles_in_one_graph_before_its_first_eager_call(name: str,
                                                                  function: hf_experts.ExpertsFunction) -> None:
    model = build(name, implementation="moeforge")
    ids = tokens()
    assert not any(function.pipelines_for(module) for module in experts_modules(model))
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    if not hf_experts._DYNAMO_PASSES_OBJECTS:  # torch 2.11: one eager call first, as the error says
        with pytest.raises(Exception, match="before their pipeline was built"):
            compiled(ids)
        torch._dynamo.reset()
        logits(model, ids)
    with torch.no_grad():
        out = compiled(ids).logits
    # The pipelines were built (outside the traced code) and kept on the experts modules.
    assert all(len(function.pipelines_for(module)) == 1 for module in experts_modules(model))
    torch.testing.assert_close(out, logits(build(name), ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_a_compiled_model_does_not_recompile_when_other_models_come_and_go(
        name: str, function: hf_experts.ExpertsFunction) -> None:
    ids = tokens()
    first, second = build(name, 0, "moeforge"), build(name, 1, "moeforge")
    compiled = torch.compile(second, fullgraph=True, backend=BACKEND)
    with torch.no_grad():
        first(ids)   # model A runs, model B runs, then B is compiled (the order)
        second(ids)
        expected = compiled(ids).logits
        with torch.compiler.set_stance("fail_on_recompile"):
            third = build(name, 2, "moeforge")
            third(ids)                          # another model's pipelines built
            del first
            gc.collect()                        # another model's freed
            torch.testing.assert_close(compiled(ids).logits, expected)
            del third
            gc.collect()
            torch.testing.assert_close(compiled(ids).logits, expected)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_compiled_static_cache_generate_gives_the_eager_tokens(name: str,
                                                                function: hf_experts.ExpertsFunction) -> None:
    ids = tokens(batch=1, length=5)
    with torch.no_grad():
        expected = build(name).generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
        model = build(name, implementation="moeforge")
        if not hf_experts._DYNAMO_PASSES_OBJECTS:  # torch 2.11: one eager call first
            model(ids)
        model.forward = torch.compile(model.forward, fullgraph=True, backend=BACKEND)
        got = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_copies_of_a_module_build_their_own_pipelines(function: hf_experts.ExpertsFunction) -> None:
    model = build("qwen3_moe", implementation="moeforge")
    ids = tokens()
    expected = logits(model, ids)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not any(function.pipelines_for(module) for module in experts_modules(copied))
        with torch.no_grad():
            copied.model.layers[0].mlp.experts.gate_up_proj.mul_(2)  # the copy reads its own weights
        changed = logits(copied, ids)
        assert not torch.allclose(changed, expected)
        torch.testing.assert_close(logits(model, ids), expected)


def test_where_dynamo_cannot_build_outside_the_trace_the_error_says_what_to_do(
        monkeypatch: pytest.MonkeyPatch, function: hf_experts.ExpertsFunction) -> None:
    # torch 2.11's Dynamo hands a constant-result function no objects: there, compiling before the first
    # eager call is refused with what to do; after one eager call the compiled model runs.
    monkeypatch.setattr(hf_experts, "_DYNAMO_PASSES_OBJECTS", False)
    model = build("qwen3_moe", implementation="moeforge")
    ids = tokens()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    with pytest.raises(Exception, match="run the model once without compiling"):
        compiled(ids)
    torch._dynamo.reset()
    expected = logits(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-5)
