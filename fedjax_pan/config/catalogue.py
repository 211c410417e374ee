"""docs/catalogue/: every method a config can select, one section each, generated from the
entries that declare them: summary, kind, reference (paper, code at its commit,
departures), equivalence tests and options with their defaults and rules.

    algorithms.md    `algorithms.registry.ALGORITHMS` (`AlgorithmEntry`)
    aggregation.md   `algorithms.aggregation.RULES` (`RuleEntry`)
    attacks.md       `algorithms.robust.attacks` (REFERENCES, DATA_ATTACKS, MODEL_ATTACKS)
    transforms.md    `algorithms.uploads.compression`, `algorithms.uploads.dp`, shuffling

Options come from the entries (`algorithms.features.FEATURES` for the sections), defaults
from `config.defaults.default_config`, what a value must be from the schema's rules. Where
no entry declares a one-line summary, it is the first sentence of the method's own module
or function docstring, or its line in its module docstring's list of kinds.

    python -m fedjax_pan.config.catalogue            # prints the pages
    python -m fedjax_pan.config.catalogue --write    # writes docs/catalogue/
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from fedjax_pan import algorithms as algorithms_pkg
from fedjax_pan.algorithms import aggregation, features, recruitment, registry, shuffle
from fedjax_pan.algorithms.core import AlgorithmEntry
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms.uploads import compression, dp
from fedjax_pan.config import schema
from fedjax_pan.config.defaults import default_config
from fedjax_pan.config.document import _Invalid, _want, pages_command
from fedjax_pan import fidelity
from fedjax_pan.references import Reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIR = os.path.join(ROOT, "docs", "catalogue")
COMMAND = "python -m fedjax_pan.config.catalogue"
# Words whose trailing period does not end a sentence.
_ABBREVIATIONS = {"al", "e.g", "i.e", "eq", "eqs", "alg", "sect", "thm", "fig", "vs", "cf"}
_CODE = re.compile(r"(`+)(.+?)\1")
_REPO = re.compile(r"^([\w.-]+/[\w.-]+)@([0-9a-f]{7,40}):\s*(.*)$")


# --- Reading what the entries declare -------------------------------------------------


def _sentence(doc: Optional[str]) -> str:
    """The first sentence of `doc`'s first paragraph (periods inside brackets and after
    abbreviations do not end it)."""
    para = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())
    depth = 0
    for i, ch in enumerate(para):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif ch == "." and depth == 0 and (i + 1 == len(para) or para[i + 1] == " "):
            if para[:i].rsplit(" ", 1)[-1].lower() not in _ABBREVIATIONS:
                return para[:i + 1]
    return para


def _listed(doc: Optional[str], name: str) -> str:
    """`name`'s line in a docstring's list of kinds ('  name   what it does', continued on
    lines indented as far as the text), without its closing ';' or ','; '' if none."""
    lines = inspect.cleandoc(doc or "").splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"^\s*{re.escape(name)}\s{{2,}}(\S.*)$", line)
        if not m:
            continue
        text = [m.group(1)]
        for more in lines[i + 1:]:
            if not more.strip() or len(more) - len(more.lstrip()) < m.start(1):
                break
            text.append(more.strip())
        return " ".join(text).rstrip(";,.") + "."
    return ""


def _module_named(name: str) -> Optional[Any]:
    """The module `fedjax_pan.algorithms.<package>.<name>`, if one package holds it."""
    for info in pkgutil.iter_modules(algorithms_pkg.__path__):
        full = f"{algorithms_pkg.__name__}.{info.name}.{name}"
        if info.ispkg and importlib.util.find_spec(full) is not None:
            return importlib.import_module(full)
    return None


def algorithm_summary(name: str, entry: AlgorithmEntry) -> str:
    """An algorithm's one line: its own module's first sentence, else its line in the list
    of the module that builds it ('' if neither says)."""
    built = sys.modules[entry.build.__module__]
    own = built if built.__name__.rsplit(".", 1)[-1] == name else _module_named(name)
    if own is not None:
        return _sentence(own.__doc__)
    return _listed(built.__doc__, name)


def _kind(entry: AlgorithmEntry) -> str:
    """What the entry declares about how it runs."""
    out = []
    if entry.personal:
        out.append("personalised (a model per client, scored on each client's own test "
                   "part: `partition.test_fraction > 0`)")
    if entry.driver is not None:
        out.append("driver (its round is not one compiled federated round: "
                   "`AlgorithmEntry.driver`)")
    if entry.public:
        out.append(f"distils on unlabelled public data ({entry.public} training examples "
                   f"held out where `dataset.public_size` is 0)")
    if entry.heterogeneous:
        out.append("heterogeneous (clients may run different networks: "
                   "`model.architectures`)")
    if entry.input_shape:
        out.append("builds a network of its own beside the client's")
    return "; ".join(out) or "plain (one compiled federated round)"


def references(kind: str) -> Dict[str, Optional[Reference]]:
    """name -> declared reference (None: undeclared) of every `kind` a config can select."""
    return {m.name: m.reference for m in fidelity.catalogue() if m.kind == kind}


def _feature(section: str) -> Any:
    return next(f for f in features.FEATURES if f.section == section)


def _selecting(section: str, name: str) -> List[str]:
    """The keys of `config.<section>` that select `name`: named after it, or whose rule
    accepts it as one of its choices."""
    out = []
    for key in features.rules((_feature(section),)):
        rule = schema.RULES[key]
        if key.rsplit(".", 1)[-1] == name or (rule.want(name) is None
                                               and rule.want(_Invalid()) is not None
                                               and rule.lo is None):
            out.append(key)
    return out


# --- Markdown ---------------------------------------------------------------------------


def _md(text: str) -> str:
    """`text` as Markdown prose: code spans kept, characters Markdown (or MyST's dollar
    math) would read as markup escaped elsewhere."""
    out, at = [], 0
    for m in _CODE.finditer(text):
        out.append(re.sub(r"([\\`*_<>$\[\]])", r"\\\1", text[at:m.start()]))
        out.append(m.group(0))
        at = m.end()
    out.append(re.sub(r"([\\`*_<>$\[\]])", r"\\\1", text[at:]))
    return " ".join("".join(out).split())


def _cell(text: str) -> str:
    return _md(text).replace("|", "\\|")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _line(text: str) -> str:
    """`text` as a sentence: capitalised, closed by a period."""
    text = _capital(text.strip().rstrip(":;,"))
    return text if not text or text.endswith((".", "!", "?")) else text + "."


def _table(keys: Iterable[str], defaults: Mapping[str, Any]) -> List[str]:
    rows = ["| key | default | must be |", "| --- | --- | --- |"]
    for key in keys:
        value = defaults[key]
        shown = "unset" if value is None else repr(value)
        rows.append(f"| `config.{key}` | `{shown.replace('|', chr(92) + '|')}` | "
                    f"{_cell(_want(key))} |")
    return rows


def _code(code: Optional[str]) -> str:
    if code is None:
        return "none followed"
    m = _REPO.match(code)
    if m is None:
        return _md(code)
    repo, commit, paths = m.groups()
    return (f"[{repo}@{commit[:12]}](https://github.com/{repo}/tree/{commit}): "
            f"{_md(paths)}")


def _reference(ref: Optional[Reference], tests: Sequence[str],
               facts: Sequence[Tuple[str, str]]) -> List[str]:
    """The bullet list (`facts` as 'label: text', paper, code, equivalence tests) and the
    departures."""
    lines = [f"- {label}: {_md(text)}" for label, text in facts]
    if ref is None:
        return lines + ["- Reference: **none declared**", ""]
    lines += [f"- Paper: {_md(ref.paper)}", f"- Code: {_code(ref.code)}"]
    lines += ["- Equivalence tests:" + ("" if tests else " **none marked**")]
    lines += [f"  - `tests/{t}`" for t in tests]
    lines.append("")
    if not ref.departures:
        return lines + ["Departures from the reference: none.", ""]
    return lines + ["Departures from the reference:", ""] + [
        f"- {_md(d)}" for d in ref.departures] + [""]


def _header(title: str, sources: str) -> List[str]:
    return [f"# {title}", "",
            f"Generated by `{COMMAND} --write` from {sources}; tests/test_catalogue.py "
            f"fails when this page is out of date.", ""]


def _section(name: str, summary: str, ref: Optional[Reference], tests: Sequence[str],
             facts: Sequence[Tuple[str, str]], level: str = "##") -> List[str]:
    return [f"{level} {name}", ""] + ([_md(_line(summary)), ""] if summary else []) + \
        _reference(ref, tests, facts)


# --- Pages ------------------------------------------------------------------------------


def _algorithms(tests: Mapping[Tuple[str, str], List[str]], defaults: Mapping[str, Any]
                ) -> str:
    lines = _header("Algorithms", "`algorithms.registry.ALGORITHMS` (each `AlgorithmEntry`: "
                    "its reference, options and rules)") + [
        "`config.algorithm` selects one; the options of algorithm `name` are the keys "
        "`config.name.*`, checked against the last column before anything runs.", ""]
    for name, entry in registry.ALGORITHMS.items():
        lines += _section(name, algorithm_summary(name, entry), entry.reference,
                          tests.get(("algorithm", name), []), [("Kind", _kind(entry))])
        keys = [f"{name}.{k}" for k in entry.rules]
        lines += ([f"Options (`config.{name}`):", ""] + _table(keys, defaults) if keys
                  else ["No options of its own."]) + [""]
    return "\n".join(lines).rstrip() + "\n"


def _aggregation(tests: Mapping[Tuple[str, str], List[str]], defaults: Mapping[str, Any]
                 ) -> str:
    lines = _header("Aggregation rules", "`algorithms.aggregation.RULES` (each `RuleEntry`: "
                    "its summary, reference, options and rules)")
    declared = {k for e in aggregation.RULES.values() for k in e.rules}
    shared = [k for k in schema.RULES if k.startswith("aggregation.")
              and k[len("aggregation."):] not in declared]
    lines += ["`config.aggregation.rule` selects one. The keys of `config.aggregation` that "
              "no rule declares:", ""] + \
        _table(shared, defaults) + [""]
    for name, entry in aggregation.RULES.items():
        kind = ([("Kind", f"public (scores models on the server's labelled public set: "
                          f"`dataset.public_size`, {aggregation.PUBLIC_SIZE} examples where 0)")]
                if entry.public else [])
        lines += _section(name, entry.summary, entry.reference,
                          tests.get(("aggregation", name), []), kind)
        keys = [f"aggregation.{k}" for k in entry.rules]
        lines += (["Options (`config.aggregation`):", ""] + _table(keys, defaults) if keys
                  else ["No options of its own."]) + [""]
    return "\n".join(lines).rstrip() + "\n"


def _feature_intro(section: str, defaults: Mapping[str, Any], lead: str = "") -> List[str]:
    """`lead`, the feature's summary and the table of its options."""
    f = _feature(section)
    return [" ".join(filter(None, (_md(lead), _md(_line(f.summary))))), "",
            f"Options (`config.{section}`):", ""] + \
        _table(features.rules((f,)), defaults) + [""]


def _attacks(tests: Mapping[Tuple[str, str], List[str]], defaults: Mapping[str, Any]) -> str:
    lines = _header("Attacks", "`algorithms.robust.attacks` (`REFERENCES`, `DATA_ATTACKS`, "
                    "`MODEL_ATTACKS`, `DEFAULT_SCALE`, its `FEATURE` and the module "
                    "docstring's list of kinds)")
    lines += _feature_intro("attack", defaults, "`config.attack.kind` selects one. "
                            + _line(_sentence(attacks.__doc__)))
    for name, ref in references("attack").items():
        kind = [k for k, table in (("data (changes the batches its clients train on)",
                                    attacks.DATA_ATTACKS),
                                   ("model (changes the parameters its clients send)",
                                    attacks.MODEL_ATTACKS)) if name in table]
        facts = [("Kind", "; ".join(kind))] if kind else []
        if name in attacks.DEFAULT_SCALE:
            facts.append(("Scale where `attack.scale` is unset",
                          repr(attacks.DEFAULT_SCALE[name])))
        lines += _section(name, _listed(attacks.__doc__, name), ref,
                          tests.get(("attack", name), []), facts)
    return "\n".join(lines).rstrip() + "\n"


def _transforms(tests: Mapping[Tuple[str, str], List[str]], defaults: Mapping[str, Any]
                ) -> str:
    lines = _header("Upload transforms, privacy and shuffling",
                    "`algorithms.uploads.compression` (`METHODS`, `OPTIONS`, `REFERENCES`), "
                    "`algorithms.uploads.dp` (`MECHANISMS`, `REFERENCES`) and the entries of "
                    "`algorithms.features.FEATURES`")
    lines += ["## Compression", ""] + _feature_intro("compression", defaults)
    for name, ref in references("compression").items():
        fn = getattr(compression, name, None)
        summary = _sentence(fn.__doc__) if callable(fn) else ""
        keys = _selecting("compression", name)
        kind = [("Set by", ", ".join(f"`config.{k}`" for k in keys))] if keys else []
        lines += _section(name, summary, ref, tests.get(("compression", name), []), kind,
                          "###")
    lines += ["## Privacy", ""] + _feature_intro(
        "privacy", defaults, _line(_sentence(dp.__doc__)))
    for name, ref in references("privacy").items():
        lines += _section(name, "", ref, tests.get(("privacy", name), []), [], "###")
    lines += ["## Shuffle", ""] + _feature_intro(
        "shuffle", defaults, _line(_sentence(shuffle.__doc__)))
    return "\n".join(lines).rstrip() + "\n"


def _recruitment(tests: Mapping[Tuple[str, str], List[str]], defaults: Mapping[str, Any]
                 ) -> str:
    lines = _header("Recruitment", "`algorithms.recruitment` (`POLICIES`, `REFERENCES`, "
                    "its `FEATURE` and the module docstring's list of policies)")
    lines += _feature_intro("recruitment", defaults, "`config.recruitment.policy` selects "
                            "one. " + _line(_sentence(recruitment.__doc__)))
    for name, ref in references("recruitment").items():
        lines += _section(name, _listed(recruitment.__doc__, name), ref,
                          tests.get(("recruitment", name), []), [])
    return "\n".join(lines).rstrip() + "\n"


_PAGES = (("algorithms.md", "Algorithms", "algorithm", "`config.algorithm`"),
          ("aggregation.md", "Aggregation rules", "aggregation", "`config.aggregation.rule`"),
          ("attacks.md", "Attacks", "attack", "`config.attack.kind`"),
          ("transforms.md#compression", "Compression", "compression", "`config.compression`"),
          ("transforms.md#privacy", "Privacy", "privacy", "`config.privacy`"),
          ("recruitment.md", "Recruitment", "recruitment", "`config.recruitment.policy`"))


def _index() -> str:
    lines = ["# Method catalogue", "",
             f"Generated by `{COMMAND} --write` from the registries; every method a config "
             f"can select, with its reference, departures, equivalence tests and options. "
             f"[Fidelity](../FIDELITY.md) holds the same references as one table, and "
             f"[Configuration keys](../CONFIG.md) every key.", ""]
    for page, title, kind, key in _PAGES:
        names = list(references(kind))
        linked = ", ".join(f"[{n}]({page.split('#')[0]}#{n})" for n in names)
        lines.append(f"- [{title}]({page}) ({len(names)}; {key}): {linked}")
    lines.append("- [Shuffle](transforms.md#shuffle): the PAN paper's shuffling "
                 "(`config.shuffle`)")
    return "\n".join(lines) + "\n"


def pages(tests_dir: str = fidelity.TESTS) -> Dict[str, str]:
    """docs/catalogue/'s file names -> their Markdown."""
    tests = fidelity.equivalence_tests(tests_dir)
    defaults = dict(schema.leaves(default_config()))
    return {"index.md": _index(),
            "algorithms.md": _algorithms(tests, defaults),
            "aggregation.md": _aggregation(tests, defaults),
            "attacks.md": _attacks(tests, defaults),
            "transforms.md": _transforms(tests, defaults),
            "recruitment.md": _recruitment(tests, defaults)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the pages, or with --write writes them; --help prints the usage; anything
    else is one error line and exit 2."""
    return pages_command(
        sys.argv[1:] if argv is None else argv, "fedjax_pan.config.catalogue", __doc__,
        f"the catalogue's pages ({os.path.relpath(DIR, ROOT)}/)",
        lambda: {os.path.join(DIR, name): text for name, text in pages().items()})


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DIR", "algorithm_summary", "references", "pages", "main"]
