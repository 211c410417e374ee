"""Figures of the PAN paper's alignment analyses (Sect. 5.2, Figs. 6-8).

Built on matplotlib's object API (`Figure`, no pyplot state), so they are safe in scripts,
tests and threads. Each function returns the Figure and, given `path`, also writes a PNG
there (creating parent directories).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from fedjax_pan.analysis.assignment import _as_perm, assignment_matrix, diagonal_ratio
from fedjax_pan.analysis.preference import class_agreement, neuron_classes

# The paper draws PANs off in blue and PANs on in red (Fig. 6).
_OFF_COLOR, _ON_COLOR = "tab:blue", "tab:red"


def _save(fig: Figure, path: Optional[str]) -> Figure:
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    return fig


def plot_assignment(perm_or_matrix: Any, title: str = "", path: Optional[str] = None) -> Figure:
    """Heat map of the optimal assignment matrix Q (PAN paper Fig. 7).

    Accepts a permutation (Q[i, perm[i]] = 1) or Q itself; the title ends with the
    diagonal ratio in brackets, as in the paper.
    """
    perm = _as_perm(perm_or_matrix)
    q = assignment_matrix(perm)
    fig = Figure(figsize=(4.0, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(q, cmap=ListedColormap(["white", "black"]), vmin=0, vmax=1,
              interpolation="nearest")
    ax.set_xlabel("local neuron")
    ax.set_ylabel("global neuron")
    ax.set_title(f"{title} [{diagonal_ratio(perm):.3f}]".strip())
    return _save(fig, path)


def plot_preferences(pref_global: np.ndarray, pref_local: np.ndarray, title: str = "",
                     path: Optional[str] = None, sort: bool = False) -> Figure:
    """Preference vectors of global vs local model side by side (PAN paper Fig. 8).

    Each panel is a neurons x classes image, every row scaled by its max |p| so neurons are
    comparable, with each row's argmax class marked. Rows keep their coordinates (the point
    is positional agreement) unless `sort`, which orders both panels by the global model's
    class. The title carries [#neurons whose class agrees / J].
    """
    g = np.asarray(pref_global, np.float64)
    loc = np.asarray(pref_local, np.float64)
    if g.shape != loc.shape or g.ndim != 2:
        raise ValueError(f"preference matrices must share a (J, C) shape, "
                         f"got {g.shape} and {loc.shape}")
    order = np.argsort(neuron_classes(g), kind="stable") if sort else np.arange(len(g))
    agree = int(round(class_agreement(g, loc) * len(g))) if len(g) else 0
    fig = Figure(figsize=(6.0, max(3.0, min(12.0, 0.12 * len(g) + 1.5))))
    axes = fig.subplots(1, 2, sharey=True)
    rows = np.arange(len(g))
    for ax, pref, name in zip(axes, (g, loc), ("global", "local")):
        scale = np.abs(pref).max(axis=1, keepdims=True)
        shown = np.divide(pref, scale, out=np.zeros_like(pref), where=scale > 0)[order]
        image = ax.imshow(shown, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto",
                          interpolation="nearest")
        ax.scatter(neuron_classes(pref)[order], rows, s=6, c="black", marker="o")
        ax.set_title(name)
        ax.set_xlabel("class")
    axes[0].set_ylabel("neuron" + (" (sorted by global class)" if sort else ""))
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="p / max|p|")
    fig.suptitle(f"{title} [{agree}/{len(g)}]".strip())
    return _save(fig, path)


def plot_divergence(div_off: Mapping[str, float], div_on: Mapping[str, float],
                    path: Optional[str] = None, layers: Optional[Sequence[str]] = None,
                    title: str = "Weight divergence",
                    err_off: Optional[Mapping[str, float]] = None,
                    err_on: Optional[Mapping[str, float]] = None) -> Figure:
    """Bars of per-layer weight divergence, PANs off vs on (PAN paper Fig. 6), with error
    bars where `err_off` / `err_on` (e.g. the std over seeds) are given.

    `layers` picks and orders the layers (default: div_off's order, then div_on's extras);
    a layer missing from one side is drawn as an empty slot.
    """
    if layers is None:
        layers = list(div_off) + [k for k in div_on if k not in div_off]
    layers = list(layers)
    x = np.arange(len(layers))
    width = 0.38
    fig = Figure(figsize=(max(4.0, 0.6 * len(layers) + 2.0), 3.5))
    ax = fig.add_subplot(1, 1, 1)
    for offset, values, err, label, color in (
            (-width / 2, div_off, err_off, "PANs off", _OFF_COLOR),
            (width / 2, div_on, err_on, "PANs on", _ON_COLOR)):
        heights = [float(values.get(k, np.nan)) for k in layers]
        yerr = None if err is None else [float(err.get(k, 0.0)) for k in layers]
        ax.bar(x + offset, np.nan_to_num(heights, nan=0.0), width, label=label, color=color,
               yerr=yerr, capsize=3 if yerr is not None else 0)
    ax.set_xticks(x)
    crowded = len(layers) > 6
    ax.set_xticklabels(layers, rotation=45 if crowded else 0, ha="right" if crowded else "center")
    ax.set_ylabel("divergence")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


__all__ = ["plot_assignment", "plot_preferences", "plot_divergence"]
