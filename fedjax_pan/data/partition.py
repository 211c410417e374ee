"""Split a labelled dataset into federated clients, as index arrays.

`partition(labels, num_clients, scheme, seed, ...)` returns one sorted int64
index array per client. All randomness comes from `np.random.default_rng(seed)`.

Schemes (K clients, C classes, N samples):

* ``iid`` -- shuffle, then cut into K near-equal parts (sizes differ by <= 1).
* ``dirichlet_by_client`` -- the construction in the PAN authors' released
  code (lxcnju/FedPAN, ``FedData.split_by_dirichlet``): draw each client's
  label mix ``Dir(alpha * 1_C)`` into a K x C matrix P, normalise every class
  column over clients, and cut each class's shuffled indices into contiguous
  slices of sizes ``P[:, c] * n_c``. Clients with fewer than ``min_size``
  samples (default 5, as in the authors' code) are dropped, so FEWER than K
  arrays may come back. (The authors round the per-slice counts, which can
  lose or clip a few samples per class; cumulative-sum cuts keep every index.)
* ``dirichlet_by_class`` -- FedMA's "hetero-dir" / PFLlib's ``dir``: for each
  class draw its split over clients ``Dir(alpha * 1_K)``, with clients that
  already hold >= N/K samples masked out; redraw everything until every
  client has >= ``min_size`` samples (default 10), at most ``max_retries``
  times, then raise `PartitionError`.
* ``pathological`` -- Fed2's "N x C" settings / PFLlib's ``pat``: every client
  holds exactly ``classes_per_client`` distinct classes. Classes are dealt
  least-used-first with random tie-breaks, so each class is held by
  floor(K*S/C) or ceil(K*S/C) clients and all classes are used when
  K*S >= C. If K*S < C, the classes nobody holds stay UNASSIGNED. A class is
  split among its holders evenly (``balance=True``) or with random sizes of
  at least one sample each (``balance=False``).

* ``natural`` -- one client per distinct value of ``groups`` (e.g. FEMNIST's
  writers, `Dataset.train_groups`), clients in ascending group order;
  ``num_clients`` must equal the number of distinct groups. No randomness.

``balance=True``: no-op for ``iid`` and ``natural``; for the Dirichlet schemes every client
gets N//K or N//K + 1 samples (all indices assigned, no retries, no clients
dropped unless N//K < min_size for ``dirichlet_by_client``): the scheme's
Dirichlet draw gives each client a target label mix, and clients (in random
order) are filled to their size from the remaining pool, falling back to
other classes when a class runs out (PFLlib-style ``balance``).

Otherwise every index is assigned to exactly one client. Parameters that do
not apply to the chosen scheme are ignored.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

SCHEMES = ("iid", "dirichlet_by_client", "dirichlet_by_class", "pathological", "natural")
_DEFAULT_MIN_SIZE = {"dirichlet_by_client": 5, "dirichlet_by_class": 10}


class PartitionError(ValueError):
    """A partition request that cannot be satisfied (e.g. min_size unreachable)."""


# ----------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------

def _as_labels(labels: Any, num_classes: int | None) -> tuple[np.ndarray, int]:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    if y.size == 0:
        raise ValueError("labels is empty")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must have an integer dtype, got {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"labels must be non-negative, got min label {int(y.min())}")
    observed = int(y.max()) + 1
    if num_classes is None:
        return y, observed
    if not _is_int(num_classes) or num_classes < observed:
        raise ValueError(
            f"num_classes={num_classes!r} must be an integer >= max label + 1 = {observed}")
    return y, int(num_classes)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_int(name: str, value: Any, low: int) -> int:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return int(value)


def _check_alpha(alpha: Any, scheme: str) -> float:
    if alpha is None:
        raise ValueError(f"scheme {scheme!r} needs alpha (Dirichlet concentration > 0), got None")
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha={alpha!r} must be a positive number") from None
    if not (a > 0 and math.isfinite(a)):
        raise ValueError(f"alpha={alpha!r} must be a finite number > 0")
    return a


# ----------------------------------------------------------------------------
# Integer apportionment helpers
# ----------------------------------------------------------------------------

def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers summing to `total`, proportional to `weights` (largest remainder)."""
    raw = weights / weights.sum() * total
    base = np.floor(raw).astype(np.int64)
    rem = int(total - base.sum())
    if rem > 0:
        order = np.argsort(-(raw - base), kind="stable")
        base[order[:rem]] += 1
    return base


def _fill(target: int, pref: np.ndarray, supply: np.ndarray) -> np.ndarray:
    """Take `target` items by preference `pref`, never more than `supply` per class.

    Shortfalls go to the preferred classes that still have supply, then (if the
    preferred ones are exhausted) proportionally to what remains. Requires
    supply.sum() >= target.
    """
    x = np.zeros_like(supply)
    if pref.sum() > 0:
        x = np.minimum(_apportion(target, pref), supply)
    while (deficit := target - int(x.sum())) > 0:
        spare = supply - x
        w = pref * (spare > 0)
        if w.sum() <= 0:
            w = spare.astype(np.float64)
        # Each pass saturates a class or finishes, so this loops at most C times.
        x += np.minimum(_apportion(deficit, w), spare)
    return x


def _cut(idx: np.ndarray, proportions: np.ndarray) -> list[np.ndarray]:
    """Contiguous slices of `idx` with sizes given by `proportions` (cumsum cuts)."""
    cuts = (np.cumsum(proportions) * len(idx)).astype(int)[:-1]
    return np.split(idx, cuts)


def _finish(chunks: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    out = []
    for parts in chunks:
        arr = np.concatenate(parts) if len(parts) else np.empty(0, np.int64)
        out.append(np.sort(arr.astype(np.int64)))
    return out


# ----------------------------------------------------------------------------
# Schemes
# ----------------------------------------------------------------------------

def _iid(y: np.ndarray, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(p) for p in np.array_split(rng.permutation(len(y)).astype(np.int64), k)]


def _balanced_fill(y: np.ndarray, num_classes: int, desired: np.ndarray,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Equal-size clients whose label mixes follow the rows of `desired` (K x C)."""
    k = desired.shape[0]
    sizes = np.full(k, len(y) // k, dtype=np.int64)
    sizes[: len(y) % k] += 1
    supply = np.bincount(y, minlength=num_classes).astype(np.int64)
    alloc = np.zeros((k, num_classes), dtype=np.int64)
    # Later clients get what is left; a random order keeps that from biasing client ids.
    for client in rng.permutation(k):
        alloc[client] = _fill(int(sizes[client]), desired[client], supply)
        supply -= alloc[client]
    chunks: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(y == c))
        for client, part in enumerate(np.split(idx, np.cumsum(alloc[:, c])[:-1])):
            chunks[client].append(part)
    return _finish(chunks)


def _dirichlet_by_client(y: np.ndarray, k: int, num_classes: int, alpha: float,
                         min_size: int, balance: bool,
                         rng: np.random.Generator) -> list[np.ndarray]:
    probs = rng.dirichlet(np.full(num_classes, alpha), size=k)
    col = probs.sum(axis=0)
    # Tiny alpha can underflow a whole column to zero; split such a class evenly.
    probs[:, col <= 0] = 1.0
    probs /= probs.sum(axis=0)
    if balance:
        desired = probs * np.bincount(y, minlength=num_classes)
        parts = _balanced_fill(y, num_classes, desired, rng)
    else:
        chunks: list[list[np.ndarray]] = [[] for _ in range(k)]
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(y == c))
            for client, part in enumerate(_cut(idx, probs[:, c])):
                chunks[client].append(part)
        parts = _finish(chunks)
    kept = [p for p in parts if len(p) >= min_size]
    if not kept:
        raise PartitionError(
            f"dirichlet_by_client: all {k} clients have fewer than min_size={min_size} "
            f"samples (N={len(y)}, alpha={alpha}); lower min_size or num_clients")
    return kept


def _dirichlet_by_class(y: np.ndarray, k: int, num_classes: int, alpha: float,
                        min_size: int, balance: bool, max_retries: int,
                        rng: np.random.Generator) -> list[np.ndarray]:
    n = len(y)
    if min_size * k > n:
        raise PartitionError(
            f"dirichlet_by_class: min_size={min_size} x num_clients={k} = {min_size * k} "
            f"exceeds the {n} samples available; lower min_size or num_clients")
    class_idx = [np.flatnonzero(y == c) for c in range(num_classes)]
    if balance:
        # Sizes are equal (>= N//K >= min_size), so one draw suffices.
        q = rng.dirichlet(np.full(k, alpha), size=num_classes)  # C x K
        desired = (q * np.bincount(y, minlength=num_classes)[:, None]).T
        return _balanced_fill(y, num_classes, desired, rng)

    best = -1
    for _ in range(max_retries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(k)]
        sizes = np.zeros(k, dtype=np.int64)
        for c in range(num_classes):
            if len(class_idx[c]) == 0:  # nothing to split (and maybe no client left open)
                continue
            idx = rng.permutation(class_idx[c])
            p = rng.dirichlet(np.full(k, alpha))
            # FedMA/PFLlib trick: stop feeding clients that already hold their share.
            open_ = sizes < n / k
            p = p * open_
            if p.sum() <= 0:  # underflow at tiny alpha
                p = open_.astype(np.float64)
            p /= p.sum()
            for client, part in enumerate(_cut(idx, p)):
                chunks[client].append(part)
                sizes[client] += len(part)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _finish(chunks)
        best = max(best, smallest)
    raise PartitionError(
        f"dirichlet_by_class: no partition with every client >= min_size={min_size} "
        f"samples after max_retries={max_retries} draws (alpha={alpha}, "
        f"num_clients={k}, N={n}); the best draw's smallest client had {best} samples. "
        f"Raise alpha, or lower min_size or num_clients.")


def _pathological(y: np.ndarray, k: int, per_client: int, balance: bool,
                  rng: np.random.Generator) -> list[np.ndarray]:
    present = np.unique(y)
    num_present = len(present)
    if per_client > num_present:
        raise ValueError(
            f"classes_per_client={per_client} exceeds the {num_present} classes present in labels")
    # Deal classes least-used-first (random tie-break): distinct classes per
    # client, class loads within 1 of each other, hence all used when K*S >= C.
    load = np.zeros(num_present, dtype=np.int64)
    holders: list[list[int]] = [[] for _ in range(num_present)]
    for client in range(k):
        chosen = np.argsort(load + rng.random(num_present), kind="stable")[:per_client]
        load[chosen] += 1
        for j in chosen:
            holders[j].append(client)
    chunks: list[list[np.ndarray]] = [[] for _ in range(k)]
    for j, c in enumerate(present):
        h = len(holders[j])
        if h == 0:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        if len(idx) < h:
            raise ValueError(
                f"class {int(c)} has {len(idx)} samples but is held by {h} clients; "
                f"lower num_clients or classes_per_client")
        owners = rng.permutation(np.asarray(holders[j]))
        if balance:
            parts = np.array_split(idx, h)
        else:
            # At least one sample per holder so every client keeps all its classes.
            sizes = 1 + rng.multinomial(len(idx) - h, rng.dirichlet(np.ones(h)))
            parts = np.split(idx, np.cumsum(sizes)[:-1])
        for client, part in zip(owners, parts):
            chunks[client].append(part)
    return _finish(chunks)


def _natural(groups: Any, n: int, k: int) -> list[np.ndarray]:
    if groups is None:
        raise ValueError("scheme 'natural' needs groups (one group id per sample, e.g. "
                         "Dataset.train_groups), got None")
    g = np.asarray(groups)
    if g.shape != (n,) or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"groups must be integers of shape ({n},) like labels, got "
                         f"{g.dtype} of shape {g.shape}")
    ids, inverse = np.unique(g, return_inverse=True)
    if len(ids) != k:
        raise ValueError(f"scheme 'natural' makes one client per group: groups hold "
                         f"{len(ids)} distinct values, so num_clients must be {len(ids)}, "
                         f"got {k}")
    # A stable sort by group keeps each client's indices in increasing order.
    order = np.argsort(inverse.reshape(-1), kind="stable").astype(np.int64)
    return np.split(order, np.cumsum(np.bincount(inverse.reshape(-1)))[:-1])


def partition(labels: Sequence[int] | np.ndarray, num_clients: int, scheme: str,
              seed: int, *, alpha: float | None = None,
              classes_per_client: int | None = None, min_size: int | None = None,
              balance: bool = False, max_retries: int = 1000,
              num_classes: int | None = None,
              groups: Sequence[int] | np.ndarray | None = None) -> list[np.ndarray]:
    """Split sample indices of `labels` among clients with the given scheme.

    Returns one sorted int64 index array per client (see the module docstring for
    each scheme; `dirichlet_by_client` may return fewer than `num_clients` arrays).
    `groups` (one id per sample) is needed by, and only used by, scheme 'natural'.
    """
    y, n_cls = _as_labels(labels, num_classes)
    n = len(y)
    if not _is_int(num_clients) or not 1 <= num_clients <= n:
        raise ValueError(
            f"num_clients={num_clients!r} must be an integer in [1, len(labels)={n}]")
    k = int(num_clients)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    if scheme == "natural":
        return _natural(groups, n, k)
    rng = np.random.default_rng(seed)

    if scheme == "iid":
        return _iid(y, k, rng)
    if scheme == "pathological":
        if classes_per_client is None:
            raise ValueError("scheme 'pathological' needs classes_per_client, got None")
        per_client = _check_int("classes_per_client", classes_per_client, 1)
        if per_client > n_cls:
            raise ValueError(
                f"classes_per_client={per_client} exceeds num_classes={n_cls}")
        return _pathological(y, k, per_client, balance, rng)

    a = _check_alpha(alpha, scheme)
    ms = _DEFAULT_MIN_SIZE[scheme] if min_size is None else _check_int("min_size", min_size, 0)
    if scheme == "dirichlet_by_client":
        return _dirichlet_by_client(y, k, n_cls, a, ms, balance, rng)
    retries = _check_int("max_retries", max_retries, 1)
    return _dirichlet_by_class(y, k, n_cls, a, ms, balance, retries, rng)


# ----------------------------------------------------------------------------
# Inspection
# ----------------------------------------------------------------------------

# Local test shares of each client's data in the personalised-FL conventions.
TEST_FRACTIONS = {"pfllib": 0.25, "pan_authors": 0.2}


def split_clients(parts: Sequence[np.ndarray], test_fraction: float, seed: int
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's indices split into its own (train, test) parts, both sorted.

    A client of n examples keeps ceil(test_fraction * n) of them, drawn uniformly at random,
    as its local test set (sklearn's `train_test_split` rounding, which PFLlib uses), but
    never its last training example; test_fraction 0 gives empty test parts. Randomness:
    `np.random.default_rng(seed)` (one stream, clients in order).
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in [0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for part in parts:
        part = np.asarray(part, np.int64)
        n_test = min(math.ceil(test_fraction * len(part) - 1e-9), len(part) - 1)
        chosen = rng.permutation(len(part))
        test.append(np.sort(part[chosen[:n_test]]))
        train.append(np.sort(part[chosen[n_test:]]))
    return train, test


# A stream of the seed apart from the partition's and the test split's.
_NOISE = 0x4E4F4953


def noisy_clients(num_clients: int, share: float, seed: int) -> np.ndarray:
    """(K,) bool: the round(share * K) clients whose training labels are noisy, drawn
    from `seed` alone (the same clients for every noise rate)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"noisy share must lie in [0, 1], got {share}")
    rng = np.random.default_rng([seed, _NOISE])
    chosen = rng.permutation(num_clients)[:int(round(share * num_clients))]
    return np.isin(np.arange(num_clients), chosen)


def noisy_labels(labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray],
                 share: float, rate: float, seed: int, num_classes: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(labels with noise, the noisy clients): on each of the `noisy_clients`, a `rate`
    share of the examples in its part (round(rate * n) of them, drawn without replacement)
    gets a label drawn uniformly from all classes (the true one included), as in studies of
    clients of unequal quality. Other indices keep their labels. From `seed` alone."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"noise rate must lie in [0, 1], got {rate}")
    y, n_cls = _as_labels(labels, num_classes)
    noisy = noisy_clients(len(parts), share, seed)
    out = y.copy()
    rng = np.random.default_rng([seed, _NOISE, 1])
    for i in np.flatnonzero(noisy):
        part = np.asarray(parts[i], dtype=np.int64)
        hit = rng.permutation(part)[:int(round(rate * len(part)))]
        out[hit] = rng.integers(0, n_cls, size=len(hit))
    return out.astype(y.dtype), noisy


def client_label_counts(labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray],
                        num_classes: int | None = None) -> np.ndarray:
    """Per-client label counts, an int64 array of shape (num_clients, num_classes)."""
    y, n_cls = _as_labels(labels, num_classes)
    counts = np.zeros((len(parts), n_cls), dtype=np.int64)
    for i, p in enumerate(parts):
        counts[i] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=n_cls)
    return counts


def _format_rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def stats_table(labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray],
                num_classes: int | None = None, max_rows: int | None = None) -> str:
    """Plain-text table: per client its size, #classes and label counts, then a summary.

    Shows one column per class when C <= 20, else each client's top-5 "label:count"
    pairs; `max_rows` limits how many client rows are printed.
    """
    counts = client_label_counts(labels, parts, num_classes)
    k, n_cls = counts.shape
    sizes = counts.sum(axis=1)
    n_distinct = (counts > 0).sum(axis=1)
    wide = n_cls <= 20
    header = ["client", "size", "classes"]
    header += [str(c) for c in range(n_cls)] if wide else ["top labels (label:count)"]
    rows = [header]
    shown = k if max_rows is None else min(k, _check_int("max_rows", max_rows, 0))
    for i in range(shown):
        row = [str(i), str(sizes[i]), str(n_distinct[i])]
        if wide:
            row += [str(v) for v in counts[i]]
        else:
            top = [c for c in np.argsort(-counts[i], kind="stable")[:5] if counts[i, c] > 0]
            row.append(" ".join(f"{c}:{counts[i, c]}" for c in top))
        rows.append(row)
    lines = _format_rows(rows)
    if shown < k:
        lines.append(f"... ({k - shown} more clients)")
    total = int(sizes.sum())
    n_all = len(np.asarray(labels))
    lines.append(f"total: {total} of {n_all} samples in {k} clients"
                 + (f" ({n_all - total} unassigned)" if total != n_all else ""))
    if k:
        lines.append(f"client size: mean {sizes.mean():.1f}, std {sizes.std():.1f}, "
                     f"min {sizes.min()}, max {sizes.max()}")
        lines.append(f"classes per client: mean {n_distinct.mean():.2f}")
    return "\n".join(lines)


def plot_label_distribution(labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray],
                            num_classes: int | None = None,
                            path: str | os.PathLike | None = None, ax: Any = None) -> Any:
    """Heat map of per-client label counts (clients x classes); returns the Figure.

    Draws on `ax` when given, else on a new `matplotlib.figure.Figure` (no pyplot
    state); saves a PNG to `path` (parents created) when given.
    """
    from matplotlib.figure import Figure  # lazy: matplotlib is only needed for plots

    counts = client_label_counts(labels, parts, num_classes)
    k, n_cls = counts.shape
    if ax is None:
        fig = Figure(figsize=(min(2.0 + 0.4 * n_cls, 16.0), min(1.5 + 0.25 * k, 12.0)))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    im = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"label distribution ({k} clients, {n_cls} classes)")
    if n_cls <= 20:
        ax.set_xticks(range(n_cls))
    if k <= 30:
        ax.set_yticks(range(k))
    if path is not None:
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    return fig
