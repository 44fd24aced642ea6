"""Benchmarks: ``make bench`` (``python -m bench``) runs them all and writes docs/benchmarks.md."""
