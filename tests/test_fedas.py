"""FedAS: the alignment step, the FIM trace and prototypes, and the Fisher-weighted
aggregation against numpy on a tiny linear model; phases and personal models over rounds;
loop / vmap / reference agreement; options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.core import ClientContext, RoundInfo
from fedjax_pan.algorithms.personal.fedas import fedas
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.config.defaults import default_config
from fedjax_pan.models import layers

ALIGN_LR = 0.2


class Tiny(nn.Module):
    """f = x A (sown as 'features'), logits = f W + b."""

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        f = nn.Dense(4, use_bias=False, name="body")(x.reshape(x.shape[0], -1))
        return nn.Dense(3, name="head")(layers.sow(self, "features", f))


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _batch(x, y, mask):
    return {"x": jnp.asarray(x), "y": jnp.asarray(y), "mask": jnp.asarray(mask)}


@pytest.mark.reference("algorithm", "fedas")
def test_alignment_fim_and_prototypes_follow_their_formulas_by_hand():
    rng = np.random.default_rng(0)
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    glob = {"body": {"kernel": 0.3 * rng.normal(size=(6, 4))},
            "head": {"kernel": 0.3 * rng.normal(size=(4, 3)), "bias": 0.1 * rng.normal(size=3)}}
    own_head = {"kernel": 0.3 * rng.normal(size=(4, 3)), "bias": 0.1 * rng.normal(size=3)}
    protos = rng.normal(size=(3, 4))
    has = np.array([1.0, 1.0, 0.0])  # class 2 has no prototype
    algo = fedas(Tiny(), client_optimizer(0.1, 0.0), 0.25, 0.25, align_lr=ALIGN_LR)
    server = algo.server_init({"params": jax.tree_util.tree_map(f32, glob)})
    state = {"model": {"params": {"body": {"kernel": f32(np.zeros((6, 4)))},
                                  "head": jax.tree_util.tree_map(f32, own_head)}},
             "protos": f32(protos), "has_proto": f32(has)}
    local = algo.client_init(server, state,
                             ClientContext(jax.random.PRNGKey(0), 4, 6, 0, 1, jnp.ones(3)))
    # The training model: the global extractor with the client's own head.
    assert max_rel_err(local.train.params["head"], own_head) < 1e-7
    assert max_rel_err(local.train.params["body"], glob["body"]) < 1e-7
    x = rng.normal(size=(6, 2, 3, 1)).astype(np.float32)
    y = np.array([0, 1, 0, 2, 1, 0], np.int32)
    mask = np.array([1, 1, 1, 1, 1, 0], np.float32)

    # Step 1 aligns: sum_c mean_{rows of c, D} (x A - p_c)^2 over classes with a prototype.
    local, metrics = algo.client_step(local, _batch(x, y, mask), server)
    assert float(metrics["num_examples"]) == 0
    a = glob["body"]["kernel"]
    xs = x.reshape(6, -1).astype(np.float64)
    grad = np.zeros_like(a)
    for c in (0, 1):
        rows = (y == c) & (mask > 0)
        diff = xs[rows] @ a - protos[c]
        grad += 2 * xs[rows].T @ diff / (rows.sum() * 4)
    np.testing.assert_allclose(np.asarray(local.train.params["body"]["kernel"]),
                               a - ALIGN_LR * grad, rtol=1e-5, atol=1e-6)
    assert max_rel_err(local.train.params["head"], own_head) < 1e-7  # the head stays
    # Steps 2 and 3 train; step 4 adds the FIM trace and the class sums of f.
    for _ in range(2):
        local, metrics = algo.client_step(local, _batch(x, y, mask), server)
        assert float(metrics["num_examples"]) == 5
    p = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), local.train.params)
    local, metrics = algo.client_step(local, _batch(x, y, mask), server)
    assert float(metrics["num_examples"]) == 0
    real = mask > 0
    feats = xs[real] @ p["body"]["kernel"]
    d_logits = (_softmax(feats @ p["head"]["kernel"] + p["head"]["bias"]) -
                np.eye(3)[y[real]]) / real.sum()
    g_w, g_b = feats.T @ d_logits, d_logits.sum(axis=0)
    g_a = xs[real].T @ (d_logits @ p["head"]["kernel"].T)
    fim = sum(np.sum(g ** 2) for g in (g_w, g_b, g_a))
    np.testing.assert_allclose(float(local.fim), fim, rtol=1e-5)
    output, new_state = algo.client_output(local, server)
    np.testing.assert_allclose(float(output["fim"]), fim, rtol=1e-5)
    for c in range(3):
        rows = y[real] == c
        np.testing.assert_allclose(np.asarray(new_state["protos"][c]),
                                   feats[rows].mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_state["has_proto"]), [1, 1, 1])
    assert max_rel_err(new_state["model"]["params"], p) < 1e-7

    # The server averages models with weights F_i / sum F_j (the engine's weights unused).
    fims = np.array([0.5, 2.0, 1.5], np.float32)
    models = {"params": jax.tree_util.tree_map(
        lambda v: f32(np.stack([v + i for i in range(3)])), glob)}
    new = algo.server_update(server, {"model": models, "fim": f32(fims)},
                             RoundInfo(jnp.int32(1), jnp.arange(3), f32([0.6, 0.2, 0.2]), 5))
    w = fims / fims.sum()
    want = jax.tree_util.tree_map(lambda v: v + float(np.dot(w, np.arange(3))), glob)
    assert max_rel_err(new.params, want) < 1e-6


@pytest.mark.slow
def test_rounds_keep_personal_models_and_prototypes():
    cd, model, variables, tx = pfl_setup()
    algo = fedas(model, tx, 0.2, 0.3)
    sim, states, stats = pfl_rounds(algo, cd, variables, rounds=2)
    cs = jax.device_get(states[-1].client_states)
    sampled = {int(k) for r in range(2) for k in sim.sample(r)}
    for k in range(cd.num_clients):
        mine = jax.tree_util.tree_map(lambda v: v[k], cs["model"])
        if k in sampled:
            assert np.all(cs["has_proto"][k] <= 1) and np.any(cs["has_proto"][k] > 0)
            assert max_rel_err(mine["params"], variables["params"]) > 1e-3
        else:  # never trained: the initial model, no prototypes
            assert max_rel_err(mine, variables) == 0 and np.all(cs["has_proto"][k] == 0)
    assert max_rel_err(sim.personal_evaluation(states[-1]), cs["model"]) == 0
    assert all(s["train_loss"] > 0 for s in stats)


@pytest.mark.slow
def test_loop_vmap_and_reference_agree():
    cd, model, variables, tx = pfl_setup()
    algo = fedas(model, tx, 0.2, 0.3)
    sim, loop, ref = strategies_agree(algo, cd, variables, rounds=3)[:3]


def test_options_are_checked():
    _, model, _, tx = pfl_setup()
    with pytest.raises(ValueError, match=r"must leave steps to train: got 0.5 \+ 0.5 >= 1"):
        fedas(model, tx, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"fedas.align_lr must be a number in \[0, 100\], got -1"):
        fedas(model, tx, 0.2, 0.2, align_lr=-1)
    cfg = default_config()
    cfg.algorithm, cfg.local.epochs = "fedas", 1.0
    cfg.fedas.align_epochs, cfg.fedas.fim_epochs = 0.5, 0.6
    with pytest.raises(ValueError, match=r"below local.epochs \(1\).*got 0.5 \+ 0.6"):
        registry.from_config(model, cfg)
    cfg.fedas.align_epochs = 1.0
    with pytest.raises(ValueError, match=r"fedas.align_epochs .*local.epochs \(1\).*got 1"):
        registry.from_config(model, cfg)
    cfg.fedas.align_epochs, cfg.fedas.fim_epochs = 0.25, 0.25
    assert registry.from_config(model, cfg).personal_variables is not None
