"""Read a kernel's PTX for shared memory that holds an mbarrier object and is also written or read as plain data.

Triton's shared-memory allocator gives the bytes of a buffer whose last use has passed to later buffers (an
epilogue's scratch, a convert's staging). An mbarrier that a kernel initialises and then never uses again is such a
buffer; plain accesses over a live mbarrier object are undefined in PTX (the manual asks for ``mbarrier.inval``
first), and on an H200 shared with other processes they gave wrong rows (docs/kernels.md, "The warp-specialised
kernel's wrong rows under load"). This reader finds the overlaps it can see: offsets from ``global_smem`` that PTX
spells out, as Triton 3.6 to 3.9 write them (``mov.b32 %rB, global_smem``; ``add.s32 %rN, %rB, OFFSET``; plain
accesses at ``[%rX+OFFSET]``, whose register part is a thread's offset from the base, or at ``[%rN]``).
"""

from __future__ import annotations

import re

_BASE = re.compile(r"mov\.(?:b|u)32\s+(%r\d+),\s*global_smem;")
_OFFSET = re.compile(r"add\.(?:s|u)32\s+(%r\d+),\s*(%r\d+),\s*(\d+);")
_BARRIER = re.compile(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[(%r\d+|global_smem)(?:\+(\d+))?\]")
_PLAIN = re.compile(r"\b(st|ld|ldmatrix|stmatrix|atom|red)\.[\w.:]*?shared[\w.:]*\s+(?:\{[^}]*\},\s*)?"
                    r"\[(%r\d+|global_smem)(?:\+(\d+))?\]")
_WIDTH = re.compile(r"\.v(\d)\.\w(\d+)|\.\w(\d+)\b")


def _width(instruction: str) -> int:
    """Bytes one thread's access covers, at least: a vector's lanes times their bits, else the scalar's bits
    (``ldmatrix`` / ``stmatrix``: a 16-byte row)."""
    if "matrix" in instruction:
        return 16
    found = _WIDTH.search(instruction.split()[0])
    if found is None:
        return 1
    lanes, bits, scalar = found.groups()
    return int(lanes) * int(bits) // 8 if lanes else max(int(scalar) // 8, 1)


def barriers_overlapped(ptx: str) -> list[tuple[int, str]]:
    """``(barrier offset, plain access)`` for every mbarrier the kernel initialises at an offset that a plain
    shared-memory access's spelled-out offset also covers (empty where none is seen)."""
    bases = set(_BASE.findall(ptx)) | {"global_smem"}
    offsets: dict[str, int] = {}
    for target, source, value in _OFFSET.findall(ptx):
        if source in bases:
            offsets[target] = int(value)

    def resolve(register: str, added: str) -> int | None:
        if register in bases:
            return int(added or 0)
        if register in offsets:
            return offsets[register] + int(added or 0)
        return int(added) if added else None  # (a thread's offset plus a spelled-out one: at least that one)

    barriers = {offset for register, added in _BARRIER.findall(ptx)
                if (offset := resolve(register, added)) is not None}
    found = []
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("mbarrier") or line.startswith("cp.async") or "mbarrier" in line:
            continue
        match = _PLAIN.search(line)
        if match is None:
            continue
        start = resolve(match.group(2), match.group(3))
        if start is None:
            continue
        end = start + _width(line)
        found += [(barrier, line) for barrier in sorted(barriers) if barrier < end and start < barrier + 8]
    return found
