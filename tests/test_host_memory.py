"""``lj.reuse_host_memory``: large outputs reuse the heap's pages instead of fresh mappings.

The setting is process-wide, so the allocator is observed in a child process: glibc's
``mallinfo2`` says how many bytes are currently served by ``mmap`` (``hblkhd``).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

import libratio_jax as lj
from libratio_jax.physics import host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A child process: an 80 MB output of a jitted function (inline dispatch, as the setting
# asks): the bytes mapped with the output alive, before and after ``reuse_host_memory``,
# and with none alive.
_CHILD = r"""
import ctypes, json, time
import numpy as np
import jax
import libratio_jax as lj

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
inline = lj.inline_cpu_dispatch()
add = jax.jit(lambda x: x + 1.0)
x = jax.device_put(np.ones(20_000_000, np.float32))
def mapped_after_free(above):
    # The bytes mapped once a freed output's mapping is gone (JAX frees it when it gets to
    # it: waited for, up to 30 s, while more than `above` bytes stay mapped).
    deadline = time.monotonic() + 30.0
    while libc.mallinfo2().hblkhd > above and time.monotonic() < deadline:
        time.sleep(0.01)
    return libc.mallinfo2().hblkhd

out = add(x)
mapped_before = libc.mallinfo2().hblkhd
value_before = float(out[-1])
out.delete()
# (the input, 80 MB on the device, is a mapping too)
mapped_idle = mapped_after_free(mapped_before - x.nbytes // 2)
applied = lj.reuse_host_memory()
mapped = []
for _ in range(3):
    out = add(x)
    mapped.append(libc.mallinfo2().hblkhd)
    value = float(out[-1])
    out.delete()
print(json.dumps(dict(inline=inline, applied=applied, bytes=x.nbytes, mapped_before=mapped_before,
                      mapped_idle=mapped_idle, mapped_after=mapped,
                      values=[value_before, value])))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_large_outputs_leave_mmap_for_the_heap():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inline"] is True and got["applied"] is True
    assert got["values"] == [2.0, 2.0]
    # By default the 80 MB output is a mapping of its own; with the setting every later
    # output of that size comes from the heap (what stays mapped is smaller than one).
    assert got["mapped_before"] - got["mapped_idle"] >= got["bytes"], got
    assert all(m - got["mapped_idle"] < got["bytes"] for m in got["mapped_after"]), got


def test_not_applied_without_glibc(monkeypatch):
    def no_libc(*args, **kwargs):
        raise AssertionError("the C library must not be loaded")

    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert lj.reuse_host_memory() is False
