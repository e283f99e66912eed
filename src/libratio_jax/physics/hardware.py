"""GPU catalog and :class:`ClusterSpec` (uniform or mixed clusters as padded pools).

Every number carries its source. Datasheet FLOP/s "with sparsity" are halved to dense figures.
Bandwidths are bytes per second; ``nvlink_bytes_per_second`` is the per-GPU, per-direction
figure (half the bidirectional number a datasheet prints), which is what a ring all-reduce's bus
bandwidth can reach at best (NCCL tests, "busbw").

A cluster is a set of *pools*, each of one GPU kind; a tenant runs on one pool (``Plan.pool``).
Pools are padded to a static capacity ``P`` with ``valid`` so one compiled function serves every
cluster of that capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import checks
from libratio_jax.physics import formats as F

_GB = 1e9
_MIB = 2**20
_TERA = 1e12


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU kind. Units in the field names; FLOP/s are dense (no sparsity)."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_second: float
    # Dense peak per compute class, in COMPUTE_CLASS_NAMES order:
    # fp32 (vector), tf32, bf16, fp16, fp8, int8 (ops/s), fp4. 0 = no such path.
    peak_flops: tuple[float, ...]
    tdp_watts: float
    idle_watts: float
    nvlink_bytes_per_second: float
    network_bytes_per_second: float
    gpus_per_node: int
    slowdown_celsius: float
    shutdown_celsius: float
    thermal_resistance_celsius_per_watt: float
    price_per_gpu_hour: float

    def pool_scalars(self) -> dict:
        """The scalars :func:`~libratio_jax.physics.throughput.tenant_step_time` reads as
        ``pool`` (NumPy; ``peak_flops[C]``, bandwidths, ``gpus_per_node``), plus ``hbm_bytes``."""
        return {
            "peak_flops": np.asarray(self.peak_flops, np.float32),
            "hbm_bytes": np.float32(self.hbm_bytes),
            "hbm_bytes_per_second": np.float32(self.hbm_bytes_per_second),
            "nvlink_bytes_per_second": np.float32(self.nvlink_bytes_per_second),
            "network_bytes_per_second": np.float32(self.network_bytes_per_second),
            "gpus_per_node": np.int32(self.gpus_per_node),
        }


# Measured on one H100 SXM (docs/measurements.md): steady-state die temperature rise
# 0.054 °C/W in that chassis; CUDA context alive at full clocks and 0% load draws 117-121 W.
_H100_THERMAL_RESISTANCE = 0.054
_H100_IDLE_WATTS = 120.0
# Assumption for kinds we have not measured: the same idle fraction of TDP (120/700) and a
# chassis whose cooling gives the same die-temperature rise at TDP (R * TDP = 0.054 * 700 °C).
_IDLE_FRACTION = _H100_IDLE_WATTS / 700.0
_RISE_AT_TDP = _H100_THERMAL_RESISTANCE * 700.0


def dense_tflops(**per_class: float) -> tuple[float, ...]:
    """Dense peak FLOP/s per compute class from TFLOP/s given by class name (every class of
    ``formats.COMPUTE_CLASS_NAMES``; 0 = no such path), in the order ``GpuSpec`` keeps."""
    if set(per_class) != set(F.COMPUTE_CLASS_NAMES):
        raise ValueError(f"dense_tflops needs exactly {F.COMPUTE_CLASS_NAMES}, "
                         f"got {sorted(per_class)}")
    return tuple(float(per_class[c]) * _TERA for c in F.COMPUTE_CLASS_NAMES)


def _idle(tdp: float) -> float:
    return _IDLE_FRACTION * tdp


def _resistance(tdp: float) -> float:
    return _RISE_AT_TDP / tdp


GPU_CATALOG: dict[str, GpuSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; TF32 989 / BF16 1979 /
    # FP8 3958 TFLOP/s with sparsity -> 494.5 / 989.5 / 1979 dense; FP32 67 TFLOP/s; INT8 3958
    # TOPS sparse; up to 700 W; NVLink 900 GB/s (450 per direction); 8 GPUs per HGX node;
    # NDR 400 Gb/s InfiniBand per GPU (50 GB/s). Capacity: nvidia-smi memory.total 81559 MiB.
    # Thermal limits from nvidia-smi -q (docs/measurements.md): slowdown 89 °C, shutdown 92 °C.
    "H100-SXM": GpuSpec(
        name="H100-SXM",
        hbm_bytes=81559 * _MIB,
        hbm_bytes_per_second=3.35e12,
        peak_flops=dense_tflops(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5,
                                fp8=1979, int8=1979, fp4=0.0),
        tdp_watts=700.0,
        idle_watts=_H100_IDLE_WATTS,
        nvlink_bytes_per_second=450 * _GB,
        network_bytes_per_second=50 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_H100_THERMAL_RESISTANCE,
        price_per_gpu_hour=3.00,
    ),
    # H100 datasheet (PCIe): 80 GB HBM2e, 2.0 TB/s; TF32 756 / BF16 1513 / FP8 3026 sparse;
    # FP32 51 TFLOP/s; 300-350 W; NVLink bridge 600 GB/s (300 per direction); thermal limits as
    # the SXM part (assumption).
    "H100-PCIe": GpuSpec(
        name="H100-PCIe",
        hbm_bytes=81559 * _MIB,
        hbm_bytes_per_second=2.0e12,
        peak_flops=dense_tflops(fp32=51, tf32=378, bf16=756.5, fp16=756.5,
                                fp8=1513, int8=1513, fp4=0.0),
        tdp_watts=350.0,
        idle_watts=_idle(350.0),
        nvlink_bytes_per_second=300 * _GB,
        network_bytes_per_second=50 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(350.0),
        price_per_gpu_hour=2.50,
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, same tensor cores as H100 SXM,
    # up to 700 W, NVLink 900 GB/s. nvidia-smi memory.total 143771 MiB.
    "H200": GpuSpec(
        name="H200",
        hbm_bytes=143771 * _MIB,
        hbm_bytes_per_second=4.8e12,
        peak_flops=dense_tflops(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5,
                                fp8=1979, int8=1979, fp4=0.0),
        tdp_watts=700.0,
        idle_watts=_H100_IDLE_WATTS,
        nvlink_bytes_per_second=450 * _GB,
        network_bytes_per_second=50 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_H100_THERMAL_RESISTANCE,
        price_per_gpu_hour=3.80,
    ),
    # NVIDIA A100 datasheet (80GB SXM): HBM2e 2,039 GB/s; FP32 19.5, TF32 156, BF16/FP16 312
    # TFLOP/s dense; INT8 624 TOPS; no FP8; 400 W; NVLink 600 GB/s (300 per direction);
    # HDR 200 Gb/s (25 GB/s) per GPU. nvidia-smi: 81920 MiB; slowdown 89 / shutdown 92 °C
    # (docs/measurements.md: A100 max operating 85 °C).
    "A100-80GB": GpuSpec(
        name="A100-80GB",
        hbm_bytes=81920 * _MIB,
        hbm_bytes_per_second=2.039e12,
        peak_flops=dense_tflops(fp32=19.5, tf32=156, bf16=312, fp16=312,
                                fp8=0.0, int8=624, fp4=0.0),
        tdp_watts=400.0,
        idle_watts=_idle(400.0),
        nvlink_bytes_per_second=300 * _GB,
        network_bytes_per_second=25 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(400.0),
        price_per_gpu_hour=1.80,
    ),
    # NVIDIA A100 datasheet (40GB SXM): HBM2 1,555 GB/s, otherwise as the 80GB part; 400 W.
    # nvidia-smi: 40960 MiB.
    "A100-40GB": GpuSpec(
        name="A100-40GB",
        hbm_bytes=40960 * _MIB,
        hbm_bytes_per_second=1.555e12,
        peak_flops=dense_tflops(fp32=19.5, tf32=156, bf16=312, fp16=312,
                                fp8=0.0, int8=624, fp4=0.0),
        tdp_watts=400.0,
        idle_watts=_idle(400.0),
        nvlink_bytes_per_second=300 * _GB,
        network_bytes_per_second=25 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(400.0),
        price_per_gpu_hour=1.30,
    ),
    # NVIDIA HGX B200 datasheet, per GPU: 180 GB HBM3e, 7.7 TB/s; FP4 18 / FP8 9 / BF16 4.5 /
    # TF32 2.2 PFLOP/s sparse -> 9 / 4.5 / 2.25 / 1.1 dense; FP32 75 TFLOP/s; INT8 9 POPS sparse;
    # 1000 W; NVLink 5 1.8 TB/s (900 GB/s per direction); ConnectX-7 400 Gb/s per GPU.
    # Thermal limits not published: H100 values assumed.
    "B200": GpuSpec(
        name="B200",
        hbm_bytes=180 * _GB,
        hbm_bytes_per_second=7.7e12,
        peak_flops=dense_tflops(fp32=75, tf32=1100, bf16=2250, fp16=2250,
                                fp8=4500, int8=4500, fp4=9000),
        tdp_watts=1000.0,
        idle_watts=_idle(1000.0),
        nvlink_bytes_per_second=900 * _GB,
        network_bytes_per_second=50 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(1000.0),
        price_per_gpu_hour=5.50,
    ),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; FP32 91.6; TF32 366 / BF16 733 / FP8 1466
    # sparse -> 183 / 366.5 / 733 dense; INT8 1466 TOPS sparse; 350 W; no NVLink: PCIe Gen4 x16
    # 64 GB/s bidirectional (32 per direction). nvidia-smi 46068 MiB. Thermal: H100 values assumed.
    "L40S": GpuSpec(
        name="L40S",
        hbm_bytes=46068 * _MIB,
        hbm_bytes_per_second=0.864e12,
        peak_flops=dense_tflops(fp32=91.6, tf32=183, bf16=366.5, fp16=366.5,
                                fp8=733, int8=733, fp4=0.0),
        tdp_watts=350.0,
        idle_watts=_idle(350.0),
        nvlink_bytes_per_second=32 * _GB,
        network_bytes_per_second=25 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(350.0),
        price_per_gpu_hour=1.00,
    ),
    # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s; FP32 vector 81.7 (matrix 163.4);
    # TF32 653.7, BF16/FP16 1307.4, FP8 2614.9 TFLOP/s, INT8 2614.9 TOPS (dense); 750 W;
    # Infinity Fabric 7 x 64 GB/s per direction = 448 GB/s; 8 per platform.
    # Thermal limits not published in the same form: H100 values assumed.
    "MI300X": GpuSpec(
        name="MI300X",
        hbm_bytes=192 * _GB,
        hbm_bytes_per_second=5.3e12,
        peak_flops=dense_tflops(fp32=81.7, tf32=653.7, bf16=1307.4, fp16=1307.4,
                                fp8=2614.9, int8=2614.9, fp4=0.0),
        tdp_watts=750.0,
        idle_watts=_idle(750.0),
        nvlink_bytes_per_second=448 * _GB,
        network_bytes_per_second=50 * _GB,
        gpus_per_node=8,
        slowdown_celsius=89.0,
        shutdown_celsius=92.0,
        thermal_resistance_celsius_per_watt=_resistance(750.0),
        price_per_gpu_hour=3.50,
    ),
}
GPU_NAMES: tuple[str, ...] = tuple(GPU_CATALOG)

_GPU_ALIASES = {"h100": "H100-SXM", "h100-sxm5": "H100-SXM", "h100_sxm": "H100-SXM",
                "h200-sxm": "H200"}


def gpu_spec(name: str) -> GpuSpec:
    """Look a GPU kind up by name (case-insensitive; a unique prefix or an alias such as
    "h100" works). Raises ValueError listing the valid names, or the candidates of an
    ambiguous name ("A100": A100-80GB or A100-40GB)."""
    if not isinstance(name, str):
        raise ValueError(f"GPU kind must be a name, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    for cand in GPU_NAMES:
        if cand.lower() == key:
            return GPU_CATALOG[cand]
    alias = _GPU_ALIASES.get(key) or _GPU_ALIASES.get(key.replace("-", "_"))
    if alias:
        return GPU_CATALOG[alias]
    prefixed = [c for c in GPU_NAMES if key and c.lower().startswith(key)]
    if len(prefixed) == 1:
        return GPU_CATALOG[prefixed[0]]
    if prefixed:
        raise ValueError(f"ambiguous GPU kind {name!r}: one of {', '.join(prefixed)}")
    raise ValueError(f"unknown GPU kind {name!r}; valid kinds: {', '.join(GPU_NAMES)}")


DEFAULT_INLET_CELSIUS = 30.0  # ASHRAE A1 recommended inlet range tops out at 27 °C; 30 = warm.


@struct.dataclass
class ClusterSpec:
    """A cluster as ``P`` pools of identical GPUs (padded). All fields are arrays.

    Shapes: ``[P]`` unless noted. ``peak_flops`` is ``[P, NUM_COMPUTE_CLASSES]``.
    Scalars: ``inlet_celsius``, ``power_cap_watts`` (whole cluster; ``inf`` for none).

    Example:
        >>> c = ClusterSpec.uniform("H100-SXM", 8)
        >>> int(c.total_gpus)
        8
    """

    gpu_count: jnp.ndarray
    gpu_kind: jnp.ndarray  # int index into GPU_NAMES
    hbm_bytes: jnp.ndarray
    hbm_bytes_per_second: jnp.ndarray
    peak_flops: jnp.ndarray
    tdp_watts: jnp.ndarray
    idle_watts: jnp.ndarray
    nvlink_bytes_per_second: jnp.ndarray
    network_bytes_per_second: jnp.ndarray
    gpus_per_node: jnp.ndarray
    slowdown_celsius: jnp.ndarray
    shutdown_celsius: jnp.ndarray
    thermal_resistance_celsius_per_watt: jnp.ndarray
    price_per_gpu_hour: jnp.ndarray
    valid: jnp.ndarray
    inlet_celsius: jnp.ndarray
    power_cap_watts: jnp.ndarray

    @property
    def num_pools(self) -> int:
        return int(self.gpu_count.shape[-1])

    @property
    def total_gpus(self):
        return jnp.sum(jnp.where(self.valid, self.gpu_count, 0), axis=-1)

    @classmethod
    def mixed(
        cls,
        pools: Mapping[str, int] | Sequence[tuple[str, int]],
        *,
        pool_capacity: int | None = None,
        inlet_celsius: float = DEFAULT_INLET_CELSIUS,
        power_cap_watts: float = float("inf"),
    ) -> ClusterSpec:
        """A cluster from ``{gpu_kind: count}`` (or pairs), padded to ``pool_capacity`` pools."""
        if isinstance(pools, Mapping):
            items = list(pools.items())
        elif isinstance(pools, Sequence) and not isinstance(pools, (str, bytes)):
            items = list(pools)
        else:
            raise ValueError(f"cluster: pools must be a mapping or (kind, count) pairs, got "
                             f"{type(pools).__name__}")
        if not items:
            raise ValueError("cluster: at least one pool of GPUs is required")
        cap = len(items) if pool_capacity is None else checks.positive_int(
            pool_capacity, "cluster: pool_capacity", 1024)
        if cap < len(items):
            raise ValueError(f"cluster: {len(items)} pools exceed pool_capacity={cap}")
        inlet_celsius = checks.number(inlet_celsius, "cluster: inlet_celsius", -50.0, 100.0)
        if power_cap_watts != float("inf"):
            power_cap_watts = checks.number(power_cap_watts, "cluster: power_cap_watts", 0.0,
                                            1e12)
        specs, counts = [], []
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"cluster: each pool is a (gpu kind, count) pair, got {item!r}")
            kind, count = item
            counts.append(checks.positive_int(count, f"cluster: gpu count of {kind!r}",
                                              checks.MAX_GPUS))
            specs.append(gpu_spec(kind))
        pad = cap - len(items)
        specs += [specs[0]] * pad
        counts += [0] * pad

        def arr(f, dtype=np.float32):
            return np.array([f(s) for s in specs], dtype=dtype)

        host = dict(
            gpu_count=np.array(counts, np.int32),
            gpu_kind=arr(lambda s: GPU_NAMES.index(s.name), np.int32),
            hbm_bytes=arr(lambda s: s.hbm_bytes),
            hbm_bytes_per_second=arr(lambda s: s.hbm_bytes_per_second),
            peak_flops=np.array([s.peak_flops for s in specs], np.float32),
            tdp_watts=arr(lambda s: s.tdp_watts),
            idle_watts=arr(lambda s: s.idle_watts),
            nvlink_bytes_per_second=arr(lambda s: s.nvlink_bytes_per_second),
            network_bytes_per_second=arr(lambda s: s.network_bytes_per_second),
            gpus_per_node=arr(lambda s: s.gpus_per_node, np.int32),
            slowdown_celsius=arr(lambda s: s.slowdown_celsius),
            shutdown_celsius=arr(lambda s: s.shutdown_celsius),
            thermal_resistance_celsius_per_watt=arr(
                lambda s: s.thermal_resistance_celsius_per_watt
            ),
            price_per_gpu_hour=arr(lambda s: s.price_per_gpu_hour),
            valid=np.arange(cap) < len(items),
            inlet_celsius=np.asarray(np.float32(inlet_celsius)),
            power_cap_watts=np.asarray(np.float32(power_cap_watts)),
        )
        return cls(**jax.device_put(host))

    @classmethod
    def uniform(cls, gpu_kind: str, count: int, **kwargs) -> ClusterSpec:
        """A cluster of ``count`` GPUs of one kind (one pool, padded to ``pool_capacity``)."""
        return cls.mixed([(gpu_kind, count)], **kwargs)


