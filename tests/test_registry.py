"""Every algorithm a config can name builds; every personalised one (per-client state or
a personal model) gives the same numbers under the loop, vmap and sharded executors as under the
slow sequential reference, and evaluates the same personal models either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PFL_LR, PFL_WORK, max_rel_err, pfl_setup, strategies_agree
from fedjax_pan.algorithms import registry
from fedjax_pan.config.defaults import default_config

# FedMA, Siren and FLChain run only as their drivers (no compiled round to build).
DRIVER_ONLY = {"fedma", "siren", "flchain"}
# Every algorithm with a model per client (the registry's `personal`), Per-FedAvg's
# Hessian-free variant too; then those scored on a global model.
PERSONALISED = [name for name, entry in registry.ALGORITHMS.items()
                if entry.personal] + ["perfedavg_hf"]
GLOBAL_MODEL = [name for name, entry in registry.ALGORITHMS.items()
                if not entry.personal and name not in DRIVER_ONLY]
PUBLIC = jnp.asarray(np.random.default_rng(0).normal(size=(12, 6, 6, 1)), jnp.float32)


def _build(name, model):
    cfg = default_config()
    cfg.algorithm = name.replace("_hf", "")
    cfg.perfedavg.hessian_free = name.endswith("_hf")
    cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.warmup = PFL_LR, 0.9, "none"
    cfg.local.epochs, cfg.local.batch_size = PFL_WORK.epochs, PFL_WORK.batch_size
    cfg.fedrep.head_epochs = cfg.ktpfl.distill_epochs = 0.5
    cfg.fedgen.server_epochs, cfg.fedgen.noise_dim, cfg.fedgen.hidden = 5, 8, 16
    cfg.partition.num_clients = 6
    return registry.from_config(model, cfg, public=PUBLIC, input_shape=(6, 6, 1))


# MOON in a vmap block of two or more of these unequal clients ends 4e-4 away from the
# reference (a block of one agrees to 1e-6): not yet explained.
_UNEQUAL_BLOCKS = pytest.mark.xfail(strict=True, reason="MOON differs in vmap blocks")


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=_UNEQUAL_BLOCKS) if name == "moon"
                                  else name for name in PERSONALISED + GLOBAL_MODEL])
def test_personalised_algorithms_loop_vmap_and_reference_agree(name):
    cd, model, variables, _ = pfl_setup(norm="batch" if name == "fedbn" else "none")
    if name == "fed2":
        model, variables = _grouped()
    algo = _build(name, model)
    # Servers, client states and the personal models evaluated all agree.
    sim, loop, ref = strategies_agree(algo, cd, variables,
                                      strategies=("loop", "vmap", "sharded"))[:3]
    mine = sim.personal_evaluation(loop[-1])
    if name in GLOBAL_MODEL:
        assert mine is None
    else:
        assert mine is not None, "a personalised algorithm evaluates personal models"
    # Something trained: the global model or the clients' own state moved.
    moved = max(max_rel_err(sim.evaluation(ref.server)[1]["params"], variables["params"]),
                max_rel_err(jax.tree_util.tree_leaves(ref.client_states),
                            jax.tree_util.tree_leaves(sim.init(variables).client_states))
                if ref.client_states is not None else 0.0)
    assert moved > 1e-3


def _grouped():
    """Fed2's grouped model and its initial variables."""
    from fedjax_pan import models
    model = models.build("mlp", 10, hidden=[20, 20], grouped={"groups": 2, "depth": 2})
    return model, models.init(model, jax.random.PRNGKey(0), (6, 6, 1))


@pytest.mark.parametrize("name", sorted(set(registry.ALGORITHMS) - DRIVER_ONLY))
def test_every_algorithm_builds_from_the_default_config(name):
    cd, model, variables, _ = pfl_setup()
    cfg = default_config()
    cfg.algorithm = name
    if name == "fed2":
        model, variables = _grouped()
    if registry.ALGORITHMS[name].public:
        with pytest.raises(ValueError, match="dataset.public_size > 0"):
            registry.from_config(model, cfg)
    algo = registry.from_config(model, cfg, public=PUBLIC, input_shape=(6, 6, 1))
    server = algo.server_init(variables)
    algo.client_state_init(server)
    assert set(algo.eval_variables(server)) >= {"params"}
    # The registry says which algorithms the config check holds to partition.test_fraction
    # > 0: exactly those that define a model per client.
    personal = algo.personal_variables is not None or algo.personal_adapt is not None
    assert registry.ALGORITHMS[name].personal == personal


def test_public_data_is_held_out_by_default_only_where_an_algorithm_distils():
    cfg = default_config()
    assert registry.public_size(cfg, 60000) == 0
    cfg.algorithm = "ktpfl"
    assert registry.public_size(cfg, 60000) == 1000
    assert registry.public_size(cfg, 1000) == 200  # at most a fifth of the training set
    cfg.dataset.public_size = 50
    assert registry.public_size(cfg, 60000) == 50
