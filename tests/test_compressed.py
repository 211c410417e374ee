"""The compression wrapper: a round's server update against the clients' own outputs
compressed by hand (top-k, error feedback's per-client residual, majority vote, the
download's public model and its byte count, the pre-training mask), the same numbers under
every executor, refusals, and through a config: byte totals and exact resume."""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients, tiny_fedavg
from fedjax_pan.algorithms.uploads import compression as comp
from fedjax_pan.run import experiment
from fedjax_pan.algorithms.uploads import compressed
from fedjax_pan.algorithms import features
from fedjax_pan.algorithms.aggregation import median
from fedjax_pan.algorithms.core import tree_bytes
from fedjax_pan.algorithms.personal.pfedeff import pfedeff
from fedjax_pan.algorithms.fedavg_family.scaffold import scaffold
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.engine import LocalWork, Simulation, make_executor

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

WORK = LocalWork(batch_size=8, epochs=1)
MODEL, VARIABLES, FEDAVG = tiny_fedavg()
_, CLIENTS = tiny_clients([20, 30, 25, 18, 22, 16])
tree_map = jax.tree_util.tree_map


def _sim(algo, strategy="loop"):
    ex = make_executor(strategy, algo, WORK, CLIENTS, VARIABLES, 3)
    return Simulation(algo, CLIENTS, WORK, ex, 0.5, seed=0)


def _plain_outputs(round_index=0, server=None):
    """Each sampled client's plain FedAvg output, run alone, and the ids."""
    sim = _sim(FEDAVG)
    state = sim.init(VARIABLES)
    state = state._replace(round=round_index, server=server or state.server)
    return sim.sample(round_index), sim.client_updates(state)


def _close(a, b, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


@pytest.mark.parametrize("strategy", ["loop", pytest.param("vmap", marks=pytest.mark.slow)])
def test_top_k_upload_server_update_by_hand(strategy):
    t = comp.top_k(0.2)
    algo = compressed.with_compression(FEDAVG, VARIABLES, t)
    sim = _sim(algo, strategy)
    state = sim.init(VARIABLES)
    new, stats = sim.round(state)
    _, outs = _plain_outputs()
    sent = [comp.apply(t, o["delta"], None, jax.random.PRNGKey(0))[0] for o in outs]
    want = tree_map(lambda w, *d: w + sum(d) / len(d), state.server.params, *sent)
    _close(new.server.params, want)
    per_client = comp.message_bytes(t, VARIABLES["params"])
    assert per_client < tree_bytes(VARIABLES["params"]) / 3
    assert stats["upload_bytes"] == 3 * per_client
    assert stats["download_bytes"] == 3 * tree_bytes(VARIABLES)


def test_error_feedback_keeps_each_clients_residual_across_rounds():
    t = comp.error_feedback(comp.top_k(0.1))
    sim = _sim(compressed.with_compression(FEDAVG, VARIABLES, t))
    state = sim.init(VARIABLES)
    new, _ = sim.round(state)
    ids, outs = _plain_outputs()
    # (a copy: the next round updates the states in place)
    residual = jax.device_get(new.client_states.transform_state.residual)
    for m, k in enumerate(ids):
        kept = comp.apply(comp.top_k(0.1), outs[m]["delta"], None, jax.random.PRNGKey(0))[0]
        _close(tree_map(lambda r: r[k], residual),
               tree_map(jnp.subtract, outs[m]["delta"], kept))
    others = np.setdiff1d(np.arange(6), ids)
    for leaf in jax.tree_util.tree_leaves(residual):
        assert not np.any(np.asarray(leaf)[others])
    # Next round, a client sends top-k of its new update plus its residual.
    ids1, outs1 = _plain_outputs(1, new.server)
    again, _ = sim.round(new)
    for m, k in enumerate(ids1):
        p = tree_map(lambda d, r: d + r[k], outs1[m]["delta"], residual)
        kept = comp.apply(comp.top_k(0.1), p, None, jax.random.PRNGKey(0))[0]
        _close(tree_map(lambda r: r[k], again.client_states.transform_state.residual),
               tree_map(jnp.subtract, p, kept))


@pytest.mark.reference("compression", "vote")
def test_majority_vote_by_hand():
    algo = compressed.with_compression(FEDAVG, VARIABLES, comp.sign(), vote=True)
    state = _sim(algo).init(VARIABLES)
    new, _ = _sim(algo).round(state)
    _, outs = _plain_outputs()

    def voted(w, *deltas):
        signs = sum(np.sign(np.asarray(d)) for d in deltas)
        scale = np.mean([np.abs(np.asarray(d)).mean() for d in deltas])
        return np.asarray(w) + np.sign(signs) * scale
    want = tree_map(voted, state.server.params, *[o["delta"] for o in outs])
    _close(new.server.params, want, atol=1e-5)


def test_download_sends_the_compressed_global_update_and_counts_missed_rounds():
    t = comp.top_k(0.3)
    algo = compressed.with_compression(FEDAVG, VARIABLES, comp.identity(), download=t,
                                       num_clients=6)
    sim = _sim(algo)
    state = sim.init(VARIABLES)
    np.testing.assert_array_equal(state.server.synced, -np.ones(6))
    full, message = tree_bytes(VARIABLES["params"]), comp.message_bytes(t, VARIABLES["params"])
    new, stats = sim.round(state)
    assert stats["download_bytes"] == 3 * full  # nobody held a model yet
    ids0 = sim.sample(0)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(new.server.synced) == 0), ids0)
    true = new.server.inner.params  # the server's model: the plain FedAvg step
    _, outs = _plain_outputs()
    _close(true, tree_map(lambda w, *d: w + sum(d) / 3, state.server.public, *[
        o["delta"] for o in outs]))
    diff = tree_map(jnp.subtract, true, state.server.public)
    sent = comp.apply(t, diff, None, jax.random.PRNGKey(0))[0]
    _close(new.server.public, tree_map(jnp.add, state.server.public, sent))
    # Round 1's clients: one message if they took part in round 0, else the whole model.
    ids1 = sim.sample(1)
    _, stats1 = sim.round(new)
    want = sum(message if k in ids0 else full for k in ids1)
    assert stats1["download_bytes"] == want
    # Clients train from the public model: the evaluated model is the server's own.
    _close(algo.eval_variables(new.server)["params"], true, atol=0)


@pytest.mark.reference("compression", "mask_before")
def test_pre_training_mask_drives_the_pruned_weights_to_zero():
    mask = compressed.MaskBefore(ratio=0.5, score="magnitude", l1=1e4, lr=0.05)
    algo = compressed.with_compression(FEDAVG, VARIABLES, comp.identity(), mask_before=mask)
    sim = _sim(algo)
    state = sim.init(VARIABLES)
    out = sim.client_updates(state)[0]
    model = tree_map(jnp.add, state.server.params, out["delta"])
    for w, w0 in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(
            state.server.params)):
        keep = np.asarray(comp.top_k_mask(jnp.abs(w0), comp.kept(0.5, w0.size)))
        assert np.all(np.asarray(w)[~keep] == 0)
        assert np.count_nonzero(np.asarray(w)[keep]) == keep.sum()


def test_importance_mask_before_training_scores_the_first_batch():
    mask = compressed.MaskBefore(ratio=0.25, score="importance", l1=1e4, lr=0.05)

    def grad_fn(params, model_state, batch):
        from fedjax_pan.algorithms import local
        return jax.grad(lambda w: local.mean_loss(MODEL, w, model_state, batch)[0])(params)
    algo = compressed.with_compression(FEDAVG, VARIABLES, comp.identity(), mask_before=mask,
                                       grad_fn=grad_fn)
    state = _sim(algo).init(VARIABLES)
    out = _sim(algo).client_updates(state)[0]
    model = tree_map(jnp.add, state.server.params, out["delta"])
    for path, w in jax.tree_util.tree_leaves_with_path(model):
        # At most k weights survive; every kept kernel weight (drawn nonzero) trains on.
        nonzero = np.count_nonzero(np.asarray(w))
        assert nonzero <= comp.kept(0.25, w.size)
        if path[-1].key == "kernel":
            assert nonzero == comp.kept(0.25, w.size)


def test_personal_models_read_the_algorithms_own_client_state_under_error_feedback():
    algo = pfedeff(MODEL, client_optimizer(0.05), num_clients=6)
    wrapped = compressed.with_compression(algo, VARIABLES, comp.error_feedback(comp.top_k(0.2)))
    server = wrapped.server_init(VARIABLES)
    client_state = wrapped.client_state_init(server)
    assert isinstance(client_state, compressed.CompressedClient)
    _close(wrapped.personal_variables(server, client_state),
           algo.personal_variables(server, client_state.inner), atol=0)


def test_refusals():
    sc = scaffold(MODEL, client_optimizer(0.05), 0.05)
    with pytest.raises(ValueError, match="neither"):
        compressed.with_compression(sc, VARIABLES, comp.top_k(0.1))
    with pytest.raises(ValueError, match="majority vote"):
        compressed.with_compression(FEDAVG._replace(aggregator=median()), VARIABLES,
                                    comp.sign(), vote=True)
    with pytest.raises(ValueError, match="target"):
        compressed.with_compression(FEDAVG, VARIABLES, comp.sign(), target="gradient")
    personal = pfedeff(MODEL, client_optimizer(0.05), num_clients=6)
    with pytest.raises(ValueError, match="personal models"):
        compressed.with_compression(personal, VARIABLES, comp.top_k(0.1),
                                    download=comp.top_k(0.1), num_clients=6)


def test_the_default_config_turns_no_feature_on():
    assert not list(features.active(config()))
    assert [f.section for f, *_ in features.active(config(compression__mask_before="magnitude"))] \
        == ["compression"]


def test_byte_totals_count_every_round(tmp_path):
    cfg = config(rounds=4, eval__every=2, compression__upload__method="qsgd",
                 compression__upload__levels=4)
    experiment.train(cfg, str(tmp_path), progress=False)
    rows = metrics(str(tmp_path))
    assert [r["round"] for r in rows] == [2, 4]
    up, down = rows[0]["upload_bytes"], rows[0]["download_bytes"]
    assert 1 / 8 < up / down < 1 / 7.9  # 4 bits a value against 32, and each leaf's norm
    for r, row in zip((2, 4), rows):
        assert row["upload_bytes_total"] == r * up
        assert row["download_bytes_total"] == r * down
    m = round(cfg.participation * cfg.partition.num_clients)
    assert rows[0]["upload_bytes_per_client"] == up / m
    assert rows[0]["download_bytes_per_client"] == down / m


@pytest.mark.slow  # resume for a kind of client state (the slow run covers every kind)
def test_resume_with_residuals_and_public_model_equals_the_uninterrupted_run(tmp_path):
    changes = dict(compression__upload__method="top_k", compression__upload__error_feedback=True,
                   compression__download__method="qsgd", checkpoint_every=2)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=4, **changes), full, progress=False)
    experiment.train(config(rounds=3, **changes), part, progress=False)
    shutil.rmtree(os.path.join(part, "checkpoints", "3"))
    experiment.train(config(rounds=4, **changes), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)
