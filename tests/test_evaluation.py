"""Evaluation against a direct NumPy computation (batch size not dividing the set)."""

import jax
import numpy as np
import pytest

from fedjax_pan import data, models
from fedjax_pan.engine import make_evaluator


def test_evaluator_matches_direct_computation():
    ds = data.synthetic(10, 103, image_shape=(4, 4, 1), seed=2)
    model = models.build("mlp", 10, hidden=[8])
    variables = models.init(model, jax.random.PRNGKey(1), (4, 4, 1))
    logits = np.asarray(model.apply(variables, ds.test_images), np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    want_loss = -logp[np.arange(103), ds.test_labels].mean()
    want_acc = (logits.argmax(1) == ds.test_labels).mean()
    got = make_evaluator(model, ds.test_images, ds.test_labels, batch_size=25)(variables)
    assert abs(got["accuracy"] - want_acc) < 1e-9
    assert abs(got["loss"] - want_loss) < 1e-5
    for c in range(10):
        sel = ds.test_labels == c
        assert abs(got["class_accuracy"][c] - (logits[sel].argmax(1) == c).mean()) < 1e-9


def _numpy_client_counts(model, variables_of, images, labels, parts):
    """Per-client (correct, count, loss sum) computed directly with NumPy."""
    out = []
    for j, p in enumerate(parts):
        if len(p) == 0:
            out.append((0.0, 0.0, 0.0))
            continue
        logits = np.asarray(model.apply(variables_of(j), images[p]), np.float64)
        logp = logits - logits.max(1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
        out.append(((logits.argmax(1) == labels[p]).sum(), len(p),
                    -logp[np.arange(len(p)), labels[p]].sum()))
    return np.asarray(out, np.float64).T


def test_client_evaluator_global_and_personal_models_against_numpy():
    from fedjax_pan.engine.evaluation import make_client_evaluator
    ds = data.synthetic(10, 90, image_shape=(4, 4, 1), seed=3)
    parts = [np.arange(0, 7), np.arange(7, 7), np.arange(7, 40), np.arange(40, 90)]
    model = models.build("mlp", 10, hidden=[8])
    own = [models.init(model, jax.random.PRNGKey(s), (4, 4, 1)) for s in range(len(parts))]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *own)
    evaluate = make_client_evaluator(model, ds.test_images, ds.test_labels, parts,
                                     batch_size=16)
    # One global model: every client sees it on its own part.
    want = _numpy_client_counts(model, lambda j: own[0], ds.test_images, ds.test_labels,
                                parts)
    got = evaluate(own[0])
    np.testing.assert_allclose(got["correct"], want[0])
    np.testing.assert_array_equal(got["count"], [7, 0, 33, 50])
    np.testing.assert_allclose(got["loss_sum"], want[2], rtol=1e-5)
    # Each client's own model, looped and vmapped.
    want = _numpy_client_counts(model, lambda j: own[j], ds.test_images, ds.test_labels,
                                parts)
    for vmapped in (False, True):
        got = evaluate(stacked, personal=True, vmapped=vmapped)
        np.testing.assert_allclose(got["correct"], want[0], err_msg=str(vmapped))
        np.testing.assert_allclose(got["loss_sum"], want[2], rtol=1e-5)
    assert not np.allclose(want[0], _numpy_client_counts(
        model, lambda j: own[0], ds.test_images, ds.test_labels, parts)[0])
    # Clients of two networks, each group on its own: the groups' counts add up to the
    # whole, and each client is scored by the network its models belong to.
    wide = models.build("mlp", 10, hidden=[12])
    own_wide = {j: models.init(wide, jax.random.PRNGKey(10 + j), (4, 4, 1)) for j in (0, 3)}
    want = _numpy_client_counts(
        model, lambda j: own[j], ds.test_images, ds.test_labels, parts)
    want_wide = _numpy_client_counts(
        wide, lambda j: own_wide.get(j, own_wide[0]), ds.test_images, ds.test_labels, parts)
    for vmapped in (False, True):
        a = evaluate(jax.tree_util.tree_map(lambda *x: np.stack(x), own_wide[0], own_wide[3]),
                     personal=True, vmapped=vmapped, net=wide, clients=[0, 3])
        b = evaluate(jax.tree_util.tree_map(lambda x: x[1:3], stacked), personal=True,
                     vmapped=vmapped, clients=[1, 2])
        np.testing.assert_array_equal(a["count"], [7, 0, 0, 50])
        np.testing.assert_array_equal(a["count"] + b["count"], [7, 0, 33, 50])
        np.testing.assert_allclose(a["correct"] + b["correct"],
                                   [want_wide[0][0], 0, want[0][2], want_wide[0][3]])
    with pytest.raises(ValueError, match="personal=True"):
        evaluate(own[0], clients=[0])


def test_client_metrics_by_hand():
    from fedjax_pan.engine.evaluation import client_metrics
    # Accuracies 1/2, 3/4, (none), 0/10, 9/10, 5/5, 2/4, 1/1, 3/6, 7/8, 4/8, 1/2:
    # 11 clients with examples; the worst ceil(1.1) = 2: 0.0 and 0.5.
    correct = np.array([1, 3, 0, 0, 9, 5, 2, 1, 3, 7, 4, 1])
    count = np.array([2, 4, 0, 10, 10, 5, 4, 1, 6, 8, 8, 2])
    acc = np.array([.5, .75, 0, .9, 1, .5, 1, .5, .875, .5, .5])
    m = client_metrics(correct, count)
    assert m["pfl_accuracy"] == 36 / 60
    assert abs(m["client_accuracy_mean"] - acc.mean()) < 1e-12
    assert abs(m["client_accuracy_std"] - acc.std()) < 1e-12
    assert m["client_accuracy_worst10"] == 0.25
    import pytest
    with pytest.raises(ValueError):
        client_metrics(np.zeros(3), np.zeros(3))
