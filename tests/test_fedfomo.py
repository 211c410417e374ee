"""FedFomo: the weights and the mix against numpy on a tiny linear model, the server's
stack and affinity matrix over rounds, loop / vmap / reference agreement, options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.core import ClientContext, tree_bytes
from fedjax_pan.algorithms.personal.fedfomo import fedfomo
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.config.defaults import default_config


class Linear(nn.Module):
    """logits = flatten(x) @ W + b: small enough to evaluate in numpy."""

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _np_loss(w, b, x, y, mask):
    """Mean over real examples of the softmax cross-entropy, in float64."""
    z = x.reshape(len(x), -1).astype(np.float64) @ w + b
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    ce = -logp[np.arange(len(y)), y]
    return float((ce * mask).sum() / mask.sum())


def _hand_case(scales, own_shift=0.0):
    """A client (id 1 of K = 4, M = 3) with two validation steps on two batches (the second
    padded), its server stack and P set by hand; returns what FedFomo gives and what numpy
    computes."""
    rng = np.random.default_rng(0)
    k, d = 4, 6
    w_true = rng.normal(size=(d, 3))
    x = rng.normal(size=(10, 2, 3, 1)).astype(np.float32)
    y = np.argmax(x.reshape(10, -1) @ w_true, axis=1).astype(np.int32)
    mask = np.ones(10, np.float32)
    mask[-2:] = 0  # padded examples
    old = {"kernel": 0.1 * rng.normal(size=(d, 3)), "bias": 0.1 * rng.normal(size=3)}
    own = {"kernel": old["kernel"] + own_shift, "bias": old["bias"]}
    stack = [{"kernel": s * w_true + 0.05 * rng.normal(size=(d, 3)),
              "bias": 0.1 * rng.normal(size=3)} for s in scales]
    as32 = lambda t: jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), t)
    model = Linear()
    tx = client_optimizer(0.1, 0.0)
    # Steps 2 of 4 validate; P[1] ranks clients 3, 1, 0 (2 last).
    algo = fedfomo(model, tx, k, 0.5, m=3)
    variables = {"params": {"Dense_0": as32(old)}}
    server = algo.server_init(variables)
    models = {"params": {"Dense_0": {n: jnp.stack([as32(s)[n] for s in stack])
                                     for n in ("kernel", "bias")}}}
    affinity = jnp.asarray([[1, 0, 0, 0], [0.4, 0.9, -0.3, 1.2], [0, 0, 1, 0], [0, 0, 0, 1]],
                           jnp.float32)
    server = server._replace(models=models, affinity=affinity)
    state = {"model": {"params": {"Dense_0": as32(own)}}, "old": {"Dense_0": as32(old)}}
    ctx = ClientContext(jax.random.PRNGKey(0), 4, 10, 1, 3, jnp.ones(3))
    local = algo.client_init(server, state, ctx)
    for part in (slice(0, 6), slice(6, 10)):
        batch = {"x": jnp.asarray(np.pad(x[part], ((0, 6 - len(x[part])), (0, 0), (0, 0),
                                                   (0, 0)))),
                 "y": jnp.asarray(np.pad(y[part], (0, 6 - len(y[part])))),
                 "mask": jnp.asarray(np.pad(mask[part], (0, 6 - len(mask[part]))))}
        local, metrics = algo.client_step(local, batch, server)
        assert float(metrics["num_examples"]) == 0  # validation trains nothing
    output, new_state = algo.client_output(local, server)

    ids = [3, 1, 0]
    l_old = _np_loss(old["kernel"], old["bias"], x, y, mask)
    raw = np.array([(l_old - _np_loss(stack[n]["kernel"], stack[n]["bias"], x, y, mask)) /
                    (np.sqrt(np.sum((stack[n]["kernel"] - old["kernel"]) ** 2) +
                             np.sum((stack[n]["bias"] - old["bias"]) ** 2)) + 1e-5)
                    for n in ids])
    return local, output, new_state, dict(raw=raw, ids=ids, stack=stack, own=own)


@pytest.mark.reference("algorithm", "fedfomo")
def test_weights_and_mix_follow_the_formula_by_hand():
    local, output, new_state, want = _hand_case(scales=[3.0, -3.0, 0.5, 2.0])
    raw, ids, stack = want["raw"], want["ids"], want["stack"]
    assert (raw > 0).sum() >= 1 and (raw < 0).sum() >= 1, raw  # both signs exercised
    vector = np.zeros(4)
    vector[ids] = raw
    np.testing.assert_allclose(output["weights"], vector, rtol=1e-5, atol=1e-6)
    w = np.maximum(raw, 0) / np.maximum(raw, 0).sum()
    mix = {n: sum(w[j] * stack[i][n] for j, i in enumerate(ids)) for n in ("kernel", "bias")}
    got = local.train.params["Dense_0"]  # the model training starts from
    for n in mix:
        np.testing.assert_allclose(got[n], mix[n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new_state["old"]["Dense_0"][n], mix[n], rtol=1e-5,
                                   atol=1e-6)
    assert int(local.train.step) == 0 and int(local.val_steps) == 0


def test_no_positive_weight_keeps_the_clients_model():
    # Every candidate far worse than the old model: the client keeps its own (trained)
    # model, which differs from the old one.
    local, output, new_state, want = _hand_case(scales=[-3.0, -3.0, 0.0, -2.0],
                                                own_shift=0.3)
    assert np.all(want["raw"] < 0), want["raw"]
    np.testing.assert_allclose(output["weights"][np.asarray(want["ids"])], want["raw"],
                               rtol=1e-5, atol=1e-6)
    for n in ("kernel", "bias"):
        np.testing.assert_allclose(local.train.params["Dense_0"][n], want["own"][n],
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(new_state["old"]["Dense_0"][n], want["own"][n],
                                   rtol=1e-6, atol=1e-7)




@pytest.mark.slow
def test_rounds_store_models_and_grow_affinities_by_the_weights_mixed():
    cd, model, variables, tx = pfl_setup()
    m = 3
    algo = fedfomo(model, tx, cd.num_clients, 0.3, m=m)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=3, on_host=True)
    # Round 0: every stored model is the initial one, equal to each client's old model:
    # all weights 0, P stays the identity, clients start from the initial model.
    np.testing.assert_array_equal(states[1].server.affinity, np.eye(cd.num_clients))
    for k in sim.sample(0):
        old = jax.tree_util.tree_map(lambda v: v[k], states[1].client_states["old"])
        assert max_rel_err(old, variables["params"]) == 0
    one = tree_bytes(variables)
    assert [s["download_bytes"] for s in stats] == [0.0] + [3.0 * m * one] * 2
    mixed = kept = 0
    for r in (1, 2):
        before, after = states[r], states[r + 1]
        for k in sim.sample(r):
            st = jax.tree_util.tree_map(lambda v: v[k], after.client_states)
            # The stack holds the client's trained model, which it keeps.
            stored = jax.tree_util.tree_map(lambda v: v[k], after.server.models)
            assert max_rel_err(stored, st["model"]) == 0
            # P[k] grew by the raw weights at the M largest entries of P[k] only.
            ids = np.argsort(-np.asarray(before.server.affinity[k]), kind="stable")[:m]
            grown = np.asarray(after.server.affinity[k] - before.server.affinity[k])
            assert np.all(np.delete(grown, ids) == 0)
            raw = grown[ids]
            # The model training started from: the weights' mix of those models, or the
            # client's model as it was where no weight is positive.
            if np.any(raw > 0):
                mixed += 1
                w = np.maximum(raw, 0) / np.maximum(raw, 0).sum()
                want = jax.tree_util.tree_map(lambda s: np.tensordot(w, np.asarray(s)[ids], 1),
                                              before.server.models["params"])
            else:
                kept += 1
                want = jax.tree_util.tree_map(lambda v: v[k],
                                              before.client_states["model"]["params"])
            assert max_rel_err(st["old"], want) < 1e-5
    assert mixed and kept, "both the mix and the fallback were exercised"
    mine = sim.personal_evaluation(states[3])
    assert max_rel_err(mine, states[3].client_states["model"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["none", "batch"])
def test_loop_vmap_and_reference_agree(norm):
    cd, model, variables, tx = pfl_setup(norm=norm)
    algo = fedfomo(model, tx, cd.num_clients, 0.3, m=3)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]
    assert np.max(np.abs(np.asarray(ref.server.affinity) - np.eye(cd.num_clients))) > 1e-3


def test_options_are_checked():
    cd, model, variables, tx = pfl_setup()
    cfg = default_config()
    cfg.algorithm, cfg.local.epochs, cfg.fedfomo.val_epochs = "fedfomo", 1.0, 1.5
    with pytest.raises(ValueError, match=r"fedfomo.val_epochs .*local.epochs \(1\).*got 1.5"):
        registry.from_config(model, cfg)
    with pytest.raises(ValueError, match=r"fedfomo.m must be an integer in \[1, 100000\], got 0"):
        fedfomo(model, tx, 6, 0.2, m=0)
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\), got 1.0"):
        fedfomo(model, tx, 6, 1.0)
    # M is capped at the clients a round (PFLlib) and at K.
    cfg.fedfomo.val_epochs, cfg.partition.num_clients, cfg.participation = 0.2, 20, 0.1
    algo = registry.from_config(model, cfg)
    server = algo.server_init(variables)
    assert int(algo.download_bytes(server, jnp.arange(2), 1)) == 2 * tree_bytes(variables)
    algo = fedfomo(model, tx, 2, 0.2, m=5)
    server = algo.server_init(variables)
    assert int(algo.download_bytes(server, jnp.arange(2), 1)) == 2 * tree_bytes(variables)
