"""Tests for fedjax_pan.data.partition: invariants, independent references, errors."""

import re
import time

import numpy as np
import pytest

from fedjax_pan import data
from fedjax_pan.data.partition import (PartitionError, client_label_counts, partition,
                                       plot_label_distribution, stats_table)

NUM_CLASSES = 10
LABELS = np.random.default_rng(1234).permutation(np.repeat(np.arange(NUM_CLASSES), 600))

# (scheme, kwargs) covering every scheme and balance setting.
CASES = [
    ("iid", {}),
    ("dirichlet_by_client", {"alpha": 0.5}),
    ("dirichlet_by_client", {"alpha": 0.5, "balance": True}),
    ("dirichlet_by_class", {"alpha": 0.5}),
    ("dirichlet_by_class", {"alpha": 0.5, "balance": True}),
    ("pathological", {"classes_per_client": 3}),
    ("pathological", {"classes_per_client": 3, "balance": True}),
]
CASE_IDS = [f"{s}-{'bal' if kw.get('balance') else 'unbal'}" for s, kw in CASES]


def _assert_valid(parts, n, covering=True):
    for p in parts:
        assert p.ndim == 1 and np.issubdtype(p.dtype, np.integer)
        assert np.all(np.diff(p) > 0), "each index array must be strictly increasing"
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients must be disjoint"
    assert allidx.min() >= 0 and allidx.max() < n
    if covering:
        np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def _mean_tv(labels, parts, num_classes=NUM_CLASSES):
    """Mean total-variation distance of client label mixes from the global mix."""
    counts = np.array([np.bincount(labels[p], minlength=num_classes) for p in parts], float)
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    mix = counts / counts.sum(axis=1, keepdims=True)
    return float(np.mean(0.5 * np.abs(mix - glob).sum(axis=1)))


@pytest.mark.parametrize("scheme,kw", CASES, ids=CASE_IDS)
def test_invariants_and_determinism(scheme, kw):
    parts = partition(LABELS, 20, scheme, 7, **kw)
    # dirichlet_by_client at alpha=0.5 with 300 samples/client drops nobody here.
    assert len(parts) == 20
    _assert_valid(parts, len(LABELS))
    again = partition(LABELS, 20, scheme, 7, **kw)
    assert len(again) == len(parts)
    for a, b in zip(parts, again):
        np.testing.assert_array_equal(a, b)
    other = partition(LABELS, 20, scheme, 8, **kw)
    assert any(len(a) != len(b) or np.any(a != b) for a, b in zip(parts, other))


def test_no_global_rng_use():
    state = np.random.get_state()
    partition(LABELS, 10, "dirichlet_by_class", 0, alpha=1.0)
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1]) and state[2] == after[2]


def test_iid_sizes_and_mix():
    parts = partition(LABELS, 7, "iid", 0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert _mean_tv(LABELS, parts) < 0.05


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("scheme", ["dirichlet_by_client", "dirichlet_by_class"])
def test_dirichlet_skew_grows_as_alpha_shrinks(scheme, balance):
    skew = [np.mean([_mean_tv(LABELS, partition(LABELS, 20, scheme, s, alpha=a,
                                                balance=balance, min_size=1))
                     for s in range(3)])
            for a in (100.0, 1.0, 0.1)]
    assert skew[0] < skew[1] < skew[2], skew
    assert skew[0] < 0.1 and skew[2] > 0.4


def _reference_dirichlet_by_client(labels, k, alpha, seed, min_size):
    """Independent re-statement of the PAN authors' construction, same rng call order."""
    rng = np.random.default_rng(seed)
    c_num = labels.max() + 1
    p = rng.dirichlet([alpha] * c_num, size=k)
    p = p / p.sum(axis=0, keepdims=True)
    clients = [[] for _ in range(k)]
    for c in range(c_num):
        idx = rng.permutation(np.where(labels == c)[0])
        bounds = [0] + list((np.cumsum(p[:, c]) * len(idx)).astype(int)[:-1]) + [len(idx)]
        for i in range(k):
            clients[i].extend(idx[bounds[i]:bounds[i + 1]].tolist())
    return [np.array(sorted(c)) for c in clients if len(c) >= min_size]


@pytest.mark.parametrize("k,alpha,seed", [(10, 1.0, 0), (50, 0.1, 3), (400, 1.0, 5)])
def test_dirichlet_by_client_matches_authors_construction(k, alpha, seed):
    labels = LABELS[:2000]
    ref = _reference_dirichlet_by_client(labels, k, alpha, seed, min_size=5)
    got = partition(labels, k, "dirichlet_by_client", seed, alpha=alpha)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_dirichlet_by_client_drops_small_clients():
    labels = LABELS[:2000]
    full = partition(labels, 400, "dirichlet_by_client", 5, alpha=1.0, min_size=0)
    assert len(full) == 400
    _assert_valid(full, len(labels))
    n_small = sum(len(p) < 5 for p in full)
    assert n_small > 0, "setting chosen so that some clients are tiny"
    kept = partition(labels, 400, "dirichlet_by_client", 5, alpha=1.0)  # default min_size=5
    assert len(kept) == 400 - n_small
    assert all(len(p) >= 5 for p in kept)
    _assert_valid(kept, len(labels), covering=False)
    assert [p.tolist() for p in kept] == [p.tolist() for p in full if len(p) >= 5]


def test_dirichlet_by_client_large_alpha_is_near_uniform():
    parts = partition(LABELS, 10, "dirichlet_by_client", 0, alpha=1e4)
    counts = client_label_counts(LABELS, parts)
    mix = counts / counts.sum(axis=1, keepdims=True)
    assert np.abs(mix - 0.1).max() < 0.03


@pytest.mark.parametrize("min_size", [1, 10, 100])
def test_dirichlet_by_class_min_size(min_size):
    parts = partition(LABELS, 30, "dirichlet_by_class", 2, alpha=0.3, min_size=min_size)
    assert len(parts) == 30
    assert min(len(p) for p in parts) >= min_size
    _assert_valid(parts, len(LABELS))


def test_dirichlet_by_class_impossible_upfront():
    labels = LABELS[:2000]
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="min_size=10"):
        partition(labels, 1000, "dirichlet_by_class", 0, alpha=0.01, min_size=10)
    assert time.perf_counter() - t0 < 2.0


def test_dirichlet_by_class_retries_are_bounded():
    labels = LABELS[:2000]
    t0 = time.perf_counter()
    with pytest.raises(PartitionError) as info:
        partition(labels, 100, "dirichlet_by_class", 0, alpha=0.01, min_size=15,
                  max_retries=20)
    assert time.perf_counter() - t0 < 2.0
    msg = str(info.value)
    for part in ("min_size=15", "max_retries=20", "alpha=0.01", "num_clients=100"):
        assert part in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("k,per", [(10, 3), (10, 5), (100, 2), (7, 4), (3, 2), (20, 10)])
@pytest.mark.parametrize("balance", [False, True])
def test_pathological_classes_per_client(k, per, balance):
    parts = partition(LABELS, k, "pathological", 11, classes_per_client=per, balance=balance)
    assert len(parts) == k
    counts = client_label_counts(LABELS, parts)
    np.testing.assert_array_equal((counts > 0).sum(axis=1), per)
    if k * per >= NUM_CLASSES:
        assert np.all(counts.sum(axis=0) == 600), "every class fully used"
        _assert_valid(parts, len(LABELS))
    else:
        _assert_valid(parts, len(LABELS), covering=False)
        assert (counts.sum(axis=0) > 0).sum() == k * per  # others documented as unassigned
    holders = (counts > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1, "classes dealt evenly over clients"
    if balance:
        for c in np.flatnonzero(holders):
            shares = counts[counts[:, c] > 0, c]
            assert shares.max() - shares.min() <= 1


def test_pathological_unassigned_when_too_few_slots():
    parts = partition(LABELS, 2, "pathological", 0, classes_per_client=3)
    counts = client_label_counts(LABELS, parts)
    assert (counts.sum(axis=0) > 0).sum() == 6
    assert sum(len(p) for p in parts) == 3600


def test_pathological_class_smaller_than_holders():
    labels = np.array([0] * 3 + [1] * 50)
    with pytest.raises(ValueError, match="class 0"):
        partition(labels, 10, "pathological", 0, classes_per_client=2)


# Pathological sizes are equal only when classes are equally frequent and K*S is a
# multiple of C, hence its separate settings.
@pytest.mark.parametrize("scheme,kw,k", [
    ("iid", {}, 10),
    ("iid", {}, 13),
    ("dirichlet_by_client", {"alpha": 0.1, "balance": True}, 10),
    ("dirichlet_by_client", {"alpha": 0.1, "balance": True}, 13),
    ("dirichlet_by_class", {"alpha": 0.1, "balance": True}, 10),
    ("dirichlet_by_class", {"alpha": 0.1, "balance": True}, 13),
    ("pathological", {"classes_per_client": 5, "balance": True}, 10),
    ("pathological", {"classes_per_client": 2, "balance": True}, 100),
])
def test_balance_gives_equal_sizes(scheme, kw, k):
    labels = LABELS if scheme == "pathological" else LABELS[:5993]
    parts = partition(labels, k, scheme, 4, **kw)
    assert len(parts) == k
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    _assert_valid(parts, len(labels))


@pytest.mark.parametrize("kwargs,needle", [
    ({"num_clients": 0, "scheme": "iid"}, "num_clients=0"),
    ({"num_clients": 6001, "scheme": "iid"}, "num_clients=6001"),
    ({"num_clients": 2.5, "scheme": "iid"}, "num_clients=2.5"),
    ({"num_clients": 5, "scheme": "bogus"}, "bogus"),
    ({"num_clients": 5, "scheme": "bogus"}, "dirichlet_by_class"),
    ({"num_clients": 5, "scheme": "dirichlet_by_class"}, "alpha"),
    ({"num_clients": 5, "scheme": "dirichlet_by_client", "alpha": 0}, "alpha=0"),
    ({"num_clients": 5, "scheme": "dirichlet_by_class", "alpha": -1.0}, "alpha=-1.0"),
    ({"num_clients": 5, "scheme": "dirichlet_by_class", "alpha": float("nan")}, "alpha=nan"),
    ({"num_clients": 5, "scheme": "pathological"}, "classes_per_client"),
    ({"num_clients": 5, "scheme": "pathological", "classes_per_client": 0},
     "classes_per_client=0"),
    ({"num_clients": 5, "scheme": "pathological", "classes_per_client": 11},
     "classes_per_client=11"),
    ({"num_clients": 5, "scheme": "dirichlet_by_class", "alpha": 1.0, "min_size": -1},
     "min_size=-1"),
    ({"num_clients": 5, "scheme": "dirichlet_by_class", "alpha": 1.0, "max_retries": 0},
     "max_retries=0"),
    ({"num_clients": 5, "scheme": "iid", "num_classes": 3}, "num_classes=3"),
])
def test_bad_inputs(kwargs, needle):
    kwargs = dict(kwargs)
    k, scheme = kwargs.pop("num_clients"), kwargs.pop("scheme")
    with pytest.raises(ValueError, match=re.escape(needle)):
        partition(LABELS, k, scheme, 0, **kwargs)


@pytest.mark.parametrize("labels,needle", [
    (np.zeros((4, 2), dtype=int), "1-D"),
    (np.array([0, 1, -1, 2]), "non-negative"),
    (np.array([0.0, 1.0, 2.0]), "integer"),
    (np.array([], dtype=int), "empty"),
])
def test_bad_labels(labels, needle):
    with pytest.raises(ValueError, match=needle):
        partition(labels, 1, "iid", 0)


def test_natural_one_client_per_group():
    labels = np.array([0, 1, 1, 2, 0, 2, 1, 0])
    groups = np.array([7, 3, 7, 5, 3, 7, 5, 3])
    parts = partition(labels, 3, "natural", 0, groups=groups)
    # Clients in ascending group order (3, 5, 7), each holding exactly its group's indices.
    expected = [[1, 4, 7], [3, 6], [0, 2, 5]]
    assert [p.tolist() for p in parts] == expected
    assert all(p.dtype == np.int64 for p in parts)
    _assert_valid(parts, len(labels))
    again = partition(labels, 3, "natural", 99, groups=list(groups), balance=True, alpha=0.1)
    assert [p.tolist() for p in again] == expected  # seed and other options do not apply


@pytest.mark.parametrize("groups,k,needle", [
    (None, 3, "needs groups"),
    (np.array([0, 1, 2]), 3, "shape (8,)"),
    (np.array([0.0, 1.0] * 4), 2, "integers"),
    (np.array([7, 3, 7, 5, 3, 7, 5, 3]), 4, "3 distinct values, so num_clients must be 3"),
])
def test_natural_bad_groups(groups, k, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        partition(np.array([0, 1, 1, 2, 0, 2, 1, 0]), k, "natural", 0, groups=groups)


def test_client_label_counts_small_example():
    labels = np.array([0, 1, 1, 2, 0, 2, 2, 1])
    parts = [np.array([0, 1, 2]), np.array([3, 5, 6]), np.array([4, 7])]
    expected = np.array([[1, 2, 0], [0, 0, 3], [1, 1, 0]])
    np.testing.assert_array_equal(client_label_counts(labels, parts), expected)
    wider = client_label_counts(labels, parts, num_classes=5)
    assert wider.shape == (3, 5) and wider[:, 3:].sum() == 0


def test_stats_table_contents():
    labels = np.array([0, 1, 1, 2, 0, 2, 2, 1])
    parts = [np.array([0, 1, 2]), np.array([3, 5, 6, 4, 7])]
    table = stats_table(labels, parts)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["client", "size", "classes"]
    assert lines[1].split() == ["0", "3", "2", "1", "2", "0"]
    assert lines[2].split() == ["1", "5", "3", "1", "1", "3"]
    assert "8 of 8" in table
    assert "min 3" in table and "max 5" in table
    # Aligned: every table row has the same width as the header.
    assert len({len(line) for line in lines[:3]}) == 1


def test_stats_table_many_classes_and_max_rows():
    labels = np.arange(300) % 30
    parts = partition(labels, 6, "iid", 0)
    table = stats_table(labels, parts, max_rows=2)
    assert "label:count" in table and "4 more clients" in table
    assert "300 of 300" in table


def test_plot_label_distribution_writes_png(tmp_path):
    parts = partition(LABELS, 8, "dirichlet_by_class", 0, alpha=0.5)
    out = tmp_path / "sub" / "dist.png"
    fig = plot_label_distribution(LABELS, parts, path=out)
    assert out.exists() and out.stat().st_size > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    assert len(fig.axes) == 2  # heat map + colorbar


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.25])
def test_split_clients(fraction):
    from fedjax_pan.data.partition import split_clients
    parts = partition(LABELS, 7, "dirichlet_by_class", 3, alpha=0.3) + [np.array([5]),
                                                                        np.array([8, 9])]
    train, test = split_clients(parts, fraction, seed=1)
    for p, tr, te in zip(parts, train, test):
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.sort(p))
        assert len(tr) >= 1 and np.all(np.diff(tr) > 0) and np.all(np.diff(te) >= 0)
        # sklearn's rounding: ceil(f * n) test examples, but one stays for training.
        assert len(te) == min(int(np.ceil(fraction * len(p) - 1e-9)), len(p) - 1)
    again = split_clients(parts, fraction, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(test, again[1]))
    if fraction:
        other = split_clients(parts, fraction, seed=2)[1]
        assert not all(np.array_equal(a, b) for a, b in zip(test, other))
    with pytest.raises(ValueError, match="test_fraction"):
        split_clients(parts, 1.0, seed=1)


def test_noisy_clients_are_a_seeded_share_the_same_for_every_rate():
    a = data.noisy_clients(20, 0.4, seed=3)
    assert a.dtype == bool and a.sum() == 8
    assert np.array_equal(a, data.noisy_clients(20, 0.4, seed=3))
    assert not np.array_equal(a, data.noisy_clients(20, 0.4, seed=4))
    assert data.noisy_clients(20, 0.0, 3).sum() == 0 and data.noisy_clients(20, 1.0, 3).all()
    with pytest.raises(ValueError, match="1.5"):
        data.noisy_clients(20, 1.5, 0)


def test_noisy_labels_touch_only_a_rate_of_the_noisy_clients_parts():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=4000)
    parts = data.partition(labels, 10, "iid", seed=0, num_classes=10)
    for rate in (0.0, 0.5, 1.0):
        noisy_y, noisy = data.noisy_labels(labels, parts, 0.3, rate, seed=1, num_classes=10)
        assert np.array_equal(noisy, data.noisy_clients(10, 0.3, 1)) and noisy.sum() == 3
        for i, part in enumerate(parts):
            changed = int(np.sum(noisy_y[part] != labels[part]))
            if not noisy[i]:
                assert changed == 0
            else:
                hit = round(rate * len(part))
                # a redrawn label equals the old one with probability 1/10
                assert 0.8 * hit <= changed <= hit
        assert np.array_equal(noisy_y, data.noisy_labels(labels, parts, 0.3, rate, 1, 10)[0])
    assert np.array_equal(labels, data.noisy_labels(labels, parts, 0.0, 1.0, 1, 10)[0])
    with pytest.raises(ValueError, match="-0.1"):
        data.noisy_labels(labels, parts, 0.3, -0.1, 1, 10)
