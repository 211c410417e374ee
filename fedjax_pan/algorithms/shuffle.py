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

from fedjax_pan import permutation as perm_lib
from fedjax_pan.algorithms.core import FederatedAlgorithm

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
        inner, metrics = algorithm.client_step(inner, batch, server)
        metrics = {**metrics, "shuffles": do.astype(jnp.float32)}
        return ShuffledLocal(inner, rng, local.prob, product), metrics

    def client_output(local, server):
        return algorithm.client_output(local.inner, server)

    return algorithm._replace(client_init=client_init, client_step=client_step,
                              client_output=client_output)
