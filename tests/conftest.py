"""Small shared builders for engine tests (tiny models on synthetic data)."""

import os
import sys
import tempfile
from typing import Any, NamedTuple

# Compile time, not run time, dominates this suite on CPU. Tests therefore compile with
# LLVM's optimisation off and XLA's older elemental emitters in place of its fusion
# emitters (2-3x faster to compile a small network; every comparison is between
# computations compiled alike), and every process of a run, xdist workers and the
# subprocesses tests start, shares one persistent compilation cache, so a program compiled
# by one test is loaded by the next. All are set before JAX starts and yield to values
# already in the environment.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"fedjax_pan_test_jax_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# Two xdist processes share the two cores already: lone clients run one at a time here
# (two side by side made the suite ~30% slower); tests of the side-by-side path ask for it.
os.environ.setdefault("FEDJAX_PAN_WORKERS", "1")

import signal  # noqa: E402

# A shell without job control starts background commands with SIGINT ignored, and Python
# then never raises KeyboardInterrupt, nor do the subprocesses tests start (an ignored
# signal stays ignored across exec). The tests of Ctrl-C need it delivered.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fedjax_pan import data, models
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.engine import ClientData, LocalWork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FMNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
needs_fmnist = pytest.mark.skipif(
    not os.path.exists(os.environ.get("FEDJAX_PAN_FASHION_MNIST_DIR", "/nonexistent")) and
    not os.path.exists(FMNIST), reason="Fashion-MNIST IDX files not installed")


def tiny_clients(sizes, image_shape=(6, 6, 1), seed=0):
    """ClientData with clients of exactly `sizes` examples of a synthetic dataset."""
    ds = data.synthetic(int(sum(sizes)), 50, image_shape=image_shape, seed=seed)
    perm = np.random.default_rng(seed).permutation(ds.num_train)
    parts = np.split(perm, np.cumsum(sizes)[:-1])
    return ds, ClientData.create(ds.train_images, ds.train_labels, [np.sort(p) for p in parts])


def tiny_fedavg(norm="none", pan=None, image_shape=(6, 6, 1), warmup="steps", bn="mean",
                server_tx=None, hidden=(24, 16)):
    model = models.build("mlp", 10, hidden=list(hidden), norm=norm, pan=pan)
    variables = models.init(model, jax.random.PRNGKey(0), image_shape)
    kwargs = {} if server_tx is None else {"server_tx": server_tx}
    algo = fedavg(model, client_optimizer(0.05, 0.9, 1e-5, 100.0, warmup, 3), bn=bn,
                  **kwargs)
    return model, variables, algo


def random_variables(model, input_shape, seed, bias_scale=0.1):
    """He-scaled numpy parameters; shapes from eval_shape (models.init compiles slowly on CPU)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, *input_shape)), train=False))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        if path[-1].key == "kernel":
            fan_in = int(np.prod(s.shape[:-1]))
            return (rng.normal(size=s.shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        return (rng.normal(size=s.shape) * bias_scale).astype(np.float32)

    return {"params": jax.tree_util.tree_map_with_path(fill, shapes["params"])}


def random_init(model, input_shape, seed=0):
    """Every collection `models.init` gives (params, batch_stats), drawn in numpy: kernels
    He-scaled, norm scales near 1, running variances in [0.5, 1.5], the rest N(0, 0.1).
    Shapes from `eval_shape`: no program compiles (tests of a forward pass or of a
    permutation need distinct, well-scaled values, not the initialisers' own)."""
    shapes = jax.eval_shape(lambda: models.init(model, jax.random.PRNGKey(0), input_shape))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = path[-1].key
        if name == "kernel":
            fan_in = int(np.prod(s.shape[:-1]))
            x = rng.normal(size=s.shape) * np.sqrt(2.0 / fan_in)
        elif name == "var":
            x = rng.uniform(0.5, 1.5, size=s.shape)
        elif name == "scale":
            x = 1.0 + 0.1 * rng.normal(size=s.shape)
        else:
            x = 0.1 * rng.normal(size=s.shape)
        return jnp.asarray(x.astype(s.dtype))

    return jax.tree_util.tree_map_with_path(fill, shapes)


def max_rel_err(a, b, floor=1e-2):
    """Max over leaves of max|a - b| / max(max|b|, floor).

    The floor (parameters here are O(0.1-1)) covers leaves that are numerically zero, e.g.
    a bias in front of BatchNorm,
    whose gradient vanishes in exact arithmetic and holds only rounding noise.
    """
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) /
               max(float(np.max(np.abs(np.asarray(y, np.float64)))), floor)
               for x, y in zip(la, lb))


__all__ = ["ROOT", "needs_fmnist", "tiny_clients", "tiny_fedavg", "max_rel_err",
           "random_variables", "random_init", "LocalWork", "sys"]


# Personalised-FL tests: six unequal clients, a small MLP, 1.5 epochs of B = 8.
PFL_SIZES = [27, 39, 19, 36, 62, 13]
PFL_WORK = LocalWork(batch_size=8, epochs=1.5)
PFL_LR = 0.05


def pfl_setup(norm="none", warmup="none"):
    """(client data, model, variables, momentum-SGD client optimiser, its `warmup` over 3
    steps or rounds) for the pFL tests."""
    _, cd = tiny_clients(PFL_SIZES)
    model = models.build("mlp", 10, hidden=[24, 16], norm=norm)
    variables = models.init(model, jax.random.PRNGKey(0), (6, 6, 1))
    return cd, model, variables, client_optimizer(PFL_LR, 0.9, 0.0, None, warmup, 3)


def reference_rounds(sim, algo, cd, variables, batch_size, rounds=2):
    """`rounds` rounds of the sequential `reference_round` on `sim`'s cohorts, its
    per-client states scattered into all K by hand."""
    from fedjax_pan.engine.reference import reference_round
    state = sim.init(variables)
    for r in range(rounds):
        cohort = sim.cohort(state, r)
        server, new, _ = reference_round(algo, cd, batch_size, state.server, cohort)
        clients = jax.tree_util.tree_map(lambda a: np.array(a), state.client_states)
        for m, k in enumerate(np.asarray(cohort.ids)):
            for leaf_all, leaf_new in zip(jax.tree_util.tree_leaves(clients),
                                          jax.tree_util.tree_leaves(new[m])):
                leaf_all[k] = leaf_new
        state = state._replace(server=server, client_states=clients, round=r + 1)
    return state


def pfl_rounds(algo, cd, variables, strategy="vmap", rounds=2, on_host=False):
    """(simulation, [state after 0, 1, ..., rounds rounds], [each round's statistics]):
    half the clients a round. `on_host`: every state copied to the host as it comes (the
    engine donates the states it steps from)."""
    from fedjax_pan.engine import Simulation, make_executor
    ex = make_executor(strategy, algo, PFL_WORK, cd, variables, 3)
    sim = Simulation(algo, cd, PFL_WORK, ex, participation=0.5, aggregation="num_examples",
                     seed=7)
    keep = jax.device_get if on_host else (lambda state: state)
    state = sim.init(variables)
    states, stats = [keep(state)], []
    for _ in range(rounds):
        state, s = sim.round(state)
        states.append(keep(state))
        stats.append(s)
    return sim, states, stats


class Agreed(NamedTuple):
    sim: Any
    loop: list  # the loop executor's states, as `pfl_rounds` returns them
    ref: Any  # the sequential reference's last state
    loop_stats: list
    vmap_stats: list


def strategies_agree(algo, cd, variables, rounds=2, strategies=("loop", "vmap"),
                     states_tol=1e-5):
    """`rounds` of `pfl_rounds` under each of `strategies` against the sequential
    `reference_rounds`: asserts the server states agree to 1e-5, the client states to
    `states_tol` (0: exactly) and, where the algorithm has personal models, the models
    the strategies evaluate to 1e-5. Returns the first strategy's run and the reference
    (`Agreed`)."""
    runs = [pfl_rounds(algo, cd, variables, s, rounds) for s in strategies]
    sim = runs[0][0]
    ref = reference_rounds(sim, algo, cd, variables, PFL_WORK.batch_size, rounds)
    for _, states, _ in runs:
        assert max_rel_err(states[-1].server, ref.server) < 1e-5
        if ref.client_states is not None:
            err = max_rel_err(states[-1].client_states, ref.client_states)
            assert err == 0 if states_tol == 0 else err < states_tol
    first = sim.personal_evaluation(runs[0][1][-1])
    if first is not None:
        for _, states, _ in runs[1:]:
            assert max_rel_err(first, sim.personal_evaluation(states[-1])) < 1e-5
    return Agreed(sim, runs[0][1], ref, runs[0][2], runs[1][2])


def signal_on_call(monkeypatch, owner, name, sig, call, after=False):
    """`owner.name` sends `sig` to this process on its `call`-th call (counted from 1),
    before the call (or, with `after`, as it returns), then goes on as before: a
    scheduler's SIGTERM or a user's Ctrl-C at that moment."""
    import os
    original, calls = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == call and not after:
            os.kill(os.getpid(), sig)
        out = original(*args, **kwargs)
        if len(calls) == call and after:
            os.kill(os.getpid(), sig)
        return out
    monkeypatch.setattr(owner, name, wrapper)
