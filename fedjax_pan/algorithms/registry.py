"""Builds a configured algorithm by name; the engine itself never sees these names.

Each algorithm owns a config namespace `config.<name>` (its `OPTIONS`, checked by its
`RULES`); `defaults.default_config` and `schema.RULES` are assembled from this table, so
neither knows any algorithm's options.
"""

from __future__ import annotations

from typing import Any, Dict

import flax.linen as nn
import optax

from fedjax_pan.algorithms import aggregation, core, stragglers
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.personal.apfl import ENTRY as APFL
from fedjax_pan.algorithms.personal.apple import ENTRY as APPLE
from fedjax_pan.algorithms.personal.ditto import ENTRY as DITTO
from fedjax_pan.algorithms.fedavg_family.fed2 import ENTRY as FED2
from fedjax_pan.algorithms.personal.fedala import ENTRY as FEDALA
from fedjax_pan.algorithms.personal.fedcp import ENTRY as FEDCP
from fedjax_pan.algorithms.personal.fedda import ENTRY as FEDDA
from fedjax_pan.algorithms.personal.fedpac import ENTRY as FEDPAC
from fedjax_pan.algorithms.personal.gpfl import ENTRY as GPFL
from fedjax_pan.algorithms.personal.feddbe import ENTRY as FEDDBE
from fedjax_pan.algorithms.personal.fedcac import ENTRY as FEDCAC
from fedjax_pan.algorithms.personal.fedas import ENTRY as FEDAS
from fedjax_pan.algorithms.personal.fedcross import ENTRY as FEDCROSS
from fedjax_pan.algorithms.personal.fedbabu import ENTRY as FEDBABU
from fedjax_pan.algorithms.personal.fedgc import ENTRY as FEDGC
from fedjax_pan.algorithms.fedavg_family.fedlc import ENTRY as FEDLC
from fedjax_pan.algorithms.fedavg_family.fedntd import ENTRY as FEDNTD
from fedjax_pan.algorithms.personal.fedfomo import ENTRY as FEDFOMO
from fedjax_pan.algorithms.personal.fedamp import ENTRY as FEDAMP
from fedjax_pan.algorithms.personal.fedphp import ENTRY as FEDPHP
from fedjax_pan.algorithms.personal.fedproto import ENTRY as FEDPROTO
from fedjax_pan.algorithms.personal.fd import ENTRY as FD
from fedjax_pan.algorithms.personal.fml import ENTRY as FML
from fedjax_pan.algorithms.personal.fedkd import ENTRY as FEDKD
from fedjax_pan.algorithms.personal.fedgh import ENTRY as FEDGH
from fedjax_pan.algorithms.personal.fedpcl import ENTRY as FEDPCL
from fedjax_pan.algorithms.fedavg_family.fedgen import ENTRY as FEDGEN
from fedjax_pan.algorithms.fedavg_family.fedavg import REFERENCE as FEDAVG_REFERENCE, fedavg
from fedjax_pan.algorithms.personal.fedmtl import ENTRY as FEDMTL
from fedjax_pan.algorithms.fedavg_family.feddyn import ENTRY as FEDDYN
from fedjax_pan.algorithms.fedavg_family.fedma import ENTRY as FEDMA
from fedjax_pan.algorithms.robust.flchain import ENTRY as FLCHAIN
from fedjax_pan.algorithms.fedavg_family.fedprox import ENTRY as FEDPROX
from fedjax_pan.algorithms.personal.fedrep import ENTRY as FEDREP
from fedjax_pan.algorithms.personal.fedrod import ENTRY as FEDROD
from fedjax_pan.algorithms.personal.ktpfl import ENTRY as KTPFL
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.algorithms.fedavg_family.moon import ENTRY as MOON
from fedjax_pan.algorithms.personal.partialfed import ENTRY as PARTIALFED
from fedjax_pan.algorithms.personal.perfedavg import ENTRY as PERFEDAVG
from fedjax_pan.algorithms.personal import ENTRIES as PERSONAL
from fedjax_pan.algorithms.personal.pfedeff import ENTRY as PFEDEFF
from fedjax_pan.algorithms.personal.pfedme import ENTRY as PFEDME
from fedjax_pan.algorithms.fedavg_family.scaffold import ENTRY as SCAFFOLD
from fedjax_pan.algorithms.robust.siren import ENTRY as SIREN

SERVER_OPTIMIZERS = ("sgd", "adam", "yogi")


def server_optimizer(name: str, learning_rate: float, momentum: float = 0.0,
                     b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3
                     ) -> optax.GradientTransformation:
    """sgd(lr=1, momentum=0) is FedAvg; sgd with momentum FedAvgM; adam/yogi FedAdam/FedYogi."""
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=momentum or None)
    if name == "adam":
        return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "yogi":
        return optax.yogi(learning_rate, b1=b1, b2=b2, eps=eps)
    raise ValueError(f"unknown server optimizer {name!r}; expected one of {SERVER_OPTIMIZERS}")


def _fedavg(model, cfg, client_tx, server_tx):
    return fedavg(model, client_tx, server_tx, bn=cfg.aggregation.bn)


ALGORITHMS: Dict[str, AlgorithmEntry] = {
    "fedavg": AlgorithmEntry(_fedavg, {}, {}, reference=FEDAVG_REFERENCE),
    "fedprox": FEDPROX,
    "scaffold": SCAFFOLD,
    "moon": MOON,
    "feddyn": FEDDYN,
    "fed2": FED2,
    "fedma": FEDMA,
    **PERSONAL,  # local, fedper, lg_fedavg, fedbn
    "fedrep": FEDREP,
    "ditto": DITTO,
    "apfl": APFL,
    "apple": APPLE,
    "perfedavg": PERFEDAVG,
    "pfedme": PFEDME,
    "fedrod": FEDROD,
    "fedala": FEDALA,
    "fedcp": FEDCP,
    "fedda": FEDDA,
    "fedpac": FEDPAC,
    "gpfl": GPFL,
    "feddbe": FEDDBE,
    "fedcac": FEDCAC,
    "fedas": FEDAS,
    "fedcross": FEDCROSS,
    "fedbabu": FEDBABU,
    "fedlc": FEDLC,
    "fedntd": FEDNTD,
    "fedgc": FEDGC,
    "fedfomo": FEDFOMO,
    "fedamp": FEDAMP,
    "fedphp": FEDPHP,
    "fedproto": FEDPROTO,
    "fd": FD,
    "fml": FML,
    "fedkd": FEDKD,
    "fedgh": FEDGH,
    "fedpcl": FEDPCL,
    "fedgen": FEDGEN,
    "fedmtl": FEDMTL,
    "partialfed": PARTIALFED,
    "pfedeff": PFEDEFF,
    "ktpfl": KTPFL,
    "siren": SIREN,
    "flchain": FLCHAIN,
}


def client_tx(cfg: Any) -> optax.GradientTransformation:
    """The clients' local optimiser `cfg.optimizer` describes."""
    opt = cfg.optimizer
    return client_optimizer(opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip, opt.warmup,
                            opt.warmup_length)


def public_size(cfg: Any, num_train: int) -> int:
    """The training examples held out as unlabelled public data: `dataset.public_size`,
    or where that is 0 the default of an algorithm that distils on public data (at most a
    fifth of the `num_train` training examples)."""
    if cfg.dataset.public_size:
        return int(cfg.dataset.public_size)
    default = int(ALGORITHMS[cfg.algorithm].public)
    if cfg.aggregation.rule in aggregation.public_rules():
        default = max(default, aggregation.PUBLIC_SIZE)
    return min(default, num_train // 5)


def from_config(model: nn.Module, cfg: Any, public: Any = None, public_labels: Any = None,
                input_shape: Any = None) -> FederatedAlgorithm:
    """The algorithm `cfg.algorithm` for `model`, configured by `cfg`, with the
    aggregation rule it names (the features add the rest: `algorithms.features`); `public`:
    the public images held out at the server (`public_labels` their labels: the rules that
    are `public` in `aggregation.RULES` score models on them); `input_shape`: one
    example's (H, W, C), for algorithms that build a network of their own."""
    if cfg.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.algorithm!r}; available: {sorted(ALGORITHMS)}")
    server = cfg.server
    server_tx = server_optimizer(server.optimizer, server.lr, server.momentum)
    entry = ALGORITHMS[cfg.algorithm]
    extra: Dict[str, Any] = {}
    if entry.public:
        if public is None or len(public) == 0:
            raise ValueError(f"{cfg.algorithm} distils on unlabelled public data: set "
                             f"dataset.public_size > 0 (a held-out slice of the training set)")
        extra["public"] = public
    if entry.input_shape:
        if input_shape is None:
            raise ValueError(f"{cfg.algorithm} builds a network of its own: it needs the "
                             f"input shape")
        extra["input_shape"] = tuple(input_shape)
    algorithm = entry.build(model, cfg, client_tx(cfg), server_tx, **extra)
    agg = cfg.aggregation
    if agg.rule != "mean":
        if algorithm.aggregator is not core.weighted_mean:
            raise ValueError(f"{cfg.algorithm} aggregates its outputs its own way; "
                             f"aggregation.rule must be 'mean', got {agg.rule!r}")
        rule = aggregation.from_config(cfg, model, public, public_labels,
                                       late=stragglers.late(cfg))
        if rule.space == "model" and algorithm.model_view is None:
            raise ValueError(f"aggregation.rule={agg.rule!r} combines models, and "
                             f"{cfg.algorithm}'s output is not a model or an update")
        algorithm = algorithm._replace(aggregator=rule)
    return algorithm
