"""GPFL (Zhang et al., ICCV 2023, "GPFL: Simultaneously Learning Global and Personalized
Feature Information for Personalized Federated Learning").

The model is a feature extractor (every layer below the head; its output f, the sown
'features') and a linear head. Clients share the extractor, a Global Category Embedding
layer (GCE, one embedding e_c in R^D per class) and a Conditional Valve (CoV); each keeps
its head. With a conditional input c,

    CoV(f, c) = ReLU(f * (1 + gamma(c)) + beta(c)),
    gamma(c) = LN(ReLU(W_g c + b_g)),  beta(c) = LN(ReLU(W_b c + b_b)),

a client with label distribution alpha_i (alpha_ic = its share of class c) uses the
generic input g = (1/C) sum_c e_c and the personal input p_i = sum_c alpha_ic e_c and
minimises

    CE(head_i(CoV(f, p_i)), y)                                        (personal path)
    + CE_cos(CoV(f, g), y)        softmax over cos(CoV(f, g), e_c) (the GCE's loss)
    + lam || CoV(f, g) - e_y^frozen ||_2                              (the batch's norm)

e^frozen the GCE as received this round. The extractor, GCE and CoV are averaged by the
server (deltas through `server_tx`: sgd(1) is the mean); heads stay with the clients. A
client is scored with head_i(CoV(f, p_i)) (`GNet`).

Choices follow PFLlib's clientgpfl.py / servergpfl.py: the GCE's loss is the mean over
the batch's (real) rows; the last term is the L2 (Frobenius) norm of the batch's
differences, not squared, not averaged; the GCE and CoV take weight decay `mu` (PFLlib's
`-mu`, default 0) on top of the optimiser; the GCE is initialised N(0, 1), the CoV's
linear layers as PyTorch's (U(+-1/sqrt(D)), here from the config seed's key); the
conditional inputs are zero in round 0 and afterwards come from the GCE a client held
before the last aggregate (PFLlib computes them at each round's end, for every client,
just before handing out the new aggregate): its own trained GCE if it trained in the
previous round (kept in its state: one GCE per client), else the global GCE one
aggregation old; heads start as the initial head.
Deviations: (1) the GCE and CoV follow `client_tx` (PFLlib: plain SGD at the same
learning rate); (2) the personal input of a client that has never trained is 0 (its
label histogram is known to it only once it takes part; PFLlib reads every client's at
start-up); (3) as FedCP's, a configured run evaluates through a
one-group `engine.groups.Groups` driver over `GNet` (settings that need the compiled
`Simulation`, and `model.architectures`, are refused there).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm, tree_bytes
from fedjax_pan.algorithms.personal.fedcp import LN_EPS, one_group
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import between

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 1.0, "mu": 0.0}
RULES = {"lam": between(0, 1e4), "mu": between(0, 100)}
COLLECTION = "gpfl"  # the personal model's extra variables (GNet reads them)


REFERENCE = Reference(
    "Zhang et al., 'GPFL: Simultaneously Learning Global and "
    "Personalized Feature Information for Personalized Federated Learning', ICCV 2023 "
    "(Algorithm 1: the Conditional Valve over the GCE's generic and personalised inputs, "
    "the personal CE + the GCE's angle-level loss + lambda times the alignment norm)",
    pfllib("servers/servergpfl.py", "clients/clientgpfl.py"),
    ("the GCE and CoV step with client_tx (plus weight decay mu); PFLlib steps them with "
     "plain SGD at the client learning rate",
     "the personal conditional input of a client that has never trained is 0 (its label "
     "histogram is known only once it takes part); PFLlib reads every client's at start-up",
     "BatchNorm statistics are averaged with the extractor; PFLlib aggregates and sends "
     "parameters only",
     "runs through a one-group Groups driver evaluating GNet: settings that need the "
     "compiled Simulation, and model.architectures, are refused"))


class GServer(NamedTuple):
    params: PyTree  # the global extractor (the head slot: the initial head, unused)
    model_state: Dict[str, PyTree]
    gce: jax.Array  # (C, D) the global category embeddings
    cov: PyTree  # the Conditional Valve
    gce_prev: jax.Array  # (C, D) the GCE one aggregation old (conditional inputs)
    opt_state: PyTree
    round: jax.Array


class GLocal(NamedTuple):
    train: local_lib.LocalState  # params {"model", "gce", "cov"}
    generic: jax.Array  # (D,) g
    personal: jax.Array  # (D,) p_i
    share: jax.Array  # (C,) alpha_i


def init_cov(key: jax.Array, dim: int) -> Dict[str, Dict[str, jax.Array]]:
    """The CoV's two Linear(D, D) (PyTorch's initialisation) and LayerNorm(D)."""
    bound = 1.0 / np.sqrt(dim)
    out = {}
    for i, name in enumerate(("gamma", "beta")):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        out[name] = {"kernel": jax.random.uniform(k1, (dim, dim), jnp.float32, -bound, bound),
                     "bias": jax.random.uniform(k2, (dim,), jnp.float32, -bound, bound),
                     "scale": jnp.ones((dim,), jnp.float32),
                     "shift": jnp.zeros((dim,), jnp.float32)}
    return out


def _branch(p: Dict[str, jax.Array], c: jax.Array) -> jax.Array:
    z = jax.nn.relu(c @ p["kernel"] + p["bias"])
    mean = jnp.mean(z, axis=-1, keepdims=True)
    var = jnp.mean((z - mean) ** 2, axis=-1, keepdims=True)
    return (z - mean) / jnp.sqrt(var + LN_EPS) * p["scale"] + p["shift"]


def cov_apply(cov: PyTree, features: jax.Array, cond: jax.Array) -> jax.Array:
    """ReLU(f * (1 + gamma(c)) + beta(c)) for features (B, D) and one input c (D,)."""
    f = features.reshape(features.shape[0], -1)
    return jax.nn.relu(f * (1.0 + _branch(cov["gamma"], cond)) + _branch(cov["beta"], cond))


def conditional_inputs(gce: jax.Array, share: jax.Array) -> tuple:
    """(g, p): the mean embedding and the embedding weighted by the label shares."""
    return jnp.mean(gce, axis=0), share @ gce


def _unit(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def gce_loss_sum(feat: jax.Array, gce: jax.Array, labels: jax.Array, mask: jax.Array
                 ) -> jax.Array:
    """Sum over real rows of -log softmax(cos(feat, e_c))[y] (PFLlib's GCE.forward)."""
    cosine = _unit(feat) @ _unit(gce).T
    return local_lib.masked_cross_entropy(cosine, labels, mask)


def batch_norm2(diff: jax.Array, mask: jax.Array) -> jax.Array:
    """||diff||_2 over the real rows, with a finite gradient at 0."""
    s = jnp.sum(jnp.sum(diff * diff, axis=-1) * mask)
    safe = jnp.where(s > 0, s, 1.0)
    return jnp.where(s > 0, jnp.sqrt(safe), 0.0)


def _body(params: PyTree) -> dict:
    """Every layer but the head."""
    return {k: v for k, v in params.items() if k != HEAD}


class GNet(NamedTuple):
    """The network a GPFL client is scored with: head(CoV(features, p_i)) when
    `variables` hold the 'gpfl' collection, else `model` itself."""

    model: nn.Module

    def apply(self, variables, x, train=False, mask=None, mutable=False):
        if COLLECTION not in variables:
            return self.model.apply(variables, x, train=train, mask=mask, mutable=mutable)
        extra = variables[COLLECTION]
        rest = {k: v for k, v in variables.items() if k != COLLECTION}
        _, f = local_lib.WithFeatures(self.model).apply(rest, x, train=False, mask=mask)
        head = rest["params"][HEAD]
        return cov_apply(extra["cov"], f, extra["cond"]) @ head["kernel"] + head["bias"]


def gpfl(model: nn.Module, client_tx: optax.GradientTransformation,
         server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 1.0,
         mu: float = 0.0, seed: int = 0) -> FederatedAlgorithm:
    """GPFL for a flax `model` that sows 'features' under a linear `head`; the GCE and
    CoV are drawn from `seed`."""
    if not 0 <= lam <= 1e4:
        raise ValueError(f"GPFL's lam must lie in [0, 1e4], got {lam}")
    if not 0 <= mu <= 100:
        raise ValueError(f"GPFL's mu must lie in [0, 100], got {mu}")
    net = local_lib.WithFeatures(model)
    key0 = jax.random.fold_in(jax.random.PRNGKey(seed), 0x6F)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        linear_head(params, "GPFL")
        dim, classes = params[HEAD]["kernel"].shape
        gce = jax.random.normal(jax.random.fold_in(key0, 0), (classes, dim), jnp.float32)
        cov = init_cov(jax.random.fold_in(key0, 1), dim)
        shared = {"params": _body(params), "gce": gce, "cov": cov}
        return GServer(params, model_state, gce, cov, gce, server_tx.init(shared),
                       jnp.zeros((), jnp.int32))

    def client_state_init(server):
        # Its head, label shares, its GCE after its last round and that round (-1: none).
        classes = server.gce.shape[0]
        return {"head": server.params[HEAD], "share": jnp.zeros((classes,), jnp.float32),
                "gce": server.gce, "last": jnp.full((), -1, jnp.int32)}

    def inputs(server, client_state, share):
        # The GCE the client held before the last aggregate: its own if it trained in
        # the previous round, else the global one of the aggregation before.
        own = client_state["last"] == server.round - 1
        source = jnp.where(own, client_state["gce"], server.gce_prev)
        g, p = conditional_inputs(source, share)
        on = (server.round > 0).astype(jnp.float32)  # PFLlib: zeros before any aggregate
        return g * on, p * on

    def client_init(server, client_state, ctx):
        counts = jnp.asarray(ctx.label_counts, jnp.float32)
        share = counts / jnp.maximum(jnp.sum(counts), 1.0)
        trained = {"model": {**server.params, HEAD: client_state["head"]}, "gce": server.gce,
                   "cov": server.cov}
        train = local_lib.init_local(client_tx, {"params": trained, **server.model_state},
                                     server.round)
        g, p = inputs(server, client_state, share)
        return GLocal(train, g, p, share)

    def client_step(local, batch, server):
        train, mask = local.train, batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)
        frozen = jax.lax.stop_gradient(server.gce)[batch["y"]]

        def loss_fn(params):
            (_, f), new_state = local_lib.forward(net, params["model"], train.model_state,
                                                  batch, train=True)
            f = f.reshape(f.shape[0], -1)
            head = params["model"][HEAD]
            logits = cov_apply(params["cov"], f, local.personal) @ head["kernel"] + head["bias"]
            ce_sum = local_lib.masked_cross_entropy(logits, batch["y"], mask)
            feat_g = cov_apply(params["cov"], f, local.generic)
            gce_sum = gce_loss_sum(feat_g, params["gce"], batch["y"], mask)
            align = batch_norm2(feat_g - frozen, mask)
            return ce_sum / n + gce_sum / n + lam * align, (ce_sum, new_state, gce_sum, align)

        grads, (ce_sum, new_state, gce_sum, align) = jax.grad(loss_fn, has_aux=True)(
            train.params)
        # PyTorch's weight_decay=mu on the GCE's and CoV's optimisers.
        for name in ("gce", "cov"):
            grads[name] = tree_map(lambda g, w: g + mu * w, grads[name], train.params[name])
        train = local_lib.apply_gradients(client_tx, train, grads, new_state)
        real = jnp.sum(mask)
        return local._replace(train=train), {"loss_sum": ce_sum, "num_examples": real,
                                             "gce_sum": gce_sum, "align_sum": align * real}

    def client_output(local, server):
        p = local.train.params
        # The head is not sent: only the extractor, GCE and CoV.
        sent = {"params": _body(p["model"]), "gce": p["gce"], "cov": p["cov"]}
        delta = tree_map(jnp.subtract, sent, {"params": _body(server.params),
                                              "gce": server.gce, "cov": server.cov})
        return ({"delta": delta, "model_state": local.train.model_state},
                {"head": p["model"][HEAD], "share": local.share, "gce": p["gce"],
                 "last": server.round})

    def server_update(server, mean_output, info):
        del info
        shared = {"params": _body(server.params), "gce": server.gce, "cov": server.cov}
        grad = tree_map(jnp.negative, mean_output["delta"])
        updates, opt_state = server_tx.update(grad, server.opt_state, shared)
        shared = optax.apply_updates(shared, updates)
        return GServer({**shared["params"], HEAD: server.params[HEAD]},
                       mean_output["model_state"], shared["gce"], shared["cov"], server.gce,
                       opt_state, server.round + 1)

    def eval_variables(server):
        # The global extractor with the initial head (the bare architecture).
        return {"params": server.params, **server.model_state}

    def personal_variables(server, client_state):
        _, p = inputs(server, client_state, client_state["share"])
        params = {**server.params, HEAD: client_state["head"]}
        return {"params": params, COLLECTION: {"cov": server.cov, "cond": p},
                **server.model_state}

    def download_bytes(server, client_ids, round_index):
        # The extractor, its statistics, the GCE and CoV, and the conditional inputs g
        # and p_i (two D-vectors from the previous GCE).
        del client_ids, round_index
        return tree_bytes((_body(server.params), server.model_state, server.gce, server.cov,
                           server.gce_prev[:2]))

    return FederatedAlgorithm(server_init, client_state_init, client_init, client_step,
                              client_output, server_update, eval_variables,
                              personal_variables=personal_variables,
                              download_bytes=download_bytes)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return gpfl(model, client_tx, server_tx, lam=cfg.gpfl.lam, mu=cfg.gpfl.mu, seed=cfg.seed)


def driver(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
           services: Any) -> Any:
    """One group over every client (`engine.groups.Groups`) evaluated through `GNet`."""
    return one_group("GPFL", GNet(model), model, cfg, client_tx, services, from_config)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, driver=driver, personal=True,
                       reference=REFERENCE)
