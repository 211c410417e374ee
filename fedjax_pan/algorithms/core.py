"""The federated-algorithm interface: a few pure functions over pytrees.

Every function takes its state first, then its inputs, and returns the new state first:

    server_init(variables)                       -> server_state
    client_state_init(server_state)              -> client_state   (None: stateless)
    client_init(server_state, client_state, ctx) -> local_state
    client_step(local_state, batch)              -> (local_state, step_metrics)
    client_output(local_state, server_state)     -> (output, client_state)
    server_update(server_state, mean_output)     -> server_state
    eval_variables(server_state)                 -> model variables to evaluate

`ctx` is a `ClientContext` (the client's key, its number of local steps this round and its
number of examples). `batch` is {'x': (B, H, W, C) float32, 'y': (B,) int32, 'mask': (B,)
float32}; padded
examples have mask 0. `step_metrics` are sums over the batch ({'loss_sum', 'num_examples'})
so the engine can add them up. The engine averages client outputs (uniformly or by
example count) and owns sampling, execution, evaluation and checkpoints; an algorithm
never sees how its clients are executed.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

PyTree = Any


class ClientContext(NamedTuple):
    """What a client knows about its own round (scalars, or vectors when vmapped)."""

    rng: Any
    num_steps: Any
    num_examples: Any


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring for signatures)."""

    server_init: Callable[[PyTree], PyTree]
    client_state_init: Callable[[PyTree], PyTree]
    client_init: Callable[[PyTree, PyTree, Any], PyTree]
    client_step: Callable[[PyTree, PyTree], tuple]
    client_output: Callable[[PyTree, PyTree], tuple]
    server_update: Callable[[PyTree, PyTree], PyTree]
    eval_variables: Callable[[PyTree], PyTree]


def no_client_state(server_state: PyTree) -> None:
    """`client_state_init` of algorithms that keep nothing per client."""
    del server_state
    return None
