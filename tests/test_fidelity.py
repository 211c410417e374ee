"""Fidelity as a checked property: every method a config can name declares its reference
and departures, has a test marked as checking it against that reference, and
docs/FIDELITY.md is the table those declarations generate."""


import pytest

from fedjax_pan import fidelity, references
from fedjax_pan.references import Reference


def test_every_method_declares_a_reference_and_its_departures():
    missing = [f"{m.kind} {m.name}" for m in fidelity.catalogue() if m.reference is None]
    assert not missing, f"no reference declared: {missing}"
    for m in fidelity.catalogue():
        references.check(m.reference, f"{m.kind} {m.name}")
    assert not fidelity.undeclared(), "references for names no config selects"


def test_every_method_has_an_equivalence_test():
    tests = fidelity.equivalence_tests()
    missing = [f"{m.kind} {m.name}" for m in fidelity.catalogue()
               if (m.kind, m.name) not in tests]
    assert not missing, (f"no test marked @pytest.mark.reference(kind, name) for: {missing}")


def test_markers_name_methods_that_exist():
    known = {(m.kind, m.name) for m in fidelity.catalogue()}
    unknown = [f"{k} {n} ({', '.join(t)})" for (k, n), t in
               fidelity.equivalence_tests().items() if (k, n) not in known]
    assert not unknown, f"markers naming no method: {unknown}"


def test_the_fidelity_page_is_generated_from_the_declarations():
    with open(fidelity.DOC, encoding="utf-8") as f:
        assert f.read() == fidelity.table(), \
            "docs/FIDELITY.md is out of date: python -m fedjax_pan.fidelity --write"


def test_the_scanner_reads_markers_and_nothing_else(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "@pytest.mark.reference('algorithm', 'fedavg', 'fedprox')\n"
        "def test_one(): pass\n"
        "@pytest.mark.slow\n"
        "@pytest.mark.reference('attack', 'sign_flip')\n"
        "def test_two(): pass\n"
        "@pytest.mark.parametrize('x', [1])\n"
        "def test_three(x): pass\n"
        "class TestC:\n"
        "    @pytest.mark.reference('privacy', 'dp_fedavg')\n"
        "    def test_four(self): pass\n")
    (tmp_path / "helper.py").write_text(
        "import pytest\n@pytest.mark.reference('algorithm', 'moon')\ndef test_x(): pass\n")
    assert fidelity.equivalence_tests(str(tmp_path)) == {
        ("algorithm", "fedavg"): ["test_a.py::test_one"],
        ("algorithm", "fedprox"): ["test_a.py::test_one"],
        ("attack", "sign_flip"): ["test_a.py::test_two"],
        ("privacy", "dp_fedavg"): ["test_a.py::test_four"]}


@pytest.mark.parametrize("bad, match", [
    (("A paper", None, []), "tuple of non-empty lines"),
    (("A paper", None, ("",)), "tuple of non-empty lines"),
    ((" ", None, ()), "paper is empty"),
    (("A paper", "", ()), "code is empty"),
])
def test_a_reference_that_says_nothing_is_refused(bad, match):
    with pytest.raises(ValueError, match=f"x y: reference.{match}|x y: .*{match}"):
        references.check(Reference(*bad), "x y")
    with pytest.raises(ValueError, match="must be a fedjax_pan.references.Reference"):
        references.check(("A paper", None, ()), "x y")


def test_the_table_marks_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(fidelity, "catalogue", lambda: [
        fidelity.Method("algorithm", "fedavg", Reference("McMahan et al. 2017", None, ())),
        fidelity.Method("algorithm", "nameless", None)])
    text = fidelity.table(str(tmp_path))
    assert "| `fedavg` | McMahan et al. 2017 | - | **missing** | none |" in text
    assert "| `nameless` | **missing** | | | |" in text


def test_a_wrong_command_line_is_one_error_line_and_exit_2(capsys):
    assert fidelity.main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unexpected arguments ['--bogus']")
    assert fidelity.main([]) == 0
    assert capsys.readouterr().out.startswith("# Fidelity")
