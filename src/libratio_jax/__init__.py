"""libratio_jax: batched, jittable physics of GPU-cluster allocation plans for RL.

    >>> import libratio_jax as lj
    >>> sc = lj.reference_scenario()
    >>> plan = lj.Plan.from_choices(sc, [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 4)
    >>> m = lj.evaluate(sc, plan)
    >>> m.fits.tolist(), bool(m.overcommitted)
    ([True, True, True, True], False)
"""

from libratio_jax.env.registry import make, registered_envs
from libratio_jax.physics import catalog
from libratio_jax.physics.architecture import ModelSpec
from libratio_jax.physics.cpu_dispatch import inline_cpu_dispatch
from libratio_jax.physics.estimate import (
    MemoryEstimate,
    ThroughputEstimate,
    estimate_memory,
    estimate_throughput,
)
from libratio_jax.physics.formats import FORMAT_NAMES, format_id
from libratio_jax.physics.hardware import ClusterSpec, GpuSpec
from libratio_jax.physics.host_memory import reuse_host_memory
from libratio_jax.physics.kernel import Metrics, evaluate, evaluate_one
from libratio_jax.physics.plan import Plan, validate_plan
from libratio_jax.physics.scenario import Scenario, Tenant, Workload, reference_scenario

__version__ = "0.2.0"

__all__ = [
    "FORMAT_NAMES",
    "ClusterSpec",
    "GpuSpec",
    "MemoryEstimate",
    "Metrics",
    "ModelSpec",
    "Plan",
    "Scenario",
    "Tenant",
    "ThroughputEstimate",
    "Workload",
    "catalog",
    "estimate_memory",
    "estimate_throughput",
    "evaluate",
    "evaluate_one",
    "inline_cpu_dispatch",
    "format_id",
    "make",
    "reference_scenario",
    "registered_envs",
    "reuse_host_memory",
    "validate_plan",
]
