"""FedAsync's mixing and SageFlow's entropy filter, loss weights, staleness grouping and the
authors' dropping of groups of negligible weight, each on a small set worked out by hand
(and the authors' lr halving); both from a config under stragglers."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan.run import experiment
from fedjax_pan.algorithms.aggregation import staleness
from fedjax_pan.engine.protocol import Arrivals

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402


def _models(values):
    return {"params": {"w": jnp.asarray(values, jnp.float32)[:, None]}}


CURRENT = {"params": {"w": jnp.asarray([10.0])}}


def _arrivals(stale, loss=None, entropy=None, round_index=0):
    scores = {} if loss is None else {"loss": jnp.asarray(loss, jnp.float32),
                                      "entropy": jnp.asarray(entropy, jnp.float32)}
    return Arrivals(jnp.asarray(stale, jnp.int32), scores, jnp.int32(round_index), CURRENT)


def test_staleness_functions():
    s = jnp.asarray([0, 1, 3, 4, 6])
    np.testing.assert_allclose(staleness.staleness_weight("polynomial", s, a=0.5),
                               [1, 2 ** -0.5, 0.5, 5 ** -0.5, 7 ** -0.5], rtol=1e-6)
    np.testing.assert_allclose(staleness.staleness_weight("hinge", s, a=10, b=4),
                               [1, 1, 1, 1, 1 / 21], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown FedAsync"):
        staleness.fedasync(kind="linear")


@pytest.mark.reference("aggregation", "fedasync")
def test_fedasync_mixes_each_staleness_group_stalest_first_by_hand():
    # Slots: two fresh models (2, 4; weights 1, 3), one of staleness 1 (8), an empty slot.
    models = _models([2.0, 4.0, 8.0, 100.0])
    weights = jnp.asarray([1.0, 3.0, 2.0, 0.0])
    rule = staleness.fedasync(mixing=0.5, kind="polynomial", a=1.0)
    got = rule.finalize(models, weights, _arrivals([0, 0, 1, 0]))
    # Staleness 1 first: a = 0.5 * 1/2 = 0.25: x = 0.75 * 10 + 0.25 * 8 = 9.5;
    # then the fresh group's mean (2 + 3 * 4) / 4 = 3.5 with a = 0.5: 0.5 * 9.5 + 1.75.
    np.testing.assert_allclose(got["params"]["w"], [6.5], rtol=1e-6)
    assert rule.space == "model" and rule.stacked


@pytest.mark.reference("aggregation", "sageflow")
def test_sageflow_filters_weighs_and_groups_by_hand():
    models = _models([1.0, 3.0, 50.0, 6.0, 7.0])
    weights = jnp.full(5, 0.2)
    loss = [1.0, 2.0, 0.1, 4.0, 1.0]
    entropy = [0.5, 0.9, 1.5, 0.2, 2.0]  # client 2 (fresh) and 4 (stale) are dropped
    rule = staleness.sageflow(e_th=1.0, delta=1.0, lam=0.5, gamma_period=0, score=None)
    got = rule.finalize(models, weights, _arrivals([0, 0, 0, 2, 2], loss, entropy))
    # Fresh group: beta = 1/1, 1/2 -> v0 = (1 + 3/2) / 1.5 = 5/3, two accepted.
    # Staleness-2 group: client 3 alone, v2 = 6, one accepted, alpha ~ 1 * 3^-0.5.
    a0, a2 = 2.0, 3 ** -0.5
    want = (a0 * 5 / 3 + a2 * 6) / (a0 + a2)
    np.testing.assert_allclose(got["params"]["w"], [want], rtol=1e-6)
    # gamma = 0.5^(t // 20): at round 45, 1/4 of the step from the current model.
    late = staleness.sageflow(1.0, 1.0, 0.5, 20, None).finalize(
        models, weights, _arrivals([0, 0, 0, 2, 2], loss, entropy, round_index=45))
    np.testing.assert_allclose(late["params"]["w"], [0.75 * 10 + 0.25 * want], rtol=1e-6)
    # With the paper's m_k the weights enter beta and alpha: client 1 weighs 3x.
    w = jnp.asarray([0.1, 0.3, 0.2, 0.2, 0.2])
    paper = rule.finalize(models, w, _arrivals([0, 0, 0, 2, 2], loss, entropy))
    v0 = (0.1 * 1 + 0.3 / 2 * 3) / (0.1 + 0.3 / 2)
    want_m = ((0.4 * v0) + 0.2 * a2 * 6) / (0.4 + 0.2 * a2)
    np.testing.assert_allclose(paper["params"]["w"], [want_m], rtol=1e-6)
    # Everyone dropped: the model stays.
    none = rule.finalize(models, weights, _arrivals([0] * 5, loss, [5.0] * 5))
    np.testing.assert_allclose(none["params"]["w"], [10.0])


@pytest.mark.reference("aggregation", "sageflow")
def test_sageflow_drops_a_group_whose_raw_loss_weights_sum_to_at_most_0_001():
    """The authors' `Eflow` returns None when sum_k 1 / loss_k^delta <= 0.001: with delta 5
    a stale group of public loss 4 (1 / 4^5 < 0.001) is dropped, the fresh one kept."""
    models = _models([1.0, 3.0, 6.0])
    weights = jnp.full(3, 1 / 3)
    loss, entropy = [1.0, 1.0, 4.0], [0.1] * 3
    rule = staleness.sageflow(e_th=1.0, delta=5.0, lam=0.5, gamma_period=0, score=None)
    got = rule.finalize(models, weights, _arrivals([0, 0, 1], loss, entropy))
    np.testing.assert_allclose(got["params"]["w"], [2.0], rtol=1e-6)  # the fresh mean
    # min_weight 0 keeps it: alpha 2 (fresh) and 1 * 2^-0.5 (stale), each group's mean.
    keep = staleness.sageflow(1.0, 5.0, 0.5, 0, None, min_weight=0.0).finalize(
        models, weights, _arrivals([0, 0, 1], loss, entropy))
    a1 = 2 ** -0.5
    np.testing.assert_allclose(keep["params"]["w"], [(2 * 2.0 + a1 * 6.0) / (2 + a1)],
                               rtol=1e-6)
    # Every group below the bar: the model stays (the authors' code would divide by 0).
    high = rule.finalize(models, weights, _arrivals([0, 0, 1], [5.0] * 3, entropy))
    np.testing.assert_allclose(high["params"]["w"], [10.0])


def test_the_authors_lr_halving():
    """`optimizer.warmup = 'halving'` halves the client rate every warmup_length rounds (the
    SageFlow authors' `lr * 0.5 ** (round // lrdecay)`, `update.py`)."""
    import jax
    from fedjax_pan.algorithms import local
    tx = local.client_optimizer(0.01, 0.0, 0.0, None, "halving", 7)
    params = {"w": jnp.zeros(())}
    for r, want in ((0, 0.01), (6, 0.01), (7, 0.005), (20, 0.0025)):
        state = local.start_round(tx.init(params), jnp.int32(r))
        step, _ = tx.update({"w": jnp.ones(())}, state, params)
        np.testing.assert_allclose(jax.device_get(step["w"]), -want, rtol=1e-6)


# SageFlow by default; FedAsync and Zeno are checked by hand (here, test_robust.py), their
# runs from a config are slow.
@pytest.mark.parametrize("rule", ["sageflow", *(pytest.param(r, marks=pytest.mark.slow)
                                                for r in ("fedasync", "zeno"))])
def test_staleness_rules_run_from_a_config_with_stragglers(tmp_path, rule):
    run = str(tmp_path / rule)
    experiment.train(config(rounds=3, straggler__max_delay=2, aggregation__rule=rule,
                            dataset__public_size=200), run, progress=False)
    rows = metrics(run)
    assert len(rows) == 3 and all(np.isfinite(r["test_loss"]) for r in rows)
