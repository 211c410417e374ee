"""docs/catalogue/ is generated from the registries: a section for every method a config can
select, each algorithm's options with their defaults, the equivalence tests fidelity finds,
and the committed pages are the generated ones."""

import os
import re

import pytest

from fedjax_pan import fidelity
from fedjax_pan.algorithms import aggregation, registry
from fedjax_pan.algorithms.core import AlgorithmEntry
from fedjax_pan.config import catalogue, schema
from fedjax_pan.config.defaults import default_config
from fedjax_pan.references import Reference
from fedjax_pan.rules import between

PAGE = {"algorithm": "algorithms.md", "aggregation": "aggregation.md",
        "attack": "attacks.md", "compression": "transforms.md", "privacy": "transforms.md",
        "recruitment": "recruitment.md"}


@pytest.fixture(scope="module")
def pages():
    return catalogue.pages()


def _sections(text):
    """{heading: its text up to the next heading} of a page's ## and ### sections."""
    parts = re.split(r"^#{2,3} (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _flat(options, prefix=""):
    for key, value in options.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def _default(cfg, dotted):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def test_the_committed_pages_are_the_generated_ones(pages):
    on_disk = sorted(f for f in os.listdir(catalogue.DIR) if f.endswith(".md"))
    assert on_disk == sorted(pages), "docs/catalogue/ holds pages the catalogue does not make"
    for name, text in pages.items():
        with open(os.path.join(catalogue.DIR, name), encoding="utf-8") as f:
            assert f.read() == text, (f"docs/catalogue/{name} is stale: python -m "
                                      f"fedjax_pan.config.catalogue --write")


def test_every_method_of_every_kind_has_its_section_with_its_tests(pages):
    tests = fidelity.equivalence_tests()
    for kind in fidelity.KINDS:
        sections = _sections(pages[PAGE[kind]])
        for name in fidelity.names(kind):
            assert name in sections, f"{kind} {name} has no section in {PAGE[kind]}"
            for t in tests.get((kind, name), []):
                assert f"`tests/{t}`" in sections[name], f"{kind} {name} misses {t}"
    algorithms = _sections(pages["algorithms.md"])
    assert [h for h in algorithms] == list(registry.ALGORITHMS)
    assert [h for h in _sections(pages["aggregation.md"])] == list(aggregation.RULES)


def test_each_algorithms_options_table_lists_its_options_with_their_defaults(pages):
    cfg = default_config()
    sections = _sections(pages["algorithms.md"])
    for name, entry in registry.ALGORITHMS.items():
        rows = dict(re.findall(r"^\| `config\.([^`]+)` \| `(.*?)` \| .* \|$", sections[name],
                               flags=re.M))
        expected = {f"{name}.{k}" for k in _flat(entry.options)}
        assert set(rows) == expected, name
        for key in expected:
            value = _default(cfg, key)
            assert rows[key] == ("unset" if value is None else repr(value)), key
    assert ("| `config.fedprox.mu` | `0.01` | a number in \\[0, 10000\\] |"
            in sections["fedprox"])
    assert "personalised" in sections["ditto"] and "driver" in sections["flchain"]


def test_summaries_come_from_the_docstrings(pages):
    sections = _sections(pages["algorithms.md"])
    assert all(catalogue.algorithm_summary(n, e) for n, e in registry.ALGORITHMS.items())
    # fedper is one line of its package's list; fedavg has a module of its own.
    assert sections["fedper"].split("\n")[2].startswith("The head personal, the body shared")
    assert sections["fedavg"].split("\n")[2] == ("FedAvg (McMahan et al.) with a server "
                                                  "optimiser (FedOpt, Reddi et al.).")


def test_headings_never_skip_a_level_and_tables_escape_pipes(pages):
    for name, text in pages.items():
        levels = [len(m) for m in re.findall(r"^(#+) ", text, flags=re.M)]
        assert levels[0] == 1 and levels.count(1) == 1, name
        assert all(b <= a + 1 for a, b in zip(levels, levels[1:])), name
        assert "<" not in re.sub(r"`[^`]*`|\\<", "", text), f"raw HTML in {name}"
        for row in re.findall(r"^\|.*\|$", text, flags=re.M):
            assert len(re.findall(r"(?<!\\)\|", row)) == 4, row


def test_a_new_entry_appears_with_its_options(monkeypatch):
    def build(model, cfg, client_tx, server_tx):
        raise NotImplementedError
    entry = AlgorithmEntry(build, {"gamma": 0.5}, {"gamma": between(0, 1)},
                           reference=Reference("A paper | with a pipe", None, ("one",)))
    monkeypatch.setitem(registry.ALGORITHMS, "fake_algo", entry)
    monkeypatch.setitem(schema.RULES, "fake_algo.gamma", entry.rules["gamma"])
    page = catalogue.pages()["algorithms.md"]
    section = _sections(page)["fake_algo"]
    assert "| `config.fake_algo.gamma` | `0.5` | a number in \\[0, 1\\] |" in section
    assert "- Paper: A paper | with a pipe" in section and "- one" in section
    assert "- Equivalence tests: **none marked**" in section
    with open(os.path.join(catalogue.DIR, "algorithms.md"), encoding="utf-8") as f:
        assert f.read() != page  # the staleness test would fail


def test_the_command_line(pages, capsys, tmp_path, monkeypatch):
    assert catalogue.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m fedjax_pan.config.catalogue")
    assert catalogue.main(["--bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unexpected arguments ['--bad']")
    monkeypatch.setattr(catalogue, "DIR", str(tmp_path / "catalogue"))
    monkeypatch.setattr(catalogue, "pages", lambda: pages)
    assert catalogue.main(["--write"]) == 0
    for name, text in pages.items():
        assert (tmp_path / "catalogue" / name).read_text(encoding="utf-8") == text
    assert catalogue.main([]) == 0
    assert "algorithms.md -->\n# Algorithms\n" in capsys.readouterr().out
