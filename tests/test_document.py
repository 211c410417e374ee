"""docs/CONFIG.md is generated from the entries: every key the schema knows appears once
with its default and its rule, and the committed page is the generated one."""

import re

from fedjax_pan.config import document, schema


def test_every_key_appears_once_with_its_rule():
    page = document.page()
    keys = re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)
    assert sorted(keys) == sorted(schema.RULES)
    assert "| `attack.kind` | `'none'` | one of none, model_poisoning" in page
    assert "| `aggregation.trim` | `0.1` | a number in [0, 0.5) |" in page


def test_the_committed_page_is_the_generated_one():
    with open(document.DOC) as f:
        assert f.read() == document.page(), (
            "docs/CONFIG.md is stale: python -m fedjax_pan.config.document --write")


def test_a_wrong_command_line_is_one_error_line_and_exit_2(capsys):
    assert document.main(["--bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unexpected arguments")
