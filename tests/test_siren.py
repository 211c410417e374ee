"""Siren: the server's decision from alarms, accuracies and cosines in each of its cases,
the clients' alarm rule (attackers alarming every round, as the authors', or never), an
alarming client starting from its own model, penalty and reward, and a config run that
resumes exactly."""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_fedavg
from fedjax_pan.run import assembly, experiment
from fedjax_pan.algorithms.robust import siren
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

ALIGNED = np.ones((5, 5))  # every update points the same way


def _detect(alarm, accuracy, cosine=ALIGNED, barred=None):
    barred = np.zeros(len(alarm), bool) if barred is None else np.asarray(barred)
    return siren.detect(np.asarray(alarm, bool), np.asarray(accuracy, float),
                        np.asarray(cosine, float), barred, 0.1)


def test_no_alarm_uses_everyone():
    np.testing.assert_array_equal(_detect([0] * 5, [0.1, 0.9, 0.5, 0.2, 0.3]), [1] * 5)


@pytest.mark.reference("algorithm", "siren")
def test_agreeing_alarms_with_worse_silent_clients_use_the_alarms():
    # Alarms 0, 1 (best 0.8; 0.75 >= 0.72 passes); the silent best 0.6 < 0.72.
    use = _detect([1, 1, 0, 0, 0], [0.8, 0.75, 0.6, 0.5, 0.1])
    np.testing.assert_array_equal(use, [1, 1, 0, 0, 0])


def test_abnormal_alarms_are_rejected_with_the_silent_clients():
    cos = ALIGNED.copy()
    cos[0, 2] = cos[2, 0] = -0.1  # alarm 2 points away from the reference (alarm 0)
    # Alarm 1 is below 0.9 * 0.8 = 0.72: abnormal too.
    use = _detect([1, 1, 1, 0, 0], [0.8, 0.7, 0.79, 0.9, 0.9], cos)
    np.testing.assert_array_equal(use, [1, 0, 0, 0, 0])


@pytest.mark.reference("algorithm", "siren")
def test_false_alarms_use_the_silent_clients_that_pass():
    cos = ALIGNED.copy()
    cos[3, 4] = cos[4, 3] = 0.0  # silent 4 is orthogonal to the silent best (3)
    # Alarms agree (0.5, 0.48); the silent best 0.9 >= 0.45: the alarms were false.
    use = _detect([1, 1, 0, 0, 0], [0.5, 0.48, 0.85, 0.9, 0.9], cos)
    np.testing.assert_array_equal(use, [0, 0, 1, 1, 0])
    # Silent 2 below 0.9 * 0.9 = 0.81 fails as well.
    use = _detect([1, 1, 0, 0, 0], [0.5, 0.48, 0.8, 0.9, 0.9])
    np.testing.assert_array_equal(use, [0, 0, 0, 1, 1])


def test_one_alarm_checks_everyone_against_the_best():
    use = _detect([0, 1, 0, 0, 0], [0.9, 0.5, 0.86, 0.7, 0.95])
    np.testing.assert_array_equal(use, [1, 0, 1, 0, 1])  # 0.95 * 0.9 = 0.855
    # A barred client is never the reference, nor counted as an alarm.
    use = _detect([0, 1, 0, 0, 0], [0.9, 0.5, 0.86, 0.7, 0.95], barred=[0, 0, 0, 0, 1])
    np.testing.assert_array_equal(use, [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(
        _detect([0, 1, 0, 0, 0], [0.9, 0.5, 0.86, 0.7, 0.95], barred=[0, 1, 0, 0, 0]),
        [1] * 5)


@pytest.mark.reference("algorithm", "siren")
def test_penalty_and_reward_by_hand():
    penalty = np.array([0.0, 1.0, 2.0, 0.5, 3.0, 7.0])
    ids = np.array([0, 1, 2, 3, 4])
    use = np.array([False, True, False, True, True])
    use, new = siren.penalize(penalty, ids, use, limit=3, forgive=0.5)
    # 0: +1; 1: used, 1 - 0.5; 2: +1 = 3 -> barred; 3: 0.5 - 0.5; 4: at 3 already, barred.
    np.testing.assert_allclose(new, [1.0, 0.5, 3.0, 0.0, 3.0, 7.0])
    np.testing.assert_array_equal(use, [False, True, False, True, False])


def test_an_alarming_client_starts_from_its_own_model():
    model, variables, _ = tiny_fedavg()
    from fedjax_pan.algorithms.local import client_optimizer
    algo = siren.siren_clients(model, client_optimizer(0.05, 0.0, 0.0, 0.0, "none", 0))
    server = algo.server_init(variables)
    own = jax.tree_util.tree_map(lambda x: x + 1.0, variables)
    ctx = ClientContext(jax.random.PRNGKey(0), jnp.int32(1), jnp.int32(10), jnp.int32(0),
                        jnp.int32(1), jnp.zeros(10))
    for alarm, want in ((True, own), (False, variables)):
        state = {"model": own, "alarm": jnp.asarray(alarm), "trained": jnp.asarray(True)}
        local = algo.client_init(server, state, ctx)
        jax.tree_util.tree_map(np.testing.assert_array_equal, local.params, want["params"])


@pytest.mark.reference("algorithm", "siren")
def test_the_alarm_rule_by_hand(monkeypatch):
    exp = assembly.build(config(rounds=2, algorithm="siren", partition__test_fraction=0.2,
                                attack__kind="sign_flip", attack__fraction=0.2))
    sim = exp.simulation
    state = sim.init(exp.variables)
    k = exp.config.partition.num_clients
    ids = sim.services.sample(1)
    own_correct = np.full(k, 8.0)
    glob = np.full(k, 7.0)
    glob[ids[1]] = 7.7  # 0.8 > 0.77 + 0.032 fails: no alarm
    counts = np.full(k, 10.0)

    def evaluate(variables, personal=False, vmapped=False, clients=None, net=None):
        return {"correct": own_correct if personal else glob, "count": counts}
    monkeypatch.setattr(sim, "client_evaluate", evaluate)
    trained = jnp.ones(k, bool).at[ids[2]].set(False)  # never trained: no model to compare
    state = state._replace(client_states={**state.client_states, "trained": trained}, round=1)
    alarm = sim.alarms(state, ids)
    want = np.ones(len(ids), bool)
    want[1] = want[2] = False
    # Attackers alarm every round (the authors' `mal_agent_other`: alarm=1), whatever
    # their accuracies.
    np.testing.assert_array_equal(alarm, want | sim.malicious[ids])
    sim.o["malicious_alarm"] = "never"
    np.testing.assert_array_equal(sim.alarms(state, ids), want & ~sim.malicious[ids])


@pytest.mark.reference("algorithm", "siren")
def test_alarming_attackers_wake_the_server_check(monkeypatch):
    """No honest client alarms; the authors' attackers do (one alarm: everyone is checked
    against the best), so the server rejects the attacker; silent attackers would leave
    every update in use."""
    exp = assembly.build(config(rounds=2, algorithm="siren", partition__test_fraction=0.2,
                                attack__kind="sign_flip", attack__fraction=0.2,
                                siren__malicious_alarm="always"))
    sim = exp.simulation
    state = sim.init(exp.variables)._replace(round=1)
    ids = sim.services.sample(1)
    k = exp.config.partition.num_clients
    sim.malicious = np.zeros(k, bool)
    sim.malicious[ids[0]] = True  # one attacker in the cohort, by hand
    bad = sim.malicious[ids]
    counts, correct = np.full(k, 10.0), np.full(k, 7.0)  # own model never beats the global

    def evaluate(variables, personal=False, vmapped=False, clients=None, net=None):
        return {"correct": correct, "count": counts}
    monkeypatch.setattr(sim, "client_evaluate", evaluate)
    accuracy = np.where(bad, 0.1, 0.8)  # the attacker's model scores badly at the server
    cosine = np.ones((len(ids), len(ids)))
    barred = np.zeros(len(ids), bool)
    alarm = sim.alarms(state, ids)
    np.testing.assert_array_equal(alarm, bad)
    np.testing.assert_array_equal(siren.detect(alarm, accuracy, cosine, barred, 0.1), ~bad)
    sim.o["malicious_alarm"] = "never"
    alarm = sim.alarms(state, ids)
    assert not alarm.any()
    assert siren.detect(alarm, accuracy, cosine, barred, 0.1).all()


def test_an_alarming_attacker_still_trains_from_the_global_model():
    exp = assembly.build(config(rounds=2, algorithm="siren", partition__test_fraction=0.2,
                                attack__kind="sign_flip", attack__fraction=0.2,
                                attack__start_round=1))
    sim = exp.simulation
    assert sim.services.attack is not None  # the config's attack, resolved by the assembly
    ids = np.arange(exp.config.partition.num_clients)
    np.testing.assert_array_equal(sim.attacking(0, ids), np.zeros(len(ids), bool))
    np.testing.assert_array_equal(sim.attacking(1, ids), sim.malicious)
    with pytest.raises(ConfigError, match="malicious_alarm"):
        assembly.validate(config(algorithm="siren", partition__test_fraction=0.2,
                                 siren__malicious_alarm="sometimes"))


# Slow (8 s): the default run checks Siren's rules by hand and drivers' resume through
# FedMA and FLChain; this is Siren's own run from a config.
@pytest.mark.slow
def test_siren_runs_from_a_config_and_resumes_exactly(tmp_path):
    changes = dict(algorithm="siren", partition__test_fraction=0.2, attack__kind="sign_flip",
                   attack__fraction=0.4, participation=1.0, partition__num_clients=6,
                   checkpoint_every=2)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=4, **changes), full, progress=False)
    # A crash after round 2's checkpoint (the penalty bar depends on the run's length, so
    # the interrupted run is the same 4-round run).
    shutil.copytree(full, part)
    shutil.rmtree(os.path.join(part, "checkpoints", "4"))
    experiment.train(config(rounds=4, **changes), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)
    assert all("train_alarms" in r and "train_rejected" in r for r in metrics(full))
    with pytest.raises(ConfigError, match="test_fraction must be > 0 for algorithm 'siren'"):
        assembly.validate(config(algorithm="siren"))
