"""What the benchmarks share: provenance stamps, run helpers, ``--set`` overrides."""
