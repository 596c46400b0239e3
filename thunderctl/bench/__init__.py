"""Benchmarks: closed-loop agent load through the cluster and straight to its engines, and what it reports."""
