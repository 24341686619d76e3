"""Benchmarks: each prints a table and a final ratio line against a baseline timed in the same run."""
