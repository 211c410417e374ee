"""Alg. 2 (shuffling during local training) as an algorithm wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import tiny_clients
from fedjax_pan import models
from fedjax_pan import permutation as P
from fedjax_pan.algorithms import ClientContext, fedavg
from fedjax_pan.algorithms.shuffle import with_shuffling
from fedjax_pan.engine import LocalWork, Simulation, make_executor


def _setup(lr, norm="batch"):
    model = models.build("mlp", 10, hidden=[12, 10], norm=norm)
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    return model, variables, fedavg(model, optax.sgd(lr, momentum=0.9))


def test_no_shuffles_is_the_plain_algorithm():
    _, cd = tiny_clients([20, 30, 25])
    model, variables, algo = _setup(0.05)
    spec = P.spec_for(model, variables)
    work = LocalWork(batch_size=8, epochs=1)
    finals = []
    for a in [algo, with_shuffling(algo, spec, p_sf=1.0, n_sf=0.0)]:
        sim = Simulation(a, cd, work, make_executor("loop", a, work, cd, variables, 2), 0.7)
        state, _ = sim.round(sim.init(variables))
        finals.append(state.server)
    for x, y in zip(jax.tree_util.tree_leaves(finals[0]), jax.tree_util.tree_leaves(finals[1])):
        np.testing.assert_array_equal(x, y)


def test_shuffles_permute_the_local_model_and_compose():
    """lr = 0 and a shuffle at every step: the local model is the broadcast model permuted by
    the product of the permutations drawn, which the wrapper tracks."""
    model, variables, algo = _setup(0.0, norm="none")  # BN statistics would move with data
    spec = P.spec_for(model, variables)
    wrapped = with_shuffling(algo, spec, p_sf=0.5, n_sf=10.0, track_product=True)
    server = algo.server_init(variables)
    ctx = ClientContext(jax.random.PRNGKey(3), jnp.int32(4), jnp.int32(32), jnp.int32(0),
                        jnp.int32(0), jnp.ones(10))  # prob 10/4 >= 1
    local = wrapped.client_init(server, None, ctx)
    batch = {"x": jnp.zeros((8, 6, 6, 1)), "y": jnp.zeros(8, jnp.int32), "mask": jnp.zeros(8)}
    step = jax.jit(wrapped.client_step)
    for _ in range(4):
        local, metrics = step(local, batch, server)
        assert float(metrics["shuffles"]) == 1.0
    assert np.mean([P.r_kept(p) for p in local.product.values()]) < 0.9
    want = P.apply_permutation(spec, {k: np.asarray(v) for k, v in local.product.items()},
                               jax.tree_util.tree_map(np.asarray, variables))
    np.testing.assert_allclose(local.inner.params["fc1"]["kernel"], want["params"]["fc1"]["kernel"])
    np.testing.assert_allclose(local.inner.params["head"]["kernel"], want["params"]["head"]["kernel"])
    # The function itself is unchanged (no PANs): permutation invariance.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 6, 6, 1)), jnp.float32)
    shuffled = {"params": local.inner.params, **local.inner.model_state}
    np.testing.assert_allclose(model.apply(shuffled, x), model.apply(variables, x), rtol=1e-5,
                               atol=1e-7)
