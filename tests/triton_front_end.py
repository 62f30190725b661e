"""Triton's compiler front end for the kernels the CPU tests run in the interpreter.

Triton's interpreter runs a kernel's Python body with NumPy: it accepts programs the compiler rejects — a variable
whose type differs between the branches of an ``if`` or across a loop, a name reused with another dtype, a
``constexpr`` the code generator cannot fold. Such a kernel passes every CPU test and fails at its first launch on
a GPU. So a CPU test session records each interpreted launch's specialisation (the kernel, each argument's Triton
type, each ``constexpr``'s value: :func:`install`, in the session and in the rank processes it spawns), and at its
end :func:`check_recorded` lowers each one to Triton IR for an sm_90 target (the front end only: no LLVM, no
``ptxas``), as the JIT would on a Hopper GPU, in a fresh process without the interpreter (where the interpreter is
on, ``triton.language``'s own ``@jit`` functions are interpreted ones, which the compiler cannot call).

    python tests/triton_front_end.py DIRECTORY   # lower the launches recorded in DIRECTORY; exit 1 on an error
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

RECORDS = "MOEFORGE_TRITON_LAUNCHES"  # the directory the launches are recorded in (set by conftest.py)
_OPTION_NAMES = ("num_warps", "num_ctas", "maxnreg", "enable_fp_fusion")
# What a moeforge kernel's launch must carry (moeforge.kernels.bound_launch.FIXED_OPTIONS): its rounding must not
# follow Triton's default, which Triton 3.10 changes.
_FIXED = {"enable_fp_fusion": True}


def _encode(value: Any) -> Any:
    """A ``constexpr``'s value as JSON (``{"unencoded": repr}`` where it has no encoding: that launch is not
    lowered, and the check says so)."""
    import triton.language as tl

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if isinstance(value, tl.constexpr):
        return _encode(value.value)
    return {"unencoded": repr(value)}


def _decode(value: Any) -> Any:
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value  # (a dtype by its name: "fp16", "i32"...)


def launch_record(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One launch's specialisation: the kernel's module and name, each argument's Triton type (``*fp16``, ``i32``,
    ...) or, for a ``constexpr`` (or ``None``), its value, and the launch's ``num_warps``."""
    from triton.runtime.jit import mangle_type

    bound = dict(zip(kernel.arg_names, args))
    bound.update((name, value) for name, value in kwargs.items() if name in kernel.arg_names)
    annotations = getattr(kernel.fn, "__annotations__", {})
    types: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name in kernel.arg_names:
        if name not in bound:
            continue  # a parameter with a default
        value = bound[name]
        if value is None or "constexpr" in str(annotations.get(name, "")):
            constexprs[name] = _encode(value)
        else:
            types[name] = mangle_type(value)
    return {"module": kernel.fn.__module__, "file": inspect.getsourcefile(kernel.fn), "name": kernel.fn.__qualname__,
            "types": types, "constexprs": constexprs,
            "options": {name: kwargs[name] for name in _OPTION_NAMES if name in kwargs}}


def install() -> None:
    """Record each new specialisation the interpreter runs in this process into the directory ``$RECORDS`` names
    (one JSON line each, in a file of this process); nothing where the interpreter is off or no directory is set.
    Once per process."""
    directory = os.environ.get(RECORDS)
    if os.environ.get("TRITON_INTERPRET") != "1" or not directory:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "recording", False):
        return
    run = InterpretedFunction.run
    path = Path(directory) / f"launches-{os.getpid()}.jsonl"
    seen: set[str] = set()

    def recorded_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        line = json.dumps(launch_record(self, args, kwargs), sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as out:
                out.write(line + "\n")
        return run(self, *args, **kwargs)

    recorded_run.recording = True  # type: ignore[attr-defined]
    InterpretedFunction.run = recorded_run  # type: ignore[method-assign]


def _kernel(module: str, file: str, name: str) -> Any:
    """The kernel by its module and name; a script's module (a benchmark the tests import) from its directory."""
    folder = os.path.dirname(file)
    if folder not in sys.path and importlib.util.find_spec(module.partition(".")[0]) is None:
        sys.path.append(folder)
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def lower(record: dict[str, Any]) -> Optional[tuple[str, str, str]]:
    """Lower one recorded launch to Triton IR for sm_90: ``None`` where the compiler accepts it, else the kernel's
    name, its constexprs and the compiler's error (or, for a moeforge kernel launched without the options every
    moeforge launch fixes, that finding, before any lowering)."""
    if record["module"].startswith("moeforge.") and any(
            record["options"].get(name) != value for name, value in _FIXED.items()):
        return (f"{record['module']}.{record['name']}", json.dumps(record["constexprs"]),
                f"launched with options {record['options']}, without {_FIXED}: a moeforge launch passes "
                "moeforge.kernels.bound_launch.FIXED_OPTIONS (a BoundLaunch adds them)")
    import triton._C.libtriton as libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = _kernel(record["module"], record["file"], record["name"])
    while not isinstance(kernel, JITFunction):  # an autotuner or heuristics around it
        kernel = kernel.fn
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for index, param in enumerate(kernel.params):
        if param.name in record["types"]:
            signature[param.name] = record["types"][param.name]
        else:
            signature[param.name] = "constexpr"
            value = record["constexprs"].get(param.name, param.default if param.has_default else None)
            constexprs[(index,)] = _decode(value)
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options(record["options"])
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        ASTSource(kernel, signature, constexprs).make_ir(target, options, backend.get_codegen_implementation(options),
                                                         backend.get_module_map(), context)
    except Exception as error:  # the compiler's error is the finding
        return f"{record['module']}.{record['name']}", json.dumps(record["constexprs"]), str(error)
    return None


def _lower_all(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [error for error in map(lower, records) if error is not None]


def check_recorded(directory: Path, workers: int = 2) -> tuple[int, list[tuple[str, str, str]], list[str]]:
    """Lower every launch recorded in ``directory`` (each specialisation once): the number lowered, the
    compiler's errors (:func:`lower`), and the launches not lowered (a kernel not importable by name, a ``constexpr`` without an
    encoding)."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("launches-*.jsonl")):
        for line in path.read_text().splitlines():
            records.setdefault(line, json.loads(line))
    checkable, skipped = [], []
    for record in records.values():
        unencoded = [name for name, value in record["constexprs"].items()
                     if isinstance(value, dict) and "unencoded" in value]
        if "<locals>" in record["name"] or unencoded:
            skipped.append(f"{record['module']}.{record['name']} ({', '.join(unencoded) or 'defined in a function'})")
        else:
            checkable.append(record)
    chunks = [checkable[i::workers] for i in range(workers)]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        errors = [error for chunk in pool.map(_lower_all, chunks) for error in chunk]
    return len(checkable), errors, skipped


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # (Triton 3.9's notice, once per process)
    lowered, errors, skipped = check_recorded(Path(argv[0]))
    print(f"Triton front end (sm_90): {lowered} interpreted launch specialisations lowered, {len(errors)} rejected, "
          f"{len(skipped)} not lowered")
    for line in sorted(set(skipped)):
        print(f"  not lowered: {line}")
    by_error: dict[tuple[str, str], list[str]] = {}  # one report per kernel and error, with its first constexprs
    for kernel, constexprs, error in errors:
        by_error.setdefault((kernel, error), []).append(constexprs)
    for (kernel, error), constexprs in by_error.items():
        more = f" (and {len(constexprs) - 1} more specialisations)" if len(constexprs) > 1 else ""
        print(f"\nrejected by Triton's compiler{more}: {kernel}, constexprs {constexprs[0]}:\n{error}")
    return 1 if errors else 0


if __name__ == "__main__":  # run without TRITON_INTERPRET: the kernels must be real JITFunctions here
    sys.exit(main(sys.argv[1:]))
