"""Testing aids shipped with the package: :mod:`.reference`, the physics of ``evaluate`` as
plain Python loops (double precision), the independent oracle of the parity tests and the
per-plan baseline of ``benchmarks/evaluate_throughput.py``."""
