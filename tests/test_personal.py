"""Partial-sharing personalised FL (Local, FedPer, LG-FedAvg, FedBN) against FedAvg, a NumPy
round (its tiny net and NumPy gradient are reused by test_ditto), and
against what each must keep to itself."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import PFL_SIZES as SIZES
from conftest import max_rel_err, pfl_rounds, pfl_setup as _setup
from fedjax_pan.algorithms import fedavg
from fedjax_pan.algorithms.personal import PERSONAL, partial_sharing
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.models import layers


def _rounds(algo, cd, variables, strategy="vmap", rounds=2):
    sim, states, stats = pfl_rounds(algo, cd, variables, strategy, rounds)
    return sim, states[-1], stats


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


@pytest.mark.parametrize("warmup", ["none", "rounds", "steps"])
def test_nothing_personal_is_fedavg(warmup):
    cd, model, variables, tx = _setup(warmup=warmup)
    _, shared, _ = _rounds(partial_sharing(model, tx, lambda path: False), cd, variables)
    _, avg, _ = _rounds(fedavg(model, tx), cd, variables)
    assert max_rel_err(shared.server.params, avg.server.params) < 1e-6
    assert max_rel_err(avg.server.params, variables["params"]) > 1e-2  # it trained


def test_local_never_communicates():
    cd, model, variables, tx = _setup()
    sim, state, stats = _rounds(partial_sharing(model, tx, PERSONAL["local"]), cd, variables,
                                rounds=1)
    assert all(s["upload_bytes"] == 0 for s in stats)
    assert max_rel_err(state.server.params, variables["params"]) == 0  # nothing arrives
    sampled = set(sim.sample(0).tolist())
    init = _flat(variables["params"])
    for k in range(len(SIZES)):
        own = {key: v[k] for key, v in state.client_states["params"].items()}
        moved = max(np.max(np.abs(own[key] - init[key])) for key in init)
        assert (moved > 0) == (k in sampled), k


def test_fedper_keeps_heads_and_shares_the_body():
    cd, model, variables, tx = _setup()
    sim, state, _ = _rounds(partial_sharing(model, tx, PERSONAL["fedper"]), cd, variables,
                            rounds=1)
    server, init = _flat(state.server.params), _flat(variables["params"])
    for key in init:
        changed = np.max(np.abs(server[key] - init[key])) > 0
        assert changed == (not key.startswith("head/")), key  # the global head never moves
    assert set(state.client_states["params"]) == {"head/bias", "head/kernel"}
    # Each sampled client's head is its own, not their mean.
    heads = state.client_states["params"]["head/kernel"][np.sort(sim.sample(0))]
    assert np.max(np.abs(heads[0] - heads[1])) > 1e-4


def test_fedbn_leaves_each_clients_norm_layers_out_of_the_average():
    cd, model, variables, tx = _setup(norm="batch")
    algo = partial_sharing(model, tx, PERSONAL["fedbn"])
    sim, state, _ = _rounds(algo, cd, variables, rounds=1)
    server, init = _flat(state.server.params), _flat(variables["params"])
    norm_keys = [k for k in init if k.split("/")[0].endswith("_norm")]
    assert norm_keys and set(state.client_states["params"]) == set(norm_keys)
    for key in init:  # norm parameters untouched on the server; the rest averaged
        assert (np.max(np.abs(server[key] - init[key])) > 0) == (key not in norm_keys), key
    # A client's norm parameters and statistics are exactly what its own training left:
    # run that client alone from the same round and compare.
    cohort = sim.cohort(sim.init(variables), 0)
    m = 0
    alone = sim.executor.run(sim.init(variables).server, cohort._replace(
        ids=cohort.ids[m:m + 1], steps=cohort.steps[m:m + 1], weights=np.ones(1),
        data_keys=cohort.data_keys[m:m + 1], rngs=cohort.rngs[m:m + 1],
        client_states=jax.tree_util.tree_map(lambda x: x[cohort.ids[m]][None],
                                             sim.init(variables).client_states)))
    client = cohort.ids[m]
    for key in norm_keys:
        np.testing.assert_allclose(state.client_states["params"][key][client],
                                   alone.client_states["params"][key][0], rtol=1e-6)
    stats = state.client_states["model_state"]["batch_stats"]
    assert stats and all(np.max(np.abs(v[client] - alone.client_states["model_state"]
                                       ["batch_stats"][k][0])) < 1e-5
                         for k, v in stats.items())
    # Evaluated on its own data a client uses its own norm layers.
    mine = sim.personal_evaluation(state)
    assert np.allclose(_flat(mine["params"])[norm_keys[0]][client],
                       state.client_states["params"][norm_keys[0]][client])


# A tiny net and its gradient written out in NumPy: the pFL modules' reference rounds.
class TinyNet(nn.Module):
    """x (N, D, 1, 1) -> a = tanh(x W + b) ('body') -> h = a * s ('body_norm', sown as
    'features') -> h V + c ('head')."""

    hidden: int = 5
    classes: int = 3

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        del train, mask
        a = jnp.tanh(nn.Dense(self.hidden, name="body")(x.reshape(x.shape[0], -1)))
        h = layers.sow(self, "features", _Scale(name="body_norm")(a))
        return nn.Dense(self.classes, name="head")(h)


class _Scale(nn.Module):
    @nn.compact
    def __call__(self, a):
        return a * self.param("scale", nn.initializers.ones, (a.shape[-1],))


def tiny_net_setup(clients=4, size=8, dim=4, seed=0):
    """(model, variables with random values everywhere, ClientData of `clients` clients of
    `size` examples (dim features, 3 classes), [(x, y) per client] in NumPy)."""
    rng = np.random.default_rng(seed)
    model = TinyNet()
    x = rng.normal(size=(clients * size, dim, 1, 1)).astype(np.float32)
    y = rng.integers(0, 3, clients * size).astype(np.int32)
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(x[:1]))["params"]
    variables = {"params": jax.tree_util.tree_map(
        lambda v: jnp.asarray(0.5 * rng.normal(size=v.shape), jnp.float32), params)}
    variables["params"]["body_norm"]["scale"] += 1.0
    parts = [np.arange(k * size, (k + 1) * size) for k in range(clients)]
    cd = ClientData.create(x, y, parts, num_classes=3)
    data = [(x[p, :, 0, 0].astype(np.float64), y[p]) for p in parts]
    return model, variables, cd, data


def np_flat(params):
    return {k: np.asarray(v, np.float64) for k, v in
            traverse_util.flatten_dict(jax.device_get(params), sep="/").items()}


def np_forward(p, x):
    """(a, h, logits) of TinyNet with flat NumPy parameters `p`."""
    a = np.tanh(x @ p["body/kernel"] + p["body/bias"])
    h = a * p["body_norm/scale"]
    return a, h, h @ p["head/kernel"] + p["head/bias"]


def np_softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_grads(p, x, y, dlogits=None):
    """Gradient of the mean softmax cross-entropy (or of a loss whose gradient in the
    logits is `dlogits`) with respect to every parameter of TinyNet."""
    a, h, z = np_forward(p, x)
    dz = (np_softmax(z) - np.eye(z.shape[1])[y]) / len(y) if dlogits is None else dlogits
    dh = dz @ p["head/kernel"].T
    dpre = dh * p["body_norm/scale"] * (1 - a ** 2)
    return {"head/kernel": h.T @ dz, "head/bias": dz.sum(0), "body_norm/scale": (dh * a).sum(0),
            "body/kernel": x.T @ dpre, "body/bias": dpre.sum(0)}


def tiny_sim(algo, cd, variables, steps, participation=0.5, seed=3, **kw):
    """A Simulation of full-batch rounds of `steps` local steps, uniform weights."""
    work = LocalWork(batch_size=8, mode="steps", local_steps=steps, **kw)
    return Simulation(algo, cd, work, make_executor("loop", algo, work, cd, variables, 2),
                      participation=participation, seed=seed)


@pytest.mark.reference("algorithm", "local", "fedper", "lg_fedavg", "fedbn")
@pytest.mark.parametrize("name", sorted(PERSONAL))
def test_rounds_match_partial_sharing_written_in_numpy(name):
    """Each sampled client trains {global shared, own personal} parameters with plain SGD;
    the server adds the mean change of the shared ones; the personal ones stay with it
    (the global model's initial values before its first round)."""
    model, variables, cd, data = tiny_net_setup()
    steps, lr = 3, 0.1
    algo = partial_sharing(model, optax.sgd(lr), PERSONAL[name])
    sim = tiny_sim(algo, cd, variables, steps)
    state = sim.init(variables)
    g = np_flat(variables["params"])
    own_keys = [k for k in g if PERSONAL[name](tuple(k.split("/")))]
    own = [{k: g[k].copy() for k in own_keys} for _ in data]
    for r in range(2):
        ids = np.asarray(sim.sample(r))
        deltas = []
        for k in ids:
            w = {**g, **own[k]}
            for _ in range(steps):
                grads = np_grads(w, *data[k])
                w = {key: w[key] - lr * grads[key] for key in w}
            own[k] = {key: w[key] for key in own_keys}
            deltas.append({key: w[key] - g[key] for key in g if key not in own_keys})
        g = {key: g[key] + (np.mean([d[key] for d in deltas], axis=0) if key not in own_keys
                            else 0.0) for key in g}
        state, _ = sim.round(state)
    got = np_flat(state.server.params)
    for key in g:
        np.testing.assert_allclose(got[key], g[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in own_keys:
        np.testing.assert_allclose(state.client_states["params"][key],
                                   np.stack([o[key] for o in own]), rtol=1e-5, atol=1e-6,
                                   err_msg=key)
