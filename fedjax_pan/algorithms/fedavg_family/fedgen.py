"""FedGen (Zhu et al., ICML 2021, "Data-Free Knowledge Distillation for Heterogeneous
Federated Learning"): a server-side generator of representations, learned from the
clients' heads, regularises local training.

The server keeps a generator G(y, eps) -> a representation for class y (noise eps
uniform on [0, 1)^noise_dim; one hidden layer with batch normalisation and ReLU). A
client trains its model on

    CE(h(f(x)), y) + CE(h(G(y', eps)), y'),    y' ~ p(y),

the second term on a batch of generated representations through its own head h (the
generator fixed), and sends its update. The server then trains G for `server_epochs`
Adam steps on

    CE(sum_k w_k h_k(G(y', eps)), y'),   y' ~ p(y),

the ensemble of the round's heads weighted by their aggregation weights, and averages the
updates as FedAvg does (with `server_tx`). For linear heads the weighted ensemble's logits
are the logits of the weighted mean head, which is how they are computed here.

As PFLlib's clientgen.py / servergen.py: the generator's layout, uniform noise, batch
statistics in its normalisation (train mode), Adam at `generator_lr` with betas
(0.9, 0.999), `server_epochs` steps of the clients' batch size, labels drawn from the
label distribution, the generator trained before the aggregation. PFLlib draws labels
from every client's labels, known at the start; here p(y) is the label distribution of
the last round's clients (their pooled histogram under 'num_examples' weights), uniform
before any round. `localize_features` (PFLlib's `localize_feature_extractor`): only the
head is averaged (starting as a draw from the seed, the same for every network), each
client keeps its own feature extractor (its state) and is scored with it under the
global head (set `partition.test_fraction` to score them), and clients may run several
networks of one representation width (`model.architectures`).
Downloads count the model (or head) and the generator.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends, server_model)
from fedjax_pan.algorithms.personal import HEAD, linear_head
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import Rule, between, boolean, check_options

PyTree = Any
# PFLlib's defaults (system/main.py: -nd 512, -hd 512 (its generator's), -glr 0.005,
# -se 1000, -lf False).
OPTIONS = {"noise_dim": 512, "hidden": 512, "generator_lr": 0.005, "server_epochs": 1000,
           "localize_features": False}
RULES = {"noise_dim": between(1, 65536, integer=True), "hidden": between(1, 65536, integer=True),
         "generator_lr": between(0, 10, lo_open=True),
         "server_epochs": between(0, 100000, integer=True),
         "localize_features": Rule(boolean)}
GENERATOR_STREAM = 0x67656E  # the generator's keys, folded into the seed's


REFERENCE = Reference(
    "Zhu, Hong and Zhou, 'Data-Free Knowledge Distillation for Heterogeneous Federated "
    "Learning', ICML 2021 (FedGen: the server's generator trained on the ensemble of the "
    "clients' heads, and the clients' cross-entropy on generated representations)",
    pfllib("servers/servergen.py", "clients/clientgen.py"),
    ("labels y' are drawn from the label distribution of the last round's clients "
     "(uniform before any round); PFLlib draws from every client's labels, known at the "
     "start",
     "the generator's first Dense has no bias (the batch normalisation after it, always "
     "on batch statistics, cancels it); PFLlib's has one",
     "with localize_features the global head starts as a draw from the seed, the same for "
     "every network; PFLlib's is a copy of the model's initial head"))


class Generator(nn.Module):
    """PFLlib's `Generative`: [eps, onehot(y)] -> Dense -> BatchNorm -> ReLU -> Dense
    (the first Dense without its bias, which the normalisation cancels)."""

    num_classes: int
    noise_dim: int
    hidden: int
    features: int

    @nn.compact
    def __call__(self, labels: jax.Array, noise: jax.Array) -> jax.Array:
        x = jnp.concatenate([noise, jax.nn.one_hot(labels, self.num_classes)], axis=-1)
        # No bias before the normalisation, which cancels it: PFLlib's has one, whose
        # gradient is 0 but for rounding, and which Adam then moves by rounding noise.
        x = nn.Dense(self.hidden, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=False)(x)  # batch statistics (train mode)
        return nn.Dense(self.features)(nn.relu(x))


class GenServer(NamedTuple):
    params: PyTree  # the global model (localize_features: the initial body, global head)
    model_state: PyTree
    opt_state: PyTree  # server_tx's, over the shared part
    generator: PyTree  # the generator's parameters
    gen_opt: PyTree  # its Adam state
    label_dist: jax.Array  # (C,) p(y)
    round: jax.Array


class GenLocal(NamedTuple):
    train: local_lib.LocalState
    key: jax.Array
    labels: jax.Array  # (C,) the client's label distribution, reported


def fedgen(model: nn.Module, client_tx: optax.GradientTransformation, batch_size: int,
           server_tx: optax.GradientTransformation = optax.sgd(1.0), *, noise_dim: int = 512,
           hidden: int = 512, generator_lr: float = 0.005, server_epochs: int = 1000,
           localize_features: bool = False, seed: int = 0) -> FederatedAlgorithm:
    """FedGen for a `model` that sows 'features' and ends in one linear head; generated
    batches (client and server) of `batch_size`."""
    check_options(RULES, "fedgen", noise_dim=noise_dim, hidden=hidden,
                  generator_lr=generator_lr, server_epochs=server_epochs,
                  localize_features=localize_features)
    gen_tx = optax.adam(generator_lr, b1=0.9, b2=0.999, eps=1e-8)
    base_key = jax.random.fold_in(jax.random.PRNGKey(seed), GENERATOR_STREAM)

    def head_shape(params):
        return linear_head(params, "FedGen")["kernel"].shape

    def generator_net(params):
        d, c = head_shape(params)
        return Generator(c, noise_dim, hidden, d)

    def generate(net, gen_params, key, dist, n):
        """n labels drawn from `dist` and their generated representations."""
        k1, k2 = jax.random.split(key)
        labels = jax.random.categorical(k1, jnp.log(jnp.maximum(dist, 1e-30)), shape=(n,))
        noise = jax.random.uniform(k2, (n, noise_dim))
        z, _ = net.apply({"params": gen_params, "batch_stats": batch_stats(net)}, labels,
                         noise, mutable=["batch_stats"])
        return labels, z

    def batch_stats(net):
        return {"BatchNorm_0": {"mean": jnp.zeros(net.hidden), "var": jnp.ones(net.hidden)}}

    def shared(params):
        return {HEAD: params[HEAD]} if localize_features else params

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        net = generator_net(params)
        d, c = head_shape(params)
        if localize_features:  # one global head for every network, drawn from the seed
            params = {**params, HEAD: {"kernel": nn.initializers.lecun_normal()(
                jax.random.fold_in(base_key, 1), (d, c), jnp.float32),
                "bias": jnp.zeros((c,), jnp.float32)}}
        gen = net.init(base_key, jnp.zeros((2,), jnp.int32), jnp.zeros((2, noise_dim)))
        return GenServer(params, model_state, server_tx.init(shared(params)), gen["params"],
                         gen_tx.init(gen["params"]), jnp.full((c,), 1.0 / c),
                         jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return server_model(server) if localize_features else None

    def client_init(server, client_state, ctx):
        if localize_features:
            start = {**client_state, "params": {**client_state["params"],
                                                HEAD: server.params[HEAD]}}
        else:
            start = server_model(server)
        counts = jnp.asarray(ctx.label_counts, jnp.float32)
        return GenLocal(local_lib.init_local(client_tx, start, ctx.round),
                        jax.random.fold_in(ctx.rng, GENERATOR_STREAM),
                        counts / jnp.maximum(jnp.sum(counts), 1.0))

    def client_step(local, batch, server):
        net = generator_net(server.params)
        key = jax.random.fold_in(local.key, local.train.step)
        # `batch_size` samples whatever the batch's rows (PFLlib's `self.batch_size`):
        # a short or padded batch draws the same.
        labels, z = generate(net, server.generator, key, server.label_dist, batch_size)
        z = jax.lax.stop_gradient(z)

        def generated(params, train, batch, logits):
            del train, batch, logits
            h = params[HEAD]
            term = optax.softmax_cross_entropy_with_integer_labels(
                z @ h["kernel"] + h["bias"], labels).mean()
            return term, {"generated_sum": term * labels.shape[0]}
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch,
                                            extra_loss=generated)
        return local._replace(train=train), metrics

    def client_output(local, server):
        delta = jax.tree_util.tree_map(jnp.subtract, shared(local.train.params),
                                       shared(server.params))
        output: Dict[str, Any] = {"delta": delta, "labels": local.labels}
        if localize_features:
            return output, local_lib.model_variables(local.train)
        return {**output, "model_state": local.train.model_state}, None

    def train_generator(server, head, dist, round_index):
        net = generator_net(server.params)

        def step(carry, t):
            gen, opt = carry

            def loss(g):
                labels, z = generate(net, g, jax.random.fold_in(
                    jax.random.fold_in(base_key, round_index), t), dist, batch_size)
                logits = z @ head["kernel"] + head["bias"]
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            updates, opt = gen_tx.update(jax.grad(loss)(gen), opt, gen)
            return (optax.apply_updates(gen, updates), opt), None
        (gen, opt), _ = jax.lax.scan(step, (server.generator, server.gen_opt),
                                     jnp.arange(server_epochs))
        return gen, opt

    def server_update(server, mean, info):
        # The round's weighted ensemble of heads is their weighted mean (linear heads).
        head = jax.tree_util.tree_map(jnp.add, server.params[HEAD], mean["delta"][HEAD])
        dist = mean["labels"] / jnp.maximum(jnp.sum(mean["labels"]), 1e-12)
        gen, gen_opt = train_generator(server, head, dist, info.round)
        pseudo_grad = jax.tree_util.tree_map(jnp.negative, mean["delta"])
        updates, opt_state = server_tx.update(pseudo_grad, server.opt_state,
                                              shared(server.params))
        new = optax.apply_updates(shared(server.params), updates)
        model_state = server.model_state if localize_features else mean["model_state"]
        return GenServer({**server.params, **new}, model_state, opt_state, gen, gen_opt,
                         dist, server.round + 1)

    def personal_variables(server, client_state):
        return {**client_state, "params": {**client_state["params"], HEAD: server.params[HEAD]}}

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               personal_variables=personal_variables if localize_features
                               else None,
                               download_bytes=sends(lambda server: shared(server.params),
                                                    "generator"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    o = cfg.fedgen
    return fedgen(model, client_tx, cfg.local.batch_size, server_tx, noise_dim=o.noise_dim,
                  hidden=o.hidden, generator_lr=o.generator_lr, server_epochs=o.server_epochs,
                  localize_features=o.localize_features, seed=cfg.seed)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, heterogeneous=True,
                       reference=REFERENCE)
