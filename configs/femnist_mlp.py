"""FedAvg with the paper's MLP on FEMNIST, one client per writer: the PAN paper's Fig. 9 panel.

Needs LEAF's FEMNIST JSON files, given with `--config.dataset.data_dir=<dir>` (or
$FEDJAX_PAN_FEMNIST_DIR; see docs/guides/data.md), and at full size (about 65k training images,
H = 1000) an accelerator. The paper's protocol (App. C) is the loader's: 10% of the writers
(data seed 0, whatever `seed`), 20% of each writer's samples form the global test set, and
the clients are the sampled writers (`partition.scheme='natural'`); R = 0.1, E = 5, B = 10,
SGD lr 0.05.

`partition.num_clients` must equal the number of sampled writers: 359 for LEAF's current
full release (3,597 writers). Older LEAF copies hold 3,500 writers (350 sampled) and the
paper states 355; if yours differs the run stops before training and names the number:
pass `--config.partition.num_clients=<it>`.

Presets (`--config=configs/femnist_mlp.py:<preset>`):
  fig9      (default) PANs off vs on (PANx, T=1, A=0.1), H=1000
  pans_on / pans_off   one run of the above
  search    off, PAN+ A=0.05, PANx A=0.05, PANx A=0.1 (the paper reports the best of the three)
"""

import ml_collections

from fedjax_pan.config.defaults import FIG9_PRESETS, fig9_config

PRESETS = FIG9_PRESETS

WRITERS = 359  # floor(0.1 * 3,597): LEAF's current FEMNIST release


def get_config(preset: str = "fig9") -> ml_collections.ConfigDict:
    return fig9_config(preset, "configs/femnist_mlp.py", **{
        "dataset.name": "femnist", "model.name": "mlp", "partition.scheme": "natural",
        "partition.num_clients": WRITERS, "local.batch_size": 10})
