"""A refusal's advice works: every algorithm on the main job's smoke preset either runs or
refuses with an `error:` line whose suggested overrides, followed literally, make it run."""

import os
import re

import pytest

from conftest import ROOT
from fedjax_pan.algorithms import registry
from fedjax_pan.run import main

SMOKE = f"--config={os.path.join(ROOT, 'configs', 'fmnist_mlp.py')}:smoke"
# The smallest run of the preset: one round on synthetic data, its three hidden layers
# narrowed (what a refusal depends on, the layer count, is the preset's).
SMALL = ["--noprogress", "--config.rounds=1", "--config.dataset.name=synthetic",
         "--config.model.options.hidden=[32, 32, 32]"]
# `--config.KEY=VALUE` (VALUE quoted where it holds spaces) or `set KEY=VALUE`.
FIX = re.compile(r"""(?:--config\.|\bset )([a-z_][\w.]*)=("[^"]*"|'[^']*'|[^\s,;)]+)""")
QUOTES = "\"'"


def suggested_overrides(line: str) -> list:
    """The command-line overrides an `error:` line suggests, unquoted."""
    return [f"--config.{key}={value.strip(QUOTES)}" for key, value in FIX.findall(line)]


def _run(capsys, *argv):
    status = main.main(["prog", SMOKE, *SMALL, *argv])
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("error:")]
    return status, lines[-1] if lines else ""


def test_suggested_overrides_are_read_as_the_shell_would_pass_them():
    line = ("error: set --config.model.options.grouped=\"{'groups': 10, 'depth': 3}\" "
            "(G = 10), or --config.partition.test_fraction=0.25, got 0.0; set pan.amplitude=0")
    assert suggested_overrides(line) == [
        "--config.model.options.grouped={'groups': 10, 'depth': 3}",
        "--config.partition.test_fraction=0.25", "--config.pan.amplitude=0"]


@pytest.mark.parametrize("name", [name if name == "fed2" else
                                  pytest.param(name, marks=pytest.mark.slow)
                                  for name in registry.ALGORITHMS])
def test_every_refusal_on_the_smoke_preset_suggests_a_fix_that_runs(tmp_path, capsys, name):
    algorithm = f"--config.algorithm={name}"
    status, line = _run(capsys, f"--workdir={tmp_path / 'as_is'}", algorithm)
    if status == 0:
        return
    fixes = suggested_overrides(line)
    assert status == 2 and fixes, f"{name} refused with no fix to follow: {line}"
    fixed, after = _run(capsys, f"--workdir={tmp_path / 'fixed'}", algorithm, *fixes)
    assert fixed == 0, f"{name}: {line}\nfollowing {fixes}: {after}"
