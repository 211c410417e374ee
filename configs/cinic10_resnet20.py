"""FedAvg with ResNet20 on CINIC-10: the PAN paper's Fig. 9 panel.

Needs CINIC-10's release files, given with `--config.dataset.data_dir=<dir>` (or
$FEDJAX_PAN_CINIC10_DIR; see docs/guides/data.md), and at full size (90,000 training images,
ResNet20 at widths 64/128/256, H = 1000) an accelerator. Setting (paper Sect. 5, App. C):
train split only (the paper does not use valid), K = 100 clients, Dirichlet alpha = 0.1
(`dirichlet_by_client`, the authors' split), R = 0.1, E = 5, B = 64, SGD lr 0.1 (ResNet).

Presets (`--config=configs/cinic10_resnet20.py:<preset>`):
  fig9      (default) PANs off vs on (PANx, T=1, A=0.1), H=1000
  pans_on / pans_off   one run of the above
  search    off, PAN+ A=0.05, PANx A=0.05, PANx A=0.1 (the paper reports the best of the three)
"""

import ml_collections

from fedjax_pan.config.defaults import FIG9_PRESETS, fig9_config

PRESETS = FIG9_PRESETS


def get_config(preset: str = "fig9") -> ml_collections.ConfigDict:
    return fig9_config(preset, "configs/cinic10_resnet20.py", **{
        "dataset.name": "cinic10", "model.name": "resnet20", "optimizer.lr": 0.1})
