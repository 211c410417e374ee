"""Resuming a run: which config changes a workdir accepts, and the metrics rows it holds."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import ml_collections

from fedjax_pan import workdir as workdir_lib
from fedjax_pan.errors import ConfigError, require

__all__ = ["RESUMABLE_CHANGES", "config_changes", "check_workdir", "read_metrics"]


# Keys that may change when resuming (to extend a run or change its reporting cadence).
RESUMABLE_CHANGES = ("rounds", "eval", "checkpoint_every", "max_train_loss")


def config_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """Dotted keys whose values differ between a run's saved config and `now` (JSON
    dicts). A key the saved config lacks counts only if `now` holds it at other than its
    default: options added to the library since (a new algorithm's namespace, say) leave
    older runs resumable."""
    from fedjax_pan.config.defaults import default_config

    def walk(saved, now, default, prefix):
        out = []
        for k in sorted(set(saved) | set(now)):
            if k not in saved and k in default and now[k] == default[k]:
                continue
            if isinstance(saved.get(k), dict) and isinstance(now.get(k), dict):
                sub = default.get(k)
                out += walk(saved[k], now[k], sub if isinstance(sub, dict) else {},
                            f"{prefix}{k}.")
            elif saved.get(k) != now.get(k):
                out.append(prefix + k)
        return out
    return walk(saved, now, json.loads(default_config().to_json()), "")


def check_workdir(cfg: ml_collections.ConfigDict, workdir: str, *, resume: bool,
                  overwrite: bool) -> None:
    """Everything about `workdir` that can refuse the run, checked before any data loads."""
    workdir_lib.check(workdir, resume=resume, overwrite=overwrite)
    if not resume:
        return
    saved = workdir_lib.read_config(workdir)
    now = json.loads(cfg.to_json())
    changed = sorted(k for k in config_changes(saved, now)
                     if k.split(".")[0] not in RESUMABLE_CHANGES)
    require(not changed, f"cannot resume {workdir!r} with a different config "
            f"(changed: {', '.join(changed)}); only {', '.join(RESUMABLE_CHANGES)} may change")
    subdirs = [os.path.join(workdir, name) for name in (cfg.get("variants") or {})]
    for d in [workdir] + [d for d in subdirs if os.path.isdir(d)]:
        done = max(workdir_lib.saved_rounds(d), default=0)
        require(cfg.rounds >= done, f"cannot resume {d!r} with rounds={cfg.rounds}: it has run "
                f"{done} rounds already; pass --config.rounds={done} or more")


def read_metrics(path: str, up_to_round: int) -> List[Dict[str, Any]]:
    """The rows of `path` up to `up_to_round`; ConfigError naming the line when one is cut
    short (a crash or a full disk) and nothing else holds the rows."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ConfigError(
                    f"line {n} of {path} is cut short and the checkpoint to resume from "
                    f"(written by an older version) holds no copy of the metrics: delete that "
                    f"line and the ones after it to resume without their rounds, or start "
                    f"again with --overwrite") from None
    return [r for r in rows if r["round"] <= up_to_round]
