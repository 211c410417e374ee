"""FedAvg with VGG9 on GTSRB: the PAN paper's Fig. 9 setting (its GTSRB panel is Supp. Fig. 24).

Needs GTSRB's official release files, given with `--config.dataset.data_dir=<dir>` (or
$FEDJAX_PAN_GTSRB_DIR; see README, Data), and at full size (39,209 training images resized
to 32x32, H = 1000) an accelerator. Setting (paper Sect. 5, App. C): K = 100 clients,
Dirichlet alpha = 0.1 (`dirichlet_by_client`, the authors' split), R = 0.1, E = 5, B = 64,
SGD lr 0.05. The paper notes FL on GTSRB is unstable and some algorithms converge slowly.

Presets (`--config=configs/gtsrb_vgg9.py:<preset>`):
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
        raise ValueError(f"unknown preset {preset!r} for configs/gtsrb_vgg9.py; expected "
                         f"one of {', '.join(PRESETS)}")
    c = default_config()
    c.dataset.name = "gtsrb"
    c.model.name = "vgg9"
    c.partition.scheme, c.partition.num_clients, c.partition.alpha = \
        "dirichlet_by_client", 100, 0.1
    c.participation = 0.1
    c.local.epochs, c.local.batch_size = 5.0, 64
    c.optimizer.lr = 0.05
    c.rounds = 1000
    if preset in PANS:
        c.pan.update(PANS[preset])
    else:
        grid = PANS if preset == "fig9" else SEARCH
        c.variants = {name: {"pan": dict(pan)} for name, pan in grid.items()}
    return c
