"""Power, temperature, throttling and memory zones of one tenant's GPUs.

- Power per GPU ``idle + (tdp - idle) * busy`` (linear utilization model; the measured
  H100 anchors of docs/measurements.md: ~120 W with a context at 0% load, the 700 W cap under
  dense GEMMs).
- Steady-state die temperature ``inlet + R * power`` (first-order thermal model; R = 0.054 °C/W
  measured on one H100 SXM chassis, docs/measurements.md). The environment adds the first-order
  lag (tau about 21.5 s) on top.
- Throttling above the slowdown temperature: the clock falls linearly from 1 at slowdown to
  ``THROTTLE_FLOOR`` at shutdown (assumption: NVIDIA documents HW slowdown as clock reduction
  between these limits but not its curve).
- Memory zones: fits when the per-GPU total (overhead included) is at most the HBM capacity;
  warning above ``MEMORY_WARNING_FRACTION`` and danger above ``MEMORY_DANGER_FRACTION``.
"""

from __future__ import annotations

import jax.numpy as jnp

THROTTLE_FLOOR = 0.5
MEMORY_WARNING_FRACTION = 0.90
MEMORY_DANGER_FRACTION = 0.97


def gpu_power_watts(busy_fraction, idle_watts, tdp_watts):
    """Per-GPU power for a busy fraction in [0, 1]."""
    return idle_watts + (tdp_watts - idle_watts) * jnp.clip(busy_fraction, 0.0, 1.0)


def steady_temperature_celsius(power_watts, inlet_celsius, resistance_celsius_per_watt):
    """Steady-state die temperature of a GPU drawing ``power_watts``."""
    return inlet_celsius + resistance_celsius_per_watt * power_watts


def throttle_clock(temperature_celsius, slowdown_celsius, shutdown_celsius):
    """Clock factor in [THROTTLE_FLOOR, 1]: 1 below slowdown, linear to the floor at shutdown."""
    span = jnp.maximum(shutdown_celsius - slowdown_celsius, 1e-3)
    over = jnp.clip((temperature_celsius - slowdown_celsius) / span, 0.0, 1.0)
    return 1.0 - (1.0 - THROTTLE_FLOOR) * over


def memory_fraction(total_bytes, hbm_bytes):
    """Per-GPU memory as a fraction of HBM capacity."""
    return total_bytes / hbm_bytes
