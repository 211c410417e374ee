"""APFL: alpha = 0 (fixed) is FedAvg; the alpha update against a hand-computed gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_LR as LR
from conftest import PFL_SIZES as SIZES
from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms import fedavg
from fedjax_pan.algorithms.personal.apfl import ALPHA_DECAY, apfl


def _run(algo, cd, variables, strategy="vmap", rounds=2):
    sim, states, _ = pfl_rounds(algo, cd, variables, strategy, rounds)
    return sim, states[-1]


@pytest.mark.parametrize("warmup", ["none", "rounds"])
def test_fixed_alpha_zero_is_fedavg(warmup):
    cd, model, variables, tx = pfl_setup(warmup=warmup)
    sim, a = _run(apfl(model, tx, LR, alpha=0.0, adaptive=False), cd, variables)
    _, f = _run(fedavg(model, tx), cd, variables)
    # Two programs: equal to rounding under the suite's compile flags (conftest), and bit
    # for bit under XLA's defaults.
    assert max_rel_err(a.server.params, f.server.params) < 1e-6
    mixed = sim.personal_evaluation(a)
    for k in range(len(SIZES)):  # every client evaluates FedAvg's global model
        own = jax.tree_util.tree_map(lambda x: x[k], mixed)
        assert max_rel_err(own["params"], f.server.params) < 1e-6


@pytest.mark.reference("algorithm", "apfl")
def test_alpha_update_matches_a_hand_computed_gradient():
    """One step on one batch: alpha moves by -lr_alpha (<v - w, g_m> + 0.02 alpha)."""
    cd, model, variables, tx = pfl_setup()
    algo = apfl(model, tx, LR, alpha=0.3, adaptive=True, alpha_lr=0.7)
    server = algo.server_init(variables)
    rng = np.random.default_rng(0)
    v = jax.tree_util.tree_map(lambda p: p + 0.1 * rng.standard_normal(p.shape).astype(
        np.float32), variables["params"])
    local = algo.client_init(server, {"params": v, "alpha": jnp.float32(0.3)}, None)
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    new, _ = algo.client_step(local, batch, server)

    w = variables["params"]
    m = jax.tree_util.tree_map(lambda a, b: 0.3 * a + 0.7 * b, v, w)
    def loss(p):  # noqa: E306
        logits = model.apply({"params": p}, batch["x"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(logp[jnp.arange(8), batch["y"]])
    g = jax.grad(loss)(m)
    inner = sum(float(np.sum((np.asarray(a) - np.asarray(b)) * np.asarray(c)))
                for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (v, w, g))))
    want = np.clip(0.3 - 0.7 * (inner + ALPHA_DECAY * 0.3), 0, 1)
    assert abs(float(new.alpha) - want) < 1e-5 and abs(want - 0.3) > 1e-4
    # The personal model moved along alpha * g_m.
    want_v = jax.tree_util.tree_map(lambda a, c: a - LR * 0.3 * c, v, g)
    assert max_rel_err(new.personal, want_v) < 1e-5


def test_loop_and_vmap_agree():
    cd, model, variables, tx = pfl_setup()
    algo = apfl(model, tx, LR, alpha=0.5)
    _, a = _run(algo, cd, variables, "loop")
    _, b = _run(algo, cd, variables, "vmap")
    assert max_rel_err(a.server, b.server) < 1e-5
    assert max_rel_err(a.client_states, b.client_states) < 1e-5
    alphas = np.asarray(a.client_states["alpha"])
    assert np.all((0 <= alphas) & (alphas <= 1)) and np.any(alphas != 0.5)  # it learned
