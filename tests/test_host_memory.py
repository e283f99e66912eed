"""``lj.reuse_host_memory``: large outputs reuse the heap's pages instead of fresh mappings.

The setting is process-wide, so the allocator is observed in a child process: where an
output's buffer lies (``/proc/self/maps``: glibc's main heap is the ``[heap]`` mapping) and
whether the heap keeps that memory once the output is freed (waited for with ``mallinfo2``:
JAX may free a deleted output later, on one of its threads).
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
# default and on four calls after ``reuse_host_memory`` (each output's free waited for), the
# heap's size after each and once the last output is freed.
_CHILD = r"""
import ctypes, json, time
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

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2

def wait_for_free(free_before, size):
    # JAX may free a deleted output later, on one of its threads: wait (up to 30 s) until the
    # main heap holds `size` more free bytes than before, so that the next call can take them
    deadline = time.monotonic() + 30.0
    while mallinfo2().fordblks < free_before + size and time.monotonic() < deadline:
        time.sleep(0.001)

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
    free_before = mallinfo2().fordblks
    out.delete()
    if after[-1]:  # (an output from a mapping of its own is unmapped when freed)
        wait_for_free(free_before, x.nbytes)
kept = heap()[1] - heap()[0]  # once the last output is freed
print(json.dumps(dict(inline=inline, applied=applied, bytes=x.nbytes, default=default,
                      after=after, heap_bytes=heap_bytes, kept=kept,
                      values=[value_before, value])))
"""


def _glibc_version() -> tuple[int, ...]:
    if not host_memory.glibc():
        return ()
    return tuple(int(v) for v in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])


@pytest.mark.skipif(_glibc_version() < (2, 33) or not os.path.exists("/proc/self/maps"),
                    reason="glibc >= 2.33 (mallinfo2) on Linux only")
def test_large_outputs_leave_mmap_for_the_heap():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inline"] is True and got["applied"] is True
    want = float(np.sin(np.float32(1)) - np.cos(np.float32(1)))
    assert got["values"][0] == got["values"][1] and abs(got["values"][0] - want) < 1e-5
    # By default the 80 MB output is a mapping of its own; with the setting it comes from the
    # main heap, which keeps the memory once it is freed (not trimmed: mapped pages for the
    # next call). (How many outputs the heap holds depends on when JAX frees them: on a
    # loaded machine a call can come before the last output's free, not asserted here.)
    assert got["default"] is False, got
    assert all(got["after"]), got
    assert got["kept"] >= got["heap_bytes"][-1] - got["bytes"] // 2, got


def test_not_applied_without_glibc(monkeypatch):
    def not_glibc(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    def no_libc(*args, **kwargs):
        raise AssertionError("the C library must not be loaded")

    monkeypatch.setattr(host_memory.os, "confstr", not_glibc)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory.glibc() is False
    assert lj.reuse_host_memory() is False
