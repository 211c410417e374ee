"""PartialFed: the partial initialisation for given strategies by hand, one adaptive
strategy step against its straight-through Gumbel formula, Fix's limits (all layers:
FedAvg; none: Local), the adaptive strategy over rounds, loop / vmap / reference,
options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import PFL_LR, PFL_WORK, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import fedavg, registry
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.partialfed import partial_init, partialfed, strategy_noise
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.config.defaults import default_config

NAMES = ("fc1", "fc2", "head")  # the pFL tests' MLP, in call order


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _own(variables, seed=3, scale=0.05):
    key = jax.random.PRNGKey(seed)
    return jax.tree_util.tree_map(lambda v: v + scale * jax.random.normal(key, v.shape),
                                  variables)


def _ctx(steps=4, k=0):
    return ClientContext(jax.random.PRNGKey(11), steps, 27, k, 1, jnp.ones(10))


def _state(own, logits, trained=1.0):
    return {"variables": own, "logits": {n: jnp.float32(v) for n, v in logits.items()},
            "trained": jnp.float32(trained)}


def _assert_layers(params, glob, own, from_global):
    for n in NAMES:
        want = glob[n] if n in from_global else own[n]
        for a, b in zip(jax.tree_util.tree_leaves(params[n]), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=n)


@pytest.mark.reference("algorithm", "partialfed")
def test_partial_initialisation_by_hand():
    _, model, variables, tx = pfl_setup()
    own = _own(variables)
    glob, mine = variables["params"], own["params"]
    algo = partialfed(model, tx, 0.5)
    server = algo.server_init(variables)
    logits = {"fc1": 0.3, "fc2": -0.2, "head": 0.0}  # ties load the global layer
    local = algo.client_init(server, _state(own, logits), _ctx())
    _assert_layers(local.train.params, glob, mine, {"fc1", "head"})
    assert int(local.strategy_steps) == 2 and int(local.train.step) == 0
    # A client that has never trained takes the global model whatever its logits.
    local = algo.client_init(server, _state(own, logits, 0.0), _ctx())
    _assert_layers(local.train.params, glob, mine, set(NAMES))
    # Fix: the bottom `layers` from the global model (None: all but the head).
    for layers, loaded in ((None, {"fc1", "fc2"}), (1, {"fc1"}), (0, set()), (3, set(NAMES))):
        fix = partialfed(model, tx, strategy="fix", layers=layers)
        local = fix.client_init(server, _state(own, {n: -1.0 for n in NAMES}), _ctx())
        _assert_layers(local.train.params, glob, mine, loaded)
        assert int(local.strategy_steps) == 0
        _assert_layers(fix.personal_variables(server, _state(own, {}))["params"], glob,
                       mine, loaded)
    # Statistics follow their layer's scope in every collection.
    g = {"params": {"a": jnp.ones(2), "a_norm": jnp.ones(1)}, "batch_stats": {"a_norm": {
        "mean": jnp.ones(1)}}}
    o = jax.tree_util.tree_map(lambda x: 2 * x, g)
    mixed = partial_init(g, o, {"a": jnp.asarray(True), "a_norm": jnp.asarray(False)})
    np.testing.assert_array_equal(mixed["params"]["a"], [1, 1])
    np.testing.assert_array_equal(mixed["params"]["a_norm"], [2])
    np.testing.assert_array_equal(mixed["batch_stats"]["a_norm"]["mean"], [2])


@pytest.mark.reference("algorithm", "partialfed")
def test_a_strategy_step_follows_the_straight_through_gumbel_formula():
    cd, model, variables, _ = pfl_setup()
    lr, tau = 0.5, 0.7
    algo = partialfed(model, optax.sgd(0.1), 0.5, strategy_lr=lr, temperature=tau)
    server = algo.server_init(variables)
    own = _own(variables, scale=0.2)
    alpha = {"fc1": 0.4, "fc2": -0.3, "head": 0.1}
    local = algo.client_init(server, _state(own, alpha), _ctx())
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    new, metrics = algo.client_step(local, batch, server)

    a = np.array([alpha[n] for n in NAMES])
    z = (a + np.asarray(strategy_noise(local.key, local.strategy_steps, 3))) / tau
    hard = z > 0
    glob, mine = variables["params"], own["params"]
    mixed = {n: glob[n] if h else mine[n] for n, h in zip(NAMES, hard)}

    def ce(p):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    g = jax.grad(ce)(mixed)
    sig = 1 / (1 + np.exp(-z))
    want = {}
    for i, n in enumerate(NAMES):
        ds = sum(float(np.sum(np.asarray(gl, np.float64) * (np.asarray(go) - np.asarray(mo))))
                 for gl, go, mo in zip(*(jax.tree_util.tree_leaves(t[n])
                                         for t in (g, glob, mine))))
        want[n] = a[i] - lr * ds * sig[i] * (1 - sig[i]) / tau
    for n in NAMES:
        np.testing.assert_allclose(float(new.logits[n]), want[n], rtol=1e-5, atol=1e-7)
    assert max(abs(float(new.logits[n]) - alpha[n]) for n in NAMES) > 1e-4  # they moved
    # The model restarts from the new logits' choice; no training step was taken.
    _assert_layers(new.train.params, glob, mine, {n for n in NAMES if want[n] >= 0})
    assert int(new.train.step) == 0 and int(new.strategy_steps) == 1
    np.testing.assert_allclose(float(metrics["loss_sum"]), 8 * float(ce(mixed)), rtol=1e-5)


@pytest.mark.slow
def test_fix_spans_fedavg_and_local_training():
    cd, model, variables, tx = pfl_setup()
    _, every, _ = pfl_rounds(partialfed(model, tx, strategy="fix", layers=3), cd, variables)
    _, f, _ = pfl_rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(every[-1].server.params, f[-1].server.params) < 1e-6
    _, none, _ = pfl_rounds(partialfed(model, tx, strategy="fix", layers=0), cd, variables)
    _, loc, _ = pfl_rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables)
    mine, theirs = _flat(none[-1].client_states["variables"]["params"]), _flat(
        loc[-1].client_states["params"])
    assert set(mine) == set(theirs)
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_adaptive_strategies_are_learned_by_trained_clients_only():
    cd, model, variables, tx = pfl_setup()
    algo = partialfed(model, tx, 0.4)
    _, first, _ = pfl_rounds(algo, cd, variables, rounds=1)
    assert all(float(np.max(np.abs(v))) == 0
               for v in first[1].client_states["logits"].values())  # round 0: untrained
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=3)
    again = {int(k) for r in (1, 2) for k in sim.sample(r)
             if any(k in sim.sample(q) for q in range(r))}
    assert again, "a client sampled twice"
    logits = np.stack([np.asarray(states[3].client_states["logits"][n]) for n in NAMES], 1)
    for k in range(cd.num_clients):
        assert (np.max(np.abs(logits[k])) > 0) == (k in again), k
    # The personal model: the current global model and the client's own, by its logits.
    mine = sim.personal_evaluation(states[3])
    glob = states[3].server.params
    for k in range(cd.num_clients):
        st = jax.tree_util.tree_map(lambda v: v[k], states[3].client_states)
        loaded = set(NAMES) if float(st["trained"]) == 0 else {
            n for i, n in enumerate(NAMES) if logits[k, i] >= 0}
        _assert_layers(jax.tree_util.tree_map(lambda v: v[k], mine["params"]), glob,
                       st["variables"]["params"], loaded)
    assert all(np.isfinite(s["train_loss"]) for s in stats)


def test_options_are_checked():
    _, model, variables, tx = pfl_setup()
    with pytest.raises(ValueError, match="partialfed.strategy must be one of .*got 'greedy'"):
        partialfed(model, tx, strategy="greedy")
    with pytest.raises(ValueError, match=r"temperature .*got 0.001"):
        partialfed(model, tx, 0.5, temperature=0.001)
    algo = partialfed(model, tx, strategy="fix", layers=9)
    with pytest.raises(ValueError, match=r"partialfed.layers must lie in \[0, 3\].*got 9"):
        algo.client_state_init(algo.server_init(variables))
    cfg = default_config()
    cfg.algorithm, cfg.local.epochs, cfg.partialfed.strategy_epochs = "partialfed", 1.0, 1.0
    with pytest.raises(ValueError, match=r"partialfed.strategy_epochs .*local.epochs \(1\)"):
        registry.from_config(model, cfg)
    cfg.partialfed.strategy = "fix"  # Fix has no strategy steps: no conflict
    registry.from_config(model, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["adaptive", "fix"])
def test_loop_vmap_and_reference_agree(strategy):
    cd, model, variables, _ = pfl_setup()
    cfg = default_config()
    cfg.algorithm, cfg.partialfed.strategy = "partialfed", strategy
    cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.warmup = PFL_LR, 0.9, "none"
    cfg.local.epochs, cfg.partialfed.strategy_epochs = PFL_WORK.epochs, 0.5
    algo = registry.from_config(model, cfg)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]
    assert max_rel_err(ref.server.params, variables["params"]) > 1e-3
