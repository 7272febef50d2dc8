"""Benchmarks: the cost of observing (run.py), the host-read counter, the GPU check."""
