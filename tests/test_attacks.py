"""Attacks: each changes exactly what it should (batches and sent models by hand; honest
clients bit for bit untouched; a label attack equals training on relabelled data), the
malicious set is drawn once per seed or exactly int(M f) of each round's cohort (the same
under every execution strategy), and the backdoor's success rate is logged."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients, tiny_fedavg
from fedjax_pan.run import assembly, experiment
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms.aggregation import median
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from test_experiment import config, metrics  # noqa: E402

WORK = LocalWork(batch_size=8, epochs=1)


def test_malicious_clients_are_drawn_once_per_seed():
    a = attacks.draw_malicious(0.2, 50, seed=1)
    assert a.sum() == 10
    np.testing.assert_array_equal(a, attacks.draw_malicious(0.2, 50, seed=1))
    assert not np.array_equal(a, attacks.draw_malicious(0.2, 50, seed=2))
    assert attacks.draw_malicious(0.0, 50, 1).sum() == 0


def test_per_round_attackers_are_exactly_int_m_fraction_of_each_cohort():
    ids = np.array([3, 8, 11, 20, 31, 40, 41, 57, 60, 99])
    for fraction, want in ((0.2, 2), (0.1, 1), (0.39, 3), (0.0, 0)):
        bad = attacks.draw_round(fraction, ids, seed=5, round_index=4)
        assert bad.sum() == want  # the authors' int(m * attack_ratio), not round()
    a = attacks.draw_round(0.2, ids, 5, 4)
    np.testing.assert_array_equal(a, attacks.draw_round(0.2, ids, 5, 4))  # seeded
    draws = {tuple(attacks.draw_round(0.2, ids, 5, r)) for r in range(20)}
    assert len(draws) > 5  # afresh each round
    # From a config: round r's row marks int(M f) of the cohort the engine samples.
    from fedjax_pan.engine.simulation import sample_clients
    cfg = config(rounds=6, attack__kind="sign_flip", attack__fraction=0.3,
                 attack__draw="per_round", participation=0.5, partition__num_clients=10)
    table = attacks.malicious_from_config(cfg, 10, "uniform")
    assert table.shape == (6, 10)
    for r in range(6):
        cohort = sample_clients(cfg.seed, 10, 5, r)
        assert table[r].sum() == 1 and table[r, cohort].sum() == 1
        np.testing.assert_array_equal(attacks.attacking(table, r, cohort),
                                      attacks.draw_round(0.3, cohort, cfg.seed, r))
    cfg.attack.draw = "fixed"
    fixed = attacks.malicious_from_config(cfg, 10, "uniform")
    np.testing.assert_array_equal(fixed, attacks.draw_malicious(0.3, 10, cfg.seed))
    with pytest.raises(ConfigError, match="attack.draw"):
        assembly.validate(config(attack__kind="sign_flip", attack__draw="sometimes"))


@pytest.mark.slow  # every strategy compiles (the slow run holds the strategies' agreement)
def test_per_round_attackers_agree_across_strategies():
    """A (rounds, K) table is looked up by client id and round: every execution strategy
    and the sequential reference see the same attackers, and round r's attackers are
    row r's (the sent update of an attacker is its honest one negated x4)."""
    from conftest import pfl_rounds, strategies_agree
    _, cd = tiny_clients([20, 30, 25, 18, 22, 16])
    table = np.zeros((2, cd.num_clients), bool)
    table[0, :] = True  # round 0: everyone attacks; round 1: clients 1 and 4
    table[1, [1, 4]] = True
    algo = attacks.with_attack(_ALGO, attacks.Attack("sign_flip", 10, 4.0), table)
    attacked = strategies_agree(algo, cd, _VARIABLES, rounds=2,
                                strategies=("loop", "vmap", "sharded"))
    _, honest, _ = pfl_rounds(_ALGO, cd, _VARIABLES, "loop", rounds=1)
    # Round 0: the server moves against its honest step, x4.
    d_honest = jax.tree_util.tree_map(lambda a, b: a - b, honest[1].server.params,
                                      honest[0].server.params)
    d_bad = jax.tree_util.tree_map(lambda a, b: a - b, attacked.loop[1].server.params,
                                   attacked.loop[0].server.params)
    jax.tree_util.tree_map(lambda h, b: np.testing.assert_allclose(b, -4.0 * h, rtol=1e-4,
                                                                   atol=1e-6),
                           d_honest, d_bad)


def test_every_kind_has_its_functions_reference_and_order():
    assert attacks.ATTACKS == ("none", "model_poisoning", "sign_flip", "gaussian",
                               "label_shift", "label_flip", "backdoor")
    assert set(attacks.ATTACKS[1:]) == set(attacks.DATA_ATTACKS) | set(attacks.MODEL_ATTACKS)
    assert set(attacks.ATTACKS[1:]) == set(attacks.REFERENCES)
    assert set(attacks.DEFAULT_SCALE) <= set(attacks.ATTACKS)
    assert "backdoor" in attacks.DATA_ATTACKS and "backdoor" in attacks.MODEL_ATTACKS
    with pytest.raises(ValueError, match="unknown attack 'nope'"):
        attacks.with_attack(_ALGO, attacks.Attack("nope", 10), np.zeros(6, bool))


def _batch(rows=8, real=6):
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.normal(size=(rows, 7, 7, 2)), jnp.float32),
            "y": jnp.asarray([0, 1, 2, 3, 7, 9, 4, 5], jnp.int32),
            "mask": jnp.asarray(np.arange(rows) < real, jnp.float32)}


@pytest.mark.reference("attack", "label_shift", "label_flip")
def test_label_attacks_by_hand():
    b = _batch()
    shift = attacks.poison_batch(b, attacks.Attack("label_shift", 10))
    np.testing.assert_array_equal(shift["y"], [1, 2, 3, 4, 8, 0, 5, 6])
    flip = attacks.poison_batch(b, attacks.Attack("label_flip", 10))
    np.testing.assert_array_equal(flip["y"], [9, 8, 7, 6, 2, 0, 5, 4])
    for out in (shift, flip):
        np.testing.assert_array_equal(out["x"], b["x"])


@pytest.mark.reference("attack", "backdoor")
def test_backdoor_poisons_the_first_share_of_real_rows_with_the_pattern():
    for real, poisoned in ((6, 1), (8, 2)):  # floor(6 * 20/64) = 1, floor(8 * 20/64) = 2
        b = _batch(real=real)
        out = attacks.poison_batch(b, attacks.Attack("backdoor", 10, target=2))
        np.testing.assert_array_equal(out["y"][:poisoned], [2] * poisoned)
        np.testing.assert_array_equal(out["y"][poisoned:], b["y"][poisoned:])
        np.testing.assert_array_equal(out["x"][poisoned:], b["x"][poisoned:])
        changed = np.asarray(out["x"][0] != b["x"][0])
        # The authors' 12 pixels, every channel, set to 1.0; nothing else.
        want = np.zeros((7, 7, 2), bool)
        for r, c in attacks.PATTERN:
            want[r, c, :] = True
        np.testing.assert_array_equal(changed, want)
        np.testing.assert_array_equal(np.asarray(out["x"][0])[want], 1.0)
    b = _batch(rows=64, real=64)
    out = attacks.poison_batch(b | {"y": jnp.zeros(64, jnp.int32)}, attacks.Attack("backdoor", 10))
    assert int(jnp.sum(out["y"] == 2)) == 20  # the authors' 20 of each 64


@pytest.mark.reference("attack", "model_poisoning", "sign_flip", "gaussian", "backdoor")
def test_sent_parameters_by_hand():
    w = {"k": jnp.asarray([1.0, -2.0, 4.0])}
    b = {"k": jnp.asarray([0.5, 0.5, 0.5])}
    key = jax.random.PRNGKey(0)

    def sent(kind, scale):
        return np.asarray(attacks.attack_params(attacks.Attack(kind, 10, scale), w, b, key)["k"])
    np.testing.assert_allclose(sent("model_poisoning", 0.1), [-0.1, 0.2, -0.4])
    np.testing.assert_allclose(sent("sign_flip", 1.0), [0.0, 3.0, -3.0])
    np.testing.assert_allclose(sent("backdoor", 10.0), [5.5, -24.5, 35.5])
    big = {"k": jnp.zeros(20000)}
    noise = np.asarray(attacks.attack_params(attacks.Attack("gaussian", 10, 0.3), big, big,
                                             key)["k"])
    assert abs(noise.std() - 0.3) < 0.01 and abs(noise.mean()) < 0.01


def _outputs(algo, cd, malicious_ids=(), kind="model_poisoning", start=0, round_index=0,
             scale=None):
    """Each sampled client's output of round `round_index` (run alone), attacked or not."""
    if kind is not None:
        table = np.zeros(cd.num_clients, bool)
        table[list(malicious_ids)] = True
        scale = attacks.DEFAULT_SCALE.get(kind, 1.0) if scale is None else scale
        algo = attacks.with_attack(algo, attacks.Attack(kind, 10, scale, start_round=start),
                                   table)
    algo = algo._replace(aggregator=median())
    ex = make_executor("loop", algo, WORK, cd, _VARIABLES, 3)
    sim = Simulation(algo, cd, WORK, ex, 0.5, seed=0)
    state = sim.init(_VARIABLES)
    state = state._replace(round=round_index)
    return sim.sample(round_index), sim.client_updates(state), state.server


_MODEL, _VARIABLES, _ALGO = tiny_fedavg()


def test_model_attacks_change_the_malicious_output_only():
    _, cd = tiny_clients([20, 30, 25, 18, 22, 16])
    ids, plain, server = _outputs(_ALGO, cd, kind=None)
    bad = int(ids[1])
    # The backdoor's boost acts on the model trained on poisoned batches (boost 1).
    _, poisoned, _ = _outputs(_ALGO, cd, [bad], "backdoor", scale=1.0)
    for kind in ("model_poisoning", "sign_flip", "backdoor"):
        _, got, _ = _outputs(_ALGO, cd, [bad], kind)
        base = plain[:1] + poisoned[1:2] + plain[2:] if kind == "backdoor" else plain
        for m, (p, g) in enumerate(zip(base, got)):
            if m != 1:  # honest clients: bit for bit
                jax.tree_util.tree_map(np.testing.assert_array_equal, p, g)
                continue
            trained = jax.tree_util.tree_map(lambda s, d: s + d, server.params, p["delta"])
            sent = jax.tree_util.tree_map(lambda s, d: s + d, server.params, g["delta"])
            s = attacks.DEFAULT_SCALE[kind]
            want = {"model_poisoning": lambda w, b: -s * w,
                    "sign_flip": lambda w, b: b - s * (w - b),
                    "backdoor": lambda w, b: b + s * (w - b)}[kind]
            jax.tree_util.tree_map(
                lambda x, w, b: np.testing.assert_allclose(x, want(w, b), rtol=1e-5,
                                                           atol=1e-6),
                sent, trained, server.params)
    # Before start_round the malicious client is honest.
    _, early, _ = _outputs(_ALGO, cd, [bad], "sign_flip", start=5, round_index=0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, plain[1], early[1])


def test_a_label_attack_equals_training_on_relabelled_data():
    ds, cd = tiny_clients([20, 30, 25, 18, 22, 16])
    shifted = ClientData.create(ds.train_images, (np.asarray(ds.train_labels) + 1) % 10,
                                [np.asarray(r[:n]) for r, n in zip(np.asarray(cd.index_table),
                                                                   cd.sizes)])
    ids, _, _ = _outputs(_ALGO, cd, kind=None)
    bad = int(ids[0])
    _, got, _ = _outputs(_ALGO, cd, [bad], "label_shift")
    _, want, _ = _outputs(_ALGO, shifted, kind=None)
    _, honest, _ = _outputs(_ALGO, cd, kind=None)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got[0], want[0])
    jax.tree_util.tree_map(np.testing.assert_array_equal, got[1], honest[1])


def test_backdoor_success_is_logged_and_model_attacks_need_models(tmp_path):
    run = str(tmp_path / "bd")
    experiment.train(config(rounds=2, attack__kind="backdoor", attack__fraction=0.5), run,
                     progress=False)
    rows = metrics(run)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rows)
    with pytest.raises(ConfigError, match="attack.kind='sign_flip' needs clients that send"):
        assembly.build(config(algorithm="scaffold", attack__kind="sign_flip", rounds=1))
