"""The session's Triton front-end check (``triton_front_end.py``): a kernel the interpreter runs but Triton's
compiler rejects is reported, with the compiler's error; a sound one passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

KERNELS = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def sound(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


    @triton.jit
    def retyped(x_ptr, out_ptr, n, rank, BLOCK: tl.constexpr):
        # `source` an int32 loop variable, then an int64 in a branch taken at run time: the interpreter runs it,
        # the compiler refuses to merge the two types (the symmetric dispatcher's put-rows kernel had this bug)
        offs = tl.arange(0, BLOCK)
        start = n * 0
        for source in range(0, rank):
            start += source
        if start >= 0:
            source = tl.program_id(0).to(tl.int64)
            tl.store(out_ptr + offs + source, tl.load(x_ptr + offs, mask=offs < n) + start, mask=offs < n)
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the CPU sessions' interpreter runs")
def test_the_front_end_rejects_what_the_interpreter_accepts(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    (tmp_path / "front_end_kernels.py").write_text(KERNELS)
    script = textwrap.dedent(f'''
        import json, sys
        sys.path[:0] = [{str(tmp_path)!r}, {str(Path(__file__).parent)!r}]
        import torch
        import front_end_kernels as k
        import triton_front_end
        x, out = torch.ones(8), torch.zeros(16)
        k.sound[(1,)](x, out, 8, BLOCK=8)
        k.retyped[(1,)](x, out, 8, 2, BLOCK=8)  # the interpreter runs it
        assert out[0] == 2.0 and out[1] == 2.0, out
        print(json.dumps([triton_front_end.launch_record(k.sound, (x, out, 8), dict(BLOCK=8)),
                          triton_front_end.launch_record(k.retyped, (x, out, 8, 2), dict(BLOCK=8))]))
    ''')
    interpreted = dict(os.environ, TRITON_INTERPRET="1")
    interpreted.pop("MOEFORGE_TRITON_LAUNCHES", None)
    records = json.loads(subprocess.run([sys.executable, "-c", script], env=interpreted, capture_output=True,
                                        text=True, check=True).stdout.splitlines()[-1])
    assert records[0]["types"] == {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    assert records[0]["constexprs"] == {"BLOCK": 8}

    directory = tmp_path / "launches"
    directory.mkdir()
    (directory / "launches-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    compiled = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    compiled["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(__file__).parent)] + sys.path)
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "triton_front_end.py"), str(directory)],
                            env=compiled, capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 interpreted launch specialisations lowered, 1 rejected" in result.stdout
    assert "front_end_kernels.retyped" in result.stdout and "front_end_kernels.sound" not in result.stdout
    assert "int32" in result.stdout and "int64" in result.stdout  # the compiler's own words


def test_a_moeforge_launch_without_the_fixed_options_is_reported() -> None:
    # (found before any lowering: no compiler needed)
    sys.path.insert(0, str(Path(__file__).parent))
    import triton_front_end

    record = {"module": "moeforge.kernels.combine", "file": "combine.py", "name": "_combine_kernel", "types": {},
              "constexprs": {"BLOCK_H": 64}, "options": {"num_warps": 4}}
    found = triton_front_end.lower(record)
    assert found is not None and found[0] == "moeforge.kernels.combine._combine_kernel"
    assert "enable_fp_fusion" in found[2] and "FIXED_OPTIONS" in found[2]
    from moeforge.kernels.bound_launch import FIXED_OPTIONS

    assert dict(FIXED_OPTIONS) == triton_front_end._FIXED  # (the check asks for what the package passes)
