"""How a small CPU computation reaches XLA: inline in the calling thread, or not.

JAX's CPU client dispatches asynchronously by default: a call hands its program to a worker
thread and the caller waits for the outputs when it reads them. For one plan (a program of
~30-60 µs) that handoff costs ~35-40 µs a call on the 2-core CPU of the benchmarks
(docs/performance.md, thirty-second and thirty-third rounds). Two ways around it:

- :func:`inline_cpu_dispatch`: the process's own CPU client runs every computation inline
  (``jax_cpu_enable_async_dispatch=False``), set before JAX's backend starts.
- :func:`synchronous_cpu_device`: a device of a second, private CPU client made synchronous
  (``asynchronous=False``), on which :func:`libratio_jax.evaluate` runs one host plan's
  program when the process's client is asynchronous; nothing else runs there, and no array
  of it leaves ``evaluate`` (one plan's metrics come back as NumPy arrays).
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np

ENV_SWITCH = "LIBRATIO_SYNC_CPU"  # "0": one plan through JAX's own client, as it dispatches


def inline_cpu_dispatch() -> bool:
    """Run this process's CPU computations inline in the calling thread rather than through
    JAX's asynchronous dispatch (``jax_cpu_enable_async_dispatch=False``). One plan does not
    need it (:func:`libratio_jax.evaluate` runs it synchronously either way, see
    :func:`synchronous_cpu_device`); small batches do (a server step of a few plans: the
    asynchronous path pays about 1 µs per argument and output buffer and a fixed handoff per
    call, and nothing is gained by overlapping Python with a computation that short). Also
    for large CPU batches with :func:`~libratio_jax.physics.host_memory.reuse_host_memory`,
    whose outputs the calling thread then allocates in the heap it keeps. JAX reads the
    setting when it starts its CPU backend: call this before the process's first
    computation. Returns whether it took effect (False once the backend is up; the setting
    is then left as it was). ``libratio serve`` calls it at start.

    Example (first lines of a server or a latency benchmark)::

        import libratio_jax as lj
        lj.inline_cpu_dispatch()
    """
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # a JAX without this check: try anyway
        pass
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def inline_dispatch() -> bool:
    """Whether this process's CPU client runs computations inline (:func:`inline_cpu_dispatch`)."""
    return not jax.config.read("jax_cpu_enable_async_dispatch")


def synchronous_cpu_device() -> jax.Device | None:
    """The device of a private CPU client that runs each computation in the calling thread,
    for one host plan's program while the process's own CPU client dispatches
    asynchronously; ``None`` where it is not wanted (:func:`wanted`) or cannot be made: a
    multi-process run (``jax.distributed``), or a jaxlib without such a client
    (``make_cpu_client(asynchronous=...)``, a JAX-internal module) or whose client fails a
    first small program: then JAX's own client, as it dispatches. Made at its first need,
    once per process (~10 ms with that first program, ~12 idle threads of its own).

    A ``jax.jit`` whose input and output shardings name this device compiles with its
    client and is called through JAX's C++ dispatch as usual; host arguments go to it
    directly, JAX arrays must be put there first (``jax.device_put(x, device)``). Measured
    (docs/performance.md, thirty-third round): one plan with a format drawn per row
    ~104 -> ~69 µs a call.
    """
    return _private_client_device() if wanted() else None


def wanted() -> bool:
    """Whether one host plan should run on :func:`synchronous_cpu_device`: the process's
    own CPU client dispatches asynchronously, and ``LIBRATIO_SYNC_CPU`` is not ``0``."""
    return not inline_dispatch() and os.environ.get(ENV_SWITCH, "1").strip() != "0"


_MAKING = threading.Lock()  # one private client per process, threads racing to make it


def _private_client_device() -> jax.Device | None:
    with _MAKING:
        if not _MADE:
            _MADE.append(_made_device())
        return _MADE[0]


_MADE: list = []  # [the device or None], once made


def _made_device() -> jax.Device | None:
    if jax.process_count() > 1:  # (its device would be process 0's: not this process's)
        return None
    try:
        from jax._src.lib import xla_client
        device = xla_client.make_cpu_client(asynchronous=False, num_devices=1).devices()[0]
        # What lj.evaluate does with it, once: a jit compiled for it, a JAX array put there
        on_device = jax.sharding.SingleDeviceSharding(device)
        first = jax.jit(lambda x, y: x + y, in_shardings=on_device, out_shardings=on_device)
        if int(first(jax.device_put(np.int32(1), device), np.int32(2))) != 3:
            return None
        return device
    except Exception:  # (ImportError, TypeError, XlaRuntimeError...): a JAX without it
        return None
