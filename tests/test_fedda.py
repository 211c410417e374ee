"""FedDA (PFL-DA): both phases of a local round against their gradients computed
independently, the rounds' bookkeeping (only the global head is shared), personal
models, loop/vmap/reference agreement, options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.fedda import fedda, head_distance
from fedjax_pan.algorithms.local import WithFeatures

LR, LAM = 0.1, 0.3


def _ce(logits, y):
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


@pytest.mark.reference("algorithm", "fedda")
def test_both_phases_follow_their_gradients():
    cd, model, variables, _ = pfl_setup()
    algo = fedda(model, optax.sgd(LR), lam=LAM, head_fraction=0.5)
    server = algo.server_init(variables)
    key = jax.random.PRNGKey(4)
    own = jax.tree_util.tree_map(lambda v: v + 0.1 * jax.random.normal(key, v.shape),
                                 variables["params"])
    local = algo.client_init(server, {"params": own},
                             ClientContext(key, 2, 16, 0, 0, jnp.ones(10)))
    assert int(local.head_steps) == 1
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    x, y = batch["x"], np.asarray(batch["y"])
    g = variables["params"]["head"]

    # Phase 1: the personal head on CE + lam ||h - g||; nothing else moves.
    def phase1(head):
        return _ce(model.apply({"params": {**own, "head": head}}, x), y)
    grad = jax.grad(phase1)(own["head"])
    diff = {k: np.asarray(own["head"][k]) - np.asarray(g[k]) for k in g}
    norm = np.sqrt(sum((d ** 2).sum() for d in diff.values()))
    want = {k: np.asarray(own["head"][k]) - LR * (np.asarray(grad[k]) + LAM * diff[k] / norm)
            for k in g}
    one, m1 = algo.client_step(local, batch, server)
    p1 = one.train.params
    assert max_rel_err(p1["model"]["head"], want) < 1e-5
    assert all(max_rel_err(p1["model"][k], own[k]) == 0 for k in ("fc1", "fc2"))
    assert max_rel_err(p1["ghead"], g) == 0
    assert abs(float(m1["head_distance_sum"]) / 8 - norm) < 1e-5

    # Phase 2: the extractor and g' on CE of g'(f(x)); the personal head stays.
    def phase2(p):
        _, f = WithFeatures(model).apply({"params": {**p["body"], "head": p1["model"]["head"]}},
                                          x)
        return _ce(f @ p["g"]["kernel"] + p["g"]["bias"], y)
    body = {k: p1["model"][k] for k in ("fc1", "fc2")}
    grad2 = jax.grad(phase2)({"body": body, "g": p1["ghead"]})
    two, _ = algo.client_step(one, batch, server)
    p2 = two.train.params
    assert max_rel_err(p2["model"]["head"], p1["model"]["head"]) == 0
    for k in ("fc1", "fc2"):
        want_k = jax.tree_util.tree_map(lambda w, d: w - LR * d, body[k], grad2["body"][k])
        assert max_rel_err(p2["model"][k], want_k) < 1e-5
    want_g = jax.tree_util.tree_map(lambda w, d: w - LR * d, p1["ghead"], grad2["g"])
    assert max_rel_err(p2["ghead"], want_g) < 1e-5
    out, state = algo.client_output(two, server)
    assert max_rel_err(out["delta"], jax.tree_util.tree_map(jnp.subtract, p2["ghead"], g)) < 1e-6
    assert max_rel_err(state["params"], p2["model"]) == 0


def test_head_distance_is_safe_at_zero():
    h = {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}
    assert float(head_distance(h, h)) == 0
    grad = jax.grad(lambda a: head_distance(a, h))(h)
    assert all(np.all(np.asarray(v) == 0) for v in jax.tree_util.tree_leaves(grad))
    other = {"kernel": jnp.zeros((3, 2)), "bias": jnp.ones(2) * 2}
    assert abs(float(head_distance(h, other)) - np.sqrt(6 + 8)) < 1e-6


@pytest.mark.slow
def test_only_the_global_head_is_shared():
    cd, model, variables, tx = pfl_setup()
    algo = fedda(model, tx, lam=1.0)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=2)
    assert np.isfinite(stats[-1]["train_loss"])
    last = states[-1]
    # The server's extractor never changes; its head (g) does.
    for k in ("fc1", "fc2"):
        assert max_rel_err(last.server.params[k], variables["params"][k]) == 0
    assert max_rel_err(last.server.params["head"], variables["params"]["head"]) > 1e-4
    sampled = set(sim.sample(0).tolist()) | set(sim.sample(1).tolist())
    for k in range(cd.num_clients):
        mine = jax.tree_util.tree_map(lambda v: v[k], last.client_states["params"])
        moved = max_rel_err(mine, variables["params"]) > 0
        assert moved == (k in sampled), k
    assert max_rel_err(sim.personal_evaluation(last), last.client_states) == 0
    assert stats[-1]["download_bytes"] == len(sim.sample(1)) * 4 * (16 * 10 + 10)


def test_bad_options_raise():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match="-1"):
        fedda(model, tx, lam=-1.0)
    with pytest.raises(ValueError, match="1.0"):
        fedda(model, tx, head_fraction=1.0)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedda(model, tx, lam=0.5)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
