"""Quant methods: each owns the expert weights' format and contributes its stages."""

from moeforge.quant.base import QuantMethod
from moeforge.quant.unquantized import UnquantizedMethod

__all__ = ["QuantMethod", "UnquantizedMethod"]
