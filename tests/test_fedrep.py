"""FedRep: a round against an independent two-phase loop (head, then body, each with its
own momentum optimiser), and the config's head epochs."""

import jax
import numpy as np
import optax
import pytest

from conftest import max_rel_err, pfl_rounds, pfl_setup
from fedjax_pan.algorithms import registry
from fedjax_pan.algorithms.personal.fedrep import fedrep
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.config.defaults import default_config
from fedjax_pan.engine.reference import client_batches


@pytest.mark.reference("algorithm", "fedrep")
@pytest.mark.parametrize("share", [0.25, 0.6])
def test_a_round_is_head_steps_then_body_steps(share):
    cd, model, variables, tx = pfl_setup()
    sim, states, _ = pfl_rounds(fedrep(model, tx, share), cd, variables, rounds=1)
    cohort = sim.cohort(sim.init(variables), 0)
    glob = variables["params"]
    deltas, weights = [], []
    for m, k in enumerate(cohort.ids):
        head, body = glob["head"], {n: p for n, p in glob.items() if n != "head"}
        steps = int(cohort.steps[m])
        head_steps = int(np.round(share * steps))
        opt_h, opt_b = tx.init(head), tx.init(body)
        for t, batch in enumerate(client_batches(cd, 8, cohort, m)):
            def loss(h, b):
                logits = model.apply({"params": {**b, "head": h}}, batch["x"])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, batch["y"]).mean()
            if t < head_steps:
                g = jax.grad(loss, argnums=0)(head, body)
                u, opt_h = tx.update(g, opt_h, head)
                head = optax.apply_updates(head, u)
            else:
                g = jax.grad(loss, argnums=1)(head, body)
                u, opt_b = tx.update(g, opt_b, body)
                body = optax.apply_updates(body, u)
        mine = {key: v[k] for key, v in states[1].client_states["params"].items()}
        assert max_rel_err(mine, {"head/kernel": head["kernel"], "head/bias": head["bias"]}
                           ) < 1e-5
        assert max_rel_err(mine["head/kernel"], glob["head"]["kernel"]) > 1e-3  # it trained
        deltas.append(jax.tree_util.tree_map(lambda a, b: a - b, body,
                                             {n: p for n, p in glob.items() if n != "head"}))
        weights.append(float(cohort.weights[m]))
    w = np.asarray(weights) / sum(weights)
    want = jax.tree_util.tree_map(lambda g, *d: g + sum(wi * di for wi, di in zip(w, d)),
                                  {n: p for n, p in glob.items() if n != "head"}, *deltas)
    got = {n: p for n, p in states[1].server.params.items() if n != "head"}
    assert max_rel_err(got, want) < 1e-5
    assert max_rel_err(states[1].server.params["head"], glob["head"]) == 0  # never shared


def test_head_epochs_come_out_of_the_local_epochs():
    cd, model, variables, _ = pfl_setup()
    cfg = default_config()
    cfg.algorithm, cfg.local.epochs, cfg.fedrep.head_epochs = "fedrep", 2.0, 1.0
    algo = registry.from_config(model, cfg)
    assert algo.client_step is not None
    cfg.fedrep.head_epochs = 2.0
    with pytest.raises(ValueError, match=r"fedrep.head_epochs .*local.epochs \(2\).*got 2"):
        registry.from_config(model, cfg)
    with pytest.raises(ValueError, match=r"\(0, 1\), got 1.0"):
        fedrep(model, client_optimizer(0.1), 1.0)
