"""Benchmarks: runnable scripts (`python -m benchmarks.NAME --help`) that print JSON."""
