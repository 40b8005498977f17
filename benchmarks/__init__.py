"""EdgeFleet's benchmarks, a package beside ``edgefleet``: ``claims`` (the figures the docs'
claims table cites), ``perf`` (overheads and scaling), ``soak`` (long runs under faults) and
``lib`` (what they share: provenance, run helpers, ``--set``). Run one from the repository
root with ``python -m benchmarks <name> [args]`` (``python -m benchmarks`` lists them); see
``benchmarks/README.md``."""
