"""Benchmarks behind the docs' claims table (``benchmarks/claims/table.py``)."""
