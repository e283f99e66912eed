"""Numeric formats: storage size, precision and range of every number format a plan may pick.

Each format has an integer id (its position in :data:`FORMAT_NAMES`); plans carry ids, the
physics gather the columns of :data:`FORMAT_TABLE` with them. Names are parsed at the API
boundary, case-insensitively, by :func:`format_id`.

Sources:
- IEEE 754-2019 (FP32, FP16); Google brain float (BF16); NVIDIA A100 whitepaper (TF32: 8-bit
  exponent, 10-bit mantissa, stored in 32 bits).
- Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (E4M3 max 448, min normal 2^-6;
  E5M2 max 57344, min normal 2^-14).
- OCP Microscaling Formats (MX) v1.0 spec, 2023: blocks of 32 elements share one 8-bit E8M0
  scale, so MXFP8 stores 8 + 8/32 = 8.25 bits per element and MXFP4 (E2M1) 4 + 8/32 = 4.25.
- NVIDIA Blackwell NVFP4: E2M1 elements in blocks of 16 with an FP8-E4M3 scale
  (4 + 8/16 = 4.5 bits; the per-tensor FP32 scale is negligible).
- Dettmers et al. 2023, "QLoRA": NF4 with blocks of 64 and an FP32 absmax per block
  (4 + 32/64 = 4.5 bits, before double quantization); smallest non-zero code 0.0796, max 1.
- INT4 as used by GPTQ/AWQ: groups of 128 with an FP16 scale (4 + 16/128 = 4.125 bits).
  INT8 with per-channel scales (negligible storage).

The unit roundoff of a floating format is 2^-(mantissa_bits + 1) (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., §2.1). For integer and code-book formats we use
the relative resolution at full scale of a scaled tensor, 2^-(bits - 1) / 2, as the analogue.
"""

from __future__ import annotations

import numpy as np

# Order defines the integer ids used in plans. Do not reorder: append.
FORMAT_NAMES: tuple[str, ...] = (
    "fp32",
    "tf32",
    "bf16",
    "fp16",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "int4",
    "nf4",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
NUM_FORMATS = len(FORMAT_NAMES)
FORMAT_IDS = {name: i for i, name in enumerate(FORMAT_NAMES)}  # canonical name -> id
# A one-byte id no format has: padding slots and out-of-domain ids of the counted rows read
# as this (physics.rowclasses, physics.native; kNoFormat in physics/_native.cc).
NO_FORMAT = 255

FP32, TF32, BF16, FP16, FP8_E4M3, FP8_E5M2, INT8, INT4, NF4, MXFP8, MXFP4, NVFP4 = range(
    NUM_FORMATS
)

# Compute classes: which tensor-core (or vector) rate a GEMM in this format runs at.
# Index into ``GpuSpec.peak_flops``. A GPU without a class (0 FLOP/s) falls back to BF16:
# weight-only formats (INT4, NF4) always dequantize to BF16 and run BF16 GEMMs
# (bitsandbytes / GPTQ kernels), FP4 on Hopper has no tensor-core path.
COMPUTE_CLASS_NAMES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp4")
NUM_COMPUTE_CLASSES = len(COMPUTE_CLASS_NAMES)
CC_FP32, CC_TF32, CC_BF16, CC_FP16, CC_FP8, CC_INT8, CC_FP4 = range(NUM_COMPUTE_CLASSES)

_ALIASES = {
    "float32": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "fp8": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "fp8e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "fp8e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "mxfp8_e4m3": "mxfp8",
    "mxfp4_e2m1": "mxfp4",
}

# Columns of the format table (one row per format, in FORMAT_NAMES order):
#  storage_bits       bits per stored element, block scales included
#  mantissa_bits      explicit mantissa (fraction) bits of the element format
#  exponent_bits      exponent bits of the element format (0 for integers / code books)
#  max_value          largest finite magnitude of the element format (scale excluded)
#  min_normal         smallest positive normal magnitude (integers: 1; NF4: smallest code)
#  needs_scaling      1 if tensors must be scaled (per tensor / block) to be usable
#  compute_class      index into COMPUTE_CLASS_NAMES
#  activation_bytes   bytes per activation element that a GEMM in this format saves for its
#                     backward pass (Transformer Engine keeps the FP8 cast of the input;
#                     weight-only formats keep BF16 activations)
#  is_float           1 for floating-point element formats
_ROWS = {
    #           bits    man  exp  max              min_normal        scale cc        act  float
    "fp32":     (32.0,  23,  8,   3.4028235e38,    2.0**-126,        0,    CC_FP32,  4.0, 1),
    "tf32":     (32.0,  10,  8,   3.4028235e38,    2.0**-126,        0,    CC_TF32,  4.0, 1),
    "bf16":     (16.0,  7,   8,   3.3895314e38,    2.0**-126,        0,    CC_BF16,  2.0, 1),
    "fp16":     (16.0,  10,  5,   65504.0,         2.0**-14,         0,    CC_FP16,  2.0, 1),
    "fp8_e4m3": (8.0,   3,   4,   448.0,           2.0**-6,          1,    CC_FP8,   1.0, 1),
    "fp8_e5m2": (8.0,   2,   5,   57344.0,         2.0**-14,         1,    CC_FP8,   1.0, 1),
    "int8":     (8.0,   7,   0,   127.0,           1.0,              1,    CC_INT8,  1.0, 0),
    "int4":     (4.125, 3,   0,   7.0,             1.0,              1,    CC_BF16,  2.0, 0),
    "nf4":      (4.5,   3,   0,   1.0,             0.07958029955625534, 1, CC_BF16,  2.0, 0),
    "mxfp8":    (8.25,  3,   4,   448.0,           2.0**-6,          1,    CC_FP8,   1.03125, 1),
    "mxfp4":    (4.25,  1,   2,   6.0,             1.0,              1,    CC_FP4,   2.0, 1),
    "nvfp4":    (4.5,   1,   2,   6.0,             1.0,              1,    CC_FP4,   2.0, 1),
}

COLUMNS: tuple[str, ...] = (
    "storage_bits",
    "mantissa_bits",
    "exponent_bits",
    "max_value",
    "min_normal",
    "needs_scaling",
    "compute_class",
    "activation_bytes",
    "is_float",
)

FORMAT_TABLE: np.ndarray = np.array([_ROWS[n] for n in FORMAT_NAMES], dtype=np.float64)
"""Shape ``[NUM_FORMATS, len(COLUMNS)]``; float64 so the plain-Python reference is exact."""


def column(name: str) -> np.ndarray:
    """One column of :data:`FORMAT_TABLE` as a ``[NUM_FORMATS]`` float64 array."""
    return FORMAT_TABLE[:, COLUMNS.index(name)].copy()


STORAGE_BITS = column("storage_bits")
STORAGE_BYTES = STORAGE_BITS / 8.0
MANTISSA_BITS = column("mantissa_bits")
EXPONENT_BITS = column("exponent_bits")
MAX_VALUE = column("max_value")
MIN_NORMAL = column("min_normal")
NEEDS_SCALING = column("needs_scaling")
COMPUTE_CLASS = column("compute_class").astype(np.int32)
ACTIVATION_BYTES = column("activation_bytes")
IS_FLOAT = column("is_float")
# Unit roundoff u = 2^-(p) with p = mantissa_bits + 1 significant bits (Higham §2.1).
UNIT_ROUNDOFF = 2.0 ** -(MANTISSA_BITS + 1.0)
# Bytes of a gradient element: gradients are never accumulated below 16 bits (Transformer Engine
# FP8 recipe keeps weight gradients in BF16/FP32; Micikevicius et al. 2022 §4), FP32 stays FP32.
GRADIENT_MIN_BYTES = 2.0
GRADIENT_BYTES = np.maximum(STORAGE_BYTES, GRADIENT_MIN_BYTES)


def gradient_bytes(storage_bytes):
    """Bytes of a gradient element for weights of ``storage_bytes`` per element (an array:
    ``GRADIENT_BYTES``' rule, elementwise, for traced values)."""
    import jax.numpy as jnp

    return jnp.maximum(storage_bytes, GRADIENT_MIN_BYTES)
# Bytes of a 16-bit activation element (the residual stream and the tensors GEMMs save in
# BF16/FP16 mixed precision).
ACT16_BYTES = 2.0
# Effective relative error per format: the unit roundoff for floats; for scaled integer grids
# the rounding error of a Gaussian tensor scaled to the grid (max ~ 4 sigma): half a step over
# sigma, INT8 4/127/2 ~ 2^-6, INT4 (group 128) ~ 2^-3; NF4 is quantile-optimal (Dettmers et al.
# 2023, "QLoRA", §3), about 2^-3.3. Block-scaled FP4 keeps E2M1's 2^-2; NVFP4's finer blocks and
# FP8 scales give lower error than MXFP4 (NVIDIA, "Introducing NVFP4", 2025): 0.8 x.
EFFECTIVE_ROUNDOFF = UNIT_ROUNDOFF.copy()
EFFECTIVE_ROUNDOFF[INT8] = 2.0**-6
EFFECTIVE_ROUNDOFF[INT4] = 2.0**-3
EFFECTIVE_ROUNDOFF[NF4] = 2.0**-3.3
EFFECTIVE_ROUNDOFF[NVFP4] = 0.8 * 2.0**-2
# Bytes read and written to quantize one input element for a scaled format (read BF16 2 bytes,
# write FP8/INT8/FP4 1 byte): Transformer Engine casts activations before each FP8 GEMM.
CAST_BYTES_PER_ELEMENT = 3.0
CAST_BYTES = NEEDS_SCALING * CAST_BYTES_PER_ELEMENT


def valid_format_names() -> list[str]:
    """The canonical format names, in id order."""
    return list(FORMAT_NAMES)


def format_id(name: str | int) -> int:
    """Parse a format name (case-insensitive, '-' or '_' separators, common aliases) to its id.

    >>> format_id("BF16"), format_id("fp8-e4m3"), format_id("float16")
    (2, 4, 3)

    Raises:
        ValueError: the name is unknown; the message lists the valid names.
    """
    if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
        if 0 <= int(name) < NUM_FORMATS:
            return int(name)
        raise ValueError(f"format id {name} out of range [0, {NUM_FORMATS})")
    if not isinstance(name, str):
        raise ValueError(f"format must be a name or an id, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    key = _ALIASES.get(key, key)
    if key not in FORMAT_NAMES:
        key2 = key.replace("_", "")
        matches = [n for n in FORMAT_NAMES if n.replace("_", "") == key2]
        if not matches:
            raise ValueError(
                f"unknown numeric format {name!r}; valid formats: {', '.join(FORMAT_NAMES)}"
                f" (aliases: {', '.join(sorted(_ALIASES))})"
            )
        key = matches[0]
    return FORMAT_NAMES.index(key)


def format_name(fid: int) -> str:
    """The canonical name of a format id."""
    return FORMAT_NAMES[int(fid)]


# The precision of a class model (``physics.rowclasses.class_model``): every format along the
# last axis of its ``[classes, F]`` pseudo-rows.
FORMAT_AXIS = np.arange(NUM_FORMATS, dtype=np.int32)[None, :]


def select_columns(precision, table):
    """Per-element values of a small per-format table: ``table[:, k][precision]`` for each
    column ``k`` of a ``[F, K]`` table, as a tuple of ``K`` arrays shaped like ``precision``.

    Written as a chain of selects rather than a gather, and column by column (no trailing
    ``K`` axis to slice or reduce across): on CPU, XLA vectorizes compares and selects but not
    gathers; on GPU, separate minor-axis arrays keep the later reductions on the fast path.
    Ids outside ``[0, F)`` give zeros (validation rejects them earlier). For
    ``precision is FORMAT_AXIS`` the columns themselves, shaped ``[1, F]``.
    """
    import jax
    import jax.numpy as jnp

    # A constant table (NumPy) is read here, entry by entry: traced, each entry's lookup was
    # a gather of its own in the program (12 x K per call, folded away by XLA after costing
    # tracing and compile time).
    table = table if isinstance(table, jax.Array) else np.asarray(table)
    if precision is FORMAT_AXIS:
        return tuple(table[:, k][None, :] for k in range(table.shape[1]))
    p = jnp.asarray(precision)
    masks = [p == f for f in range(table.shape[0])]
    out = []
    for k in range(table.shape[1]):
        col = jnp.zeros(p.shape, table.dtype)
        for f, mask in enumerate(masks):
            col = jnp.where(mask, table[f, k], col)
        out.append(col)
    return tuple(out)
