"""FedKD: the SVD truncation and its byte count against NumPy (PFLlib's energy loop), a
client's compressed upload at the round's energy, one adaptive mutual-distillation step
against an objective written out by hand; clients of several networks (engine.groups)
against the one-network simulation; loop, vmap and the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import PFL_WORK, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext, tree_bytes
from fedjax_pan.algorithms.personal.fedkd import compress_tree, energy, fedkd, svd_compress
from fedjax_pan.algorithms.local import FEATURES
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

STUDENT = "mlp(hidden=(12,))"
SHAPE = (6, 6, 1)


def _fedkd(model, tx, **kw):
    return fedkd(model, tx, input_shape=SHAPE, rounds=kw.pop("rounds", 10),
                 student=kw.pop("student", STUDENT), **kw)


def _matrix(rows, cols, sigma, seed=0):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(rows, rows)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, cols)))
    s = np.zeros(min(rows, cols))
    s[:len(sigma)] = sigma
    return (u[:, :len(s)] * s) @ v[:, :len(s)].T


def _pfllib_rank(m, keep):
    """clientkd.py's loop; where it finds none (it would zero the matrix), all values."""
    sigma = np.linalg.svd(m, compute_uv=False)
    for k in range(len(sigma)):
        if np.sum(np.square(sigma[:k])) > keep * np.sum(np.square(sigma)):
            return k
    return len(sigma)


def _truncated(m, k):
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vt[:k]


@pytest.mark.reference("algorithm", "fedkd")
def test_svd_keeps_the_fewest_values_over_the_energy_and_counts_its_factors():
    m = _matrix(20, 12, [4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1])
    for keep in (0.5, 0.9, 0.99):
        k = _pfllib_rank(m, keep)
        got, sent = svd_compress(jnp.asarray(m, jnp.float32), jnp.float32(keep))
        np.testing.assert_allclose(np.asarray(got), _truncated(m, k), atol=2e-5)
        assert float(sent) == 4 * k * (20 + 12 + 1)
    assert [_pfllib_rank(m, e) for e in (0.5, 0.9, 0.99)] == [1, 3, 5]
    # Energy 1 keeps every value: the factors would be larger, so the matrix goes dense.
    got, sent = svd_compress(jnp.asarray(m, jnp.float32), jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(m, np.float32))
    assert float(sent) == 4 * 20 * 12
    # A conv kernel is its (kh kw in) x out matrix; zeros and vectors go dense.
    conv = _matrix(18, 8, [2.0, 1.0, 0.01], seed=1)
    tree = {"k": jnp.asarray(conv.reshape(3, 3, 2, 8), jnp.float32),
            "b": jnp.ones(8), "z": jnp.zeros((6, 5))}
    got, sent = compress_tree(tree, jnp.float32(0.9))
    k = _pfllib_rank(conv, 0.9)
    np.testing.assert_allclose(np.asarray(got["k"]).reshape(18, 8), _truncated(conv, k),
                               atol=2e-5)
    assert float(sent) == 4 * (k * (18 + 8 + 1) + 8 + 30)
    assert float(energy(5, 10, 0.9, 1.0)) == pytest.approx(0.95)


def test_a_client_uploads_its_students_update_compressed_at_the_rounds_energy():
    _, model, variables, tx = pfl_setup()
    algo = _fedkd(model, tx, t_start=0.5, t_end=0.9, rounds=4)
    server = algo.server_init(variables)._replace(round=jnp.int32(2))  # T = 0.7
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 6, 20, 0, 2, jnp.ones(10)))
    kernel = _matrix(36, 12, [1.0, 0.8, 0.6, 0.3, 0.1])
    delta = jax.tree_util.tree_map(lambda w: 0.01 * jnp.ones_like(w), server.student)
    delta["fc1"]["kernel"] = jnp.asarray(kernel, jnp.float32)
    moved = jax.tree_util.tree_map(jnp.add, server.student, delta)
    local = local._replace(student=local.student._replace(params=moved))
    output, _ = jax.jit(algo.client_output)(local, server)
    k = _pfllib_rank(kernel, 0.7)
    np.testing.assert_allclose(np.asarray(output["delta"]["fc1"]["kernel"]),
                               _truncated(kernel, k), atol=2e-5)
    # The head (12 x 10) is rank one here: one triplet; the biases go dense.
    np.testing.assert_allclose(np.asarray(output["delta"]["head"]["kernel"]), 0.01,
                               atol=1e-6)
    assert k == 2 and float(algo.upload_bytes(output, local)) == 4 * (
        k * (36 + 12 + 1) + 12 + 1 * (12 + 10 + 1) + 10)


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.reference("algorithm", "fedkd")
def test_a_step_follows_pfllibs_adaptive_mutual_distillation(detach):
    cd, model, variables, _ = pfl_setup()
    lr, mentee, clip = 0.3, 0.1, 0.05
    algo = _fedkd(model, optax.sgd(lr), student_tx=optax.sgd(mentee), detach=detach,
                  clip=clip)
    server = algo.server_init(variables)
    local = algo.client_init(server, algo.client_state_init(server),
                             ClientContext(jax.random.PRNGKey(0), 6, 20, 0, 0, jnp.ones(10)))
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8).at[7].set(0)}
    net = models.from_spec(STUDENT, 10)
    m = batch["mask"]
    sg = jax.lax.stop_gradient if detach else (lambda x: x)

    def run(n, w):
        out, state = n.apply({"params": w}, batch["x"], mutable=["intermediates"])
        return out, state["intermediates"][FEATURES]

    def kl(t, s):  # torch.nn.KLDivLoss()(log_softmax(s), softmax(t)): mean over 7 x 10
        p = jax.nn.softmax(t)
        return jnp.sum(m[:, None] * p * (jnp.log(p) - jax.nn.log_softmax(s))) / 70

    def ce(o):
        return jnp.sum(m * optax.softmax_cross_entropy_with_integer_labels(o, batch["y"])) / 7

    def mse(a, b):  # torch.nn.MSELoss() over the 7 real rows x D_t = 16
        return jnp.sum(m[:, None] * (a - b) ** 2) / (7 * 16)

    def total(wt, ws, wh):
        (ot, ht), (os_, hs) = run(model, wt), run(net, ws)
        lt = ce(ot) + (kl(sg(os_), ot) + mse(ht, sg(hs) @ wh)) / (ce(ot) + sg(ce(os_)))
        ls = ce(os_) + (kl(sg(ot), os_) + mse(sg(ht), hs @ wh)) / (sg(ce(ot)) + ce(os_))
        return lt + ls

    start = (variables["params"], server.student, server.w_h)
    grads = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(*start)

    def step(w, g, rate, clipped=True):
        norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                           for x in jax.tree_util.tree_leaves(g)))
        assert (norm > clip) == clipped  # where the clipping acts
        scale = min(1.0, clip / (norm + 1e-6))
        return jax.tree_util.tree_map(lambda a, b: a - rate * b * scale, w, g)
    new, metrics = jax.jit(algo.client_step)(local, batch, server)
    assert max_rel_err(new.teacher.params, step(start[0], grads[0], lr)) < 1e-5
    assert max_rel_err(new.student.params, step(start[1], grads[1], mentee)) < 1e-5
    assert max_rel_err(new.w_h.params, step(start[2], grads[2], lr, False)) < 1e-5
    assert server.w_h.shape == (12, 16) and float(jnp.max(jnp.abs(server.w_h))) <= 12 ** -0.5
    assert float(metrics["kl_sum"]) > 0 and float(metrics["hidden_sum"]) > 0


@pytest.mark.slow
def test_rounds_average_compressed_students_and_clients_keep_their_teachers():
    cd, model, variables, tx = pfl_setup()
    algo = _fedkd(model, tx, t_start=0.5, t_end=0.6, rounds=2)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=1)
    student = states[0].server.student
    dense = tree_bytes(student)
    # Three clients, each under its dense update; each downloads the whole student.
    assert 0 < stats[0]["upload_bytes"] < 3 * dense
    assert stats[0]["download_bytes"] == 3 * dense
    assert max_rel_err(states[-1].server.student, student) > 1e-4
    ids = sim.sample(0)
    teachers = sim.personal_evaluation(states[-1])
    for k in range(6):
        moved = max_rel_err(jax.tree_util.tree_map(lambda v: v[k], teachers["params"]),
                            variables["params"])
        assert (moved > 1e-4) == (k in ids)  # trained, else its initial model


@pytest.mark.slow
def test_energy_one_is_the_uncompressed_round_with_the_same_local_training():
    cd, model, variables, tx = pfl_setup()
    _, states, _ = pfl_rounds(_fedkd(model, tx, t_start=0.5, t_end=0.6, rounds=2), cd,
                              variables, rounds=1)
    full = _fedkd(model, tx, t_start=1.0, t_end=1.0, rounds=2)
    _, fstates, fstats = pfl_rounds(full, cd, variables, rounds=1)
    assert fstats[0]["upload_bytes"] == 3 * tree_bytes(states[0].server.student)
    assert max_rel_err(fstates[1].client_states, states[1].client_states) < 1e-5
    assert max_rel_err(fstates[1].server.student, states[1].server.student) > 1e-4


def test_bad_options_are_refused_naming_the_value():
    _, model, _, tx = pfl_setup()
    for kw, text in ((dict(t_start=0.0), "0.0"), (dict(t_end=1.5), "1.5"),
                     (dict(kl_mean="rows"), "'rows'"), (dict(clip=-1.0), "-1.0"),
                     (dict(rounds=0), "0"), (dict(student="mlp(hidden=-3)"), "mlp")):
        with pytest.raises(ValueError, match=text):
            _fedkd(model, tx, **kw)


def _groups(algorithms, nets, initial, cd, arch):
    services = Services(cd, PFL_WORK, participation=0.5, seed=7, strategy="vmap")
    return Groups(nets, initial, arch, algorithms, services, "num_examples")


@pytest.mark.slow
def test_networks_of_several_architectures_share_one_student():
    cd, model, variables, tx = pfl_setup()
    deep = models.build("mlp", 10, hidden=[20, 12, 8])
    dvars = models.init(deep, jax.random.PRNGKey(1), SHAPE)
    algos = [_fedkd(model, tx), _fedkd(deep, tx)]
    g = _groups(algos, [model, deep], [variables, dvars], cd, np.arange(6) % 2)
    start = g.init(None)
    state, stats = g.round(start)
    a, b = state.server
    assert max_rel_err(a.student, b.student) == 0
    assert max_rel_err(a.student, start.server[0].student) > 1e-4
    assert state.client_states[1]["w_h"].shape == (3, 12, 8)  # D_s = 12 -> D_t = 8
    assert stats["download_bytes"] == 3 * tree_bytes(a.student)


@pytest.mark.slow
def test_groups_of_one_network_give_the_simulations_numbers():
    cd, model, variables, tx = pfl_setup()
    algo = _fedkd(model, tx)
    _, want, _ = pfl_rounds(algo, cd, variables)
    g = _groups([algo], [model], [variables], cd, np.zeros(6, int))
    state = g.init(None)
    for _ in range(2):
        state, _ = g.round(state)
    assert max_rel_err(state.server[0].student, want[-1].server.student) == 0
    assert max_rel_err(state.client_states[0], want[-1].client_states) == 0


@pytest.mark.slow
def test_config_runs_several_networks(tmp_path):
    from fedjax_pan.run import experiment
    from test_experiment import config, metrics
    archs = "mlp(hidden=(32, 16)); mlp(hidden=(16,))"
    cfg = dict(algorithm="fedkd", model__architectures=archs, rounds=2,
               partition__test_fraction=0.25, fedkd__student="mlp(hidden=(8,))")
    experiment.train(config(**cfg), str(tmp_path / "a"), progress=False)
    rows = metrics(tmp_path / "a")
    assert len(rows) == 2 and 0 <= rows[-1]["pfl_accuracy"] <= 1
    assert rows[-1]["download_bytes_per_client"] == 4 * (784 * 8 + 8 + 8 * 10 + 10)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = _fedkd(model, tx, t_start=0.6, t_end=0.7, rounds=2)
    sim, loop, ref, loop_stats, vmap_stats = strategies_agree(algo, cd, variables)
    assert [s["upload_bytes"] for s in loop_stats] == [s["upload_bytes"] for s in vmap_stats]
    teachers = sim.personal_evaluation(loop[-1])
    assert max_rel_err(teachers, loop[-1].client_states["teacher"]) == 0
