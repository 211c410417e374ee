"""Compressed communication, as a wrapper over any algorithm whose output is an update or a
model (its `model_view`), optax style (`fedjax_pan.compression` holds the transforms).

Upload. A client's trained model w, broadcast w_s: with target 'update' it sends
C(w - w_s) and the server reads w_s + C(w - w_s); with target 'model' it sends C(w)
(pruning: `magnitude_mask`, `importance_mask`, as slides 001's post-training mask
Theta_p = Theta * M^P). Non-trainable state (BatchNorm statistics) is sent dense. A
transform's state (error feedback's residual) is kept per client across rounds.

Pre-training masks (`mask_before`): the slides' L_i = l(D_i, Theta) + lambda_1 ||Theta *
M^r||_1 with M^r the weights a mask computed on the broadcast model would prune (scored by
|w|, or by |dL/dw * w| on the client's first batch); the L1 term is applied as its
proximal step after each local step (soft-thresholding the masked weights by lr *
lambda_1), which needs no change to the algorithm's loss. The upload's post-training mask
(`magnitude_mask` / `importance_mask` with target 'model') then prunes.

Majority vote (`vote`, with sign compression): the server moves each coordinate by the
sign of the clients' summed signs times their mean scale (signSGD with majority vote,
Bernstein et al. 2019), instead of averaging the scaled signs.

Download. The server sends C(w_new - w_pub) and every client's broadcast is the public
model w_pub <- w_pub + C(w_new - w_pub) (with `error_feedback`, the residual is the
server's). A client sampled at round t that last received the public model at round r
needs the t - r messages since, or the whole model if that is smaller (the first time: the
whole model); `download_bytes` charges exactly that. The server's own model (evaluated) is
w_new.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_pan import compression as comp
from fedjax_pan.algorithms.core import FederatedAlgorithm, tree_bytes, weighted_mean
from fedjax_pan.algorithms.local import split_variables
from fedjax_pan.engine.protocol import output_update, with_output_update

PyTree = Any
tree_map = jax.tree_util.tree_map
TARGETS = ("update", "model")
MASK_SCORES = ("magnitude", "importance")
_UPLOAD_STREAM, _DOWNLOAD_STREAM = 0xC0, 0xC1


class MaskBefore(NamedTuple):
    """The pre-training mask: keep `ratio` of each layer by `score`, push the rest to 0
    with L1 strength `l1` at the clients' learning rate `lr`."""

    ratio: float
    score: str = "magnitude"
    l1: float = 1e-4
    lr: float = 0.05


class CompressedLocal(NamedTuple):
    inner: PyTree
    transform_state: PyTree
    key: jax.Array
    prune: PyTree  # pre-training mask's pruned weights (1: pruned), or None


class CompressedClient(NamedTuple):
    inner: PyTree  # the algorithm's own client state
    transform_state: PyTree


class DownloadServer(NamedTuple):
    inner: PyTree  # the algorithm's server state (its model: the server's)
    public: PyTree  # the parameters every client receives
    synced: jax.Array  # (K,) int32: round each client last received it, -1: never
    transform_state: PyTree


def _has_leaves(tree: PyTree) -> bool:
    return bool(jax.tree_util.tree_leaves(tree))


def with_compression(algorithm: FederatedAlgorithm, variables: PyTree,
                     upload: comp.Transform = comp.identity(), *, target: str = "update",
                     download: Optional[comp.Transform] = None, num_clients: int = 0,
                     seed: int = 0, vote: bool = False,
                     mask_before: Optional[MaskBefore] = None,
                     grad_fn: Optional[Callable] = None) -> FederatedAlgorithm:
    """`algorithm` whose clients send `upload`'s messages (and receive `download`'s, for
    `num_clients` clients; its random draws from `seed` and the round) over the model
    `variables`; see the module docstring.
    `grad_fn(params, model_state, batch)`: the loss gradient, for importance masks
    before training."""
    if target not in TARGETS:
        raise ValueError(f"compression target must be one of {TARGETS}, got {target!r}")
    view = algorithm.model_view
    if view is None:
        raise ValueError("compression transforms a model or an update, and this algorithm's "
                         "output is neither")
    if vote and target != "update":
        raise ValueError("majority vote is over the signs of updates, not of models")
    if vote and algorithm.aggregator is not weighted_mean:
        raise ValueError("majority vote replaces the mean, and this algorithm aggregates "
                         "another way")
    if mask_before is not None and mask_before.score == "importance" and grad_fn is None:
        raise ValueError("an importance mask before training needs the loss gradient")
    params, model_state = split_variables(variables)
    upload_bytes = comp.message_bytes(upload, params) + tree_bytes(model_state)
    stateful = _has_leaves(jax.eval_shape(upload.init, params))
    out = algorithm._replace(
        client_state_init=_client_state_init(algorithm, upload, stateful),
        client_init=_client_init(algorithm, upload, stateful, mask_before),
        client_step=_client_step(algorithm, mask_before, grad_fn),
        client_output=_client_output(algorithm, upload, target, stateful, vote),
        upload_bytes=lambda output, local: upload_bytes,  # an int: exact past 2^24
        server_update=(_vote_update(algorithm) if vote else algorithm.server_update),
        model_view=None if vote else view)
    if download is not None:
        out = _with_download(out, algorithm, download, params, num_clients, seed)
    return out


def _client_state_init(algorithm, upload, stateful):
    def client_state_init(server):
        inner = algorithm.client_state_init(server)
        if not stateful:
            return inner
        params = algorithm.eval_variables(server)["params"]
        return CompressedClient(inner, upload.init(params))
    return client_state_init


def _client_init(algorithm, upload, stateful, mask_before):
    def client_init(server, client_state, ctx):
        inner_state = client_state.inner if stateful else client_state
        local = algorithm.client_init(server, inner_state, ctx)
        ts = client_state.transform_state if stateful else None  # None: stateless
        prune = None
        if mask_before is not None:
            # Placeholder until the first step scores the broadcast (importance needs a
            # batch); magnitude masks are final here.
            w = algorithm.eval_variables(server)["params"]
            prune = _pruned(w, w, mask_before.ratio) if mask_before.score == "magnitude" \
                else tree_map(lambda v: jnp.zeros(v.shape, bool), w)
        return CompressedLocal(local, ts, jax.random.fold_in(ctx.rng, _UPLOAD_STREAM), prune)
    return client_init


def _pruned(weights: PyTree, scores: PyTree, ratio: float) -> PyTree:
    """1 where a weight is outside its layer's top ceil(ratio * d) scores."""
    return tree_map(lambda w, s: ~comp.top_k_mask(jnp.abs(s), comp.kept(ratio, w.size)),
                    weights, scores)


def _client_step(algorithm, mask_before, grad_fn):
    if mask_before is None:
        def client_step(local, batch, server):
            inner, metrics = algorithm.client_step(local.inner, batch, server)
            return local._replace(inner=inner), metrics
        return client_step
    shrink = mask_before.lr * mask_before.l1

    def client_step(local, batch, server):
        prune = local.prune
        if mask_before.score == "importance":
            def score(_):
                w, ms = local.inner.params, local.inner.model_state
                g = grad_fn(w, ms, batch)
                return _pruned(w, tree_map(lambda a, b: a * b, g, w), mask_before.ratio)
            prune = jax.lax.cond(local.inner.step == 0, score, lambda _: prune, None)
        inner, metrics = algorithm.client_step(local.inner, batch, server)
        # The L1 term's proximal step on the weights to be pruned.
        params = tree_map(lambda w, p: jnp.where(p, jnp.sign(w) * jnp.maximum(
            jnp.abs(w) - shrink, 0.0), w), inner.params, prune)
        return local._replace(inner=inner._replace(params=params), prune=prune), metrics
    return client_step


def _client_output(algorithm, upload, target, stateful, vote):
    view = algorithm.model_view

    def client_output(local, server):
        output, inner_state = algorithm.client_output(local.inner, server)
        broadcast = algorithm.eval_variables(server)["params"]
        if target == "model":
            model = view.to_model(server, output)
            sent, ts = comp.apply(upload, model["params"], local.transform_state, local.key,
                                  broadcast)
            output = view.to_output(server, {**model, "params": sent})
        else:
            x = output_update(view, server, output, broadcast)
            update, ts = comp.apply(upload, x, local.transform_state, local.key, broadcast)
            output = with_output_update(view, server, output, update, broadcast)
        client_state = CompressedClient(inner_state, ts) if stateful else inner_state
        if vote:
            # The votes and each leaf's scale (sign messages are scale * sign(v)).
            output = {"inner": output, "votes": tree_map(jnp.sign, update),
                      "scale": tree_map(lambda u: jnp.max(jnp.abs(u)), update)}
        return output, client_state
    return client_output


def _vote_update(algorithm):
    view = algorithm.model_view

    def server_update(server, aggregate, info):
        broadcast = algorithm.eval_variables(server)["params"]
        step = tree_map(lambda v, s: jnp.sign(v) * s, aggregate["votes"], aggregate["scale"])
        return algorithm.server_update(
            server, with_output_update(view, server, aggregate["inner"], step, broadcast), info)
    return server_update


def _with_download(out: FederatedAlgorithm, algorithm: FederatedAlgorithm,
                   download: comp.Transform, params: PyTree, num_clients: int, seed: int
                   ) -> FederatedAlgorithm:
    """`out` whose clients receive the public model (module docstring)."""
    if algorithm.personal_variables is not None or algorithm.personal_adapt is not None:
        raise ValueError("download compression sends one public model, and this algorithm "
                         "evaluates personal models built from the server's")
    message = comp.message_bytes(download, params)
    full = tree_bytes(params)
    base_key = jax.random.fold_in(jax.random.PRNGKey(seed), _DOWNLOAD_STREAM)

    def clients_view(server):
        return server.inner._replace(params=server.public)

    def server_init(variables):
        inner = out.server_init(variables)
        if not hasattr(inner, "params") or not hasattr(inner, "_replace"):
            raise ValueError("download compression needs a server state with `params`")
        return DownloadServer(inner, inner.params, -jnp.ones(num_clients, jnp.int32),
                              download.init(inner.params))

    def server_update(server, aggregate, info):
        new = out.server_update(clients_view(server), aggregate, info)
        diff = tree_map(jnp.subtract, new.params, server.public)
        key = jax.random.fold_in(base_key, info.round)
        sent, ts = comp.apply(download, diff, server.transform_state, key, server.public)
        synced = server.synced.at[info.client_ids].set(info.round)
        return DownloadServer(new, tree_map(jnp.add, server.public, sent), synced, ts)

    cap = full // message + 1  # more messages than this cost more than the model

    def download_bytes(server, client_ids, round_index):
        last = server.synced[client_ids]
        behind = jnp.minimum(round_index - last, cap)
        return jnp.where(last < 0, full, jnp.minimum(full, behind * message)).astype(jnp.int32)

    def client_step(local, batch, server):
        return out.client_step(local, batch, clients_view(server))

    def client_output(local, server):
        return out.client_output(local, clients_view(server))

    return out._replace(
        server_init=server_init, server_update=server_update,
        client_state_init=lambda server: out.client_state_init(clients_view(server)),
        client_init=lambda server, cs, ctx: out.client_init(clients_view(server), cs, ctx),
        client_step=client_step, client_output=client_output,
        eval_variables=lambda server: out.eval_variables(server.inner),
        download_bytes=download_bytes, model_view=None)


__all__ = ["TARGETS", "MASK_SCORES", "MaskBefore", "CompressedLocal", "CompressedClient",
           "DownloadServer", "with_compression"]
