"""FedALA: one ALA step against its formula, untrained clients skipping ALA, W learned in
[0, 1] once clients have trained, the personal model as the ALA mix, options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.personal.fedala import fedala
from fedjax_pan.config.defaults import default_config

ETA = 0.7


@pytest.mark.reference("algorithm", "fedala")
def test_an_ala_step_follows_its_formula():
    cd, model, variables, tx = pfl_setup()
    algo = fedala(model, tx, 0.5, layers=2, eta=ETA)
    server = algo.server_init(variables)
    key = jax.random.PRNGKey(3)
    own_params = jax.tree_util.tree_map(
        lambda v: v + 0.05 * jax.random.normal(key, v.shape), variables["params"])
    weights = {n: jax.tree_util.tree_map(lambda v: jnp.full(v.shape, 0.6), own_params[n])
               for n in ("fc2", "head")}
    state = {"params": own_params, "weights": weights, "trained": jnp.float32(1)}
    local = algo.client_init(server, state, ClientContext(key, 4, 27, 0, 1, jnp.ones(10)))
    own = {n: own_params[n] for n in ("fc2", "head")}
    glob = {n: variables["params"][n] for n in ("fc2", "head")}
    mixed = jax.tree_util.tree_map(lambda o, g: o + 0.6 * (g - o), own, glob)
    assert max_rel_err({n: local.train.params[n] for n in mixed}, mixed) < 1e-6
    assert max_rel_err(local.train.params["fc1"], variables["params"]["fc1"]) == 0
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}

    def loss(top):
        logits = model.apply({"params": {**variables["params"], **top}}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    g = jax.grad(loss)(mixed)
    want_w = jax.tree_util.tree_map(lambda w, gt, o, gl: np.clip(w - ETA * gt * (gl - o), 0, 1),
                                    weights, g, own, glob)
    new, _ = algo.client_step(local, batch, server)
    assert max_rel_err(new.weights, want_w) < 1e-5
    assert max_rel_err(new.weights, weights) > 1e-3  # W moved
    want_theta = jax.tree_util.tree_map(lambda o, gl, w: o + (gl - o) * w, own, glob, want_w)
    assert max_rel_err({n: new.train.params[n] for n in want_theta}, want_theta) < 1e-5
    assert int(new.train.step) == 0 and int(new.ala_steps) == int(local.ala_steps) - 1


def test_untrained_clients_skip_ala_and_trained_ones_learn_w():
    cd, model, variables, tx = pfl_setup()
    algo = fedala(model, tx, 0.4)
    _, first, _ = pfl_rounds(algo, cd, variables, rounds=1)
    w1 = np.asarray(first[1].client_states["weights"]["head"]["kernel"])
    assert np.all(w1 == 1.0)  # round 0: nobody had trained, nothing to adapt
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=3)
    adapted = {int(k) for r in (1, 2) for k in sim.sample(r)
               if any(k in sim.sample(q) for q in range(r))}
    assert adapted, "a client sampled twice"
    w3 = np.asarray(states[3].client_states["weights"]["head"]["kernel"])
    for k in range(cd.num_clients):
        assert np.all((0 <= w3[k]) & (w3[k] <= 1))
        assert (np.max(np.abs(w3[k] - 1)) > 0) == (k in adapted), k
    # The personal model is the ALA mix of the current global model (global if untrained).
    mine = sim.personal_evaluation(states[3])
    glob = states[3].server.params
    for k in range(cd.num_clients):
        st = jax.tree_util.tree_map(lambda v: v[k], states[3].client_states)
        head = jax.tree_util.tree_map(lambda o, g, w: o + (g - o) * w, st["params"]["head"],
                                      glob["head"], st["weights"]["head"])
        if float(st["trained"]) == 0:
            head = glob["head"]
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[k], mine["params"]["head"]),
                           head) < 1e-6
        assert max_rel_err(jax.tree_util.tree_map(lambda v: v[k], mine["params"]["fc1"]),
                           glob["fc1"]) == 0


def test_options_are_checked():
    cd, model, variables, tx = pfl_setup()
    cfg = default_config()
    cfg.algorithm, cfg.local.epochs, cfg.fedala.ala_epochs = "fedala", 1.0, 1.0
    with pytest.raises(ValueError, match=r"fedala.ala_epochs .*local.epochs \(1\).*got 1"):
        registry.from_config(model, cfg)
    algo = fedala(model, tx, 0.5, layers=9)
    with pytest.raises(ValueError, match=r"fedala.layers must lie in \[1, 3\].*got 9"):
        algo.client_state_init(algo.server_init(variables))
    # From a config: refused when the run is assembled, before any round (exit 2).
    from fedjax_pan.run import experiment
    from test_experiment import config
    with pytest.raises(experiment.ConfigError, match=r"^config.fedala: fedala.layers must lie "
                                                     r"in \[1, 4\] .*got 99$"):
        experiment.build(config(algorithm="fedala", fedala__layers=99,
                                partition__test_fraction=0.25))


@pytest.mark.parametrize("name", ["mlp", "cnn", "vgg9", "resnet20", "mobilenet"])
def test_the_adapted_layers_are_the_top_of_the_network_on_every_architecture(name):
    """ALA mixes the head (layers=1), in the model's call order, which an interceptor on
    a real forward pass records independently of any naming convention."""
    import flax.linen as flax_nn

    from fedjax_pan import models
    model = models.build(name, 10)
    variables = jax.eval_shape(lambda: models.init(model, jax.random.PRNGKey(0), (32, 32, 3)))
    called = []

    def record(next_fun, args, kwargs, context):
        path = context.module.path
        if context.method_name == "__call__" and len(path) == 1 and path[0] not in called:
            called.append(path[0])
        return next_fun(*args, **kwargs)
    with flax_nn.intercept_methods(record):
        jax.eval_shape(lambda v: model.apply(v, jnp.zeros((1, 32, 32, 3))), variables)
    order = [scope for scope in called if scope in variables["params"]]
    assert models.layer_order(model, variables["params"]) == order
    tx = optax.sgd(0.1)
    for layers, top in ((1, order[-1:]), (3, order[-3:])):
        algo = fedala(model, tx, 0.5, layers=layers)
        state = jax.eval_shape(lambda v: algo.client_state_init(algo.server_init(v)),
                               variables)
        assert sorted(state["weights"]) == sorted(top) and top[-1] == "head"
