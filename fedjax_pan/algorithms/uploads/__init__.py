"""What clients send: compression transforms with exact byte counts (`compression`, the
wrapper `compressed`) and client-level privacy (DP-FedAvg `dp`, its accountant
`privacy`)."""
