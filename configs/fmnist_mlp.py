"""FedAvg on Fashion-MNIST with the paper's MLP, PANs off and on (the default main job).

Presets (`--config=configs/fmnist_mlp.py:<preset>`):
  compare   (default) PANs off vs on (PANx, T=1, A=0.1), K=100, R=0.1, E=5, alpha=0.1,
            seeds 0, 1, 2 (PANs off and on of a seed share data split, cohorts and initial
            weights), 12 rounds: the table gives the PAN effect as a difference paired by
            seed with its spread (about 8 minutes on 2 CPU cores)
  pans_on / pans_off   one run of the above (40 rounds, seed 0)
  paper     the paper's Fig. 9 setting at full length (K=100, R=0.1, E=5, alpha=0.1, H=1000)
  smoke     3 tiny rounds, for tests
  multiprocess  4 short rounds (K=20, 8 a round, E=3) of FedAvg, SCAFFOLD (client
            states, kept on disk) and the median rule (stacked outputs) on the sharded
            executor: the check that 1 and N processes give the same numbers
            (`make multiprocess-check`)
"""

import ml_collections

from fedjax_pan.config.defaults import default_config

PRESETS = ("compare", "pans_on", "pans_off", "paper", "smoke", "multiprocess")


def get_config(preset: str = "compare") -> ml_collections.ConfigDict:
    c = default_config()
    preset = preset or "compare"
    # Variants override nested keys of this config; each runs into workdir/<name>/, and
    # variants named <group>_s<seed> are summarised per group over seeds.
    compare = {"pans_off": {"pan": {"amplitude": 0.0}}, "pans_on": {"pan": {"amplitude": 0.1}}}
    if preset == "compare":
        # 200-round runs of this setting (experiments/sweeps.py fig10, 3 seeds) end within
        # 0.3 points of each other; 12 rounds x 3 seeds x 2 keeps the job under 10 minutes.
        c.rounds = 12
        c.variants = {f"{name}_s{seed}": {**ov, "seed": seed}
                      for seed in (0, 1, 2) for name, ov in compare.items()}
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
        # Phases taken out of local.epochs = 1, so `--config.algorithm=fedrep` (or ktpfl,
        # fedgh, fedpcl) runs on this preset as it is.
        c.fedrep.head_epochs = c.ktpfl.distill_epochs = 0.5
        c.fedgh.collect_epochs = c.fedpcl.collect_epochs = 0.5
    elif preset == "multiprocess":
        c.rounds = 4
        c.partition.num_clients = 20
        c.partition.alpha = 1.0
        c.participation = 0.4
        c.local.epochs = 3.0
        c.dataset.train_limit = 3000
        c.eval.batch_size = 2000
        c.optimizer.warmup = "none"
        c.checkpoint_every = 2
        c.execution.strategy = "sharded"
        c.variants = {"fedavg": {},
                      "scaffold": {"algorithm": "scaffold",
                                   "execution": {"client_states": "disk"}},
                      "median": {"aggregation": {"rule": "median"}}}
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/fmnist_mlp.py; expected "
                         f"one of {', '.join(PRESETS)}")
    return c
