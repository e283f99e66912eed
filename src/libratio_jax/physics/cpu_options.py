"""XLA compiler options of :func:`libratio_jax.evaluate`'s batch programs on the CPU.

XLA's CPU compiler prefers 256-bit vectors (``xla_cpu_prefer_vector_width``) even on a CPU
with AVX-512, for Intel's CPUs, whose clock can drop under 512-bit instructions. On an AMD
EPYC of family 26 (Zen 5, whose vector units are 512 bits wide) 512-bit vectors took 3-16%
less time in the batch programs (the forty-second round: the two forms compiled in one
process and timed alternately, 4,096 and 65,536 plans at full resolution and with merged
rows; docs/performance.md). The metrics are the same up to float rounding: bit for bit on
those batches, some sums a float32 ulp apart on others (the tests allow 1e-6). A batch of
one plan was not faster (0.336 against 0.351 ms) and keeps XLA's default, as does one
plan's own program.

:func:`batch_compiler_options` therefore asks for 512-bit vectors on an AMD CPU of family 26
or later with AVX-512 (the kind measured) and leaves XLA's default elsewhere: Intel's CPUs
and AMD's family 25 (Zen 4, whose AVX-512 runs on 256-bit halves) were not measured.
``LIBRATIO_VECTOR_WIDTH`` (``256`` or ``512``) sets the width for any CPU, to compare the
two on one machine; it is read when a program is first built (``lj.evaluate`` keeps a
program per batch shape: set it before the process's first batch of a shape).

Example:
    >>> from libratio_jax.physics import cpu_options
    >>> cpu_options.batch_compiler_options(cpu={"vendor_id": "GenuineIntel",
    ...                                         "flags": "avx2 avx512f"}, environ={})
    {}
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

ENV_SWITCH = "LIBRATIO_VECTOR_WIDTH"  # "256" or "512": this width on any CPU
WIDTHS = ("256", "512")


@functools.cache
def cpuinfo() -> dict:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none; read
    once per process)."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def batch_compiler_options(*, cpu: Mapping[str, str] | None = None,
                           environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The XLA compiler options of a batch program on this CPU: ``{"xla_cpu_prefer_vector_width":
    "512"}`` on an AMD CPU of family 26 or later with AVX-512, ``{}`` (XLA's defaults)
    elsewhere, or the width
    ``LIBRATIO_VECTOR_WIDTH`` names (a ``ValueError`` naming it for any other value). ``cpu``
    and ``environ`` stand for ``/proc/cpuinfo``'s fields and ``os.environ`` (tests)."""
    environ = os.environ if environ is None else environ
    width = environ.get(ENV_SWITCH, "").strip()
    if width:
        if width not in WIDTHS:
            raise ValueError(f"{ENV_SWITCH} must be one of {', '.join(WIDTHS)}, got {width!r}")
        return {"xla_cpu_prefer_vector_width": width}
    cpu = cpuinfo() if cpu is None else cpu
    family = cpu.get("cpu family", "")
    if (cpu.get("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= 26
            and "avx512f" in cpu.get("flags", "").split()):
        return {"xla_cpu_prefer_vector_width": "512"}
    return {}
