"""Datasets as in-memory arrays, and client partitions as index arrays."""

from fedjax_pan.data.partition import (SCHEMES, TEST_FRACTIONS, PartitionError,
                                       client_label_counts, noisy_clients, noisy_labels,
                                       partition, plot_label_distribution, split_clients,
                                       stats_table)
from fedjax_pan.data.sources import (AUTHORS_NORMALIZATION, DATASETS, GROUPED_DATASETS,
                                     NORMALIZATION, Dataset,
                                     DataError, channel_stats, load, normalization, normalize,
                                     read_idx, subset, synthetic)
from fedjax_pan.data.files import cinic10, femnist, gtsrb

__all__ = [
    "DATASETS", "GROUPED_DATASETS", "SCHEMES", "PartitionError", "Dataset", "DataError",
    "NORMALIZATION", "AUTHORS_NORMALIZATION", "load", "normalize", "normalization", "channel_stats", "read_idx",
    "subset", "synthetic", "partition", "split_clients", "TEST_FRACTIONS", "noisy_clients",
    "noisy_labels",
    "client_label_counts", "stats_table",
    "plot_label_distribution", "femnist", "gtsrb", "cinic10",
]
