"""FedAvg and the algorithms that keep one global model (PFLlib's traditional FL): FedProx,
SCAFFOLD, MOON, FedDyn, Fed2, FedMA, FedGen, FedNTD, FedLC, and fine-tuning before
evaluation."""
