"""Builds a configured algorithm by name; the engine itself never sees these names."""

from __future__ import annotations

from typing import Any, Callable, Dict

import flax.linen as nn
import optax

from fedjax_pan.algorithms.core import FederatedAlgorithm
from fedjax_pan.algorithms.fedavg import BN_MODES, fedavg
from fedjax_pan.algorithms.local import WARMUPS, client_optimizer

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


def _fedavg(model: nn.Module, cfg: Any) -> FederatedAlgorithm:
    opt, server = cfg.optimizer, cfg.server
    return fedavg(model,
                  client_optimizer(opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip),
                  server_optimizer(server.optimizer, server.lr, server.momentum),
                  warmup=opt.warmup, warmup_length=opt.warmup_length, bn=cfg.aggregation.bn)


ALGORITHMS: Dict[str, Callable[[nn.Module, Any], FederatedAlgorithm]] = {"fedavg": _fedavg}
OPTIONS = {"warmup": WARMUPS, "bn": BN_MODES, "server": SERVER_OPTIMIZERS}


def from_config(model: nn.Module, cfg: Any) -> FederatedAlgorithm:
    """The algorithm `cfg.algorithm` for `model`, configured by `cfg`."""
    if cfg.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.algorithm!r}; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[cfg.algorithm](model, cfg)
