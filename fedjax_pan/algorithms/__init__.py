"""Federated algorithms, each a `FederatedAlgorithm` of small pure functions."""

from fedjax_pan.algorithms.core import ClientContext, FederatedAlgorithm, no_client_state
from fedjax_pan.algorithms.fedavg import fedavg
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.algorithms.registry import ALGORITHMS, from_config, server_optimizer

__all__ = ["ClientContext", "FederatedAlgorithm", "no_client_state", "fedavg", "client_optimizer",
           "server_optimizer", "ALGORITHMS", "from_config"]
