"""Test-only code: what tests, benchmarks and deploy scripts use, never shipped in the wheel.

The wheel packages ``edgefleet`` alone (pyproject's ``packages``); this package sits beside it
at the repository root, importable wherever the root is on ``sys.path`` (pytest's rootdir, an
editable install's path entry, ``python -m``). :mod:`fleetharness.faults`: deliberately bad
train replies, for testing the server's screening; :mod:`fleetharness.fleet`: Deployment-Engine
fleets (a SuperLink and SuperNodes on loopback) for tests, benchmarks and deploy scripts.
"""
