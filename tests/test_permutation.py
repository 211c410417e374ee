"""Permutation specs: invariance with PANs off, inverses, generators vs their expectation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_init
from fedjax_pan import models
from fedjax_pan.pan import permutation as P

SMALL = {"vgg9": {"width": 0.25}, "vgg11": {"width": 0.25}, "vgg13": {"width": 0.25},
         "vgg16": {"width": 0.25}, "resnet20": {"widths": (16, 32, 64), "stem_width": 16},
         "mlp": {"hidden": [64, 48, 32]}}


def _model(name, norm, pan=None, shape=(32, 32, 3)):
    """A small network with distinct random values everywhere, running statistics and
    norm scales included (`random_init`)."""
    model = models.build(name, 10, norm=norm, pan=pan, **SMALL[name])
    return model, random_init(model, shape)


NETS, NORMS = ["mlp", "vgg9", "vgg11", "vgg13", "vgg16", "resnet20"], ["none", "batch", "group(4)"]
# Every network under one norm in the default run (the norms in turn), every pair in the
# slow run.
CASES = [pytest.param(n, norm, marks=() if norm == NORMS[i % 3] else pytest.mark.slow)
         for i, n in enumerate(NETS) for norm in NORMS]


@pytest.mark.parametrize("name,norm", CASES)
def test_pans_off_networks_are_permutation_invariant(name, norm):
    model, variables = _model(name, norm)
    spec = P.spec_for(model, variables)
    perms = P.random_permutations(spec, np.random.default_rng(1), p_sf=1.0)
    assert all(P.r_kept(p) < 0.2 for p in perms.values())  # really shuffled
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 32, 32, 3)), jnp.float32)
    apply = jax.jit(model.apply)  # one program for both
    out = np.asarray(apply(variables, x))
    permuted = P.apply_permutation(spec, perms, variables)
    out_sf = np.asarray(apply(permuted, x))
    assert np.max(np.abs(out_sf - out)) <= 1e-5 * np.max(np.abs(out))
    # ... while the parameters themselves did change, and the inverse restores them exactly.
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(permuted),
                                                        jax.tree_util.tree_leaves(variables)))
    back = P.apply_permutation(spec, P.inverse(perms), permuted)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(variables)):
        np.testing.assert_array_equal(a, b)


GROUPED = {  # the first grouped layer a conv, an FC; a grouped conv feeding the head (vgg11)
    "mlp": ("mlp", {"hidden": [20, 20, 20], "grouped": {"groups": 5, "depth": 3}}, (4, 4, 1)),
    "vgg9_conv": ("vgg9", {"width": 0.125, "grouped": {"groups": 2, "depth": 5}}, (8, 8, 1)),
    "vgg9_fc": ("vgg9", {"width": 0.125, "grouped": {"groups": 2, "depth": 3}}, (8, 8, 1)),
    "vgg11": ("vgg11", {"width": 0.125, "grouped": {"groups": 2, "depth": 3}}, (8, 8, 1)),
}


@pytest.mark.parametrize("case", sorted(GROUPED))
def test_grouped_models_are_invariant_to_within_group_permutations(case):
    name, options, shape = GROUPED[case]
    model = models.build(name, 10, **options)
    variables = random_init(model, shape)
    rng = np.random.default_rng(4)  # nonzero biases and GroupNorm shifts, so order matters
    variables = jax.tree_util.tree_map(
        lambda x: x + jnp.asarray(0.1 * rng.normal(size=x.shape), x.dtype), variables)
    spec = P.spec_for(model, variables)
    perms = P.random_permutations(spec, np.random.default_rng(1), p_sf=1.0)
    g = model.grouped.groups
    for layer in model.group_layout():
        if layer != "head":  # grouped layers shuffle within their groups only
            assert spec.groups[layer] == g
            width = spec.sizes[layer] // g
            np.testing.assert_array_equal(perms[layer] // width, np.arange(spec.sizes[layer])
                                          // width)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, *shape)), jnp.float32)
    assert P.shuffle_error(model, variables, perms, spec, x) < 1e-6 * float(
        jnp.max(jnp.abs(model.apply(variables, x))))
    with_pans = models.build(name, 10, pan={"kind": "mul", "amplitude": 0.5}, **options)
    assert P.shuffle_error(with_pans, variables, perms, spec, x) > 1e-4
    back = P.apply_permutation(spec, P.inverse(perms), P.apply_permutation(spec, perms,
                                                                           variables))
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options", [{}, {"grouped": {"groups": 2, "depth": 6}}])
def test_mobilenet_is_permutation_invariant_and_depthwise_convs_follow_their_input(options):
    model = models.build("mobilenet", 10, width=0.125, **options)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3))))
    rng = np.random.default_rng(0)  # random parameters and running statistics (init is slow)
    variables = {k: jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), jnp.float32), shapes[k])
        for k in ("params", "batch_stats")}
    variables["batch_stats"] = jax.tree_util.tree_map(lambda v: jnp.abs(v) + 0.5,
                                                      variables["batch_stats"])
    spec = P.spec_for(model, variables)
    assert spec.axes[("params", "block3_dw", "kernel")] == (None, None, None, "block2_pw")
    assert spec.axes[("batch_stats", "block3_dw_norm", "var")] == ("block2_pw",)
    assert spec.axes[("params", "block3_pw", "kernel")] == (None, None, "block2_pw", "block3_pw")
    perms = P.random_permutations(spec, np.random.default_rng(1), p_sf=1.0)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8, 8, 3)), jnp.float32)
    scale = float(jnp.max(jnp.abs(model.apply(variables, x))))
    assert P.shuffle_error(model, variables, perms, spec, x) < 1e-6 * scale
    with_pans = models.build("mobilenet", 10, width=0.125, pan={"amplitude": 0.5}, **options)
    assert P.shuffle_error(with_pans, variables, perms, spec, x) > 1e-3
    if options:  # grouped blocks 9-13 shuffle within their 2 groups
        assert spec.groups["block12_pw"] == 2 and spec.groups["block8_pw"] == 1
        assert spec.axes[("params", "block11_pw", "kernel")][2] == P.InGroup("block10_pw", 3, 2)


@pytest.mark.parametrize("case", ["mlp", "vgg9_group", "resnet20", "grouped_vgg11"])
def test_compiled_permutation_equals_numpy_take(case):
    """Inside jit, axes are reordered by one flat gather (`_reorder_axis`): the result is
    numpy's take / take_along_axis, for plain, in-group and 4-D conv axes."""
    if case == "grouped_vgg11":
        name, options, shape = GROUPED["vgg11"]
        model = models.build(name, 10, **options)
        variables = random_init(model, shape)
    else:
        name, norm = {"mlp": ("mlp", "batch"), "vgg9_group": ("vgg9", "group(4)"),
                      "resnet20": ("resnet20", "batch")}[case]
        model, variables = _model(name, norm)
    spec = P.spec_for(model, variables)
    rng = np.random.default_rng(3)
    variables = jax.tree_util.tree_map(  # distinct entries, so any misplacement shows
        lambda x: np.asarray(rng.normal(size=x.shape), np.float32), variables)
    perms = P.random_permutations(spec, np.random.default_rng(1), p_sf=1.0)
    want = P.apply_permutation(spec, perms, variables)  # numpy arrays: numpy's take
    got = jax.jit(lambda v, p: P.apply_permutation(spec, p, v))(
        jax.tree_util.tree_map(jnp.asarray, variables),
        {k: jnp.asarray(v) for k, v in perms.items()})
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_spec_structure_of_vgg9_and_resnet20():
    model, variables = _model("vgg9", "batch")
    spec = P.spec_for(model, variables)
    assert spec.axes[("params", "fc1", "kernel")] == (P.Flat("conv6"), "fc1")
    assert spec.axes[("params", "conv1", "kernel")] == (None, None, None, "conv1")
    assert spec.axes[("params", "head", "kernel")] == ("fc2", None)
    assert spec.axes[("params", "head", "bias")] == (None,)
    assert spec.axes[("batch_stats", "conv3_norm", "var")] == ("conv3",)
    model, variables = _model("resnet20", "batch")
    spec = P.spec_for(model, variables)
    # One permutation per residual stream: a stage's conv2s and its shortcut share it.
    assert spec.axes[("params", "stage2_block1_shortcut", "kernel")] == (None, None, "res1", "res2")
    assert spec.axes[("params", "stage2_block3_conv2", "kernel")][-1] == "res2"
    assert spec.axes[("params", "stage2_block1_conv1", "kernel")][2:] == ("res1",
                                                                       "stage2_block1_inner")
    assert spec.sizes["res3"] == 64 and len(spec.sizes) == 3 + 9


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_resnet_with_explicit_shortcuts_is_permuted_block_by_block(norm):
    """Identity shortcuts as explicit identity 1x1 convs compute the same function; each
    block's output then has its own permutation, the identity kernels carry the change
    between blocks (becoming permutation matrices), and the network is still invariant."""
    model, variables = _model("resnet20", norm)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 32, 32, 3)), jnp.float32)
    explicit, ev = models.explicit_shortcuts(model, variables)
    out = np.asarray(model.apply(variables, x))
    np.testing.assert_allclose(np.asarray(explicit.apply(ev, x)), out, rtol=1e-5, atol=1e-6)
    # A freshly initialised explicit model starts from identities too.
    fresh = models.init(models.build("resnet20", 10, norm=norm, explicit_shortcuts=True,
                                     **SMALL["resnet20"]), jax.random.PRNGKey(0), (32, 32, 3))
    np.testing.assert_array_equal(fresh["params"]["stage1_block2_identity"]["kernel"][0, 0],
                                  np.eye(16))
    spec = P.spec_for(explicit, ev)
    # stem + 9 block outputs + 9 inner: no stage-wide stream permutations.
    assert len(spec.sizes) == 19 and "res1" not in spec.sizes
    assert spec.axes[("params", "stage1_block2_identity", "kernel")] == (
        None, None, "stage1_block1_out", "stage1_block2_out")
    assert spec.axes[("params", "stage2_block1_shortcut", "kernel")][2:] == (
        "stage1_block3_out", "stage2_block1_out")
    perms = P.random_permutations(spec, np.random.default_rng(1), p_sf=1.0)
    permuted = P.apply_permutation(spec, perms, ev)
    out_sf = np.asarray(explicit.apply(permuted, x))
    assert np.max(np.abs(out_sf - out)) <= 1e-5 * np.max(np.abs(out))
    k = permuted["params"]["stage1_block2_identity"]["kernel"][0, 0]
    assert sorted(k.sum(0)) == sorted(k.sum(1)) == [1.0] * 16 and not np.array_equal(
        k, np.eye(16))
    np.testing.assert_array_equal(
        k, np.eye(16)[perms["stage1_block1_out"]][:, perms["stage1_block2_out"]])


def test_group_norm_permutations_stay_within_groups():
    model, variables = _model("mlp", "group(4)")
    spec = P.spec_for(model, variables)
    assert set(spec.groups.values()) == {4}
    for name, perm in P.random_permutations(spec, np.random.default_rng(0), 1.0).items():
        width = spec.sizes[name] // 4
        np.testing.assert_array_equal(perm // width, np.arange(len(perm)) // width)


def _expected_r_kept(size, p):
    """Alg. 1: position k keeps its neuron iff no earlier step picks it and its own step
    does not swap: prod_{j<k} (1 - p/(J-1-j)) * (1 - p if k < J-1)."""
    total = 0.0
    for k in range(size):
        stay = np.prod([1 - p / (size - 1 - j) for j in range(k)])
        total += stay * ((1 - p) if k < size - 1 else 1.0)
    return total / size


@pytest.mark.parametrize("p_sf", [0.1, 0.5, 1.0])
def test_generator_r_kept_matches_its_expectation(p_sf):
    size, draws = 16, 3000
    rng = np.random.default_rng(0)
    kept = [P.r_kept(P.shuffle_permutation(rng, size, p_sf)) for _ in range(draws)]
    want = _expected_r_kept(size, p_sf)
    assert abs(np.mean(kept) - want) < 4 * np.std(kept) / np.sqrt(draws) + 1e-3
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    gen = jax.jit(jax.vmap(lambda k: P.shuffle_permutation_jax(k, size, p_sf)))
    perms = np.asarray(gen(keys))
    assert all(sorted(p) == list(range(size)) for p in perms)
    kept_jax = [P.r_kept(p) for p in perms]
    assert abs(np.mean(kept_jax) - want) < 4 * np.std(kept_jax) / np.sqrt(400) + 1e-3


def test_window_variant_and_zero_probability():
    rng = np.random.default_rng(0)
    assert P.r_kept(P.shuffle_permutation(rng, 50, 0.0)) == 1.0
    perm = P.shuffle_permutation(rng, 50, 1.0, window=0.1)
    assert sorted(perm) == list(range(50))
    p = np.asarray(P.shuffle_permutation_jax(jax.random.PRNGKey(1), 50, 1.0, window=0.1))
    assert sorted(p) == list(range(50))


def test_fl_shuffle_product_keeps_fewer_neurons_as_n_sf_grows():
    rng = np.random.default_rng(0)
    means = [np.mean([P.r_kept(P.fl_shuffle_product(rng, 32, 0.1, n_sf, 50))
                      for _ in range(150)]) for n_sf in [0, 1, 4, 16]]
    assert means[0] == 1.0 and means[0] > means[1] > means[2] > means[3]


def test_compose_and_inverse():
    rng = np.random.default_rng(3)
    a, b = {"x": rng.permutation(7)}, {"x": rng.permutation(7)}
    v = np.arange(7) * 10
    np.testing.assert_array_equal(v[P.compose(a, b)["x"]], v[a["x"]][b["x"]])
    np.testing.assert_array_equal(P.compose(a, P.inverse(a))["x"], np.arange(7))


# The convnets with the slow tests (their invariance is checked in the default run).
@pytest.mark.parametrize("name", ["mlp", *(pytest.param(n, marks=pytest.mark.slow)
                                           for n in ("vgg13", "resnet20"))])
def test_shuffle_error_grows_with_amplitude_and_faster_for_pan_mul(name):
    """Eq. 8 on N(0,1) inputs: ~0 with PANs off, positive and increasing in A when on, and
    PANx grows faster (superlinearly, its A^(L-1) terms) than PAN+ (paper Sect. 3.2)."""
    model, variables = _model(name, "batch" if name == "resnet20" else "none")
    spec = P.spec_for(model, variables)
    perms = P.random_permutations(spec, np.random.default_rng(2), 1.0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 32, 32, 3)), jnp.float32)
    amps = [0.05, 0.1, 0.2, 0.4]
    err = {}
    for kind in ["add", "mul"]:
        err[kind] = [P.shuffle_error(models.build(name, 10, pan={"kind": kind, "amplitude": a},
                                                  norm="batch" if name == "resnet20" else "none",
                                                  **SMALL[name]), variables, perms, spec, x)
                     for a in amps]
        assert np.all(np.diff(err[kind]) > 0), (kind, err[kind])
    off = P.shuffle_error(model, variables, perms, spec, x)
    assert off < 1e-4 * err["add"][0]
    growth = {k: e[-1] / e[0] for k, e in err.items()}
    assert growth["mul"] > growth["add"], growth
    if name == "resnet20":  # normalised activations: PANx's error is also larger outright
        assert all(m > a for m, a in zip(err["mul"], err["add"]))
