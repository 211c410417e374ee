"""How a feature wraps an algorithm (optax style): the wrapper's state holds the
algorithm's own in a field `inner`, and these helpers give the algorithm as seen through
that state, so a wrapper names only the fields it changes.

    nested = nest_local(nest_server(algorithm, lambda server: server.inner))
    return nested._replace(server_init=..., server_update=..., client_init=...)

`nest_server`, `nest_client` and `nest_local` leave the functions that make the nested
state (`server_init`, `server_update`; `client_state_init`, `client_output`; `client_init`)
making the algorithm's: the wrapper replaces them with its own, built on the nested ones.
`map_sent_model` / `map_sent_update` change what a client's output stands for (through the
algorithm's `model_view`), as attacks, compression and DP-FedAvg do.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from fedjax_pan.algorithms.core import FederatedAlgorithm
from fedjax_pan.engine.protocol import ModelView, PyTree, output_update, with_output_update


def _project_view(view: Optional[ModelView], project: Callable[[PyTree], PyTree]
                  ) -> Optional[ModelView]:
    if view is None:
        return None
    return ModelView(
        lambda server, output: view.to_model(project(server), output),
        lambda server, variables: view.to_output(project(server), variables),
        None if view.update is None else (
            lambda server, output: view.update(project(server), output)),
        None if view.with_update is None else (
            lambda server, output, update: view.with_update(project(server), output, update)))


def nest_server(algorithm: FederatedAlgorithm, project: Callable[[PyTree], PyTree]
                ) -> FederatedAlgorithm:
    """`algorithm` whose every function reading a server state reads `project(server)`
    instead (clients, evaluation, personal models, download bytes, the model view): for a
    wrapper whose server state holds the algorithm's. `server_init` and `server_update`
    still make the algorithm's state: the wrapper replaces both."""
    a = algorithm
    return a._replace(
        client_state_init=lambda server: a.client_state_init(project(server)),
        client_init=lambda server, cs, ctx: a.client_init(project(server), cs, ctx),
        client_step=lambda local, batch, server: a.client_step(local, batch, project(server)),
        client_output=lambda local, server: a.client_output(local, project(server)),
        server_update=lambda server, aggregate, info: a.server_update(project(server),
                                                                      aggregate, info),
        eval_variables=lambda server: a.eval_variables(project(server)),
        personal_variables=None if a.personal_variables is None else (
            lambda server, cs: a.personal_variables(project(server), cs)),
        personal_adapt=None if a.personal_adapt is None else (
            lambda server, cs, batch: a.personal_adapt(project(server), cs, batch)),
        download_bytes=None if a.download_bytes is None else (
            lambda server, ids, r: a.download_bytes(project(server), ids, r)),
        model_view=_project_view(a.model_view, project))


def nest_client(algorithm: FederatedAlgorithm, project: Callable[[PyTree], PyTree]
                ) -> FederatedAlgorithm:
    """`algorithm` whose every function reading a client state reads `project(state)`
    instead (`client_init`, personal models): for a wrapper whose client state holds the
    algorithm's. `client_state_init` and `client_output` still make the algorithm's: the
    wrapper replaces both."""
    a = algorithm
    return a._replace(
        client_init=lambda server, cs, ctx: a.client_init(server, project(cs), ctx),
        personal_variables=None if a.personal_variables is None else (
            lambda server, cs: a.personal_variables(server, project(cs))),
        personal_adapt=None if a.personal_adapt is None else (
            lambda server, cs, batch: a.personal_adapt(server, project(cs), batch)))


def nest_local(algorithm: FederatedAlgorithm) -> FederatedAlgorithm:
    """`algorithm` over a wrapper's local state (a NamedTuple whose field `inner` holds
    the algorithm's): `client_step` steps `local.inner` and returns `local` with it
    replaced, `client_output` and `upload_bytes` read `local.inner`. `client_init` still
    makes the algorithm's local state: the wrapper replaces it."""
    a = algorithm

    def client_step(local, batch, server):
        inner, metrics = a.client_step(local.inner, batch, server)
        return local._replace(inner=inner), metrics

    return a._replace(
        client_step=client_step,
        client_output=lambda local, server: a.client_output(local.inner, server),
        upload_bytes=None if a.upload_bytes is None else (
            lambda output, local: a.upload_bytes(output, local.inner)))


def map_sent_model(algorithm: FederatedAlgorithm, server: PyTree, output: PyTree,
                   fn: Callable[[PyTree, PyTree], Tuple[PyTree, Any]]) -> Tuple[PyTree, Any]:
    """(`output` standing for its model with parameters `fn(params, broadcast)[0]`, its
    other state unchanged; `fn`'s second value), where `broadcast` is the parameters of
    `server`'s model (`eval_variables`)."""
    view = algorithm.model_view
    broadcast = algorithm.eval_variables(server)["params"]
    model = view.to_model(server, output)
    params, aux = fn(model["params"], broadcast)
    return view.to_output(server, {**model, "params": params}), aux


def map_sent_update(algorithm: FederatedAlgorithm, server: PyTree, output: PyTree,
                    fn: Callable[[PyTree, PyTree], Tuple[PyTree, Any]]
                    ) -> Tuple[PyTree, Any]:
    """(`output` standing for the parameter update `fn(update, broadcast)[0]` instead of
    its own `update` (`engine.protocol.output_update`); `fn`'s second value), where
    `broadcast` is the parameters of `server`'s model."""
    view = algorithm.model_view
    broadcast = algorithm.eval_variables(server)["params"]
    update, aux = fn(output_update(view, server, output, broadcast), broadcast)
    return with_output_update(view, server, output, update, broadcast), aux


__all__ = ["nest_server", "nest_client", "nest_local", "map_sent_model", "map_sent_update"]
