"""Alg. 2 (shuffling during local training) as an algorithm wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.pan import permutation as P
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
    # Two programs: equal to rounding under the suite's compile flags (conftest), and bit
    # for bit under XLA's defaults (BatchNorm's zero-gradient biases hold only rounding).
    assert max_rel_err(finals[1], finals[0]) < 1e-6


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


def test_shuffles_fall_on_the_steps_drawn_as_a_step_by_step_reference():
    """N_sf = 3 over 6 steps (prob 1/2), lr = 0: the local model is the broadcast model
    permuted by exactly the permutations of the steps whose draw fell under 1/2, replayed
    here one step at a time from the same keys."""
    model, variables, algo = _setup(0.0, norm="none")
    spec = P.spec_for(model, variables)
    wrapped = with_shuffling(algo, spec, p_sf=0.5, n_sf=3.0)
    server = algo.server_init(variables)
    ctx = ClientContext(jax.random.PRNGKey(5), jnp.int32(6), jnp.int32(48), jnp.int32(0),
                        jnp.int32(0), jnp.ones(10))
    local = wrapped.client_init(server, None, ctx)
    batch = {"x": jnp.zeros((8, 6, 6, 1)), "y": jnp.zeros(8, jnp.int32), "mask": jnp.zeros(8)}
    step = jax.jit(wrapped.client_step)
    rng = jax.random.fold_in(ctx.rng, 0x5F)
    total = P.identity(spec)
    shuffled = []
    for _ in range(6):
        local, metrics = step(local, batch, server)
        rng, k_do, k_perm = jax.random.split(rng, 3)
        do = float(jax.random.uniform(k_do)) <= 0.5
        if do:
            drawn = P.random_permutations_jax(spec, k_perm, 0.5)
            total = P.compose(total, {k: np.asarray(v) for k, v in drawn.items()})
        shuffled.append(do)
        assert float(metrics["shuffles"]) == float(do)
    assert 0 < sum(shuffled) < 6, shuffled  # some steps shuffle, some do not
    want = P.apply_permutation(spec, total, jax.tree_util.tree_map(np.asarray, variables))
    for name in ("fc1", "fc2", "head"):
        np.testing.assert_array_equal(local.inner.params[name]["kernel"],
                                      want["params"][name]["kernel"])


def test_shuffled_training_gives_the_same_numbers_under_loop_and_vmap():
    """Under vmap a shuffle decision differs between clients (the branch becomes a select):
    the round equals the per-client loop's."""
    _, cd = tiny_clients([20, 30, 25])
    model, variables, algo = _setup(0.05)
    spec = P.spec_for(model, variables)
    shuffled = with_shuffling(algo, spec, p_sf=0.5, n_sf=1.5)
    work = LocalWork(batch_size=8, epochs=2)
    finals = []
    for strategy, block in (("loop", None), ("vmap", 3)):
        ex = make_executor(strategy, shuffled, work, cd, variables, 3, block_size=block)
        sim = Simulation(shuffled, cd, work, ex, 1.0)
        state, stats = sim.round(sim.init(variables))
        assert stats["train_shuffles"] > 0
        finals.append(state.server)
    for x, y in zip(jax.tree_util.tree_leaves(finals[0]), jax.tree_util.tree_leaves(finals[1])):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
