"""Datasets as in-memory arrays, and client partitions as index arrays."""

from fedjax_pan.data.partition import (SCHEMES, PartitionError, client_label_counts,
                                       partition, plot_label_distribution, stats_table)
from fedjax_pan.data.sources import (DATASETS, NORMALIZATION, Dataset, DataError, load,
                                     normalize, read_idx, subset, synthetic)

__all__ = [
    "DATASETS", "SCHEMES", "PartitionError", "Dataset", "DataError", "NORMALIZATION", "load",
    "normalize", "read_idx", "subset", "synthetic", "partition", "client_label_counts",
    "stats_table", "plot_label_distribution",
]
