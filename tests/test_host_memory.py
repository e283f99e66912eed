"""``lj.reuse_host_memory``: large outputs reuse the heap's pages instead of fresh mappings.

The setting is process-wide, so the allocator is observed in a child process: glibc's
``mallinfo2`` (glibc >= 2.33) says how many bytes are currently served by ``mmap``
(``hblkhd``).
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


def _glibc_version() -> tuple[int, ...]:
    if not host_memory.glibc():
        return ()
    return tuple(int(v) for v in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])


# A child process on the CPU with inline dispatch (as the setting asks): an 80 MB output of a
# jitted function of two kernels (with asynchronous dispatch, JAX's worker threads would
# allocate it: measured, the test then fails), the bytes mapped with the output alive before
# and after ``reuse_host_memory``, and with none alive.
_CHILD = r"""
import ctypes, json, time
import numpy as np
import jax
import jax.numpy as jnp
import libratio_jax as lj

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
inline = lj.inline_cpu_dispatch()
fn = jax.jit(lambda x: jnp.sin(x) - jnp.mean(jnp.cos(x)))
x = jax.device_put(np.ones(20_000_000, np.float32))

def mapped_after_free(above):
    # The bytes mapped once a freed output's mapping is gone (JAX frees it when it gets to
    # it: waited for, up to 30 s, while more than `above` bytes stay mapped).
    deadline = time.monotonic() + 30.0
    while libc.mallinfo2().hblkhd > above and time.monotonic() < deadline:
        time.sleep(0.01)
    return libc.mallinfo2().hblkhd

out = fn(x)
mapped_before = libc.mallinfo2().hblkhd
value_before = float(out[-1])
out.delete()
# (the input, 80 MB on the device, is a mapping too)
mapped_idle = mapped_after_free(mapped_before - x.nbytes // 2)
applied = lj.reuse_host_memory()
mapped = []
for _ in range(3):
    out = fn(x)
    mapped.append(libc.mallinfo2().hblkhd)
    value = float(out[-1])
    out.delete()
print(json.dumps(dict(inline=inline, applied=applied, bytes=x.nbytes,
                      mapped_before=mapped_before, mapped_idle=mapped_idle,
                      mapped_after=mapped, values=[value_before, value])))
"""


@pytest.mark.skipif(_glibc_version() < (2, 33), reason="glibc >= 2.33 (mallinfo2) only")
def test_large_outputs_leave_mmap_for_the_heap():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inline"] is True and got["applied"] is True
    want = float(np.sin(np.float32(1)) - np.cos(np.float32(1)))
    assert got["values"][0] == got["values"][1] and abs(got["values"][0] - want) < 1e-5
    # By default the 80 MB output is a mapping of its own; with the setting every later
    # output of that size comes from the heap (what stays mapped is less than half of one).
    half = got["bytes"] // 2
    assert got["mapped_before"] - got["mapped_idle"] > half, got
    assert all(m - got["mapped_idle"] < half for m in got["mapped_after"]), got


def test_not_applied_without_glibc(monkeypatch):
    def not_glibc(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    def no_libc(*args, **kwargs):
        raise AssertionError("the C library must not be loaded")

    monkeypatch.setattr(host_memory.os, "confstr", not_glibc)
    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory.glibc() is False
    assert lj.reuse_host_memory() is False
