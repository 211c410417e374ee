"""Alignment figures (PAN paper Figs. 6-8) and run curves write non-empty PNGs."""

import numpy as np
from matplotlib.figure import Figure

from fedjax_pan.analysis import plot_assignment, plot_divergence, plot_preferences

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 100 and data[:8] == PNG_MAGIC


def test_plot_assignment(tmp_path):
    path = tmp_path / "nested" / "assign.png"
    fig = plot_assignment([0, 2, 1, 3], "conv5", path=str(path))
    assert isinstance(fig, Figure) and _is_png(path)
    assert "[0.500]" in fig.axes[0].get_title()  # 2 of 4 on the diagonal
    fig = plot_assignment(np.eye(3, dtype=int)[[1, 0, 2]], "matrix")
    assert "[0.333]" in fig.axes[0].get_title()


def test_plot_preferences(tmp_path):
    rng = np.random.default_rng(0)
    pref_g = rng.normal(size=(12, 5))
    pref_l = pref_g.copy()
    pref_l[:3] = -pref_l[:3]  # flips those rows' argmax (barring ties, not in this draw)
    path = tmp_path / "a" / "b" / "pref.png"
    fig = plot_preferences(pref_g, pref_l, "conv6", path=str(path))
    assert _is_png(path)
    agree = int(np.sum(pref_g.argmax(1) == pref_l.argmax(1)))
    assert f"[{agree}/12]" in fig.get_suptitle()
    path2 = tmp_path / "pref_sorted.png"
    plot_preferences(pref_g, pref_l, "sorted", path=str(path2), sort=True)
    assert _is_png(path2)


def test_plot_divergence(tmp_path):
    path = tmp_path / "div" / "fig6.png"
    fig = plot_divergence({"fc1": 1.0, "fc2": 2.0, "head": 0.5},
                          {"fc1": 0.4, "fc2": 0.8}, path=str(path))
    assert isinstance(fig, Figure) and _is_png(path)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["fc1", "fc2", "head"]


def test_curves_fall_back_to_a_linear_loss_axis_without_a_positive_loss(tmp_path):
    import warnings

    from fedjax_pan.run import reporting
    rows = [{"round": r, "test_accuracy": 0.1 * r, "train_loss": loss}
            for r, loss in ((1, 0.0), (2, 0.0))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns on a log axis with no positive value
        reporting.plot_curves({"collecting": rows}, str(tmp_path / "flat.png"))
        reporting.plot_curves({"run": [{**r, "train_loss": 1.0 / r["round"]} for r in rows]},
                              str(tmp_path / "log.png"))
    assert (tmp_path / "flat.png").stat().st_size > 0 and (tmp_path / "log.png").exists()
