"""FedAvg with ResNet20 on CINIC-10: the PAN paper's Fig. 9 panel.

Needs CINIC-10's release files, given with `--config.dataset.data_dir=<dir>` (or
$FEDJAX_PAN_CINIC10_DIR; see README, Data), and at full size (90,000 training images,
ResNet20 at widths 64/128/256, H = 1000) an accelerator. Setting (paper Sect. 5, App. C):
train split only (the paper does not use valid), K = 100 clients, Dirichlet alpha = 0.1
(`dirichlet_by_client`, the authors' split), R = 0.1, E = 5, B = 64, SGD lr 0.1 (ResNet).

Presets (`--config=configs/cinic10_resnet20.py:<preset>`):
  fig9      (default) PANs off vs on (PANx, T=1, A=0.1), H=1000
  pans_on / pans_off   one run of the above
  search    off, PAN+ A=0.05, PANx A=0.05, PANx A=0.1 (the paper reports the best of the three)
"""

import ml_collections

from fedjax_pan.defaults import default_config

PANS = {"pans_off": {"amplitude": 0.0}, "pans_on": {"kind": "mul", "amplitude": 0.1}}
SEARCH = {"pans_off": {"amplitude": 0.0},
          "pan_add_a005": {"kind": "add", "amplitude": 0.05},
          "pan_mul_a005": {"kind": "mul", "amplitude": 0.05},
          "pan_mul_a01": {"kind": "mul", "amplitude": 0.1}}
PRESETS = ("fig9", "pans_on", "pans_off", "search")


def get_config(preset: str = "fig9") -> ml_collections.ConfigDict:
    preset = preset or "fig9"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} for configs/cinic10_resnet20.py; expected "
                         f"one of {', '.join(PRESETS)}")
    c = default_config()
    c.dataset.name = "cinic10"
    c.model.name = "resnet20"
    c.partition.scheme, c.partition.num_clients, c.partition.alpha = \
        "dirichlet_by_client", 100, 0.1
    c.participation = 0.1
    c.local.epochs, c.local.batch_size = 5.0, 64
    c.optimizer.lr = 0.1
    c.rounds = 1000
    if preset in PANS:
        c.pan.update(PANS[preset])
    else:
        grid = PANS if preset == "fig9" else SEARCH
        c.variants = {name: {"pan": dict(pan)} for name, pan in grid.items()}
    return c
