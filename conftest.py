"""Test-session settings, loaded by pytest before any test module imports JAX.

The suite is dominated by XLA compile time (hundreds of small programs, each run a few
times), so it runs with most XLA optimizations off (``JAX_DISABLE_MOST_OPTIMIZATIONS``): about
30% faster on the 2-core CI machine. Results are the same physics (the parity, jit-vs-eager and
determinism tests run under it); benchmarks and users run fully optimized. Set the variable
yourself to override.
"""

import os

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
