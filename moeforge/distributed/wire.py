"""The wire format of dispatched rows: each row's data, scales and routing weight packed into bytes.

One ``uint8`` row per token copy, so that one ``all_to_all_single`` carries everything a rank needs
(one collective instead of three, and the same call for every dtype and process-group backend: gloo
has no fp8). The layout of a row of ``row_bytes`` bytes::

    [ data (width * element bytes) | scales (scale_width * scale bytes) | weight (fp32) | flag | padding ]

Offsets are aligned to the next field's element size and the row to 16 bytes. The flag byte is 1 in
every packed row, so a zero-filled fixed-capacity buffer tells its used rows apart by itself (the
low-latency dispatcher sends no counts). Fields are copied as 32-bit words where their offsets allow
(4x fewer elements than bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import attrs
import torch

from moeforge.dispatch_dtype import DispatchDtype
from moeforge.payloads import GROUP_SIZE, Activations
from moeforge.spec import ScaleLayout

_ROW_ALIGN = 16


def _align(offset: int, to: int) -> int:
    return -(-offset // to) * to


@dataclasses.dataclass(frozen=True, eq=False)  # a payload: see moeforge.payloads
class Traffic:
    """Bytes one rank sent and received in one exchange (rows, scales, weights and counts), including
    the rows a rank exchanges with itself."""

    sent: int
    received: int


@attrs.frozen
class RowFormat:
    """How one dispatched row is laid out on the wire (see the module docstring)."""

    width: int  # data elements per row (H, or H / 2 packed bytes for NVFP4)
    dtype: torch.dtype  # of the data
    scale_width: int = 0  # scale elements per row (0: no per-row scale)
    scale_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, x: Activations) -> RowFormat:
        """The format of token-major activations ``x`` (``data [T, W]``, scale ``[T, S]`` or none)."""
        scale = x.scale
        if scale is None:
            return cls(x.data.shape[-1], x.data.dtype)
        return cls(x.data.shape[-1], x.data.dtype, scale.shape[-1], scale.dtype)

    @classmethod
    def for_dispatch(cls, dispatch: DispatchDtype, hidden: int, scale_layout: ScaleLayout) -> RowFormat:
        """The format of ``hidden``-wide rows dispatched as ``dispatch`` (sizes buffers per layer from
        :attr:`DispatchDtype.params_bytes`)."""
        dtype = dispatch.activation_dtype.torch_dtype
        width = int(hidden * dispatch.params_bytes / dtype.itemsize)
        if scale_layout is ScaleLayout.NONE:
            return cls(width, dtype)
        if scale_layout is ScaleLayout.PER_TOKEN:
            return cls(width, dtype, 1)
        if scale_layout is ScaleLayout.PER_GROUP_128:
            return cls(width, dtype, hidden // GROUP_SIZE)
        if scale_layout is ScaleLayout.NVFP4_BLOCK16:
            return cls(width, dtype, hidden // 16, torch.float8_e4m3fn)
        raise ValueError(f"{scale_layout.value} scales cannot travel per row (one scale per rank's tensor)")

    @property
    def data_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def scale_offset(self) -> int:
        return _align(self.data_bytes, self.scale_dtype.itemsize)

    @property
    def weight_offset(self) -> int:
        return _align(self.scale_offset + self.scale_width * self.scale_dtype.itemsize, 4)

    @property
    def flag_offset(self) -> int:
        return self.weight_offset + 4

    @property
    def row_bytes(self) -> int:
        return _align(self.flag_offset + 1, _ROW_ALIGN)

    def _fields(self) -> list[tuple[int, int]]:
        """(offset, bytes) of data, scales (if any) and weight."""
        fields = [(0, self.data_bytes)]
        if self.scale_width:
            fields.append((self.scale_offset, self.scale_width * self.scale_dtype.itemsize))
        return fields + [(self.weight_offset, 4)]

    def pack(self, data: torch.Tensor, scale: Optional[torch.Tensor], weight: Optional[torch.Tensor],
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``data [N, width]``, ``scale [N, scale_width]`` (or None), fp32 ``weight [N]`` -> ``uint8
        [N, row_bytes]`` with the flag set (written into ``out`` when given). Padding bytes — and the
        weight field when ``weight`` is None (:meth:`set_weights` fills it later) — are left as they
        are."""
        rows = data.shape[0]
        packet = out if out is not None else torch.empty(rows, self.row_bytes, dtype=torch.uint8,
                                                         device=data.device)
        values = [data, scale] if self.scale_width else [data]
        if weight is not None:
            values.append(weight.float())
        for (offset, size), value in zip(self._fields(), values):
            assert value is not None
            source = value.contiguous().reshape(-1).view(torch.uint8).reshape(rows, size)
            _words(packet[:, offset:offset + size]).copy_(_words(source))
        packet[:, self.flag_offset] = 1
        return packet

    def set_weights(self, packet: torch.Tensor, weight: torch.Tensor) -> None:
        """Overwrite the fp32 weight field of every row of ``packet [N, row_bytes]``."""
        rows = packet.shape[0]
        source = weight.float().contiguous().reshape(-1).view(torch.uint8).reshape(rows, 4)
        _words(packet[:, self.weight_offset:self.weight_offset + 4]).copy_(_words(source))

    def unpack(self, packet: torch.Tensor, rows: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """The inverse of :meth:`pack` for ``packet [..., row_bytes]``, taking only ``rows`` (of the
        flattened rows) when given: contiguous ``data``, ``scale`` (None without scales) and fp32
        ``weight``. Each field is gathered straight from the packet (one pass)."""
        flat = packet.reshape(-1, self.row_bytes)
        lead = packet.shape[:-1] if rows is None else rows.shape

        def field(start: int, size: int) -> torch.Tensor:
            view = _words(flat[:, start:start + size])
            # index_select always returns a contiguous result (advanced indexing with a 2-D index
            # may not, on CUDA), which the dtype views below need.
            picked = view.index_select(0, rows.reshape(-1)) if rows is not None else view.contiguous()
            return picked.view(torch.uint8)

        fields = [field(offset, size) for offset, size in self._fields()]
        data = fields[0].view(self.dtype).view(*lead, self.width)
        scale = fields[1].view(self.scale_dtype).view(*lead, self.scale_width) if self.scale_width else None
        weight = fields[-1].view(torch.float32).view(lead)
        return data, scale, weight

    def flags(self, packet: torch.Tensor) -> torch.Tensor:
        """Which rows of ``packet [..., row_bytes]`` were packed (bool ``[...]``)."""
        return packet[..., self.flag_offset] == 1


def _words(columns: torch.Tensor) -> torch.Tensor:
    """A byte-column slice ``[N, size]`` seen as 32-bit words when offset and size allow it."""
    if columns.shape[-1] % 4 == 0 and columns.storage_offset() % 4 == 0 and columns.stride(0) % 4 == 0:
        return columns.view(torch.int32)
    return columns
