"""The round contract belongs to the engine: the engine imports nothing from the algorithms,
drivers import nothing private from the engine, and every way of running a round is a
`Round`."""

import ast
import os

import numpy as np

from conftest import ROOT, tiny_clients, tiny_fedavg
from fedjax_pan import models
from fedjax_pan.algorithms import fedma, flchain, ktpfl
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.protocol import Round
from fedjax_pan.engine.services import Services

PUBLIC_ENGINE = {"fedjax_pan.engine", "fedjax_pan.engine.protocol", "fedjax_pan.engine.services"}


def _imports(path):
    """Every fedjax_pan module `path` imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("fedjax_pan")}


def test_the_engine_imports_nothing_from_the_algorithms():
    engine = os.path.join(ROOT, "fedjax_pan", "engine")
    for name in sorted(os.listdir(engine)):
        if name.endswith(".py"):
            found = {m for m in _imports(os.path.join(engine, name))
                     if m.startswith("fedjax_pan.algorithms")}
            assert not found, f"engine/{name} imports {sorted(found)}"


def test_drivers_use_only_the_engines_public_services():
    for module in (fedma, ktpfl, flchain):
        engine = {m for m in _imports(module.__file__) if m.startswith("fedjax_pan.engine")}
        assert engine and engine <= PUBLIC_ENGINE, (module.__name__, sorted(engine))


def test_simulations_and_drivers_are_rounds():
    _, cd = tiny_clients([20, 30, 25, 15])
    _, variables, algo = tiny_fedavg()
    work = LocalWork(batch_size=8, epochs=1.0)
    sim = Simulation(algo, cd, work, make_executor("loop", algo, work, cd, variables, 2), 0.5)
    services = Services(cd, work, participation=0.5)
    mlp = models.build("mlp", 10, hidden=[8])
    net = models.build("mlp", 10, hidden=[4])
    assert isinstance(sim, Round)
    assert isinstance(fedma.FedMA(mlp, algo_tx(), services), Round)
    mixed = ktpfl.KtMixed([mlp, net], [models.init(m, _key(), (6, 6, 1)) for m in (mlp, net)],
                          np.arange(4) % 2, algo_tx(), services,
                          np.zeros((5, 6, 6, 1), np.float32), 0.5)
    assert isinstance(mixed, Round)
    rule = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.0, "weights": "examples"}
    assert isinstance(flchain.FLChain(mlp, algo_tx(), services, flchain.OPTIONS, rule, 0,
                                      "mean", 10), Round)
    assert not isinstance(object(), Round)


def algo_tx():
    from fedjax_pan.algorithms import client_optimizer
    return client_optimizer(0.05)


def _key():
    import jax
    return jax.random.PRNGKey(0)
