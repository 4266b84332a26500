"""The documentation: the site builds strict, its runnable snippets run, the README stays a front door,
and nothing shipped speaks of the machinery it was developed with.

A snippet is runnable when it is written as a MyST directive with the class ``run``::

    ```{code-block} python
    :class: run

    import pnpscale
    ```

(``python`` or ``bash``). Each page's runnable snippets run in page order, each in its own process, in
one fresh folder per page that holds a small sweep under ``outputs/`` (a copy of ``tests/data/run_v1``);
``python`` on the ``PATH`` of a bash snippet is this interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: The README's two commands, byte for byte; .ci/run runs the second.
MAIN_JOB = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m pnpscale -m gpus=1,2,4 problem=2d"
)
TESTS = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m pytest"

#: What no shipped file may say: the borrowed machines and the calls that reached them while pnpscale was
#: developed. Shipped text says what a check needs and does, not how its authors reached a machine.
FORBIDDEN = [
    r"\blent\b",
    r"\bborrow(?:ed|ing)?\b",
    r"\bdevice[- ]tool\b",
    r"\bdevice calls?\b",
    r"\btool calls?\b",
    r"\bcarry=\[",
    r"\bcarry \.device-wheels",
    r"carried in the working tree",
    r"\b(?:other|these|those) sessions\b",
    r"\bsessions'",
    r"\bthe session's time\b",
    r"\bsessions that wrote\b",
    r"\bfiles_fetch\b",
]
SHIPPED = ["README.md", "docs", "benchmarks", "scripts", "pnpscale", "examples"]
BINARY = {".png", ".jpg", ".gif", ".parquet", ".pt", ".gz", ".whl", ".pyc", ".so"}


def code_blocks(text: str) -> Iterator[tuple[str, dict[str, str], str]]:
    """(info string, directive options, body) of each top-level fenced block of a Markdown text.

    >>> page = "```{code-block} python\\n:class: run\\n\\nprint(1)\\n```\\n````md\\n```python\\nx\\n```\\n````\\n"
    >>> [(info, opts) for info, opts, _ in code_blocks(page)]
    [('{code-block} python', {'class': 'run'}), ('md', {})]
    """
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not re.match(rf"^{fence}`*\s*$", lines[j]):
            j += 1
        body = lines[i + 1 : j]
        opts: dict[str, str] = {}
        if info.startswith("{"):
            while body and body[0].startswith(":"):
                key, _, value = body[0][1:].partition(":")
                opts[key.strip()] = value.strip()
                body = body[1:]
            if body and not body[0].strip():
                body = body[1:]
        yield info, opts, "\n".join(body) + "\n"
        i = j + 1


def runnable(path: Path) -> list[tuple[str, str]]:
    """(language, body) of the page's runnable snippets, in page order."""
    out = []
    for info, opts, body in code_blocks(path.read_text()):
        m = re.fullmatch(r"\{code-block\}\s+(python|bash)", info)
        if m and "run" in opts.get("class", "").split():
            out.append((m.group(1), body))
    return out


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_the_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0 and "WARNING" not in out.stderr, f"sphinx -W failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "html" / "index.html").is_file()
    built = {p.stem for p in (tmp_path / "html").glob("*.html")}
    assert {p.stem for p in pages()} <= built


#: What a page's snippets must leave behind, beyond exiting 0.
LEAVES = {"traces.md": ["traces/rank0.json", "traces/analysis/sections.parquet", "traces/analysis/timeline.json"]}


@pytest.mark.parametrize("page", [p.name for p in pages() if runnable(p)])
def test_a_pages_runnable_snippets_run(page, tmp_path):
    snippets = runnable(DOCS / page)
    shutil.copytree(ROOT / "tests" / "data" / "run_v1", tmp_path / "outputs" / "2026-01-01_00-00-00")
    bindir = tmp_path / ".bin"
    bindir.mkdir()
    shim = bindir / "python"  # a script, not a link: a virtual environment's python finds its site by its path
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }
    env.pop("RANK", None)
    for n, (lang, body) in enumerate(snippets):
        if lang == "python":
            script = tmp_path / f".snippet{n}.py"
            script.write_text(body)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", body]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"{page}, snippet {n} ({lang}) failed:\n{body}\n{out.stdout}\n{out.stderr}"
    for rel in LEAVES.get(page, []):
        assert (tmp_path / rel).is_file(), f"{page}: its snippets left no {rel}"


def test_the_notebook_and_the_instrument_snippets_are_runnable():
    bodies = [body for p in pages() for _, body in runnable(p)]
    assert any("pnpscale.load(" in b for b in bodies)
    assert any("record_function(" in b and "prof.step()" in b and "export_chrome_trace" in b for b in bodies)
    assert any("python -m pnpscale.analyze" in b and "--sections" in b for b in bodies)


def test_the_readmes_python_is_the_docs_runnable_python():
    """Every Python block of the README is a runnable snippet of the docs, so it is run too."""
    docs = {body for p in pages() for lang, body in runnable(p) if lang == "python"}
    readme = [body for info, _, body in code_blocks(README.read_text()) if info == "python"]
    assert readme, "the README shows no Python"
    for body in readme:
        assert body in docs, f"README block not among the docs' runnable snippets:\n{body}"


def test_the_readme_is_a_front_door():
    data = README.read_bytes()
    lines = data.decode().splitlines()
    assert len(data) <= 20_000, f"README.md is {len(data)} bytes (at most 20,000)"
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    assert MAIN_JOB in lines and TESTS in lines
    assert lines.index(MAIN_JOB) < lines.index(TESTS)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TESTS in ci, ".ci/run must run exactly the README's test command"
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", README.read_text()):
        assert (ROOT / target).is_file(), f"README links to a missing file: {target}"


def shipped_files() -> Iterator[Path]:
    for name in SHIPPED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in files:
            rel = p.relative_to(ROOT).parts
            if "_build" in rel or "__pycache__" in rel or p.suffix in BINARY:
                continue
            yield p


def test_nothing_shipped_speaks_of_how_it_was_built():
    pattern = re.compile("|".join(FORBIDDEN), re.IGNORECASE)
    hits = []
    for path in shipped_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if m := pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {m.group(0)!r}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
