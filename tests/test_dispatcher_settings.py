"""A dispatcher with settings of its own is one class outside moeforge, passed as an instance: no edit to
LayerConfig, MoELayer or the selector. The example is a capacity-dropping dispatcher (a fixed number of rows per
expert, the copies beyond it dropped), the kind the design's extension table measures."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import pytest
import torch

import moeforge as mf
from moeforge.kernels.config import ConfigTable
from moeforge.roles.base import LayerConfig
from moeforge.roles.dispatchers import PaddedDispatcher, combine_for
from moeforge.spec import Layout
from moeforge.stages.dispatch import PaddedDispatch

E, K, H, I = 4, 2, 32, 16


@attrs.frozen
class CapacityDispatcher(PaddedDispatcher):
    """``[E, capacity, H]`` rows; an expert's copies beyond ``capacity`` are dropped (``overflow="drop"``) or
    refused (``"error"``)."""

    capacity: int
    overflow: str = "drop"
    keyword: ClassVar[Optional[str]] = None
    automatic: ClassVar[bool] = False

    @classmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[mf.Stage[Any, Any], Optional[mf.Stage[Any, Any]]]:
        settings = cls.settings(config)
        assert isinstance(settings, CapacityDispatcher), "asked for by instance only (no keyword)"
        dispatch = PaddedDispatch(config.num_experts, capacity=settings.capacity, overflow=settings.overflow,
                                  apply_routing_weights=config.weights_on_input)
        return dispatch, combine_for(config)


def _layers(dispatcher: CapacityDispatcher) -> tuple[mf.MoELayer, mf.MoELayer]:
    torch.manual_seed(0)
    plain = mf.MoELayer(E, K, H, I, backend="torch", dtype=torch.float32, environ={})
    capped = mf.MoELayer(E, K, H, I, backend="torch", dtype=torch.float32, dispatcher=dispatcher, environ={})
    capped.load_state_dict(plain.state_dict())
    return plain, capped


def test_a_dispatcher_with_its_own_settings_is_chosen_by_instance() -> None:
    plain, capped = _layers(CapacityDispatcher(capacity=64))
    text = capped.describe()
    assert "CapacityDispatcher" in text and "PaddedDispatch(capacity=64, overflow=drop" in text
    x = torch.randn(10, H)
    torch.testing.assert_close(capped(x), plain(x))  # room for every copy: the same output


def test_its_settings_act_on_the_rows() -> None:
    plain, capped = _layers(CapacityDispatcher(capacity=1))
    x = torch.randn(16, H)
    assert not torch.allclose(capped(x), plain(x))  # 32 copies over 4 experts: most are dropped
    _, strict = _layers(CapacityDispatcher(capacity=1, overflow="error"))
    with pytest.raises(mf.InputError, match="capacity"):
        strict(x)


def test_two_instances_with_different_settings_build_different_layers() -> None:
    assert CapacityDispatcher(capacity=8) != CapacityDispatcher(capacity=9)
    _, small = _layers(CapacityDispatcher(capacity=8))
    _, large = _layers(CapacityDispatcher(capacity=9))
    assert "capacity=8" in small.describe() and "capacity=9" in large.describe()
