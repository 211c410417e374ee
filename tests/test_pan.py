"""PAN encodings against hand-computed values (paper Eq. 4-5, SPEC 1)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan import pan

S3 = math.sqrt(3) / 2  # sin(pi/3) = sin(2pi/3)


@pytest.mark.parametrize("width,period,amplitude,sines", [
    (4, 1.0, 0.5, [0.0, 1.0, 0.0, -1.0]),          # sin(2*pi*j/4)
    (8, 2.0, 0.1, [0, 1, 0, -1, 0, 1, 0, -1]),      # sin(pi*j/2)
    (6, 0.5, 0.2, [0.0, 0.5, S3, 1.0, S3, 0.5]),     # sin(pi*j/6)
    (3, 1.0, 0.75, [0.0, S3, -S3]),                  # sin(2*pi*j/3)
])
def test_encoding_matches_hand_computed_values(width, period, amplitude, sines):
    sines = np.asarray(sines, dtype=np.float64)
    add = pan.encoding(width, "add", period, amplitude)
    mul = pan.encoding(width, "mul", period, amplitude)
    assert add.dtype == np.float32 and add.shape == (width,)
    np.testing.assert_allclose(add, amplitude * sines, atol=1e-7)
    np.testing.assert_allclose(mul, 1.0 + amplitude * sines, atol=1e-7)


def test_ratio_encodes_only_the_leading_neurons():
    add = pan.encoding(8, "add", 2.0, 0.1, ratio=0.5)
    mul = pan.encoding(8, "mul", 2.0, 0.1, ratio=0.5)
    np.testing.assert_allclose(add, [0, 0.1, 0, -0.1, 0, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(mul, [1, 1.1, 1, 0.9, 1, 1, 1, 1], atol=1e-7)
    # floor(0.3 * 10) = 3 encoded neurons.
    assert np.count_nonzero(pan.encoding(10, "add", 1.0, 0.2, ratio=0.3)[3:]) == 0


@pytest.mark.parametrize("cfg", [
    pan.PANConfig("add", 1.0, 0.0), pan.PANConfig("mul", 1.0, 0.0),
    pan.PANConfig("mul", 0.0, 0.3), pan.PANConfig("add", 1.0, 0.2, ratio=0.0)])
def test_disabled_configs_are_the_identity(cfg):
    assert not cfg.enabled
    x = jnp.asarray([[-0.0, 1.5, -2.0]])
    assert pan.apply_pan(x, cfg) is x
    assert pan.apply_pan(x, None) is x


def test_apply_acts_on_the_last_axis_of_feature_maps():
    x = np.random.default_rng(0).normal(size=(2, 3, 3, 4)).astype(np.float32)
    for kind in pan.KINDS:
        cfg = pan.PANConfig(kind, 1.0, 0.5)
        e = pan.encoding(4, kind, 1.0, 0.5)
        want = x + e if kind == "add" else x * e
        np.testing.assert_allclose(np.asarray(pan.apply_pan(jnp.asarray(x), cfg)), want,
                                   rtol=1e-6)


def test_encoding_is_constant_not_a_variable():
    # PANs add no variables: the parameter tree with PANs is the tree without them.
    from fedjax_pan import models
    shapes = [jax.tree_util.tree_map(lambda x: x.shape, jax.eval_shape(
        lambda: models.build("mlp", 10, hidden=[8, 8], pan=p).init(
            jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 1))))) for p in (None, pan.PANConfig())]
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="sub"), "kind"), (dict(ratio=1.5), "ratio"), (dict(amplitude=float("nan")), "finite")])
def test_invalid_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pan.PANConfig(**kwargs)


def test_as_config_accepts_mappings_and_rejects_unknown_keys():
    assert pan.as_config({"kind": "add", "amplitude": 0.05}) == pan.PANConfig("add", 1.0, 0.05)
    assert pan.as_config(None) is None
    with pytest.raises(ValueError, match="amplitud"):
        pan.as_config({"amplitud": 0.1})
    with pytest.raises(ValueError, match="width"):
        pan.encoding(0, "add", 1.0, 0.1)
