"""The README's Python snippets run as written.

Every ```python block of README.md is executed; ```text and ```bash blocks are not. The convention,
stated in the README: the snippets of one ``## `` section run in order in one namespace (a later
snippet may use the names an earlier one of the same section defined); each section starts afresh,
so a section's first snippet makes its own imports. They run in a temporary working directory (a
snippet may write files there, e.g. a checkpoint) with the environment ``torchrun`` gives a single
rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: the expert-parallel
snippet says it runs under torchrun); a process group a snippet starts is destroyed afterwards.

Snippets that need ``transformers`` build their tiny random model in code (no download); their
section is skipped only where ``transformers`` is not installed (CI installs it with the ``hf``
extra). A snippet that raises fails its section's test, and the traceback shows the README's line.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")


def python_blocks(text: str) -> list[tuple[str, int, str]]:
    """``(section, first line number of the code, code)`` for each ```python block, in order."""
    blocks: list[tuple[str, int, str]] = []
    section, language, start, lines = "(top)", None, 0, []  # type: ignore[var-annotated]
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if language is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif fence:
                language, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            if language == "python":
                blocks.append((section, start, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    assert language is None, f"README.md: a ```{language} block opened at line {start - 1} is not closed"
    return blocks


BLOCKS = python_blocks(README.read_text())
SECTIONS: dict[str, list[tuple[int, str]]] = {}
for _section, _line, _code in BLOCKS:
    SECTIONS.setdefault(_section, []).append((_line, _code))


def test_the_snippets_are_found() -> None:
    assert len(BLOCKS) == README.read_text().count("```python") >= 8
    assert {"Using it", "Quantization", "Expert parallelism"} <= set(SECTIONS)


def test_the_quantization_section_shows_the_way_from_a_float_layer_to_a_quantized_one() -> None:
    # Run by test_readme_section_runs like every snippet: the conversion works as shown.
    code = "".join(snippet for _, snippet in SECTIONS["Quantization"])
    assert "quantize_layer(" in code and ".quantize_weights(" in code


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("section", list(SECTIONS))
def test_readme_section_runs(section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snippets = SECTIONS[section]
    if any(re.search(r"^\s*(from|import) transformers\b", code, re.M) for _, code in snippets):
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    import torch
    import torch.distributed as dist

    namespace: dict[str, Any] = {"__name__": f"readme_{section}"}
    torch.manual_seed(0)
    try:
        for line, code in snippets:
            # Padding puts the code on its README line numbers: a traceback points into README.md.
            exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


DOCS = [README, README.parent / "docs" / "kernels.md"]
TOP_LEVEL = {"moeforge", "tests", "benchmarks", "docs", "examples", "notes", ".ci"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_docs_cite_files_that_exist(doc: Path) -> None:
    """A path the docs cite (in backticks or as a link) is in the repository, not on someone's
    machine; and the docs describe things instead of pointing at issue numbers."""
    text = doc.read_text()
    cited = set(re.findall(r"`(/?[\w.\-]+(?:/[\w.\-<>*]+)+/?)`", text)) | set(re.findall(r"\]\(([^)#\s]+)\)", text))
    root = README.parent
    for path in sorted(cited):
        if path.startswith("/"):
            pytest.fail(f"{doc.name} cites the absolute path {path}")
        if path.split("/")[0] not in TOP_LEVEL or "<" in path or "*" in path:
            continue
        assert (root / path).exists() or (doc.parent / path).exists(), f"{doc.name} cites {path}, which does not exist"
    assert not re.search(r"\bissues? #?\d", text, re.I), re.search(r".*\bissues? #?\d.*", text, re.I)
