"""The largest E8M0 code of an MXFP4 scale tensor, worked out once per state of the tensor.

The grouped GEMM decodes MXFP4 weights with one multiply per pair of weights fewer when it knows that every
E8M0 code of the weight is at most 128 (``moe_gemm(weight_scale_max=)``, ``dequant.FOLDED_SCALE_MAX``): it
then folds the e2m1 decoding's ``x 2**126`` into the scales. Checkpoints have such scales (a code of 128 is
the scale 2: an FP4 block of values up to 12).

A stage cannot afford a reduction and a host synchronisation in every forward, and cannot trust a maximum
taken when it was built either: the scales may be loaded or changed in place later (``load_state_dict``,
``copy_``). :class:`ScaleCodeBound` keeps the maximum together with the state of the tensor it was taken from
(storage, shape, strides and PyTorch's version counter, which every in-place write advances) and takes it
again when that state has changed. While a CUDA graph is captured it cannot synchronise: it then answers
with the maximum of the unchanged tensor, or ``None`` (the GEMM decodes without the fold, the same values).
Under ``torch.compile`` (no tensor state to compare while tracing) and for inference tensors (they keep no
version counter) it answers ``None``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch


@attrs.define(eq=False)
class ScaleCodeBound:
    """A cache of one scale tensor's largest code (a stage holds one per weight): :meth:`max_code`."""

    _state: Optional[tuple[object, ...]] = None
    _max: Optional[int] = None

    def max_code(self, scales: torch.Tensor) -> Optional[int]:
        """The largest value of the uint8 tensor ``scales``, or ``None`` where it cannot be known without a
        synchronisation that is not allowed now (or the tensor keeps no version counter)."""
        if torch.compiler.is_compiling() or scales.is_inference():
            return None
        state = (scales.device, scales.data_ptr(), tuple(scales.shape), scales.stride(), scales._version)
        if state == self._state:
            return self._max
        if scales.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        self._max = int(scales.max()) if scales.numel() else 0
        self._state = state
        return self._max
