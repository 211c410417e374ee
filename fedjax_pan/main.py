"""Command line: python -m fedjax_pan.main --config=FILE[:preset] [--config.KEY=VALUE ...] --workdir=DIR

Runs a config (or each of its variants) into DIR. A non-empty DIR is refused unless
--resume (continue from its last checkpoint) or --overwrite. Invalid input prints one
`error:` line and exits with status 2; a diverged run (NaN loss) exits with status 3.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from absl import flags
from ml_collections import config_flags

USAGE = ("usage: python -m fedjax_pan.main --config=configs/FILE.py[:preset] "
         "[--config.KEY=VALUE ...] --workdir=DIR [--resume | --overwrite] [--noprogress]")


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "ml_collections config file[:preset]",
                                    flag_values=fv, lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory", flag_values=fv)
    flags.DEFINE_bool("resume", False, "continue from the workdir's last checkpoint",
                      flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty workdir", flag_values=fv)
    flags.DEFINE_bool("progress", True, "show a progress bar", flag_values=fv)
    return fv


def _error(message, status: int = 2) -> int:
    text = str(message)
    if "Traceback" in text:  # config_flags embeds the config file's traceback: keep its cause
        text = [line for line in text.splitlines() if line.strip()][-1]
    print(f"error: {' '.join(text.split())}", file=sys.stderr)
    return status


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    fv = _flags()
    try:
        fv(argv)
        cfg = fv.config
        if cfg is not None:
            cfg.to_json()  # config files load lazily: surface their errors here
    except flags.Error as e:
        return _error(e)
    except Exception as e:  # a config file raising on a bad preset or override
        return _error(f"{type(e).__name__}: {e}")
    if cfg is None or not fv.workdir:
        return _error(f"--config and --workdir are required; {USAGE}")

    from fedjax_pan import experiment  # heavy imports only once the flags are valid

    try:
        summaries = experiment.run(cfg, fv.workdir, resume=fv.resume,
                                   overwrite=fv.overwrite, progress=fv.progress)
    except experiment.ConfigError as e:
        return _error(e)
    except experiment.TrainingDiverged as e:
        return _error(e, status=3)
    print(experiment.format_table(summaries))
    print(f"results in {fv.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
