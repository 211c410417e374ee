"""The round contract the engine runs: an algorithm as a few pure functions over pytrees,
and `Round`, what the engine's loop drives (a `Simulation`, or an algorithm's driver where
its round is not one compiled function: FedMA, KT-pFL over several networks).

Every function takes its state first, then its inputs, and returns the new state first:

    server_init(variables)                        -> server_state
    client_state_init(server_state)               -> client_state   (None: stateless)
    client_init(server_state, client_state, ctx)  -> local_state
    client_step(local_state, batch, server_state) -> (local_state, step_metrics)
    client_output(local_state, server_state)      -> (output, client_state)
    server_update(server_state, aggregate, info)  -> server_state
    eval_variables(server_state)                  -> model variables to evaluate
    personal_variables(server_state, client_state) -> the variables a client evaluates on
                                                     its own test data (optional; None:
                                                     the global model)
    personal_adapt(server_state, client_state, batch) -> the same, adapted on one batch of
                                                     the client's training data first
                                                     (optional; Per-FedAvg's one step)
    aggregator                                    how outputs become `aggregate`
    upload_bytes(output, local_state)             -> bytes sent (optional)

`ctx` is a `ClientContext`; `server_state` in `client_step` is the round's broadcast
(read-only: a client need not copy it into its local state). `batch` is
{'x': (B, H, W, C) float32, 'y': (B,) int32, 'mask': (B,) float32}; padded examples have
mask 0. `step_metrics` are sums over the batch: 'loss_sum' and 'num_examples', plus any the
algorithm reports; the engine adds them up over steps and clients and logs each
'<name>_sum' as `train_<name>` per example. The aggregate is, by default, the weighted mean
of the clients' outputs (`weighted_mean`); see `Aggregator` for the others. `info` is a
`RoundInfo`. The engine owns sampling, execution, evaluation and checkpoints; an algorithm
never sees how its clients are executed.
"""

from __future__ import annotations

from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple,
                    runtime_checkable)

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
tree_map = jax.tree_util.tree_map


class ClientContext(NamedTuple):
    """What a client knows about its own round (scalars, or vectors when vmapped)."""

    rng: Any  # this client's key for this round
    num_steps: Any  # local steps it takes
    num_examples: Any  # examples it holds
    client_id: Any  # its index in 0..K-1
    round: Any  # the round's index, from 0
    label_counts: Any  # (C,) float32 histogram of its labels


class RoundInfo(NamedTuple):
    """What the server update knows about the round it closes."""

    round: Any  # the round's index, from 0
    client_ids: Any  # (M,) int32, the sampled clients
    weights: Any  # (M,) float32 aggregation weights (summing to 1)
    num_clients: int  # K


class Aggregator(NamedTuple):
    """How the clients' outputs become the server update's `aggregate`.

    Streaming (`stacked=False`): the engine keeps only sum_k w_k * output_k and calls
    `finalize(output_sum, total_weight)`. Stacked: it keeps every client's output and calls
    `finalize(outputs, weights)` with a leading client axis (M, ...) and weights (M,)
    summing to 1 (memory: M copies of an output).
    """

    finalize: Callable[[PyTree, Any], PyTree]
    stacked: bool = False


def _mean(output_sum: PyTree, total_weight: Any) -> PyTree:
    return tree_map(lambda x: x / total_weight.astype(x.dtype), output_sum)


def _sum(output_sum: PyTree, total_weight: Any) -> PyTree:
    del total_weight
    return output_sum


# The default: sum_k w_k out_k / sum_k w_k, streamed (no client's output is kept).
weighted_mean = Aggregator(_mean)
# For per-leaf or per-group weights: clients send numerators and denominators, already
# weighted as they like, and the server update divides.
weighted_sum = Aggregator(_sum)


def median() -> Aggregator:
    """Coordinate-wise median over the round's clients (weights ignored; robust)."""
    return Aggregator(lambda outs, weights: tree_map(lambda x: jnp.median(x, axis=0), outs),
                      stacked=True)


def trimmed_mean(trim: float) -> Aggregator:
    """Coordinate-wise mean after dropping the floor(trim * M) largest and smallest values.

    Weights are ignored (Yin et al. 2018); trim in [0, 0.5).
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean needs trim in [0, 0.5), got {trim}")

    def finalize(outs, weights):
        def one(x):
            m = x.shape[0]
            cut = int(trim * m)
            kept = jnp.sort(x, axis=0)[cut:m - cut]
            return jnp.mean(kept, axis=0).astype(x.dtype)
        return tree_map(one, outs)
    return Aggregator(finalize, stacked=True)


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring for signatures)."""

    server_init: Callable[[PyTree], PyTree]
    client_state_init: Callable[[PyTree], PyTree]
    client_init: Callable[[PyTree, PyTree, Any], PyTree]
    client_step: Callable[[PyTree, PyTree, PyTree], tuple]
    client_output: Callable[[PyTree, PyTree], tuple]
    server_update: Callable[[PyTree, PyTree, RoundInfo], PyTree]
    eval_variables: Callable[[PyTree], PyTree]
    aggregator: Aggregator = weighted_mean
    # upload_bytes(output, local_state) -> bytes this client sends (None: its whole output;
    # e.g. Psi-Net's trimmed groups are not sent).
    upload_bytes: Optional[Callable[[PyTree, PyTree], Any]] = None
    # personal_variables(server_state, client_state) -> the model a client evaluates on its
    # own test part (None: the global model, `eval_variables`).
    personal_variables: Optional[Callable[[PyTree, PyTree], PyTree]] = None
    # personal_adapt(server_state, client_state, batch) -> that model when the client first
    # adapts it on one batch of its own training data (takes precedence; None: none).
    personal_adapt: Optional[Callable[[PyTree, PyTree, PyTree], PyTree]] = None


def tree_bytes(tree: PyTree) -> int:
    """Bytes of a pytree's leaves (arrays or shape-dtype structs): what sending it costs."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree_util.tree_leaves(tree)))


@runtime_checkable
class Round(Protocol):
    """What the engine's training loop drives, round after round (`Simulation` for a
    `FederatedAlgorithm`; a driver for server logic that is not one compiled round).

    `init(variables)` -> the first state (a `SimState`: server, client_states, round);
    `round(state)` -> (next state, the round's statistics: train_loss, real_examples,
    computed_examples, upload_bytes, optional download_bytes and train_* metrics);
    `evaluation(server)` -> (network, variables) the global model is scored with;
    `personal_evaluation(state)` -> each client's own variables stacked (K, ...), or None
    where clients are scored on the global model; `personal_groups(state)` -> for clients
    of several networks, [(network, client ids, stacked variables)] per network, else None.
    `num_sampled`: clients a round; `shapes_change`: checkpoints restore the saved shapes
    (a model that grows).
    """

    num_sampled: int
    shapes_change: bool

    def init(self, variables: PyTree) -> Any: ...

    def round(self, state: Any) -> Tuple[Any, Dict[str, Any]]: ...

    def evaluation(self, server: PyTree) -> Tuple[Any, PyTree]: ...

    def personal_evaluation(self, state: Any) -> Optional[PyTree]: ...

    def personal_groups(self, state: Any) -> Optional[List[Tuple[Any, np.ndarray, PyTree]]]: ...
