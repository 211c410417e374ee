"""What a run reports: its summary, curves, and multi-seed comparisons paired by seed."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Optional

import ml_collections
import numpy as np

__all__ = ["finite", "json_text", "summarize", "plot_curves", "seed_groups", "paired_stats",
           "compare_groups", "format_table"]


def finite(obj: Any) -> Any:
    """`obj` (dicts, lists, tuples, numbers) with each NaN or infinite float as None: JSON
    has no value for them (`dp_epsilon` is infinite without noise). TensorBoard's scalars
    keep them."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def json_text(obj: Any, indent: Optional[int] = None) -> str:
    """`obj` as strict JSON (no NaN or Infinity tokens): non-finite floats become null."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def summarize(rows: List[Dict[str, Any]], last: int = 5) -> Dict[str, float]:
    """Final accuracy = mean test accuracy of the last `last` evaluations (paper Fig. 10)."""
    acc = [r["test_accuracy"] for r in rows]
    out = {"final_accuracy": float(np.mean(acc[-last:])) if acc else float("nan"),
           "best_accuracy": float(np.max(acc)) if acc else float("nan"),
           "final_loss": float(np.mean([r["test_loss"] for r in rows[-last:]])) if rows else
           float("nan")}
    own = [r["pfl_accuracy"] for r in rows if "pfl_accuracy" in r]
    if own:  # each client on its own test part (a personalised algorithm's own result)
        out["final_pfl_accuracy"] = float(np.mean(own[-last:]))
    return out


def plot_curves(runs: Dict[str, List[Dict[str, Any]]], path: str, title: str = "",
                groups: Optional[Dict[str, Dict[int, str]]] = None) -> None:
    """Test accuracy and training loss per round: one line per run, or with `groups`
    ({group: {seed: run}}) the mean over a group's runs with a band from min to max."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_acc, ax_loss = fig.subplots(1, 2)
    groups = groups or {name: {0: name} for name in runs}
    positive_loss = False
    for group, members in groups.items():
        rows = [runs[name] for name in members.values()]
        n = min(len(r) for r in rows)
        if n == 0:
            continue
        rounds = [r["round"] for r in rows[0][:n]]
        label = group if len(rows) == 1 else f"{group} (mean of {len(rows)} seeds)"
        for ax, key, scale in ((ax_acc, "test_accuracy", 100.0), (ax_loss, "train_loss", 1.0)):
            v = scale * np.asarray([[r[key] for r in run[:n]] for run in rows], np.float64)
            line, = ax.plot(rounds, v.mean(axis=0), label=label)
            positive_loss |= key == "train_loss" and bool(np.any(v > 0))
            if len(rows) > 1:
                ax.fill_between(rounds, v.min(axis=0), v.max(axis=0), alpha=0.2,
                                color=line.get_color())
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    # A log axis needs a positive value (a run whose rounds only collect statistics has none).
    ax_loss.set(xlabel="round", ylabel="training loss",
                yscale="log" if positive_loss else "linear")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def seed_groups(configs: Dict[str, ml_collections.ConfigDict]) -> Dict[str, Dict[int, str]]:
    """Variants named `<group>_s<seed>` (the seed their config runs with) gathered as
    {group: {seed: variant}}, in order of first appearance; any other variant is a group
    of its own."""
    out: Dict[str, Dict[int, str]] = {}
    for name, c in configs.items():
        m = re.fullmatch(r"(.+)_s(\d+)", name)
        group = m.group(1) if m and int(m.group(2)) == c.seed else name
        out.setdefault(group, {})[int(c.seed)] = name
    return out


def paired_stats(off: List[float], on: List[float]) -> Dict[str, float]:
    """Mean and std (ddof 0) of `off` and `on` and of the paired difference on - off (element
    i of each from the same seed); NaN entries (diverged runs) drop their pair."""
    a, b = np.asarray(off, np.float64), np.asarray(on, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {a.size} and {b.size}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    stat = (lambda v: (float(v.mean()), float(v.std()))) if ok.any() else (
        lambda v: (float("nan"), float("nan")))
    (om, osd), (nm, nsd), (dm, dsd) = stat(a), stat(b), stat(b - a)
    return {"off_mean": om, "off_std": osd, "on_mean": nm, "on_std": nsd,
            "diff_mean": dm, "diff_std": dsd, "pairs": int(ok.sum())}


def compare_groups(summaries: Dict[str, Dict[str, Any]],
                   groups: Dict[str, Dict[int, str]]) -> List[Dict[str, Any]]:
    """Per group: mean and std (ddof 0) of the final accuracy over its seeds, and the
    difference to the first group (the reference) paired by seed, with its std."""
    ref = next(iter(groups.values()))
    out = []
    for group, members in groups.items():
        acc = np.asarray([summaries[v]["final_accuracy"] for v in members.values()])
        common = [seed for seed in members if seed in ref]
        paired = paired_stats([summaries[ref[seed]]["final_accuracy"] for seed in common],
                              [summaries[members[seed]]["final_accuracy"] for seed in common])
        out.append({"group": group, "seeds": sorted(members), "mean": float(acc.mean()),
                    "std": float(acc.std()), "diff_mean": paired["diff_mean"],
                    "diff_std": paired["diff_std"], "pairs": paired["pairs"]})
    return out


def format_table(summaries: Dict[str, Dict[str, Any]],
                 groups: Optional[Dict[str, Dict[int, str]]] = None) -> str:
    """A small plain-text comparison table; with `groups` (`seed_groups`) of several seeds,
    also each group's mean +- std over seeds and its difference to the first group paired
    by seed."""
    width = max([12, *(len(n) for n in summaries)])
    # Clients scored on their own test parts: a personalised algorithm's result, beside
    # the global model's (KT-pFL's is its initial one).
    own = any("final_pfl_accuracy" in s for s in summaries.values())
    head = (f"{'variant':<{width}} {'final acc (last 5)':>18} {'best acc':>9} "
            + (f"{'own test (last 5)':>18} " if own else "") + f"{'rounds':>6} {'time':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        mine = (f"{100 * s['final_pfl_accuracy']:>17.2f}% " if "final_pfl_accuracy" in s
                else f"{'-':>18} ") if own else ""
        lines.append(f"{name:<{width}} {100 * s['final_accuracy']:>17.2f}% "
                     f"{100 * s['best_accuracy']:>8.2f}% {mine}{s['rounds']:>6} "
                     f"{s['wall_seconds']:>7.0f}s")
    if groups and any(len(m) > 1 for m in groups.values()):
        table = compare_groups(summaries, groups)
        ref = table[0]["group"]
        lines.append("")
        lines.append(f"mean +- std over seeds; difference to {ref} paired by seed:")
        for r in table:
            diff = ("" if r["group"] == ref else
                    f"   {r['group']} - {ref}: {100 * r['diff_mean']:+.2f} +- "
                    f"{100 * r['diff_std']:.2f} points ({r['pairs']} pairs)")
            lines.append(f"{r['group']:<{width}} {100 * r['mean']:>6.2f}% +- "
                         f"{100 * r['std']:.2f}{diff}")
    return "\n".join(lines)
