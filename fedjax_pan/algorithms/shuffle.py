"""The PAN paper's shuffle process during local training (Alg. 2), as an algorithm wrapper.

At each local step a client permutes its hidden neurons with probability N_sf / r_k
(r_k = its number of local steps this round, so N_sf shuffles are expected per round),
each permutation drawn by Alg. 1 with swap probability P_sf. The model (parameters and
BatchNorm statistics) is permuted; the optimiser state is not, as when a PyTorch model's
weights are permuted in place. Each round logs `train_shuffles`, the shuffles applied
over all its clients; with `track_product` the local state also keeps the product of the
permutations applied (for tests and analyses; a composition per shuffle).

Works for any algorithm whose local state has `params` and `model_state` fields.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_pan.pan import permutation as perm_lib
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms.core import Build, FeatureEntry, FederatedAlgorithm
from fedjax_pan.algorithms.wrapping import nest_local
from fedjax_pan.engine.protocol import placeholder_context
from fedjax_pan.rules import between

PyTree = Any


class ShuffledLocal(NamedTuple):
    inner: PyTree
    rng: jax.Array
    prob: jax.Array  # shuffle probability per step: N_sf / r_k
    product: Optional[Dict[str, jax.Array]]  # the permutations applied so far, composed


def with_shuffling(algorithm: FederatedAlgorithm, spec: perm_lib.PermutationSpec,
                   p_sf: float, n_sf: float, window: Optional[float] = None,
                   track_product: bool = False) -> FederatedAlgorithm:
    """`algorithm` with Alg. 2's random neuron shuffles during local training."""
    nested = nest_local(algorithm)

    def client_init(server, client_state, ctx):
        inner = algorithm.client_init(server, client_state, ctx)
        prob = n_sf / jnp.maximum(ctx.num_steps, 1).astype(jnp.float32)
        identity = {k: jnp.arange(n) for k, n in spec.sizes.items()} if track_product else None
        return ShuffledLocal(inner, jax.random.fold_in(ctx.rng, 0x5F), prob, identity)

    def shuffle(inner, product, key):
        perms = perm_lib.random_permutations_jax(spec, key, p_sf, window)
        variables = perm_lib.apply_permutation(spec, perms,
                                               {"params": inner.params, **inner.model_state})
        inner = inner._replace(params=variables["params"],
                               model_state={k: variables[k] for k in inner.model_state})
        return inner, (perm_lib.compose(product, perms) if track_product else product)

    def client_step(local, batch, server):
        rng, k_do, k_perm = jax.random.split(local.rng, 3)
        do = jax.random.uniform(k_do) <= local.prob
        # Alg. 1 is a sequential loop over each layer's neurons: drawn only on the steps
        # that shuffle (about N_sf of a round's r_k), not on every step.
        inner, product = jax.lax.cond(do, shuffle, lambda i, p, _: (i, p), local.inner,
                                      local.product, k_perm)
        local, metrics = nested.client_step(local._replace(inner=inner, rng=rng,
                                                           product=product), batch, server)
        return local, {**metrics, "shuffles": do.astype(jnp.float32)}

    return nested._replace(client_init=client_init, client_step=client_step)


def _check_shuffleable(algorithm: FederatedAlgorithm, variables: PyTree, num_classes: int,
                       name: str) -> None:
    # Alg. 2 permutes a local model in place: the local state must be one (params and
    # model_state); per-client extras (control variates, previous models) would also need
    # permuting, which no algorithm declares yet.
    ctx = placeholder_context(num_classes)
    server = jax.eval_shape(algorithm.server_init, variables)
    local = jax.eval_shape(lambda s: algorithm.client_init(
        s, algorithm.client_state_init(s), ctx), server)
    if not (hasattr(local, "params") and hasattr(local, "model_state")):
        raise ValueError(f"n_sf > 0 (Alg. 2) needs a local state that is a model; "
                         f"algorithm {name!r} keeps {type(local).__name__}: set "
                         f"shuffle.n_sf=0")


def _wrap(algorithm: FederatedAlgorithm, build: Build) -> FederatedAlgorithm:
    s = build.cfg.shuffle
    _check_shuffleable(algorithm, build.variables, build.num_classes, build.cfg.algorithm)
    spec = perm_lib.spec_for(build.model, build.variables)
    return with_shuffling(algorithm, spec, s.p_sf, s.n_sf, s.window)


FEATURE = FeatureEntry(
    "shuffle",
    options={"n_sf": 0.0, "p_sf": 0.1, "window": placeholder(float)},
    rules={"n_sf": between(0, 1000), "p_sf": between(0, 1),
           "window": between(0, 1, lo_open=True, optional=True)},
    off=(("n_sf", 0),), wrap=_wrap,
    summary="Alg. 2: shuffle hidden neurons during local training, n_sf times per round "
            "expected, each position swapped with probability p_sf (window: the released "
            "code's variant, swaps within floor(J window) positions of a layer of J)")
