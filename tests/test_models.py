"""Models: parameter counts, PAN placement against hand-written forward passes, init, options."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_init
from fedjax_pan import models
from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig, encoding

PAN_MUL = PANConfig("mul", 1.0, 0.3)
PAN_ADD = PANConfig("add", 1.0, 0.3)
KEY = jax.random.PRNGKey(0)


def _init(model, shape):
    return models.init(model, KEY, shape)


def _shapes(model, shape):
    """`models.init`'s variables as shapes (nothing compiles)."""
    return jax.eval_shape(lambda: _init(model, shape))


def _inputs(shape, n=2, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, *shape)), jnp.float32)


def _dense_count(sizes):
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def _conv_count(channels, k=3):
    return sum(k * k * a * b + b for a, b in zip(channels[:-1], channels[1:]))


def test_parameter_counts_match_the_paper_architectures():
    mlp = _shapes(models.build("mlp", 10), (28, 28, 1))
    assert models.count_params(mlp) == _dense_count([784, 1024, 1024, 1024, 10]) == 2_913_290
    vgg9 = _shapes(models.build("vgg9", 10), (32, 32, 3))
    want = _conv_count([3, 32, 64, 128, 128, 256, 256]) + _dense_count([4096, 512, 512, 10])
    assert models.count_params(vgg9) == want == 3_491_530
    cnn = _shapes(models.build("cnn", 10), (28, 28, 1))
    want = _conv_count([1, 32, 64], k=5) + _dense_count([7 * 7 * 64, 512, 10])
    assert models.count_params(cnn) == want == 1_663_370


SHAPES = [(28, 28, 1), (32, 32, 3)]


@pytest.mark.parametrize("name,shape", [  # each model by default, with one shape in turn
    pytest.param(n, shape, marks=() if shape == SHAPES[i % 2] else pytest.mark.slow)
    for i, n in enumerate(models.NAMES) for shape in SHAPES])
def test_forward_pass_for_one_and_three_channels(name, shape):
    model = models.build(name, 7, pan=PAN_MUL)
    variables = random_init(model, shape)
    logits, inter = jax.jit(functools.partial(models.apply_with_intermediates, model))(
        variables, _inputs(shape, n=3))
    assert logits.shape == (3, 7) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    head = variables["params"]["head"]
    # The sown representation is exactly the classifier's input (what MOON contrasts).
    np.testing.assert_allclose(inter["features"] @ head["kernel"] + head["bias"], logits,
                               rtol=1e-5, atol=1e-6)


OFF = [PANConfig("mul", 1.0, 0.0), PANConfig("add", 1.0, 0.0), PANConfig("mul", 0.0, 0.5)]


@pytest.mark.parametrize("name,shape,norm,off", [  # each network by default, the offs in turn
    pytest.param(*net, off, marks=() if off == OFF[i % 3] else pytest.mark.slow)
    for i, net in enumerate([("mlp", (28, 28, 1), "none"), ("mlp", (28, 28, 1), "batch"),
                             ("vgg9", (32, 32, 3), "none"), ("vgg11", (32, 32, 3), "group(8)"),
                             ("resnet20", (32, 32, 3), "batch")])
    for off in OFF])
def test_pans_off_is_bit_for_bit_the_baseline(name, shape, norm, off):
    base = models.build(name, 10, norm=norm)
    variables = random_init(base, shape)
    x = _inputs(shape)
    with_off = models.build(name, 10, norm=norm, pan=off)
    assert jax.tree_util.tree_structure(_shapes(with_off, shape)) == \
        jax.tree_util.tree_structure(variables)
    # Each network compiled as one program, as training runs it.
    out_off, out_base = (jax.jit(m.apply)(variables, x) for m in (with_off, base))
    np.testing.assert_array_equal(out_off, out_base)
    # ... while a real PAN changes the function (with the same parameters).
    on = models.build(name, 10, norm=norm, pan=PAN_MUL)
    assert not np.allclose(jax.jit(on.apply)(variables, x), out_base)


def _bn_eval(z, scale, bias, mean, var):
    return (z - mean) / np.sqrt(var + layers.NORM_EPS) * scale + bias


@pytest.mark.parametrize("pan_cfg", [PAN_MUL, PAN_ADD])
@pytest.mark.parametrize("norm", ["none", "batch"])
def test_mlp_matches_a_numpy_forward_pass(pan_cfg, norm):
    """PAN after bias and norm, before ReLU, on the three hidden layers only."""
    model = models.build("mlp", 10, pan=pan_cfg, norm=norm, hidden=[16, 12, 8])
    variables = _init(model, (4, 4, 1))
    if norm == "batch":  # non-trivial running statistics
        rng = np.random.default_rng(3)
        variables["batch_stats"] = jax.tree_util.tree_map(
            lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), jnp.float32),
            variables["batch_stats"])
    x = _inputs((4, 4, 1), n=5)
    p = jax.tree_util.tree_map(np.asarray, variables["params"])
    h = np.asarray(x).reshape(5, -1).astype(np.float64)
    for i, width in enumerate([16, 12, 8], start=1):
        z = h @ p[f"fc{i}"]["kernel"] + p[f"fc{i}"]["bias"]
        if norm == "batch":
            s = variables["batch_stats"][f"fc{i}_norm"]
            z = _bn_eval(z, p[f"fc{i}_norm"]["scale"], p[f"fc{i}_norm"]["bias"],
                         np.asarray(s["mean"]), np.asarray(s["var"]))
        e = encoding(width, pan_cfg.kind, pan_cfg.period, pan_cfg.amplitude)
        h = np.maximum(z + e if pan_cfg.kind == "add" else z * e, 0.0)
    want = h @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(model.apply(variables, x), want, rtol=1e-4, atol=1e-6)


def _conv(x, kernel, stride=1):
    pad = kernel.shape[0] // 2
    return jax.lax.conv_general_dilated(
        np.asarray(x, np.float64), np.asarray(kernel, np.float64), (stride, stride),
        [(pad, pad)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_vgg9_first_conv_and_fc_pan_option():
    model = models.build("vgg9", 10, pan=PAN_ADD)
    variables = random_init(model, (32, 32, 3))
    x = _inputs((32, 32, 3))
    _, inter = models.apply_with_intermediates(model, variables, x)
    p = variables["params"]["conv1"]
    want = np.maximum(_conv(x, p["kernel"]) + p["bias"] + encoding(32, "add", 1.0, 0.3), 0)
    np.testing.assert_allclose(inter["conv1"], want, rtol=1e-4, atol=1e-5)
    # FC hidden layers are plain unless pan_fc=True (the released code's choice).
    f = variables["params"]["fc1"]
    flat = inter["conv6"]
    flat = np.asarray(jax.lax.reduce_window(flat, -np.inf, jax.lax.max, (1, 2, 2, 1),
                                            (1, 2, 2, 1), "SAME")).reshape(2, -1)
    z = flat @ np.asarray(f["kernel"]) + np.asarray(f["bias"])
    np.testing.assert_allclose(inter["fc1"], np.maximum(z, 0), rtol=1e-4, atol=1e-5)
    with_fc = models.build("vgg9", 10, pan=PAN_ADD, pan_fc=True)
    _, inter_fc = models.apply_with_intermediates(with_fc, variables, x)
    e = encoding(512, "add", 1.0, 0.3)
    np.testing.assert_allclose(inter_fc["fc1"], np.maximum(z + e, 0), rtol=1e-4, atol=1e-5)


def test_resnet_block_with_projection_shortcut_matches_hand_computation():
    model = models.build("resnet20", 10, pan=PAN_MUL, widths=(8, 16, 32), stem_width=8)
    variables = random_init(model, (16, 16, 3))
    x = _inputs((16, 16, 3))
    _, inter = models.apply_with_intermediates(model, variables, x)
    p, s = variables["params"], variables["batch_stats"]

    def bn(z, name):
        return _bn_eval(z, p[name]["scale"], p[name]["bias"], s[name]["mean"], s[name]["var"])

    def enc(width):
        return encoding(width, "mul", 1.0, 0.3)

    x_in = inter["stage1_block3"]  # 8 channels in, 16 out, stride 2: projection shortcut
    name = "stage2_block1"
    h = np.maximum(bn(_conv(x_in, p[f"{name}_conv1"]["kernel"], 2), f"{name}_conv1_norm")
                   * enc(16), 0)
    h = bn(_conv(h, p[f"{name}_conv2"]["kernel"]), f"{name}_conv2_norm") * enc(16)
    sc = bn(_conv(x_in, p[f"{name}_shortcut"]["kernel"], 2), f"{name}_shortcut_norm") * enc(16)
    np.testing.assert_allclose(inter[name], np.maximum(h + sc, 0), rtol=1e-4, atol=1e-5)
    # Identity shortcut: no encoding on the skip path.
    x_in, name = inter["stage2_block1"], "stage2_block2"
    h = np.maximum(bn(_conv(x_in, p[f"{name}_conv1"]["kernel"]), f"{name}_conv1_norm")
                   * enc(16), 0)
    h = bn(_conv(h, p[f"{name}_conv2"]["kernel"]), f"{name}_conv2_norm") * enc(16)
    np.testing.assert_allclose(inter[name], np.maximum(h + x_in, 0), rtol=1e-4, atol=1e-5)
    # The stem carries no PAN, and convs have no bias under BatchNorm.
    stem = np.maximum(bn(_conv(x, p["stem"]["kernel"]), "stem_norm"), 0)
    np.testing.assert_allclose(inter["stem"], stem, rtol=1e-4, atol=1e-5)
    assert "bias" not in p["stem"] and f"{name}_shortcut" not in p
    assert {k for k in p if k.endswith("_shortcut")} == {"stage2_block1_shortcut",
                                                        "stage3_block1_shortcut"}


def test_initialisation_follows_the_released_code():
    variables = _init(models.build("vgg9", 10, norm="batch"), (32, 32, 3))
    p = variables["params"]
    k = np.asarray(p["conv6"]["kernel"])  # 3x3x256x256: fan_out = 9 * 256
    assert abs(k.std() - np.sqrt(2.0 / (9 * 256))) < 0.02 * np.sqrt(2.0 / (9 * 256))
    assert abs(float(np.asarray(p["fc1"]["kernel"]).std()) - 0.01) < 2e-4
    for name in ["conv1", "conv6", "fc1", "head"]:
        assert not np.any(np.asarray(p[name]["bias"]))
    np.testing.assert_array_equal(p["conv3_norm"]["scale"], 1.0)
    np.testing.assert_array_equal(p["conv3_norm"]["bias"], 0.0)


def test_batch_norm_updates_running_statistics_in_train_mode():
    model = models.build("vgg9", 10, norm="batch")
    variables = random_init(model, (32, 32, 3))
    _, state = model.apply(variables, _inputs((32, 32, 3), n=4), train=True,
                           mutable=["batch_stats"])
    before = variables["batch_stats"]["conv1_norm"]["mean"]
    after = state["batch_stats"]["conv1_norm"]["mean"]
    assert not np.allclose(before, after)


def test_width_options():
    v = _shapes(models.build("resnet20", 10, widths=[16, 32, 64], stem_width=16), (32, 32, 3))
    assert v["params"]["head"]["kernel"].shape == (64, 10)
    v = _shapes(models.build("vgg9", 10, width=0.5), (32, 32, 3))
    assert v["params"]["conv1"]["kernel"].shape == (3, 3, 3, 16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="vgg10"), "vgg10"), (dict(norm="layer"), "layer"), (dict(num_classes=0), "num_classes"),
    (dict(name="mlp", pan_fc=True), "pan_fc"), (dict(pan={"kind": "pow"}), "pow"),
    # Sizes are checked before any layer is built, naming the option.
    (dict(name="mlp", hidden=-3), "option hidden must be a list of positive integers, got -3"),
    (dict(name="mlp", hidden=[200, 0]), r"option hidden .*got \(200, 0\)"),
    (dict(channels=[32, "a"]), "option channels"), (dict(width=-1.0), "option width"),
    (dict(name="cnn", kernel=2.5), "option kernel must be a positive integer"),
    (dict(name="resnet20", widths=[16, True]), "option widths")])
def test_bad_arguments_raise_clear_errors(kwargs, match):
    args = dict(name="vgg9", num_classes=10) | kwargs
    with pytest.raises(ValueError, match=match):
        models.build(args.pop("name"), args.pop("num_classes"), **args)


def test_group_norm_must_divide_channels():
    model = models.build("mlp", 10, norm="group(7)", hidden=[16])
    with pytest.raises(ValueError, match="7 groups"):
        _init(model, (4, 4, 1))


def test_batch_norm_mask_ignores_padded_examples():
    """A masked partial batch behaves exactly like the short batch PyTorch would see."""
    model = models.build("vgg9", 10, norm="batch", width=0.25)
    variables = random_init(model, (8, 8, 3))
    x = _inputs((8, 8, 3), n=6)
    mask = jnp.asarray([1, 1, 1, 1, 0, 0], jnp.float32)
    garbage = x.at[4:].set(1e3)  # what sits in the padded rows must not matter
    out_m, st_m = model.apply(variables, garbage, train=True, mask=mask, mutable=["batch_stats"])
    out_s, st_s = model.apply(variables, x[:4], train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(out_m[:4], out_s, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(st_m), jax.tree_util.tree_leaves(st_s)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_models_are_built_from_specs():
    """A spec is a call with literal keyword options (norm is build's): the same module
    as `build`; a bad one names the model, the option or the syntax."""
    assert models.from_spec("mlp(hidden=(7,))", 10) == models.build("mlp", 10, hidden=[7])
    cnn = models.from_spec("cnn(channels=(4, 8), norm='group(2)')", 3, pan=PAN_MUL)
    assert cnn == models.build("cnn", 3, pan=PAN_MUL, channels=(4, 8), norm="group(2)")
    assert cnn.plan == (4, "M", 8, "M") and cnn.kernel == 5 and cnn.norm == "group"
    for bad, why in [("vgg10", "unknown model 'vgg10'"), ("mlp(hidden=[1], x=2)", "'x'"),
                     ("mlp(2)", "keyword"), ("mlp()()", "not a name"), ("1 + 2", "not a name")]:
        with pytest.raises(ValueError, match=why):
            models.from_spec(bad, 10)
