"""Check that a stage does what its contract says: the payloads it produces match its declared spec.

The pipeline trusts ``stage.output_spec`` at build time and does not look at tensors at run time, so a
stage whose output disagrees with its declaration would only show up as a wrong answer (or a crash)
further down. These checks run the stage on generated payloads and compare.
"""

from __future__ import annotations

from typing import Any, Optional

import hypothesis
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from moeforge.errors import PayloadError, _show
from moeforge.payloads import Activations, ExpertRows, MoEInput, MoEOutput, PaddedRows, RoutedTokens, check_payload
from moeforge.spec import Layout, Spec
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


def with_stale_slots(rows: PaddedRows, seed: int = 0) -> PaddedRows:
    """``rows`` with every unused slot (past its expert's ``masked_m``) holding what an exchange may leave there:
    the low-latency and symmetric dispatchers never write those slots, so they keep an earlier batch's bits. Float
    rows get NaN, infinities and the dtype's largest values; 1-byte rows (FP8, INT8, packed 4-bit) random bytes; scales
    one per slot NaN (float) or random bytes. The used slots, ``masked_m``, the slots' weights (0 past the used ones,
    as the layout says) and the plan are ``rows``' own."""
    data = rows.x.data
    experts, capacity = data.shape[:2]
    used = rows.used_slots()
    generator = torch.Generator().manual_seed(seed)

    def stale(values: torch.Tensor) -> torch.Tensor:
        if values.dim() < 2 or tuple(values.shape[:2]) != (experts, capacity):
            return values  # (a scale for the whole tensor: no slots)
        unused = (~used).reshape(experts, capacity, *([1] * (values.dim() - 2))).expand_as(values)
        if values.dtype.is_floating_point and values.element_size() >= 2:
            big = torch.finfo(values.dtype).max
            pattern = torch.tensor([float("nan"), float("inf"), -big, big], dtype=values.dtype)
            junk = pattern[torch.randint(0, 4, values.shape, generator=generator)].to(values.device)
        else:
            raw = torch.randint(0, 256, (*values.shape[:-1], values.shape[-1] * values.element_size()),
                                generator=generator, dtype=torch.uint8)
            junk = raw.view(values.dtype).to(values.device)
        return torch.where(unused, junk, values)

    scale = rows.x.scale
    return rows.with_x(Activations(stale(data), stale(scale) if scale is not None else None))


def _used_parts(payload: object, used: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """What of a stage's output a later stage may read: a padded output's used slots (data and per-slot scales, as
    bytes), every tensor of any other output."""
    if isinstance(payload, PaddedRows) and used is not None:
        parts = [payload.x.data]
        if payload.x.scale is not None:
            parts.append(payload.x.scale)
        out = []
        for part in parts:
            if part.dim() >= 2 and tuple(part.shape[:2]) == tuple(used.shape):
                part = part[used]
            out.append(part.contiguous().view(torch.uint8) if part.element_size() == 1 else part)
        return out
    if isinstance(payload, MoEOutput):
        return [payload.hidden_states]
    if isinstance(payload, ExpertRows):
        return [payload.x.data] + ([payload.x.scale] if payload.x.scale is not None else [])
    raise AssertionError(f"no comparison for a {type(payload).__name__} output")


def check_ignores_unused_slots(stage: Stage[Any, Any], input_spec: Spec, payload: PaddedRows, seed: int = 0) -> None:
    """Run ``stage`` on padded ``payload`` as it is and with its unused slots stale (:func:`with_stale_slots`): what a
    later stage may read of the output (a padded output's used slots, any other output whole) must be the same bits.
    Raises ``AssertionError`` naming the stage."""
    check_stage(stage, input_spec, payload)
    clean = stage(payload)
    dirty = stage(with_stale_slots(payload, seed))
    used = None
    if isinstance(clean, PaddedRows):
        used = clean.used_slots()
    for index, (want, got) in enumerate(zip(_used_parts(clean, used), _used_parts(dirty, used))):
        same = torch.equal(want, got) or (want.is_floating_point() and bool(
            ((want == got) | (want.isnan() & got.isnan())).all()))
        if not same:
            raise AssertionError(f"{stage.name} reads the unused slots of padded rows: with them stale, its output's "
                                 f"{'data' if index == 0 else 'scales'} at the used slots changed")


def assert_stage_ignores_unused_slots(
    stage: Stage[Any, Any],
    input_spec: Spec,
    payloads: Optional[st.SearchStrategy[Any]] = None,
    *,
    max_examples: int = 15,
    settings: Optional[hypothesis.settings] = None,
) -> None:
    """Property test for a stage that takes ``EXPERT_PADDED`` rows: the slots past each expert's ``masked_m`` hold
    whatever the buffer last held (an exchange leaves them unwritten, NaN included), so the stage's output must not
    depend on them (:func:`check_ignores_unused_slots` on payloads drawn from ``payloads``, by default
    :func:`~moeforge.testing.payload_for`). One scale for the whole tensor taken over every slot, or a sum over the
    slots, fails it."""
    if input_spec.layout is not Layout.EXPERT_PADDED:
        raise ValueError(f"unused slots are the padded layout's: the spec says {input_spec.layout.value}")
    accepted_output_spec(stage, input_spec)
    strategy: st.SearchStrategy[Any] = payloads if payloads is not None else payload_for(input_spec)

    @given(strategy, st.integers(0, 2**16))
    def ignores_unused_slots(payload: PaddedRows, seed: int) -> None:
        check_ignores_unused_slots(stage, input_spec, payload, seed)

    (settings or default_settings(max_examples))(ignores_unused_slots)()
