"""Throughput benchmarks; each script prints one JSON line per result."""
