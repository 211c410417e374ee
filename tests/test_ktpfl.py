"""KT-pFL: the knowledge-coefficient step against its hand-computed gradient, the
regulariser alone contracting c to 1/N, distillation lowering the KL to a client's
target, the server's store of soft predictions, the held-out public set; clients of
several architectures: one network split into two groups equal to one group, mixed
networks training their own models, evaluated on their own networks, resuming exactly;
the paper's order (phase 1, server step, phase 2): distilling towards this round's own
predictions leaves a model where phase 1 put it, the round equal to its phases composed
by hand on the reference round, the server storing the trained (not the distilled)
models' predictions, a config run resuming exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_WORK, max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.engine.services import Services
from fedjax_pan.algorithms.personal.ktpfl import (KtMixed, absorb, kl, ktpfl, parse_architectures,
                                         simplex_columns, soft_predictions,
                                         update_coefficients)


def _soft(rng, n, p, c):
    z = rng.normal(size=(n, p, c))
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.reference("algorithm", "ktpfl")
def test_coefficient_step_matches_the_hand_computed_gradient():
    rng = np.random.default_rng(0)
    n, p, c = 3, 4, 5
    soft = _soft(rng, n, p, c)
    coef = rng.uniform(0.1, 0.6, size=(n, n))
    sizes = np.asarray([10.0, 30.0, 60.0])
    lam, rho, lr = 0.7, 0.2, 0.05
    w = sizes / sizes.sum()
    t = np.einsum("mn,mpc->npc", coef, soft)
    grad = np.zeros((n, n))
    for m in range(n):
        for k in range(n):
            grad[m, k] = lam * w[k] / p * np.sum(soft[m] * (np.log(t[k]) + 1 - np.log(soft[k])))
            grad[m, k] += 2 * rho * (coef[m, k] - 1 / n)
    got = update_coefficients(jnp.asarray(coef, jnp.float32), jnp.asarray(soft, jnp.float32),
                              jnp.asarray(sizes, jnp.float32), lam, rho, lr)
    np.testing.assert_allclose(got, coef - lr * grad, rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(grad)) > 1e-2


def test_the_regulariser_alone_contracts_c_to_uniform():
    rng = np.random.default_rng(1)
    coef = rng.uniform(size=(4, 4)).astype(np.float32)
    got = update_coefficients(jnp.asarray(coef), jnp.asarray(_soft(rng, 4, 3, 2), jnp.float32),
                              jnp.ones(4), lam=0.0, rho=0.5, lr=0.2)
    np.testing.assert_allclose(got, 0.25 + (1 - 0.2) * (coef - 0.25), rtol=1e-6)


def _setup():
    cd, model, variables, tx = pfl_setup()
    public = jnp.asarray(np.random.default_rng(2).normal(size=(30, 6, 6, 1)), jnp.float32)
    return cd, model, variables, tx, public


def test_distillation_lowers_the_kl_to_the_target():
    cd, model, variables, tx, public = _setup()
    algo = ktpfl(model, tx, public, cd.num_clients, 0.5, temperature=2.0)
    server = algo.server_init(variables)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 8, 27, 1, 0, jnp.ones(10)))
    row = np.full(10, 0.3 / 9)
    row[3] = 0.7  # one class favoured on every public example: reachable by the head's bias
    target = jnp.asarray(np.tile(row, (30, 1)), jnp.float32)
    local = local._replace(target=target, distill_from=jnp.int32(0))

    def distance(params):
        return float(kl(target, soft_predictions(model.apply({"params": params}, public), 2.0)))
    before = distance(local.train.params)
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8)}
    for _ in range(15):
        local, metrics = algo.client_step(local, batch, server)
    assert float(metrics["num_examples"]) == 0  # distillation adds no training loss
    assert distance(local.train.params) < 0.5 * before


def test_the_server_stores_soft_predictions_and_steps_c():
    cd, model, variables, tx, public = _setup()
    algo = ktpfl(model, tx, public, cd.num_clients, 0.4, lam=1.0, rho=0.1, coef_lr=0.05,
                 simplex=False)
    sim, states, _ = pfl_rounds(algo, cd, variables, rounds=2)
    server = states[2].server
    ids = set(sim.sample(0).tolist()) | set(sim.sample(1).tolist())
    for k in range(cd.num_clients):
        mine = jax.tree_util.tree_map(lambda v: v[k], states[2].client_states)
        if k in ids:  # its latest model's soft predictions on the public set, its size
            want = soft_predictions(model.apply(mine, public), 1.0)
            assert max_rel_err(server.soft[k], want) < 1e-5
            assert float(server.sizes[k]) == cd.sizes[k]
        else:  # the initial model's; no weight yet
            assert max_rel_err(server.soft[k], server.soft[k] * 0 + soft_predictions(
                model.apply(variables, public), 1.0)) < 1e-6
            assert float(server.sizes[k]) == 0
    # c took exactly one step per round, on the soft predictions stored by then.
    c1 = update_coefficients(states[0].server.coef, states[1].server.soft,
                             states[1].server.sizes, 1.0, 0.1, 0.05)
    assert max_rel_err(states[1].server.coef, c1) < 1e-5
    assert max_rel_err(states[1].server.coef, states[0].server.coef) > 1e-4
    # Personal models: each client's own, never averaged.
    personal = sim.personal_evaluation(states[2])
    assert max_rel_err(personal, states[2].client_states) == 0


def test_the_public_set_is_held_out_of_every_client():
    from fedjax_pan.run import experiment
    from test_experiment import config
    # dataset.public_size = 0: KT-pFL's default, a fifth of these 1,000 examples (at most
    # 1,000); the smoke preset's options and a test part per client are all it needs.
    for size, held in ((0, 200), (100, 100)):
        exp = experiment.build(config(algorithm="ktpfl", dataset__public_size=size,
                                      partition__test_fraction=0.25))
        public, kept = experiment.public_split(exp.dataset.num_train, held, exp.config.seed)
        assert len(public) == held and len(kept) == exp.dataset.num_train - held
        used = np.concatenate(exp.client_indices + exp.test_indices)
        assert not set(used.tolist()) & set(public.tolist())
        assert sorted(used.tolist()) == kept.tolist()
    # Without a public set the partition is the one it always was.
    plain = experiment.build(config())
    again = experiment.build(config(dataset__public_size=0))
    assert all(np.array_equal(a, b) for a, b in zip(plain.client_indices, again.client_indices))


# ---- clients of several architectures ----------------------------------------------------

OPTS = dict(lam=1.0, rho=0.1, coef_lr=0.05, simplex=True)


def _mixed(nets, initial, arch, strategy="vmap"):
    cd, _, _, tx, public = _setup()
    services = Services(cd, PFL_WORK, participation=0.5, seed=7, strategy=strategy)
    return KtMixed(nets, initial, np.asarray(arch), tx, services, public, 0.4, options=OPTS)


def _run(sim, rounds=2):
    states = [sim.init(None)]
    for _ in range(rounds):
        states.append(sim.round(states[-1])[0])
    return states


# The loop executor with the slow tests: both executors run the groups' common code.
@pytest.mark.parametrize("strategy", [pytest.param("loop", marks=pytest.mark.slow), "vmap"])
@pytest.mark.parametrize("arch", [[0, 1, 0, 1, 0, 1],
                                  pytest.param([1, 1, 0, 0, 0, 1], marks=pytest.mark.slow)])
def test_one_network_in_two_groups_equals_one_group(strategy, arch):
    """Grouping is bookkeeping: the same network split into two groups of clients trains,
    stores soft predictions and steps c exactly as one federation of that network."""
    cd, model, variables, tx, public = _setup()
    algo = ktpfl(model, tx, public, cd.num_clients, 0.4, **OPTS)
    _, want, _ = pfl_rounds(algo, cd, variables, strategy, rounds=2)
    sim = _mixed([model, model], [variables, variables], arch, strategy)
    got = _run(sim)
    for r in (1, 2):
        for field in ("coef", "soft", "sizes"):
            np.testing.assert_array_equal(getattr(got[r].server, field),
                                          getattr(want[r].server, field))
    # (the Simulation's earlier client states were donated to its scatter)
    for g, states in zip(sim.groups, got[2].client_states):
        mine = jax.tree_util.tree_map(lambda x: x[g.ids], want[2].client_states)
        assert max_rel_err(states, mine) == 0
    assert max_rel_err(want[2].server.coef, want[1].server.coef) > 1e-4  # c moved
    assert bool(jnp.all(jnp.isfinite(want[2].server.coef)))


@pytest.mark.slow  # about 8 s: three networks' programs compile
def test_mixed_networks_train_their_own_models():
    """Two MLPs of other widths and a small CNN in one federation: each client keeps a
    model of its own network, reports that model's soft predictions, and c steps on the
    stored predictions of every client."""
    cd, _, _, tx, public = _setup()
    nets = [models.build("mlp", 10, hidden=[24, 16]), models.build("mlp", 10, hidden=[12]),
            models.build("cnn", 10, channels=[4, 6], fc_hidden=[16])]
    initial = [models.init(n, jax.random.PRNGKey(i), (6, 6, 1)) for i, n in enumerate(nets)]
    arch = np.arange(cd.num_clients) % 3
    sim = _mixed(nets, initial, arch, strategy="auto")
    states = _run(sim)
    sampled = set(sim.sample(0).tolist()) | set(sim.sample(1).tolist())
    assert {int(arch[k]) for k in sampled} == {0, 1, 2}
    server = states[2].server
    for a, (g, stacked) in enumerate(zip(sim.groups, states[2].client_states)):
        assert g.ids.tolist() == np.flatnonzero(arch == a).tolist()
        assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
            initial[a])
        for i, k in enumerate(g.ids):
            mine = jax.tree_util.tree_map(lambda x: x[i], stacked)
            trained = max_rel_err(mine, initial[a]) > 1e-3
            assert trained == (k in sampled)
            want = soft_predictions(nets[a].apply(mine, public), 1.0)
            assert max_rel_err(server.soft[k], want) < 1e-5
            assert float(server.sizes[k]) == (cd.sizes[k] if k in sampled else 0)
    c1 = simplex_columns(update_coefficients(states[0].server.coef, states[1].server.soft,
                                             states[1].server.sizes, 1.0, 0.1, 0.05))
    assert max_rel_err(states[1].server.coef, c1) < 1e-6
    # Personal models: each group on its own network.
    groups = sim.personal_groups(states[2])
    assert [net for net, _, _ in groups] == nets
    assert all(max_rel_err(v, s) == 0 for (_, _, v), s in zip(groups, states[2].client_states))


@pytest.mark.reference("algorithm", "ktpfl")
def test_simplex_projection_by_hand_and_keeping_targets_distributions():
    coef = jnp.asarray([[0.5, 0.2], [0.8, 0.3], [-0.2, 0.5]], jnp.float32)
    # Column 0 by hand: sorted 0.8, 0.5, -0.2 keeps two, theta = (1.3 - 1) / 2 = 0.15;
    # column 1 sums to 1 and is non-negative: unchanged.
    np.testing.assert_allclose(simplex_columns(coef), [[0.35, 0.2], [0.65, 0.3], [0.0, 0.5]],
                               atol=1e-6)
    # A step large enough to push c negative: NaN targets without the projection, valid
    # mixtures with it.
    cd, model, variables, tx, public = _setup()
    coefs = []
    for simplex in (False, True):
        algo = ktpfl(model, tx, public, cd.num_clients, 0.4, coef_lr=0.5, simplex=simplex)
        _, states, _ = pfl_rounds(algo, cd, variables, rounds=2)
        coefs.append([np.asarray(s.server.coef) for s in states])
    assert coefs[0][1].min() < 0 and np.isnan(coefs[0][2]).any()
    for c in coefs[1][1:]:
        assert c.min() >= 0 and np.allclose(c.sum(0), 1, atol=1e-5)


def test_architecture_specs_are_parsed_and_bad_ones_named():
    assert parse_architectures("") == []
    assert parse_architectures("mlp(hidden=(200, 200)); cnn") == [
        ("mlp", {"hidden": (200, 200)}), ("cnn", {})]
    assert parse_architectures(" cnn(channels=[8, 16], norm='group') ") == [
        ("cnn", {"channels": [8, 16], "norm": "group"})]
    for bad, why in [("mlp; foo", "unknown model 'foo'"), ("mlp(3)", "keyword arguments"),
                     ("mlp(width=2)", r"unknown option\(s\) \['width'\]"),
                     ("mlp(hidden=h)", "not a literal"), ("mlp;", "not a name")]:
        with pytest.raises(ValueError, match=why):
            parse_architectures(bad)
    # Each spec is built by the config check, so bad sizes stop before any data loads.
    from fedjax_pan.config import schema
    from fedjax_pan.config.defaults import default_config
    cfg = default_config()
    cfg.ktpfl.architectures = "mlp; mlp(hidden=-3)"
    with pytest.raises(schema.ConfigError, match=r"^config.ktpfl.architectures must be .*"
                                                 r"option hidden must be a list of positive "
                                                 r"integers, got -3"):
        schema.validate(cfg)


def _mixed_config(**changes):
    from test_experiment import config
    base = dict(algorithm="ktpfl", local__epochs=2.0, dataset__public_size=100,
                partition__test_fraction=0.25,
                ktpfl__architectures="mlp(hidden=(16, 16)); cnn(channels=(4, 8), "
                                     "fc_hidden=(16,))")
    return config(**{**base, **changes})


def test_more_architectures_than_clients_is_a_config_error():
    from fedjax_pan.run import experiment
    with pytest.raises(experiment.ConfigError,
                       match="config.ktpfl: architectures lists 3 models for 2 clients"):
        experiment.build(_mixed_config(partition__num_clients=2,
                                       ktpfl__architectures="mlp; mlp(hidden=(8,)); cnn"))


@pytest.mark.slow
def test_config_runs_mixed_networks_and_scores_each_on_its_own(tmp_path):
    """From a config: the driver runs; the logged personal accuracy is every client's own
    network on its own test part (numpy over the stored models); a bad spec names
    itself; one architecture runs as the one compiled algorithm."""
    from fedjax_pan.run import assembly, experiment
    cfg = _mixed_config(rounds=2)
    exp = experiment.build(cfg)
    assert isinstance(exp.simulation, KtMixed)
    state = exp.simulation.init(exp.variables)
    for _ in range(2):
        state, _ = exp.simulation.round(state)
    got = experiment.evaluate_clients(exp, state, None, None)
    y = exp.dataset.train_labels
    xs_all = assembly._normalized(exp.config, exp.dataset, None)[0]
    correct = count = 0
    for net, ids, stacked in exp.simulation.personal_groups(state):
        for i, k in enumerate(ids):
            rows = exp.test_indices[k]
            own = jax.tree_util.tree_map(lambda v: v[i], stacked)
            pred = np.argmax(np.asarray(net.apply(own, xs_all[rows])), -1)
            correct += int(np.sum(pred == y[rows]))
            count += len(rows)
    assert got["pfl_accuracy"] == pytest.approx(correct / count, abs=1e-9)
    assert count == sum(len(t) for t in exp.test_indices)
    with pytest.raises(experiment.ConfigError, match="ktpfl.architectures.*unknown model"):
        experiment.build(_mixed_config(ktpfl__architectures="mlp; resnet99"))
    # One spec equal to the config's model: the plain config's numbers, in the lagged order
    # the compiled algorithm's (driver or not), in the paper's the driver's with one group.
    for order in ("lagged", "paper"):
        one = _mixed_config(rounds=1, ktpfl__architectures="mlp(hidden=(16, 16))",
                            model__options__hidden=[16, 16], ktpfl__order=order)
        plain = _mixed_config(rounds=1, ktpfl__architectures="",
                              model__options__hidden=[16, 16], ktpfl__order=order)
        a, b = experiment.build(one), experiment.build(plain)
        assert isinstance(a.simulation, KtMixed)
        assert isinstance(b.simulation, KtMixed) == (order == "paper")
        sa, _ = a.simulation.round(a.simulation.init(a.variables))
        sb, _ = b.simulation.round(b.simulation.init(b.variables))
        np.testing.assert_array_equal(sa.server.coef, sb.server.coef)
        mine = sb.client_states if order == "lagged" else sb.client_states[0]
        assert max_rel_err(sa.client_states[0], mine) == 0


def _resumes_exactly(make_config, tmp_path):
    """3 rounds in one go against 2 + a resume to 3 (checkpoints every 2) of the config
    `make_config(**changes)` gives: equal metrics, the clients' own included; those metrics."""
    from fedjax_pan.run import experiment
    from test_experiment import metrics
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(make_config(rounds=3, checkpoint_every=2), full, progress=False)
    experiment.train(make_config(rounds=2, checkpoint_every=2), part, progress=False)
    experiment.train(make_config(rounds=3, checkpoint_every=2), part, resume=True,
                     progress=False)
    assert metrics(part) == metrics(full) and len(metrics(full)) == 3
    assert all("pfl_accuracy" in m for m in metrics(full))
    return metrics(full)


@pytest.mark.slow
def test_mixed_networks_resume_exactly(tmp_path):
    _resumes_exactly(_mixed_config, tmp_path)


def _authors_step_numpy(weight, raw, rho):
    """The authors' `get_models_logits` step in NumPy, row by row as released (their
    weight[self][teacher] is our c[teacher, self]); gradients of the two MSEs by hand."""
    n = weight.shape[0]
    weight = weight.copy()
    size = raw[0].size
    for me in range(n):
        target = sum(weight[me, t] * raw[t] for t in range(n))
        grad = np.array([-2.0 / size * np.sum((raw[me] - target) * raw[t]) for t in range(n)])
        grad += rho * 2.0 / n * (weight[me] - 1.0 / n)
        avg, rate = np.sum(np.abs(grad)) / n, 1.0
        for _ in range(5):
            if avg > 0.01:
                avg, rate = avg / 5, rate / 5
            if avg < 0.01:
                avg, rate = avg * 5, rate * 5
        weight[me] = weight[me] - grad * rate
    out = np.exp(5.0 * weight)
    return out / out.sum(axis=1, keepdims=True)


def test_the_authors_coefficient_step_against_their_loop():
    from fedjax_pan.algorithms.personal.ktpfl import authors_coefficients
    rng = np.random.default_rng(0)
    n, p, c = 4, 6, 3
    raw = rng.dirichlet(np.ones(c), size=(n, p)).astype(np.float64)
    coef = rng.uniform(0.1, 0.4, size=(n, n))
    got = np.asarray(authors_coefficients(jnp.asarray(coef, jnp.float32),
                                          jnp.asarray(raw, jnp.float32), 0.1))
    want = _authors_step_numpy(coef.T, raw, 0.1).T  # rows of theirs are our columns
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=0), 1.0, rtol=1e-5)  # each target a mixture
    # From a config: a round steps c the authors' way (columns stay distributions).
    from fedjax_pan.run import experiment
    from test_experiment import config
    exp = experiment.build(config(algorithm="ktpfl", partition__test_fraction=0.25,
                                  ktpfl__coef_update="authors"))
    state, _ = exp.simulation.round(exp.simulation.init(exp.variables))
    c = np.asarray(state.server.coef)
    np.testing.assert_allclose(c.sum(axis=0), 1.0, rtol=1e-5)
    assert np.abs(c - 1.0 / c.shape[0]).max() > 1e-4


# ---- the paper's order: train, server step, distil -------------------------------------

def _paper(nets, initial, arch, order="paper", strategy="vmap", **options):
    cd, _, _, tx, public = _setup()
    services = Services(cd, PFL_WORK, participation=0.5, seed=7, strategy=strategy)
    return KtMixed(nets, initial, np.asarray(arch), tx, services, public, 0.4,
                   options={**OPTS, **options}, order=order)


def _rows(state, ids, group=0):
    """The models of rows `ids` (an index or a list) of group `group` in a driver's state
    (with one group, rows are client ids)."""
    return jax.tree_util.tree_map(lambda x: x[np.asarray(ids)], state.client_states[group])


def test_distilling_towards_its_own_predictions_leaves_a_model_in_the_paper_order():
    """c = I and a still c (coef_lr = lam = rho = 0): each client's target is its own
    predictions. In the paper's order these are this round's, of the phase-1 model, where
    the distillation gradient is zero (fresh momentum, no weight decay): the round ends
    where phase 1 did. In the lagged order they are the initial model's, which pull the
    trained model back."""
    cd, model, variables, _, _ = _setup()
    still = dict(coef_lr=0.0, lam=0.0, rho=0.0)
    paper = _paper([model], [variables], np.zeros(cd.num_clients), **still)
    lagged = _paper([model], [variables], np.zeros(cd.num_clients), "lagged", **still)
    start = paper.init(None)
    start = start._replace(server=start.server._replace(coef=jnp.eye(cd.num_clients)))
    ids = paper.sample(0)
    mid, _ = paper.train_phase(start)
    assert max_rel_err(_rows(mid, ids), _rows(start, ids)) > 1e-2  # phase 1 trained
    end, _ = paper.round(start)
    moved, _ = lagged.round(start)
    for state in (mid, end, moved):
        np.testing.assert_array_equal(state.server.coef, np.eye(cd.num_clients))
    for k in ids:
        assert max_rel_err(_rows(end, [k]), _rows(mid, [k])) < 1e-5
        assert max_rel_err(_rows(moved, [k]), _rows(mid, [k])) > 1e-3


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_the_paper_round_is_its_phases_composed_by_hand(strategy):
    """The driver's round against the reference round of `ktpfl(phase="train")` on the
    hand-split step counts, `absorb` of the trained models' predictions, then the
    reference round of `ktpfl(phase="distill")` from the new server state on the second
    batch-order stream."""
    from fedjax_pan.algorithms.core import tree_bytes
    from fedjax_pan.engine.reference import reference_round
    cd, model, variables, tx, public = _setup()
    sim = _paper([model], [variables], np.zeros(cd.num_clients), strategy=strategy)
    got, stats = sim.round(sim.init(None))
    ids = sim.sample(0)
    full = PFL_WORK.num_steps(cd.sizes[ids])
    # round(0.4 x steps) in float32, half to even (4.5 -> 4), as the compiled round splits.
    distill = np.round(np.float32(0.4) * full.astype(np.float32)).astype(np.int64)
    assert (distill > 0).all() and (full - distill > 0).all()
    train = ktpfl(model, tx, public, cd.num_clients, 0.4, phase="train", **OPTS)
    distil = ktpfl(model, tx, public, cd.num_clients, 0.4, phase="distill", **OPTS)
    server = train.server_init(variables)
    start = jax.tree_util.tree_map(lambda x: jnp.stack([x] * len(ids)),
                                   train.client_state_init(server))
    one = sim.services.cohort(ids, 0, start)._replace(steps=full - distill)
    absorbed, trained, loss = reference_round(train, cd, PFL_WORK.batch_size, server, one)
    soft = jnp.stack([soft_predictions(model.apply(v, public), 1.0) for v in trained])
    by_hand = absorb(server, jnp.asarray(ids), soft, jnp.asarray(cd.sizes[ids], jnp.float32),
                     OPTS["lam"], OPTS["rho"], OPTS["coef_lr"], OPTS["simplex"])
    assert max_rel_err(absorbed, by_hand) < 1e-5
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *trained)
    two = sim.services.cohort(ids, 0, stacked, stage=1)._replace(steps=distill)
    after, distilled, _ = reference_round(distil, cd, PFL_WORK.batch_size, absorbed, two)
    assert after is absorbed  # phase 2 sends nothing
    for field in ("coef", "soft", "sizes"):
        assert max_rel_err(getattr(got.server, field), getattr(by_hand, field)) < 1e-5
    want = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *distilled)
    assert max_rel_err(_rows(got, ids), want) < 1e-5
    assert max_rel_err(want, stacked) > 1e-3  # phase 2 moved the models
    assert stats["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert stats["upload_bytes"] == len(ids) * tree_bytes({"soft": soft[0], "size": jnp.float32(0)})
    b = PFL_WORK.batch_size

    def rows(n, s):  # whole epochs of n examples, then full batches
        epochs, rest = divmod(s, -(-n // b))
        return epochs * n + rest * b
    assert stats["real_examples"] == sum(rows(int(n), int(s)) for steps in (full - distill, distill)
                                         for n, s in zip(cd.sizes[ids], steps))
    assert stats["computed_examples"] >= stats["real_examples"]


def test_the_server_stores_the_trained_not_the_distilled_predictions():
    """Two networks in the paper's order: after the round the server holds the phase-1
    models' predictions and the c stepped on them; the distilled models' differ."""
    cd, _, _, _, public = _setup()
    nets = [models.build("mlp", 10, hidden=[24, 16]), models.build("mlp", 10, hidden=[12])]
    initial = [models.init(n, jax.random.PRNGKey(i), (6, 6, 1)) for i, n in enumerate(nets)]
    arch = np.arange(cd.num_clients) % 2
    sim = _paper(nets, initial, arch)
    start = sim.init(None)
    mid, _ = sim.train_phase(start)
    end, _ = sim.round(start)
    ids = sim.sample(0)
    assert {int(arch[k]) for k in ids} == {0, 1}
    for field in ("coef", "soft", "sizes"):
        np.testing.assert_array_equal(getattr(end.server, field), getattr(mid.server, field))
    for k in ids:
        a, g = int(arch[k]), sim.groups[int(arch[k])]
        i = int(np.searchsorted(g.ids, k))
        trained, distilled = _rows(mid, i, a), _rows(end, i, a)
        pre = soft_predictions(nets[a].apply(trained, public), 1.0)
        post = soft_predictions(nets[a].apply(distilled, public), 1.0)
        assert max_rel_err(end.server.soft[k], pre) < 1e-6
        # Near-uniform predictions of young models: distillation moves them by 2e-4 to 4e-3.
        assert max_rel_err(end.server.soft[k], post) > 1e-4
        assert max_rel_err(distilled, trained) > 1e-3
        assert float(end.server.sizes[k]) == cd.sizes[k]
    c1 = simplex_columns(update_coefficients(start.server.coef, end.server.soft,
                                             end.server.sizes, 1.0, 0.1, 0.05))
    assert max_rel_err(end.server.coef, c1) < 1e-6


def test_the_order_option_is_checked_and_picks_the_round():
    from fedjax_pan.run import experiment
    from fedjax_pan.config import schema
    from fedjax_pan.config.defaults import default_config
    from test_experiment import config
    cfg = default_config()
    assert cfg.ktpfl.order == "paper"
    cfg.ktpfl.order = "late"
    with pytest.raises(schema.ConfigError, match=r"config.ktpfl.order must be one of paper, "
                                                 r"lagged, got 'late'"):
        schema.validate(cfg)
    paper = experiment.build(config(algorithm="ktpfl", partition__test_fraction=0.25))
    assert isinstance(paper.simulation, KtMixed) and paper.simulation.order == "paper"
    assert [g.ids.tolist() for g in paper.simulation.groups] == [list(range(20))]
    lagged = experiment.build(config(algorithm="ktpfl", partition__test_fraction=0.25,
                                     ktpfl__order="lagged"))
    assert not isinstance(lagged.simulation, KtMixed)


def _paper_config(**changes):
    from test_experiment import config
    return config(algorithm="ktpfl", partition__test_fraction=0.25,
                  dataset__public_size=100, **changes)


@pytest.mark.slow
def test_config_runs_in_the_paper_order_and_resumes_exactly(tmp_path):
    """The default order from a config: resumes exactly; its first round trains exactly as
    the lagged order's (same batches, keys and steps before any distillation)."""
    from fedjax_pan.run import experiment
    from test_experiment import metrics
    full = _resumes_exactly(_paper_config, tmp_path)
    lag = str(tmp_path / "lag")
    experiment.train(_paper_config(rounds=1, ktpfl__order="lagged"), lag, progress=False)
    first, lagged = full[0], metrics(lag)[0]
    assert first["train_loss"] == pytest.approx(lagged["train_loss"], rel=1e-6)
    assert first["upload_bytes"] == lagged["upload_bytes"]  # one report a client
