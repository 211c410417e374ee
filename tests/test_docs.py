"""The documentation: the README and the site under docs/.

Default run: the README's length and links, every code block marked runnable (the line
`<!-- runnable -->` before it) run in a fresh interpreter, every page in the site's table of
contents, the notebooks' sources, and the docstring conversion the API reference uses
(docs/_ext/plain_docstrings.py). Slow run: the site built as `make docs` builds it (Sphinx,
warnings as errors), both notebooks executed, what they print checked.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, needs_fmnist

DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
RUNNABLE = "<!-- runnable -->"
_FENCE = re.compile(r"^```(\w+)?\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")

sys.path.insert(0, os.path.join(DOCS, "_ext"))
import plain_docstrings  # noqa: E402


def _pages():
    """Every Markdown source of the site (generated API stubs and build output aside)."""
    out = []
    for path in sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)):
        rel = os.path.relpath(path, DOCS)
        if rel.split(os.sep)[0] not in ("_build", "jupyter_execute") and "_generated" not in rel:
            out.append(path)
    return out


def _blocks(path):
    """(line, language, code) of each fenced block in `path` marked runnable."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        m = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert m, f"{path}:{i + 1}: {RUNNABLE} must come right before a fenced code block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        out.append((i + 2, m.group(1) or "", "\n".join(lines[i + 2:end]) + "\n"))
    return out


def _runnable():
    cases = []
    for path in [README] + _pages():
        for line, lang, code in _blocks(path):
            marks = [needs_fmnist] if "fashion_mnist" in code else []
            cases.append(pytest.param(lang, code, id=f"{os.path.relpath(path, ROOT)}:{line}",
                                      marks=marks))
    return cases


def test_readme_is_short_and_has_the_two_commands_and_a_runnable_example():
    text = open(README, encoding="utf-8").read()
    assert len(text.splitlines()) <= 250
    assert "make run" in text and "make test" in text and "make docs" in text
    assert any(lang == "python" for _, lang, _ in _blocks(README))
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated logs belong in CHANGELOG.md"


@pytest.mark.parametrize("lang,code", _runnable())
def test_runnable_block_runs(lang, code, tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    if lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    elif lang in ("bash", "sh", "console"):
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        pytest.fail(f"a runnable block must be python or bash, not {lang!r}")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_runnable_blocks_are_found():
    """The marker finder itself: a marked block is found, an unmarked one is not."""
    ids = [p.id for p in _runnable()]
    assert any(i.startswith("README.md:") for i in ids)
    assert any(i.startswith("docs/guides/") for i in ids)


def _links(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("path", [README] + _pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    here = os.path.dirname(path)
    for target in _links(path):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        assert os.path.exists(os.path.normpath(os.path.join(here, file))), \
            f"{os.path.relpath(path, ROOT)} links {target!r}, which does not exist"


def _toctree_entries():
    entries = set()
    for path in _pages():
        text = open(path, encoding="utf-8").read()
        for body in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
            for line in body.splitlines():
                line = line.strip()
                if line and not line.startswith(":"):
                    base = os.path.dirname(os.path.relpath(path, DOCS))
                    entries.add(os.path.normpath(os.path.join(base, line)))
    return entries


def test_every_page_is_in_the_table_of_contents():
    entries = _toctree_entries()
    missing = [os.path.relpath(p, DOCS) for p in _pages()
               if os.path.relpath(p, DOCS)[:-3] not in entries | {"index"}]
    assert not missing, f"pages in no toctree: {missing}"


def test_notebook_sources_are_myst_notebooks_without_outputs():
    jupytext = pytest.importorskip("jupytext")
    paths = sorted(glob.glob(os.path.join(DOCS, "notebooks", "*.md")))
    assert {os.path.basename(p) for p in paths} >= {"quickstart.md", "composing.md"}
    for path in paths:
        nb = jupytext.read(path)
        assert nb.metadata["kernelspec"]["name"] == "python3", path
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert len(code) >= 3 and all(not c.get("outputs") for c in code), path


@pytest.mark.parametrize("given,want", [
    # Markdown's inline code becomes an RST literal; outside it |, * and a trailing _ are text.
    (["norm `|x|` of |x| and 2*pi*T, **bold**, clip_ and **kwargs"],
     ["norm ``|x|`` of \\|x\\| and 2\\*pi\\*T, **bold**, clip\\_ and \\*\\*kwargs"]),
    # An indented block after a line ending in ':' is a literal block.
    (["Run:", "    python -m fedjax_pan", "after"],
     ["Run::", "", "    python -m fedjax_pan", "", "after"]),
    # As in Markdown, a block indented by four more after a blank line is code.
    (["Each step:", "", "    x <- x - lr g", "    y <- y + 1", "", "then"],
     ["Each step::", "", "    x <- x - lr g", "    y <- y + 1", "", "then"]),
    (["The update", "", "    x <- x - lr g", "done"],
     ["The update", "", "::", "", "    x <- x - lr g", "", "done"]),
    # Any other indented block is set off by blank lines.
    (["Some text", "  indented", "back"], ["Some text", "", "  indented", "", "back"]),
    # A list after a paragraph gets its blank line; its continuation lines do not.
    (["Deviations:", "- one", "  more of one", "- two", "end"],
     ["Deviations:", "", "- one", "  more of one", "- two", "", "end"]),
    # "100) scoring" continues a sentence; it does not start a list.
    (["a set of", "100) scoring"], ["a set of", "100) scoring"]),
])
def test_docstring_conversion(given, want):
    assert plain_docstrings.convert(given) == want


@needs_fmnist
@pytest.mark.slow  # about 2 minutes: the API reference of every module, both notebooks run
def test_site_builds_without_warnings_and_runs_the_notebooks(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    shutil.rmtree(os.path.join(DOCS, "api", "_generated"), ignore_errors=True)
    out = tmp_path / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
         "-d", str(tmp_path / "doctrees"), DOCS, str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for page in ["index", "getting_started", "catalogue/algorithms", "api/index", "CONFIG",
                 "results/paper", "changelog", "notebooks/quickstart", "notebooks/composing"]:
        assert (out / f"{page}.html").is_file(), page
    api = glob.glob(str(out / "api" / "_generated" / "*.html"))
    assert any(p.endswith("fedjax_pan.engine.simulation.html") for p in api)

    def text(page):
        html = (out / f"{page}.html").read_text(encoding="utf-8")
        return re.sub(r"<[^>]+>", "", html)

    composing = text("notebooks/composing")
    accuracy = [float(a) for a in re.findall(r"round \d: clients \[[\d, ]+\], test accuracy "
                                             r"([0-9.]+)", composing)]
    assert len(accuracy) == 4 and accuracy[-1] > 0.3 and accuracy[-1] > accuracy[0], accuracy
    off, on = (float(e) for e in re.findall(r"shuffle error ([0-9.e+-]+)", composing))
    assert off < 1e-5 < 1e-3 < on
    mean, median = (float(d) for d in re.findall(r"(?:mean|median) ([0-9.]+)", composing)[-2:])
    assert median < mean
    quickstart = text("notebooks/quickstart")
    finals = re.findall(r"(pans_off|pans_on): final accuracy ([0-9.]+)", quickstart)
    assert [name for name, _ in finals] == ["pans_off", "pans_on"]
    assert all(0.0 < float(a) <= 1.0 for _, a in finals)
