"""FedAMP: the attention weights and cloud model against NumPy, one local step against
its gradient, the server's record of uploads, and its limits (lam = 0 is Local)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.core import ClientContext, tree_bytes
from fedjax_pan.algorithms.personal.fedamp import fedamp
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing

ALPHA, SIGMA, LAM = 0.4, 2.5, 0.3


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.reference("algorithm", "fedamp")
def test_attention_and_cloud_model_follow_the_formulas_and_a_step_its_gradient():
    cd, model, variables, _ = pfl_setup()
    k = cd.num_clients
    tx = optax.sgd(0.1)
    algo = fedamp(model, tx, k, alpha=ALPHA, lam=LAM, sigma=SIGMA)
    server = algo.server_init(variables)
    keys = jax.random.split(jax.random.PRNGKey(5), k)
    stack = jax.tree_util.tree_map(
        lambda v: jnp.stack([v + 0.02 * jax.random.normal(kk, v.shape) for kk in keys]),
        variables["params"])
    uploaded = jnp.asarray([1, 1, 0, 1, 1, 0], jnp.float32)
    server = server._replace(models=stack, uploaded=uploaded)
    me = 1
    own = jax.tree_util.tree_map(lambda v: v[me] + 0.01, stack)  # moved since it uploaded
    local = algo.client_init(server, {"params": own},
                             ClientContext(keys[0], 3, 20, me, 2, jnp.ones(10)))
    w = _flat(own)
    models = np.stack([_flat(jax.tree_util.tree_map(lambda v: v[j], stack)) for j in range(k)])
    xi = np.zeros(k)
    for j in range(k):
        if j != me and uploaded[j]:
            xi[j] = ALPHA * np.exp(-np.sum((w - models[j]) ** 2) / SIGMA) / SIGMA
    assert 0.01 < xi.sum() < 1  # the case exercises the weights
    u = (1 - xi.sum()) * w + xi @ models
    np.testing.assert_allclose(_flat(local.cloud), u, rtol=1e-5, atol=1e-6)
    # One plain-SGD step: CE's gradient plus lam / alpha (w - u).
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}

    def ce(p):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    g = _flat(jax.grad(ce)(own)) + LAM / ALPHA * (w - u)
    new, metrics = algo.client_step(local, batch, server)
    np.testing.assert_allclose(_flat(new.train.params), w - 0.1 * g, rtol=1e-5, atol=1e-6)
    prox = LAM / (2 * ALPHA) * np.sum((w - u) ** 2)
    assert float(metrics["prox_sum"]) == pytest.approx(8 * prox, rel=1e-4)
    assert algo.download_bytes(server, jnp.arange(2), 0) == tree_bytes(variables["params"])


def test_before_any_upload_the_cloud_model_is_the_clients_own():
    cd, model, variables, tx = pfl_setup()
    algo = fedamp(model, tx, cd.num_clients, alpha=ALPHA, sigma=SIGMA)
    server = algo.server_init(variables)
    own = jax.tree_util.tree_map(lambda v: v + 1.0, variables["params"])
    local = algo.client_init(server, {"params": own},
                             ClientContext(jax.random.PRNGKey(0), 3, 20, 2, 0, jnp.ones(10)))
    assert max_rel_err(local.cloud, own) == 0


@pytest.mark.slow
def test_the_server_keeps_each_clients_latest_upload_and_lam_zero_is_local():
    cd, model, variables, tx = pfl_setup()
    algo = fedamp(model, tx, cd.num_clients, alpha=ALPHA, lam=0.0, sigma=SIGMA)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=2)
    _, local, _ = pfl_rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables,
                             rounds=2)
    from flax import traverse_util
    mine = traverse_util.flatten_dict(jax.device_get(states[-1].client_states["params"]),
                                      sep="/")
    theirs = local[-1].client_states["params"]
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7)
    server = states[-1].server
    seen = set(sim.sample(0)) | set(sim.sample(1))
    np.testing.assert_array_equal(np.asarray(server.uploaded),
                                  [float(k in seen) for k in range(cd.num_clients)])
    for k in seen:  # the server's copy is the client's own model
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[k], server.models),
                           jax.tree_util.tree_map(lambda v: v[k],
                                                  states[-1].client_states["params"])) == 0


@pytest.mark.slow
def test_attention_pulls_clients_together():
    """With attention on (sigma large enough that distant models count), the personal
    models end closer to one another than Local's."""
    cd, model, variables, tx = pfl_setup()

    def spread(algo):
        _, states, _ = pfl_rounds(algo, cd, variables, rounds=3)
        w = np.stack([_flat(jax.tree_util.tree_map(lambda v: v[k],
                                                   states[-1].client_states["params"]))
                      for k in range(cd.num_clients)])
        return np.mean(np.linalg.norm(w - w.mean(0), axis=1))
    assert spread(fedamp(model, tx, cd.num_clients, alpha=0.5, lam=5.0, sigma=50.0)) < \
        0.9 * spread(fedamp(model, tx, cd.num_clients, alpha=0.5, lam=0.0, sigma=50.0))


def test_bad_options_are_refused():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"fedamp.alpha must be a number in \(0, .*got 0.0"):
        fedamp(model, tx, 4, alpha=0.0)
    with pytest.raises(ValueError, match=r"fedamp.sigma .*got -1.0"):
        fedamp(model, tx, 4, sigma=-1.0)
