"""Preference vectors (Fed2 Eq. 9, PAN paper Fig. 8) and total variance (Fed2 Eq. 17)."""

import math

import jax
import numpy as np
import pytest

from conftest import random_variables
from fedjax_pan import data, models
from fedjax_pan.analysis.preference import grouped_depth, sharing_depth
from fedjax_pan.analysis import (class_agreement, layerwise_total_variance, neuron_classes,
                                 preference_vectors, total_variance)


@pytest.fixture(scope="module")
def mlp():
    model = models.build("mlp", 10, hidden=[32, 24])
    variables = random_variables(model, (8, 8, 1), seed=5)
    ds = data.synthetic(10, 60, image_shape=(8, 8, 1), seed=6)
    return model, variables, ds.test_images, ds.test_labels


def _numpy_features_preference(variables, x, y, num_classes=10):
    # 'features' h feeds the head linearly, so dZ_c/dh_i = W_head[i, c].
    p = variables["params"]
    h = np.maximum(x.reshape(len(x), -1) @ p["fc1"]["kernel"] + p["fc1"]["bias"], 0.0)
    h = np.maximum(h @ p["fc2"]["kernel"] + p["fc2"]["bias"], 0.0).astype(np.float64)
    w = np.asarray(p["head"]["kernel"], np.float64)
    pref = np.zeros((h.shape[1], num_classes))
    for b in range(len(x)):
        pref[:, y[b]] += h[b] * w[:, y[b]]
    return pref


def test_features_preference_matches_head_kernel(mlp):
    model, variables, x, y = mlp
    expected = _numpy_features_preference(variables, x, y)
    # batch_size 4 with 6 samples per class exercises padding and multi-batch accumulation.
    for batch_size in (4, 256):
        pref = preference_vectors(model, variables, x, y, "features", 10, batch_size=batch_size)
        assert pref.shape == (24, 10)
        np.testing.assert_allclose(pref, expected, rtol=1e-4, atol=1e-6)


def test_output_layer_preference_is_diagonal(mlp):
    """Fig. 22 (the MLP's FC4): an output neuron i's own logit Z_i has dZ_c/dZ_i = [i = c],
    so p[i, c] = [i = c] * sum of Z_c over the class-c samples."""
    model, variables, x, y = mlp
    logits = np.asarray(model.apply(variables, x), np.float64)
    expected = np.diag([logits[y == c, c].sum() for c in range(10)])
    pref = preference_vectors(model, variables, x, y, "head", 10, batch_size=16)
    np.testing.assert_allclose(pref, expected, rtol=1e-4, atol=1e-6)


def test_mean_and_normalize_options(mlp):
    model, variables, x, y = mlp
    expected = _numpy_features_preference(variables, x, y) / np.bincount(y, minlength=10)
    pref = preference_vectors(model, variables, x, y, "features", 10, reduce="mean")
    np.testing.assert_allclose(pref, expected, rtol=1e-4, atol=1e-6)
    l1 = preference_vectors(model, variables, x, y, "features", 10, reduce="mean",
                            normalize="l1")
    norms = np.abs(expected).sum(axis=1, keepdims=True)
    live = norms[:, 0] > 0
    np.testing.assert_allclose(l1[live], expected[live] / norms[live], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(l1[~live], 0.0)


def test_absent_classes_are_zero(mlp):
    model, variables, x, y = mlp
    keep = y < 4
    pref = preference_vectors(model, variables, x[keep], y[keep], "features", 10)
    np.testing.assert_array_equal(pref[:, 4:], 0.0)
    expected = _numpy_features_preference(variables, x[keep], y[keep])
    np.testing.assert_allclose(pref, expected, rtol=1e-4, atol=1e-6)


def test_conv_preference_sums_space_euler_identity():
    # With zero biases, no norm and no PANs, the logits are positively homogeneous of degree 1
    # in any hidden layer's activations, so sum_i Acti_i dZ_c/dActi_i = Z_c (Euler). Summed
    # over neurons and class-c samples: sum_i p[i, c] = sum_{b in c} Z_c(x_b) -- which holds
    # only if the conv product is summed over spatial positions as well.
    model = models.build("vgg9", 4, width=0.25)
    variables = random_variables(model, (16, 16, 3), seed=8, bias_scale=0.0)
    ds = data.synthetic(4, 16, image_shape=(16, 16, 3), num_classes=4, seed=9)
    x, y = ds.test_images, ds.test_labels
    logits = np.asarray(model.apply(variables, x), np.float64)
    expected = np.array([logits[y == c, c].sum() for c in range(4)])
    for layer in ("conv3", "fc1"):
        pref = preference_vectors(model, variables, x, y, layer, 4)
        np.testing.assert_allclose(pref.sum(axis=0), expected, rtol=1e-3, atol=1e-4)


def test_permutation_equivariance(mlp):
    model, variables, x, y = mlp
    sigma = np.random.default_rng(3).permutation(32)
    permuted = jax.tree_util.tree_map(np.copy, variables)
    p, q = variables["params"], permuted["params"]
    q["fc1"]["kernel"] = np.asarray(p["fc1"]["kernel"])[:, sigma]
    q["fc1"]["bias"] = np.asarray(p["fc1"]["bias"])[sigma]
    q["fc2"]["kernel"] = np.asarray(p["fc2"]["kernel"])[sigma, :]
    pref_a = preference_vectors(model, variables, x, y, "fc1", 10)
    pref_b = preference_vectors(model, permuted, x, y, "fc1", 10)
    np.testing.assert_allclose(pref_b, pref_a[sigma], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(neuron_classes(pref_b), neuron_classes(pref_a)[sigma])
    feats_a = preference_vectors(model, variables, x, y, "features", 10)
    feats_b = preference_vectors(model, permuted, x, y, "features", 10)
    np.testing.assert_allclose(feats_b, feats_a, rtol=1e-4, atol=1e-6)


def test_class_agreement_by_hand(mlp):
    model, variables, x, y = mlp
    pref = preference_vectors(model, variables, x, y, "fc1", 10)
    assert class_agreement(pref, pref) == 1.0
    a = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    b = np.array([[0.0, 1.0], [0.0, 1.0], [3.0, 0.0]])
    np.testing.assert_array_equal(neuron_classes(a), [0, 1, 0])
    assert class_agreement(a, b) == pytest.approx(2.0 / 3.0)


def test_total_variance_by_hand():
    # Rows normalised by their sums: (.5,.5), (.75,.25), (0,1); mean (5/12, 7/12);
    # distances sqrt(2)/12 * (1, 4, 5) -> TV = 10 sqrt(2) / 36.
    pref = np.array([[1.0, 1.0], [3.0, 1.0], [0.0, 2.0]])
    assert total_variance(pref) == pytest.approx(5.0 * math.sqrt(2.0) / 18.0)
    # A dead neuron (p = 0) has no defined normalised vector and is left out.
    assert total_variance(np.vstack([pref, [0.0, 0.0]])) == pytest.approx(
        5.0 * math.sqrt(2.0) / 18.0)
    # Scaling a neuron's vector does not change its normalised vector.
    assert total_variance(pref * np.array([[2.0], [0.5], [7.0]])) == pytest.approx(
        5.0 * math.sqrt(2.0) / 18.0)
    # l1: (.5,-.5), (1,0); mean (.75,-.25); both .25 sqrt(2) away. 'sum' drops row 1 (sum 0).
    mixed = np.array([[1.0, -1.0], [2.0, 0.0]])
    assert total_variance(mixed, normalize="l1") == pytest.approx(0.25 * math.sqrt(2.0))
    assert total_variance(mixed) == pytest.approx(0.0)
    # Unnormalised: (1,-1), (2,0); mean (1.5,-.5); both sqrt(.5) away.
    assert total_variance(mixed, normalize=False) == pytest.approx(math.sqrt(0.5))


def test_layerwise_total_variance(mlp):
    model, variables, x, y = mlp
    tv = layerwise_total_variance(model, variables, x, y, ["fc1", "features"], 10)
    assert set(tv) == {"fc1", "features"}
    reference = _numpy_features_preference(variables, x, y)
    sums = reference.sum(axis=1, keepdims=True)
    normed = reference[sums[:, 0] != 0] / sums[sums[:, 0] != 0]
    expected = np.mean(np.linalg.norm(normed - normed.mean(axis=0), axis=1))
    assert tv["features"] == pytest.approx(expected, rel=1e-3)
    assert np.isfinite(tv["fc1"]) and tv["fc1"] >= 0.0


def test_sharing_depth_by_hand():
    tv = {"conv1": 0.1, "conv2": 0.2, "conv3": 0.9, "fc1": 0.3, "fc2": 1.0}
    # threshold = 0.1 + 0.5 * (1.0 - 0.1) = 0.55: conv3 is the first layer above it.
    assert sharing_depth(tv) == (2, pytest.approx(0.55))
    assert sharing_depth(tv, threshold=0.95) == (4, 0.95)
    assert sharing_depth(tv, threshold=2.0)[0] == 5  # nothing above: share everything
    assert sharing_depth({"a": float("nan"), "b": 0.1, "c": 0.5}, relative=0.5)[0] == 2
    layers = ["conv1", "conv2", "conv3", "fc1", "fc2", "head"]
    assert grouped_depth(layers, 2) == 4  # conv3, fc1, fc2 and the head
    assert grouped_depth(layers, 5) == 2  # at least one grouped hidden layer and the head
    with pytest.raises(ValueError, match="finite"):
        sharing_depth({"a": float("nan")})
