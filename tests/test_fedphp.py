"""FedPHP: the MMD against a NumPy double loop, the inherited model's moving average by
hand, one step's objective, and its limits (lam = 0 trains FedAvg's global model)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.personal.fedphp import BANDWIDTHS, fedphp, mmd
from fedjax_pan.algorithms.local import FEATURES


def _np_mmd(x, y, mask):
    real = [i for i in range(len(mask)) if mask[i]]

    def k(a, b):
        return sum(np.exp(-np.sum((a - b) ** 2) / (2 * h)) for h in BANDWIDTHS)
    total = 0.0
    for i in real:
        for j in real:
            total += k(x[i], x[j]) + k(y[i], y[j]) - 2 * k(x[i], y[j])
    return total / len(real) ** 2


@pytest.mark.reference("algorithm", "fedphp")
def test_mmd_is_the_kernel_mean_over_pairs_of_real_rows():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 5)) * 3, rng.normal(size=(6, 5)) * 3 + 1
    mask = np.array([1, 1, 0, 1, 1, 0], np.float32)
    got = float(mmd(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), mask))
    assert got == pytest.approx(_np_mmd(x, y, mask), rel=1e-4)
    assert float(mmd(jnp.asarray(x), jnp.asarray(x), mask)) == pytest.approx(0, abs=1e-5)


@pytest.mark.reference("algorithm", "fedphp")
def test_the_private_model_is_the_moving_average_and_a_step_mixes_both_terms():
    cd, model, variables, _ = pfl_setup()
    tx = optax.sgd(0.2)
    algo = fedphp(model, tx, rounds=8, mu=0.6, lam=0.3)
    server = algo.server_init(variables)
    private = {"params": jax.tree_util.tree_map(lambda v: v + 0.1, variables["params"])}
    local = algo.client_init(server, private,
                             ClientContext(jax.random.PRNGKey(0), 3, 20, 1, 2, jnp.ones(10)))
    assert max_rel_err(local.train.params, variables["params"]) == 0  # starts global
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8).at[7].set(0)}

    def features(p, x):
        _, state = model.apply({"params": p}, x, mutable=["intermediates"])
        return state["intermediates"][FEATURES]

    def objective(p):
        logits = model.apply({"params": p}, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        ce = jnp.sum(ce * batch["mask"]) / 7
        d = mmd(features(p, batch["x"]), features(private["params"], batch["x"]),
                batch["mask"])
        return 0.7 * ce + 0.3 * d
    want = jax.tree_util.tree_map(lambda w, g: w - 0.2 * g, variables["params"],
                                  jax.grad(objective)(variables["params"]))
    new, metrics = algo.client_step(local, batch, server)
    assert max_rel_err(new.train.params, want) < 1e-5
    assert float(metrics["mmd_sum"]) > 0
    _, hpm = algo.client_output(new, server)
    m = 0.6 * 2 / 8  # mu r / R in round 2
    want_hpm = jax.tree_util.tree_map(lambda w, p: (1 - m) * w + m * p, new.train.params,
                                      private["params"])
    assert max_rel_err(hpm["params"], want_hpm) < 1e-6
    assert max_rel_err(algo.personal_variables(server, hpm), hpm) == 0


@pytest.mark.slow
def test_lam_zero_trains_fedavgs_global_model_and_mu_zero_keeps_the_trained_model():
    cd, model, variables, tx = pfl_setup()
    sim, php, _ = pfl_rounds(fedphp(model, tx, 4, lam=0.0, mu=0.0), cd, variables, rounds=1)
    # mu = 0: a client's private model is the model it trained in its last round, the
    # broadcast plus its FedAvg delta (read before round 1 donates the states).
    out = sim.client_updates(php[1])
    second, _ = sim.round(php[1])
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(second.server.params, avg[-1].server.params) < 1e-6
    for m, k in enumerate(sim.sample(1)):
        trained = jax.tree_util.tree_map(lambda w, d: w + d, avg[1].server.params,
                                         out[m]["delta"])
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[k],
                                                  second.client_states["params"]),
                           trained) < 1e-5


def test_bad_options_are_refused():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"fedphp.mu must be a number in \[0, 1\], got 1.5"):
        fedphp(model, tx, 10, mu=1.5)
    with pytest.raises(ValueError, match=r"rounds >= 1, got 0"):
        fedphp(model, tx, 0)
