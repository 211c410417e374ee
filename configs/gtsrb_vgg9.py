"""FedAvg with VGG9 on GTSRB: the PAN paper's Fig. 9 setting (its GTSRB panel is Supp. Fig. 24).

Needs GTSRB's official release files, given with `--config.dataset.data_dir=<dir>` (or
$FEDJAX_PAN_GTSRB_DIR; see docs/guides/data.md), and at full size (39,209 training images resized
to 32x32, H = 1000) an accelerator. Setting (paper Sect. 5, App. C): K = 100 clients,
Dirichlet alpha = 0.1 (`dirichlet_by_client`, the authors' split), R = 0.1, E = 5, B = 64,
SGD lr 0.05. The paper notes FL on GTSRB is unstable and some algorithms converge slowly.

Presets (`--config=configs/gtsrb_vgg9.py:<preset>`):
  fig9      (default) PANs off vs on (PANx, T=1, A=0.1), H=1000
  pans_on / pans_off   one run of the above
  search    off, PAN+ A=0.05, PANx A=0.05, PANx A=0.1 (the paper reports the best of the three)
"""

import ml_collections

from fedjax_pan.config.defaults import FIG9_PRESETS, fig9_config

PRESETS = FIG9_PRESETS


def get_config(preset: str = "fig9") -> ml_collections.ConfigDict:
    return fig9_config(preset, "configs/gtsrb_vgg9.py",
                       **{"dataset.name": "gtsrb", "model.name": "vgg9"})
