"""The package's layers, as `ls fedjax_pan` shows them: each module imports only from its
own layer or those below (foundations < PAN method < data and models < engine <
algorithms < configuration < running and analyses), no modules import each other in a
cycle, and the algorithms import neither the registry nor engine internals inside
functions. The old import paths of moved modules still resolve, to the same module."""

import ast
import functools
import importlib
import os
import warnings

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "fedjax_pan")
# Bottom to top; a module belongs to the layer of its longest listed prefix.
LAYERS = (
    ("fedjax_pan.errors", "fedjax_pan.references", "fedjax_pan.rules", "fedjax_pan.workdir",
     "fedjax_pan._moved"),
    ("fedjax_pan.pan",),
    ("fedjax_pan.data", "fedjax_pan.models"),
    ("fedjax_pan.engine",),
    ("fedjax_pan.algorithms",),
    ("fedjax_pan.config", "fedjax_pan.fidelity"),
    ("fedjax_pan.run", "fedjax_pan.analysis"),
    ("fedjax_pan", "fedjax_pan.__main__"),
)


def _modules():
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


@functools.lru_cache(maxsize=None)
def _imports(path, inside_functions=None):
    """{module: line} of the fedjax_pan modules `path` imports (inside functions only, or
    outside them only, or both where None)."""
    tree = ast.parse(open(path).read())
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested.update(id(n) for n in ast.walk(node) if n is not node)
    found = {}
    for node in ast.walk(tree):
        if inside_functions is not None and (id(node) in nested) != inside_functions:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import sub` imports the submodule; `from mod import name`, mod.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        for name in names:
            if name in MODULES:
                found.setdefault(name, node.lineno)
    return found


def _layer(module):
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (
                    best is None or len(p) > len(best[1])):
                best = (i, p)
    return best[0]


def test_every_module_has_a_layer():
    assert all(_layer(m) is not None for m in MODULES)


def test_nothing_imports_upward():
    upward = [f"{m}:{line} imports {target}" for m, path in MODULES.items()
              for target, line in _imports(path).items()
              if _layer(target) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {m: set(_imports(path)) - {m} for m, path in MODULES.items()}
    # A package's own __init__ importing its submodules is not a cycle with them.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    cycles, done, stack = [], set(), []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles[:5])


def test_algorithms_import_no_registry_nor_engine_internals_inside_functions():
    public_engine = {"fedjax_pan.engine", "fedjax_pan.engine.protocol",
                     "fedjax_pan.engine.services", "fedjax_pan.engine.distributed"}
    bad = [f"{m}:{line} imports {t} inside a function"
           for m, path in MODULES.items() if m.startswith("fedjax_pan.algorithms")
           for t, line in _imports(path, inside_functions=True).items()
           if t == "fedjax_pan.algorithms.registry"
           or (t.startswith("fedjax_pan.engine") and t not in public_engine)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("old", ["fedjax_pan.assembly", "fedjax_pan.defaults",
                                 "fedjax_pan.algorithms.attacks", "fedjax_pan.ledger"])
def test_old_import_paths_resolve_to_the_moved_module(old):
    from fedjax_pan import _moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    assert module is importlib.import_module(_moved.MOVED[old])
    assert module.__name__ == _moved.MOVED[old]


def test_every_old_path_names_an_existing_module():
    from fedjax_pan import _moved
    assert not [new for new in _moved.MOVED.values() if new not in MODULES]
    assert not [old for old in _moved.MOVED if old in MODULES]


def test_the_old_ledger_command_line_still_verifies_with_flchains():
    """`python -m fedjax_pan.ledger WORKDIR` must not pass silently now that the ledger
    module has no command line of its own: it runs FLChain's."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "fedjax_pan.ledger", "--bad"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "python -m fedjax_pan.algorithms.robust.flchain_cli WORKDIR" in done.stderr
