"""FedBABU: a round against an independent body-only loop (head frozen at its initial
values), the head never moving and never sent, fine-tuning (eval.finetune_epochs) moving
the head of the personal models, executors against the reference, and its refusals."""

import jax
import numpy as np
import optax
import pytest

from conftest import PFL_LR, PFL_WORK, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.core import tree_bytes
from fedjax_pan.algorithms.personal.fedbabu import fedbabu
from fedjax_pan.algorithms.fedavg_family.finetune import fine_tuning
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.reference import client_batches
from fedjax_pan.engine.simulation import Tuning


def _body(params):
    return {n: p for n, p in params.items() if n != "head"}


@pytest.mark.reference("algorithm", "fedbabu")
@pytest.mark.slow
def test_a_round_trains_the_body_alone_and_averages_it():
    cd, model, variables, tx = pfl_setup()
    sim, states, stats = pfl_rounds(fedbabu(model, tx), cd, variables, rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]
    head = glob["head"]

    @jax.jit
    def grad(b, x, y):  # the body's gradient only: the head is a constant
        def loss(b):
            logits = model.apply({"params": {**b, "head": head}}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return jax.grad(loss)(b)

    deltas, weights = [], []
    for m in range(len(cohort.ids)):
        body = _body(glob)
        opt = tx.init(body)
        for batch in client_batches(cd, 8, cohort, m):
            u, opt = tx.update(grad(body, batch["x"], batch["y"]), opt, body)
            body = optax.apply_updates(body, u)
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, body, _body(glob)))
        weights.append(float(cohort.weights[m]))
    w = np.asarray(weights) / sum(weights)
    want = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                  _body(glob), *deltas)
    got = states[1].server.params
    assert max_rel_err(_body(got), want) < 1e-5
    assert max_rel_err(_body(got), _body(glob)) > 1e-3  # it trained
    assert max_rel_err(got["head"], head) == 0  # frozen
    # Only the body goes either way.
    body_bytes = tree_bytes(_body(glob))
    assert stats[0]["upload_bytes"] == len(cohort.ids) * body_bytes
    assert stats[0]["download_bytes"] == len(cohort.ids) * body_bytes


def test_the_head_stays_frozen_under_a_server_optimiser_with_weight_decay():
    cd, model, variables, tx = pfl_setup()
    algo = fedbabu(model, tx, optax.adamw(0.01, weight_decay=0.5))
    _, states, _ = pfl_rounds(algo, cd, variables, rounds=2)
    assert max_rel_err(states[-1].server.params["head"], variables["params"]["head"]) == 0
    assert max_rel_err(_body(states[-1].server.params), _body(variables["params"])) > 1e-3


@pytest.mark.slow
def test_fine_tuning_before_evaluation_moves_the_head_of_each_clients_model():
    """The personal models are the global model fine-tuned, body and head (PFLlib's
    fine_tune), by the engine's eval.finetune_epochs service."""
    cd, model, variables, tx = pfl_setup()
    algo = fedbabu(model, tx)
    work = LocalWork(batch_size=8, epochs=1.0)
    tune = fine_tuning(model, tx)
    sim = Simulation(algo, cd, PFL_WORK, make_executor("vmap", algo, PFL_WORK, cd, variables, 3),
                     participation=0.5, aggregation="num_examples", seed=7,
                     tuning=Tuning(tune, work, make_executor("vmap", tune, work, cd,
                                                             variables, 3)))
    state, _ = sim.round(sim.init(variables))
    tuned = sim.personal_evaluation(state)
    for k in range(cd.num_clients):
        mine = jax.tree_util.tree_map(lambda v: v[k], tuned["params"])
        assert max_rel_err(mine["head"], variables["params"]["head"]) > 1e-3
        assert max_rel_err(_body(mine), _body(state.server.params)) > 1e-3
    assert max_rel_err(state.server.params["head"], variables["params"]["head"]) == 0


def test_the_config_builds_it_and_a_model_without_head_is_refused():
    cd, model, variables, _ = pfl_setup()
    cfg = default_config()
    cfg.algorithm = "fedbabu"
    algo = registry.from_config(model, cfg)
    assert algo.personal_variables is None and not registry.ALGORITHMS["fedbabu"].personal
    params = {"fc1": variables["params"]["fc1"], "out": variables["params"]["head"]}
    with pytest.raises(ValueError, match="output layer named 'head'"):
        algo.server_init({"params": params})
    with pytest.raises(ValueError, match="'nope'"):
        fedbabu(model, optax.sgd(PFL_LR), bn="nope")


@pytest.mark.slow
def test_loop_vmap_and_the_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedbabu(model, tx)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
