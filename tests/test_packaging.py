"""What an installed moeforge gives its users, checked from outside the repository.

The slow test installs the package the way a user's ``pip install`` does (a wheel built from the
source, unpacked into a temporary directory) and runs mypy in another temporary directory on user
code, so that nothing of the work tree (its ``pyproject.toml`` settings, its ``mypy_path``, the
editable install) can stand in for what the wheel ships.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TYPING = Path(__file__).resolve().parent / "typing"


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install --no-deps --no-build-isolation --target <tmp> <copy of the source>``: the same
    wheel build a user's install runs, without touching the network or the work tree (setuptools
    builds in ``build/`` next to the sources, so it builds in a copy)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "moeforge", source / "moeforge",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    target = tmp_path_factory.mktemp("site-packages")
    done = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                 "--no-index", "--target", str(target), str(source)], cwd=source, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def _mypy(snippet: Path, installed: Path, work: Path) -> tuple[int, str]:
    """mypy (strict) on ``snippet`` copied into ``work``, finding moeforge as an installed package:
    through ``PYTHONPATH``, i.e. the interpreter's ``sys.path``, where PEP 561 applies (``MYPYPATH``
    would analyse the package even without ``py.typed`` and prove nothing)."""
    shutil.copy2(snippet, work / snippet.name)
    env = {key: value for key, value in os.environ.items() if key not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(installed)
    done = _run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir",
                 str(work / ".mypy_cache"), snippet.name], cwd=work, env=env)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_installed_package_is_typed_for_mypy(installed: Path, tmp_path: Path) -> None:
    """The README's promise, for a user who installed moeforge: mypy flags a wrong ``chain(...)``
    order on the right line and accepts a right one."""
    pytest.importorskip("mypy", reason="runs mypy (the tests extra installs it)")
    assert (installed / "moeforge" / "py.typed").is_file()
    assert (installed / "moeforge" / "kernels" / "configs").is_dir()

    status, out = _mypy(TYPING / "bad_chain.py", installed, tmp_path)
    assert status == 1, out
    # line 9: mf.chain(mf.TopK(E, K)).then(mf.GroupedGemm(...)) -- a GEMM straight after the top-k
    assert 'bad_chain.py:9: error: Argument 1 to "then" of "Chain" has incompatible type "GroupedGemm"' in out, out
    assert "py.typed" not in out, out

    status, out = _mypy(TYPING / "good_chain.py", installed, tmp_path)
    assert status == 0, out

    # The check above sees the installed copy as an installed package: without its marker, mypy
    # skips it (the defect this test guards against).
    (installed / "moeforge" / "py.typed").unlink()
    status, out = _mypy(TYPING / "good_chain.py", installed, tmp_path)
    assert status == 1 and "missing library stubs or py.typed marker" in out, out


@pytest.mark.slow
def test_installed_metadata_carries_the_license(installed: Path) -> None:
    (info,) = installed.glob("moeforge-*.dist-info")
    metadata = (info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata, metadata
    assert "License-File: LICENSE" in metadata
    license_text = (info / "licenses" / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert license_text == (ROOT / "LICENSE").read_text()


def test_license_file_is_the_apache_license() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_testing_without_hypothesis_says_what_to_install() -> None:
    """``import moeforge`` needs no hypothesis; ``moeforge.testing`` names the package and the extra."""
    code = ("import sys\n"
            "sys.modules['hypothesis'] = None  # as if it were not installed\n"
            "import moeforge\n"
            "try:\n"
            "    import moeforge.testing\n"
            "except ImportError as error:\n"
            "    print(type(error).__name__, error.name, '|', error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith("ModuleNotFoundError hypothesis |"), out
    assert "moeforge.testing needs the 'hypothesis' package" in out
    assert "pip install 'moeforge[tests]'" in out and "pip install hypothesis" in out


def test_import_moeforge_reaches_families_and_checkpoint_without_optional_packages() -> None:
    """``moeforge.families`` and ``moeforge.checkpoint`` are attributes after ``import moeforge``
    (the README uses them so); ``moeforge.hf`` stays optional, and neither Triton nor transformers
    nor hypothesis is imported by ``import moeforge``."""
    code = ("import sys\n"
            "import moeforge\n"
            "print(moeforge.families.FAMILIES['deepseek_v3'], moeforge.checkpoint.load_weights.__name__)\n"
            "print(sorted(m for m in ('triton', 'transformers', 'hypothesis', 'safetensors', 'moeforge.hf')"
            " if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["moeforge.families.deepseek_v3 load_weights", "[]"], done.stdout


def test_the_public_api_is_the_users_and_the_authoring_kit_lives_in_submodules() -> None:
    import moeforge
    import moeforge.errors
    import moeforge.spec
    import moeforge.stages

    assert len(moeforge.__all__) <= 42, "moeforge.__all__ is the user's API, not every class"
    for module in (moeforge, moeforge.stages, moeforge.spec, moeforge.errors):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what it does not define: {missing}"
    kit = {"Stage", "StageKind", "Mismatch", "ParamRef", "Activations", "ExpertRows", "RoutedTokens", "TopKOutput",
           "SortedRows", "PaddedRows", "AlignedRows", "Plan", "PerTokenQuantizer", "QuantizeRows"}
    assert kit <= set(moeforge.stages.__all__) and not kit & set(moeforge.__all__)
    assert {"Spec", "Accepts", "PayloadKind", "Layout", "ScaleLayout", "ScalingFactor"} <= set(moeforge.spec.__all__)
    # every error is in moeforge.errors, and each one a caller may not catch by a wider class is in moeforge
    errors = {name for name in dir(moeforge.errors) if name.endswith("Error")}
    assert errors == set(moeforge.errors.__all__)
    assert {"MoEForgeError", "ContractError", "InputError", "CheckpointError"} <= set(moeforge.__all__)
