"""The engine's services for drivers give exactly what a Simulation of the same federation
computes: the same samples, steps and keys, and the same training through their executors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from conftest import max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import FederatedAlgorithm
from fedjax_pan.engine import LocalWork, SimState, Simulation, make_executor
from fedjax_pan.engine.protocol import Round, RoundInfo
from fedjax_pan.engine.services import RoundDefaults, Services

SIZES = [20, 30, 25, 15, 40, 12]
WORK = LocalWork(batch_size=8, epochs=1.5)


def _federation():
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    ex = make_executor("loop", algo, WORK, cd, variables, 3)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=11)
    return cd, variables, algo, sim, Services(cd, WORK, participation=0.5, seed=11,
                                              strategy="loop")


def test_what_the_config_names_arrives_resolved_with_fedavgs_defaults():
    """A driver takes the server optimiser, the cohort sampling and the attack from its
    services (the assembly resolves them); by default sgd(1) (the update is minus the mean
    delta), uniform cohorts and no attack."""
    services = _federation()[-1]
    assert services.sampling == "uniform" and services.attack is None
    g = {"w": jnp.asarray([0.5, -2.0], jnp.float32)}
    update, _ = services.server_tx.update(g, services.server_tx.init(g))
    np.testing.assert_array_equal(update["w"], -g["w"])


def test_samples_steps_and_keys_are_the_simulations():
    cd, variables, _, sim, services = _federation()
    state = sim.init(variables)
    assert services.num_sampled == sim.num_sampled == 3
    for r in range(4):
        ids = services.sample(r)
        np.testing.assert_array_equal(ids, sim.sample(r))
        mine, theirs = services.cohort(ids, r, None), sim.cohort(state, r)
        np.testing.assert_array_equal(mine.ids, theirs.ids)
        np.testing.assert_array_equal(mine.steps, theirs.steps)
        for a, b in ((mine.data_keys, theirs.data_keys), (mine.rngs, theirs.rngs)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another stage of the same round draws other batch orders, the same init keys.
    other = services.cohort(ids, 3, None, stage=1)
    assert not np.array_equal(np.asarray(other.data_keys), np.asarray(mine.data_keys))
    np.testing.assert_array_equal(np.asarray(other.rngs), np.asarray(mine.rngs))
    # A group's own rows: keys still follow the global ids.
    rows = services.cohort(ids, 3, None, rows=np.arange(len(ids)))
    np.testing.assert_array_equal(rows.ids, np.arange(len(ids)))
    np.testing.assert_array_equal(np.asarray(rows.data_keys), np.asarray(mine.data_keys))


def test_training_a_cohort_equals_the_simulations_round():
    """FedAvg's round driven by hand on the services (train the cohort, average, update)
    gives the Simulation's new server state; the executor is built once per key."""
    cd, variables, algo, sim, services = _federation()
    state = sim.init(variables)
    expected, stats = sim.round(state)
    ids = services.sample(0)
    weights = np.ones(len(ids))
    cohort = services.cohort(ids, 0, None)._replace(weights=weights)
    result = services.train("fedavg", algo, variables, cohort, server=state.server)
    assert services.executor("fedavg", algo, variables) is services.executor(
        "fedavg", None, None)  # cached: the second call builds nothing
    mean = algo.aggregator.finalize(result.output_sum, np.float32(len(ids)))
    server = algo.server_update(state.server, mean, RoundInfo(0, ids, weights / len(ids),
                                                                cd.num_clients))
    assert max_rel_err(server, expected.server) < 1e-6
    own = services.statistics(jax.device_get(result.metrics),
                              real_examples=services.real_examples(ids))
    assert abs(own["train_loss"] - stats["train_loss"]) < 1e-6
    assert own["real_examples"] == stats["real_examples"]


# The example of a driver in docs/guides/writing.md: server logic that inspects every
# client's update before aggregating (here it drops the largest update), written on the
# engine's services only.

@dataclasses.dataclass
class DropLargest(RoundDefaults):
    """FedAvg without the client whose update is largest (a defence's shape)."""

    algorithm: FederatedAlgorithm  # the clients' work; its aggregator stacked (each output)
    services: Services

    def __post_init__(self):
        self.num_sampled = self.services.num_sampled

    def init(self, variables):
        self.variables = variables
        return SimState(self.algorithm.server_init(variables), None, 0)

    def round(self, state):
        r, server = state.round, state.server
        ids = self.services.sample(r)
        cohort = self.services.cohort(ids, r, None)
        result = self.services.train("clients", self.algorithm, self.variables, cohort, server)
        norms = sum(jnp.sum(x ** 2, axis=tuple(range(1, x.ndim)))
                    for x in jax.tree_util.tree_leaves(result.outputs["delta"]))
        keep = jnp.argsort(norms)[:-1]  # all but the largest
        mean = jax.tree_util.tree_map(lambda x: jnp.mean(x[keep], axis=0), result.outputs)
        info = RoundInfo(r, ids[np.asarray(keep)], jnp.full(len(keep), 1.0 / len(keep)),
                         self.services.num_clients)
        server = self.algorithm.server_update(server, mean, info)
        stats = self.services.statistics(
            jax.device_get(result.metrics), real_examples=self.services.real_examples(ids),
            computed_examples=result.computed_examples)
        return SimState(server, None, r + 1), stats

    def evaluation(self, server):
        return None, self.algorithm.eval_variables(server)

    def personal_evaluation(self, state):
        return None

    def personal_groups(self, state):
        return None


def test_a_driver_written_on_the_services_runs_and_drops_the_largest_update():
    from fedjax_pan.algorithms import median
    cd, variables, algo, sim, services = _federation()
    driver = DropLargest(algo._replace(aggregator=median()), services)
    assert isinstance(driver, Round)
    state = driver.init(variables)
    new, stats = driver.round(state)
    assert new.round == 1 and np.isfinite(stats["train_loss"])
    # By hand: the sampled clients trained alone from the same server, the largest dropped.
    ids = services.sample(0)
    outs = []
    for k in ids:
        one = services.cohort(np.asarray([k]), 0, None)
        # FedAvg's streamed mean over one client (weight 1) is that client's output.
        res = services.train(("one", int(k)), algo, variables, one, state.server,
                             per_round=1)
        outs.append(res.output_sum)
    norms = [sum(float(jnp.sum(x ** 2)) for x in jax.tree_util.tree_leaves(o["delta"]))
             for o in outs]
    kept = [o for o, n in zip(outs, norms) if n < max(norms)]
    mean = jax.tree_util.tree_map(lambda *x: sum(x) / len(x), *kept)
    expected = algo.server_update(state.server, mean, None)
    assert max_rel_err(new.server.params, expected.params) < 1e-5

