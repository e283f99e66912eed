"""Keep the host memory of large outputs for the next call (glibc's ``malloc``, opt-in).

A full-resolution batch with ``layer_stability`` returns a fresh ``float32[B, M, L]`` array
(420 MB at 65,536 plans of the reference scenario), which XLA's CPU client allocates with
``malloc``. glibc serves a block that large with a fresh ``mmap`` and unmaps it when it is
freed, so every call pays the kernel for zeroing new pages (~20-50 ms of system time a call
at 65,536 plans on the 2-core CPU of the benchmarks). :func:`reuse_host_memory` makes the
main heap serve large blocks and keep what is freed there, so that the next call's output
reuses pages already mapped. docs/performance.md (thirty-first round) has the measurements.
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (<malloc.h>).
M_TRIM_THRESHOLD = -1  # free memory at the main heap's top kept up to this many bytes
M_MMAP_MAX = -4  # the most blocks served by mmap at once (0: none)
# The largest trim threshold mallopt takes (a C int): 2 GiB - 1 of freed memory kept.
KEPT_BYTES = 2**31 - 1


def glibc() -> bool:
    """Whether this process's C library is glibc (where :func:`reuse_host_memory` applies)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no such name (not glibc), or no confstr
        return False


def reuse_host_memory() -> bool:
    """Make this process's ``malloc`` (glibc) keep the memory of large freed blocks for the
    next allocation instead of returning it to the kernel: blocks of any size come from the
    main heap (``M_MMAP_MAX = 0``) and up to ``KEPT_BYTES`` freed at its top stay mapped
    (``M_TRIM_THRESHOLD``). For repeated large batches on the CPU, above all full-resolution
    ones with ``layer_stability``: their output then reuses pages already mapped rather than
    fresh ones the kernel must zero (65,536 plans of the reference scenario on the 2-core CPU
    of the benchmarks, alternating processes: ~70-80 -> ~54-64 ms a call; the README's
    throughput table). The cost: the process keeps its peak heap, which a loop calling
    ``lj.evaluate`` on batches of one shape needs again at its next call anyway, and memory
    freed below a block still in use stays in the heap too (fragmentation can hold more).

    It helps the outputs that the calling thread allocates, i.e. with
    :func:`inline_cpu_dispatch`. With JAX's default asynchronous dispatch the outputs are
    allocated on JAX's worker threads, in glibc arenas of their own that map every block
    above their 64 MB heaps afresh whatever this says (glibc's ``sysmalloc``); limiting the
    process to one arena would route them here too, but it made the threads' other
    allocations contend (65,536 plans without ``layer_stability``: ~19 -> ~31 ms a call), so
    this does not. A process-wide setting that can be made at any time, never undone.
    Returns whether it was applied: False where the C library is not glibc (nothing changed)
    or, should glibc refuse a setting, when it was not fully applied.

    Example (first lines of a training script that evaluates large batches)::

        import libratio_jax as lj
        lj.inline_cpu_dispatch()
        lj.reuse_host_memory()
    """
    if not glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1
               for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEPT_BYTES)))
