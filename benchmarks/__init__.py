"""Speed measurements of the fedjax_pan engine against a naive per-batch JAX loop.

Entry point: `python -m benchmarks.run --suite cpu --out DIR` (see `benchmarks/run.py`).
Modules: `suites` (the measurements), `naive` (the baseline), `report` (table, markdown,
targets).
"""
