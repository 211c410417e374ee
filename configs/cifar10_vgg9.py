"""FedAvg with VGG9 on CIFAR-10: the settings of the PAN paper's Table 1 (and Fig. 9).

Needs CIFAR-10 prepared for TFDS (see docs/guides/data.md) and, at these sizes, an accelerator.
Presets (`--config=configs/cifar10_vgg9.py:<preset>`), each running PANs off vs on:
  table1_row1   K=16, R=1.0, alpha=0.5, E=20   (paper: FedAvg 86.83, +PANs 88.49)
  table1_row2   K=20, R=0.4, alpha=1.0, E=40   (paper: FedAvg 79.76, +PANs 81.94)
  fig9          K=100, R=0.1, alpha=0.1, E=5, H=1000
Table 1 does not state H; 100 rounds are used here (`--config.rounds=` to change).
"""

import ml_collections

from fedjax_pan.config.defaults import default_config

SETTINGS = {  # (K, R, alpha, E, rounds)
    "table1_row1": (16, 1.0, 0.5, 20, 100),
    "table1_row2": (20, 0.4, 1.0, 40, 100),
    "fig9": (100, 0.1, 0.1, 5, 1000),
}
PRESETS = tuple(SETTINGS)


def get_config(preset: str = "table1_row1") -> ml_collections.ConfigDict:
    preset = preset or "table1_row1"
    if preset not in SETTINGS:
        raise ValueError(f"unknown preset {preset!r} for configs/cifar10_vgg9.py; expected "
                         f"one of {', '.join(SETTINGS)}")
    k, r, alpha, epochs, rounds = SETTINGS[preset]
    c = default_config()
    c.dataset.name = "cifar10"
    # The authors' CIFAR pipeline: their normalisation constants, random crops and flips.
    c.dataset.normalization, c.dataset.augment = "authors", "crop_flip"
    c.model.name = "vgg9"
    c.partition.num_clients, c.participation, c.partition.alpha = k, r, alpha
    c.local.epochs, c.rounds = float(epochs), rounds
    c.optimizer.lr = 0.05
    c.variants = {"pans_off": {"pan": {"amplitude": 0.0}}, "pans_on": {"pan": {"amplitude": 0.1}}}
    return c
