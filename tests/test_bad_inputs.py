"""Bad input and bad configuration: refused with an error that names the argument (and what to do),
never a silent wrong answer or an error from deep inside torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moeforge as mf

E, K, H, I = 8, 2, 16, 8


def make_layer(**kwargs: Any) -> mf.MoELayer:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("environ", {})
    torch.manual_seed(0)
    return mf.MoELayer(E, K, H, I, **kwargs)


# -- item 7: router logits paired with the hidden states ----------------------------------------------


def token_by_token(layer: mf.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The intended pairing: token ``t`` of ``x [T, H]`` routed by row ``t`` of ``logits [T, E]``."""
    return torch.cat([layer(x[t:t + 1], logits[t:t + 1]) for t in range(x.shape[0])])


# (hidden states' leading shape, router logits' leading shape) accepted.
ACCEPTED = [((6,), (6,)), ((2, 3), (2, 3)), ((2, 3), (6,)), ((1, 5), (1, 5)), ((3, 1), (3,))]


@pytest.mark.parametrize("lead, logits_lead", ACCEPTED, ids=[f"{a}-{b}" for a, b in ACCEPTED])
def test_every_accepted_router_logits_shape_pairs_token_by_token(
        lead: tuple[int, ...], logits_lead: tuple[int, ...]) -> None:
    layer = make_layer(router=False)
    x = torch.randn(*lead, H)
    logits = torch.randn(*logits_lead, E)
    with torch.no_grad():
        out = layer(x, logits)
        expected = token_by_token(layer, x.reshape(-1, H), logits.reshape(-1, E))
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, H), expected)


# (hidden states' leading shape, router logits' leading shape) refused: same token count, another pairing.
REFUSED = [((2, 3), (3, 2)), ((2, 3), (1, 6)), ((6,), (2, 3)), ((6,), (3, 2)), ((2, 3), (6, 1)),
           ((2, 3), (2, 3, 1))]


@pytest.mark.parametrize("lead, logits_lead", REFUSED, ids=[f"{a}-{b}" for a, b in REFUSED])
def test_router_logits_whose_leading_shape_differs_are_refused_naming_both_shapes(
        lead: tuple[int, ...], logits_lead: tuple[int, ...]) -> None:
    layer = make_layer(router=False)
    x, logits = torch.randn(*lead, H), torch.randn(*logits_lead, E)
    with pytest.raises(mf.InputError, match="router_logits") as info:
        layer(x, logits)
    assert str(tuple(logits.shape)) in str(info.value) and str(tuple(x.shape)) in str(info.value)
