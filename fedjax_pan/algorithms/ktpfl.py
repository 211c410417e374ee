"""KT-pFL (Zhang et al., NeurIPS 2021; paper 001's Algorithm 1): personalised models that
share knowledge through soft predictions on unlabelled public data.

Every client n keeps its own model w^n (nothing is averaged). In a round a sampled client
trains on its private data, then distils on public batches towards its personalised soft
target sum_m c_mn s(w^m, x) (the server's latest soft predictions of every client, mixed
by the knowledge-coefficient matrix c), minimising T^2 KL(target || s(w^n, x)) with
s(w, x) = softmax(z / T) (Hinton's T^2 keeps the gradient's scale across T). It then
sends its soft predictions on the whole public set. The server stores them and takes one
gradient step on c (Eq. 7):

    c <- c - eta3 grad_c [ lam sum_n (D_n / D) KL(sum_m c_mn s^m || s^n)
                           + rho ||c - 1/N||^2 ]

KL averaged over the public examples. The paper constrains c no further than the
regulariser pulling it to 1/N, and neither does this. Before any client has trained,
every client's soft predictions are the initial model's.

Here the distillation is the last `distill_share` of the round's local steps (so it comes
out of `local.epochs`: E = 2 with `ktpfl.distill_epochs` = 1 trains one epoch, then
distils for as many steps), each on a public batch of the local batch size drawn with
replacement from the client's key. Clients evaluate their own w^n; there is no global
model (the global evaluation shows the initial one). One architecture for every client:
mixed architectures are not built yet.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import Aggregator, AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.rules import between

PyTree = Any
OPTIONS = {"temperature": 1.0, "lam": 1.0, "rho": 0.1, "coef_lr": 0.1, "distill_epochs": 1.0}
RULES = {"temperature": between(0, lo_open=True), "lam": between(0), "rho": between(0),
         "coef_lr": between(0), "distill_epochs": between(0, lo_open=True)}
EPS = 1e-12  # inside logs of probabilities


class KtServer(NamedTuple):
    params: PyTree  # the initial model (evaluated as the "global" one)
    model_state: Dict[str, PyTree]
    coef: jax.Array  # c (N, N): c[m, n] = client m's share in client n's target
    soft: jax.Array  # (N, P, C): every client's latest soft predictions on the public set
    sizes: jax.Array  # (N,) D_n as the clients reported them (0: never took part, no weight)
    round: jax.Array


class KtLocal(NamedTuple):
    train: local_lib.LocalState
    target: jax.Array  # (P, C) this client's personalised soft target
    key: jax.Array
    distill_from: jax.Array  # the first distillation step
    size: jax.Array  # D_n, reported with the soft predictions


def soft_predictions(logits: jax.Array, temperature: float) -> jax.Array:
    return jax.nn.softmax(logits / temperature, axis=-1)


def kl_rows(target: jax.Array, probs: jax.Array) -> jax.Array:
    """KL(target || probs) of each row, summed over the last (class) axis."""
    return jnp.sum(target * (jnp.log(target + EPS) - jnp.log(probs + EPS)), axis=-1)


def kl(target: jax.Array, probs: jax.Array) -> jax.Array:
    """KL(target || probs) averaged over every row."""
    return jnp.mean(kl_rows(target, probs))


def targets(coef: jax.Array, soft: jax.Array) -> jax.Array:
    """(N, P, C): client n's target sum_m c[m, n] soft[m]."""
    return jnp.einsum("mn,mpc->npc", coef, soft)


def coefficient_objective(coef: jax.Array, soft: jax.Array, weights: jax.Array, lam: float,
                          rho: float) -> jax.Array:
    """lam sum_n w_n KL(target_n || soft_n) + rho ||c - 1/N||^2 (w: D_n / D)."""
    t = targets(coef, soft)
    per_client = jax.vmap(kl)(t, soft)
    n = coef.shape[0]
    return lam * jnp.sum(weights * per_client) + rho * jnp.sum((coef - 1.0 / n) ** 2)


def update_coefficients(coef: jax.Array, soft: jax.Array, sizes: jax.Array, lam: float,
                        rho: float, lr: float) -> jax.Array:
    """One gradient step of size `lr` on `coefficient_objective` (Eq. 7)."""
    weights = sizes / jnp.maximum(jnp.sum(sizes), 1.0)
    grad = jax.grad(coefficient_objective)(coef, soft, weights, lam, rho)
    return coef - lr * grad


def ktpfl(model: nn.Module, client_tx: optax.GradientTransformation, public: jax.Array,
          num_clients: int, distill_share: float, *, temperature: float = 1.0,
          lam: float = 1.0, rho: float = 0.1, coef_lr: float = 0.1, eval_batch: int = 1000,
          warmup: str = "none", warmup_length: int = 0) -> FederatedAlgorithm:
    """KT-pFL for `num_clients` clients of one architecture distilling on `public`
    (normalised images); the last round(distill_share x steps) local steps distil."""
    local_lib.check_share(distill_share, "KT-pFL's share of local steps for distillation")
    public = jnp.asarray(public, jnp.float32)
    n_pub = public.shape[0]

    def predict(params, model_state):
        """Soft predictions on the whole public set, in chunks."""
        out = []
        for start in range(0, n_pub, eval_batch):
            x = public[start:start + eval_batch]
            logits = model.apply({"params": params, **model_state}, x, train=False)
            out.append(soft_predictions(logits, temperature))
        return jnp.concatenate(out)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        first = predict(params, model_state)
        return KtServer(params, model_state,
                        jnp.full((num_clients, num_clients), 1.0 / num_clients, jnp.float32),
                        jnp.broadcast_to(first, (num_clients, *first.shape)),
                        jnp.zeros((num_clients,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return {"params": server.params, **server.model_state}

    def client_init(server, client_state, ctx):
        lr_scale = local_lib.round_lr_scale(server.round, warmup, warmup_length)
        train = local_lib.init_local(client_tx, client_state, lr_scale)
        target = jnp.einsum("m,mpc->pc", server.coef[:, ctx.client_id], server.soft)
        distill_from = (jnp.asarray(ctx.num_steps, jnp.int32)
                        - local_lib.phase_steps(distill_share, ctx.num_steps))
        return KtLocal(train, target, jax.random.fold_in(ctx.rng, 0x4B), distill_from,
                       jnp.asarray(ctx.num_examples, jnp.float32))

    def train_step(local, batch):
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch, warmup,
                                            warmup_length)
        return local._replace(train=train), metrics

    def distill_step(local, batch):
        rows = jax.random.randint(jax.random.fold_in(local.key, local.train.step),
                                  batch["y"].shape, 0, n_pub)
        target = local.target[rows]

        def loss(logits, labels, mask):
            del labels
            per_row = kl_rows(target, soft_predictions(logits, temperature))
            return temperature ** 2 * jnp.sum(per_row * mask)
        public_batch = {"x": public[rows], "y": batch["y"], "mask": jnp.ones_like(batch["mask"])}
        train, _ = local_lib.sgd_step(model, client_tx, local.train, public_batch, warmup,
                                      warmup_length, loss=loss)
        # The round's training loss is the private data's: distillation steps add nothing.
        return local._replace(train=train), {"loss_sum": jnp.zeros((), jnp.float32),
                                             "num_examples": jnp.zeros((), jnp.float32)}

    def client_step(local, batch, server):
        del server
        return jax.lax.cond(local.train.step < local.distill_from, train_step, distill_step,
                            local, batch)

    def client_output(local, server):
        del server
        soft = predict(local.train.params, local.train.model_state)
        return ({"soft": soft, "size": local.size},
                {"params": local.train.params, **local.train.model_state})

    def server_update(server, outputs, info):
        ids = info.client_ids
        soft = server.soft.at[ids].set(outputs["soft"])
        sizes = server.sizes.at[ids].set(outputs["size"])
        coef = update_coefficients(server.coef, soft, sizes, lam, rho, coef_lr)
        return server._replace(coef=coef, soft=soft, sizes=sizes, round=server.round + 1)

    def eval_variables(server):
        return {"params": server.params, **server.model_state}

    def personal_variables(server, client_state):
        del server
        return client_state

    return FederatedAlgorithm(server_init, client_state_init, client_init, client_step,
                              client_output, server_update, eval_variables,
                              aggregator=Aggregator(lambda outs, weights: outs, stacked=True),
                              personal_variables=personal_variables)


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation, *, public: Any) -> FederatedAlgorithm:
    del server_tx  # nothing is averaged
    share = local_lib.share_of_steps(cfg.ktpfl.distill_epochs, cfg.local.epochs,
                                     "ktpfl.distill_epochs", "distillation is")
    o = cfg.ktpfl
    return ktpfl(model, client_tx, public, cfg.partition.num_clients, share,
                 temperature=o.temperature, lam=o.lam, rho=o.rho, coef_lr=o.coef_lr,
                 eval_batch=cfg.eval.batch_size, warmup=cfg.optimizer.warmup,
                 warmup_length=cfg.optimizer.warmup_length)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, public=True)
