"""MobileNetV1: parameter count by hand, a depthwise-separable block against numpy loops,
PANs off bit-for-bit, Fed2 gradient isolation and group owners, one Fed2 round."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_pan import data, models
from fedjax_pan.algorithms import fed2
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.models import layers
from fedjax_pan.pan import PANConfig

SHAPE = (8, 8, 3)  # four stride-2 blocks: 8 -> 4 -> 2 -> 1 -> 1
WIDTH = 0.125  # stem 4, blocks 8, 16, 16, 32, 32, 64 x 6, 128, 128
PAN_MUL = PANConfig("mul", 1.0, 0.3)


def _x(n=3, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, *SHAPE)), jnp.float32)


def _variables(model, seed=0):
    """Random variables (He-scaled kernels, random norm affines and running statistics, so
    norms do real work in eval mode); shapes from eval_shape, as models.init compiles slowly
    on CPU."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, *SHAPE))))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        scope, leaf = path[-2].key, path[-1].key
        if leaf == "kernel":
            fan_in = int(np.prod(s.shape[:-1]))
            x = rng.normal(size=s.shape) * np.sqrt(2.0 / fan_in)
        elif leaf in ("scale", "var"):
            x = rng.uniform(0.5, 1.5, s.shape)
        else:  # biases, norm shifts, running means
            x = rng.normal(size=s.shape) * (0.3 if scope.endswith("_norm") else 0.1)
        return jnp.asarray(x, jnp.float32)
    return jax.tree_util.tree_map_with_path(
        fill, {k: v for k, v in shapes.items() if k in ("params", "batch_stats")})


def test_parameter_count_by_hand():
    model = models.build("mobilenet", 10)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))
    w = [32, 64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024]
    # Stem conv 3x3x3x32 + BN; per block a 3x3 depthwise kernel + BN and a 1x1 pointwise
    # kernel + BN (no conv biases); head 1024x10 + 10. In all 3,217,226.
    by_hand = (27 * 32 + 2 * 32 + sum(9 * a + 2 * a + a * b + 2 * b for a, b in zip(w, w[1:]))
               + 1024 * 10 + 10)
    assert models.count_params(shapes) == by_hand == 3_217_226
    assert shapes["params"]["block2_dw"]["kernel"].shape == (3, 3, 1, 64)
    assert shapes["params"]["block2_pw"]["kernel"].shape == (1, 1, 64, 128)


@pytest.fixture(scope="module")
def pan_model():
    """(model with PANx, randomised variables, x, logits, intermediates), jitted once."""
    model = models.build("mobilenet", 10, pan=PAN_MUL, width=WIDTH)
    variables = _variables(model)
    x = _x()
    logits, inter = jax.jit(lambda v, x: models.apply_with_intermediates(model, v, x))(
        variables, x)
    return model, variables, x, np.asarray(logits), jax.tree_util.tree_map(np.asarray, inter)


def _bn(z, p, s):
    return (z - s["mean"]) / np.sqrt(s["var"] + layers.NORM_EPS) * p["scale"] + p["bias"]


def _depthwise(x, k, stride):
    """Per-channel 3x3 cross-correlation, zero padding 1, by explicit loops over taps."""
    b, h, w, c = x.shape
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    out = np.zeros((b, ho, wo, c))
    for i in range(ho):
        for j in range(wo):
            for di in range(3):
                for dj in range(3):
                    out[:, i, j, :] += xp[:, stride * i + di, stride * j + dj, :] * k[di, dj, 0, :]
    return out


@pytest.mark.parametrize("block,stride", [(1, 1), (2, 2)])
def test_depthwise_separable_block_by_hand(pan_model, block, stride):
    """dw conv + BN + ReLU (no PAN), then 1x1 conv + BN + PANx + ReLU, from the block input."""
    _, variables, _, _, inter = pan_model
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables["params"])
    s = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables["batch_stats"])
    x = np.asarray(inter["stem" if block == 1 else f"block{block - 1}_pw"], np.float64)
    dw, pw = f"block{block}_dw", f"block{block}_pw"
    h = np.maximum(_bn(_depthwise(x, p[dw]["kernel"], stride), p[dw + "_norm"],
                       s[dw + "_norm"]), 0)
    np.testing.assert_allclose(inter[dw], h, rtol=1e-4, atol=1e-5)
    z = _bn(np.einsum("bhwi,io->bhwo", h, p[pw]["kernel"][0, 0]), p[pw + "_norm"],
            s[pw + "_norm"])
    j = np.arange(z.shape[-1])
    out = np.maximum(z * (1 + 0.3 * np.sin(2 * np.pi * j / z.shape[-1])), 0)
    np.testing.assert_allclose(inter[pw], out, rtol=1e-4, atol=1e-5)
    assert inter[pw].shape == (3, 8 // stride, 8 // stride, 16 if block == 2 else 8)


def test_pans_off_is_bit_for_bit_the_plain_model(pan_model):
    _, variables, x, pan_logits, inter = pan_model
    outs = {}
    for key, pan in [("plain", None), ("off", PANConfig("mul", 1.0, 0.0))]:
        model = models.build("mobilenet", 10, pan=pan, width=WIDTH)
        outs[key] = np.asarray(jax.jit(model.apply)(variables, x))
    np.testing.assert_array_equal(outs["off"], outs["plain"])
    assert not np.allclose(pan_logits, outs["plain"])
    # The sown features are exactly the head's input.
    head = variables["params"]["head"]
    np.testing.assert_allclose(inter["features"] @ head["kernel"] + head["bias"], pan_logits,
                               rtol=1e-5, atol=1e-6)


GROUPED = {"groups": 3, "depth": 6, "class_groups": (2, 0, 1, 0, 1, 2)}


def test_grouped_shapes_owners_and_gradient_isolation():
    """The loss on class c's logit moves only the shared layers and class c's group."""
    model = models.build("mobilenet", 6, width=WIDTH, pan=PAN_MUL, grouped=GROUPED)
    variables = _variables(model, seed=1)
    params = variables["params"]
    # Depth 6 = blocks 9..13 + head. Block 9's depthwise conv reads the shared 64 channels;
    # its pointwise conv sees them all and emits 66 (64 rounded up to G = 3); from block 10
    # on, depthwise convs act within groups and pointwise convs see 22 (then 43) channels.
    assert params["block9_dw"]["kernel"].shape == (3, 3, 1, 64)
    assert params["block9_pw"]["kernel"].shape == (1, 1, 64, 66)
    assert params["block10_dw"]["kernel"].shape == (3, 3, 1, 66)
    assert params["block10_pw"]["kernel"].shape == (1, 1, 22, 66)
    assert params["block12_pw"]["kernel"].shape == (1, 1, 22, 129)
    assert params["block13_pw"]["kernel"].shape == (1, 1, 43, 129)
    assert params["head"]["kernel"].shape == (3, 43, 6)
    owners = models.group_owners(model, variables)
    expected = ({("params", "block9_pw", "kernel"), ("params", "block9_pw", "bias"),
                 ("params", "block9_pw_norm", "scale"), ("params", "block9_pw_norm", "bias"),
                 ("params", "head", "kernel"), ("params", "head", "bias")}
                | {("params", f"block{i}_{part}", leaf) for i in range(10, 14)
                   for part, leaf in [("dw", "kernel"), ("dw_norm", "scale"),
                                      ("dw_norm", "bias"), ("pw", "kernel"), ("pw", "bias"),
                                      ("pw_norm", "scale"), ("pw_norm", "bias")]})
    assert set(owners) == expected
    axis, owner = owners[("params", "block10_dw", "kernel")]
    assert axis == 3 and owner.tolist() == [g for g in range(3) for _ in range(22)]
    axis, owner = owners[("params", "head", "bias")]
    assert axis == 0 and owner.tolist() == list(GROUPED["class_groups"])

    cmap = model.grouped.class_map(6)
    x = _x(n=5, seed=2)
    stats = variables["batch_stats"]

    # d (sum over the batch of each logit) / d params: a leading class axis on every leaf.
    # Compiled without LLVM's optimisations (half the compile time here): exact zeros stay
    # exact, since they come from the structure (masked or unconnected), not from rounding.
    jac = jax.jit(jax.jacrev(lambda p: jnp.sum(
        model.apply({"params": p, "batch_stats": stats}, x), axis=0))).lower(params).compile(
            {"xla_backend_optimization_level": 0})(params)
    per_class = {tuple(k.key for k in path): np.asarray(v) for path, v in
                 jax.tree_util.tree_flatten_with_path({"params": jac})[0]}
    for c in range(6):
        own = 0.0
        for path, (axis, owner) in owners.items():
            g = np.moveaxis(per_class[path][c], axis, 0)
            assert np.all(g[owner != cmap[c]] == 0.0), (c, path)
            own += float(np.abs(g[owner == cmap[c]]).sum())
        assert own > 0.0, c
        # The first grouped block's depthwise conv is shared: every class moves it.
        assert np.abs(per_class[("params", "block9_dw", "kernel")][c]).sum() > 0.0


def test_fed2_round_on_grouped_mobilenet():
    """One Fed2 round: finite loss; the group of classes nobody holds is left as it was.

    Depth 3 (blocks 12, 13 and the head) has every kind of grouped leaf at a lower compile
    cost than the paper's depth 6, which the isolation test covers."""
    model = models.build("mobilenet", 10, width=WIDTH, grouped={"groups": 5, "depth": 3})
    variables = _variables(model, seed=2)
    ds = data.synthetic(200, 10, image_shape=SHAPE, seed=3)
    # Classes 8 and 9 (group 4) are held by no client.
    # 8 examples each: one step of batch 8, so a single step program compiles.
    parts = [np.flatnonzero(np.isin(ds.train_labels, cls))[:8]
             for cls in [(0, 1, 2), (3, 4, 5), (6, 7, 0)]]
    cd = ClientData.create(ds.train_images, ds.train_labels, parts, 10)
    work = LocalWork(batch_size=8, epochs=1.0)
    algo = fed2(model, optax.sgd(0.05))
    sim = Simulation(algo, cd, work, make_executor("loop", algo, work, cd, variables, 3),
                     participation=1.0, seed=0)
    state, stats = sim.round(sim.init(variables))
    assert np.isfinite(stats["train_loss"]) and stats["train_loss"] > 0
    new = state.server.params
    for path, (axis, owner) in models.group_owners(model, variables).items():
        old = np.moveaxis(np.asarray(variables["params"][path[1]][path[2]]), axis, 0)
        got = np.moveaxis(np.asarray(new[path[1]][path[2]]), axis, 0)
        np.testing.assert_array_equal(got[owner == 4], old[owner == 4])
    assert not np.array_equal(np.asarray(new["stem"]["kernel"]),
                              np.asarray(variables["params"]["stem"]["kernel"]))
