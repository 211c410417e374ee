"""The slides' personalised masked aggregation: pruning and the personalised aggregate by
hand, a round against FedAvg's clients, the download's byte count, and a config run with an
upload mask."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms.uploads import compression as comp
from fedjax_pan.run import experiment
from fedjax_pan.algorithms import fedavg
from fedjax_pan.algorithms.personal.pfedeff import personalised, pfedeff, prune

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

tree_map = jax.tree_util.tree_map


@pytest.mark.reference("algorithm", "pfedeff")
def test_prune_and_personalised_aggregate_by_hand():
    w = {"a": jnp.asarray([0.5, -2.0, 0.1, 3.0]), "b": jnp.asarray([1.0, -1.0, 0.2])}
    p = prune(w, 0.5)  # ceil(0.5 d): 2 of 4, 2 of 3
    np.testing.assert_array_equal(p["a"], [0.0, -2.0, 0.0, 3.0])
    np.testing.assert_array_equal(p["b"], [1.0, -1.0, 0.0])
    g = {"a": jnp.asarray([10.0, 20.0, 30.0, 40.0]), "b": jnp.asarray([1.0, 2.0, 3.0])}
    mixed = personalised(p, g, 0.25)  # 0.25 own + 0.75 M * g
    np.testing.assert_allclose(mixed["a"], [0.0, 0.25 * -2 + 15.0, 0.0, 0.75 + 30.0])
    np.testing.assert_allclose(mixed["b"], [1.0, 1.25, 0.0])


def test_a_round_against_fedavgs_clients_and_the_download_count():
    cd, model, variables, tx = pfl_setup()
    keep, lam = 0.25, 0.5
    algo = pfedeff(model, tx, num_clients=cd.num_clients, keep=keep, lam=lam)
    sim, states, _ = pfl_rounds(algo, cd, variables, "loop", rounds=1)
    plain_sim, plain, _ = pfl_rounds(fedavg(model, tx), cd, variables, "loop", rounds=1)
    # Round 0: every client starts from the initial model, so the global step is FedAvg's
    # and each client keeps its FedAvg-trained model pruned.
    assert max_rel_err(states[1].server.base.params, plain[1].server.params) < 1e-6
    ids = sim.sample(0)
    outs = plain_sim.client_updates(plain[0])
    for m, k in enumerate(ids):
        want = prune(tree_map(jnp.add, variables["params"], outs[m]["delta"]), keep)
        got = tree_map(lambda x: x[k], states[1].client_states["params"])
        assert max_rel_err(got, want) < 1e-5
        for leaf in jax.tree_util.tree_leaves(got):
            assert np.count_nonzero(np.asarray(leaf)) <= comp.kept(keep, leaf.size)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(states[1].server.pruned)), ids)
    params = variables["params"]
    dense = comp.message_bytes(comp.identity(), params)
    sparse = comp.message_bytes(comp.top_k(keep), params)
    # (a second run: the first one's states were updated in place by its rounds)
    _, states, stats = pfl_rounds(algo, cd, variables, "loop", rounds=2)
    assert stats[0]["download_bytes"] == len(ids) * dense
    ids1 = sim.sample(1)
    assert stats[1]["download_bytes"] == sum(sparse if k in ids else dense for k in ids1)
    # Clients are scored on their own pruned models.
    personal = sim.personal_evaluation(states[2])
    assert max_rel_err(personal["params"], states[2].client_states["params"]) == 0


@pytest.mark.slow  # a config run end to end (the round is checked above)
def test_config_run_with_an_upload_mask(tmp_path):
    cfg = config(rounds=2, algorithm="pfedeff", partition__test_fraction=0.25,
                 pfedeff__keep=0.5, compression__upload__method="top_k",
                 compression__upload__ratio=0.5)
    experiment.train(cfg, str(tmp_path), progress=False)
    rows = metrics(str(tmp_path))
    assert rows[0]["upload_bytes"] < rows[0]["download_bytes"] / 1.8
    assert rows[1]["download_bytes"] < rows[0]["download_bytes"]
    assert 0 < rows[-1]["client_accuracy_mean"] <= 1
