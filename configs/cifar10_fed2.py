"""Fed2 against FedAvg on CIFAR-10 (paper 003 Tables 1-2), each with PANs off and on.

Needs CIFAR-10 prepared for TFDS (see docs/guides/data.md) and, at these sizes, an accelerator.
Every preset runs four variants into `workdir/<variant>/`: `fedavg` (the plain network),
`fed2` (G = 10 groups over the last 6 layers, GroupNorm in the grouped layers, feature
paired averaging), and both again with PANx (T = 1, A = 0.1): `fedavg_pans`, `fed2_pans`.

Presets (`--config=configs/cifar10_fed2.py:<preset>`); N nodes, each holding C classes
(`pathological` partition), all nodes in every round:
  vgg9_10x3, vgg9_10x4, vgg9_10x5, vgg9_10x10       Table 1, VGG9 (paper: Fed2 +1-4 points)
  vgg9_20x5, vgg9_50x5, vgg9_100x5                   Table 2, node scaling (10x5 above)
  mobilenet_10x3 ... mobilenet_100x5                 the same with MobileNetV1 (+5-19 points)
The papers state neither H nor E for these tables: E = 5 local epochs and H = 100 rounds
here (`--config.rounds=`, `--config.local.epochs=` to change); SGD lr 0.05, momentum 0.9,
B = 64 as the PAN paper.
"""

import ml_collections

from fedjax_pan.config.defaults import default_config

SETTINGS = {"10x3": (10, 3), "10x4": (10, 4), "10x5": (10, 5), "10x10": (10, 10),
            "20x5": (20, 5), "50x5": (50, 5), "100x5": (100, 5)}
MODELS = ("vgg9", "mobilenet")
PRESETS = tuple(f"{m}_{s}" for m in MODELS for s in SETTINGS)
GROUPED = {"groups": 10, "depth": 6}
PANS_ON = {"kind": "mul", "period": 1.0, "amplitude": 0.1}


def variants() -> dict:
    """fedavg / fed2, PANs off / on."""
    out = {}
    for pans in (False, True):
        suffix = "_pans" if pans else ""
        pan = {"amplitude": PANS_ON["amplitude"] if pans else 0.0}
        out["fedavg" + suffix] = {"pan": pan}
        out["fed2" + suffix] = {"algorithm": "fed2", "pan": pan,
                                "model": {"options": {"grouped": dict(GROUPED)}}}
    return out


def get_config(preset: str = "vgg9_10x3") -> ml_collections.ConfigDict:
    preset = preset or "vgg9_10x3"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} for configs/cifar10_fed2.py; expected one "
                         f"of {', '.join(PRESETS)}")
    model, setting = preset.split("_")
    nodes, classes = SETTINGS[setting]
    c = default_config()
    c.dataset.name = "cifar10"
    # The authors' CIFAR pipeline: their normalisation constants, random crops and flips.
    c.dataset.normalization, c.dataset.augment = "authors", "crop_flip"
    c.model.name = model
    c.model.options.grouped = None  # the plain network unless a variant groups it
    c.pan.update(PANS_ON)
    c.partition.scheme, c.partition.num_clients = "pathological", nodes
    c.partition.alpha, c.partition.classes_per_client = None, classes
    c.participation = 1.0
    c.local.epochs, c.rounds = 5.0, 100
    c.variants = variants()
    return c
