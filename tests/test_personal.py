"""Partial-sharing personalised FL (Local, FedPer, LG-FedAvg, FedBN) against FedAvg and
against what each must keep to itself."""

import jax
import numpy as np
import pytest
from flax import traverse_util

from conftest import PFL_SIZES as SIZES
from conftest import max_rel_err, pfl_rounds, pfl_setup as _setup
from fedjax_pan.algorithms import fedavg
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing


def _rounds(algo, cd, variables, strategy="vmap", rounds=2):
    sim, states, stats = pfl_rounds(algo, cd, variables, strategy, rounds)
    return sim, states[-1], stats


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


@pytest.mark.parametrize("warmup", ["none", "rounds", "steps"])
def test_nothing_personal_is_fedavg(warmup):
    cd, model, variables, tx = _setup(warmup=warmup)
    _, shared, _ = _rounds(partial_sharing(model, tx, lambda path: False), cd, variables)
    _, avg, _ = _rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(shared.server.params, avg.server.params) < 1e-6
    assert max_rel_err(avg.server.params, variables["params"]) > 1e-2  # it trained


def test_local_never_communicates():
    cd, model, variables, tx = _setup()
    sim, state, stats = _rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables,
                                rounds=1)
    assert all(s["upload_bytes"] == 0 for s in stats)
    assert max_rel_err(state.server.params, variables["params"]) == 0  # nothing arrives
    sampled = set(sim.sample(0).tolist())
    init = _flat(variables["params"])
    for k in range(len(SIZES)):
        own = {key: v[k] for key, v in state.client_states["params"].items()}
        moved = max(np.max(np.abs(own[key] - init[key])) for key in init)
        assert (moved > 0) == (k in sampled), k


def test_fedper_keeps_heads_and_shares_the_body():
    cd, model, variables, tx = _setup()
    sim, state, _ = _rounds(partial_sharing(model, tx, PERSONAL["fedper"]), cd, variables,
                            rounds=1)
    server, init = _flat(state.server.params), _flat(variables["params"])
    for key in init:
        changed = np.max(np.abs(server[key] - init[key])) > 0
        assert changed == (not key.startswith("head/")), key  # the global head never moves
    assert set(state.client_states["params"]) == {"head/bias", "head/kernel"}
    # Each sampled client's head is its own, not their mean.
    heads = state.client_states["params"]["head/kernel"][np.sort(sim.sample(0))]
    assert np.max(np.abs(heads[0] - heads[1])) > 1e-4


def test_fedbn_leaves_each_clients_norm_layers_out_of_the_average():
    cd, model, variables, tx = _setup(norm="batch")
    algo = partial_sharing(model, tx, PERSONAL["fedbn"])
    sim, state, _ = _rounds(algo, cd, variables, rounds=1)
    server, init = _flat(state.server.params), _flat(variables["params"])
    norm_keys = [k for k in init if k.split("/")[0].endswith("_norm")]
    assert norm_keys and set(state.client_states["params"]) == set(norm_keys)
    for key in init:  # norm parameters untouched on the server; the rest averaged
        assert (np.max(np.abs(server[key] - init[key])) > 0) == (key not in norm_keys), key
    # A client's norm parameters and statistics are exactly what its own training left:
    # run that client alone from the same round and compare.
    cohort = sim.cohort(sim.init(variables), 0)
    m = 0
    alone = sim.executor.run(sim.init(variables).server, cohort._replace(
        ids=cohort.ids[m:m + 1], steps=cohort.steps[m:m + 1], weights=np.ones(1),
        data_keys=cohort.data_keys[m:m + 1], rngs=cohort.rngs[m:m + 1],
        client_states=jax.tree_util.tree_map(lambda x: x[cohort.ids[m]][None],
                                             sim.init(variables).client_states)))
    client = cohort.ids[m]
    for key in norm_keys:
        np.testing.assert_allclose(state.client_states["params"][key][client],
                                   alone.client_states["params"][key][0], rtol=1e-6)
    stats = state.client_states["model_state"]["batch_stats"]
    assert stats and all(np.max(np.abs(v[client] - alone.client_states["model_state"]
                                       ["batch_stats"][k][0])) < 1e-5
                         for k, v in stats.items())
    # Evaluated on its own data a client uses its own norm layers.
    mine = sim.personal_evaluation(state)
    assert np.allclose(_flat(mine["params"])[norm_keys[0]][client],
                       state.client_states["params"][norm_keys[0]][client])
