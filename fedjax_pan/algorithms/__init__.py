"""Federated algorithms, each a `FederatedAlgorithm` of small pure functions: FedAvg's
family (`fedavg_family/`), personalised FL (`personal/`), aggregation rules
(`aggregation/`), FL under adversaries and without a trusted server (`robust/`), what
clients send (`uploads/`), and the cross-cutting features that wrap any of them
(`features`); `registry` names them for the config."""

from fedjax_pan.algorithms.aggregation import (fedasync, geometric_median, median,
                                               multi_krum, sageflow, trimmed_mean, zeno)
from fedjax_pan.algorithms.robust.attacks import Attack, with_attack
from fedjax_pan.algorithms.uploads.compressed import with_compression
from fedjax_pan.algorithms.core import (Aggregator, ClientContext, FederatedAlgorithm,
                                        RoundInfo, no_client_state, tree_bytes,
                                        weighted_mean, weighted_sum)
from fedjax_pan.algorithms.uploads.dp import AdaptiveClip, with_dp
from fedjax_pan.algorithms.fedavg_family.fed2 import fed2
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.algorithms.fedavg_family.fedprox import fedprox
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.algorithms.registry import ALGORITHMS, from_config, server_optimizer

__all__ = ["Aggregator", "ClientContext", "FederatedAlgorithm", "RoundInfo", "median",
           "no_client_state", "tree_bytes", "trimmed_mean", "weighted_mean", "weighted_sum",
           "fed2", "fedavg", "fedprox", "client_optimizer", "server_optimizer", "ALGORITHMS",
           "from_config", "multi_krum", "geometric_median", "zeno", "fedasync", "sageflow",
           "Attack", "with_attack", "with_compression", "with_dp", "AdaptiveClip"]
