"""KT-pFL: the knowledge-coefficient step against its hand-computed gradient, the
regulariser alone contracting c to 1/N, distillation lowering the KL to a client's
target, the server's store of soft predictions, and the held-out public set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_LR, max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.ktpfl import kl, ktpfl, soft_predictions, update_coefficients


def _soft(rng, n, p, c):
    z = rng.normal(size=(n, p, c))
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def test_coefficient_step_matches_the_hand_computed_gradient():
    rng = np.random.default_rng(0)
    n, p, c = 3, 4, 5
    soft = _soft(rng, n, p, c)
    coef = rng.uniform(0.1, 0.6, size=(n, n))
    sizes = np.asarray([10.0, 30.0, 60.0])
    lam, rho, lr = 0.7, 0.2, 0.05
    w = sizes / sizes.sum()
    t = np.einsum("mn,mpc->npc", coef, soft)
    grad = np.zeros((n, n))
    for m in range(n):
        for k in range(n):
            grad[m, k] = lam * w[k] / p * np.sum(soft[m] * (np.log(t[k]) + 1 - np.log(soft[k])))
            grad[m, k] += 2 * rho * (coef[m, k] - 1 / n)
    got = update_coefficients(jnp.asarray(coef, jnp.float32), jnp.asarray(soft, jnp.float32),
                              jnp.asarray(sizes, jnp.float32), lam, rho, lr)
    np.testing.assert_allclose(got, coef - lr * grad, rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(grad)) > 1e-2


def test_the_regulariser_alone_contracts_c_to_uniform():
    rng = np.random.default_rng(1)
    coef = rng.uniform(size=(4, 4)).astype(np.float32)
    got = update_coefficients(jnp.asarray(coef), jnp.asarray(_soft(rng, 4, 3, 2), jnp.float32),
                              jnp.ones(4), lam=0.0, rho=0.5, lr=0.2)
    np.testing.assert_allclose(got, 0.25 + (1 - 0.2) * (coef - 0.25), rtol=1e-6)


def _setup():
    cd, model, variables, tx = pfl_setup()
    public = jnp.asarray(np.random.default_rng(2).normal(size=(30, 6, 6, 1)), jnp.float32)
    return cd, model, variables, tx, public


def test_distillation_lowers_the_kl_to_the_target():
    cd, model, variables, tx, public = _setup()
    algo = ktpfl(model, tx, public, cd.num_clients, 0.5, temperature=2.0)
    server = algo.server_init(variables)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 8, 27, 1, 0, jnp.ones(10)))
    row = np.full(10, 0.3 / 9)
    row[3] = 0.7  # one class favoured on every public example: reachable by the head's bias
    target = jnp.asarray(np.tile(row, (30, 1)), jnp.float32)
    local = local._replace(target=target, distill_from=jnp.int32(0))

    def distance(params):
        return float(kl(target, soft_predictions(model.apply({"params": params}, public), 2.0)))
    before = distance(local.train.params)
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    for _ in range(15):
        local, metrics = algo.client_step(local, batch, server)
    assert float(metrics["num_examples"]) == 0  # distillation adds no training loss
    assert distance(local.train.params) < 0.5 * before


def test_the_server_stores_soft_predictions_and_steps_c():
    cd, model, variables, tx, public = _setup()
    algo = ktpfl(model, tx, public, cd.num_clients, 0.4, lam=1.0, rho=0.1, coef_lr=0.5)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=2)
    server = states[2].server
    ids = set(sim.sample(0).tolist()) | set(sim.sample(1).tolist())
    for k in range(cd.num_clients):
        mine = jax.tree_util.tree_map(lambda v: v[k], states[2].client_states)
        if k in ids:  # its latest model's soft predictions on the public set, its size
            want = soft_predictions(model.apply(mine, public), 1.0)
            assert max_rel_err(server.soft[k], want) < 1e-5
            assert float(server.sizes[k]) == cd.sizes[k]
        else:  # the initial model's; no weight yet
            assert max_rel_err(server.soft[k], server.soft[k] * 0 + soft_predictions(
                model.apply(variables, public), 1.0)) < 1e-6
            assert float(server.sizes[k]) == 0
    # c took exactly one step per round, on the soft predictions stored by then.
    c1 = update_coefficients(states[0].server.coef, states[1].server.soft,
                             states[1].server.sizes, 1.0, 0.1, 0.5)
    assert max_rel_err(states[1].server.coef, c1) < 1e-5
    assert max_rel_err(states[1].server.coef, states[0].server.coef) > 1e-4
    # Personal models: each client's own, never averaged.
    personal = sim.personal_evaluation(states[2])
    assert max_rel_err(personal, states[2].client_states) == 0


def test_the_public_set_is_held_out_of_every_client():
    from fedjax_pan import experiment
    from test_experiment import config
    with pytest.raises(experiment.ConfigError, match="dataset.public_size > 0"):
        experiment.build(config(algorithm="ktpfl", local__epochs=2.0))
    exp = experiment.build(config(algorithm="ktpfl", local__epochs=2.0,
                                  dataset__public_size=100))
    public, kept = experiment.public_split(exp.dataset.num_train, 100, exp.config.seed)
    assert len(public) == 100 and len(kept) == exp.dataset.num_train - 100
    used = np.concatenate(exp.client_indices)
    assert not set(used.tolist()) & set(public.tolist())
    assert sorted(used.tolist()) == kept.tolist()
    # Without a public set the partition is the one it always was.
    plain = experiment.build(config())
    again = experiment.build(config(dataset__public_size=0))
    assert all(np.array_equal(a, b) for a, b in zip(plain.client_indices, again.client_indices))
