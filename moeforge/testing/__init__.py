"""Property-based testing of stages, pipelines and layers (needs ``hypothesis``).

``import moeforge`` does not import this package; import it from your tests. The same checks the
library runs on its built-in stages work on yours::

    import moeforge as mf
    from moeforge.testing import assert_stage_honours_contract

    class MyRouting(mf.Stage[mf.MoEInput, mf.RoutedTokens]):
        ...

    spec = mf.input_spec(hidden_size=16, dtype=torch.float32, num_experts=4)
    # Draws MoEInput payloads matching `spec` (0 and 1 tokens included, tied and skewed logits),
    # runs the stage and checks each output against MyRouting().output_spec(spec).
    assert_stage_honours_contract(MyRouting(), spec)

Compose the strategies in your own hypothesis tests::

    from hypothesis import given, settings
    from moeforge.testing import check_matches_dense_reference, layer_configs

    @settings(max_examples=20, deadline=None)
    @given(layer_configs())
    def test_layer(config):
        layer = config.build()
        x, logits = config.inputs(num_tokens=3, seed=0)
        check_matches_dense_reference(layer, x, rtol=1e-4, logits=logits)

A stage meant to run in float64 layers too (so that ``torch.autograd.gradcheck`` can check a layer that
uses it) accepts ``moeforge.spec.REFERENCE_FLOAT_DTYPES`` (``FLOAT_DTYPES`` leaves float64 out, and the
contract checker refuses it in a float64 layer) and computes in ``accumulation_dtype(rows.dtype)`` (fp32,
float64 for float64 rows), not ``.float()``, which would round a float64 layer to fp32 and fail
gradcheck; check it here on a float64 spec, e.g. ``mf.input_spec(16, torch.float64, 4)``.
``examples/custom_activation.py`` is such a stage, gradcheck included.
"""

try:
    import hypothesis  # noqa: F401  (checked first: without it the submodules below fail with a bare name)
except ModuleNotFoundError as missing:
    if missing.name != "hypothesis":
        raise
    raise ModuleNotFoundError(
        "moeforge.testing needs the 'hypothesis' package, which is not installed: "
        "pip install 'moeforge[tests]' (or pip install hypothesis)", name="hypothesis") from missing

from moeforge.testing.contracts import (
    accepted_output_spec,
    assert_stage_honours_contract,
    assert_stage_ignores_unused_slots,
    check_ignores_unused_slots,
    check_stage,
    default_settings,
    with_stale_slots,
)
from moeforge.testing.properties import (
    check_dispatch_combine_identity,
    check_matches_dense_reference,
    check_token_permutation_equivariance,
)
from moeforge.testing.strategies import (
    LayerConfig,
    activation_configs,
    activations_like,
    dispatch_outputs,
    layer_configs,
    moe_inputs,
    moe_outputs,
    payload_for,
    quantizer_for_spec,
    routed_tokens,
    router_logits,
    routing_configs,
    token_counts,
    topk_outputs,
)

__all__ = [
    "LayerConfig", "accepted_output_spec", "activation_configs", "activations_like",
    "assert_stage_honours_contract", "assert_stage_ignores_unused_slots", "check_dispatch_combine_identity",
    "check_ignores_unused_slots", "check_matches_dense_reference",
    "check_stage", "check_token_permutation_equivariance", "default_settings", "dispatch_outputs",
    "layer_configs", "moe_inputs", "moe_outputs", "payload_for", "quantizer_for_spec", "routed_tokens",
    "router_logits", "routing_configs", "token_counts", "topk_outputs", "with_stale_slots",
]
