"""The class path's per-row work on an NVIDIA GPU as a CUDA kernel: 8-bit tensor-core counts.

:func:`class_sums` computes what :func:`~libratio_jax.physics.gpu_kernels.class_sums` (the
Pallas kernel) does, the roofline seconds, the weighted sums, the largest held entry and
whether every row was counted, per plan and tenant, from the plans' one-byte format ids,
with one CUDA kernel (``_cuda_kernels.cu``, an XLA FFI handler for the CUDA platform).

The Pallas kernel built a bf16 one-hot per (row, format) for its products, ~3 instructions
each: ~4,200 warp-instructions per plan and 15-17 ms for 1,048,576 reference plans on an H200
(docs/performance.md, thirtieth round), where reading them takes ~0.8 ms. The CUDA kernel
turns each 32-bit word of four ids into a byte-permute selector once and makes the int8
one-hots of two formats at a time with one ``prmt`` (1 for the pair's first format, 64 for
its second), then counts them with ``mma.sync m16n8k32`` (s8, exact int32 sums): per plan,
class and pair ``n_first + 64 n_second``, exact while a class holds at most 63 rows
(:data:`MAX_CLASS_ROWS`). The sums stay in registers (see the source's header).

The small operands are prepared here, in the layouts of the MMA fragments (the functions
``*_fragments``; the tests replay the kernel's arithmetic on them in NumPy). The extension
``_cuda_kernels.so`` is built by ``pip install`` where ``nvcc`` is found and an NVIDIA
driver is present, or ``LIBRATIO_BUILD_CUDA=1`` asks for it (``setup.py``);
``LIBRATIO_CUDA_KERNELS=0`` turns the kernel off at run time (the Pallas kernel then runs).
:func:`status` says which.

Example:
    >>> import numpy as np
    >>> from libratio_jax.physics import cuda_kernels
    >>> grid = np.array([[[0, 2], [1, 3]]], np.int32)  # 1 tenant, 2 classes of 2 rows, L = 3
    >>> cuda_kernels.member_fragments(grid, 3).shape  # [M, steps of 32 rows, 32 lanes, 4]
    (1, 1, 32, 4)
    >>> isinstance(cuda_kernels.status().reason, str)
    True
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.physics import formats as F
from libratio_jax.physics import gpu_kernels
from libratio_jax.physics.rowclasses import format_ids

ENV_SWITCH = "LIBRATIO_CUDA_KERNELS"  # "0": the Pallas kernel instead
TARGET = "lj_class_sums_cuda"
LIBRARY = os.path.join(os.path.dirname(__file__), "_cuda_kernels.so")
CLASSES = 16  # classes a tenant at most (two MMA tiles of 8)
MAX_CLASS_ROWS = 63  # a pair's count is n_first + 64 n_second: exact below 64 rows a class
MAX_TENANTS = 16  # one warp each in a block
MAX_TERMS = 31  # summed terms (with the column of ones: four MMA tiles of 8)
MAX_SHARED_BYTES = 227 * 1024  # a block stages 16 plans' bytes (Hopper's most a block)
PLANS_PER_BLOCK = 16
ROWS_PER_STEP = 32
ENTRY_SLOTS = 8  # floats per (format, class) entry: 5 terms, then zeros


ABI_VERSION = 1  # the operands' layouts the source's kAbiVersion names (bumped together)


class CudaStatus(NamedTuple):
    """Whether this process runs :func:`class_sums`' kernel, and why not."""

    used: bool
    reason: str  # "" when used
    max_shared_bytes: int = 0  # a block's most dynamic shared memory on the device


@functools.cache
def status() -> CudaStatus:
    """Whether the batch path on this process's default device runs the CUDA kernel: an
    NVIDIA GPU of compute capability 8.0 or later as JAX's default backend, the extension
    built from these sources (its layouts' version is :data:`ABI_VERSION`), its kernel
    loadable on the device (a probe: the driver runs the build's CUDA, the build holds code
    for the device; it also reads the device's most shared memory a block), the handler
    registered, ``LIBRATIO_CUDA_KERNELS`` not ``0``, and the Pallas kernels' conditions
    (``gpu_kernels.available``) met. Read once per process."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return CudaStatus(False, f"disabled by {ENV_SWITCH}=0")
    if not gpu_kernels.available():
        return CudaStatus(False, "no NVIDIA GPU as JAX's default backend (or the GPU "
                                 "kernels are off)")
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if float(capability) < 8.0:
        return CudaStatus(False, f"compute capability {capability} < 8.0 (mma.sync s8)")
    if not os.path.exists(LIBRARY):
        return CudaStatus(False, f"{os.path.basename(LIBRARY)} is not built (setup.py: "
                                 f"nvcc, or LIBRATIO_BUILD_CUDA=1)")
    try:
        library = ctypes.cdll.LoadLibrary(LIBRARY)
        abi = library.LjClassSumsCudaAbi()
        if abi != ABI_VERSION:
            return CudaStatus(False, f"{LIBRARY} was built from other sources (layouts "
                                     f"{abi}, not {ABI_VERSION}): rebuild it (pip install -e .)")
        probe = library.LjClassSumsCudaProbe
        probe.argtypes, probe.restype = [ctypes.POINTER(ctypes.c_int64)], ctypes.c_int
        shared = ctypes.c_int64(0)
        error = probe(ctypes.byref(shared))
        if error:
            return CudaStatus(False, f"the kernel cannot run on this device (CUDA error {error}:"
                                     " an older driver than the build's CUDA, or no code for it)")
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.LjClassSumsCuda),
                                    platform="CUDA")
    except Exception as e:  # any failure: the Pallas kernel, and the reason kept
        return CudaStatus(False, f"loading {LIBRARY} failed: {type(e).__name__}: {e}")
    return CudaStatus(True, "", min(int(shared.value), MAX_SHARED_BYTES))


def supports(grid_shape, ids_shape, terms: int) -> bool:
    """Whether the kernel takes a grid ``[M, C, S]``, ids ``[B, M, L]`` and ``terms`` summed
    terms (else the Pallas kernel runs): at most :data:`CLASSES` classes, :data:`MAX_CLASS_ROWS`
    slots (rows) a class, :data:`MAX_TENANTS` tenants, :data:`MAX_TERMS` terms, and 16 plans'
    bytes in one block's shared memory (the device's most where :func:`status` probed it,
    else :data:`MAX_SHARED_BYTES`)."""
    m, c, s = grid_shape
    _, _, l = ids_shape
    st = status()
    shared = st.max_shared_bytes if st.used else MAX_SHARED_BYTES
    return (c <= CLASSES and s <= MAX_CLASS_ROWS and 1 <= m <= MAX_TENANTS
            and terms <= MAX_TERMS and PLANS_PER_BLOCK * m * l + 64 <= shared)


def steps(num_layers: int) -> int:
    """Steps of :data:`ROWS_PER_STEP` rows covering ``num_layers`` rows."""
    return -(-int(num_layers) // ROWS_PER_STEP)


@functools.cache
def _member_index(num_steps: int):
    """For each byte of ``member_fragments``' ``[steps, 32 lanes, 4 words, 4 bytes]``, its
    (row, class): lane ``(g, t)``'s words are the m16n8k32 B fragments of classes ``g``
    (words 0, 1) and ``8 + g`` (words 2, 3); word 0's byte ``j`` is MMA row ``4t + j``, which
    the kernel feeds with plan row ``8t + j`` of the step, word 1's MMA row ``16 + 4t + j``
    with plan row ``8t + 4 + j``."""
    s, lane, word, byte = np.meshgrid(np.arange(num_steps), np.arange(32), np.arange(4),
                                      np.arange(4), indexing="ij")
    g, t = lane // 4, lane % 4
    row = ROWS_PER_STEP * s + 8 * t + 4 * (word % 2) + byte
    cls = g + 8 * (word // 2)
    return row, cls


def member_fragments(grid, num_layers: int):
    """``uint32[M, steps, 32, 4]``: the class membership of each tenant's rows (1 where row
    ``l`` is in class ``c`` of ``grid int32[M, C, S]``, padding slots ``>= num_layers`` in
    none) as the kernel's B fragments, four rows a word (little-endian)."""
    n = steps(num_layers)
    # [M, rows, C'] with C' = 16 classes (the Pallas kernel's operand, 0/1)
    member = gpu_kernels.membership(grid, num_layers, n * ROWS_PER_STEP).astype(jnp.uint32)
    row, klass = _member_index(n)
    bits = member[:, row, klass] << (8 * jnp.arange(4, dtype=jnp.uint32))  # [M, n, 32, 4, 4]
    return jnp.sum(bits, axis=-1, dtype=jnp.uint32)


def plan_fragments(plan_terms):
    """``float32[M, B, 16]`` of ``gpu_kernels.class_sums``' ``plan_terms [M, B, 4 + F]``
    (``gpu_kernels.PLAN_TERMS``, then the seconds per FLOP of each format): per plan the
    weight reads over the HBM bandwidth, the expert weight reads over it, the work over it,
    0, then the work times each format's seconds per FLOP (the roofline's factors, applied
    per entry as ``max(alpha_f x flops, rho x w + rho_x x w_expert + beta x io)``)."""
    p = jnp.asarray(plan_terms, jnp.float32)
    work, hbm, reads, expert_reads = (p[..., j] for j in range(len(gpu_kernels.PLAN_TERMS)))
    spf = p[..., len(gpu_kernels.PLAN_TERMS):len(gpu_kernels.PLAN_TERMS) + F.NUM_FORMATS]
    scalars = jnp.stack([reads / hbm, expert_reads / hbm, work / hbm, jnp.zeros_like(work)],
                        axis=-1)
    return jnp.concatenate([scalars, work[..., None] * spf], axis=-1)


def entry_fragments(entries):
    """``float32[M, F, 16, 8]`` of ``gpu_kernels.class_sums``' ``entries [M, F, 6, C]``
    (``gpu_kernels.ENTRY_TERMS``): per (format, class) its FLOPs, its weight bytes when not
    an expert's and when one, its io bytes (all four 0 where the entry is not valid), its
    peak term, then zeros; classes padded to :data:`CLASSES`."""
    e = jnp.asarray(entries, jnp.float32)
    flops, weight, io, expert, valid, top = (e[:, :, j] for j in range(6))  # [M, F, C]
    ok = valid > 0.0
    expert = expert > 0.0

    def kept(x):
        return jnp.where(ok, x, 0.0)

    cols = [kept(flops), kept(jnp.where(expert, 0.0, weight)), kept(jnp.where(expert, weight,
            0.0)), kept(io), top]
    out = jnp.stack(cols + [jnp.zeros_like(top)] * (ENTRY_SLOTS - len(cols)), axis=-1)
    return jnp.pad(out, ((0, 0), (0, 0), (0, CLASSES - out.shape[2]), (0, 0)))


def _bf16_parts(x):
    """The bits (``uint32``, in the low 16) of three bf16 parts of float32 ``x`` whose sum is
    ``x`` to ~2^-23 (the kernel multiplies each part by exact counts and sums in float32).
    Each part is its remainder truncated to bf16 by masking its bits, no float conversion:
    XLA's GPU compiler drops a float32 -> bf16 -> float32 round trip (excess precision
    allowed by default), which made every remainder 0 (measured on an H200: the sums off by
    ~1e-3)."""
    def truncated(v):
        return jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)

    def value(bits):
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    hi = truncated(x)
    rest = x - value(hi)  # exact
    mid = truncated(rest)
    lo = truncated(rest - value(mid))  # exact difference, truncated
    return tuple(part >> 16 for part in (hi, mid, lo))


def term_tiles(terms: int) -> int:
    """MMA tiles of 8 the kernel sums ``terms`` terms and its column of ones in."""
    return -(-(int(terms) + 1) // 8)


def table_fragments(table):
    """``uint32[M, F, KT, 3, 32, 2]`` of ``table float32[M, K, C, F]`` and a term of ones
    (the rows counted, term ``K``), padded to ``KT = term_tiles(K)`` tiles of 8 terms: lane
    ``(g, t)`` of tile ``k`` of format ``f`` holds, for each of the three bf16 parts, the
    m16n8k16 B fragment of term ``8k + g``: classes ``(2t, 2t + 1)`` and ``(2t + 8, 2t + 9)``
    as bf16 pairs (the lower class in the low half). A part's 32 lanes are contiguous (one
    256-byte load a warp)."""
    t = jnp.asarray(table, jnp.float32)
    m, k, c, f = t.shape
    tiles = term_tiles(k)
    t = jnp.concatenate([t, jnp.ones((m, 1, c, f), jnp.float32)], axis=1)
    t = jnp.pad(t, ((0, 0), (0, 8 * tiles - k - 1), (0, CLASSES - c), (0, 0)))
    lane = np.arange(32)
    g, tt = lane // 4, lane % 4
    term = 8 * np.arange(tiles)[:, None] + g[None, :]  # [KT, 32]
    parts = []
    for bits in _bf16_parts(t):  # [M, K', 16, F]
        words = []
        for first in (2 * tt, 2 * tt + 8):  # [32]
            low, high = bits[:, term, first[None, :], :], bits[:, term, first[None, :] + 1, :]
            words.append(low | (high << 16))  # [M, KT, 32, F]
        parts.append(jnp.stack(words, axis=-1))  # [M, KT, 32, F, 2]
    return jnp.moveaxis(jnp.stack(parts, axis=2), 4, 1)  # [M, F, KT, 3, 32, 2]


def class_sums(grid, ids, plan_terms, entries, table) -> gpu_kernels.ClassSums:
    """``gpu_kernels.class_sums(grid, ids, plan_terms, entries, table)`` (same arguments, same
    results up to float rounding) by the CUDA kernel, in a program lowered for CUDA: call it
    where :func:`status` says ``used`` (it registers the kernel) and :func:`supports` the
    shapes (``ValueError`` otherwise, at trace time)."""
    if not supports(jnp.shape(grid), ids.shape, table.shape[1]):
        raise ValueError(f"cuda_kernels.class_sums: grid {jnp.shape(grid)}, ids {ids.shape} and "
                         f"{table.shape[1]} terms are outside the kernel's range (supports)")
    status()  # registers the handler (where it can be used)
    grid = jnp.asarray(grid, jnp.int32)
    b, m, l = ids.shape
    k = table.shape[1]
    tiles = term_tiles(k)
    out_type = (jax.ShapeDtypeStruct((m, b), jnp.float32),
                jax.ShapeDtypeStruct((m, 8 * tiles, b), jnp.float32),
                jax.ShapeDtypeStruct((m, b), jnp.float32))
    roof, sums, peak = jax.ffi.ffi_call(TARGET, out_type)(
        format_ids(ids), member_fragments(grid, l), plan_fragments(plan_terms),
        entry_fragments(entries), table_fragments(table))
    counted = jnp.round(sums[:, k]).astype(jnp.int32)
    return gpu_kernels.ClassSums(roof, sums[:, :k], peak,
                                 gpu_kernels._complete(grid, l, counted))
