"""Every method a config can name, with its reference, its equivalence tests and its
departures: the catalogue behind docs/FIDELITY.md.

Kinds and where each declares its references (`fedjax_pan.references.Reference`):

    algorithm     `config.algorithm`            its `AlgorithmEntry.reference`
    aggregation   `config.aggregation.rule`     its `algorithms.aggregation.RuleEntry.reference`
    attack        `config.attack.kind`          `algorithms.attacks.REFERENCES`
    compression   `config.compression`          `compression.REFERENCES`
    privacy       `config.privacy`, sampling    `algorithms.dp.REFERENCES`
    recruitment   `config.recruitment.policy`   `algorithms.recruitment.REFERENCES`

A test that checks a method against its reference written independently carries
`@pytest.mark.reference(kind, name, ...)`; `equivalence_tests` finds them by reading the
test modules (no import), and tests/test_fidelity.py fails for a method without a
reference, without departures declared, or without such a test.

    python -m fedjax_pan.fidelity            # prints the table
    python -m fedjax_pan.fidelity --write    # writes docs/FIDELITY.md
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from fedjax_pan.algorithms.uploads import compression
from fedjax_pan.algorithms import aggregation
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms.uploads import dp
from fedjax_pan.algorithms import recruitment, registry
from fedjax_pan.config.document import pages_command
from fedjax_pan.references import Reference

KINDS = ("algorithm", "aggregation", "attack", "compression", "privacy", "recruitment")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
DOC = os.path.join(ROOT, "docs", "FIDELITY.md")
MARKER = "reference"


class Method(NamedTuple):
    kind: str
    name: str
    reference: Optional[Reference]


def names(kind: str) -> Tuple[str, ...]:
    """The names of `kind` a config can select (each must declare a reference)."""
    if kind == "algorithm":
        return tuple(registry.ALGORITHMS)
    if kind == "aggregation":
        return tuple(aggregation.RULES)
    if kind == "attack":
        return tuple(a for a in attacks.ATTACKS if a != "none")
    if kind == "compression":
        return tuple(m for m in compression.METHODS if m != "none") + compression.OPTIONS
    if kind == "privacy":
        return dp.MECHANISMS
    if kind == "recruitment":
        return tuple(p for p in recruitment.POLICIES if p != "none")
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def _declared(kind: str) -> Dict[str, Reference]:
    if kind == "algorithm":
        return {k: e.reference for k, e in registry.ALGORITHMS.items()
                if e.reference is not None}
    if kind == "aggregation":
        return {k: e.reference for k, e in aggregation.RULES.items()
                if e.reference is not None}
    return {"attack": attacks.REFERENCES, "compression": compression.REFERENCES,
            "privacy": dp.REFERENCES, "recruitment": recruitment.REFERENCES}[kind]


def catalogue() -> List[Method]:
    """Every selectable method of every kind, with its reference (None: undeclared)."""
    out = []
    for kind in KINDS:
        declared = _declared(kind)
        out += [Method(kind, n, declared.get(n)) for n in names(kind)]
    return out


def undeclared() -> List[str]:
    """'kind name' of each reference declared for a name no config can select."""
    return [f"{kind} {n}" for kind in KINDS for n in _declared(kind) if n not in names(kind)]


def _marker_args(decorator: ast.expr) -> Optional[List[str]]:
    # pytest.mark.reference("kind", "name", ...) -> its string arguments
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == MARKER):
        return None
    mark = decorator.func.value
    if not (isinstance(mark, ast.Attribute) and mark.attr == "mark"):
        return None
    return [a.value for a in decorator.args
            if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def equivalence_tests(tests_dir: str = TESTS) -> Dict[Tuple[str, str], List[str]]:
    """(kind, name) -> ['test_x.py::test_fn', ...]: the tests marked as checking it."""
    found: Dict[Tuple[str, str], List[str]] = {}
    for file in sorted(os.listdir(tests_dir)):
        if not (file.startswith("test_") and file.endswith(".py")):
            continue
        with open(os.path.join(tests_dir, file), encoding="utf-8") as f:
            tree = ast.parse(f.read(), file)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for decorator in node.decorator_list:
                args = _marker_args(decorator)
                if args and len(args) >= 2:
                    for name in args[1:]:
                        found.setdefault((args[0], name), []).append(f"{file}::{node.name}")
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(tests_dir: str = TESTS) -> str:
    """docs/FIDELITY.md: one section per kind, a row per method."""
    tests = equivalence_tests(tests_dir)
    lines = ["# Fidelity: every method against its reference", "",
             "Generated by `python -m fedjax_pan.fidelity --write` from the references the "
             "methods declare (`fedjax_pan/references.py`) and the tests marked "
             "`@pytest.mark.reference`; tests/test_fidelity.py fails when a method lacks a "
             "reference, a departures list or an equivalence test, or when this page is "
             "out of date. Code references name the file read and the commit it was read "
             "at. \"none\" under departures: the method equals its reference.", ""]
    by_kind: Dict[str, List[Method]] = {}
    for m in catalogue():
        by_kind.setdefault(m.kind, []).append(m)
    for kind in KINDS:
        lines += [f"## {kind}", "",
                  "| method | reference | code | equivalence tests | departures |",
                  "| --- | --- | --- | --- | --- |"]
        for m in by_kind.get(kind, []):
            ref = m.reference
            if ref is None:
                lines.append(f"| `{m.name}` | **missing** | | | |")
                continue
            checked = "<br>".join(f"`{t}`" for t in tests.get((kind, m.name), [])) or \
                "**missing**"
            departures = "<br>".join(f"- {_cell(d)}" for d in ref.departures) or "none"
            lines.append(f"| `{m.name}` | {_cell(ref.paper)} | "
                         f"{_cell(ref.code) if ref.code else '-'} | {checked} | {departures} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the table, or with --write writes docs/FIDELITY.md, or with --help (-h) what
    it does; anything else is one error line and exit 2."""
    return pages_command(sys.argv[1:] if argv is None else argv, "fedjax_pan.fidelity",
                         __doc__, f"the fidelity table ({os.path.relpath(DOC, ROOT)})",
                         lambda: {DOC: table()})


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["KINDS", "Method", "names", "catalogue", "undeclared", "equivalence_tests",
           "table", "main"]
