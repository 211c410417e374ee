"""Compressed communication, as a wrapper over any algorithm whose output is an update or a
model (its `model_view`), optax style (`algorithms.uploads.compression` holds the
transforms).

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

from fedjax_pan.algorithms.uploads import compression as comp
from fedjax_pan.algorithms.core import (Build, FeatureEntry, FederatedAlgorithm, tree_bytes,
                                        weighted_mean)
from fedjax_pan.algorithms.local import mean_loss, split_variables
from fedjax_pan.algorithms import stragglers
from fedjax_pan.algorithms.wrapping import (map_sent_model, map_sent_update, nest_client,
                                            nest_local, nest_server)
from fedjax_pan.engine.protocol import with_output_update
from fedjax_pan.rules import Rule, between, boolean, one_of

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
    # A stateful transform's state (error feedback's residual) is kept per client beside
    # the algorithm's own client state (`CompressedClient`).
    nested = nest_local(nest_client(algorithm, lambda client_state: client_state.inner)
                        if stateful else algorithm)

    def client_state_init(server):
        inner_state = algorithm.client_state_init(server)
        return CompressedClient(inner_state,
                                upload.init(algorithm.eval_variables(server)["params"]))

    def client_init(server, client_state, ctx):
        local = nested.client_init(server, client_state, ctx)
        ts = client_state.transform_state if stateful else None  # None: stateless
        prune = None
        if mask_before is not None:
            # Placeholder until the first step scores the broadcast (importance needs a
            # batch); magnitude masks are final here.
            w = algorithm.eval_variables(server)["params"]
            prune = _pruned(w, w, mask_before.ratio) if mask_before.score == "magnitude" \
                else tree_map(lambda v: jnp.zeros(v.shape, bool), w)
        return CompressedLocal(local, ts, jax.random.fold_in(ctx.rng, _UPLOAD_STREAM), prune)

    def client_output(local, server):
        output, inner_state = nested.client_output(local, server)

        def send(x, broadcast):
            sent, ts = comp.apply(upload, x, local.transform_state, local.key, broadcast)
            return sent, (sent, ts)
        output, (sent, ts) = (map_sent_model if target == "model" else map_sent_update)(
            algorithm, server, output, send)
        client_state = CompressedClient(inner_state, ts) if stateful else inner_state
        if vote:
            # The votes and each leaf's scale (sign messages are scale * sign(v)).
            output = {"inner": output, "votes": tree_map(jnp.sign, sent),
                      "scale": tree_map(lambda u: jnp.max(jnp.abs(u)), sent)}
        return output, client_state

    out = nested._replace(
        client_state_init=client_state_init if stateful else nested.client_state_init,
        client_init=client_init,
        client_step=(nested.client_step if mask_before is None
                     else _mask_step(nested, mask_before, grad_fn)),
        client_output=client_output,
        upload_bytes=lambda output, local: upload_bytes,  # an int: exact past 2^24
        server_update=_vote_update(algorithm) if vote else nested.server_update,
        model_view=None if vote else view)
    if download is not None:
        out = _with_download(out, algorithm, download, params, num_clients, seed)
    return out


def _pruned(weights: PyTree, scores: PyTree, ratio: float) -> PyTree:
    """1 where a weight is outside its layer's top ceil(ratio * d) scores."""
    return tree_map(lambda w, s: ~comp.top_k_mask(jnp.abs(s), comp.kept(ratio, w.size)),
                    weights, scores)


def _mask_step(nested, mask_before, grad_fn):
    """`nested.client_step` with the pre-training mask's L1 term (module docstring)."""
    shrink = mask_before.lr * mask_before.l1

    def client_step(local, batch, server):
        prune = local.prune
        if mask_before.score == "importance":
            def score(_):
                w, ms = local.inner.params, local.inner.model_state
                g = grad_fn(w, ms, batch)
                return _pruned(w, tree_map(lambda a, b: a * b, g, w), mask_before.ratio)
            prune = jax.lax.cond(local.inner.step == 0, score, lambda _: prune, None)
        local, metrics = nested.client_step(local._replace(prune=prune), batch, server)
        # The L1 term's proximal step on the weights to be pruned.
        params = tree_map(lambda w, p: jnp.where(p, jnp.sign(w) * jnp.maximum(
            jnp.abs(w) - shrink, 0.0), w), local.inner.params, prune)
        return local._replace(inner=local.inner._replace(params=params)), metrics
    return client_step


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
    nested = nest_server(out, clients_view)

    def server_init(variables):
        inner = out.server_init(variables)
        if not hasattr(inner, "params") or not hasattr(inner, "_replace"):
            raise ValueError("download compression needs a server state with `params`")
        return DownloadServer(inner, inner.params, -jnp.ones(num_clients, jnp.int32),
                              download.init(inner.params))

    def server_update(server, aggregate, info):
        new = nested.server_update(server, aggregate, info)
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

    # Clients train from the public model; the server's own (evaluated) is w_new.
    return nested._replace(
        server_init=server_init, server_update=server_update,
        eval_variables=lambda server: out.eval_variables(server.inner),
        download_bytes=download_bytes, model_view=None)


def server_side(cfg: Any) -> bool:
    """`cfg` compresses the download or votes: clients train from a public model other
    than the server's, or the server does not average their updates."""
    return cfg.compression.download.method != "none" or cfg.compression.vote


def _check(cfg: Any) -> None:
    comp = cfg.compression
    if comp.vote and comp.upload.method != "sign":
        raise ValueError(f"compression.vote needs compression.upload.method='sign', got "
                         f"{comp.upload.method!r}")
    if comp.download.method in ("magnitude_mask", "importance_mask"):
        raise ValueError(f"compression.download.method={comp.download.method!r}: masks "
                         f"prune a client's model before it is sent; the download sends the "
                         f"global update")
    if comp.download.method != "none" and stragglers.late(cfg):
        raise ValueError("compression.download needs straggler.max_delay=0 (a late "
                         "client's download would be counted against a model it did not "
                         "hold)")


def _transform(side: Any) -> comp.Transform:
    return comp.from_name(side.method, side.ratio, side.levels, side.bits,
                          side.error_feedback, side.quantize_bits)


def _wrap(algorithm: FederatedAlgorithm, build: Build) -> FederatedAlgorithm:
    c, model = build.cfg.compression, build.model
    mask = None
    if c.mask_before != "none":
        mask = MaskBefore(c.upload.ratio, c.mask_before, c.mask_l1, build.cfg.optimizer.lr)

    def grad_fn(params, model_state, batch):
        return jax.grad(lambda w: mean_loss(model, w, model_state, batch)[0])(params)
    return with_compression(
        algorithm, build.variables, _transform(c.upload),
        target="model" if c.upload.method.endswith("_mask") else "update",
        download=None if c.download.method == "none" else _transform(c.download),
        num_clients=build.num_clients, seed=build.cfg.seed, vote=c.vote, mask_before=mask,
        grad_fn=grad_fn)


_SIDE = {"method": "none", "ratio": 0.1, "levels": 16, "bits": 8, "quantize_bits": 0,
         "error_feedback": False}
_SIDE_RULES = {"method": one_of(comp.METHODS), "ratio": between(0, 1, lo_open=True),
               "levels": between(1, 2**16, integer=True), "bits": between(1, 16, integer=True),
               "quantize_bits": between(0, 16, integer=True), "error_feedback": Rule(boolean)}
FEATURE = FeatureEntry(
    "compression",
    options={"upload": dict(_SIDE), "download": dict(_SIDE), "vote": False,
             "mask_before": "none", "mask_l1": 1e-4},
    rules={**{f"{side}.{key}": rule for side in ("upload", "download")
              for key, rule in _SIDE_RULES.items()},
           "vote": Rule(boolean), "mask_before": one_of(("none",) + MASK_SCORES),
           "mask_l1": between(0, 1e4)},
    off=(("upload.method", "none"), ("download.method", "none"), ("mask_before", "none")),
    check=_check, wrap=_wrap, needs_model=lambda cfg: True,
    summary="what clients send and receive (module docstring): method 'none', 'top_k' / "
            "'random_k' (keep `ratio` of each layer), 'qsgd' (`levels`), 'sign', 'quantize' "
            "(`bits`), or the post-training masks 'magnitude_mask' / 'importance_mask' (keep "
            "`ratio` of each layer's weights: the model is sent, not its update); "
            "quantize_bits > 0 quantises the values a sparsifier keeps; error_feedback keeps "
            "the sender's residual. vote: majority vote over sign messages. mask_before: the "
            "slides' pre-training mask ('magnitude' or 'importance', keeping `ratio`) whose "
            "other weights an L1 term of strength mask_l1 pushes to 0 during local training")


__all__ = ["FEATURE", "server_side", "TARGETS", "MASK_SCORES", "MaskBefore", "CompressedLocal",
           "CompressedClient", "DownloadServer", "with_compression"]
