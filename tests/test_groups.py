"""Clients of several networks (engine.groups): one group is the Simulation to the bit,
groups split by id give the same sums to float rounding, stacked outputs arrive in the
cohort's order, and what cannot be grouped is refused."""

import jax
import numpy as np
import optax
import pytest

from conftest import max_rel_err, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.core import Aggregator
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

WORK = LocalWork(batch_size=8, epochs=1.5)


def _setup():
    _, cd = tiny_clients([27, 39, 19, 36, 62, 13])
    model = models.build("mlp", 10, hidden=[24, 16])
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    return cd, model, variables, fedavg(model, optax.sgd(0.1, momentum=0.9))


def _services(cd):
    return Services(cd, WORK, participation=0.5, seed=7, strategy="vmap")


def test_one_group_is_the_simulation_and_groups_by_id_add_up_to_it():
    cd, model, variables, algo = _setup()
    sim = Simulation(algo, cd, WORK, make_executor("vmap", algo, WORK, cd, variables, 3),
                     participation=0.5, aggregation="num_examples", seed=7)
    want, want_stats = sim.round(sim.init(variables))
    services = _services(cd)
    for arch, exact in ((np.zeros(6, int), True), (np.arange(6) % 3, False)):
        k = int(arch.max()) + 1
        g = Groups([model] * k, [variables] * k, arch, [algo] * k, services, "num_examples")
        state, stats = g.round(g.init(None))
        for server in state.server:
            err = max_rel_err(server.params, want.server.params)
            assert err == 0 if exact else err < 1e-6
        for key in ("real_examples", "download_bytes", "upload_bytes", "clients"):
            assert stats[key] == want_stats[key], key
        assert stats["train_loss"] == pytest.approx(want_stats["train_loss"], rel=1e-6)


def test_stacked_outputs_arrive_in_the_cohorts_order():
    """A stacked rule taking the second output of the cohort (sorted ids): grouped as
    below, the groups' outputs come [3, 5 | 4] and must be put back in order."""
    cd, model, variables, algo = _setup()

    def finalize(outs, weights, arrivals=None):
        return jax.tree_util.tree_map(lambda x: x[1], outs)
    second = algo._replace(aggregator=Aggregator(finalize, stacked=True))
    sim = Simulation(second, cd, WORK, make_executor("vmap", second, WORK, cd, variables, 3),
                     participation=0.5, aggregation="num_examples", seed=7)
    assert list(sim.sample(0)) == [3, 4, 5]
    want, _ = sim.round(sim.init(variables))
    g = Groups([model] * 2, [variables] * 2, np.array([1, 1, 0, 0, 1, 0]), [second] * 2,
               _services(cd), "num_examples")
    state, _ = g.round(g.init(None))
    assert max_rel_err(state.server[0].params, want.server.params) < 1e-6


def test_what_cannot_be_grouped_is_refused():
    cd, model, variables, algo = _setup()
    services = _services(cd)
    with pytest.raises(ValueError, match=r"index into the 2 architectures"):
        Groups([model] * 2, [variables] * 2, np.arange(6) % 3, [algo] * 2, services)
    with pytest.raises(ValueError, match=r"no client has architecture 1"):
        Groups([model] * 2, [variables] * 2, np.zeros(6, int), [algo] * 2, services)
    wide = models.build("mlp", 10, hidden=[40])
    wvars = models.init(wide, jax.random.PRNGKey(1), (6, 6, 1))
    with pytest.raises(ValueError, match=r"architecture 1 \(MLP\) sends outputs shaped"):
        Groups([model, wide], [variables, wvars], np.arange(6) % 2,
               [algo, fedavg(wide, optax.sgd(0.1))], services)
    model_space = algo._replace(aggregator=Aggregator(lambda o, w, a=None: o, stacked=True,
                                                      space="model"))
    with pytest.raises(ValueError, match=r"combine outputs, not models"):
        Groups([model], [variables], np.zeros(6, int), [model_space], services)
