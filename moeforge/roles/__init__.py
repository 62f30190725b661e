"""The roles a layer is assembled from (router, dispatcher, experts) and their implementations; the
selector that picks them is :mod:`moeforge.selector`."""

from moeforge.roles.base import Dispatcher, Experts, LayerConfig, Role, Router, TorchExperts, TritonExperts

__all__ = ["Dispatcher", "Experts", "LayerConfig", "Role", "Router", "TorchExperts", "TritonExperts"]
