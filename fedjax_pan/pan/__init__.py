"""The PAN method: Position-Aware Neurons' encodings (`encoding`, re-exported here),
neuron permutations with their specs per architecture (`permutation`), and neuron
matching (`matching`)."""

from fedjax_pan.pan.encoding import *  # noqa: F401,F403

