"""FedPAC (Xu, Tong, Huang, ICLR 2023, "Personalized Federated Learning with Feature
Alignment and Classifier Collaboration").

The model is a feature extractor f (every layer below the head; its output, the sown
'features') and a linear head g_i per client. Round t, client i:

  1. receives the global extractor and the global class prototypes c_k (the mean over
     the previous round's clients of their class means of f(x));
  2. trains its head with the extractor frozen, on CE;
  3. trains the extractor with its head frozen, on CE + lam * MSE(f(x), c_y)  (Eq. 6;
     rows of a class without a prototype add 0);
  4. reports its extractor, head, class means, and the statistics of the received
     extractor on its data: h_ik = p_ik mu_ik and
     V_i = (1/n_i) sum_k [p_ik tr(F_k^T F_k)/n_ik - p_ik^2 ||mu_ik||^2]
     (p_ik its label share, mu_ik its class-k mean feature; PFLlib's/the authors'
     `statistics_extraction`, its 1/n_i included).
The server averages the extractors (weighted by size; deltas through `server_tx`, sgd(1)
the mean), averages the class means into prototypes (unweighted over the clients that
hold the class), and gives each sampled client i the head sum_j alpha_ij g_j with

  alpha_i = argmin_{alpha in simplex} alpha^T (diag(V) + D_i) alpha,
  D_i[j, l] = sum_k (h_ik - h_jk) . (h_ik - h_lk)                       (Eq. 10)

over the round's clients; as PFLlib, weights <= 1e-3 are then set to 0 (not
renormalised). PFLlib solves the QP with cvxpy; here projected gradient descent with
Nesterov momentum (FISTA, `SOLVER_STEPS` steps of 1 / (2 lambda_max), Euclidean
projection onto the simplex), a convex QP's global optimum to ~1e-6 (tested against
scipy's SLSQP). The matrix is positive semi-definite by construction (a Gram matrix
plus V >= 0), so PFLlib's eigenvalue clipping and "no solution" fallback never apply.
A client is scored with the global extractor and its own head (the global extractor's
slot holds the initial head until then).

Choices: the head phase is the first `head_fraction` of the round's local steps and the
body phase the rest. PFLlib's clientpac.py trains the head one epoch and then the body
E (`local_epochs`) epochs: `local.epochs` = E + 1 with `head_fraction` = 1 / (E + 1)
reproduces it (the default 0.5 is E = 1 with `local.epochs` = 2;
experiments/personalized.py sets both). Deviations (to stay inside one pass of local
steps): V and h come from the head phase's batches (the extractor is still the received
one there; PFLlib makes a separate pass over the data before training), and the class
means from the body phase's training batches as they are seen (PFLlib: a pass with the
trained extractor after training; its commented-out code collected them in the loop as
here); examples count as often as they are visited. The frozen parts do not move
(their updates are masked out). Before any client has trained there are no prototypes
(no alignment term, PFLlib's first round).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, every_output,
                                        federated_algorithm, per_client, sends)
from fedjax_pan.algorithms.fedavg_family.fedavg import server_step
from fedjax_pan.algorithms.personal.fedpcl import global_prototypes
from fedjax_pan.algorithms.personal.fedproto import class_means
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.rules import between, check_options
from fedjax_pan.references import Reference, pfllib

PyTree = Any
tree_map = jax.tree_util.tree_map
OPTIONS = {"lam": 1.0, "head_fraction": 0.5}
RULES = {"lam": between(0, 1e4), "head_fraction": between(0, 1, lo_open=True, hi_open=True)}
SOLVER_STEPS = 2000
ZERO_BELOW = 1e-3  # PFLlib zeroes combination weights <= this


REFERENCE = Reference(
    "Xu, Tong & Huang, 'Personalized Federated Learning with Feature Alignment and "
    "Classifier Collaboration', ICLR 2023 (FedPAC, Alg. 1, Eq. 11-13)",
    pfllib("servers/serverpac.py", "clients/clientpac.py"),
    ("the statistics V and h come from the head phase's batches, not a separate pass: one "
     "pass of local steps",
     "class means come from the body phase's training batches, not a pass after training",
     "the combination QP is solved by FISTA on the simplex, not cvxpy (checked against "
     "scipy)",
     "the extractor is averaged by `aggregation.weights` (PFLlib: by training-set size)"))


class PacServer(NamedTuple):
    params: PyTree  # the global extractor; the head slot keeps the initial head
    model_state: Dict[str, PyTree]
    protos: jax.Array  # (C, D) global prototypes
    present: jax.Array  # (C,) 1 where some client reported the class last round
    heads: PyTree  # (N, ...) each client's head (the initial head until combined)
    opt_state: PyTree
    round: jax.Array


class PacLocal(NamedTuple):
    train: local_lib.LocalState
    head_steps: jax.Array
    count: jax.Array  # (C,) examples seen per class, head phase (statistics)
    sums: jax.Array  # (C, D) their features' sums
    sq: jax.Array  # (C,) their squared norms' sums
    p_count: jax.Array  # (C,) body phase (class means)
    p_sums: jax.Array  # (C, D)
    share: jax.Array  # (C,) label shares
    size: jax.Array  # n_i
    client_id: jax.Array


def simplex_projection(v: jax.Array, allowed: Any = None) -> jax.Array:
    """The Euclidean projection of v onto the probability simplex (Duchi et al. 2008),
    restricted to the coordinates `allowed` (the others 0)."""
    if allowed is not None:
        v = jnp.where(allowed, v, -1e9)
    n = v.shape[0]
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u)
    k = jnp.arange(1, n + 1, dtype=v.dtype)
    last = jnp.max(jnp.where(u - (css - 1.0) / k > 0, jnp.arange(n), 0))
    return jnp.maximum(v - (css[last] - 1.0) / (last + 1.0), 0.0)


def simplex_qp(p: jax.Array, allowed: Any = None, steps: int = SOLVER_STEPS) -> jax.Array:
    """argmin_{alpha in simplex} alpha^T P alpha for a symmetric PSD P (FISTA)."""
    n = p.shape[0]
    allowed = jnp.ones((n,), bool) if allowed is None else allowed
    lmax = jnp.max(jnp.linalg.eigvalsh(p))
    step = 1.0 / jnp.maximum(2.0 * lmax, 1e-12)
    x0 = jnp.where(allowed, 1.0, 0.0) / jnp.maximum(jnp.sum(allowed), 1)

    def body(_, carry):
        x, y, t = carry
        x_new = simplex_projection(y - step * 2.0 * (p @ y), allowed)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        y_new = x_new + ((t - 1.0) / t_new) * (x_new - x)
        return x_new, y_new, t_new
    x, _, _ = jax.lax.fori_loop(0, steps, body, (x0, x0, jnp.ones((), p.dtype)))
    return x


def combination_matrix(v: jax.Array, h: jax.Array) -> jax.Array:
    """(M, M, M): for each client i, diag(V) + D_i with D_i[j, l] =
    sum_k (h_i[k] - h_j[k]) . (h_i[k] - h_l[k]) (h: (M, C, D))."""
    def one(hi):
        diff = (hi[None] - h).reshape(h.shape[0], -1)
        return jnp.diag(v) + diff @ diff.T
    return jax.vmap(one)(h)


def combination_weights(v: jax.Array, h: jax.Array, present: Any = None) -> jax.Array:
    """(M, M): row i client i's weights over the round's heads (Eq. 10, then PFLlib's
    zeroing of weights <= 1e-3)."""
    alpha = jax.vmap(lambda p: simplex_qp(p, present))(combination_matrix(v, h))
    return jnp.where(alpha > ZERO_BELOW, alpha, 0.0)


def statistics(count: jax.Array, sums: jax.Array, sq: jax.Array, share: jax.Array,
               size: jax.Array) -> tuple:
    """(V, h): PFLlib's `statistics_extraction` from per-class counts, feature sums and
    squared-norm sums."""
    has = count > 0
    n = jnp.maximum(count, 1.0)
    mu = sums / n[:, None]
    h = jnp.where(has[:, None], share[:, None] * mu, 0.0)
    v = jnp.sum(jnp.where(has, share * sq / n - share ** 2 * jnp.sum(mu * mu, axis=1), 0.0))
    return v / jnp.maximum(size, 1.0), h


def fedpac(model: nn.Module, client_tx: optax.GradientTransformation, num_clients: int,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, lam: float = 1.0,
           head_fraction: float = 0.5) -> FederatedAlgorithm:
    """FedPAC for `num_clients` clients of a flax `model` that sows 'features' under a
    linear `head`."""
    check_options(RULES, "fedpac", lam=lam, head_fraction=head_fraction)
    net = local_lib.WithFeatures(model)

    def body(params):
        return {k: v for k, v in params.items() if k != HEAD}

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        linear_head(params, "FedPAC")
        dim, classes = params[HEAD]["kernel"].shape
        heads = per_client(params[HEAD], num_clients)
        return PacServer(params, model_state, jnp.zeros((classes, dim), jnp.float32),
                         jnp.zeros((classes,), jnp.float32), heads,
                         server_tx.init(body(params)), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        # The heads live in the server's stack (the server combines them); a client keeps
        # its row there once it has trained (-1 before: the initial head).
        del server
        return {"slot": jnp.full((), -1, jnp.int32)}

    def client_init(server, client_state, ctx):
        del client_state
        head = tree_map(lambda x: x[ctx.client_id], server.heads)
        train = local_lib.init_local(client_tx, {"params": {**server.params, HEAD: head},
                                                 **server.model_state}, server.round)
        classes, dim = server.protos.shape
        counts = jnp.asarray(ctx.label_counts, jnp.float32)
        zc, zcd = jnp.zeros((classes,), jnp.float32), jnp.zeros((classes, dim), jnp.float32)
        return PacLocal(train, local_lib.phase_steps(head_fraction, ctx.num_steps), zc, zcd,
                        zc, zc, zcd, counts / jnp.maximum(jnp.sum(counts), 1.0),
                        jnp.asarray(ctx.num_examples, jnp.float32),
                        jnp.asarray(ctx.client_id, jnp.int32))

    def client_step(local, batch, server):
        train, mask = local.train, batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)
        in_head = train.step < local.head_steps
        onehot = jax.nn.one_hot(batch["y"], server.protos.shape[0]) * mask[:, None]

        def loss_fn(params):
            (logits, f), new_state = local_lib.forward(net, params, train.model_state, batch,
                                                       train=True)
            f = f.reshape(f.shape[0], -1)
            ce_sum = local_lib.masked_cross_entropy(logits, batch["y"], mask)
            has = server.present[batch["y"]] * mask
            target = server.protos[batch["y"]]
            mse = jnp.sum(jnp.sum((f - target) ** 2, axis=1) * has) / (n * f.shape[1])
            align = jnp.where(in_head, 0.0, lam * mse)
            return ce_sum / n + align, (ce_sum, new_state, f, mse)

        grads, (ce_sum, new_state, f, mse) = jax.grad(loss_fn, has_aux=True)(train.params)
        updates, opt_state = client_tx.update(grads, train.opt_state, train.params)
        # The head phase moves the head only, the body phase everything else.
        updates = {k: tree_map(lambda u: jnp.where(in_head == (k == HEAD), u, 0.0), u_k)
                   for k, u_k in updates.items()}
        params = optax.apply_updates(train.params, updates)
        f = jax.lax.stop_gradient(f)
        h_w = jnp.where(in_head, 1.0, 0.0)
        local = local._replace(
            train=local_lib.LocalState(params, new_state, opt_state, train.step + 1),
            count=local.count + h_w * jnp.sum(onehot, 0),
            sums=local.sums + h_w * onehot.T @ f,
            sq=local.sq + h_w * onehot.T @ jnp.sum(f * f, axis=1),
            p_count=local.p_count + (1 - h_w) * jnp.sum(onehot, 0),
            p_sums=local.p_sums + (1 - h_w) * onehot.T @ f)
        return local, {"loss_sum": ce_sum, "num_examples": jnp.sum(mask),
                       "align_sum": jnp.where(in_head, 0.0, mse) * jnp.sum(mask)}

    def client_output(local, server):
        p = local.train.params
        v, h = statistics(local.count, local.sums, local.sq, local.share, local.size)
        protos, has = class_means(local.p_sums, local.p_count)
        delta = tree_map(jnp.subtract, body(p), body(server.params))
        return ({"delta": delta, "model_state": local.train.model_state, "head": p[HEAD],
                 "v": v, "h": h, "protos": protos, "has": has},
                {"slot": local.client_id})

    def server_update(server, outs, info):
        w = info.weights
        here = w > 0  # a weight of 0: a slot without an output
        mean = lambda x: jnp.tensordot(w, x, axes=1)  # noqa: E731
        body_params, opt_state = server_step(server_tx, body(server.params), server.opt_state,
                                             tree_map(mean, outs["delta"]))
        params = {**body_params, HEAD: server.params[HEAD]}
        model_state = tree_map(mean, outs["model_state"])
        protos, present = global_prototypes(outs["protos"], outs["has"] * here[:, None])
        alpha = combination_weights(outs["v"], outs["h"], here)
        new_heads = tree_map(lambda x: jnp.tensordot(alpha, x, axes=1), outs["head"])
        ids = jnp.where(here, info.client_ids, info.num_clients)  # absent: dropped
        heads = tree_map(lambda all_, new: all_.at[ids].set(new, mode="drop"), server.heads,
                         new_heads)
        return PacServer(params, model_state, protos, present, heads, opt_state,
                         server.round + 1)

    def personal_variables(server, client_state):
        slot = client_state["slot"]
        head = tree_map(lambda all_, first: jnp.where(slot >= 0, all_[jnp.maximum(slot, 0)],
                                                      first), server.heads, server.params[HEAD])
        return {"params": {**server.params, HEAD: head}, **server.model_state}

    def sent(server):
        # The extractor and its statistics, the prototypes and the client's head.
        return (body(server.params), server.model_state, server.protos, server.present,
                tree_map(lambda x: x[0], server.heads))

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               aggregator=every_output, personal_variables=personal_variables,
                               download_bytes=sends(sent))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fedpac(model, client_tx, cfg.partition.num_clients, server_tx, lam=cfg.fedpac.lam,
                  head_fraction=cfg.fedpac.head_fraction)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, reference=REFERENCE)
