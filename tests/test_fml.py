"""FML: one mutual-learning step against an objective written out by hand (PFLlib's
undetached gradients, clipping, the KL's reductions in NumPy), the meme's FedAvg as
FedAvg, alpha = 1 with detached targets as Local; clients of several networks
(engine.groups) against the one-network simulation; loop, vmap and the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import PFL_WORK, max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan import models
from fedjax_pan.algorithms.core import ClientContext
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.personal.fml import MEME_KEY, fml, kl_divergence
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.services import Services

MEME = "mlp(hidden=(12,))"
SHAPE = (6, 6, 1)


def _fml(model, tx, **kw):
    return fml(model, tx, input_shape=SHAPE, meme=kw.pop("meme", MEME), **kw)


def _ctx():
    return ClientContext(jax.random.PRNGKey(0), 6, 20, 0, 1, jnp.ones(10))


@pytest.mark.reference("algorithm", "fml")
def test_kl_reductions_match_numpy():
    rng = np.random.default_rng(0)
    t, s = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    mask = np.array([1, 1, 0, 1, 1.0])
    p = np.exp(t) / np.exp(t).sum(1, keepdims=True)
    q = np.exp(s) / np.exp(s).sum(1, keepdims=True)
    rows = (p * (np.log(p) - np.log(q))).sum(1) * mask
    elements, total = kl_divergence(jnp.asarray(t), jnp.asarray(s), jnp.asarray(mask),
                                    "elements")
    examples, _ = kl_divergence(jnp.asarray(t), jnp.asarray(s), jnp.asarray(mask), "examples")
    np.testing.assert_allclose(float(total), rows.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(elements), rows.sum() / (4 * 4), rtol=1e-5)
    np.testing.assert_allclose(float(examples), rows.sum() / 4, rtol=1e-5)


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.reference("algorithm", "fml")
def test_a_step_follows_pfllibs_mutual_objective_with_clipping(detach):
    cd, model, variables, _ = pfl_setup()
    lr, alpha, beta, clip = 0.3, 0.6, 0.25, 0.05
    algo = _fml(model, optax.sgd(lr), alpha=alpha, beta=beta, detach=detach, clip=clip)
    server = algo.server_init(variables)
    local = algo.client_init(server, algo.client_state_init(server), _ctx())
    batch = {"x": cd.images[:8], "y": cd.labels[:8], "mask": jnp.ones(8).at[7].set(0)}
    meme_net = models.from_spec(MEME, 10)
    m = batch["mask"]

    def kl(t, s):  # torch.nn.KLDivLoss()(log_softmax(s), softmax(t)): mean over 7 x 10
        p = jax.nn.softmax(t)
        return jnp.sum(m[:, None] * p * (jnp.log(p) - jax.nn.log_softmax(s))) / 70

    def ce(o):
        return jnp.sum(m * optax.softmax_cross_entropy_with_integer_labels(o, batch["y"])) / 7

    def losses(wp, wm):
        op = model.apply({"params": wp}, batch["x"])
        om = meme_net.apply({"params": wm}, batch["x"])
        return (alpha * ce(op) + (1 - alpha) * kl(om, op),
                beta * ce(om) + (1 - beta) * kl(op, om))

    wp, wm = variables["params"], server.meme
    if detach:  # each network descends its own loss only
        gp, gm = jax.jit(lambda a, b: (jax.grad(lambda w: losses(w, b)[0])(a),
                                       jax.grad(lambda w: losses(a, w)[1])(b)))(wp, wm)
    else:  # PFLlib: loss.backward(); loss_g.backward() accumulate into both
        gp, gm = jax.jit(jax.grad(lambda a, b: sum(losses(a, b)), argnums=(0, 1)))(wp, wm)

    def clipped(g):
        norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                           for x in jax.tree_util.tree_leaves(g)))
        assert norm > clip  # the clipping acts
        return jax.tree_util.tree_map(lambda x: x * clip / (norm + 1e-6), g)
    want_p = jax.tree_util.tree_map(lambda w, g: w - lr * g, wp, clipped(gp))
    want_m = jax.tree_util.tree_map(lambda w, g: w - lr * g, wm, clipped(gm))
    new, metrics = jax.jit(algo.client_step)(local, batch, server)
    assert max_rel_err(new.own.params, want_p) < 1e-5
    assert max_rel_err(new.meme.params, want_m) < 1e-5
    assert float(metrics["num_examples"]) == 7 and float(metrics["kl_sum"]) > 0
    # The meme starts from its spec's network on the seed's folded key, every client alike.
    init = models.init(meme_net, jax.random.fold_in(jax.random.PRNGKey(0), MEME_KEY), SHAPE)
    assert max_rel_err(server.meme, init["params"]) == 0


@pytest.mark.slow
def test_alpha_one_detached_is_local_training_and_beta_one_the_meme_is_fedavg():
    cd, model, variables, tx = pfl_setup()
    spec = "mlp(hidden=(24, 16))"  # the meme as the clients' network, for FedAvg
    algo = _fml(model, tx, meme=spec, alpha=1.0, beta=1.0, detach=True, clip=0.0)
    _, states, stats = pfl_rounds(algo, cd, variables)
    _, local, _ = pfl_rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables)
    from flax import traverse_util
    mine = traverse_util.flatten_dict(jax.device_get(states[-1].client_states["params"]),
                                      sep="/")
    for key, theirs in local[-1].client_states["params"].items():
        np.testing.assert_allclose(mine[key], theirs, rtol=1e-5, atol=1e-6)
    meme0 = {"params": states[0].server.meme}
    _, avg, _ = pfl_rounds(fedavg(model, tx), cd, meme0)
    assert max_rel_err(states[-1].server.meme, avg[-1].server.params) < 1e-5
    # Every sampled client downloads the meme (12 -> 24 -> 16 -> 10, float32).
    meme_bytes = 4 * (36 * 24 + 24 + 24 * 16 + 16 + 16 * 10 + 10)
    assert stats[0]["download_bytes"] == 3 * meme_bytes


def test_bad_options_are_refused_naming_the_value():
    _, model, _, tx = pfl_setup()
    for kw, text in ((dict(alpha=1.5), "1.5"), (dict(beta=-0.1), "-0.1"),
                     (dict(kl_mean="rows"), "'rows'"), (dict(clip=-1.0), "-1.0"),
                     (dict(meme="mlp(hidden=-3)"), "mlp"),
                     (dict(meme="mlp; mlp"), "'mlp; mlp'")):
        with pytest.raises(ValueError, match=text):
            _fml(model, tx, **kw)


def _groups(algorithms, nets, initial, cd, arch):
    services = Services(cd, PFL_WORK, participation=0.5, seed=7, strategy="vmap")
    return Groups(nets, initial, arch, algorithms, services, "num_examples")


@pytest.mark.slow
def test_networks_of_several_architectures_share_one_meme():
    cd, model, variables, tx = pfl_setup()
    deep = models.build("mlp", 10, hidden=[20, 12, 8])
    dvars = models.init(deep, jax.random.PRNGKey(1), SHAPE)
    algos = [_fml(model, tx, alpha=0.5, beta=0.5), _fml(deep, tx, alpha=0.5, beta=0.5)]
    g = _groups(algos, [model, deep], [variables, dvars], cd, np.arange(6) % 2)
    start = g.init(None)
    state, stats = g.round(start)
    a, b = state.server
    assert max_rel_err(a.meme, b.meme) == 0
    assert max_rel_err(a.meme, start.server[0].meme) > 1e-4  # it trained
    # Each client is scored on its own network's private model.
    nets = g.personal_groups(state)
    assert nets[1][2]["params"]["fc3"]["kernel"].shape == (3, 12, 8)
    assert max_rel_err(nets[0][2], state.client_states[0]) == 0


@pytest.mark.slow
def test_groups_of_one_network_give_the_simulations_numbers():
    cd, model, variables, tx = pfl_setup()
    algo = _fml(model, tx, alpha=0.5, beta=0.5)
    _, want, _ = pfl_rounds(algo, cd, variables)
    g = _groups([algo], [model], [variables], cd, np.zeros(6, int))
    state = g.init(None)
    for _ in range(2):
        state, _ = g.round(state)
    assert max_rel_err(state.server[0].meme, want[-1].server.meme) == 0
    assert max_rel_err(state.client_states[0], want[-1].client_states) == 0


@pytest.mark.slow
def test_config_runs_several_networks(tmp_path):
    from fedjax_pan.run import experiment
    from test_experiment import config, metrics
    archs = "mlp(hidden=(32, 16)); mlp(hidden=(16,))"
    cfg = dict(algorithm="fml", model__architectures=archs, rounds=2,
               partition__test_fraction=0.25, fml__meme="mlp(hidden=(8,))")
    experiment.train(config(**cfg), str(tmp_path / "a"), progress=False)
    rows = metrics(tmp_path / "a")
    assert len(rows) == 2 and 0 <= rows[-1]["pfl_accuracy"] <= 1
    assert rows[-1]["download_bytes_per_client"] == 4 * (784 * 8 + 8 + 8 * 10 + 10)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = _fml(model, tx, alpha=0.5, beta=0.5)
    sim, loop, ref = strategies_agree(algo, cd, variables)[:3]
    assert max_rel_err(sim.personal_evaluation(loop[-1]), loop[-1].client_states) == 0
