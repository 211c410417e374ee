"""FedProx: the proximal term by hand, mu = 0 is FedAvg, mu > 0 keeps clients close."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err, tiny_clients, tiny_fedavg
from fedjax_pan.algorithms import client_optimizer, fedprox
from fedjax_pan.algorithms.fedavg_family.fedprox import proximal_term
from fedjax_pan.engine import LocalWork, Simulation, make_executor

SIZES = [27, 39, 19, 36, 62, 13]
WORK = LocalWork(batch_size=8, epochs=2.0)


@pytest.mark.reference("algorithm", "fedprox")
def test_proximal_term_by_hand():
    params = {"a": jnp.asarray([1.0, 2.0]), "b": {"c": jnp.asarray([[0.25]])}}
    anchor = {"a": jnp.asarray([0.0, 0.5]), "b": {"c": jnp.asarray([[0.0]])}}
    # diffs 1, 1.5, 0.25
    assert float(proximal_term(params, anchor, 0.2, "l2")) == pytest.approx(
        0.5 * 0.2 * (1 + 2.25 + 0.0625))
    # smooth-L1: 0.5 x^2 inside |x| <= 1, |x| - 0.5 outside
    assert float(proximal_term(params, anchor, 0.2, "huber")) == pytest.approx(
        0.2 * (0.5 + 1.0 + 0.5 * 0.0625))


def _algos(mu, distance="l2"):
    model, variables, base = tiny_fedavg()
    prox = fedprox(model, client_optimizer(0.05, 0.9, 1e-5, 100.0, "steps", 3), mu=mu,
                   distance=distance)
    return variables, base, prox


def _round(algo, variables, cd, strategy="loop"):
    ex = make_executor(strategy, algo, WORK, cd, variables, 3)
    sim = Simulation(algo, cd, WORK, ex, participation=0.5, seed=11)
    state = sim.init(variables)
    return sim, state, sim.round(state)


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_mu_zero_is_fedavg(strategy):
    _, cd = tiny_clients(SIZES)
    variables, base, prox = _algos(0.0)
    _, _, (s_avg, _) = _round(base, variables, cd, strategy)
    _, _, (s_prox, stats) = _round(prox, variables, cd, strategy)
    assert max_rel_err(s_prox.server, s_avg.server) < 1e-6
    assert stats["train_prox"] == 0.0


@pytest.mark.parametrize("distance", ["l2", "huber"])
def test_a_strong_proximal_term_keeps_clients_near_the_global_model(distance):
    _, cd = tiny_clients(SIZES)
    variables, base, prox = _algos(5.0, distance)
    norms = {}
    for name, algo in (("fedavg", base), ("fedprox", prox)):
        sim, state, (_, stats) = _round(algo, variables, cd)
        deltas = [o["delta"] for o in sim.client_updates(state)]
        norms[name] = np.mean([np.sqrt(sum(float(jnp.sum(d ** 2)) for d in
                                           jax.tree_util.tree_leaves(x))) for x in deltas])
        if name == "fedprox":
            assert stats["train_prox"] > 0.0
    assert norms["fedprox"] < 0.8 * norms["fedavg"], norms


def test_fedprox_runs_from_a_config_and_logs_its_term(tmp_path):
    import importlib.util
    from conftest import ROOT
    from fedjax_pan.run import experiment
    spec = importlib.util.spec_from_file_location("c", os.path.join(ROOT, "configs",
                                                                    "fmnist_mlp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("smoke")
    cfg.dataset.name, cfg.algorithm, cfg.fedprox.mu, cfg.rounds = "synthetic", "fedprox", 0.1, 2
    cfg.local.epochs = 3.0  # several steps per client: the term is 0 at a round's first
    experiment.train(cfg, str(tmp_path / "w"), progress=False)
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 and all(r["train_prox"] > 0 for r in rows)
