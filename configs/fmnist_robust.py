"""Slow and malicious clients on Fashion-MNIST (the SageFlow authors' setting): does FedAvg
break, and which defence holds?

K = 100 clients with two label shards each, C = 0.2 a round, E = 5 local epochs of B = 10
at SGD lr 0.01 momentum 0.9, McMahan et al.'s 2NN (784-200-200-10), 1,000 training
examples held out at the server (SageFlow's and Zeno's public set); 20% of the clients
poison their model (send -0.1 w) and every client is late by 0, 1 or 2 rounds, its output
used on arrival with its staleness. Every variant shares data split, attackers, delays and
initial weights; the main command prints their final accuracies in one table.

Presets (`--config=configs/fmnist_robust.py:<preset>`):
  compare   (default) 30 rounds: FedAvg without attack and without stragglers, then under
            both: FedAvg, Multi-Krum (f = 4), RFA (geometric median), Zeno (b = 4), FedAsync
            and SageFlow (7 runs like the robustness script's, 30-75 s each on 2 CPU cores)
  sageflow  SageFlow alone under both
  authors   SageFlow under both at the SageFlow authors' protocol (`Sageflow_both.sh`):
            attackers exactly int(M ratio) = 4 of each round's 20 (attack.draw=per_round),
            the first three free clients of a round late by 0, 1, 2 (straggler.forced),
            plain SGD without weight decay or clipping
  smoke     3 tiny rounds of three variants, for tests
Change the threat with e.g. `--config.attack.kind=label_shift`, `backdoor` (its success
rate is logged), `--config.straggler.policy=ignore`, or `--config.straggler.max_delay=0`.
"""

import ml_collections

from fedjax_pan.config.defaults import default_config

PRESETS = ("compare", "sageflow", "authors", "smoke")
DEFENCES = {
    "fedavg": {"aggregation": {"rule": "mean"}},
    "multi_krum": {"aggregation": {"rule": "multi_krum", "byzantine": 4}},
    "rfa": {"aggregation": {"rule": "geometric_median"}},
    "zeno": {"aggregation": {"rule": "zeno", "byzantine": 4}},
    "fedasync": {"aggregation": {"rule": "fedasync"}},
    "sageflow": {"aggregation": {"rule": "sageflow"}},
}
CLEAN = {"attack": {"kind": "none"}, "straggler": {"max_delay": 0}}


def get_config(preset: str = "compare") -> ml_collections.ConfigDict:
    c = default_config()
    preset = preset or "compare"
    c.rounds = 30
    c.partition.scheme, c.partition.classes_per_client = "pathological", 2
    c.partition.num_clients, c.participation = 100, 0.2
    c.local.epochs, c.local.batch_size = 5.0, 10
    c.optimizer.lr, c.optimizer.momentum, c.optimizer.warmup = 0.01, 0.9, "none"
    c.model.options = {"hidden": [200, 200]}
    c.pan.amplitude = 0.0
    c.dataset.public_size = 1000
    c.attack.kind, c.attack.fraction = "model_poisoning", 0.2
    c.straggler.max_delay, c.straggler.policy = 2, "stale"
    # An attacked FedAvg's loss may grow large before it breaks: only a loss that is no
    # longer finite ends a run.
    c.max_train_loss = 1e30
    if preset == "compare":
        c.variants = {"fedavg_no_threat": {**DEFENCES["fedavg"], **CLEAN}, **DEFENCES}
    elif preset == "sageflow":
        c.aggregation.rule = "sageflow"
    elif preset == "authors":
        c.aggregation.rule = "sageflow"
        c.attack.draw = "per_round"
        c.straggler.forced = (0, 1, 2)
        c.optimizer.weight_decay, c.optimizer.grad_clip = 0.0, 0.0
    elif preset == "smoke":
        c.rounds = 3
        c.partition.num_clients, c.participation = 20, 0.2
        c.local.epochs = 1.0
        c.dataset.train_limit, c.dataset.public_size = 4000, 200
        c.eval.batch_size = 2000
        c.checkpoint_every = 1
        c.model.options = {"hidden": [64, 64]}
        # Phases taken out of local.epochs = 1, so other algorithms run on this preset.
        c.fedrep.head_epochs = c.ktpfl.distill_epochs = 0.5
        c.fedgh.collect_epochs = c.fedpcl.collect_epochs = 0.5
        c.variants = {"fedavg_no_threat": {**DEFENCES["fedavg"], **CLEAN},
                      "fedavg": DEFENCES["fedavg"], "sageflow": DEFENCES["sageflow"]}
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/fmnist_robust.py; expected "
                         f"one of {', '.join(PRESETS)}")
    return c
