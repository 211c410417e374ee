"""pFedMe: local steps against their closed form on least squares, lambda = 0 (nothing
reaches the global model), beta scaling the server step, the personal model evaluated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_LR, max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.pfedme import pfedme
from quadratic import quadratic_clients, squared_loss

LAM, PLR, LR, K = 2.0, 0.05, 0.1, 3


@pytest.mark.reference("algorithm", "pfedme")
def test_local_steps_match_the_closed_form():
    q = quadratic_clients(dim=3, size=8)
    algo = pfedme(q.model, LR, lam=LAM, inner_steps=K, personal_lr=PLR, mu=0.01,
                  loss=squared_loss)
    w0 = np.asarray([0.3, -0.2, 0.5])
    server = algo.server_init({"params": {"w": jnp.asarray(w0, jnp.float32)}})
    local = algo.client_init(server, None, ClientContext(None, 2, 8, 0, 0, jnp.ones(1)))
    x = np.asarray(q.data.images)[:8]
    w, theta = w0.copy(), w0.copy()
    for rows in (slice(0, 4), slice(4, 8)):  # two steps, two batches
        batch = {"x": jnp.asarray(x[rows]), "y": jnp.zeros(4, jnp.int32), "mask": jnp.ones(4)}
        local, _ = algo.client_step(local, batch, server)
        a, b = x[rows, :3, 0, 0].astype(np.float64), x[rows, 3, 0, 0].astype(np.float64)
        for _ in range(K):
            g = a.T @ (a @ theta - b) / 4
            theta = theta - PLR * (g + LAM * (theta - w) + 0.01 * theta)
        w = w - LR * LAM * (w - theta)
    np.testing.assert_allclose(local.w["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(local.theta["w"], theta, rtol=1e-5, atol=1e-6)
    output, state = algo.client_output(local, server)
    np.testing.assert_allclose(output["delta"]["w"], w - w0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["params"]["w"], theta, rtol=1e-5, atol=1e-6)


def test_lambda_zero_keeps_the_global_model_and_beta_scales_its_step():
    cd, model, variables, _ = pfl_setup()
    _, still, _ = pfl_rounds(pfedme(model, PFL_LR, lam=0.0), cd, variables, rounds=1)
    assert max_rel_err(still[-1].server.params, variables["params"]) == 0
    assert max_rel_err(still[-1].client_states["params"],
                       jax.tree_util.tree_map(lambda v: v[None], variables["params"])) > 1e-3
    moves = []
    for beta in (1.0, 2.0):
        _, s, _ = pfl_rounds(pfedme(model, PFL_LR, beta=beta), cd, variables, rounds=1)
        moves.append(jax.tree_util.tree_map(lambda a, b: np.asarray(a - b),
                                            s[-1].server.params, variables["params"]))
    assert max_rel_err(jax.tree_util.tree_map(lambda m: 2 * m, moves[0]), moves[1]) < 1e-4
    assert max(float(np.max(np.abs(m))) for m in jax.tree_util.tree_leaves(moves[0])) > 1e-4


def test_clients_evaluate_their_theta():
    cd, model, variables, _ = pfl_setup()
    sim, states, _ = pfl_rounds(pfedme(model, PFL_LR), cd, variables, rounds=2)
    mine = sim.personal_evaluation(states[-1])
    assert max_rel_err(mine["params"], states[-1].client_states["params"]) == 0
