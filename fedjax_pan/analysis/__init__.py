"""Neuron-alignment analyses of the PAN paper (Sect. 5.2, App. E) and Fed2 (Eqs. 9, 17).

weight divergence (Fig. 6), optimal-assignment matching (Fig. 7), class-preference vectors
(Fig. 8) with their layer-wise total variance, and the matching figures.
"""

from fedjax_pan.analysis.assignment import (assignment_matrix, diagonal_ratio, match_layer,
                                            neuron_representations, optimal_assignment)
from fedjax_pan.analysis.divergence import weight_divergence
from fedjax_pan.analysis.plots import plot_assignment, plot_divergence, plot_preferences
from fedjax_pan.analysis.preference import (class_agreement, layerwise_total_variance,
                                            neuron_classes, preference_vectors, total_variance)

__all__ = ["weight_divergence",
           "neuron_representations", "optimal_assignment", "assignment_matrix",
           "diagonal_ratio", "match_layer",
           "preference_vectors", "neuron_classes", "class_agreement", "total_variance",
           "layerwise_total_variance",
           "plot_assignment", "plot_preferences", "plot_divergence"]
