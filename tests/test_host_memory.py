"""``lj.reuse_host_memory``: large outputs reuse the heap's pages instead of fresh mappings.

The setting is process-wide, so the allocator is observed in a child process: where an
output's buffer lies (``/proc/self/maps``: glibc's main heap is the ``[heap]`` mapping) and
how far that heap grows over calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import host_memory

# A child process on the CPU with inline dispatch (as the setting asks): an 80 MB output of a
# jitted function of two kernels (with asynchronous dispatch, JAX's worker threads would
# allocate it: measured, the test then fails), whether its buffer lies in the main heap, by
# default and on four calls after ``reuse_host_memory``, and the heap's size after each.
_CHILD = r"""
import json
import numpy as np
import jax
import jax.numpy as jnp
import libratio_jax as lj

def heap():  # (start, end) of glibc's main heap
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            return start, end
    return 0, 0

def in_heap(array):
    start, end = heap()
    return start <= array.unsafe_buffer_pointer() < end

inline = lj.inline_cpu_dispatch()
fn = jax.jit(lambda x: jnp.sin(x) - jnp.mean(jnp.cos(x)))
x = jax.device_put(np.ones(20_000_000, np.float32))
out = fn(x)
default = in_heap(out)
value_before = float(out[-1])
out.delete()
applied = lj.reuse_host_memory()
after, heap_bytes = [], []
for _ in range(4):
    out = fn(x)
    after.append(in_heap(out))
    heap_bytes.append(heap()[1] - heap()[0])
    value = float(out[-1])
    out.delete()
print(json.dumps(dict(inline=inline, applied=applied, bytes=x.nbytes, default=default,
                      after=after, heap_bytes=heap_bytes, values=[value_before, value])))
"""


@pytest.mark.skipif(not (host_memory.glibc() and os.path.exists("/proc/self/maps")),
                    reason="glibc on Linux only")
def test_large_outputs_leave_mmap_for_the_heap():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inline"] is True and got["applied"] is True
    want = float(np.sin(np.float32(1)) - np.cos(np.float32(1)))
    assert got["values"][0] == got["values"][1] and abs(got["values"][0] - want) < 1e-5
    # By default the 80 MB output is a mapping of its own; with the setting it comes from the
    # main heap, whose pages later calls reuse: the heap stops growing (a freed output may
    # come back to the heap a call late, so the first two calls can take two outputs' room).
    assert got["default"] is False, got
    assert all(got["after"]), got
    assert got["heap_bytes"][-1] - got["heap_bytes"][1] < got["bytes"] // 2, got


def test_not_applied_without_glibc(monkeypatch):
    def not_glibc(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    def no_libc(*args, **kwargs):
        raise AssertionError("the C library must not be loaded")

    monkeypatch.setattr(host_memory.os, "confstr", not_glibc)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory.glibc() is False
    assert lj.reuse_host_memory() is False
