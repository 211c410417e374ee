"""Byzantine-robust aggregation rules over the round's stacked client outputs.

Each is an `Aggregator` with `stacked=True`: `finalize(outputs, weights, arrivals)` sees
every client's output (a pytree with a leading client axis N) and the round's weights
(N,), a weight of 0 marking an empty slot (an output not arrived), and returns one
output; jit-able, so any algorithm whose output is a model or an update can use it
(`config.aggregation.rule`). Distances are Euclidean over the whole output (every leaf),
computed leaf by leaf so no client's output is flattened into a copy.

- `multi_krum(f, m)` (Blanchard et al. 2017; El Mhamdi et al. 2018): client i's score is
  the sum of squared distances to its n - f - 2 nearest other clients; the m lowest-scored
  clients are averaged with the round's weights, renormalised (m = 1 is Krum; m = n - f
  by default).
- `geometric_median()` (RFA, Pillutla et al. 2022): the smoothed Weiszfeld iteration of
  the authors' code, weights = the round's (sample counts under
  `aggregation.weights = num_examples`): start at the weighted mean, then up to `maxiter`
  times v <- sum_i b_i x_i / sum_i b_i with b_i = a_i / max(eps, |v - x_i|), stopping once
  the objective sum_i a_i |v - x_i| changes by less than ftol times itself.
- `zeno(b, rho, public_loss)` (Xie et al. 2019), on models: client i's score is
  f_r(x) - f_r(x_i) - rho |x_i - x|^2, the descent its model x_i makes on the server's
  held-out data from the current model x, less rho times its squared step; the n - b
  best-scored models are averaged with the round's weights, renormalised.

f and b are checked against the clients a round before a run (`krum_kept`, `zeno_kept`).
A round can still have fewer present than that (late clients, Poisson sampling, a
recruiter's cohort): then Multi-Krum scores each client on its max(n - f - 2, 1) nearest
and averages clip(m, 1, n) of them, and Zeno averages its max(n - b, 1) best: never fewer
than one, never an empty mean.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp

from fedjax_pan.engine.protocol import Aggregator, PyTree

tree_map = jax.tree_util.tree_map


def pairwise_sq_distances(outputs: PyTree) -> jax.Array:
    """(M, M) squared Euclidean distances between the clients' outputs (all leaves)."""
    def leaf(x):
        x = x.reshape(x.shape[0], -1).astype(jnp.float32)
        # |a - b|^2 by differences, not the Gram identity (no cancellation when updates
        # are close, the case that matters), one row at a time: memory M x P, not M^2 x P.
        return jax.lax.map(lambda row: jnp.sum((x - row) ** 2, axis=1), x)
    return sum(leaf(x) for x in jax.tree_util.tree_leaves(outputs))


def krum_kept(clients: int, byzantine: int, keep: Optional[int] = None) -> int:
    """How many of a round's `clients` Multi-Krum averages (`keep`; None: clients - f).
    ValueError unless clients > f + 2 (each is scored on its clients - f - 2 nearest) and
    1 <= m <= clients."""
    if clients <= byzantine + 2:
        raise ValueError(f"Krum needs more than f + 2 clients a round: {clients} clients, "
                         f"f = {byzantine}")
    kept = clients - byzantine if keep is None else keep
    if not 1 <= kept <= clients:
        raise ValueError(f"Multi-Krum averages m of the {clients} clients a round, "
                         f"1 <= m <= {clients}: got m = {kept}")
    return kept


def zeno_kept(clients: int, byzantine: int) -> int:
    """How many of a round's `clients` Zeno averages: clients - b. ValueError unless
    0 <= b < clients: Xie et al. 2019 average the m - b best of m and assume at least one
    non-faulty worker, so m > b."""
    if not 0 <= byzantine < clients:
        raise ValueError(f"Zeno averages the n - b best of the n clients a round, so it "
                         f"needs 0 <= b < n: {clients} clients, b = {byzantine}")
    return clients - byzantine


def krum_scores(outputs: PyTree, byzantine: int, present: Optional[jax.Array] = None
                ) -> jax.Array:
    """(N,) Krum scores: each client's summed squared distance to its n - f - 2 nearest
    other clients, n the clients `present` (default all; absent ones score +inf). With
    n <= f + 2 (possible only when arrivals vary) each is scored on its nearest one."""
    m = jax.tree_util.tree_leaves(outputs)[0].shape[0]
    present = jnp.ones(m, bool) if present is None else present
    d = pairwise_sq_distances(outputs)
    # A client is not its own neighbour, nor is an empty slot anyone's.
    d = jnp.where(jnp.eye(m, dtype=bool) | ~present[None, :], jnp.inf, d)
    neighbours = jnp.maximum(jnp.sum(present) - byzantine - 2, 1)
    near = jnp.where(jnp.arange(m)[None, :] < neighbours, jnp.sort(d, axis=1), 0.0)
    return jnp.where(present, jnp.sum(near, axis=1), jnp.inf)


def _weighted_mean(outputs: PyTree, weights: jax.Array) -> PyTree:
    w = weights / jnp.sum(weights)
    return tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), outputs)


def _best(scores: jax.Array, present: jax.Array, count: jax.Array) -> jax.Array:
    """(N,) bool: the `count` lowest `scores` among the slots `present` (ties to the lower
    index; a present slot with an infinite or NaN score still ranks before any absent)."""
    top = jnp.finfo(jnp.float32).max
    key = jnp.where(present, jnp.nan_to_num(scores.astype(jnp.float32), nan=top, posinf=top),
                    jnp.inf)
    return jnp.argsort(jnp.argsort(key)) < count


def multi_krum(byzantine: int, keep: Optional[int] = None) -> Aggregator:
    """Multi-Krum tolerating `byzantine` (f) clients a round, averaging the `keep` (m)
    best-scored (None: n - f of the n present; 1: Krum). A round of n <= f + 2 present
    is clipped as the module docstring says (`krum_kept` checks a config's rounds)."""
    if byzantine < 0 or (keep is not None and keep < 1):
        raise ValueError(f"multi_krum needs f >= 0 and m >= 1, got f = {byzantine}, "
                         f"m = {keep}")

    def finalize(outputs, weights, arrivals=None):
        # The stack's size varies with Poisson sampling or a recruiter, and fewer than it
        # may be present (late clients): the masks and clips below handle every n >= 1.
        present = weights > 0
        n = jnp.sum(present)
        kept = jnp.clip(n - byzantine if keep is None else keep, 1, n)
        chosen = _best(krum_scores(outputs, byzantine, present), present, kept)
        return _weighted_mean(outputs, jnp.where(chosen, weights, 0.0))
    return Aggregator(finalize, stacked=True)


def _distances(v: PyTree, outputs: PyTree) -> jax.Array:
    """(M,) Euclidean distances from `v` to each client's output."""
    return jnp.sqrt(_sq_distance(outputs, v))


def geometric_median(maxiter: int = 4, eps: float = 1e-5, ftol: float = 1e-6) -> Aggregator:
    """RFA's smoothed Weiszfeld geometric median (module docstring); the authors' defaults."""
    if maxiter < 1 or eps <= 0 or ftol < 0:
        raise ValueError(f"geometric_median needs maxiter >= 1, eps > 0, ftol >= 0, got "
                         f"{maxiter}, {eps}, {ftol}")

    def finalize(outputs, weights, arrivals=None):
        alpha = weights / jnp.sum(weights)
        v = _weighted_mean(outputs, alpha)
        d = _distances(v, outputs)  # one pass over the outputs per iteration: reused below
        obj = jnp.sum(alpha * d)
        done = jnp.zeros((), bool)
        for _ in range(maxiter):  # a handful: unrolled; converged iterations change nothing
            new_v = _weighted_mean(outputs, alpha / jnp.maximum(eps, d))
            new_d = _distances(new_v, outputs)
            new_obj = jnp.sum(alpha * new_d)
            keep_old = lambda a, b: jnp.where(done, a, b)  # noqa: E731
            v, d = tree_map(keep_old, v, new_v), keep_old(d, new_d)
            converged = jnp.abs(obj - new_obj) < ftol * new_obj
            obj = keep_old(obj, new_obj)
            done = done | converged
        return v
    return Aggregator(finalize, stacked=True)


def public_scorer(model: Any, images: jax.Array, labels: jax.Array,
                  batch_size: int = 1000) -> Callable[[PyTree], Dict[str, jax.Array]]:
    """score(variables) -> {'loss': mean cross-entropy, 'entropy': mean entropy of the
    softmax, 'accuracy'} of `model` over the server's held-out examples (SageFlow's public
    set, Zeno's validation data, Siren's root set), in batches of `batch_size`."""
    images, labels = jnp.asarray(images), jnp.asarray(labels, jnp.int32)
    n = images.shape[0]
    b = min(batch_size, n)
    pad = -n % b
    xs = jnp.concatenate([images, jnp.zeros((pad,) + images.shape[1:], images.dtype)])
    ys = jnp.concatenate([labels, jnp.zeros(pad, jnp.int32)])
    mask = jnp.arange(n + pad) < n
    xs, ys, mask = (a.reshape((-1, b) + a.shape[1:]) for a in (xs, ys, mask))

    def score(variables):
        def batch(acc, i):
            logits = model.apply(variables, xs[i], train=False).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            loss = -jnp.take_along_axis(logp, ys[i][:, None], axis=1)[:, 0]
            entropy = -jnp.sum(jnp.exp(logp) * logp, axis=1)
            m = mask[i]
            hit = jnp.argmax(logits, axis=1) == ys[i]
            return (acc[0] + jnp.sum(jnp.where(m, loss, 0.0)),
                    acc[1] + jnp.sum(jnp.where(m, entropy, 0.0)),
                    acc[2] + jnp.sum(jnp.where(m & hit, 1.0, 0.0))), None
        zero = jnp.float32(0)
        (loss, entropy, correct), _ = jax.lax.scan(batch, (zero, zero, zero),
                                                   jnp.arange(xs.shape[0]))
        return {"loss": loss / n, "entropy": entropy / n, "accuracy": correct / n}
    return score


def _sq_distance(a: PyTree, b: PyTree) -> jax.Array:
    """(N,) squared distances from each of the stacked `a` to the one `b`."""
    return sum(jnp.sum((x - y[None]).reshape(x.shape[0], -1).astype(jnp.float32) ** 2, axis=1)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def zeno(byzantine: int, rho: float,
         score: Callable[[PyTree], Dict[str, jax.Array]]) -> Aggregator:
    """Zeno over models (module docstring): keeps the n - b best of the n present by
    f_r(x) - f_r(x_i) - rho |x_i - x|^2, f_r the loss `score` gives (trainable
    parameters only enter the distance); the best one where n <= b (`zeno_kept` checks a
    config's rounds)."""
    if byzantine < 0 or rho < 0:
        raise ValueError(f"zeno needs b >= 0 and rho >= 0, got b = {byzantine}, rho = {rho}")

    def finalize(models, weights, arrivals):
        present = weights > 0
        step = _sq_distance(models["params"], arrivals.current["params"])
        descent = score(arrivals.current)["loss"] - arrivals.scores["loss"]
        kept = jnp.maximum(jnp.sum(present) - byzantine, 1)
        chosen = _best(-(descent - rho * step), present, kept)  # the highest Zeno scores
        return _weighted_mean(models, jnp.where(chosen, weights, 0.0))
    return Aggregator(finalize, stacked=True, space="model", score=score)


__all__ = ["multi_krum", "geometric_median", "zeno", "public_scorer", "krum_kept",
           "zeno_kept", "krum_scores", "pairwise_sq_distances"]
