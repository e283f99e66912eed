"""Evaluation of a batch of plans sharded over every local device (data parallel).

The plans are split along their batch axis over a one-axis device mesh (``"batch"``); the
scenario is replicated; each device runs :func:`~libratio_jax.physics.kernel.evaluate_batch`
on its shard (``jax.shard_map``: no communication, the physics of one plan never looks at
another). A batch that does not divide by the device count is padded with copies of its first
plan and the padding is cut from the result. One compiled function per mesh and padded batch
size.

On CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` makes 8 host devices (set it
before JAX starts), which is how the tests exercise it.

Example:
    >>> import libratio_jax as lj
    >>> from libratio_jax.physics.plan import sample_plans
    >>> from libratio_jax.physics.sharding import evaluate_sharded
    >>> sc = lj.reference_scenario(block_groups=1)
    >>> m = evaluate_sharded(sc, sample_plans(sc, 10, seed=0))
    >>> m.fits.shape
    (10, 4)
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from libratio_jax.physics.kernel import Metrics, evaluate_batch, jax_ready_plan
from libratio_jax.physics.plan import Plan, validate_plan
from libratio_jax.physics.scenario import Scenario

AXIS = "batch"


def batch_mesh(devices=None) -> Mesh:
    """A one-axis mesh (``"batch"``) over ``devices`` (default: every local device)."""
    devices = jax.local_devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("batch_mesh: no devices")
    return Mesh(np.asarray(devices), (AXIS,))


@functools.cache
def sharded_evaluate_batch(mesh: Mesh, layer_stability: bool = True):
    """The jitted pure function ``(scenario, plans) -> Metrics`` that runs
    :func:`~libratio_jax.physics.kernel.evaluate_batch` on every device of ``mesh`` (the
    scenario replicated, the plans split on the batch axis; place them with
    :func:`shard_plans`). Cached per mesh: use it in loops and benchmarks."""
    fn = jax.shard_map(functools.partial(evaluate_batch, layer_stability=layer_stability),
                       mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS))
    return jax.jit(fn)


def shard_plans(plan: Plan, mesh: Mesh) -> tuple[Plan, int]:
    """``(plans padded to a multiple of the mesh size and placed on it, real batch size)``."""
    b = plan.gpus.shape[0]
    n = mesh.devices.size
    pad = -b % n

    def place(x):
        x = jnp.asarray(x)
        if pad:
            x = jnp.concatenate([x, jnp.broadcast_to(x[:1], (pad,) + x.shape[1:])])
        return jax.device_put(x, NamedSharding(mesh, P(AXIS)))

    return jax.tree.map(place, plan), b


_REPLICATED: dict = {}  # (id(scenario), mesh) -> (weak reference, the scenario replicated)


def replicated(scenario: Scenario, mesh: Mesh) -> Scenario:
    """``scenario`` placed on every device of ``mesh``. Kept while the scenario object lives
    when its leaves are all JAX arrays (they cannot change; a NumPy array may change in
    place, so such a scenario is placed anew each call): placing the reference scenario's 66
    arrays on two host devices took ~4-5 ms, ~15% of a 65,536-plan merged-row call. Each
    kept replica holds a copy per device while its scenario lives."""
    key = (id(scenario), mesh)
    kept = _REPLICATED.get(key)
    if kept is not None and kept[0]() is scenario:
        return kept[1]
    placed = jax.device_put(scenario, NamedSharding(mesh, P()))
    leaves = jax.tree.leaves(scenario)
    if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
        try:  # (the dict bound now: module globals may be gone when the last scenarios die)
            ref = weakref.ref(scenario, lambda _, key=key, kept=_REPLICATED: kept.pop(key, None))
        except TypeError:
            return placed
        _REPLICATED[key] = (ref, placed)
    return placed


def evaluate_sharded(scenario: Scenario, plan: Plan, *, mesh: Mesh | None = None,
                     validate: bool = True, layer_stability: bool = True) -> Metrics:
    """:func:`~libratio_jax.evaluate` of plans ``[B, ...]`` split over the devices of ``mesh``
    (default: :func:`batch_mesh` of every local device). Same values as ``lj.evaluate``
    (``validate`` and ``layer_stability`` as there)."""
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan, got {type(plan).__name__}")
    if plan.precision.ndim != 3:
        raise ValueError("evaluate_sharded takes plans with one batch axis: precision [B, M, L], "
                         f"got shape {plan.precision.shape}")
    if validate:
        validate_plan(scenario, plan)
    mesh = batch_mesh() if mesh is None else mesh
    plans, b = shard_plans(jax_ready_plan(plan), mesh)  # host integers beyond int32 unwrapped
    scenario = replicated(scenario, mesh)
    out = sharded_evaluate_batch(mesh, bool(layer_stability))(scenario, plans)
    return out if out.fits.shape[0] == b else jax.tree.map(lambda x: x[:b], out)
