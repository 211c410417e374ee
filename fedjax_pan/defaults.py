"""The default run configuration every config file starts from (SPEC 3 hyper-parameters).

Unset optional values are typed placeholders (None) so they can still be set from the
command line, e.g. `--config.partition.min_size=10`.
"""

import copy

import ml_collections
from ml_collections.config_dict import placeholder

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
    # or 'authors' (the PAN authors' CIFAR constants).
    c.dataset = ml_collections.ConfigDict({"name": "fashion_mnist",
                                           "data_dir": placeholder(str),
                                           "train_limit": placeholder(int),
                                           "augment": "none", "normalization": "standard"})
    c.model = ml_collections.ConfigDict({"name": "mlp", "norm": placeholder(str),
                                         "options": {}})
    c.pan = ml_collections.ConfigDict({"kind": "mul", "period": 1.0, "amplitude": 0.1,
                                       "ratio": 1.0})
    c.partition = ml_collections.ConfigDict({
        "scheme": "dirichlet_by_client", "num_clients": 100, "alpha": 0.1,
        "classes_per_client": placeholder(int), "min_size": placeholder(int), "balance": False})
    c.local = ml_collections.ConfigDict({"epochs": 5.0, "batch_size": 64, "mode": "epochs",
                                         "local_steps": placeholder(int)})
    c.optimizer = ml_collections.ConfigDict({
        "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-5, "grad_clip": 100.0,
        "warmup": "rounds", "warmup_length": 10})
    c.server = ml_collections.ConfigDict({"optimizer": "sgd", "lr": 1.0, "momentum": 0.0})
    # rule: 'mean' (weighted by `weights`), or robust 'median' / 'trimmed_mean' (cut `trim`
    # of the clients at each end, per coordinate).
    c.aggregation = ml_collections.ConfigDict({"weights": "uniform", "bn": "mean",
                                               "rule": "mean", "trim": 0.1})
    c.execution = ml_collections.ConfigDict({"strategy": "auto",
                                             "block_size": placeholder(int)})
    # local: also log each client's expected accuracy on a test set with its label mix.
    c.eval = ml_collections.ConfigDict({"every": 1, "batch_size": 1000, "local": False})
    # Alg. 2: shuffle hidden neurons during local training, N_sf times per round expected.
    c.shuffle = ml_collections.ConfigDict({"n_sf": 0.0, "p_sf": 0.1, "window": placeholder(float)})
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
