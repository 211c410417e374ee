"""The wrapping helpers, on a hand-built algorithm whose every function returns what it was
handed: nesting reroutes exactly the functions that read the nested state and forwards every
other field as it is; the sent model or update is changed through the view, by hand."""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedjax_pan.algorithms.core import Aggregator, FederatedAlgorithm
from fedjax_pan.algorithms.wrapping import (map_sent_model, map_sent_update, nest_client,
                                            nest_local, nest_server)
from fedjax_pan.engine.protocol import ModelView

AGGREGATOR = Aggregator(lambda total, weight: total, stacked=True)


def _echo(name):
    return lambda *args: (name, *args)


def _toy() -> FederatedAlgorithm:
    """Every function answers (its name, its arguments)."""
    def client_step(local, batch, server):
        return ("client_step", local, batch, server), {"loss_sum": 1.0}
    return FederatedAlgorithm(
        server_init=_echo("server_init"), client_state_init=_echo("client_state_init"),
        client_init=_echo("client_init"), client_step=client_step,
        client_output=_echo("client_output"), server_update=_echo("server_update"),
        eval_variables=_echo("eval_variables"), aggregator=AGGREGATOR,
        upload_bytes=_echo("upload_bytes"), personal_variables=_echo("personal_variables"),
        personal_adapt=_echo("personal_adapt"),
        model_view=ModelView(_echo("to_model"), _echo("to_output"), _echo("update"),
                             _echo("with_update")),
        download_bytes=_echo("download_bytes"))


class Outer(NamedTuple):
    inner: Any
    extra: Any


S, CS, L = Outer("server", "s+"), Outer("client", "c+"), Outer("local", "l+")
# Each field called with the outer states: (arguments, the server / client / local state
# positions among them). A new protocol field fails `test_every_field_is_covered` until
# it is added here (and to the helpers that must reroute it).
CALLS = {
    "server_init": (("variables",), (), (), ()),
    "client_state_init": ((S,), (0,), (), ()),
    "client_init": ((S, CS, "ctx"), (0,), (1,), ()),
    "client_step": ((L, "batch", S), (2,), (), (0,)),
    "client_output": ((L, S), (1,), (), (0,)),
    "server_update": ((S, "aggregate", "info"), (0,), (), ()),
    "eval_variables": ((S,), (0,), (), ()),
    "upload_bytes": (("output", L), (), (), (1,)),
    "personal_variables": ((S, CS), (0,), (1,), ()),
    "personal_adapt": ((S, CS, "batch"), (0,), (1,), ()),
    "download_bytes": ((S, "ids", 3), (0,), (), ()),
}
VIEW_CALLS = {"to_model": (S, "output"), "to_output": (S, "variables"),
              "update": (S, "output"), "with_update": (S, "output", "update")}


def _projected(args, positions):
    return tuple(a.inner if i in positions else a for i, a in enumerate(args))


def test_every_field_is_covered():
    assert set(CALLS) | {"aggregator", "model_view"} == set(FederatedAlgorithm._fields)


def test_nest_server_reroutes_what_reads_the_server_and_forwards_the_rest():
    algo = _toy()
    nested = nest_server(algo, lambda server: server.inner)
    for name, (args, servers, _, _) in CALLS.items():
        if name in ("server_init", "upload_bytes"):  # they read no server state
            assert getattr(nested, name) is getattr(algo, name), name
            continue
        got = getattr(nested, name)(*args)
        assert got == getattr(algo, name)(*_projected(args, servers)), name
    assert nested.aggregator is algo.aggregator
    for name, args in VIEW_CALLS.items():
        assert getattr(nested.model_view, name)(*args) == (name, "server", *args[1:])
    # Optional fields stay absent.
    bare = algo._replace(personal_variables=None, personal_adapt=None, download_bytes=None,
                         model_view=ModelView(_echo("to_model"), _echo("to_output")))
    nested = nest_server(bare, lambda server: server.inner)
    assert nested.personal_variables is nested.personal_adapt is None
    assert nested.download_bytes is None and nested.model_view.update is None
    assert nested.model_view.with_update is None
    assert nest_server(algo._replace(model_view=None), lambda s: s.inner).model_view is None


def test_nest_local_steps_the_inner_local_state_and_forwards_the_rest():
    algo = _toy()
    nested = nest_local(algo)
    local, metrics = nested.client_step(L, "batch", S)
    assert local == Outer(("client_step", "local", "batch", S), "l+")  # extra kept
    assert metrics == {"loss_sum": 1.0}
    assert nested.client_output(L, S) == ("client_output", "local", S)
    assert nested.upload_bytes("output", L) == ("upload_bytes", "output", "local")
    for name in FederatedAlgorithm._fields:
        if name not in ("client_step", "client_output", "upload_bytes"):
            assert getattr(nested, name) is getattr(algo, name), name
    assert nest_local(algo._replace(upload_bytes=None)).upload_bytes is None


def test_nest_client_reroutes_what_reads_the_client_state_and_forwards_the_rest():
    algo = _toy()
    nested = nest_client(algo, lambda client_state: client_state.inner)
    for name in ("client_init", "personal_variables", "personal_adapt"):
        args, _, clients, _ = CALLS[name]
        assert getattr(nested, name)(*args) == getattr(algo, name)(*_projected(args, clients))
    for name in FederatedAlgorithm._fields:
        if name not in ("client_init", "personal_variables", "personal_adapt"):
            assert getattr(nested, name) is getattr(algo, name), name
    bare = nest_client(algo._replace(personal_variables=None, personal_adapt=None),
                       lambda client_state: client_state.inner)
    assert bare.personal_variables is bare.personal_adapt is None


def _delta_algorithm(with_update: bool) -> FederatedAlgorithm:
    """A server {'params'}; outputs {'delta', 'stats'} standing for params + delta."""
    def to_model(server, output):
        return {"params": server["params"] + output["delta"], "stats": output["stats"]}

    def to_output(server, variables):
        return {"delta": variables["params"] - server["params"], "stats": variables["stats"]}
    view = ModelView(to_model, to_output)
    if with_update:
        view = view._replace(update=lambda server, output: output["delta"],
                             with_update=lambda server, output, u: {**output, "delta": u})
    return _toy()._replace(eval_variables=lambda server: dict(server), model_view=view)


def test_map_sent_model_and_update_by_hand():
    server = {"params": jnp.asarray([1.0, 2.0])}
    output = {"delta": jnp.asarray([0.5, -1.0]), "stats": jnp.asarray(7.0)}
    for with_update in (False, True):
        algo = _delta_algorithm(with_update)
        # The model w = [1.5, 1.0] sent as 2 w - w_s = [2.0, 0.0]: the update [1.0, -2.0].
        sent, aux = map_sent_model(algo, server, output, lambda w, b: (2 * w - b, "aux"))
        np.testing.assert_allclose(sent["delta"], [1.0, -2.0])
        assert float(sent["stats"]) == 7.0 and aux == "aux"
        # The update u = [0.5, -1.0] sent as u + w_s = [1.5, 1.0].
        sent, aux = map_sent_update(algo, server, output, lambda u, b: (u + b, None))
        np.testing.assert_allclose(sent["delta"], [1.5, 1.0])
        assert float(sent["stats"]) == 7.0 and aux is None
