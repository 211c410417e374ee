"""fedjax_pan: federated-learning simulation in JAX/Flax with Position-Aware Neurons.

The layers, bottom to top (each imports only from its own or lower ones; tests/test_layers.py):

    errors, references, rules, workdir   foundations: errors, citations, config rules, files
    pan/                                  the PAN method: encodings, permutations, matching
    data/, models/                        datasets and partitions; flax networks with PANs
    engine/                               the round contract, execution, Simulation, services
    algorithms/                           FedAvg's family, personalised FL, aggregation rules,
                                          robust FL (attacks, Siren, FLChain), uploads
                                          (compression, DP), the cross-cutting features
    config/                               the default config and its schema, derived from
                                          the algorithms' and features' entries
    run/, analysis/, fidelity             from a config to a run, the command line
                                          (`python -m fedjax_pan`); analyses; the references
"""

from fedjax_pan import _moved

_moved.install()  # old import paths (before the layer folders) keep working for a release

from fedjax_pan import data  # noqa: E402
from fedjax_pan import models
from fedjax_pan import pan
from fedjax_pan.pan import permutation

__version__ = "0.2.0"
__all__ = ["data", "models", "pan", "permutation", "__version__"]
