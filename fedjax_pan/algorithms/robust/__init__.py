"""Federated learning under adversaries and without a trusted server: malicious clients
(`attacks`), Siren's proactive alarms, FLChain's ledger-kept rounds."""
