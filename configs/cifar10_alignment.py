"""Neuron alignment in FL on CIFAR-10 (paper 000 Tables 1-2): FedAvg, FedAvg + PANs, FedMA
and Fed2 on VGG9, at FedMA's settings.

Needs CIFAR-10 prepared for TFDS (see docs/guides/data.md) and, at these sizes, an accelerator.
Presets (`--config=configs/cifar10_alignment.py:<preset>`), (K, R, alpha, E):
  K16_R1_a0.5_E20   (16, 1.0, 0.5, 20)   Table 1 (paper: FedAvg 86.83, +PANs 88.49, FedMA 84.0,
                                         Fed2 88.29)
  K16_R1_a0.1_E20   (16, 1.0, 0.1, 20)
  K16_R0.4_a0.5_E20 (16, 0.4, 0.5, 20)
Each runs four variants into `workdir/<variant>/`: `fedavg`, `fedavg_pans` (PANx, T = 1,
A = 0.1), `fedma` (BBP-MAP matching, E retraining epochs per matched layer; IBM's
sigma = sigma0 = 1, gamma = 7) and `fed2` (G = 10 groups over the last 6 layers). Clients
from FedMA's "hetero-dir" split (`dirichlet_by_class`, >= 10 examples each); VGG9 without
normalisation (FedMA's); SGD lr 0.01, momentum 0.9, B = 64 (IBM's run.sh); 50 rounds
(`--config.rounds=`). experiments/alignment_methods.py runs the same comparison on
Fashion-MNIST on a CPU.
"""

import ml_collections

from fedjax_pan.config.defaults import default_config

SETTINGS = {"K16_R1_a0.5_E20": (16, 1.0, 0.5, 20.0), "K16_R1_a0.1_E20": (16, 1.0, 0.1, 20.0),
            "K16_R0.4_a0.5_E20": (16, 0.4, 0.5, 20.0)}
PRESETS = tuple(SETTINGS)


def variants(epochs: float) -> dict:
    """fedavg, fedavg_pans, fedma and fed2 (PANs only in fedavg_pans)."""
    off = {"amplitude": 0.0}
    return {"fedavg": {"pan": off},
            "fedavg_pans": {"pan": {"amplitude": 0.1}},
            "fedma": {"algorithm": "fedma", "pan": off, "fedma": {"retrain_epochs": epochs}},
            "fed2": {"algorithm": "fed2", "pan": off,
                     "model": {"options": {"grouped": {"groups": 10, "depth": 6}}}}}


def get_config(preset: str = "K16_R1_a0.5_E20") -> ml_collections.ConfigDict:
    preset = preset or "K16_R1_a0.5_E20"
    if preset not in SETTINGS:
        raise ValueError(f"unknown preset {preset!r} for configs/cifar10_alignment.py; "
                         f"expected one of {', '.join(PRESETS)}")
    k, r, alpha, e = SETTINGS[preset]
    c = default_config()
    c.dataset.name = "cifar10"
    # The authors' CIFAR pipeline: their normalisation constants, random crops and flips.
    c.dataset.normalization, c.dataset.augment = "authors", "crop_flip"
    c.model.name = "vgg9"
    c.model.options.grouped = None  # the plain network unless a variant groups it
    c.pan.update({"kind": "mul", "period": 1.0, "amplitude": 0.0})
    c.partition.scheme, c.partition.num_clients = "dirichlet_by_class", k
    c.partition.alpha = alpha
    c.participation = r
    c.local.epochs, c.rounds = e, 50
    c.optimizer.lr, c.optimizer.warmup = 0.01, "none"
    c.variants = variants(e)
    return c
