"""Evaluation against a direct NumPy computation (batch size not dividing the set)."""

import jax
import numpy as np

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
