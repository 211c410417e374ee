"""FedAvg on Fashion-MNIST with the paper's MLP, PANs off and on (the default main job).

Presets (`--config=configs/fmnist_mlp.py:<preset>`):
  compare   (default) PANs off vs on (PANx, T=1, A=0.1), K=100, R=0.1, E=5, alpha=0.1
  pans_on / pans_off   one run of the above
  paper     the paper's Fig. 9 setting at full length (K=100, R=0.1, E=5, alpha=0.1, H=1000)
  smoke     3 tiny rounds, for tests
"""

import ml_collections

from fedjax_pan.defaults import default_config

PRESETS = ("compare", "pans_on", "pans_off", "paper", "smoke")


def get_config(preset: str = "compare") -> ml_collections.ConfigDict:
    c = default_config()
    preset = preset or "compare"
    # Variants override nested keys of this config; each runs into workdir/<name>/.
    compare = {"pans_off": {"pan": {"amplitude": 0.0}}, "pans_on": {"pan": {"amplitude": 0.1}}}
    if preset == "compare":
        c.variants = compare
    elif preset == "pans_on":
        pass
    elif preset == "pans_off":
        c.pan.amplitude = 0.0
    elif preset == "paper":
        c.rounds = 1000
        c.variants = compare
    elif preset == "smoke":
        c.rounds = 3
        c.partition.num_clients = 20
        c.participation = 0.2
        c.local.epochs = 1.0
        c.dataset.train_limit = 4000
        c.eval.batch_size = 2000
        c.optimizer.warmup = "none"
        c.checkpoint_every = 1
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/fmnist_mlp.py; expected "
                         f"one of {', '.join(PRESETS)}")
    return c
