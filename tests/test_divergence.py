"""Weight divergence (PAN paper Fig. 6) against hand-computed values; the advice a diverged
run gives."""

import math
import os
import sys

import jax
import numpy as np
import pytest

from fedjax_pan import models
from fedjax_pan.analysis import weight_divergence
from fedjax_pan.config import defaults
from fedjax_pan.run import experiment, training

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config  # noqa: E402


def _tree(kernel, bias, head):
    return {"fc": {"kernel": np.array([kernel], np.float32), "bias": np.array(bias, np.float32)},
            "head": {"kernel": np.array([[head]], np.float32)}}


A = _tree([0.0, 0.0], [0.0], 1.0)
B = _tree([2.0, 0.0], [2.0], 3.0)
C = _tree([1.0, 3.0], [1.0], 2.0)


def test_two_clients_by_hand():
    # mean fc = kernel [1, 0], bias [1]: both deviations are (+-1, 0, +-1) -> sqrt(2).
    # head mean 2: deviations 1 and 1 -> 1.
    div = weight_divergence([A, B])
    assert div == pytest.approx({"fc": math.sqrt(2.0), "head": 1.0})


def test_three_clients_by_hand():
    # mean fc = kernel [1, 1], bias [1]; deviations A (-1,-1,-1), B (1,-1,1), C (0,2,0).
    div = weight_divergence([A, B, C])
    assert div["fc"] == pytest.approx((2 * math.sqrt(3.0) + 2.0) / 3.0)
    assert div["head"] == pytest.approx(2.0 / 3.0)  # deviations 1, 1, 0
    kernels = weight_divergence([A, B, C], leaf="kernel")
    assert kernels["fc"] == pytest.approx((2 * math.sqrt(2.0) + 2.0) / 3.0)
    assert kernels["head"] == pytest.approx(2.0 / 3.0)


def test_reference_by_hand():
    ref = _tree([0.0, 1.0], [0.0], 0.0)
    # A - ref = (0, -1, 0) -> 1; B - ref = (2, -1, 2) -> 3; head: 1 and 3.
    assert weight_divergence([A, B], reference=ref) == pytest.approx({"fc": 2.0, "head": 2.0})


def test_leaf_option_skips_layers_without_it():
    div = weight_divergence([A, B], leaf="bias")
    assert div == pytest.approx({"fc": 1.0})  # bias deviations -1, +1


def test_list_and_stacked_and_variables_agree():
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), A, B, C)
    expected = {"fc": (2 * math.sqrt(3.0) + 2.0) / 3.0, "head": 2.0 / 3.0}
    assert weight_divergence(stacked) == pytest.approx(expected)
    assert weight_divergence({"params": stacked}) == pytest.approx(expected)
    assert weight_divergence([{"params": t} for t in (A, B, C)]) == pytest.approx(expected)


def test_identical_clients_have_zero_divergence():
    model = models.build("mlp", 10, hidden=[16, 8])
    params = models.init(model, jax.random.PRNGKey(0), (4, 4, 1))["params"]
    div = weight_divergence([params, params, params])
    assert set(div) == set(params)
    assert all(v == 0.0 for v in div.values())


def test_mismatched_reference_rejected():
    with pytest.raises(ValueError):
        weight_divergence([A, B], reference=_tree([0.0, 1.0, 2.0], [0.0], 0.0))


def _config(**changes):
    return defaults.set_keys(defaults.default_config(),
                             {k.replace("__", "."): v for k, v in changes.items()})


def test_divergence_advice_names_noise_and_attacks_first():
    lr = "lower optimizer.lr or optimizer.grad_clip"
    assert training._divergence_advice(_config()) == lr
    # Clipping alone adds no noise; an attack names its scale, the kind's default if unset.
    cfg = _config(algorithm="fedprox", fedprox__mu=0.5, privacy__clip=0.1,
                  privacy__noise_multiplier=2.0, attack__kind="sign_flip")
    assert training._divergence_advice(cfg) == (
        "check privacy.noise_multiplier=2 (noise of std 2 x privacy.clip=0.1 on the updates' "
        "sum), attack.scale=4 (sign_flip's default) with attack.fraction=0.2, fedprox.mu=0.5 "
        f"(changed from the default), or {lr}")
    cfg = _config(privacy__clip=0.1, attack__kind="gaussian", attack__scale=30.0,
                  attack__fraction=0.5)
    assert training._divergence_advice(cfg) == (
        f"check attack.scale=30 (gaussian) with attack.fraction=0.5, or {lr}")
    assert training._divergence_advice(_config(attack__kind="label_flip")) == (
        f"check attack.kind='label_flip' with attack.fraction=0.2, or {lr}")


def test_a_run_diverging_under_dp_noise_names_the_noise_first(tmp_path):
    cfg = config(rounds=1, max_train_loss=0.01, privacy__clip=0.05,
                 privacy__noise_multiplier=50.0, model__options={"hidden": [16]},
                 dataset__train_limit=1000)
    with pytest.raises(experiment.TrainingDiverged,
                       match=r"nothing was kept; check privacy.noise_multiplier=50 \(noise of "
                             r"std 50 x privacy.clip=0.05 on the updates' sum\), or lower "
                             r"optimizer.lr or optimizer.grad_clip$"):
        experiment.train(cfg, str(tmp_path / "w"), progress=False)
