"""Test-session setup.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be chosen before
any kernel is defined; this is the tests' own setting, never the library's. The interpreter accepts some
programs Triton's compiler rejects, so the session records each interpreted launch's specialisation and, at its
end, lowers each with the compiler's front end for an sm_90 GPU (``triton_front_end.py``): a kernel the compiler
rejects fails the CPU session instead of its first GPU launch.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import triton_front_end

INTERPRETED = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
        # one intra-op thread per xdist worker: with as many workers as cores, torch's CPU thread pools oversubscribe
        # the cores, and their spinning threads slow every torch op on the CPU (the commit that added this has figures)
        torch.set_num_threads(1)
    if INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
        if triton_front_end.RECORDS not in os.environ:  # the controller (xdist's workers inherit the directory)
            os.environ[triton_front_end.RECORDS] = tempfile.mkdtemp(prefix="moeforge-launches-")
            config.stash[_OWNER] = True
        triton_front_end.install()


_OWNER = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.stash.get(_OWNER, False):
        return
    directory = os.environ.pop(triton_front_end.RECORDS)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join([tests, str(Path(tests).parent)] + [p for p in sys.path if p])
    result = subprocess.run([sys.executable, os.path.join(tests, "triton_front_end.py"), directory], env=env,
                            capture_output=True, text=True)
    shutil.rmtree(directory, ignore_errors=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = result.stdout + (result.stderr if result.returncode else "")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "Triton front end")
        reporter.write_line(text.rstrip())
    else:
        print(text)
    if result.returncode and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
