"""The default run configuration every config file starts from (SPEC 3 hyper-parameters).

Unset optional values are typed placeholders (None) so they can still be set from the
command line, e.g. `--config.partition.min_size=10`.
"""

import copy
from typing import Any, Mapping

import ml_collections
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms import aggregation, features
from fedjax_pan.algorithms.registry import ALGORITHMS


def default_config() -> ml_collections.ConfigDict:
    """FedAvg, MLP on Fashion-MNIST, K=100, R=0.1, E=5, B=64, Dirichlet(0.1), PANx T=1 A=0.1."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.rounds = 40
    c.participation = 0.1  # R
    c.algorithm = "fedavg"
    # augment: 'crop_flip' = random 4-pixel-padded crops and horizontal flips of training
    # batches (the CIFAR pipeline); normalization: 'standard' (each dataset's statistics)
    # or 'authors' (the PAN authors' CIFAR constants). public_size: a seeded slice of the
    # training set held out of every client's data as unlabelled public data (KT-pFL).
    c.dataset = ml_collections.ConfigDict({"name": "fashion_mnist",
                                           "data_dir": placeholder(str),
                                           "train_limit": placeholder(int),
                                           "public_size": 0,
                                           "augment": "none", "normalization": "standard"})
    # architectures: '' (every client runs the model above) or model specs separated by
    # ';', client n running the (n mod A)-th (algorithms whose clients may differ, e.g.
    # fedproto; engine/groups.py).
    c.model = ml_collections.ConfigDict({"name": "mlp", "norm": placeholder(str),
                                         "options": {}, "architectures": ""})
    c.pan = ml_collections.ConfigDict({"kind": "mul", "period": 1.0, "amplitude": 0.1,
                                       "ratio": 1.0})
    c.partition = ml_collections.ConfigDict({
        "scheme": "dirichlet_by_client", "num_clients": 100, "alpha": 0.1,
        "classes_per_client": placeholder(int), "min_size": placeholder(int), "balance": False,
        # > 0: each client keeps this share of its data as its own test set, and every
        # evaluation also scores each client on it (PFLlib 0.25, the PAN authors 0.2).
        "test_fraction": 0.0,
        # Clients of unequal quality: a noisy_share of the clients (from the seed) have
        # noise_rate of their training labels replaced by uniformly random ones.
        "noisy_share": 0.0, "noise_rate": 0.5})
    c.local = ml_collections.ConfigDict({"epochs": 5.0, "batch_size": 64, "mode": "epochs",
                                         "local_steps": placeholder(int)})
    # warmup 'rounds' / 'steps' ramps the rate up over warmup_length of them; 'halving'
    # halves it every warmup_length rounds instead (the SageFlow authors' lrdecay).
    c.optimizer = ml_collections.ConfigDict({
        "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-5, "grad_clip": 100.0,
        "warmup": "rounds", "warmup_length": 10})
    c.server = ml_collections.ConfigDict({"optimizer": "sgd", "lr": 1.0, "momentum": 0.0})
    # rule: one of `algorithms.aggregation.RULES` (each entry's summary says what it does);
    # the keys the rules read (trim, byzantine, zeno.rho, ...) join the section with the
    # defaults their entries declare.
    c.aggregation = ml_collections.ConfigDict({
        "weights": "uniform", "bn": "mean", "rule": "mean",
        **aggregation.config_options()})
    # The cross-cutting features, each described by its entry (`algorithms.features`):
    # shuffle (PAN's Alg. 2), attack, compression, privacy (DP-FedAvg), straggler.
    for section, options in features.default_sections().items():
        c[section] = options
    # 'uniform': round(R K) clients a round; 'poisson': each client with probability R;
    # 'auto': Poisson under DP-FedAvg (privacy.clip > 0; its analysis), else uniform.
    c.sampling = "auto"
    # client_states: where the K clients' persistent states live, 'auto' (by size:
    # device, host, then disk) or one of 'device', 'host', 'disk' (engine/store.py).
    # precision: 'bfloat16' computes every model's forward and backward pass in bfloat16
    # on float32 weights, optimiser states and losses (models/precision.py);
    # matmul_precision: XLA's 'default', 'high' or 'highest' for float32 matrix products.
    c.execution = ml_collections.ConfigDict({"strategy": "auto",
                                             "block_size": placeholder(int),
                                             "client_states": "auto",
                                             "precision": "float32",
                                             "matmul_precision": "default"})
    # local: also log each client's expected accuracy on a test set with its label mix.
    # finetune_epochs > 0: before each evaluation every client trains the model it is
    # scored on for this many epochs of its own data (FedAvg-C;
    # algorithms/fedavg_family/finetune.py).
    c.eval = ml_collections.ConfigDict({"every": 1, "batch_size": 1000, "local": False,
                                        "finetune_epochs": 0.0})
    c.checkpoint_every = 10
    # A round whose mean training loss exceeds this stops the run as diverged (cross-entropy
    # of a uniform guess is ln C, 2.3 for 10 classes; the paper's runs stay below 3).
    c.max_train_loss = 100.0
    # Each algorithm's own options, e.g. config.fedprox.mu (see algorithms/registry.py).
    for name, entry in ALGORITHMS.items():
        if entry.options:
            # A copy: placeholders are mutable references, never shared between configs.
            c[name] = ml_collections.ConfigDict(copy.deepcopy(entry.options))
    c.variants = ml_collections.ConfigDict()
    return c


def set_keys(cfg: ml_collections.ConfigDict, changes: Mapping[str, Any]
             ) -> ml_collections.ConfigDict:
    """Sets dotted keys ({'fedma.sigma': 2.0}) of `cfg` in place; returns it."""
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        node[leaf] = value
    return cfg


# The PAN settings of the paper's Fig. 9 panels: off vs PANx (T = 1, A = 0.1), and the three
# settings whose best the paper reports.
FIG9_PANS = {"pans_off": {"amplitude": 0.0}, "pans_on": {"kind": "mul", "amplitude": 0.1}}
FIG9_SEARCH = {"pans_off": {"amplitude": 0.0},
               "pan_add_a005": {"kind": "add", "amplitude": 0.05},
               "pan_mul_a005": {"kind": "mul", "amplitude": 0.05},
               "pan_mul_a01": {"kind": "mul", "amplitude": 0.1}}
FIG9_PRESETS = ("fig9", "pans_on", "pans_off", "search")


def fig9_config(preset: str, source: str, **changes: Any) -> ml_collections.ConfigDict:
    """A Fig. 9 panel: FedAvg, K = 100, R = 0.1, E = 5, B = 64, H = 1000, Dirichlet 0.1 by
    client, with `changes` ({'dataset.name': ..., 'model.name': ...}, dotted keys); preset
    'fig9' runs PANs off vs on as variants, 'pans_on' / 'pans_off' one of them, 'search'
    the paper's three settings and off. `source` names the config file in errors."""
    preset = preset or "fig9"
    if preset not in FIG9_PRESETS:
        raise ValueError(f"unknown preset {preset!r} for {source}; expected one of "
                         f"{', '.join(FIG9_PRESETS)}")
    c = default_config()
    c.partition.scheme, c.partition.num_clients, c.partition.alpha = \
        "dirichlet_by_client", 100, 0.1
    c.participation, c.local.epochs, c.local.batch_size = 0.1, 5.0, 64
    c.optimizer.lr, c.rounds = 0.05, 1000
    set_keys(c, changes)
    if preset in FIG9_PANS:
        c.pan.update(FIG9_PANS[preset])
    else:
        grid = FIG9_PANS if preset == "fig9" else FIG9_SEARCH
        c.variants = {name: {"pan": dict(pan)} for name, pan in grid.items()}
    return c
