"""Overhead and scaling benchmarks."""
