"""The algorithm interface: the mean rule, stacked rules under every execution strategy,
and what clients and the server are told."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import core
from fedjax_pan.algorithms.aggregation import trimmed_mean
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.reference import reference_round

SIZES = [27, 39, 19, 36, 62, 13]
WORK = LocalWork(batch_size=8, epochs=1.0)


@pytest.mark.reference("aggregation", "mean")
@pytest.mark.parametrize("aggregation", ["num_examples", "uniform"])
def test_the_mean_rule_is_fedavgs_weighted_average(aggregation):
    # McMahan et al. 2017, Alg. 1: w <- sum_k n_k / n w_k (num_examples); uniform: 1 / M.
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    ex = make_executor("loop", algo, WORK, cd, variables, 3)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, aggregation=aggregation, seed=2)
    state = sim.init(variables)
    ids = sim.sample(0)
    n = np.asarray([SIZES[k] for k in ids], np.float64)
    weights = n / n.sum() if aggregation == "num_examples" else np.full(len(ids), 1 / len(ids))
    models = [jax.tree_util.tree_map(lambda w, d: np.asarray(w, np.float64) + np.asarray(d),
                                     state.server.params, o["delta"])
              for o in sim.client_updates(state)]
    new, _ = sim.round(state)
    want = jax.tree_util.tree_map(lambda *ms: sum(a * m for a, m in zip(weights, ms)), *models)
    for a, b in zip(jax.tree_util.tree_leaves(new.server.params),
                    jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Seen(NamedTuple):
    ids: jax.Array
    rounds: jax.Array
    counts: jax.Array
    steps: jax.Array


def _recording_algorithm(num_clients):
    """Clients send what their context says (weighted sums); the server keeps the totals and
    what RoundInfo says, so the test can compare both with the cohort."""

    def server_init(variables):
        return {"seen": _Seen(jnp.zeros(()), jnp.zeros(()), jnp.zeros(10), jnp.zeros(())),
                "info_ids": jnp.zeros(3, jnp.int32), "info_k": jnp.zeros((), jnp.int32),
                "info_round": jnp.zeros((), jnp.int32), "steps_seen": jnp.zeros(())}

    def client_init(server, client_state, ctx):
        return {"seen": _Seen(ctx.client_id.astype(jnp.float32),
                              ctx.round.astype(jnp.float32), ctx.label_counts,
                              jnp.zeros(())), "server_round": server["info_round"]}

    def client_step(local, batch, server):
        seen = local["seen"]._replace(steps=local["seen"].steps + 1.0)
        return {**local, "seen": seen}, {"loss_sum": jnp.zeros(()),
                                         "num_examples": jnp.sum(batch["mask"]),
                                         "steps_sum": jnp.ones(())}

    def client_output(local, server):
        return local["seen"], None

    def server_update(server, total, info):
        return {"seen": total, "info_ids": info.client_ids,
                "info_k": jnp.asarray(info.num_clients, jnp.int32), "info_round": info.round,
                "steps_seen": total.steps}

    return core.FederatedAlgorithm(server_init, core.no_client_state, client_init,
                                   client_step, client_output, server_update, lambda s: s,
                                   core.weighted_sum)


@pytest.mark.parametrize("strategy,group", [("loop", None), ("vmap", 3)])
def test_clients_and_server_are_told_who_they_are(strategy, group):
    ds, cd = tiny_clients(SIZES)
    algo = _recording_algorithm(len(SIZES))
    ex = make_executor(strategy, algo, WORK, cd, {"params": {"w": jnp.zeros(3)}}, 3, group)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, aggregation="uniform", seed=3)
    state = sim.init(None)
    state, _ = sim.round(state)
    state, stats = sim.round(state)
    ids = sim.sample(1)
    seen = state.server["seen"]
    assert float(seen.ids) == ids.sum() and float(seen.rounds) == 1 * len(ids)
    counts = np.stack([np.bincount(np.asarray(ds.train_labels)[np.asarray(
        cd.index_table)[k, :SIZES[k]]], minlength=10) for k in ids]).sum(0)
    np.testing.assert_array_equal(np.asarray(seen.counts), counts)
    assert float(seen.steps) == sim.steps[ids].sum()
    np.testing.assert_array_equal(state.server["info_ids"], ids)
    assert int(state.server["info_k"]) == len(SIZES) and int(state.server["info_round"]) == 1
    # An algorithm's own metric sums reach the round's statistics, per example.
    assert stats["train_steps"] == pytest.approx(sim.steps[ids].sum() / stats["real_examples"])


def test_the_reference_tells_clients_the_same():
    ds, cd = tiny_clients(SIZES)
    algo = _recording_algorithm(len(SIZES))
    ex = make_executor("loop", algo, WORK, cd, {"params": {"w": jnp.zeros(3)}}, 3)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, aggregation="uniform", seed=3)
    state = sim.init(None)
    engine, _ = sim.round(state)
    server, _, _ = reference_round(algo, cd, WORK.batch_size, state.server, sim.cohort(state, 0))
    for a, b in zip(jax.tree_util.tree_leaves(engine.server), jax.tree_util.tree_leaves(server)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))


def test_stacked_rules_give_the_same_numbers_under_every_strategy():
    # The rules themselves are checked against numpy (test_aggregation.py); here the
    # stacking plumbing.
    _, cd = tiny_clients(SIZES)
    _, variables, algo = tiny_fedavg()
    algo = algo._replace(aggregator=trimmed_mean(0.34))
    servers = {}
    for strategy, group in [("loop", None), ("vmap", 1), ("vmap", 2)]:
        ex = make_executor(strategy, algo, WORK, cd, variables, 3, group)
        sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=5)
        state = sim.init(variables)
        for _ in range(2):
            state, _ = sim.round(state)
        servers[f"{strategy}/{group}"] = state.server
    state = sim.init(variables)
    for r in range(2):
        server, _, _ = reference_round(algo, cd, WORK.batch_size, state.server,
                                       sim.cohort(state, r))
        state = state._replace(server=server, round=r + 1)
    for name, server in servers.items():
        assert max_rel_err(server, state.server) < 1e-5, name
    assert max_rel_err(state.server.params, variables["params"]) > 1e-2


def test_tree_bytes_counts_every_leaf_at_its_dtype_width():
    tree = {"w": np.zeros((3, 4), np.float32), "b": jnp.zeros((5,), jnp.bfloat16),
            "n": [np.zeros((), np.int64), jax.ShapeDtypeStruct((2, 2), jnp.float16)], "x": None}
    assert core.tree_bytes(tree) == 3 * 4 * 4 + 5 * 2 + 8 + 4 * 2
    assert core.tree_bytes({}) == 0


def test_federated_algorithm_fills_the_stateless_global_model_defaults():
    def fn(*args):
        return args
    algo = core.federated_algorithm(fn, fn, fn, fn, fn, aggregator=core.every_output)
    assert algo.client_state_init is core.no_client_state
    assert algo.eval_variables is core.server_model
    assert algo.aggregator is core.every_output and algo.download_bytes is None
    assert (algo.server_init, algo.client_init, algo.client_step, algo.client_output,
            algo.server_update) == (fn,) * 5
    named = core.federated_algorithm(fn, fn, fn, fn, fn, client_state_init=len,
                                     eval_variables=repr)
    assert (named.client_state_init, named.eval_variables) == (len, repr)


def test_sends_counts_the_named_fields_and_what_a_function_picks():
    class Server(NamedTuple):
        a: jax.Array
        b: dict

    server = Server(jnp.zeros((3, 2), jnp.float32), {"w": jnp.zeros(5, jnp.int8)})
    ids = jnp.arange(2)
    assert core.sends("a")(server, ids, 0) == 24
    assert core.sends("a", "b")(server, ids, 0) == 29
    assert core.sends(lambda s: s.b["w"][:2], "a")(server, ids, 0) == 26


def test_per_client_copies_and_set_rows_replaces_the_present_clients_rows():
    store = core.per_client({"w": jnp.asarray([1.0, 2.0])}, 4)
    assert store["w"].shape == (4, 2)
    rows = {"w": jnp.asarray([[5.0, 5.0], [7.0, 7.0]])}
    new = core.set_rows(store, jnp.asarray([3, 1]), rows)
    np.testing.assert_array_equal(new["w"], [[1, 2], [7, 7], [1, 2], [5, 5]])
    kept = core.set_rows(store, jnp.asarray([3, 1]), rows, jnp.asarray([True, False]))
    np.testing.assert_array_equal(kept["w"], [[1, 2], [1, 2], [1, 2], [5, 5]])
