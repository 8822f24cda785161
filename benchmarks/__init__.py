"""Benchmarks: scripts that measure; results go to benchmarks/results/."""
