"""Command line: python -m fedjax_pan --config=FILE[:preset] [--config.KEY=VALUE ...] --workdir=DIR

Runs a config (or each of its variants) into DIR; --config.model.options.KEY=VALUE sets
any option of the model (a Python literal, e.g. `"{'groups': 10, 'depth': 6}"` for
`grouped`), whether or not the config file names it. A non-empty DIR is refused unless
--resume (continue from its last checkpoint) or --overwrite (replace it once the new run
succeeds). Every way a run can end early prints one `error:` line and exits with:
2 invalid input (config value, workdir request, data), 3 training diverged, 4 the workdir
could not be written or read back, 130/143 interrupted by SIGINT/SIGTERM (resumable),
1 anything unexpected (its traceback is saved to a file the line names).

One process of a multi-process run (`fedjax_pan.engine.distributed`) takes --coordinator=HOST:PORT
--num_processes=N --process_id=I, or --distributed to read them from the cluster (SLURM,
TPU pods); every process is given the same command otherwise, and process 0 writes DIR.

--help (-h) lists the flags, and with --config=FILE that file's presets.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import tempfile
import textwrap
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import flags
from ml_collections import config_flags

USAGE = ("usage: python -m fedjax_pan --config=configs/FILE.py[:preset] "
         "[--config.KEY=VALUE ...] [--config.model.options.KEY=VALUE ...] --workdir=DIR "
         "[--resume | --overwrite] [--noprogress] "
         "[--coordinator=HOST:PORT --num_processes=N --process_id=I | --distributed]")
_OVERRIDE = re.compile(r"^--?config\.([^=]+)")
_MODEL_OPTION = re.compile(r"^--?config\.model\.options\.([A-Za-z_][\w.]*)(?:=(.*))?$", re.S)


def _flags(argv: List[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    # sys_argv: overrides are read from the argv given, not sys.argv (main() runs in-process).
    config_flags.DEFINE_config_file("config", None, "ml_collections config file[:preset]",
                                    flag_values=fv, lock_config=True, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "output directory", flag_values=fv)
    flags.DEFINE_bool("resume", False, "continue from the workdir's last checkpoint",
                      flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty workdir once the new run "
                      "succeeds", flag_values=fv)
    flags.DEFINE_bool("progress", True, "show a progress bar", flag_values=fv)
    flags.DEFINE_string("compilation_cache", "~/.cache/fedjax_pan/xla",
                        "persistent XLA compilation cache ('' = off; $JAX_COMPILATION_CACHE_DIR "
                        "wins)", flag_values=fv)
    flags.DEFINE_string("coordinator", None, "host:port of process 0 in a multi-process run",
                        flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "processes in a multi-process run",
                         flag_values=fv)
    flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)",
                         flag_values=fv)
    flags.DEFINE_bool("distributed", False, "join a multi-process run whose settings JAX "
                      "reads from the cluster (SLURM, TPU pods, Open MPI)", flag_values=fv)
    flags.DEFINE_float("peer_timeout", 60.0, "seconds without word from a process of a "
                       "multi-process run (killed, or its host lost) before the others stop",
                       flag_values=fv)
    return fv


_HELP = ("--help", "-h")


def _wants_help(argv: List[str]) -> bool:
    args = argv[1:]
    return any(arg in _HELP for arg in (args[:args.index("--")] if "--" in args else args))


def _flag_lines(fv: flags.FlagValues) -> List[str]:
    """Each flag of `fv` with its help text and default, in the order they were defined."""
    lines = []
    for name in fv:
        flag = fv[name]
        if isinstance(flag, flags.BooleanFlag):
            name, default = f"[no]{name}", str(flag.default).lower()
        else:
            default = "none" if flag.default is None else repr(flag.default)
        lines.append(textwrap.fill(f"--{name}: {flag.help} (default: {default})", width=92,
                                   initial_indent="  ", subsequent_indent="      "))
    return lines


def _preset_texts(doc: str, names: Sequence[str]) -> Dict[str, str]:
    """Each preset's description from a config file's docstring, whose block after its
    `Presets` line has an indented entry per preset: its name (or `a / b`, `a, b`, or
    `a ... d` for the presets a to d), then its text, continued on deeper-indented lines."""
    lines = doc.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Presets")), None)
    if start is None:
        return {}
    body = lines[start:]
    body = body[next((i for i, line in enumerate(body) if line[:1].isspace()), len(body)):]
    texts: Dict[str, str] = {}
    chosen: List[str] = []
    level = None
    for line in body:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent == 0:
            break
        level = indent if level is None else level
        words = line.split()
        if indent == level:  # a new entry: its names, then its text
            n, chosen = 0, []
            while n < len(words) and words[n].rstrip(",") in names:
                word = words[n].rstrip(",")
                if n and words[n - 1] == "...":
                    chosen += names[names.index(chosen[-1]) + 1:names.index(word)]
                chosen.append(word)
                if words[n].endswith(","):
                    n += 1
                elif words[n + 1:n + 2] in (["/"], ["..."]):
                    n += 2
                else:  # the last name: the text follows
                    n += 1
                    break
            words = words[n:]
            texts.update((name, "") for name in chosen)
        for name in chosen:
            texts[name] = " ".join([texts[name], *words]).strip()
    return texts


def _load(path: str) -> Any:
    """Config file `path` as a module (as config_flags loads it, under a name of its own):
    its imports run, no config is built, no data read."""
    loader = importlib.machinery.SourceFileLoader("fedjax_pan_help_config", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name,
                                                                             loader))
    loader.exec_module(module)
    return module


def _preset_lines(path: str, module: Any) -> List[str]:
    """The presets of config file `path` (its PRESETS, the names its `:preset` error
    lists), each with its description where the file's docstring gives one."""
    names = list(getattr(module, "PRESETS", ()))
    if not names:
        return [f"{path} names no presets (no PRESETS)"]
    preset = inspect.signature(getattr(module, "get_config", lambda: None)).parameters.get(
        "preset")  # get_config's default preset, when it has one
    default = "" if preset is None or preset.default is preset.empty else \
        f"; default {preset.default}"
    texts = _preset_texts(module.__doc__ or "", names)
    width = max(len(n) for n in names) + 4
    return [f"presets of {path} (--config={path}:PRESET{default}):"] + [
        textwrap.fill(f"{name:<{width - 2}}{texts.get(name, '')}", width=92,
                      initial_indent="  ", subsequent_indent=" " * width,
                      break_on_hyphens=False)
        for name in names]


def _help(fv: flags.FlagValues, argv: List[str]) -> int:
    """Prints the usage, the flags, the exit statuses and, with --config=FILE, the file's
    presets; a config file that does not load is one `error:` line, status 2."""
    path = None
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg.partition("=")
        if name in ("--config", "-config"):
            path = (value if eq else (argv[i + 1] if i + 1 < len(argv) else "")).split(":")[0]
    presets: List[str] = []
    if path is not None:
        try:
            module = _load(path)
        except OSError as e:
            return _error(f"--config={path} cannot be read: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - the config file's own error, in one line
            return _error(f"--config={path} does not load: {type(e).__name__}: {e}")
        presets = [""] + _preset_lines(path, module)
    about = (__doc__ or "").partition("\n")[2].strip()
    keys = ("config keys: every --config.KEY, with its default and what it must be, is in "
            "docs/CONFIG.md (`python -m fedjax_pan.config.document` prints it)")
    print("\n".join([textwrap.fill(USAGE, width=92, subsequent_indent="    "), "", about, "",
                     "flags:", *_flag_lines(fv), "", textwrap.fill(keys, width=92),
                     *presets]))
    return 0


def _error(message, status: int = 2) -> int:
    text = str(message)
    if "Traceback" in text:  # config_flags embeds the config file's traceback: keep its cause
        text = [line for line in text.splitlines() if line.strip()][-1]
    distributed = sys.modules.get("fedjax_pan.engine.distributed")  # once a run started
    if distributed is not None:  # one process of several: the first failure, named
        text, status = distributed.ending(text, status, getattr(message, "message", None))
    print(f"error: {' '.join(text.split())}", file=sys.stderr)
    return status


def _unknown_override(argv: List[str]) -> Optional[str]:
    """The message for the first --config.KEY that names no config key, if any."""
    from fedjax_pan.config import schema
    known = schema.known_keys()
    for arg in argv[1:]:
        m = _OVERRIDE.match(arg)
        if m is None:
            continue
        key = m.group(1)
        if key in known or any(key.startswith(k + ".") for k in schema.OPAQUE):
            continue
        return schema.unknown_key(key, known)
    return None


def _silence_stderr() -> None:
    """After a run's one-line error, nothing else reaches stderr: tensorstore threads whose
    writes failed (e.g. on a full disk) print tracebacks when they end, after the error."""
    sys.stderr.flush()
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


def _missing_key(argv: List[str], e: BaseException) -> str:
    name = str(e).strip("'\"").split("'")[0].split("\\")[0]
    for arg in argv[1:]:
        m = _OVERRIDE.match(arg)
        if m and m.group(1).rsplit(".", 1)[-1] == name:
            section = m.group(1).rsplit(".", 1)[0]
            return (f"cannot set config.{m.group(1)}: this config's {section} has no key "
                    f"{name!r}; add it in the config file")
    return f"{type(e).__name__}: {e}"


def _model_options(argv: List[str]) -> Tuple[List[str], List[Tuple[str, Any]]]:
    """argv without its --config.model.options.KEY=VALUE overrides, and those as (KEY,
    value). The model's options are free-form (each model takes its own), so they are set
    here rather than by config_flags, which only overrides keys the config file holds;
    values are Python literals (`(200, 200)`, `{'groups': 10, 'depth': 6}`), else text."""
    rest, options = [argv[0]], []
    args = iter(argv[1:])
    for arg in args:
        m = _MODEL_OPTION.match(arg)
        if m is None:
            rest.append(arg)
            continue
        text = m.group(2) if m.group(2) is not None else next(args, "")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = text
        options.append((m.group(1), value))
    return rest, options


def _set_model_options(cfg: Any, options: List[Tuple[str, Any]]) -> None:
    with cfg.unlocked():
        for key, value in options:
            *parents, leaf = key.split(".")
            node = cfg.model.options
            for part in parents:
                if part not in node or not hasattr(node[part], "keys"):
                    node[part] = {}
                node = node[part]
            node[leaf] = value


def _unexpected(e: BaseException) -> int:
    path = os.path.join(tempfile.gettempdir(),
                        f"fedjax_pan-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    try:
        with open(path, "w") as f:
            traceback.print_exception(type(e), e, e.__traceback__, file=f)
        where = f"traceback in {path}"
    except OSError:
        where = "its traceback could not be saved"
    notes = "; ".join(getattr(e, "__notes__", []))
    return _error(f"unexpected {type(e).__name__}: {e}{'; ' + notes if notes else ''} "
                  f"({where})", status=1)


def main(argv: Optional[List[str]] = None) -> int:
    argv, options = _model_options(list(sys.argv if argv is None else argv))
    fv = _flags(argv)
    if _wants_help(argv):  # before anything is parsed or loaded: help is instant
        return _help(fv, argv)
    try:
        unknown = _unknown_override(argv)
        if unknown:
            return _error(unknown)
        fv(argv)
        cfg = fv.config
        if cfg is not None:
            cfg.to_json()  # config files load lazily: surface their errors here
            _set_model_options(cfg, options)
    except flags.Error as e:
        return _error(e)
    except KeyboardInterrupt:
        return _error("interrupted before the run started; nothing was written", status=130)
    except (AttributeError, KeyError) as e:  # an override naming a key the file lacks
        return _error(_missing_key(argv, e))
    except Exception as e:  # a config file raising on a bad preset or override
        return _error(f"{type(e).__name__}: {e}")
    if cfg is None or not fv.workdir:
        return _error(f"--config and --workdir are required; {USAGE}")

    from fedjax_pan.engine import distributed
    from fedjax_pan.errors import RunError
    try:  # before anything touches a JAX backend
        distributed.initialize(fv.coordinator, fv.num_processes, fv.process_id,
                               auto=fv.distributed, peer_timeout=fv.peer_timeout,
                               workdir=fv.workdir)
    except RunError as e:
        return _error(e, status=e.status)
    from fedjax_pan.run import experiment
    from fedjax_pan import workdir
    from fedjax_pan.engine.compiles import use_compilation_cache

    try:
        use_compilation_cache(fv.compilation_cache)
    except OSError as e:
        return _error(f"--compilation_cache={fv.compilation_cache!r} cannot be used: {e}",
                      status=4)
    finished = False
    try:
        # SIGINT and SIGTERM take effect at safe points (between rounds, clients, runs):
        # the run in progress saves its round. One that comes after the last safe point is
        # raised as the block ends: the command never exits 0 after a signal.
        with workdir.interrupts_at_safe_points():
            summaries = experiment.run(cfg, fv.workdir, resume=fv.resume,
                                       overwrite=fv.overwrite, progress=fv.progress)
            finished = True
            if distributed.is_primary():
                print(experiment.format_table(
                    summaries, experiment.seed_groups(experiment.variant_configs(cfg))))
                print(f"results in {fv.workdir}")
                for name, summary in summaries.items():  # FLChain: the ledger's trust anchor
                    if "ledger_anchor" in summary:
                        from fedjax_pan.algorithms.robust import ledger
                        where = (os.path.join(fv.workdir, name) if cfg.get("variants")
                                 else fv.workdir)
                        print(ledger.anchor_text(where, summary["ledger_anchor"]))
    except RunError as e:
        return _error(e, status=e.status)
    except KeyboardInterrupt as e:  # before the run claimed its workdir, or after it ended
        status = 128 + workdir.signal_number(e)
        if finished:
            return _error(f"interrupted; the results in {fv.workdir} are complete",
                          status=status)
        return _error("interrupted before the run started; nothing was written",
                      status=status)
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback to a file
        return _unexpected(e)
    return 0


def run() -> None:
    """The command line: `main` on sys.argv, exiting with its status."""
    code = main()
    if code:
        _silence_stderr()
    sys.exit(code)


if __name__ == "__main__":
    run()
