"""DP-FedAvg: clipped updates, the fixed denominator and the noise's measured std, adaptive
clipping's geometric step by hand, the split noise multiplier, Poisson rounds without
clients, refusals, and a config run logging a growing epsilon."""

import glob
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients, tiny_fedavg
from fedjax_pan.algorithms.uploads import compression as comp
from fedjax_pan.run import experiment
from fedjax_pan.algorithms.uploads import privacy
from fedjax_pan.algorithms.uploads import dp
from fedjax_pan.algorithms.core import RoundInfo
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

WORK = LocalWork(batch_size=8, epochs=1)
MODEL, VARIABLES, FEDAVG = tiny_fedavg()
_, CLIENTS = tiny_clients([20, 30, 25, 18, 22, 16])
tree_map = jax.tree_util.tree_map


def _sim(algo, participation=0.5, sampling="uniform"):
    ex = make_executor("loop", algo, WORK, CLIENTS, VARIABLES, 3)
    return Simulation(algo, CLIENTS, WORK, ex, participation, seed=0, sampling=sampling)


def _norm(tree):
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                             for x in jax.tree_util.tree_leaves(tree))))


@pytest.mark.reference("privacy", "dp_fedavg")
def test_updates_are_clipped_and_averaged_over_the_expected_count():
    clip, m = 0.01, 4.0  # m: a fixed denominator other than the 3 who took part
    algo = dp.with_dp(FEDAVG, clip, 0.0, m, seed=0)
    sim = _sim(algo)
    state = sim.init(VARIABLES)
    plain = _sim(FEDAVG)
    outs = plain.client_updates(plain.init(VARIABLES))
    assert all(_norm(o["delta"]) > clip for o in outs)  # every client is clipped here
    mine = sim.client_updates(state)
    for o, p in zip(mine, outs):
        assert _norm(o["update"]["delta"]) <= clip * (1 + 1e-5)
        np.testing.assert_allclose(_norm(o["update"]["delta"]), clip, rtol=1e-5)
        ratio = clip / _norm(p["delta"])
        for a, b in zip(jax.tree_util.tree_leaves(o["update"]["delta"]),
                        jax.tree_util.tree_leaves(p["delta"])):
            np.testing.assert_allclose(a, b * ratio, rtol=1e-4, atol=1e-8)
    new, _ = sim.round(state)
    want = tree_map(lambda w, *d: w + sum(d) / m, state.server.inner.params,
                    *[o["update"]["delta"] for o in mine])
    for a, b in zip(jax.tree_util.tree_leaves(new.server.inner.params),
                    jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.reference("privacy", "dp_fedavg")
def test_the_noise_has_std_z_times_clip_over_m():
    z, clip, m = 1.3, 0.7, 5.0
    algo = dp.with_dp(FEDAVG, clip, z, m, seed=3)
    server = algo.server_init(VARIABLES)
    zero = {"update": {"delta": tree_map(jnp.zeros_like, VARIABLES["params"]),
                       "model_state": {}}}
    update = jax.jit(algo.server_update)
    draws = []
    for r in range(40):
        info = RoundInfo(jnp.int32(r), jnp.zeros(3, jnp.int32), jnp.ones(3) / 3, 6)
        new = update(server, zero, info)
        draws.append(np.concatenate([np.ravel(a - b) for a, b in zip(
            jax.tree_util.tree_leaves(new.inner.params),
            jax.tree_util.tree_leaves(server.inner.params))]))
    draws = np.stack(draws)  # 40 rounds x d coordinates
    n = draws.size
    assert abs(draws.mean()) < 4 * z * clip / m / np.sqrt(n)
    # The sample std of n normals is within 4 / sqrt(2n) of the truth (relative).
    np.testing.assert_allclose(draws.std(), z * clip / m, rtol=4 / np.sqrt(2 * n))
    assert not np.allclose(draws[0], draws[1])  # fresh noise each round
    again = update(server, zero, RoundInfo(jnp.int32(0), jnp.zeros(3, jnp.int32),
                                           jnp.ones(3) / 3, 6))
    np.testing.assert_array_equal(  # from (seed, round) alone
        np.concatenate([np.ravel(a - b) for a, b in zip(
            jax.tree_util.tree_leaves(again.inner.params),
            jax.tree_util.tree_leaves(server.inner.params))]), draws[0])


@pytest.mark.reference("privacy", "adaptive_clipping")
def test_adaptive_clipping_steps_the_norm_geometrically_by_hand():
    # Andrew et al.'s estimate from centred bits: b = (sum_k (b_k - 1/2) + noise) / m + 1/2,
    # here with m = 4 expected clients and a cohort of 3, where the uncentred
    # sum_k b_k / m would differ by 1/8.
    quantile, lr, clip, m = 0.5, 0.2, 0.1, 4.0
    adaptive = dp.AdaptiveClip(quantile, lr, count_std=1e-9)  # the count's noise: none
    algo = dp.with_dp(FEDAVG, clip, 0.0, m, seed=0, adaptive=adaptive)
    sim = _sim(algo)
    state = sim.init(VARIABLES)
    outs = sim.client_updates(state)
    assert len(outs) == 3
    sent = [float(o["unclipped"]) for o in outs]
    norms = [_norm(o["update"]["delta"]) for o in outs]
    below = [float(n < clip * (1 - 1e-6)) for n in norms]
    assert sent == [b - 0.5 for b in below]  # each client sends its centred bit
    new, stats = sim.round(state)
    b = (sum(below) - 3 * 0.5) / m + 0.5
    np.testing.assert_allclose(float(new.server.clip),
                               clip * np.exp(-lr * (b - quantile)), rtol=1e-6)
    assert stats["upload_bytes"] == 3 * (comp.message_bytes(comp.identity(),
                                                            VARIABLES["params"]) + 1)


@pytest.mark.reference("privacy", "adaptive_clipping")
def test_counting_query_moves_by_half_when_a_client_joins():
    # The sensitivity the split z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) assumes: adding
    # one client, whatever its bit, moves the noiseless estimate's numerator by 1/2.
    adaptive = dp.AdaptiveClip(0.5, 1.0, count_std=1e-9)
    for clip in (1e-6, 1e6):  # every update clipped / none clipped
        algo = dp.with_dp(FEDAVG, clip, 0.0, 4.0, seed=0, adaptive=adaptive)
        sim = _sim(algo)
        state = sim.init(VARIABLES)
        outs = sim.client_updates(state)
        sums = [sum(float(o["unclipped"]) for o in outs[:n]) for n in (2, 3)]
        assert abs(sums[1] - sums[0]) == 0.5


def test_split_noise_multiplier():
    # (z^-2 - (2 sigma_b)^-2)^(-1/2): z = 1, sigma_b = 1 -> (1 - 1/4)^(-1/2).
    np.testing.assert_allclose(dp.update_noise_multiplier(1.0, 1.0), (0.75) ** -0.5)
    assert dp.update_noise_multiplier(0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="z < 2 sigma_b"):
        dp.update_noise_multiplier(2.0, 1.0)


def test_poisson_rounds_without_clients_still_add_noise():
    algo = dp.with_dp(FEDAVG, 0.1, 1.0, 0.06, seed=0)
    sim = _sim(algo, participation=0.01, sampling="poisson")
    state = sim.init(VARIABLES)
    empty = [r for r in range(20) if len(sim.sample(r)) == 0]
    assert empty, "q = 0.01 of 6 clients: most rounds sample nobody"
    state = state._replace(round=empty[0])
    new, stats = sim.round(state)
    assert stats["upload_bytes"] == 0 and stats["download_bytes"] == 0
    assert new.round == empty[0] + 1
    moved = [np.abs(np.asarray(a - b)).max() for a, b in zip(
        jax.tree_util.tree_leaves(new.server.inner.params),
        jax.tree_util.tree_leaves(state.server.inner.params))]
    assert max(moved) > 0
    # Without a fixed denominator an empty round leaves the server as it was.
    plain = _sim(FEDAVG, participation=0.01, sampling="poisson")
    s0 = plain.init(VARIABLES)._replace(round=empty[0])
    s1, _ = plain.round(s0)
    for a, b in zip(jax.tree_util.tree_leaves(s1.server), jax.tree_util.tree_leaves(s0.server)):
        np.testing.assert_array_equal(a, b)


def test_poisson_sampling_is_seeded_and_has_the_expected_size():
    sim = _sim(FEDAVG, participation=0.5, sampling="poisson")
    sizes = [len(sim.sample(r)) for r in range(400)]
    assert len(set(sizes)) > 3
    assert abs(np.mean(sizes) - 3.0) < 4 * np.sqrt(6 * 0.25 / 400)
    np.testing.assert_array_equal(sim.sample(7), _sim(FEDAVG, 0.5, "poisson").sample(7))


def test_fields_dp_does_not_change_read_the_inner_server():
    """A personalised algorithm's functions reach DP-FedAvg's server state unwrapped."""
    def echo(name):
        return lambda *args: (name, *args)
    algo = FEDAVG._replace(personal_variables=echo("personal"), personal_adapt=echo("adapt"),
                           download_bytes=echo("download"))
    wrapped = dp.with_dp(algo, 0.1, 0.0, 3.0, seed=0)
    server = wrapped.server_init(VARIABLES)
    inner = server.inner
    assert wrapped.personal_variables(server, "cs") == ("personal", inner, "cs")
    assert wrapped.personal_adapt(server, "cs", "batch") == ("adapt", inner, "cs", "batch")
    assert wrapped.download_bytes(server, "ids", 2) == ("download", inner, "ids", 2)
    assert wrapped.client_state_init(server) is None
    for a, b in zip(jax.tree_util.tree_leaves(wrapped.eval_variables(server)),
                    jax.tree_util.tree_leaves(FEDAVG.eval_variables(inner))):
        np.testing.assert_array_equal(a, b)


def test_refusals():
    bn_model, bn_variables, bn_algo = tiny_fedavg(norm="batch")
    algo = dp.with_dp(bn_algo, 1.0, 1.0, 3.0, seed=0)
    with pytest.raises(ValueError, match="BatchNorm"):
        algo.server_init(bn_variables)
    with pytest.raises(ValueError, match="clip > 0"):
        dp.with_dp(FEDAVG, 0.0, 1.0, 3.0, seed=0)
    with pytest.raises(ConfigError, match="config.privacy.clip=1.0: DP-FedAvg releases only"):
        from fedjax_pan.run import assembly
        assembly.build(config(privacy__clip=1.0, model__norm="batch"))
    for changes, match in (
            ({"privacy__clip": 1.0, "aggregation__weights": "num_examples"}, "uniform"),
            ({"privacy__noise_multiplier": 1.0}, "need privacy.clip > 0"),
            ({"privacy__clip": 1.0, "privacy__adaptive": True,
              "privacy__noise_multiplier": 2.0, "partition__num_clients": 20,
              "participation": 0.5}, "must be below 2"),
            ({"privacy__clip": 1.0, "aggregation__rule": "median"}, "rule must be 'mean'")):
        with pytest.raises(ConfigError, match=match):
            experiment.validate(config(**changes))


def test_sampling_defaults_to_poisson_under_dp():
    from fedjax_pan.algorithms.sampling import cohort_sampling, expected_clients
    assert cohort_sampling(config()) == "uniform"
    cfg = config(privacy__clip=1.0)
    assert cohort_sampling(cfg) == "poisson"
    k = cfg.partition.num_clients
    assert expected_clients(cfg, k) == cfg.participation * k
    assert cohort_sampling(config(privacy__clip=1.0, sampling="uniform")) == "uniform"


@pytest.mark.slow  # a config run end to end (the accountant is checked in test_privacy)
def test_config_run_logs_a_growing_epsilon(tmp_path):
    cfg = config(rounds=3, privacy__clip=0.05, privacy__noise_multiplier=1.1,
                 privacy__delta=1e-4)
    summary = experiment.train(cfg, str(tmp_path), progress=False)
    assert summary["sampling"] == "poisson"  # 'auto' under DP
    rows = metrics(str(tmp_path))
    eps = [r["dp_epsilon"] for r in rows]
    assert eps[0] < eps[1] < eps[2]
    k = cfg.partition.num_clients
    m = max(1, round(cfg.participation * k))
    np.testing.assert_allclose(eps[2], privacy.epsilon(1.1, 3, 1e-4, "poisson", k, m,
                                                       rate=cfg.participation))


# A DP run as small as a run gets: what these tests check is in the files it writes.
TINY = {"model__options": {"hidden": [16]}, "dataset__train_limit": 400,
        "partition__num_clients": 8, "eval__batch_size": 500}


def _strict_json(text):
    """json.loads refusing the NaN and Infinity tokens that are not JSON."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_clipping_without_noise_writes_strict_json(tmp_path):
    """z = 0: epsilon is infinite, which JSON has no value for: null in every file the run
    writes (also rewritten from the checkpoint on resume), inf in TensorBoard's scalars."""
    from tensorboard.backend.event_processing import event_accumulator
    w = str(tmp_path / "w")
    experiment.train(config(rounds=1, privacy__clip=0.05, **TINY), w, progress=False)
    acc = event_accumulator.EventAccumulator(w, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("dp_epsilon")] == [(1, math.inf)]
    experiment.train(config(rounds=2, privacy__clip=0.05, **TINY), w, resume=True,
                     progress=False)
    with open(os.path.join(w, "metrics.jsonl")) as f:
        rows = [_strict_json(line) for line in f]
    assert [(r["round"], r["dp_epsilon"]) for r in rows] == [(1, None), (2, None)]
    written = ["summary.json", "config.json", "checkpoints/*/meta/metadata"]
    paths = [p for pattern in written for p in glob.glob(os.path.join(w, pattern))]
    assert {os.path.basename(p) for p in paths} == {"summary.json", "config.json",
                                                    "metadata"}
    for path in paths:
        with open(path) as f:
            _strict_json(f.read())


@pytest.mark.slow  # 8 + 7 + 1 rounds end to end
def test_resumed_dp_run_logs_the_same_epsilon_to_the_bit(tmp_path):
    """A DP run with compressed uploads stopped after round 6 and resumed to 8 logs what
    one run of 8 rounds logs, dp_epsilon included (the ledger of the resumed run composes
    from its first round on: `privacy.Ledger`). A run killed after round 6 resumes on the
    same path: a new process, a new ledger, the checkpoint of round 6."""
    dp_on = dict(privacy__clip=0.05, privacy__noise_multiplier=1.1, privacy__delta=1e-4,
                 compression__upload__method="top_k", compression__upload__error_feedback=True,
                 **TINY)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=8, **dp_on), full, progress=False)
    experiment.train(config(rounds=6, **dp_on), part, progress=False)
    experiment.train(config(rounds=8, **dp_on), part, resume=True, progress=False)
    want, got = metrics(full), metrics(part)
    assert [r["dp_epsilon"] for r in got] == [r["dp_epsilon"] for r in want]
    assert got == want and len(got) == 8
