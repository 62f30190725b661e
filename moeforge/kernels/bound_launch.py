"""One launch site of a ``@triton.jit`` kernel whose specialisation is fixed: launched through the compiled kernel.

``kernel[grid](*args, **constexprs)`` binds every argument, computes Triton's specialisation key, looks the
compiled kernel up and checks the kernel's globals on each call: several times the host time of the compiled
kernel's own launcher (docs/kernels.md, "The eager host path"). A :class:`BoundLaunch` is made for arguments whose
specialisation its maker has fixed — the same grid, constexprs and launch options, the same dtypes and integer
values, pointers with the same 16-byte alignment (the maker keys it by them, as ``moe_gemm``'s launch recipes and
:class:`LaunchSite` do): its first call goes through the JIT
(which compiles or finds the kernel and returns it), later calls hand the positional arguments straight to the
compiled kernel's launcher, which is what the JIT calls too.

:class:`LaunchSite` keeps the bound launches of one call site of a kernel by the site's key and the arguments'
:func:`specialization`, for launchers whose few arguments make that key cheap.

The JIT serves every call where the shortcut would differ from it: under Triton's interpreter (no compiled
kernel), with launch hooks set (a profiler's ``launch_enter_hook``), or a Triton whose compiled kernels lack the
launcher attributes this module reads (``run``, ``function``, ``packed_metadata``; Triton 3.6 to 3.9 have them).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Hashable, Mapping, Optional

import torch
from triton import knobs
from triton.runtime.driver import driver

from moeforge.kernels.launch_memo import CAPACITY, LaunchMemo

# Launch options every moeforge kernel takes (a BoundLaunch adds them; a direct ``kernel[grid](...)`` passes them):
# floating-point contraction (``a * b + c`` as one fused multiply-add) on, the default of Triton 3.6 to 3.9, which
# Triton 3.10 turns off (``TRITON_DEFAULT_FP_FUSION``). Left to that default, the kernels' rounding — and so the bits
# the tests and the determinism promise are about — would change with the Triton version. (A process that sets
# ``TRITON_FORCE_DISABLE_FP_FUSION`` still gets it off: Triton's override wins.)
FIXED_OPTIONS: Mapping[str, Any] = MappingProxyType({"enable_fp_fusion": True})


class BoundLaunch:
    """``kernel[grid](*args, **constexprs, **options)`` for the positional ``args`` of each call (see the module
    docstring). ``constexprs``: the kernel's ``tl.constexpr`` parameters, which must all follow its other
    parameters in its signature (else every call goes through the JIT); ``options``: launch options
    (``num_warps``, ``num_stages``, ``launch_pdl``), to which :data:`FIXED_OPTIONS` are added."""

    __slots__ = ("kernel", "grid", "constexprs", "options", "tail", "compiled", "device")

    def __init__(self, kernel: Any, grid: tuple[int, ...], constexprs: dict[str, Any], options: dict[str, Any]) -> None:
        self.kernel = kernel
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.constexprs = constexprs
        self.options = {**FIXED_OPTIONS, **options}
        names = list(getattr(kernel, "arg_names", ()))
        tail = names[len(names) - len(constexprs):] if constexprs else []
        # The constexprs' values in signature order, after the positional arguments (None: not in that order).
        self.tail: Optional[tuple[Any, ...]] = (
            tuple(constexprs[name] for name in tail) if set(tail) == set(constexprs) else None)
        self.compiled: Optional[Any] = None  # the kernel compiled (and loaded) for ``device``
        self.device = -1

    def __call__(self, *args: Any) -> None:
        compiled = self.compiled
        if compiled is not None:
            device = driver.active.get_current_device()  # (the JIT launches on the current device too)
            if device == self.device and not _hooked(knobs.runtime.launch_enter_hook) \
                    and not _hooked(knobs.runtime.launch_exit_hook):
                assert self.tail is not None
                compiled.run(self.grid[0], self.grid[1], self.grid[2], driver.active.get_current_stream(device),
                             compiled.function, compiled.packed_metadata, None, None, None, *args, *self.tail)
                return
        result = self.kernel[self.grid](*args, **self.constexprs, **self.options)
        if hasattr(result, "result"):  # Triton 3.6 may hand back a future of the compilation
            result = result.result()
        # A compiled kernel (none under the interpreter) with the launcher this module calls binds this launch.
        if compiled is None and self.tail is not None and len(args) + len(self.tail) == len(self.kernel.arg_names) \
                and all(hasattr(result, name) for name in ("run", "function", "packed_metadata")):
            self.compiled, self.device = result, driver.active.get_current_device()


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6 to 3.9 keep a chain of them (``HookChain``, empty by default); an
    older one a callable or ``None``."""
    return hook is not None and bool(getattr(hook, "calls", True))


def specialization(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton specialises a launch on, of its positional arguments: each tensor's dtype and whether its address
    is 16-byte aligned, each integer's value (Triton specialises on its divisibility by 16 and on 1), each other
    argument's type (floats are not specialised)."""
    # (integers first: most of a launch's arguments are sizes and strides, and a type test is cheaper than isinstance)
    return tuple([arg if type(arg) is int else (arg.dtype, arg.data_ptr() % 16 == 0) if isinstance(arg, torch.Tensor)
                  else type(arg) for arg in args])


class LaunchSite:
    """The :class:`BoundLaunch` es of one kernel at one call site, by the site's key (what decides the grid, the
    constexprs and the launch options: the caller's to give) and :func:`specialization` of the arguments, in a
    bounded :class:`~moeforge.kernels.launch_memo.LaunchMemo` (a module's, as Triton's kernel cache is)."""

    __slots__ = ("kernel", "memo")

    def __init__(self, kernel: Any, capacity: int = CAPACITY) -> None:
        self.kernel = kernel
        self.memo: LaunchMemo[BoundLaunch] = LaunchMemo(capacity)

    def launch(self, key: Hashable, grid: tuple[int, ...], args: tuple[Any, ...],
               make: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Launch ``kernel[grid](*args, **constexprs, **options)``, where ``make()`` returns ``(constexprs,
        options)``, a function of ``key`` alone (called once per key and specialisation)."""
        full = (key, grid, specialization(args))
        bound = self.memo.get(full)
        if bound is None:
            constexprs, options = make()
            bound = BoundLaunch(self.kernel, grid, constexprs, options)
            self.memo.put(full, bound)
        bound(*args)
