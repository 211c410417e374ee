"""The benchmark suite's sections, one module each (`benchmarks.suites` runs them)."""
