"""FedGen: a client step's two terms by hand, the server's label distribution and FedAvg
update, the generator learning to be classified by the round's mean head, and the
localised variant over several networks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.fedavg_family.fedgen import GENERATOR_STREAM, Generator, fedgen
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=1.0)
SMALL = dict(noise_dim=6, hidden=12)


def _setup(hidden=(24, 16), seed=0):
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    model = models.build("mlp", 10, hidden=list(hidden))
    variables = models.init(model, jax.random.PRNGKey(seed), (6, 6, 1))
    return cd, model, variables


def _generated(server, key, n):
    net = Generator(10, SMALL["noise_dim"], SMALL["hidden"], 16)
    k1, k2 = jax.random.split(key)
    labels = jax.random.categorical(k1, jnp.log(server.label_dist), shape=(n,))
    noise = jax.random.uniform(k2, (n, SMALL["noise_dim"]))
    stats = {"BatchNorm_0": {"mean": jnp.zeros(12), "var": jnp.ones(12)}}
    z, _ = net.apply({"params": server.generator, "batch_stats": stats}, labels, noise,
                     mutable=["batch_stats"])
    return labels, z


@pytest.mark.reference("algorithm", "fedgen")
def test_a_step_adds_the_cross_entropy_of_generated_representations_through_its_head():
    cd, model, variables = _setup()
    algo = fedgen(model, optax.sgd(0.2), 8, **SMALL)
    server = algo.server_init(variables)
    rng = jax.random.PRNGKey(4)
    local = algo.client_init(server, None, ClientContext(rng, 3, 20, 0, 0, jnp.ones(10)))
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8).at[7].set(0)}
    labels, z = _generated(server, jax.random.fold_in(jax.random.fold_in(
        rng, GENERATOR_STREAM), 0), 8)

    def objective(p):
        logits = model.apply({"params": p}, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        gen = optax.softmax_cross_entropy_with_integer_labels(
            z @ p["head"]["kernel"] + p["head"]["bias"], labels)
        return jnp.sum(ce * batch["mask"]) / 7 + gen.mean()
    want = jax.tree_util.tree_map(lambda w, g: w - 0.2 * g, variables["params"],
                                  jax.grad(objective)(variables["params"]))
    new, metrics = algo.client_step(local, batch, server)
    assert max_rel_err(new.train.params, want) < 1e-5
    assert float(metrics["generated_sum"]) > 0


def _simulation(algo, cd, variables):
    return Simulation(algo, cd, WORK, make_executor("vmap", algo, WORK, cd, variables, 3),
                      participation=0.5, aggregation="num_examples", seed=7)


@pytest.mark.slow
def test_the_server_averages_learns_the_label_mix_and_trains_the_generator():
    cd, model, variables = _setup()
    tx = optax.sgd(0.1)
    frozen = fedgen(model, tx, 8, server_epochs=0, **SMALL)
    sim = _simulation(frozen, cd, variables)
    state = sim.init(variables)
    outs = sim.client_updates(state)
    new, _ = sim.round(state)
    ids = sim.sample(0)
    w = cd.sizes[ids] / cd.sizes[ids].sum()
    mean = jax.tree_util.tree_map(lambda *d: sum(wi * di for wi, di in zip(w, d)),
                                  *[o["delta"] for o in outs])
    want = jax.tree_util.tree_map(jnp.add, variables["params"], mean)
    assert max_rel_err(new.server.params, want) < 1e-5  # FedAvg's rule
    counts = np.asarray(cd.label_counts)[ids].sum(0)
    np.testing.assert_allclose(np.asarray(new.server.label_dist), counts / counts.sum(),
                               rtol=1e-5)
    assert max_rel_err(new.server.generator, state.server.generator) == 0
    # With server steps the generator learns representations the mean head classifies.
    algo = fedgen(model, tx, 8, server_epochs=60, generator_lr=0.01, **SMALL)
    sim = _simulation(algo, cd, variables)
    state = sim.init(variables)
    trained, _ = sim.round(state)
    head = jax.tree_util.tree_map(jnp.add, variables["params"]["head"], mean["head"])

    def ce(server):
        labels, z = _generated(server._replace(label_dist=trained.server.label_dist),
                               jax.random.PRNGKey(9), 256)
        logits = z @ head["kernel"] + head["bias"]
        return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())
    assert ce(trained.server) < 0.7 * ce(state.server)


@pytest.mark.slow
def test_localised_features_average_only_the_head_over_networks_of_one_width():
    cd, model, variables = _setup()
    tx = optax.sgd(0.1)
    algo = fedgen(model, tx, 8, server_epochs=5, localize_features=True, **SMALL)
    sim = _simulation(algo, cd, variables)
    state, stats = sim.round(sim.init(variables))
    assert max_rel_err(state.server.params["fc1"], variables["params"]["fc1"]) == 0
    k = int(sim.sample(0)[0])
    mine = jax.tree_util.tree_map(lambda v: v[k], state.client_states)
    assert max_rel_err(mine["params"]["fc1"], variables["params"]["fc1"]) > 1e-4
    personal = algo.personal_variables(state.server, mine)
    assert max_rel_err(personal["params"]["head"], state.server.params["head"]) == 0
    deep = models.build("mlp", 10, hidden=[32, 16])
    dvars = models.init(deep, jax.random.PRNGKey(1), (6, 6, 1))
    services = Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")
    g = Groups([model, deep], [variables, dvars], np.arange(6) % 2,
               [algo, fedgen(deep, tx, 8, server_epochs=5, localize_features=True, **SMALL)],
               services, "num_examples")
    state, _ = g.round(g.init(None))
    assert max_rel_err(state.server[0].generator, state.server[1].generator) == 0
    assert max_rel_err(state.server[0].params["head"], state.server[1].params["head"]) == 0
    with pytest.raises(ValueError, match=r"sends outputs shaped"):
        Groups([model, deep], [variables, dvars], np.arange(6) % 2,
               [fedgen(model, tx, 8, **SMALL), fedgen(deep, tx, 8, **SMALL)], services,
               "num_examples")
