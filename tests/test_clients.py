"""Client data and local-work semantics against hand-computed counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_clients
from fedjax_pan.engine.clients import (ClientData, LocalWork, epoch_order, make_batch,
                                       real_examples)


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
            batch = make_batch(cd.images, cd.labels, cd.index_table[client], jnp.int32(size),
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
