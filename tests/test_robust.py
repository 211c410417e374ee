"""Robust aggregation rules: Krum and Multi-Krum on a hand-solved set, the geometric median
against a plain NumPy Weiszfeld (RFA's loop) and against sets whose median is known, and
the rules from a config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan.algorithms.aggregation import robust

# Five clients on a line, 0, 1, 2 near each other and 10, 11 far off; the output is a
# tree of two leaves (the coordinate split 1 + 1 with a zero second part) so distances
# must add over leaves.
POINTS = np.array([0.0, 1.0, 2.0, 10.0, 11.0])


def _tree(values):
    v = jnp.asarray(values, jnp.float32)
    return {"a": v[:, None], "b": {"c": jnp.zeros((len(values), 2, 2))}}


@pytest.mark.reference("aggregation", "multi_krum")
def test_krum_scores_and_choice_by_hand():
    # f = 1: each client sums its 5 - 1 - 2 = 2 nearest squared distances.
    # 0: 1 + 4; 1: 1 + 1; 2: 1 + 4; 10: 1 + 64; 11: 1 + 81.
    np.testing.assert_allclose(robust.krum_scores(_tree(POINTS), 1), [5, 2, 5, 65, 82])
    w = jnp.asarray([3.0, 1.0, 1.0, 1.0, 1.0]) / 7
    krum = robust.multi_krum(1, keep=1).finalize(_tree(POINTS), w)
    np.testing.assert_allclose(krum["a"], [1.0])  # the best-scored client alone
    # m = 3 keeps 0, 1, 2 and averages them with their weights renormalised: 3:1:1.
    multi = robust.multi_krum(1, keep=3).finalize(_tree(POINTS), w)
    np.testing.assert_allclose(multi["a"], [(0 * 3 + 1 + 2) / 5], rtol=1e-6)
    np.testing.assert_array_equal(multi["b"]["c"], np.zeros((2, 2)))
    # The default m = M - f = 4 drops the worst (11) only.
    default = robust.multi_krum(1).finalize(_tree(POINTS), w)
    np.testing.assert_allclose(default["a"], [(0 * 3 + 1 + 2 + 10) / 6], rtol=1e-6)


def test_multi_krum_without_byzantine_clients_is_the_weighted_mean():
    rng = np.random.default_rng(0)
    outs = {"w": jnp.asarray(rng.normal(size=(6, 3, 4)), jnp.float32)}
    w = jnp.asarray(rng.uniform(0.5, 2.0, size=6), jnp.float32)
    got = robust.multi_krum(0).finalize(outs, w / jnp.sum(w))
    want = np.tensordot(np.asarray(w / jnp.sum(w)), np.asarray(outs["w"]), axes=1)
    np.testing.assert_allclose(got["w"], want, rtol=1e-5, atol=1e-6)


def test_multi_krum_clips_a_round_of_too_few_clients():
    # A config with n <= f + 2 clients a round is refused (`krum_kept`, the rule's check);
    # a round that has that few (Poisson sampling, late clients) scores each client on
    # its one nearest (here all 1: ties to the lower index) and keeps clip(n - f, 1, n).
    with pytest.raises(ValueError, match="more than f \\+ 2 clients"):
        robust.krum_kept(5, 3)
    got = robust.multi_krum(3).finalize(_tree(POINTS), jnp.full(5, 0.2))
    np.testing.assert_allclose(got["a"], [0.5])  # clients 0 and 1
    with pytest.raises(ValueError, match="f >= 0"):
        robust.multi_krum(-1)


def _weiszfeld_numpy(points, alphas, maxiter=4, eps=1e-5, ftol=1e-6):
    """RFA's `geometric_median` (krishnap25/RFA), written out in NumPy float64."""
    alphas = np.asarray(alphas, np.float64) / np.sum(alphas)

    def objective(v):
        return sum(a * np.linalg.norm(v - p) for a, p in zip(alphas, points))
    median = np.tensordot(alphas, points, axes=1)
    obj = objective(median)
    for _ in range(maxiter):
        prev = obj
        weights = np.asarray([a / max(eps, np.linalg.norm(median - p))
                              for a, p in zip(alphas, points)])
        median = np.tensordot(weights / weights.sum(), points, axes=1)
        obj = objective(median)
        if abs(prev - obj) < ftol * obj:
            break
    return median


@pytest.mark.reference("aggregation", "geometric_median")
@pytest.mark.parametrize("maxiter,ftol", [(4, 1e-6), (50, 0.0), (50, 1e-3)])
def test_geometric_median_against_rfas_loop(maxiter, ftol):
    rng = np.random.default_rng(1)
    points = rng.normal(size=(7, 5))
    points[6] += 40.0  # an outlier
    alphas = rng.integers(50, 500, size=7).astype(np.float64)
    tree = {"x": jnp.asarray(points[:, :2], jnp.float32),
            "y": jnp.asarray(points[:, 2:].reshape(7, 3, 1), jnp.float32)}
    got = robust.geometric_median(maxiter, 1e-5, ftol).finalize(
        tree, jnp.asarray(alphas / alphas.sum(), jnp.float32))
    want = _weiszfeld_numpy(points, alphas, maxiter, 1e-5, ftol)
    flat = np.concatenate([np.ravel(got["x"]), np.ravel(got["y"])])
    np.testing.assert_allclose(flat, want, rtol=1e-4, atol=1e-5)
    mean = np.tensordot(alphas / alphas.sum(), points, axes=1)
    assert np.linalg.norm(flat - np.median(points[:6], axis=0)) < 0.5 * np.linalg.norm(
        mean - np.median(points[:6], axis=0))  # the outlier pulls the mean, not the median


def test_geometric_median_of_known_sets():
    # Symmetric about c: the median is c.
    c = np.array([1.0, -2.0, 0.5])
    offsets = np.array([[1, 0, 0], [-1, 0, 0], [0, 3, 0], [0, -3, 0], [0, 0, 2], [0, 0, -2]])
    sym = {"v": jnp.asarray(c + offsets, jnp.float32)}
    got = robust.geometric_median().finalize(sym, jnp.full(6, 1 / 6))
    np.testing.assert_allclose(got["v"], c, atol=1e-5)
    # Three points on a line, one far off: the median is the middle point (Weiszfeld
    # converges to it; the mean sits at 33.7).
    line = {"v": jnp.asarray([[0.0], [1.0], [100.0]], jnp.float32)}
    got = robust.geometric_median(maxiter=100, ftol=0.0).finalize(line, jnp.full(3, 1 / 3))
    assert abs(float(got["v"][0]) - 1.0) < 1e-2


def test_rules_from_a_config_run_and_bad_ones_are_named():
    from fedjax_pan.run import experiment
    from fedjax_pan.errors import ConfigError
    from test_experiment import config
    for rule in ("multi_krum", "geometric_median"):
        exp = experiment.build(config(rounds=1, aggregation__rule=rule,
                                      aggregation__byzantine=int(rule == "multi_krum")))
        state, stats = exp.simulation.round(exp.simulation.init(exp.variables))
        assert np.isfinite(stats["train_loss"])
        assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(state.server))
    # The smoke preset samples 4 of 20 clients: Krum needs 4 > f + 2, Zeno 4 > b.
    with pytest.raises(ConfigError, match="aggregation.byzantine = 2"):
        experiment.build(config(aggregation__rule="multi_krum", aggregation__byzantine=2))
    for b in (4, 100):
        with pytest.raises(ConfigError, match=rf"aggregation.byzantine={b} with aggregation"
                                              r".rule='zeno' \(4 clients a round\)"):
            experiment.build(config(aggregation__rule="zeno", aggregation__byzantine=b))
    with pytest.raises(ConfigError, match="aggregation.byzantine=1 is not used by "
                                          "aggregation.rule='geometric_median'"):
        experiment.build(config(aggregation__rule="geometric_median", aggregation__byzantine=1))


@pytest.mark.parametrize("rule,b", [("multi_krum", 1), ("zeno", 3)])
def test_rounds_of_fewer_clients_than_the_rule_tolerates_are_clipped(rule, b):
    # Poisson sampling draws 1 to 7 of the nominal 4 a round (rounds 3 and 4: 2 and 1):
    # Multi-Krum scores on one neighbour at least and keeps one at least, Zeno keeps
    # its best one; the run goes on.
    from fedjax_pan.run import experiment
    from test_experiment import config
    exp = experiment.build(config(rounds=5, sampling="poisson", aggregation__rule=rule,
                                  aggregation__byzantine=b))
    sim = exp.simulation
    assert [len(sim.sample(t)) for t in range(5)] == [5, 7, 5, 2, 1]
    state = sim.init(exp.variables)
    for _ in range(5):
        state, stats = sim.round(state)
        assert np.isfinite(stats["train_loss"])
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(state.server))


def test_multi_krum_and_zeno_clip_by_hand():
    # Two clients present where f = 1 needs four: each is scored on its one neighbour
    # (equal scores: the lower index wins) and m = clip(2 - 1, 1, 2) = 1 is kept, in a
    # stack of two or among empty slots.
    two = _tree([0.0, 10.0])
    w = jnp.asarray([0.5, 0.5])
    np.testing.assert_allclose(robust.multi_krum(1).finalize(two, w)["a"], [0.0])
    slots = _tree([7.0, 0.0, 7.0, 10.0])
    w_slots = jnp.asarray([0.0, 0.5, 0.0, 0.5])
    np.testing.assert_allclose(robust.multi_krum(1).finalize(slots, w_slots)["a"], [0.0])
    with pytest.raises(ValueError, match="Krum needs more than f \\+ 2 clients a round"):
        robust.krum_kept(2, 1)
    with pytest.raises(ValueError, match="needs 0 <= b < n: 4 clients, b = 4"):
        robust.zeno_kept(4, 4)


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "multi_krum", "geometric_median"])
def test_empty_slots_are_ignored(name):
    # Slots of outputs not arrived weigh 0 and hold anything (here huge values): the rule
    # gives what it gives on the present outputs alone.
    from fedjax_pan.algorithms.aggregation.coordinate import median, trimmed_mean
    rule = {"median": median(), "trimmed_mean": trimmed_mean(0.2),
            "multi_krum": robust.multi_krum(1), "geometric_median": robust.geometric_median()}[name]
    rng = np.random.default_rng(1)
    present = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)}
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=6), jnp.float32)
    with_slots = {"w": jnp.concatenate([present["w"][:2], jnp.full((3, 3), 1e6),
                                        present["w"][2:]])}
    w_slots = jnp.concatenate([w[:2], jnp.zeros(3), w[2:]])
    alone = rule.finalize(present, w / jnp.sum(w))
    slots = rule.finalize(with_slots, w_slots / jnp.sum(w_slots))
    np.testing.assert_allclose(slots["w"], alone["w"], rtol=1e-5, atol=1e-6)
    if name == "median":  # and the median is jnp.median's to the bit
        np.testing.assert_array_equal(alone["w"], jnp.median(present["w"], axis=0))


def test_public_scorer_by_hand():
    import flax.linen as nn

    class Linear(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3, use_bias=False)(x.reshape(x.shape[0], -1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 2, 1, 1)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 2])
    kernel = rng.normal(size=(2, 3)).astype(np.float32)
    logits = x.reshape(7, 2) @ kernel
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want_loss = -logp[np.arange(7), y].mean()
    want_entropy = -(np.exp(logp) * logp).sum(1).mean()
    score = robust.public_scorer(Linear(), x, y, batch_size=3)  # batches 3, 3, 1 (+2 masked)
    got = score({"params": {"Dense_0": {"kernel": jnp.asarray(kernel)}}})
    np.testing.assert_allclose(float(got["loss"]), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(got["entropy"]), want_entropy, rtol=1e-5)


@pytest.mark.reference("aggregation", "zeno")
def test_zeno_keeps_the_models_that_descend_most_by_hand():
    from fedjax_pan.engine.protocol import Arrivals
    # A scorer whose loss is |w - 3| on a one-parameter model; the current model is 0.
    score = lambda v: {"loss": jnp.abs(v["params"]["w"][0] - 3.0)}  # noqa: E731
    models = {"params": {"w": jnp.asarray([[2.0], [3.5], [-4.0], [9.0]])}}
    scores = {"loss": jnp.asarray([1.0, 0.5, 7.0, 6.0])}
    current = {"params": {"w": jnp.asarray([0.0])}}
    weights = jnp.asarray([0.25, 0.25, 0.25, 0.25])
    arrivals = Arrivals(jnp.zeros(4, jnp.int32), scores, jnp.int32(0), current)
    # Zeno scores with rho = 0.1: 3 - 1 - 0.4 = 1.6; 3 - 0.5 - 1.225 = 1.275;
    # 3 - 7 - 1.6 = -5.6; 3 - 6 - 8.1 = -11.1. Keep n - b = 2: clients 0 and 1.
    got = robust.zeno(2, 0.1, score).finalize(models, weights, arrivals)
    np.testing.assert_allclose(got["params"]["w"], [2.75])
    # With a large rho the step dominates: 1.6 - ... client 0 (step 4) beats 1 (12.25).
    got = robust.zeno(3, 1.0, score).finalize(models, weights, arrivals)
    np.testing.assert_allclose(got["params"]["w"], [2.0])
    # Two present (clients 1 and 2) where b = 2 would keep none: the better one (1) is.
    few = jnp.asarray([0.0, 0.5, 0.5, 0.0])
    got = robust.zeno(2, 0.1, score).finalize(models, few, arrivals)
    np.testing.assert_allclose(got["params"]["w"], [3.5])
