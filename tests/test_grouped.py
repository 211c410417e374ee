"""Grouped (Fed2 / Psi-Net) models: class maps, shapes counted by hand, gradient isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pan import models
from fedjax_pan.models import grouped as grouped_lib
from fedjax_pan.models.grouped import GroupedConfig, as_grouped


def test_class_maps():
    assert GroupedConfig(groups=5).class_map(10).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert GroupedConfig(groups=10).class_map(10).tolist() == list(range(10))  # one-to-one
    assert GroupedConfig(groups=3).class_map(10).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    custom = GroupedConfig(groups=2, class_groups=(1, 0, 1, 0))
    assert custom.class_map(4).tolist() == [1, 0, 1, 0]
    for bad, match in [(GroupedConfig(groups=11), "11 groups"),
                       (GroupedConfig(groups=2, class_groups=(0, 1)), "one group per class"),
                       (GroupedConfig(groups=2, class_groups=(0, 2, 1, 1)), r"\[0, 1\]"),
                       (GroupedConfig(groups=3, class_groups=(0, 1, 1, 0)), r"groups \[2\]")]:
        with pytest.raises(ValueError, match=match):
            bad.class_map(10 if bad.class_groups is None else 4)


def test_bad_grouped_options_are_named():
    with pytest.raises(ValueError, match="depth must be >= 2"):
        GroupedConfig(depth=1)
    with pytest.raises(ValueError, match="unknown grouped option"):
        as_grouped({"groups": 2, "deepness": 3})
    with pytest.raises(ValueError, match="exceeds the model's 4 weight layers"):
        models.build("mlp", 10, hidden=[8, 8, 8], grouped={"groups": 2, "depth": 5}
                     ).group_layout()


def test_vgg9_grouped_shapes_and_count_by_hand():
    model = models.build("vgg9", 10, grouped={"groups": 10, "depth": 6})
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 28, 28, 1))))["params"]
    got = {k: {n: v.shape for n, v in d.items()} for k, d in shapes.items()}
    # conv4 is the first grouped layer: dense input, 128 -> 130 outputs (a multiple of G);
    # conv5/6 see 13/26 channels of their group; fc1 sees its group's 4x4x26 = 416 features.
    assert got["conv4"]["kernel"] == (3, 3, 128, 130)
    assert got["conv5"]["kernel"] == (3, 3, 13, 260)
    assert got["conv6"]["kernel"] == (3, 3, 26, 260)
    assert got["conv6_norm"]["scale"] == (260,)
    assert got["fc1"]["kernel"] == (10, 416, 52) and got["fc1"]["bias"] == (10, 52)
    assert got["fc2"]["kernel"] == (10, 52, 52)
    assert got["head"]["kernel"] == (10, 52, 10) and got["head"]["bias"] == (10,)
    by_hand = (9 * 1 * 32 + 32 + 9 * 32 * 64 + 64 + 9 * 64 * 128 + 128
               + 9 * 128 * 130 + 130 + 2 * 130 + 9 * 13 * 260 + 260 + 2 * 260
               + 9 * 26 * 260 + 260 + 2 * 260 + 10 * 416 * 52 + 520 + 10 * 52 * 52 + 520
               + 10 * 52 * 10 + 10)
    assert models.count_params({"params": shapes}) == by_hand == 585252


CASES = {  # name -> (model, input shape); each puts the first grouped layer elsewhere
    "mlp": (lambda: models.build("mlp", 6, hidden=[12, 12, 12],
                                 grouped={"groups": 3, "depth": 3,
                                          "class_groups": (2, 0, 1, 0, 1, 2)}), (4, 4, 1)),
    "vgg9_conv_first": (lambda: models.build("vgg9", 6, width=0.125,
                                             grouped={"groups": 3, "depth": 5}), (8, 8, 1)),
    "vgg9_fc_first": (lambda: models.build("vgg9", 6, width=0.125, pan={"amplitude": 0.1},
                                           grouped={"groups": 2, "depth": 3}), (8, 8, 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_isolation(case):
    """The loss on class c's logit moves only the shared layers and class c's group."""
    build, shape = CASES[case]
    model = build()
    variables = models.init(model, jax.random.PRNGKey(1), shape)
    x = jax.random.normal(jax.random.PRNGKey(2), (5, *shape))
    owners = models.group_owners(model, variables)
    assert owners, "no grouped leaves"
    cmap = model.grouped.class_map(model.num_classes)
    # d (sum over the batch of each logit) / d params: a leading class axis on every leaf.
    jac = jax.jit(jax.jacrev(lambda p: jnp.sum(model.apply({"params": p}, x), axis=0)))
    per_class = {tuple(k.key for k in path): np.asarray(v) for path, v in
                 jax.tree_util.tree_flatten_with_path({"params": jac(variables["params"])})[0]}
    for c in range(model.num_classes):
        own = 0.0
        for path, (axis, owner) in owners.items():
            g = np.moveaxis(per_class[path][c], axis, 0)
            other = g[owner != cmap[c]]
            assert np.all(other == 0.0), (case, c, path)
            own += float(np.abs(g[owner == cmap[c]]).sum())
        assert own > 0.0, (case, c)


def test_pans_combine_with_groups_and_a_zero_amplitude_is_the_plain_model():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4, 1))
    plain = models.build("mlp", 6, hidden=[12, 12], grouped={"groups": 3, "depth": 2})
    variables = models.init(plain, jax.random.PRNGKey(0), (4, 4, 1))
    off = models.build("mlp", 6, hidden=[12, 12], grouped={"groups": 3, "depth": 2},
                       pan={"kind": "mul", "amplitude": 0.0})
    on = models.build("mlp", 6, hidden=[12, 12], grouped={"groups": 3, "depth": 2},
                      pan={"kind": "mul", "amplitude": 0.5})
    base = np.asarray(plain.apply(variables, x))
    assert np.array_equal(np.asarray(off.apply(variables, x)), base)
    assert not np.allclose(np.asarray(on.apply(variables, x)), base)


def test_grouped_mlp_forward_by_hand():
    """A numpy forward pass with the groups spelled out as slices."""
    model = models.build("mlp", 4, hidden=[6, 4], grouped={"groups": 2, "depth": 2})
    variables = models.init(model, jax.random.PRNGKey(3), (2, 2, 1))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables["params"])
    p = {k: dict(v) for k, v in p.items()}
    p["head"]["kernel"] = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (2, 2, 4)))
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (3, 2, 2, 1)), np.float64)
    h = np.maximum(x.reshape(3, -1) @ p["fc1"]["kernel"] + p["fc1"]["bias"], 0)  # shared
    h2 = np.concatenate([np.maximum(h @ p["fc2"]["kernel"][:, 2 * g:2 * g + 2]
                                    + p["fc2"]["bias"][2 * g:2 * g + 2], 0)
                         for g in range(2)], axis=1)  # first grouped: outputs in 2 blocks
    logits = np.zeros((3, 4))
    for c in range(4):  # classes 0,1 -> group 0; 2,3 -> group 1
        g = c // 2
        logits[:, c] = h2[:, 2 * g:2 * g + 2] @ p["head"]["kernel"][g, :, c] + p["head"]["bias"][c]
    got = model.apply({"params": jax.tree_util.tree_map(jnp.asarray, p)}, x.astype(np.float32))
    np.testing.assert_allclose(np.asarray(got), logits, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Grouped conv implementations: one parameter layout, the same numbers and gradients.
# ----------------------------------------------------------------------------------------

def _random_like(tree, seed: int):
    """numpy normals shaped like a tree of shapes (no PRNG programs to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(scale=0.3, size=s.shape), jnp.float32), tree)


@pytest.mark.parametrize("groups,kernel,stride", [(g, k, s) for g in (2, 4) for k in (3, 1)
                                                  for s in (1, 2)])
def test_conv_impls_agree_on_outputs_and_gradients(groups, kernel, stride):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 6, 6, 3 * groups)), jnp.float32)
    convs = {impl: grouped_lib.GroupedConv(2 * groups, groups, kernel, stride, impl)
             for impl in grouped_lib.CONV_IMPLS}
    shapes = jax.eval_shape(convs["feature_group_count"].init, jax.random.PRNGKey(1), x)
    for c in convs.values():  # one parameter layout, whatever computes the conv
        assert jax.eval_shape(c.init, jax.random.PRNGKey(1), x) == shapes
    assert shapes["params"]["kernel"].shape == (kernel, kernel, 3, 2 * groups)
    # A non-zero bias and a random cotangent, so every output channel's gradient counts.
    variables = _random_like(shapes, 1)
    cot = jnp.asarray(rng.normal(size=(3, 6 // stride, 6 // stride, 2 * groups)), jnp.float32)

    @jax.jit
    def run_all(variables, x, cot):  # one compilation for every implementation
        out = {}
        for impl, conv in convs.items():
            y, vjp = jax.vjp(conv.apply, variables, x)
            out[impl] = (y, vjp(cot))
        return out
    results = run_all(variables, x, cot)
    want_y, (want_v, want_x) = results["feature_group_count"]
    for impl, (y, (dv, dx)) in results.items():
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5, err_msg=impl)
        np.testing.assert_allclose(dx, want_x, rtol=1e-5, atol=1e-5, err_msg=impl)
        for name in ("kernel", "bias"):
            np.testing.assert_allclose(dv["params"][name], want_v["params"][name], rtol=1e-5,
                                       atol=1e-5, err_msg=f"{impl} {name}")


def test_block_diagonal_kernel_is_zero_off_the_blocks_and_passes_no_gradient_there():
    kernel = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, 2, 6)), jnp.float32)
    full, vjp = jax.vjp(lambda k: grouped_lib.block_diagonal_kernel(k, 3), kernel)  # G=3
    assert full.shape == (3, 3, 6, 6)
    full, kernel = np.asarray(full), np.asarray(kernel)
    for gi in range(3):
        for go in range(3):
            block = full[:, :, 2 * gi:2 * gi + 2, 2 * go:2 * go + 2]
            want = kernel[..., 2 * go:2 * go + 2] if gi == go else 0.0
            np.testing.assert_array_equal(block, np.broadcast_to(want, block.shape))
    # Each kernel entry sits in exactly one diagonal block: a cotangent of ones gives ones,
    # and one that is non-zero only off the blocks gives zeros.
    np.testing.assert_array_equal(vjp(jnp.ones(full.shape))[0], np.ones(kernel.shape))
    off = 1.0 - np.kron(np.eye(3), np.ones((2, 2)))
    np.testing.assert_array_equal(vjp(jnp.broadcast_to(off, full.shape))[0], 0.0)


def test_auto_picks_per_backend_and_shape():
    pick = grouped_lib.pick_conv_impl
    assert pick(10, 260, "cpu") == pick(2, 260, "cpu") == pick(16, 64, "cpu") == "split"
    # Few channels per group (depthwise included), or very many groups.
    assert pick(32, 64, "cpu") == pick(256, 256, "cpu") == "block_diagonal"
    assert pick(128, 1024, "cpu") == "block_diagonal"
    assert pick(1, 260, "cpu") == pick(10, 260, "gpu") == "feature_group_count"
    assert GroupedConfig().conv_impl == "auto"
    with pytest.raises(ValueError, match="unknown grouped conv_impl"):
        GroupedConfig(conv_impl="im2col")


def test_grouped_vgg9_logits_do_not_depend_on_conv_impl():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 1)), jnp.float32)
    build = lambda impl: models.build("vgg9", 6, width=0.125, grouped={  # noqa: E731
        "groups": 2, "depth": 5, "conv_impl": impl})
    variables = _random_like(jax.eval_shape(build("feature_group_count").init,
                                            jax.random.PRNGKey(1), x), 1)
    # conv6 is a 2-group conv of 32 channels (16 in per group).
    assert variables["params"]["conv6"]["kernel"].shape == (3, 3, 16, 32)
    logits = jax.jit(lambda v: {impl: build(impl).apply(v, x)  # one compilation for all
                                for impl in grouped_lib.CONV_IMPLS})(variables)
    assert np.abs(logits["feature_group_count"]).max() > 1e-2  # not vacuous
    for impl, got in logits.items():
        np.testing.assert_allclose(got, logits["feature_group_count"], rtol=1e-5, atol=1e-5,
                                   err_msg=impl)
