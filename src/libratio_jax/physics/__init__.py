"""The physics kernel: pure functions of arrays (formats, hardware, architectures, memory,
throughput, stability, safety) composed by :func:`kernel.evaluate`."""
