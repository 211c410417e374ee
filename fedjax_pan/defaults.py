"""The default run configuration every config file starts from (SPEC 3 hyper-parameters).

Unset optional values are typed placeholders (None) so they can still be set from the
command line, e.g. `--config.partition.min_size=10`.
"""

import copy
from typing import Any, Mapping

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
        "test_fraction": 0.0})
    c.local = ml_collections.ConfigDict({"epochs": 5.0, "batch_size": 64, "mode": "epochs",
                                         "local_steps": placeholder(int)})
    # warmup 'rounds' / 'steps' ramps the rate up over warmup_length of them; 'halving'
    # halves it every warmup_length rounds instead (the SageFlow authors' lrdecay).
    c.optimizer = ml_collections.ConfigDict({
        "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-5, "grad_clip": 100.0,
        "warmup": "rounds", "warmup_length": 10})
    c.server = ml_collections.ConfigDict({"optimizer": "sgd", "lr": 1.0, "momentum": 0.0})
    # rule: 'mean' (weighted by `weights`), or robust 'median' / 'trimmed_mean' (cut `trim`
    # of the clients at each end, per coordinate), 'multi_krum' (tolerating `byzantine`
    # clients a round, averaging the `krum_keep` best; None: all but `byzantine`) or
    # 'geometric_median' (RFA), each over the round's outputs (engine/robust.py).
    # Model-space rules on the server's held-out public set (dataset.public_size, 1,000
    # by default): 'zeno' (keep all but `byzantine` by descent on it, less rho times the
    # squared step), 'sageflow' (entropy filter, loss weights, staleness groups; gamma
    # halves every gamma_period rounds when clients can be late) and 'fedasync' (mixing
    # weight times s(staleness), s polynomial, hinge or constant) (engine/staleness.py).
    c.aggregation = ml_collections.ConfigDict({
        "weights": "uniform", "bn": "mean", "rule": "mean", "trim": 0.1, "byzantine": 0,
        "krum_keep": placeholder(int),
        "zeno": {"rho": 5e-4},
        "sageflow": {"entropy_threshold": 1.0, "delta": 1.0, "lam": 0.5,
                     "gamma_period": 20, "min_weight": 1e-3},
        "fedasync": {"mixing": 0.6, "staleness": "polynomial", "a": 0.5, "b": 4.0}})
    # Clients that answer late (engine/timing.py): delays uniform over {0..max_delay}, or
    # 'slow': a slow_share of the clients always max_delay late; the server waits for
    # all, waits for wait_share, ignores late outputs, or uses them stale. 0: none.
    # forced: delays given to the first free clients of each round in a random order from
    # (seed, round) (the SageFlow authors' (0, 1, 2): every staleness group gets one), the
    # rest drawn.
    c.straggler = ml_collections.ConfigDict({"max_delay": 0, "delays": "uniform",
                                             "slow_share": 0.2, "policy": "stale",
                                             "wait_share": 0.5, "forced": ()})
    # Malicious clients (algorithms/attacks.py): `fraction` of them, drawn once per seed
    # (draw 'fixed'), or exactly int(M fraction) of each round's cohort of M ('per_round',
    # the SageFlow authors'), from round start_round; scale unset: the kind's default
    # (model_poisoning 0.1, sign_flip 4, gaussian 1, backdoor's boost 10); backdoor: `poisoned` of each batch
    # carry the pattern and label `target`.
    c.attack = ml_collections.ConfigDict({"kind": "none", "fraction": 0.2, "start_round": 0,
                                          "scale": placeholder(float), "target": 2,
                                          "poisoned": 20 / 64, "draw": "fixed"})
    # What clients send and receive (compression.py, algorithms/compressed.py): method
    # 'none', 'top_k' / 'random_k' (keep `ratio` of each layer), 'qsgd' (`levels`), 'sign',
    # 'quantize' (`bits`), or the post-training masks 'magnitude_mask' / 'importance_mask'
    # (keep `ratio` of each layer's weights: the model is sent, not its update);
    # quantize_bits > 0 quantises the values a sparsifier keeps; error_feedback keeps the
    # sender's residual. vote: majority vote over sign messages. mask_before: the slides'
    # pre-training mask ('magnitude' or 'importance', keeping `ratio`) whose other weights
    # an L1 term of strength mask_l1 pushes to 0 during local training.
    method = {"method": "none", "ratio": 0.1, "levels": 16, "bits": 8, "quantize_bits": 0,
              "error_feedback": False}
    c.compression = ml_collections.ConfigDict({
        "upload": dict(method), "download": dict(method), "vote": False,
        "mask_before": "none", "mask_l1": 1e-4})
    # DP-FedAvg (algorithms/dp.py) when clip > 0: updates clipped to `clip` (adaptive: its
    # start, moved towards the `quantile` of update norms at rate clip_lr, counting noise
    # count_std, None: m / 20), noise multiplier z on the sum, epsilon at `delta` logged
    # each evaluated round (privacy.py).
    c.privacy = ml_collections.ConfigDict({
        "clip": 0.0, "noise_multiplier": 0.0, "delta": 1e-5, "adaptive": False,
        "quantile": 0.5, "clip_lr": 0.2, "count_std": placeholder(float)})
    # 'uniform': round(R K) clients a round; 'poisson': each client with probability R;
    # 'auto': Poisson under DP-FedAvg (privacy.clip > 0; its analysis), else uniform.
    c.sampling = "auto"
    # client_states: where the K clients' persistent states live, 'auto' (by size:
    # device, host, then disk) or one of 'device', 'host', 'disk' (engine/store.py).
    c.execution = ml_collections.ConfigDict({"strategy": "auto",
                                             "block_size": placeholder(int),
                                             "client_states": "auto"})
    # local: also log each client's expected accuracy on a test set with its label mix.
    # finetune_epochs > 0: before each evaluation every client trains the model it is
    # scored on for this many epochs of its own data (FedAvg-C; algorithms/finetune.py).
    c.eval = ml_collections.ConfigDict({"every": 1, "batch_size": 1000, "local": False,
                                        "finetune_epochs": 0.0})
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
