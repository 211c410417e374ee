"""Every command answers --help and -h with its usage and exit status 0.

The commands are found, not listed: every module under fedjax_pan/, benchmarks/ and
experiments/ with an `if __name__ == "__main__":` block, the old import paths of those
(`_moved.MOVED`) and the old command paths (`_moved.COMMANDS`). Each runs in this process;
three subprocesses check the real command lines.
"""

import importlib
import os
import re
import runpy
import subprocess
import sys
import warnings
from unittest import mock

import pytest

from conftest import ROOT
from fedjax_pan import _moved
from fedjax_pan.run import main as run_main

_MAIN_BLOCK = re.compile(r"^if __name__ == ['\"]__main__['\"]:", re.M)


def _entry_points():
    found = []
    for top in ("fedjax_pan", "benchmarks", "experiments"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and _MAIN_BLOCK.search(open(path, encoding="utf-8")
                                                               .read()):
                    found.append(os.path.relpath(path[:-3], ROOT).replace(os.sep, "."))
    return sorted(found)


ENTRY_POINTS = _entry_points()
OLD_PATHS = sorted(old for old, new in _moved.MOVED.items() if new in ENTRY_POINTS)
COMMANDS = ENTRY_POINTS + OLD_PATHS + sorted(_moved.COMMANDS)


def test_the_scan_finds_the_commands():
    # A scan that found nothing would let every test below pass.
    assert {"fedjax_pan.__main__", "fedjax_pan.run.main", "fedjax_pan.run.launch",
            "fedjax_pan.algorithms.robust.flchain_cli", "fedjax_pan.config.document",
            "fedjax_pan.fidelity", "benchmarks.run", "experiments.sweeps"} <= set(ENTRY_POINTS)
    assert {"fedjax_pan.main", "fedjax_pan.launch"} <= set(OLD_PATHS)
    assert set(_moved.COMMANDS.values()) <= set(ENTRY_POINTS)


def _run(name, args):
    """The exit status of `python -m name *args`, run in this process: the module's
    main(argv) where it has one, else its code as `python -m` runs it (an old command path's
    is its new command's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # old paths say they moved
        try:
            main = None if name in _moved.COMMANDS else getattr(importlib.import_module(name),
                                                                "main", None)
            if main is not None:  # fedjax_pan.run.main's takes the program name first
                return main([name, *args] if main is run_main.main else list(args))
            imported = sys.modules.pop(name, None)  # found afresh, as `python -m` finds it
            try:
                with mock.patch.object(sys, "argv", [name, *args]):
                    runpy.run_module(name, run_name="__main__", alter_sys=False)
            finally:
                if imported is not None:
                    sys.modules[name] = imported
            return None  # a command must exit with a status
        except SystemExit as e:
            return e.code


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", COMMANDS)
def test_help_prints_usage_and_exits_0(name, flag, capsys):
    code = _run(name, [flag])
    out, err = capsys.readouterr()
    assert code == 0, (code, err)
    assert "usage" in out.lower(), out


def test_launch_compare_has_its_own_help(capsys):
    assert _run("fedjax_pan.run.launch", ["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m fedjax_pan.run.launch compare" in out and "DIR_B" in out


def test_main_help_lists_flags_exit_statuses_and_config_keys(capsys, tmp_path):
    workdir = tmp_path / "w"
    assert run_main.main(["prog", f"--workdir={workdir}", "--config.rounds=3", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fedjax_pan --config=")
    for name in run_main._flags(["prog"]):
        assert f"--{name}: " in out or f"--[no]{name}: " in out, name
    assert "--[no]resume: continue from the workdir's last checkpoint (default: false)" in out
    assert "(default: '~/.cache/fedjax_pan/xla')" in out
    assert "3 training diverged" in out and "130/143" in out  # the exit statuses
    assert "docs/CONFIG.md" in out and "python -m fedjax_pan.config.document" in out
    assert "\npresets of" not in out and not workdir.exists()


CONFIG = '''"""A config for the help test.

Presets (`--config=this.py:<preset>`), described
over two lines:
  small     one line
            and its continuation
  a / b     shared text
  c ... e   a range
Not a preset's line.
"""
PRESETS = ("small", "a", "b", "c", "d", "e", "bare")


def get_config(preset="small"):
    raise AssertionError("--help builds no config")
'''


def test_main_help_lists_a_config_files_presets_without_building_it(capsys, tmp_path):
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    assert run_main.main(["prog", "--config", f"{path}:nothing", "--help"]) == 0
    out = capsys.readouterr().out.split("\npresets of ")[1].splitlines()
    assert out[0] == f"{path} (--config={path}:PRESET; default small):"
    assert [line.split(None, 1) for line in out[1:]] == [
        ["small", "one line and its continuation"], ["a", "shared text"],
        ["b", "shared text"], ["c", "a range"], ["d", "a range"], ["e", "a range"],
        ["bare"]]


@pytest.mark.parametrize("text,why", [(None, "cannot be read"),
                                      ("PRESETS = (\n", "does not load: SyntaxError")])
def test_main_help_with_a_bad_config_is_one_error_line(capsys, tmp_path, text, why):
    path = tmp_path / "config.py"
    if text is not None:
        path.write_text(text)
    assert run_main.main(["prog", f"--config={path}", "--help"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: --config={path} ")
    assert why in err


def _command(*args):
    # JAX logs every compilation at this setting: --help must compile nothing.
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "JAX_LOG_COMPILES": "1"})
    assert done.returncode == 0 and "Compiling" not in done.stderr, done.stderr
    return done.stdout


def test_the_command_line_answers_help():
    out = _command("fedjax_pan", "--help")
    assert out.startswith("usage: python -m fedjax_pan ") and "--workdir: " in out


def test_the_command_line_lists_a_config_files_presets():
    out = _command("fedjax_pan", "--config=configs/fmnist_mlp.py", "--help")
    presets = runpy.run_path(os.path.join(ROOT, "configs", "fmnist_mlp.py"))["PRESETS"]
    listed = out.split("presets of configs/fmnist_mlp.py")[1].splitlines()[1:]
    assert [line.split()[0] for line in listed if line[2:3] != " "] == list(presets)
    assert "  smoke         3 tiny rounds, for tests" in listed


@pytest.mark.parametrize("old", sorted(_moved.COMMANDS))
def test_an_old_command_path_answers_help(old):
    out = _command(old, "--help")
    assert f"usage: python -m {_moved.COMMANDS[old]} " in out
