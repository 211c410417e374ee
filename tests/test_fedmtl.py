"""FedMTL: the regulariser's value and gradient against PFLlib's formula and the paper's
trace written out in numpy, one local step by hand, the stack of models over rounds
(lam = 0 is Local training), loop / vmap / reference, options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import PFL_LR, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.fedmtl import (coefficients, fedmtl, other_columns, pfllib_scale,
                                          regularizer_value)
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.config.defaults import default_config

K = 6  # the pFL tests' clients


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _columns(stack):
    """W (d, K) from a stack of trees (leaves (K, ...)), leaves in tree order."""
    leaves = jax.tree_util.tree_leaves(stack)
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in leaves],
                          axis=1).T


@pytest.mark.slow
def test_pfllib_scale_is_ten_to_minus_digits_plus_one():
    assert pfllib_scale(1458) == 1e-5  # the pFL tests' MLP
    assert pfllib_scale(1000) == 1e-5
    assert pfllib_scale(999) == 1e-4
    assert pfllib_scale(582026) == 1e-7


@pytest.mark.parametrize("kind", ["pfllib", "paper"])
@pytest.mark.reference("algorithm", "fedmtl")
def test_regulariser_value_and_gradient_by_hand(kind):
    rng = np.random.default_rng(0)
    n, k, scale = 3, 1, 0.3
    stack = {"a": rng.normal(size=(n, 2)).astype(np.float32),
             "b": rng.normal(size=(n, 1, 2)).astype(np.float32)}
    own = {"a": rng.normal(size=2).astype(np.float32),
           "b": rng.normal(size=(1, 2)).astype(np.float32)}
    W = _columns(stack)
    W[:, k] = _columns(jax.tree_util.tree_map(lambda x: x[None], own))[:, 0]
    if kind == "pfllib":
        # clientmtl.py: I = torch.ones, omega = (I - 1/K 1 1^T)^2, the client's sqrt([0][0])
        omega = np.sqrt(((np.ones((n, n)) - np.ones((n, 1)) @ np.ones((1, n)) / n) ** 2)[0, 0])
        want = scale * (np.linalg.norm(W) ** 2 + np.sum(np.sum(W * omega, 1) ** 2))
        grad = scale * (2 * W[:, k] + 2 * omega ** 2 * W.sum(1))
    else:
        big_omega = np.linalg.matrix_power(np.eye(n) - np.ones((n, n)) / n, 2)
        want = scale * np.trace(W @ big_omega @ W.T)
        grad = scale * 2 * (W @ big_omega)[:, k]
    others_sum, others_sq = other_columns(jax.tree_util.tree_map(jnp.asarray, stack), k)

    def value(p):
        return regularizer_value(p, others_sum, others_sq, scale, coefficients(kind, n))
    got, g = jax.value_and_grad(value)(jax.tree_util.tree_map(jnp.asarray, own))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(_columns(jax.tree_util.tree_map(lambda x: x[None], g))[:, 0],
                               grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_local_step_descends_cross_entropy_plus_the_regulariser():
    cd, model, variables, _ = pfl_setup()
    lr, lam, k = 0.1, 0.02, 2
    algo = fedmtl(model, optax.sgd(lr), K, lam=lam)
    server = algo.server_init(variables)
    key = jax.random.PRNGKey(5)
    stack = jax.tree_util.tree_map(
        lambda s: s + 0.1 * jax.random.normal(key, s.shape), server.stack)
    server = server._replace(stack=stack)
    own = jax.tree_util.tree_map(lambda s: s[k], stack)
    local = algo.client_init(server, {"params": own},
                             ClientContext(key, 3, 27, k, 0, jnp.ones(10)))
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    new, metrics = algo.client_step(local, batch, server)

    def ce(p):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    g_ce = _columns(jax.tree_util.tree_map(lambda x: x[None], jax.grad(ce)(own)))[:, 0]
    W = _columns(stack)
    c = (1 - 1 / K) ** 2
    g_reg = lam * (2 * W[:, k] + 2 * c * W.sum(1))
    want = W[:, k] - lr * (g_ce + g_reg)
    got = _columns(jax.tree_util.tree_map(lambda x: x[None], new.train.params))[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    reg = lam * (np.sum(W ** 2) + c * np.sum(W.sum(1) ** 2))
    np.testing.assert_allclose(float(metrics["reg_sum"]), 8 * reg, rtol=1e-5)


@pytest.mark.slow
def test_lam_zero_is_local_training_and_the_stack_holds_the_latest_models():
    cd, model, variables, tx = pfl_setup()
    sim, m, stats = pfl_rounds(fedmtl(model, tx, K, lam=0.0), cd, variables)
    _, loc, _ = pfl_rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables)
    mine, theirs = _flat(m[-1].client_states["params"]), loc[-1].client_states["params"]
    assert set(mine) == set(theirs)
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7)
    # Column k of W is client k's latest model; never-sampled clients hold the initial one.
    stack, init = _flat(m[-1].server.stack), _flat(variables["params"])
    sampled = {int(i) for r in range(2) for i in sim.sample(r)}
    for key in mine:
        np.testing.assert_array_equal(stack[key], mine[key])
        for j in set(range(K)) - sampled:
            np.testing.assert_array_equal(stack[key][j], init[key])
    # Each sampled client downloads all K columns; the personal model is its own.
    model_bytes = sum(4 * v.size for v in init.values())
    assert stats[0]["download_bytes"] == len(sim.sample(0)) * K * model_bytes
    assert max_rel_err(sim.personal_evaluation(m[-1]), m[-1].client_states) == 0
    # The global evaluation shows the initial model.
    assert max_rel_err(sim.evaluation(m[-1].server)[1]["params"], variables["params"]) == 0
    # A regulariser that bites pulls the models apart from Local's.
    _, p, _ = pfl_rounds(fedmtl(model, tx, K, lam=0.5, regularizer="paper"), cd, variables)
    assert max_rel_err(p[-1].client_states["params"], m[-1].client_states["params"]) > 1e-4


def test_options_are_checked():
    cd, model, variables, tx = pfl_setup()
    with pytest.raises(ValueError, match="fedmtl.regularizer must be one of .*got 'trace'"):
        fedmtl(model, tx, K, regularizer="trace")
    with pytest.raises(ValueError, match=r"fedmtl.lam .*got -1"):
        fedmtl(model, tx, K, lam=-1.0)
    cfg = default_config()
    cfg.algorithm, cfg.fedmtl.regularizer = "fedmtl", "nope"
    with pytest.raises(ValueError, match="'nope'"):
        registry.from_config(model, cfg)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, _ = pfl_setup()
    cfg = default_config()
    cfg.algorithm, cfg.partition.num_clients = "fedmtl", K
    cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.warmup = PFL_LR, 0.9, "none"
    cfg.fedmtl.lam = 0.05
    algo = registry.from_config(model, cfg)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
    assert max_rel_err(ref.client_states["params"], variables["params"]) > 1e-3
