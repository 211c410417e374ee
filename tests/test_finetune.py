"""Fine-tuning before evaluation (FedAvg-C): one full-batch step against its gradient by
hand, every strategy against the sequential reference, personal models tuned from their
own start, the server untouched, and the config's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import PFL_LR, PFL_WORK, max_rel_err, pfl_setup, tiny_clients
from fedjax_pan import models
from fedjax_pan.algorithms.personal.ditto import ditto
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.fedavg_family.finetune import fine_tuning
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.reference import reference_round
from fedjax_pan.engine.simulation import Tuning


def _simulation(algo, cd, model, variables, tx, epochs=1.0, batch_size=8, strategy="vmap"):
    work = LocalWork(batch_size=batch_size, epochs=epochs)
    tune = fine_tuning(model, tx)
    tuning = Tuning(tune, work, make_executor(strategy, tune, work, cd, variables, 3))
    return Simulation(algo, cd, PFL_WORK, make_executor(strategy, algo, PFL_WORK, cd,
                                                        variables, 3),
                      participation=0.5, aggregation="num_examples", seed=7, tuning=tuning)


def test_one_full_batch_step_is_the_gradient_of_the_clients_own_loss():
    """One epoch in one batch of plain SGD: w - lr grad(mean CE over the client's whole
    training part), whatever the order; each client tunes from the global model."""
    _, cd = tiny_clients([5, 9, 7])
    model = models.build("mlp", 10, hidden=[8])
    variables = models.init(model, jax.random.PRNGKey(1), (6, 6, 1))
    tx = optax.sgd(0.3)
    algo = fedavg(model, tx)
    sim = _simulation(algo, cd, model, variables, tx, batch_size=16)
    state = sim.init(variables)
    tuned = sim.personal_evaluation(state)
    for k in range(3):
        rows = np.asarray(cd.index_table[k][:cd.sizes[k]])
        x, y = cd.images[rows], cd.labels[rows]

        def loss(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        want = jax.tree_util.tree_map(lambda w, g: w - 0.3 * g, variables["params"],
                                      jax.grad(loss)(variables["params"]))
        got = jax.tree_util.tree_map(lambda v: v[k], tuned["params"])
        assert max_rel_err(got, want) < 1e-5
        assert max_rel_err(got, variables["params"]) > 1e-3  # it moved
    # Evaluation trains nothing the run keeps: the server is as it was.
    assert max_rel_err(state.server.params, variables["params"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["loop", "sharded"])
def test_strategies_and_the_reference_agree_and_personal_models_tune_from_their_own(strategy):
    cd, model, variables, tx = pfl_setup()
    algo = ditto(model, tx, PFL_LR, lam=0.5)
    sims = {s: _simulation(algo, cd, model, variables, tx, epochs=1.5, strategy=s)
            for s in ("vmap", strategy)}
    state = sims["vmap"].init(variables)
    state, _ = sims["vmap"].round(state)
    got = {s: sim.personal_evaluation(state) for s, sim in sims.items()}
    assert max_rel_err(got[strategy], got["vmap"]) < 1e-5
    # The sequential reference, from each client's own Ditto model.
    sim = sims["vmap"]
    ids = np.arange(cd.num_clients)
    own = jax.vmap(algo.personal_variables, in_axes=(None, 0))(state.server,
                                                               state.client_states)
    from fedjax_pan.engine.clients import client_keys
    from fedjax_pan.engine.execution import Cohort
    from fedjax_pan.engine import simulation as sim_lib
    cohort = Cohort(ids, sim.tuning.work.num_steps(cd.sizes), np.ones(len(ids)),
                    client_keys(jax.random.fold_in(sim._data_key, sim_lib._TUNE_STREAM),
                                state.round, ids),
                    client_keys(jax.random.fold_in(sim._algo_key, sim_lib._TUNE_STREAM),
                                state.round, ids), own, state.round)
    _, ref, _ = reference_round(sim.tuning.algorithm, cd, 8, sim.tuning.server, cohort)
    ref = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *ref)
    assert max_rel_err(got["vmap"], ref) < 1e-5
    assert max_rel_err(got["vmap"], own) > 1e-3


@pytest.mark.slow
def test_the_config_needs_a_test_part_and_a_compiled_round(tmp_path):
    from fedjax_pan.run import experiment
    from test_experiment import config, metrics
    with pytest.raises(experiment.ConfigError,
                       match=r"^config.partition.test_fraction must be > 0 with "
                             r"eval.finetune_epochs = 1.0"):
        experiment.build(config(eval__finetune_epochs=1.0))
    with pytest.raises(experiment.ConfigError, match=r"eval.finetune_epochs"):
        experiment.build(config(eval__finetune_epochs=-1.0))
    cfg = dict(rounds=1, partition__test_fraction=0.25)
    experiment.train(config(**cfg), str(tmp_path / "plain"), progress=False)
    experiment.train(config(eval__finetune_epochs=1.0, **cfg), str(tmp_path / "c"),
                     progress=False)
    plain, tuned = metrics(tmp_path / "plain")[-1], metrics(tmp_path / "c")[-1]
    # The same global model, its clients scored after tuning.
    assert plain["test_accuracy"] == tuned["test_accuracy"]
    assert plain["pfl_accuracy"] != tuned["pfl_accuracy"]
