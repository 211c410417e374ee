"""MOON: the contrastive term by hand, mu = 0 is FedAvg, the previous models clients keep,
execution strategies agree, training works, and the memory the stored models take."""

import functools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, random_variables, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms import ClientContext, client_optimizer, fedavg
from fedjax_pan.algorithms.fedavg_family.moon import (ENTRY, ClientState, contrastive_loss, moon,
                                        state_bytes)
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.execution import Cohort
from fedjax_pan.engine.reference import reference_round

SIZES = [27, 39, 19, 36, 62, 13]
WORK = LocalWork(batch_size=8, epochs=1.5)
SHAPE = (6, 6, 1)
TX = client_optimizer(0.05, 0.9, 1e-5, 100.0)
WARM_TX = client_optimizer(0.05, 0.9, 1e-5, 100.0, "steps", 3)
tree_map = jax.tree_util.tree_map


@functools.lru_cache(maxsize=None)
def _setup():
    """Data, a tiny MLP and He-scaled weights (the N(0, 0.01) init barely trains in a few
    rounds), built once: every executor below compiles its own programs."""
    ds, cd = tiny_clients(SIZES)
    model = models.build("mlp", 10, hidden=[24, 16])
    return ds, cd, model, random_variables(model, SHAPE, seed=0)


@functools.lru_cache(maxsize=None)
def _algo(mu):
    model = _setup()[2]
    if mu is None:
        return fedavg(model, WARM_TX)
    return moon(model, WARM_TX, mu=mu)


@functools.lru_cache(maxsize=None)
def _executor(mu, strategy, block_size=None):
    _, cd, _, variables = _setup()
    return make_executor(strategy, _algo(mu), WORK, cd, variables, 3, block_size=block_size)


def _simulation(mu, strategy, block_size=None, seed=1):  # cohorts [1 2 4], then [1 2 5]
    return Simulation(_algo(mu), _setup()[1], WORK, _executor(mu, strategy, block_size),
                      participation=0.5, seed=seed)


@functools.lru_cache(maxsize=None)
def _rounds(mu, strategy, block_size=None, rounds=2):
    """Host copies of the state after each round, and the rounds' statistics."""
    sim = _simulation(mu, strategy, block_size)
    state, states, stats = sim.init(_setup()[3]), [], []
    for _ in range(rounds):
        state, s = sim.round(state)
        # Copy: the next round's scatter donates (overwrites) the stored client states.
        states.append(tree_map(np.array, state))
        stats.append(s)
    return states, stats


def _cos(a, b):
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _l_con(z, z_glob, z_prev, tau):
    """Eq. 3 per example, literally."""
    pos, neg = np.exp(_cos(z, z_glob) / tau), np.exp(_cos(z, z_prev) / tau)
    return -np.log(pos / (pos + neg))


@pytest.mark.reference("algorithm", "moon")
def test_contrastive_term_matches_the_formula():
    # One example by hand: sim(z, z_glob) = 1, sim(z, z_prev) = 0, tau = 0.5.
    one = contrastive_loss(jnp.asarray([[3.0, 0.0]]), jnp.asarray([[0.5, 0.0]]),
                           jnp.asarray([[0.0, 2.0]]), jnp.ones(1), 0.5)
    assert float(one) == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)

    rng = np.random.default_rng(0)
    z, z_glob, z_prev = (rng.normal(size=(5, 7)).astype(np.float32) for _ in range(3))
    z[4] = 0.0  # a padded row of all-zero features: masked out, and must stay finite
    mask = np.asarray([1, 1, 0, 1, 0], np.float32)
    want = np.sum(_l_con(z[:4], z_glob[:4], z_prev[:4], 0.3) * mask[:4]) / 3
    got = contrastive_loss(z, z_glob, z_prev, mask, 0.3)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    # The cosine similarity ignores scale; the gradient is finite despite the zero row.
    scaled = contrastive_loss(4.0 * z, z_glob, 0.1 * z_prev, mask, 0.3)
    assert float(scaled) == pytest.approx(float(want), rel=1e-5)
    grad = jax.grad(lambda v: contrastive_loss(v, z_glob, z_prev, mask, 0.3))(jnp.asarray(z))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[[2, 4]] == 0.0)


@pytest.mark.reference("algorithm", "moon")
def test_one_step_is_sgd_on_ce_plus_mu_times_the_term():
    """A step's metric and update against an independent loss built from the sown features
    of the three models (local: trained; global: the broadcast; previous: client state)."""
    _, _, model, variables = _setup()
    mu, tau, lr = 2.0, 0.5, 0.1
    algo = moon(model, optax.sgd(lr), mu=mu, tau=tau)
    server = algo.server_init(variables)
    shift = lambda p, s: tree_map(lambda x: x + s * jnp.sign(x) * 0.05, p)  # noqa: E731
    prev, start = shift(server.params, -1.0), shift(server.params, 1.0)
    ctx = ClientContext(jax.random.PRNGKey(0), 1, 5, 0, 0, jnp.zeros(10))
    local = algo.client_init(server, ClientState(prev, None), ctx)
    local = local._replace(train=local.train._replace(params=start))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, *SHAPE)).astype(np.float32)
    x[4] = 100.0  # a padded row: must change nothing
    batch = {"x": jnp.asarray(x), "y": jnp.asarray([1, 4, 2, 7, 0], jnp.int32),
             "mask": jnp.asarray([1, 1, 1, 1, 0], jnp.float32)}
    new, metrics = jax.jit(algo.client_step)(local, batch, server)

    real = x[:4]
    feats = lambda p: np.asarray(models.apply_with_intermediates(  # noqa: E731
        model, {"params": p}, real)[1]["features"])
    z_glob, z_prev = feats(server.params), feats(prev)
    want = np.mean(_l_con(feats(start), z_glob, z_prev, tau))
    assert float(metrics["contrastive_sum"]) == pytest.approx(4 * want, rel=1e-5)
    assert float(metrics["num_examples"]) == 4.0

    @jax.jit
    def grad(p, mu):
        def objective(p):
            logits, inter = models.apply_with_intermediates(model, {"params": p}, real)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"][:4]).mean()
            z = inter["features"]
            cos = lambda a, b: jnp.sum(a * b, -1) / (  # noqa: E731
                jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1))
            pos, neg = jnp.exp(cos(z, z_glob) / tau), jnp.exp(cos(z, z_prev) / tau)
            return ce + mu * jnp.mean(-jnp.log(pos / (pos + neg)))
        return jax.grad(objective)(p)

    want_params = tree_map(lambda p, g: p - lr * g, start, grad(start, mu))
    assert max_rel_err(new.train.params, want_params) < 1e-5
    # The term moved the update: plain SGD on the cross-entropy alone lands elsewhere.
    ce_only = tree_map(lambda p, g: p - lr * g, start, grad(start, 0.0))
    assert max_rel_err(ce_only, want_params) > 1e-3


# Under vmap the same algorithm is held to the reference in
# test_clients_keep_their_final_local_models; one strategy suffices here.
@pytest.mark.parametrize("strategy", ["loop"])
def test_mu_zero_is_fedavg(strategy):
    # Round 0 alone would prove little: there z_prev = z_glob, so the term's gradient is 0
    # for any mu. Round 1 resamples a client whose previous model is its own.
    sim = _simulation(0.0, strategy)
    assert set(sim.sample(0)) & set(sim.sample(1))
    moon_states, moon_stats = _rounds(0.0, strategy)
    # Against FedAvg run by the loop executor (one compile fewer): exact up to rounding
    # there, and to the 1e-5 strategies agree to (tests/test_execution.py) under vmap.
    avg_states, _ = _rounds(None, "loop")
    tol = 1e-6 if strategy == "loop" else 1e-5
    for r in range(2):
        assert max_rel_err(moon_states[r].server, avg_states[r].server) < tol, r
    assert moon_stats[0]["train_contrastive"] == pytest.approx(math.log(2), rel=1e-5)
    assert moon_stats[1]["train_contrastive"] < math.log(2) - 1e-3  # computed, not used
    # With mu > 0 the same two rounds end elsewhere (the comparison is not vacuous).
    assert max_rel_err(_rounds(1.0, "loop")[0][1].server, avg_states[1].server) > 1e-4


def _reference(sim, algo, rounds=2):
    """Sequential rounds of engine.reference, storing the per-client states it returns."""
    _, cd, _, variables = _setup()
    state, out = sim.init(variables), []
    client_states = tree_map(np.array, state.client_states)
    for r in range(rounds):
        cohort = sim.cohort(state._replace(client_states=client_states), r)
        server, new, _ = reference_round(algo, cd, WORK.batch_size, state.server, cohort)
        for m, k in enumerate(cohort.ids):
            for all_, one in zip(jax.tree_util.tree_leaves(client_states),
                                 jax.tree_util.tree_leaves(new[m])):
                all_[k] = np.asarray(one)
        state = state._replace(server=server, round=r + 1)
        out.append((tree_map(np.asarray, server), tree_map(np.copy, client_states), cohort, new))
    return out


def test_clients_keep_their_final_local_models():
    _, cd, _, variables = _setup()
    algo = _algo(1.0)
    sim = _simulation(1.0, "loop")
    ref = _reference(sim, algo)
    runs = {name: _rounds(1.0, *key)[0] for name, key in
            [("loop", ("loop",)), ("vmap/1", ("vmap", 1)), ("vmap/3", ("vmap", 3))]}

    # After round 0: the sampled clients hold their local models, the others the initial one.
    stored = runs["loop"][0].client_states
    sampled = sim.sample(0)
    for k in range(cd.num_clients):
        mine = tree_map(lambda x: x[k], stored)
        if k in sampled:
            assert max_rel_err(mine, tree_map(lambda x: x[k], ref[0][1])) < 1e-5, k
            assert max_rel_err(mine.params, variables["params"]) > 1e-2, k
        else:
            for a, b in zip(jax.tree_util.tree_leaves(mine.params),
                            jax.tree_util.tree_leaves(variables["params"])):
                np.testing.assert_array_equal(a, b)
    # Independently of client_output: one client alone, uniform weight, server SGD(1) makes
    # the new global model that client's local model, which is what it must have stored.
    cohort = ref[0][2]
    for m in range(len(cohort.ids)):
        alone = Cohort(cohort.ids[m:m + 1], cohort.steps[m:m + 1], np.ones(1),
                       cohort.data_keys[m:m + 1], cohort.rngs[m:m + 1],
                       tree_map(lambda x: x[m:m + 1], cohort.client_states), 0)
        server, new, _ = reference_round(algo, cd, WORK.batch_size, sim.init(variables).server,
                                         alone)
        assert max_rel_err(new[0].params, server.params) < 1e-6, m
        assert new[0].model_state is None  # no BatchNorm: nothing else per client

    # Two rounds: round 1 resamples two clients (their previous models are their own) and
    # a new one (its previous model is the initial one). Every strategy gives the
    # reference's server and stacked client states.
    assert 0 < len(set(sim.sample(0)) & set(sim.sample(1))) < len(sim.sample(1))
    for name, states in runs.items():
        for r in range(2):
            assert max_rel_err(states[r].server, ref[r][0]) < 1e-5, (name, r)
            assert max_rel_err(states[r].client_states, ref[r][1]) < 1e-5, (name, r)


def test_bn_local_keeps_statistics_next_to_the_previous_model():
    # FedAvg's bn='local' (per-client BatchNorm statistics) stored beside the previous model.
    model = models.build("mlp", 10, hidden=[8], norm="batch")
    variables = models.init(model, jax.random.PRNGKey(0), SHAPE)
    algo = moon(model, optax.sgd(0.1), bn="local")
    server = algo.server_init(variables)
    first = algo.client_state_init(server)
    assert first.model_state is not None
    assert max_rel_err(first, ClientState(server.params, server.model_state)) == 0.0
    x = np.random.default_rng(0).normal(size=(6, *SHAPE)).astype(np.float32)
    batch = {"x": jnp.asarray(x), "y": jnp.arange(6, dtype=jnp.int32),
             "mask": jnp.ones(6, jnp.float32)}

    @jax.jit
    def train(client_state):
        local = algo.client_init(server, client_state, None)
        local, _ = algo.client_step(local, batch, server)
        return algo.client_output(local, server)[1], local

    after, local = train(first)
    mean = lambda s: np.asarray(s.model_state["batch_stats"]["fc1_norm"]["mean"])  # noqa
    assert not np.allclose(mean(after), mean(first))  # the client's own statistics moved
    assert max_rel_err(after.params, local.train.params) == 0.0  # and its model is kept
    # The next round resumes from them (not from the server's).
    again = algo.client_init(server, after, None)
    np.testing.assert_array_equal(
        again.train.model_state["batch_stats"]["fc1_norm"]["mean"], mean(after))
    with pytest.raises(ValueError, match="bn mode"):
        moon(model, optax.sgd(0.1), bn="frozen")


def test_term_is_reported_and_training_lowers_the_loss():
    ds, _, model, variables = _setup()
    states, stats = _rounds(1.0, "loop", rounds=5)

    def loss(v):  # the global model's mean cross-entropy on all training examples
        logits = model.apply(v, ds.train_images)
        return float(optax.softmax_cross_entropy_with_integer_labels(
            logits, ds.train_labels).mean())

    terms = [s["train_contrastive"] for s in stats]
    assert terms[0] == pytest.approx(math.log(2), rel=1e-5)  # z_prev = z_glob at first
    assert all(0.0 < t < math.log(2) - 1e-3 for t in terms[1:]), terms
    train = [s["train_loss"] for s in stats]
    assert train[-1] < 0.8 * train[0], train
    first, last = loss(variables), loss(_algo(1.0).eval_variables(states[-1].server))
    assert last < 0.8 * first, (first, last)


def test_state_bytes_by_hand():
    _, _, _, variables = _setup()
    # 36*24 + 24 + 24*16 + 16 + 16*10 + 10 = 1458 float32 parameters per stored model.
    assert state_bytes(variables, 6) == 6 * 1458 * 4
    bn_model = models.build("mlp", 10, hidden=[24, 16], norm="batch")
    bn_vars = jax.eval_shape(lambda: models.init(bn_model, jax.random.PRNGKey(0), SHAPE))
    # + scale and bias of both norms (80 params); bn='local' adds their mean and var (80).
    assert state_bytes(bn_vars, 6) == 6 * (1458 + 80) * 4
    assert state_bytes(bn_vars, 6, bn="local") == 6 * (1458 + 160) * 4
    # The paper's MLP (2,913,290 parameters) for K = 100 clients: 1.165 GB.
    paper = jax.eval_shape(lambda: models.init(models.build("mlp", 10), jax.random.PRNGKey(0),
                                               (28, 28, 1)))
    assert state_bytes(paper, 100) == 100 * 2_913_290 * 4 == 1_165_316_000


def test_config_entry():
    assert ENTRY.options == {"mu": 1.0, "tau": 0.5}
    assert ENTRY.rules["mu"].check(0.0) is None and ENTRY.rules["mu"].check(-1.0)
    assert ENTRY.rules["tau"].check(0.5) is None and ENTRY.rules["tau"].check(0.0)
    model = _setup()[2]
    cfg = SimpleNamespace(moon=SimpleNamespace(mu=0.0, tau=0.2), aggregation=SimpleNamespace(
        bn="mean"), optimizer=SimpleNamespace())
    built = ENTRY.build(model, cfg, TX, optax.sgd(1.0))
    assert isinstance(built.client_state_init(built.server_init(_setup()[3])), ClientState)
    with pytest.raises(ValueError, match="tau"):
        moon(model, TX, tau=0.0)
    with pytest.raises(ValueError, match="mu"):
        moon(model, TX, mu=-1.0)
