"""Optimal-assignment matching (PAN paper Sect. 5.2 II, Fig. 7) recovers known permutations."""

import itertools

import jax
import numpy as np
import pytest

from conftest import random_variables
from fedjax_pan import data, models
from fedjax_pan.analysis import (assignment_matrix, diagonal_ratio, match_layer,
                                 neuron_representations, optimal_assignment)


@pytest.fixture(scope="module")
def mlp():
    model = models.build("mlp", 10, hidden=[32, 32])
    variables = random_variables(model, (8, 8, 1), seed=1)
    ds = data.synthetic(16, 200, image_shape=(8, 8, 1), seed=3)
    return model, variables, ds.test_images


@pytest.fixture(scope="module")
def vgg():
    model = models.build("vgg9", 10, width=0.25)
    variables = random_variables(model, (32, 32, 3), seed=2)
    ds = data.synthetic(4, 48, image_shape=(32, 32, 3), seed=4)
    return model, variables, ds.test_images


def _permute_mlp_fc1(variables, sigma):
    # New neuron j is old neuron sigma[j]: fc1's outputs and fc2's inputs move together.
    out = jax.tree_util.tree_map(np.copy, variables)
    p = out["params"]
    p["fc1"]["kernel"] = variables["params"]["fc1"]["kernel"][:, sigma]
    p["fc1"]["bias"] = variables["params"]["fc1"]["bias"][sigma]
    p["fc2"]["kernel"] = variables["params"]["fc2"]["kernel"][sigma, :]
    return out


def _permute_vgg_conv1(variables, sigma):
    out = jax.tree_util.tree_map(np.copy, variables)
    p = out["params"]
    p["conv1"]["kernel"] = variables["params"]["conv1"]["kernel"][..., sigma]
    p["conv1"]["bias"] = variables["params"]["conv1"]["bias"][sigma]
    p["conv2"]["kernel"] = variables["params"]["conv2"]["kernel"][:, :, sigma, :]
    return out


def test_mlp_permutation_recovered(mlp):
    model, variables, x = mlp
    sigma = np.random.default_rng(7).permutation(32)
    permuted = _permute_mlp_fc1(variables, sigma)
    np.testing.assert_allclose(model.apply(permuted, x), model.apply(variables, x),
                               rtol=1e-5, atol=1e-5)  # sanity: same function
    perm, ratio = match_layer(model, variables, permuted, x, "fc1")
    # B's neuron j is A's neuron sigma[j], so A's neuron i sits at B's argsort(sigma)[i].
    np.testing.assert_array_equal(perm, np.argsort(sigma))
    np.testing.assert_array_equal(sigma[perm], np.arange(32))
    assert ratio == pytest.approx(np.mean(sigma == np.arange(32)))
    # fc2 itself was not permuted.
    perm2, ratio2 = match_layer(model, variables, permuted, x, "fc2")
    np.testing.assert_array_equal(perm2, np.arange(32))
    assert ratio2 == 1.0


def test_identity_model_ratio_one(mlp):
    model, variables, x = mlp
    perm, ratio = match_layer(model, variables, variables, x, "fc1")
    np.testing.assert_array_equal(perm, np.arange(32))
    assert ratio == 1.0


def test_mlp_representations_match_numpy(mlp):
    model, variables, x = mlp
    p = variables["params"]
    h = np.maximum(x.reshape(len(x), -1) @ p["fc1"]["kernel"] + p["fc1"]["bias"], 0.0)
    reps = neuron_representations(model, variables, x, "fc1", batch_size=64, pre_relu=False)
    assert reps.shape == (32, len(x)) and reps.dtype == np.float64
    np.testing.assert_allclose(reps, h.T, rtol=1e-4, atol=1e-5)


def test_pre_relu_representations_are_post_pan_and_the_head_is_the_logits(mlp):
    """The authors' representation: (x W + b) * e with the PAN encoding e (paper Eq. 4,
    e_j = 1 + A sin(2 pi T j / J)), negatives kept; 'head' gives the logits (Fig. 22)."""
    _, variables, x = mlp
    model = models.build("mlp", 10, hidden=[32, 32], pan={"kind": "mul", "period": 1.0,
                                                          "amplitude": 0.3})
    p = variables["params"]
    enc = 1 + 0.3 * np.sin(2 * np.pi * np.arange(32) / 32)
    pre1 = (x.reshape(len(x), -1) @ p["fc1"]["kernel"] + p["fc1"]["bias"]) * enc
    reps = neuron_representations(model, variables, x, "fc1", batch_size=64)
    np.testing.assert_allclose(reps, pre1.T, rtol=1e-4, atol=1e-5)
    assert (reps < 0).any()
    post = neuron_representations(model, variables, x, "fc1", pre_relu=False)
    np.testing.assert_allclose(post, np.maximum(pre1, 0).T, rtol=1e-4, atol=1e-5)
    head = neuron_representations(model, variables, x, "head")
    np.testing.assert_allclose(head, np.asarray(model.apply(variables, x)).T, rtol=1e-5,
                               atol=1e-6)


def test_conv_representations_are_spatial_max(vgg):
    model, variables, x = vgg
    k, b = variables["params"]["conv1"]["kernel"], variables["params"]["conv1"]["bias"]
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = x.shape[1:3]
    conv = sum(xp[:, dy:dy + h, dx:dx + w, :] @ k[dy, dx] for dy in range(3) for dx in range(3))
    expected = np.maximum(conv + b, 0.0).max(axis=(1, 2)).T
    reps = neuron_representations(model, variables, x, "conv1", pre_relu=False)
    np.testing.assert_allclose(reps, expected, rtol=1e-4, atol=1e-5)


def test_conv_permutation_recovered(vgg):
    model, variables, x = vgg
    sigma = np.random.default_rng(11).permutation(8)
    permuted = _permute_vgg_conv1(variables, sigma)
    np.testing.assert_allclose(model.apply(permuted, x), model.apply(variables, x),
                               rtol=1e-4, atol=1e-5)
    perm, ratio = match_layer(model, variables, permuted, x, "conv1")
    np.testing.assert_array_equal(sigma[perm], np.arange(8))
    assert ratio == pytest.approx(np.mean(sigma == np.arange(8)))


def test_optimal_assignment_matches_brute_force():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    costs = {p: sum(np.sqrt(np.sum((a[i] - b[p[i]]) ** 2)) for i in range(6))
             for p in itertools.permutations(range(6))}
    best = min(costs, key=costs.get)
    np.testing.assert_array_equal(optimal_assignment(a, b), best)


def test_optimal_assignment_near_identical_rows():
    # Rows that differ by 1e-7 on a large offset: the |a|^2 - 2ab + |b|^2 expansion would
    # lose them to cancellation in float32.
    base = 1e4 + np.arange(5, dtype=np.float64)[:, None] * 1e-7 * np.ones((5, 3))
    sigma = np.array([3, 0, 4, 1, 2])
    perm = optimal_assignment(base, base[sigma])
    np.testing.assert_array_equal(sigma[perm], np.arange(5))


def test_assignment_matrix_and_ratio_by_hand():
    np.testing.assert_array_equal(assignment_matrix([2, 0, 1]),
                                  [[0, 0, 1], [1, 0, 0], [0, 1, 0]])
    assert diagonal_ratio([0, 2, 1, 3]) == 0.5
    assert diagonal_ratio(np.eye(4, dtype=int)) == 1.0
    with pytest.raises(ValueError):
        diagonal_ratio([0, 0, 1])
    with pytest.raises(ValueError):
        optimal_assignment(np.zeros((3, 2)), np.zeros((4, 2)))
