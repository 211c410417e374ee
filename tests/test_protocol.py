"""The round contract belongs to the engine: the engine imports nothing from the algorithms,
drivers import nothing private from the engine nor the registry (nor does the ledger import
the algorithms), and every way of running a round is a `Round`."""

import ast
import importlib
import os
import types

import numpy as np

from conftest import ROOT, tiny_clients, tiny_fedavg
from fedjax_pan import algorithms, engine as engine_lib, models
from fedjax_pan.algorithms.robust import ledger
from fedjax_pan.algorithms.fedavg_family import fedma
from fedjax_pan.algorithms.robust import flchain
from fedjax_pan.algorithms.personal import ktpfl
from fedjax_pan.algorithms import registry
from fedjax_pan.engine import LocalWork, Simulation, make_executor
from fedjax_pan.engine.protocol import Round
from fedjax_pan.engine.services import Services

# What a driver may use: the contract, the services, and which process of a multi-process
# run this is (a driver writing beside the run writes from process 0 alone).
PUBLIC_ENGINE = {"fedjax_pan.engine", "fedjax_pan.engine.protocol", "fedjax_pan.engine.services",
                 "fedjax_pan.engine.distributed"}


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


def _import_statements(path):
    """(module, name) for every `from module import name` in `path`, (module, None) for
    every `import module`, at the top or inside functions."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
    return out


def _faults(path):
    """What a driver's module `path` imports that it must not: the registry, or the
    engine other than its package's public names and `PUBLIC_ENGINE`."""
    faults = []
    for module, name in _import_statements(path):
        full = module if name is None else f"{module}.{name}"
        if "fedjax_pan.algorithms.registry" in (module, full) or full == "fedjax_pan.algorithms":
            faults.append(full)  # the registry, or the package that re-exports it
        elif module == "fedjax_pan.algorithms" and not isinstance(
                getattr(algorithms, name, None), types.ModuleType):
            faults.append(full)  # a name the package re-exports (from the registry)
        elif module == "fedjax_pan.engine" and name is not None:
            if name not in engine_lib.__all__ and full not in PUBLIC_ENGINE:
                faults.append(full)  # an engine module, not a public name
        elif module.startswith("fedjax_pan.engine") and module not in PUBLIC_ENGINE:
            faults.append(full)
    return faults


def test_drivers_use_only_the_engines_public_services():
    """Every module that provides a driver (the registry's entries say which) takes what
    the config names resolved from `Services`, never from the registry, and uses the
    engine's public services only; FLChain's ledger is given its update rule."""
    names = sorted({e.driver.__module__ for e in registry.ALGORITHMS.values()
                    if e.driver is not None})
    assert {m.__name__ for m in (fedma, ktpfl, flchain)} <= set(names)
    for name in names + ["fedjax_pan.algorithms.robust.ledger"]:
        path = importlib.import_module(name).__file__
        assert not _faults(path), (name, _faults(path))
    found = [m for m in _imports(ledger.__file__) if m.startswith("fedjax_pan.algorithms")]
    assert not found, f"ledger.py imports {found}"
    uses = {m for name in names for m in _imports(importlib.import_module(name).__file__)}
    assert "fedjax_pan.engine.services" in uses  # the rule sees the drivers' imports


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
