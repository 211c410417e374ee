"""Client data and local-work semantics against hand-computed counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients
from fedjax_pan.engine.clients import (Augment, ClientData, LocalWork, augment_batch,
                                       epoch_order, real_examples, step_batch, step_rows,
                                       tail_rows)


@pytest.mark.parametrize("mode,epochs,steps,sizes,want", [
    ("epochs", 5, None, [600, 130, 64, 1], [50, 15, 5, 5]),       # E * ceil(n/B)
    ("epochs", 0.5, None, [600, 130], [5, 2]),                      # ceil(0.5 * 10), ceil(1.5)
    ("authors", 5, None, [600, 130, 1], [50, 15, 5]),              # max(floor(E*b), 5)
    ("authors", 0.2, None, [600, 130], [5, 5]),                    # floor(2) -> 5, floor(.6) -> 5
    ("steps", 1, 7, [600, 3], [7, 7]),
])
def test_num_steps(mode, epochs, steps, sizes, want):
    work = LocalWork(batch_size=64, epochs=epochs, mode=mode, local_steps=steps)
    np.testing.assert_array_equal(work.num_steps(np.asarray(sizes)), want)


@pytest.mark.parametrize("kwargs", [dict(mode="epoch"), dict(batch_size=0), dict(epochs=0),
                                    dict(mode="steps", local_steps=None)])
def test_local_work_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        LocalWork(**kwargs)


def test_every_epoch_visits_each_client_example_exactly_once():
    ds, cd = tiny_clients([37, 50, 8])
    key = jax.random.PRNGKey(3)
    batch_size, client = 8, 0
    size = int(cd.sizes[client])
    per_epoch = -(-size // batch_size)  # 5 batches, the last with 5 real examples
    labels = np.asarray(cd.labels)
    own = np.sort(np.asarray(cd.index_table[client, :size]))
    orders = []
    for epoch in range(3):
        seen, masks = [], []
        for b in range(per_epoch):
            batch = step_batch(cd.images, cd.labels, cd.index_table[client], jnp.int32(size),
                               key, jnp.int32(epoch * per_epoch + b), batch_size)
            m = np.asarray(batch["mask"]) > 0
            masks.append(int(m.sum()))
            # Identify examples by their image rows (images are distinct floats).
            x = np.asarray(batch["x"])[m].reshape(int(m.sum()), -1)
            rows = [int(np.flatnonzero(np.all(np.asarray(cd.images).reshape(len(labels), -1)
                                              == r, axis=1))[0]) for r in x]
            seen += rows
        assert masks == [8, 8, 8, 8, 5]
        assert sorted(seen) == list(own)
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_a_short_batch_on_fewer_rows_holds_the_same_examples():
    _, cd = tiny_clients([37, 50])
    key, size, t = jax.random.PRNGKey(5), jnp.int32(37), jnp.int32(9)  # epoch 1, batch 4
    full = step_batch(cd.images, cd.labels, cd.index_table[0], size, key, t, 8)
    short = step_batch(cd.images, cd.labels, cd.index_table[0], size, key, t, 8, rows=6)
    np.testing.assert_array_equal(np.asarray(full["mask"]), [1] * 5 + [0] * 3)
    np.testing.assert_array_equal(np.asarray(short["mask"]), [1] * 5 + [0])
    for k in ("x", "y"):
        np.testing.assert_array_equal(np.asarray(short[k])[:5], np.asarray(full[k])[:5])


def test_tail_rows_round_remainders_up_to_a_quarter_of_the_batch():
    # B=64: granule 16. 600 = 9*64 + 24 -> 32; 605 -> 29 -> 32; 616 -> 40 -> 48; 640 and
    # 63, 49 (-> 64) have no separate tail; 1 -> 16.
    np.testing.assert_array_equal(
        tail_rows(np.asarray([600, 605, 616, 640, 63, 49, 1]), 64), [32, 32, 48, 0, 0, 0, 16])
    np.testing.assert_array_equal(tail_rows(np.asarray([27, 12, 16, 7]), 8), [4, 4, 0, 0])
    # 600 examples, 5 epochs: 10 steps each, the 10th on 32 rows (24 real).
    rows = step_rows(600, 50, 64)
    assert rows == ([64] * 9 + [32]) * 5 and sum(rows) == 5 * 600 + 5 * 8
    assert step_rows(27, 6, 8) == [8, 8, 8, 4, 8, 8]  # a partial epoch has no tail
    assert step_rows(63, 3, 64) == [64, 64, 64]


def test_epoch_order_puts_padding_last_and_is_deterministic():
    key = jax.random.PRNGKey(0)
    o = np.asarray(epoch_order(key, 2, 5, 9))
    assert sorted(o[:5]) == [0, 1, 2, 3, 4] and sorted(o[5:]) == [5, 6, 7, 8]
    np.testing.assert_array_equal(o, np.asarray(epoch_order(key, 2, 5, 9)))


def test_real_examples_counts_partial_epochs():
    work = LocalWork(batch_size=10, mode="steps", local_steps=7)
    # n=25: 3 batches/epoch (10, 10, 5); 7 steps = 2 epochs (50) + 1 full batch (10).
    # n=100: 10 batches/epoch; 7 steps = 70.
    assert real_examples(work, np.asarray([25, 100])) == 60 + 70
    assert real_examples(LocalWork(batch_size=10, epochs=2), np.asarray([25])) == 50


def test_client_data_rejects_empty_clients():
    with pytest.raises(ValueError, match="at least one"):
        ClientData.create(np.zeros((3, 2, 2, 1)), np.zeros(3, np.int32),
                          [np.array([0, 1]), np.array([], np.int64)])


def test_crop_and_flip_are_windows_of_the_padded_image():
    """Every augmented example is one of the (2p+1)^2 windows of its image padded with
    `fill`, flipped or not; crops and flips vary over examples; a batch's first rows do not
    depend on how many rows it has; the same key gives the same batch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 6, 5, 2)).astype(np.float32)
    aug = Augment(pad=2, flip=True, fill=(-1.5, 7.0))
    key = jax.random.PRNGKey(3)
    out = np.asarray(augment_batch(jnp.asarray(x), key, aug))
    padded = np.empty((24, 10, 9, 2), np.float32)
    padded[...] = np.asarray(aug.fill, np.float32)
    padded[:, 2:8, 2:7] = x
    found = []
    for i in range(24):
        hits = [(dy, dx, f) for dy in range(5) for dx in range(5) for f in (False, True)
                if np.array_equal(out[i], (lambda w: w[:, ::-1] if f else w)(
                    padded[i, dy:dy + 6, dx:dx + 5]))]
        assert hits, i
        found.append(hits[0])
    assert len({(dy, dx) for dy, dx, _ in found}) > 5 and {f for *_, f in found} == {False, True}
    np.testing.assert_array_equal(
        np.asarray(augment_batch(jnp.asarray(x[:10]), key, aug)), out[:10])
    np.testing.assert_array_equal(np.asarray(augment_batch(jnp.asarray(x), key, aug)), out)
    plain = np.asarray(augment_batch(jnp.asarray(x), key, Augment(pad=0, flip=False)))
    np.testing.assert_array_equal(plain, x)


def test_a_batch_above_every_client_costs_what_the_largest_client_does():
    """The executors' B is min(B, largest client): the same steps and batches (one whole
    client per epoch), and no client computes more than its rows rounded up to a quarter
    of that, however large the configured B (100,000 on 200 examples padded to 25,000)."""
    sizes = np.asarray([200, 173, 57, 1, 64, 129])
    for b in (8, 64, 200, 100_000):
        eff = min(b, int(sizes.max()))
        work, capped = LocalWork(batch_size=b, epochs=3), LocalWork(batch_size=eff, epochs=3)
        np.testing.assert_array_equal(work.num_steps(sizes), capped.num_steps(sizes))
        for n, steps in zip(sizes, capped.num_steps(sizes)):
            rows = step_rows(int(n), int(steps), eff)
            assert max(rows) <= min(eff, n + -(-eff // 4) - 1), (b, n, rows)
