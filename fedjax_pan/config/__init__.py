"""The run configuration: every key's default (`defaults`) and the check of a whole config
against each key's rule (`schema`; rules are `fedjax_pan.rules`), both derived from the
algorithms' and features' entries."""
