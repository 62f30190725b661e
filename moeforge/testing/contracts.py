"""Check that a stage does what its contract says: the payloads it produces match its declared spec.

The pipeline trusts ``stage.output_spec`` at build time and does not look at tensors at run time, so a
stage whose output disagrees with its declaration would only show up as a wrong answer (or a crash)
further down. These checks run the stage on generated payloads and compare.
"""

from __future__ import annotations

from typing import Any, Optional

import hypothesis
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from moeforge.errors import PayloadError, _show
from moeforge.payloads import ExpertRows, MoEInput, MoEOutput, RoutedTokens, check_payload
from moeforge.spec import Spec
from moeforge.stage import Stage
from moeforge.testing.strategies import Payload, payload_for


def _num_tokens(payload: object) -> Optional[int]:
    """The number of tokens a payload describes, where it says."""
    if isinstance(payload, MoEInput):
        return int(payload.hidden_states.shape[0])
    if isinstance(payload, RoutedTokens):
        return int(payload.x.data.shape[0])
    if isinstance(payload, MoEOutput):
        return int(payload.hidden_states.shape[0])
    if isinstance(payload, ExpertRows):
        plan = getattr(payload, "plan", None)
        tokens = getattr(plan, "num_tokens", None)
        return tokens if isinstance(tokens, int) else None
    return None


def accepted_output_spec(stage: Stage[Any, Any], input_spec: Spec) -> Spec:
    """``stage.output_spec(input_spec)``, after asserting that the stage accepts ``input_spec``."""
    mismatches = stage.check(input_spec)
    if mismatches:
        lines = [f"  field '{m.field}': have {_show(m.have)}, stage accepts {_show(m.want)}"
                 + (f" (hint: {m.hint})" if m.hint else "") for m in mismatches]
        raise AssertionError(
            f"{stage.name} does not accept the input spec ({input_spec.short()}):\n" + "\n".join(lines))
    return stage.output_spec(input_spec)


def check_stage(stage: Stage[Any, Any], input_spec: Spec, payload: object) -> object:
    """Run ``stage`` on one ``payload`` (which must match ``input_spec``) and assert that its output
    matches ``stage.output_spec(input_spec)`` and keeps the token count. Returns the output payload.

    Raises ``AssertionError`` naming the stage and the broken field.
    """
    output_spec = accepted_output_spec(stage, input_spec)
    try:
        check_payload(payload, input_spec)
    except PayloadError as error:  # the test's fault, not the stage's: say so
        raise AssertionError(
            f"the input payload given to {stage.name} does not match its input spec "
            f"({input_spec.short()}): {error}") from error
    output = stage(payload)
    try:
        check_payload(output, output_spec)
    except PayloadError as error:
        raise AssertionError(
            f"{stage.name} broke its declared output spec ({output_spec.short()}): {error}") from error
    tokens_in, tokens_out = _num_tokens(payload), _num_tokens(output)
    if tokens_in is not None and tokens_out is not None and tokens_in != tokens_out:
        raise AssertionError(
            f"{stage.name} changed the number of tokens: {tokens_in} in, {tokens_out} out")
    return output


def default_settings(max_examples: int = 25) -> hypothesis.settings:
    """No deadline (the first call of a torch op can be slow), one bug reported at a time."""
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def assert_stage_honours_contract(
    stage: Stage[Any, Any],
    input_spec: Spec,
    payloads: Optional[st.SearchStrategy[Any]] = None,
    *,
    max_examples: int = 25,
    settings: Optional[hypothesis.settings] = None,
) -> None:
    """Property test: for payloads matching ``input_spec`` (drawn from ``payloads``, by default
    :func:`~moeforge.testing.payload_for`), ``stage`` produces payloads matching the spec it
    declares. Works for any stage, the built-in ones and yours.

    Raises ``AssertionError`` naming the stage and the broken field (hypothesis prints the
    falsifying example). ``settings`` overrides the default hypothesis settings entirely.
    """
    accepted_output_spec(stage, input_spec)  # fail fast, outside hypothesis, on a spec it rejects
    strategy: st.SearchStrategy[Payload] = payloads if payloads is not None else payload_for(input_spec)

    @given(strategy)
    def honours_contract(payload: object) -> None:
        check_stage(stage, input_spec, payload)

    (settings or default_settings(max_examples))(honours_contract)()
