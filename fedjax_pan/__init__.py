"""fedjax_pan: federated-learning simulation in JAX/Flax with Position-Aware Neurons."""

from fedjax_pan import data
from fedjax_pan import models
from fedjax_pan import pan
from fedjax_pan import permutation

__version__ = "0.1.0"
__all__ = ["data", "models", "pan", "permutation", "__version__"]
