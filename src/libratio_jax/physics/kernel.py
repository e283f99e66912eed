"""``evaluate(scenario, plan) -> Metrics``: memory, speed, stability and safety of a plan.

:func:`evaluate_one` is the pure function for one plan (jit/vmap/grad-free friendly);
:func:`evaluate` is the API boundary: it validates concrete inputs once, outside ``jit``, then
runs a cached jitted ``vmap`` over any leading batch axes of the plan.

Example:
    >>> import libratio_jax as lj
    >>> sc = lj.reference_scenario()
    >>> plans = lj.Plan.stack([lj.Plan.from_choices(sc, [{"gpus": 2}] * 4)] * 3)
    >>> m = lj.evaluate(sc, plans)
    >>> m.tokens_per_second.shape
    (3, 4)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import (
    cpu_dispatch,
    cpu_options,
    cuda_kernels,
    gpu_kernels,
    native,
    safety,
    stability,
)
from libratio_jax.physics import formats as F
from libratio_jax.physics.architecture import ROW_FIELDS
from libratio_jax.physics.cpu_dispatch import inline_dispatch as _inline_dispatch
from libratio_jax.physics.memory import (
    largest_layer_bytes_of,
    layer_gather_bytes,
    memory_row_terms,
    tenant_memory,
)
from libratio_jax.physics.packing import join_bytes, leaf_reader, pack, split_bytes, unpack
from libratio_jax.physics.plan import (
    INT_FIELDS,
    INT_LIMIT,
    Plan,
    breaks_rules,
    format_ids_in_range,
    gate_fields,
    sanitize_fields,
    sanitize_plan,
    validate_plan,
    validate_shapes,
)
from libratio_jax.physics.rowclasses import (
    CONTRACTION_PRECISION,
    ENTRY_SHIFT,
    RowPairs,
    class_model,
    class_total,
    compact_entries,
    count_ids,
    entry_model,
    format_counts,
    format_ids,
    own_classes,
    row_pairs,
)
from libratio_jax.physics.scenario import TRAIN, Scenario
from libratio_jax.physics.stability import stability_row_terms, tenant_stability
from libratio_jax.physics.throughput import (
    LAUNCH_GROUPS,
    format_speed_columns,
    grouped_launch_seconds,
    launch_groups,
    roofline_factors,
    roofline_row_sums,
    roofline_rows,
    row_roofline,
    step_row_terms,
    tenant_step_time,
)


@struct.dataclass
class Metrics:
    """Per-tenant fields have shape ``[..., M]`` (``layer_stability``: ``[..., M, L]``, None when
    ``evaluate(..., layer_stability=False)``);
    cluster fields ``[...]`` (``gpus_used``: ``[..., P]``). Absent tenants and tenants with no
    GPUs (``active`` False) report zeros, ``fits`` False for a present tenant with no GPUs.
    Units: bytes per GPU, seconds, tokens/s, watts per GPU, °C.
    """

    memory_weights_bytes: jnp.ndarray
    memory_gradients_bytes: jnp.ndarray
    memory_optimizer_bytes: jnp.ndarray
    memory_activations_bytes: jnp.ndarray
    memory_logits_bytes: jnp.ndarray
    memory_kv_cache_bytes: jnp.ndarray
    memory_overhead_bytes: jnp.ndarray
    memory_bytes: jnp.ndarray
    memory_fraction: jnp.ndarray
    fits: jnp.ndarray
    memory_warning: jnp.ndarray
    memory_danger: jnp.ndarray
    step_seconds: jnp.ndarray
    tokens_per_second: jnp.ndarray
    speedup_vs_bf16: jnp.ndarray
    meets_slo: jnp.ndarray
    layer_stability: jnp.ndarray
    stability: jnp.ndarray
    diverges: jnp.ndarray
    power_watts: jnp.ndarray
    temperature_celsius: jnp.ndarray
    clock_factor: jnp.ndarray
    throttled: jnp.ndarray
    active: jnp.ndarray
    gpus_used: jnp.ndarray
    overcommitted: jnp.ndarray
    cluster_power_watts: jnp.ndarray
    power_over_cap: jnp.ndarray
    plan_valid: jnp.ndarray  # [..., M] every field in its domain (physics.plan.sanitize_plan)


_METRICS_NAMES = tuple(f.name for f in dataclasses.fields(Metrics))
_METRICS_FIELDS = len(_METRICS_NAMES)
_LAYER_STABILITY = _METRICS_NAMES.index("layer_stability")


def _metrics_of(leaves) -> Metrics:
    """``Metrics`` of its fields' values in order (extra values after them ignored)."""
    return _frozen(Metrics, _METRICS_NAMES, leaves[:_METRICS_FIELDS])


def _frozen(cls, names, values):
    """An instance of the frozen dataclass ``cls`` (``Metrics``, ``Plan``) of its fields'
    ``values`` in the order of ``names``, without its generated ``__init__``, which sets the
    fields one ``object.__setattr__`` at a time (~3 µs against ~1 µs; one host plan's call
    is latency-bound). Neither class has a ``__post_init__`` or slots: the instance is the
    one ``cls(*values)`` makes."""
    out = object.__new__(cls)
    out.__dict__.update(zip(names, values, strict=True))
    return out


_POOL_FIELDS = ("peak_flops", "hbm_bytes", "hbm_bytes_per_second", "nvlink_bytes_per_second",
                "network_bytes_per_second", "gpus_per_node", "tdp_watts", "idle_watts",
                "slowdown_celsius", "shutdown_celsius", "thermal_resistance_celsius_per_watt")


def _layout(gpus, tp, pp, micro_batch):
    """A tenant's ``(tp, pp, dp, micro_batch)`` from its sanitized fields
    (``plan.sanitize_fields``): degrees of at least 1, ``dp`` the GPUs left to data
    parallelism and the micro-batch as float32."""
    tp_ = jnp.maximum(tp, 1)
    pp_ = jnp.maximum(pp, 1)
    # ``gpus // (tp * pp)`` in float32: exact on sanitized fields (at most 2^24 GPUs, and
    # ``tp * pp`` divides them or there are none), and XLA's CPU code divides floats 16 at a
    # time where it divides integers one at a time.
    dp = jnp.floor(gpus.astype(jnp.float32) / (tp_.astype(jnp.float32)
                                                * pp_.astype(jnp.float32)))
    return tp_, pp_, jnp.maximum(dp, 1.0), jnp.maximum(micro_batch, 1).astype(jnp.float32)


def _tenant_metrics(model, coarse, workload, present, pool, inlet, precision, row_weight, sums,
                    gpus, tp, pp, zero_stage, recompute, kv_precision, micro_batch):
    """All per-tenant metrics (scalars, plus ``[L]`` layer scores) as a dict; each row of
    ``model`` counted ``row_weight`` times (None: once); ``sums`` the plan-dependent row
    sums if the caller has them (:func:`_class_row_sums`), else None."""
    tp_, pp_, dp, mb = _layout(gpus, tp, pp, micro_batch)
    given = {} if sums is None else sums  # the row sums the caller has (class path)
    mem = tenant_memory(model, workload, precision, kv_precision, tp_, pp_, dp, zero_stage,
                        recompute, mb, row_weight=row_weight,
                        largest_layer_bytes=given.get("largest_layer"),
                        row_totals=given.get("memory"))
    st = tenant_step_time(model, workload, pool, precision, kv_precision, tp_, pp_, dp,
                          zero_stage, recompute, mb, row_weight=row_weight,
                          roofline_sums=given.get("roofline"), row_totals=given.get("step"))
    # The all-BF16 baseline on the merged-block model (identical physics, ~14 rows; its
    # roofline sums from the caller's per-entry terms if it has them).
    bf16 = jnp.full_like(coarse.kind, F.BF16)
    st_bf16 = tenant_step_time(coarse, workload, pool, bf16, jnp.int32(F.BF16), tp_, pp_, dp,
                               zero_stage, recompute, mb,
                               roofline_sums=given.get("bf16"))
    power = safety.gpu_power_watts(st.busy_fraction, pool["idle_watts"], pool["tdp_watts"])
    temp = safety.steady_temperature_celsius(power, inlet,
                                             pool["thermal_resistance_celsius_per_watt"])
    clock = safety.throttle_clock(temp, pool["slowdown_celsius"], pool["shutdown_celsius"])
    # Throttling stretches the kernels' time by 1 / clock; communication is unaffected.
    step = st.step_seconds + st.kernel_seconds * (1.0 / clock - 1.0)
    tokens = st.tokens_per_second * st.step_seconds / step
    rows, score, diverges = tenant_stability(model, workload.mode, precision, kv_precision,
                                             row_weight, row_totals=given.get("stability"))
    frac = safety.memory_fraction(mem.total, pool["hbm_bytes"])
    active = present & (gpus > 0)
    z = jnp.float32(0.0)

    def on(x, off=z):
        return jnp.where(active, x, off)

    return dict(
        memory_weights_bytes=on(mem.weights), memory_gradients_bytes=on(mem.gradients),
        memory_optimizer_bytes=on(mem.optimizer), memory_activations_bytes=on(mem.activations),
        memory_logits_bytes=on(mem.logits), memory_kv_cache_bytes=on(mem.kv_cache),
        memory_overhead_bytes=on(mem.overhead), memory_bytes=on(mem.total),
        memory_fraction=on(frac),
        fits=jnp.where(present, active & (frac <= 1.0), True),
        memory_warning=active & (frac > safety.MEMORY_WARNING_FRACTION),
        memory_danger=active & (frac > safety.MEMORY_DANGER_FRACTION),
        step_seconds=on(step), tokens_per_second=on(tokens),
        speedup_vs_bf16=on(st_bf16.step_seconds / st.step_seconds),
        meets_slo=active & (tokens >= workload.slo_tokens_per_second),
        layer_stability=jnp.where(present, rows, 1.0), stability=on(score),
        diverges=active & diverges,
        power_watts=on(power), temperature_celsius=on(temp), clock_factor=on(clock, 1.0),
        throttled=active & (clock < 1.0), active=active,
    )


def evaluate_one(scenario: Scenario, plan: Plan) -> Metrics:
    """Metrics of one plan (no batch axis) on one scenario. Pure; safe under jit and vmap.

    Any plan arrays are accepted (floats, NaN, out-of-domain values): a tenant whose plan is
    out of its domain is evaluated as idle and reported in ``plan_valid`` (see
    :func:`~libratio_jax.physics.plan.sanitize_plan`); every metric stays finite."""
    # Fenced (physics.native.fence): else XLA recomputes the sanitizer's ~60 checks inside
    # every per-row kernel of the physics (merged rows, 65,536 plans, alternating processes:
    # 0.89-0.91 -> 1.14-1.17 M plans/s), and the verdict inside it, else each safe field's
    # kernel recomputes the checks (9 copies).
    safe, valid = sanitize_plan(scenario, plan, fence=native.fence)
    return evaluate_sanitized(scenario, native.fence(safe), valid)


def evaluate_sanitized(scenario: Scenario, plan: Plan, plan_valid) -> Metrics:
    """:func:`evaluate_one` of a plan already through ``sanitize_plan`` (``plan_valid[M]`` its
    verdict): for callers that need the sanitized plan too, so it is computed once."""
    return _evaluate_tenants(scenario, scenario.models, plan.precision, 0,
                             {f: getattr(plan, f) for f in INT_FIELDS}, plan_valid)


def _tenant_pools(cluster, pool_field):
    """Each tenant's pool scalars (``_POOL_FIELDS``, ``[M]`` each) of its ``pool`` field, and
    its pool's ``format_speed`` (``throughput.format_speed_columns``, ``[M, F, 2]``), computed
    per pool: independent of the plan, so once per call under ``vmap``, where per tenant each
    plan recomputed them (a gather and a division per format: full resolution, two pools,
    16,384 plans, ~0.3 µs per plan of kernel time)."""
    pool_idx = jnp.clip(pool_field, 0, cluster.gpu_count.shape[-1] - 1)
    pools = {k: getattr(cluster, k)[pool_idx] for k in _POOL_FIELDS}
    # picked by a select per pool (elementwise; a gather of the rows cost ~40 ns per plan)
    speed = jax.vmap(format_speed_columns)(cluster.peak_flops)  # [pools, F, 2]
    picked = jnp.broadcast_to(speed[0], pool_idx.shape + speed.shape[1:])
    for p in range(1, speed.shape[0]):
        picked = jnp.where((pool_idx == p)[..., None, None], speed[p], picked)
    pools["format_speed"] = picked
    return pool_idx, pools


# The sanitized fields :func:`_tenant_metrics` takes after its sums, in its order.
_TENANT_FIELDS = ("gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch")


def _evaluate_tenants(scenario: Scenario, models, precision, precision_axis, fields,
                      plan_valid, row_weight=None, sums=None) -> Metrics:
    """Metrics of sanitized ``fields`` (``[M]`` each) with the row formats ``precision`` of
    ``models`` (``[M, L]`` and the scenario's models, or ``formats.FORMAT_AXIS`` and the
    class models of :func:`_classes`, ``precision_axis`` None, each row
    counted ``row_weight[M, C, F]`` times, ``sums`` the plan-dependent sums if known)."""
    c = scenario.cluster
    pool_idx, pools = _tenant_pools(c, fields["pool"])
    per_tenant = jax.vmap(_tenant_metrics,
                          in_axes=(0, 0, 0, 0, 0, None, precision_axis,
                                   None if row_weight is None else 0,
                                   None if sums is None else 0) + (0,) * 7)(
        models, scenario.coarse_models, scenario.workloads, scenario.present, pools,
        c.inlet_celsius, precision, row_weight, sums,
        *(fields[f] for f in _TENANT_FIELDS))
    return _with_cluster(c, scenario.present, per_tenant, fields["gpus"], pool_idx, plan_valid)


def _with_cluster(cluster, present, per_tenant: dict, gpus, pool_idx, plan_valid) -> Metrics:
    """Metrics of the tenants' own metrics ``per_tenant`` (what :func:`_tenant_metrics` gives,
    ``[M]`` each) with the cluster's: the GPUs each pool gives (``gpus[M]`` of the present
    tenants, in their pools ``pool_idx[M]``), over-commitment and the cluster's power. The
    only physics that couples tenants."""
    n_pools = cluster.gpu_count.shape[-1]
    active = per_tenant["active"]
    gpus = jnp.where(present, gpus, 0)
    onehot = pool_idx[:, None] == jnp.arange(n_pools)[None, :]
    used = jnp.sum(jnp.where(onehot, gpus[:, None], 0), axis=0)
    overcommitted = jnp.any(used > jnp.where(cluster.valid, cluster.gpu_count, 0))
    idle_gpus = jnp.maximum(jnp.where(cluster.valid, cluster.gpu_count, 0) - used, 0)
    cluster_power = (jnp.sum(jnp.where(active, per_tenant["power_watts"] * gpus, 0.0))
                     + jnp.sum(idle_gpus * cluster.idle_watts))
    return Metrics(
        **per_tenant,
        gpus_used=used,
        overcommitted=overcommitted,
        cluster_power_watts=cluster_power,
        power_over_cap=cluster_power > cluster.power_cap_watts,
        plan_valid=plan_valid,
    )


# The Metrics fields _with_cluster sets (the others are _tenant_metrics', leading axis M).
_WITH_CLUSTER_FIELDS = ("gpus_used", "overcommitted", "cluster_power_watts", "power_over_cap",
                        "plan_valid")


def evaluate_without_each(scenario: Scenario, plan: Plan, metrics: Metrics) -> Metrics:
    """``Metrics`` with a leading axis ``[M]``: entry ``i`` is what :func:`evaluate_sanitized`
    gives the plan with tenant ``i`` removed (absent, holding the idle plan: the
    counterfactual of a difference reward, ``rewards.difference.null_plan``), from the
    plan's own ``metrics``. One plan (no batch axis; vmap this for several) through
    ``sanitize_plan``: its safe plan, its metrics. A tenant's own metrics depend on it alone,
    so only the removed tenant's (those of an absent tenant, constants XLA folds) and the
    cluster's (pools, power) change: no physics is evaluated again. Equal to evaluating
    each counterfactual (``tests/test_physics.py``)."""
    if metrics.active.ndim != 1:
        raise ValueError("evaluate_without_each takes one plan's metrics ([M] per tenant), "
                         f"got active of shape {metrics.active.shape}: vmap it over a batch")
    m = scenario.num_tenants
    absent = evaluate_sanitized(scenario.replace(present=jnp.zeros_like(scenario.present)),
                                Plan.idle(m, scenario.num_layers), jnp.ones((m,), jnp.bool_))
    pool_idx = jnp.clip(plan.pool, 0, scenario.cluster.gpu_count.shape[-1] - 1)

    def without(i):
        keep = jnp.arange(m) != i

        def pick(own, gone):
            if own is None:  # (a field left out, e.g. layer_stability)
                return None
            return jnp.where(keep.reshape((m,) + (1,) * (own.ndim - 1)), own, gone)

        per_tenant = {f.name: pick(getattr(metrics, f.name), getattr(absent, f.name))
                      for f in dataclasses.fields(Metrics)
                      if f.name not in _WITH_CLUSTER_FIELDS}
        return _with_cluster(scenario.cluster, scenario.present & keep, per_tenant,
                             jnp.where(keep, plan.gpus, 0), pool_idx,  # (no GPUs: any pool)
                             jnp.where(keep, metrics.plan_valid, True))

    return jax.vmap(without)(jnp.arange(m))


def evaluate_counted(scenario: Scenario, plan: Plan, counts, *,
                     layer_stability: bool = True) -> Metrics:
    """:func:`evaluate_one` of a plan whose row formats are given as ``counts[M, classes, F]``
    (:func:`~libratio_jax.physics.rowclasses.format_counts`) in the grid of :func:`_classes`
    (a full-resolution scenario's ``row_classes``, or one class per merged row): the
    physics run on the class models, identical to the
    row-by-row physics up to float rounding. ``plan.precision`` is read only for
    ``layer_stability`` (``[M, L]``; with ``layer_stability=False`` the field is None)."""
    out = _evaluate_counted_fields(scenario, *sanitize_fields(scenario, plan), counts)
    per_row = (rows_layer_stability(scenario, plan.precision, out.plan_valid)
               if layer_stability else None)
    return out.replace(layer_stability=per_row)


def _evaluate_counted_fields(scenario: Scenario, fields: dict, fields_valid, counts,
                             complete=None, sums=None, models=None) -> Metrics:
    """:func:`evaluate_counted` with ``layer_stability=False`` of a plan's integer fields
    already through ``sanitize_fields(scenario, plan)`` (``fields_valid[M]`` their verdict);
    ``complete[M]``, whether every row of the tenant was counted, if known (else from the
    counts' sum); ``sums`` its plan-dependent row sums if known (:func:`_class_row_sums`);
    ``models`` the class models of :func:`_classes` if the caller has them."""
    if complete is None:
        rows = jnp.sum(scenario.models.valid, axis=-1).astype(jnp.float32)
        complete = jnp.sum(counts, axis=(-2, -1)) == rows
    fields, valid = native.fence(gate_fields(scenario, fields, fields_valid, complete))
    # An invalid or absent tenant has no GPUs in ``fields``, so every metric of it is gated
    # off and its counts (finite whatever the plan: out-of-domain rows are not counted) need
    # no replacing (XLA would recompute the whole check inside every per-entry kernel).
    models = _classes(scenario)[0] if models is None else models
    out = _evaluate_tenants(scenario, models, F.FORMAT_AXIS, None, fields, valid, counts, sums)
    return out.replace(layer_stability=None)  # the class model's, not the plan's rows


def _evaluate_counted_batch(scenario: Scenario, models, fields: dict, fields_valid, counts,
                            complete, sums: dict) -> Metrics:
    """``jax.vmap`` of :func:`_evaluate_counted_fields` over a chunk of ``b`` plans, computed
    with the plans last: ``fields`` and ``fields_valid`` ``[b, M]``, ``counts [M, C, F, b]``
    (or None), ``complete [M, b]`` and ``sums`` (``[M, b]`` leaves) as the class path has
    them; the metrics ``[b, ...]``, as the vmap's. The same operations, each tenant's
    physics mapped over the plans inside a map over the tenants, so that XLA's CPU kernels
    run along the plans (8 floats a vector with AVX2) rather than along the 4 tenants of a
    plan (on one core an elementwise kernel on ``[4096, 4]`` took ~1.5x as long as on ``[4,
    4096]``: docs/performance.md, thirty-eighth round)."""
    c = scenario.cluster
    fields, valid = jax.vmap(lambda f, v, ok: gate_fields(scenario, f, v, ok),
                             in_axes=(0, 0, 1))(fields, fields_valid, complete)
    # the gated fields transposed once, [M, b] (else each kernel that reads one transposes it)
    fields, valid = native.fence(jax.tree.map(lambda x: x.T, (fields, valid)))
    pool_idx, pools = _tenant_pools(c, fields["pool"])  # [M, b(, ...)]
    per_field = [fields[f] for f in _TENANT_FIELDS]

    def tenant(model, coarse, workload, present, pool, row_weight, tenant_sums, *tenant_fields):
        return jax.vmap(_tenant_metrics,
                        in_axes=(None, None, None, None, 0, None, None,
                                 None if row_weight is None else -1,
                                 None if tenant_sums is None else 0) + (0,) * 7)(
            model, coarse, workload, present, pool, c.inlet_celsius, F.FORMAT_AXIS,
            row_weight, tenant_sums, *tenant_fields)

    per_tenant = jax.vmap(tenant, in_axes=(0, 0, 0, 0, 0, None if counts is None else 0,
                                           None if sums is None else 0) + (0,) * 7)(
        models, scenario.coarse_models, scenario.workloads, scenario.present, pools, counts,
        sums, *per_field)  # [M, b] each
    # Fenced, then transposed to [b, M] where they are written into the batch's outputs
    # (unfenced, XLA fuses their physics into those writes, which run in the output's order)
    per_tenant = native.fence({k: v for k, v in per_tenant.items() if k != "layer_stability"})
    per_tenant["layer_stability"] = None  # (the class models', not the plan's rows)
    return jax.vmap(_with_cluster, in_axes=(None, None, 1, 1, 1, 1))(
        c, scenario.present, per_tenant, fields["gpus"], pool_idx, valid)


def _plans_last() -> bool:
    """Whether the class path runs a chunk's tenant physics with the plans last
    (:func:`_evaluate_counted_batch`): on the CPU, where XLA's kernels vectorize along the
    innermost axis. Elsewhere the plan-by-plan ``vmap`` of :func:`_evaluate_counted_fields`,
    as the GPU numbers were measured (the other form has not run on a GPU)."""
    return jax.default_backend() == "cpu"


def _classes(scenario: Scenario) -> tuple:
    """``(class models [M, C, F], grid int32[M, C, S], class sizes float32[M, C])`` that the
    class path counts and sums a batch by: the row classes of a full-resolution scenario
    (``rowclasses.class_model`` of its merged rows, ``row_classes``, the merged rows'
    ``count``), or each merged row a class of its own (``rowclasses.own_classes``)."""
    if scenario.row_classes is None:
        return own_classes(scenario.models)
    coarse = scenario.coarse_models
    return (jax.vmap(class_model)(coarse), scenario.row_classes,
            jnp.where(coarse.valid, coarse.count, 0.0))


def _by_class(scenario: Scenario) -> bool:
    """Whether :func:`evaluate_batch` counts and sums a batch by class: at full resolution
    always; with merged rows on the CPU with the native counts and picked sums (AVX2; on a
    CPU with AVX-512 VBMI, 65,536 plans, one process, no ``layer_stability``: 1.05-1.30 ->
    1.31-1.63 M plans/s counted, more with the picked sums since; on an AMD EPYC with AVX2
    only, 0.22-0.26 M row by row -> 1.2-1.4 M with the AVX2 kernels), else row by row."""
    return scenario.row_classes is not None or (jax.default_backend() == "cpu"
                                                and native.status().counts
                                                and native.status().picks)


def _class_rows(scenario: Scenario, classes: tuple | None = None) -> dict:
    """The plan-independent per-entry terms the class path sums batch-last
    (:func:`_class_row_sums`), ``[M, C, F, 1]`` each: the roofline's
    (``throughput.roofline_rows``), each entry's ZeRO-3 gathered bytes (``-1`` where no
    row can be) and its weight and group in the launches' sum (``launch_weight``,
    ``launch_group``: ``throughput.launch_groups``); ``class_rows [M, C, 1, 1]``, the rows of
    each class; ``terms``, per module its plan-independent row terms (``_ROW_TERMS``),
    ``[M, K, C, F]``. ``classes``: :func:`_classes` of the scenario if the caller has it."""
    models, _, sizes = _classes(scenario) if classes is None else classes
    rows = jax.vmap(roofline_rows, in_axes=(0, None))(models, F.FORMAT_AXIS)
    storage = jnp.asarray(F.STORAGE_BYTES, jnp.float32)[None, :]
    gather = jax.vmap(layer_gather_bytes, in_axes=(0, None))(models, storage)
    rows["largest_layer"] = jnp.where(models.valid, gather, -1.0)
    rows["launch_weight"], rows["launch_group"] = jax.vmap(launch_groups, in_axes=(0, None, 0))(
        rows, F.FORMAT_AXIS, scenario.workloads.mode == TRAIN)
    out = {k: jnp.broadcast_to(v, models.valid.shape)[..., None] for k, v in rows.items()}
    out["class_rows"] = sizes[:, :, None, None]
    out["terms"] = {name: jax.vmap(lambda model, workload, fn=fn: jnp.stack(
        [jnp.broadcast_to(x, model.valid.shape) for x in fn(model, workload)]))(
            models, scenario.workloads) for name, fn in _ROW_TERMS.items()}  # [M, K, C, F]
    return out


# Each module's plan-independent row terms on a class model (:func:`_classes`), in the
# order of its ``row_totals``: the class path sums them in one contraction.
_ROW_TERMS = {
    "memory": lambda model, workload: memory_row_terms(model, workload, F.FORMAT_AXIS),
    "step": lambda model, workload: step_row_terms(model, F.FORMAT_AXIS),
    "stability": lambda model, workload: stability_row_terms(model, workload.mode,
                                                             F.FORMAT_AXIS),
}
# Of those terms ((module, index) in _ROW_TERMS), the ones the contraction leaves out (13 -> 8
# terms: the native contraction ~195 -> ~150 ns per plan alone). A term that does not depend
# on the row's format (the parameters, the activation bytes saved in the blocks, the rows'
# stability weight) sums over a tenant whose rows all count to a per-tenant constant, its
# value per class times the class's rows (a tenant with a row not counted is gated off:
# _evaluate_counted_fields); a term equal to another module's (the gradient and weight bytes
# of the step time) is summed once. tests/test_kernel.py checks both on the modules' tables.
_FORMAT_FREE_TERMS = (("memory", 6), ("step", 1), ("stability", 1))
_SAME_TERMS = {("step", 0): ("memory", 1), ("step", 2): ("memory", 0)}


def _tenant_factors(workload, pool, model, gpus, tp, pp, recompute, micro_batch):
    """One tenant's roofline factors (``throughput.roofline_factors``) of its sanitized
    fields (``_FACTOR_FIELDS``), as :func:`_tenant_metrics`' step time computes them."""
    _, _, dp, mb = _layout(gpus, tp, pp, micro_batch)
    return roofline_factors(workload, pool, dp, recompute, mb,
                            experts_per_token=model.experts_per_token, n_experts=model.n_experts)


_FACTOR_FIELDS = ("gpus", "tp", "pp", "recompute", "micro_batch")


def _plan_factors(scenario: Scenario, fields: dict):
    """The roofline's plan factors (``throughput.Roofline``) of plans' sanitized integer fields
    (``[b, M]`` each), the plans' axis last: ``[M, 1, 1, b]`` scalars, ``[M, 1, F, b]`` per
    format."""
    def plan_factors(f):
        _, pools = _tenant_pools(scenario.cluster, f["pool"])
        return jax.vmap(_tenant_factors)(scenario.workloads, pools, scenario.coarse_models,
                                         *(f[k] for k in _FACTOR_FIELDS))

    r = jax.vmap(plan_factors)(fields)  # [b, M] scalars, [b, M, F] per format

    def batch_last(x):  # -> [M, 1, 1, b] or, per format, [M, 1, F, b]
        x = jnp.moveaxis(x, 0, -1)
        return x[:, None, None, :] if x.ndim == 2 else x[:, None, :, :]

    # Fenced (physics.native.fence): XLA fused the factors, transposed to the plans' axis last,
    # into the per-entry kernels below and recomputed them for each of the 192 entries of a
    # tenant (16,384 plans, no layer_stability, alternating processes: 312-418 -> 454-489 k
    # plans/s).
    return native.fence(jax.tree.map(batch_last, r))


def _sum_tables(rows: dict) -> tuple[list, tuple]:
    """What the class path's weighted sums take of :func:`_class_rows`' entries, made once
    per call outside the chunks: the keys ``(module, index)`` of the row terms summed (every
    module's, less ``_FORMAT_FREE_TERMS`` and ``_SAME_TERMS``) and ``(table float32[M, K, C x
    F], peaks, weights, groups [M, C x F])`` (``native.weighted_sums``' arguments)."""
    terms = rows["terms"]  # {module: [M, K, C, F]}
    m, _, c, f = terms["memory"].shape
    keys = [(name, k) for name, t in terms.items() for k in range(t.shape[1])]
    summed = [key for key in keys if key not in _FORMAT_FREE_TERMS and key not in _SAME_TERMS]
    table = jnp.stack([terms[name][:, k] for name, k in summed], axis=1).reshape(m, -1, c * f)

    def flat(x):  # [M, C, F, 1] -> [M, C x F]
        return x.reshape(m, c * f)

    return summed, (table, flat(rows["largest_layer"]), flat(rows["launch_weight"]),
                    flat(rows["launch_group"]))


def _by_group(weights, groups, n_groups: int = LAUNCH_GROUPS):
    """``[M, n_groups, E]``: each entry's launch weight in its group's row (``weights``,
    ``groups [M, E]``), so that the counts' product with it sums the weights per group."""
    return (groups[:, None, :] == jnp.arange(n_groups)[:, None]) * weights[:, None, :]


def _weighted_sums_in_xla(x, t, v, w, g, n_groups: int = LAUNCH_GROUPS):
    """``native.weighted_sums``' XLA form for the class path's counts ``x [M, E, b]``."""
    x = x.astype(jnp.float32)
    by_group = _by_group(w, g, n_groups)
    # One product, so the counts are read once, in float32 (CONTRACTION_PRECISION: on an H100
    # JAX's default is TF32). There the two default products took 1.12 + 1.15 ms of a
    # 1,048,576-plan call, the one float32 product 1.49 ms (docs/performance.md).
    both = jnp.einsum("mke,meb->mkb", jnp.concatenate([t, by_group], axis=1), x,
                      precision=CONTRACTION_PRECISION)
    k = t.shape[1]
    return both[:, :k], _largest_present(x, v), both[:, k:]


def _class_row_sums(scenario: Scenario, rows: dict, tables: tuple, fields: dict,
                    counts) -> dict:
    """The row sums of plans counted by class, ``[M, b]`` each, computed with the plans' axis
    last: ``roofline``, the ``(roofline, launch)`` seconds (``throughput.row_roofline``
    weighted by the counts, before tensor parallelism), ``bf16``, the same with every row in
    BF16 (the plan's all-BF16 baseline), ``largest_layer`` (the largest ZeRO-3 gathered
    bytes of an entry the plan holds), and per module (``memory``, ``step``, ``stability``)
    the sums of its plan-independent row terms, its ``row_totals``. ``fields`` the plans'
    sanitized integer fields (``[b, M]``), ``counts`` theirs (``[M, C, F, b]``, any numeric
    dtype), ``rows`` of :func:`_class_rows`, ``tables`` their :func:`_sum_tables`.
    Written per plan inside ``vmap``, these sums
    made XLA transpose the counts to the plans' axis first and write every entry's terms
    before a contraction (~1.5 µs per plan on the 2-core machine); here they are one native
    pass over the counts (``native.weighted_sums``: the row terms' sums, the largest held
    entry, the launches' weights per launch cost) and the roofline's fused elementwise pass
    over the batch-last counts (``rowclasses.class_total``)."""
    r = _plan_factors(scenario, fields)
    roof, _ = row_roofline(r, rows, r.seconds_per_flop, r.gemm_fixed_seconds)
    # The plan-independent terms of every module's sums, one contraction with the counts.
    # With them, ZeRO-3's largest gathered entry the plan holds (-1: no row can be), and the
    # launches' weights summed by launch cost (throughput.launch_groups): linear in the
    # counts, no per-entry pass of their own.
    m, c, f, b = counts.shape
    summed, args = tables
    sums = native.weighted_sums(counts.reshape(m, c * f, b), *args, LAUNCH_GROUPS,
                                _weighted_sums_in_xla)
    return _row_sums(scenario, rows, r, class_total(counts * roof), summed, sums)


def _gpu_class_row_sums(scenario: Scenario, rows: dict, tables: tuple, grid, fields: dict,
                        ids) -> tuple[dict, jax.Array]:
    """:func:`_class_row_sums` on an NVIDIA GPU from the plans' format ids ``ids uint8[b, M,
    L]``, with no counts: one kernel counts each plan's rows and sums the roofline, the
    weighted terms and the largest held entry of its counts in registers, the CUDA one
    (``cuda_kernels.class_sums``) where it is built and takes the scenario, else the Pallas
    one (``gpu_kernels.class_sums``); the XLA form wrote the counts, then ran the roofline
    over every entry of every plan (~36 of ~38 ms of a 1,048,576-plan call on an H100).
    Also returns whether every row of a tenant holds a format (``[M, b]``). Lowered for
    another platform (``gpu_kernels.PLATFORMS``), the counts and :func:`_class_row_sums`
    instead."""
    def elsewhere(fields, ids):
        counts, complete = format_counts(grid, ids, with_complete=True, compact=True)
        return _class_row_sums(scenario, rows, tables, fields, counts), complete

    def by_kernel(fields, ids):
        return _kernel_class_row_sums(scenario, rows, tables, grid, fields, ids)

    return gpu_kernels.on_gpu(by_kernel, elsewhere, fields, ids)


def _kernel_class_row_sums(scenario: Scenario, rows: dict, tables: tuple, grid, fields: dict,
                           ids) -> tuple[dict, jax.Array]:
    """:func:`_gpu_class_row_sums` by the kernel."""
    r = _plan_factors(scenario, fields)  # [M, 1, 1, b] scalars, [M, 1, F, b] per format
    summed, (table, peaks, weights, groups) = tables
    m, c, f = rows["valid"].shape[:3]
    full = jnp.concatenate([table, _by_group(weights, groups)], axis=1)  # [M, K + G, C x F]
    full = full.reshape(m, -1, c, f)

    def entry(x):  # [M, C, F(, 1)] -> [M, F, C]
        return jnp.swapaxes(jnp.broadcast_to(x, (m, c, f, 1))[..., 0].astype(jnp.float32), 1, 2)

    entries = jnp.stack([entry(rows[k]) for k in gpu_kernels.ENTRY_TERMS[:-1]]
                        + [entry(peaks.reshape(m, c, f, 1))], axis=2)  # [M, F, 6, C]
    reads = r.passes * r.micro_batches  # each weight per pass and micro-batch when training
    scalars = [r.work, r.hbm_bytes_per_second, jnp.where(r.is_train, reads, 1.0),
               jnp.where(r.is_train, reads, r.touched)]  # gpu_kernels.PLAN_TERMS
    plan_terms = jnp.concatenate(
        [jnp.stack([jnp.broadcast_to(x, r.work.shape)[:, 0, 0] for x in scalars], axis=-1),
         jnp.swapaxes(r.seconds_per_flop[:, 0], 1, 2)], axis=-1)  # [M, b, 4 + F]
    if cuda_kernels.status().used and cuda_kernels.supports(grid.shape, ids.shape,
                                                            full.shape[1]):
        got = cuda_kernels.class_sums(grid, ids, plan_terms, entries, full)
    else:
        got = gpu_kernels.class_sums(grid, ids, plan_terms, entries, full)
    k = table.shape[1]
    sums = native.EntrySums(got.sums[:, :k], got.peak, got.sums[:, k:])
    return _row_sums(scenario, rows, r, got.roofline, summed, sums), got.complete


def _picks(scenario: Scenario, rows: dict) -> jax.Array:
    """``float32[M, 2 + P, C x F]``: what :func:`_picked_row_sums` picks of each class's
    entry, the roofline's per-entry terms that depend on its format (weight bytes,
    activation bytes per token) and the seconds per FLOP of its format on each of the
    cluster's ``P`` pools (``throughput.format_speed_columns``)."""
    m, c, f, _ = rows["weight_bytes"].shape
    speed = jax.vmap(format_speed_columns)(scenario.cluster.peak_flops)[..., 0]  # [P, F]
    per_pool = jnp.broadcast_to(speed[None, :, None, :], (m, speed.shape[0], c, f))
    return jnp.concatenate([rows["weight_bytes"][..., 0][:, None],
                            rows["io_bytes_per_token"][..., 0][:, None], per_pool],
                           axis=1).reshape(m, -1, c * f)


def _picked_in_xla(grid, ids, table, peaks, weights, groups, picks,
                   n_groups: int = LAUNCH_GROUPS):
    """``native.picked_sums``' XLA form: the plans' counts (``rowclasses.count_ids``), their
    weighted sums, and each class's picks as the counts' product with them (one entry per
    class)."""
    counts, complete = count_ids(grid, ids)  # [M, C, F, b]
    m, c, f, b = counts.shape
    flat = counts.reshape(m, c * f, b)
    picked = jnp.einsum("mjcf,mcfb->mjcb", picks.reshape(m, -1, c, f), counts,
                        precision=CONTRACTION_PRECISION)
    return (native.EntrySums(*_weighted_sums_in_xla(flat, table, peaks, weights, groups,
                                                    n_groups)), picked, complete)


def _picked_row_sums(scenario: Scenario, rows: dict, tables: tuple, picks, grid,
                     fields: dict, ids, start=None,
                     size: int | None = None) -> tuple[dict, jax.Array]:
    """:func:`_class_row_sums` of plans whose classes hold one row each (merged rows,
    ``rowclasses.own_classes``; ``grid int32[M, C, 1]``; ``picks`` of :func:`_picks`, made
    once per call as ``tables`` are), read from their format ids ``ids
    uint8[b, M, L]`` (``start``, ``size``: a chunk of them read where it lies,
    ``native.picked_sums``), and whether every row of a tenant holds a format (``[M, b]``).
    Instead of the counts (16 x 12 entries a tenant, each written, then read by the sums and
    by the roofline's per-entry pass), a native pass sums each class's entry and picks its
    format's roofline terms, so the roofline runs on the ``C`` classes alone."""
    r = _plan_factors(scenario, fields)
    summed, args = tables
    n_pools = scenario.cluster.peak_flops.shape[0]
    got = native.picked_sums(grid, ids, *args, picks, LAUNCH_GROUPS, _picked_in_xla, start,
                             size)
    weight_bytes, io_bytes, *speed = (got.picked[:, j][:, :, None, :]
                                      for j in range(2 + n_pools))  # [M, C, 1, b] each
    pool = jnp.moveaxis(jnp.clip(fields["pool"], 0, n_pools - 1), 0, -1)[:, None, None, :]
    seconds_per_flop = speed[0]
    for p in range(1, n_pools):
        seconds_per_flop = jnp.where(pool == p, speed[p], seconds_per_flop)
    # the terms that do not depend on the format at format 0's entry, the others picked
    free = {k: jax.lax.slice_in_dim(v, 0, 1, axis=2) for k, v in rows.items()
            if k not in ("terms", "class_rows")}
    picked = dict(free, weight_bytes=weight_bytes, io_bytes_per_token=io_bytes)
    # (an entry not held picks 0 bytes and 0 seconds per FLOP: its roofline is 0)
    roof, _ = row_roofline(r, picked, seconds_per_flop, r.gemm_fixed_seconds)
    return _row_sums(scenario, rows, r, class_total(roof), summed, got.sums), got.complete


def _row_sums(scenario: Scenario, rows: dict, r, roofline, summed: list, sums) -> dict:
    """:func:`_class_row_sums`' dict from the plan factors ``r`` (:func:`_plan_factors`), the
    plans' roofline seconds ``roofline [M, b]``, and ``sums`` (``native.EntrySums``) of the
    ``summed`` terms (:func:`_sum_tables`)."""
    terms = rows["terms"]  # {module: [M, K, C, F]}
    m, b = roofline.shape
    totals = {key: sums.sums[:, j] for j, key in enumerate(summed)}  # [M, b] each
    for name, k in _FORMAT_FREE_TERMS:  # its BF16 column times the class sizes
        constant = jnp.sum(rows["class_rows"][:, :, 0, 0] * terms[name][:, k, :, F.BF16], axis=-1)
        totals[name, k] = jnp.broadcast_to(constant[:, None], (m, b))
    for key, same in _SAME_TERMS.items():
        totals[key] = totals[same]
    scalars = jax.tree.map(lambda x: x[:, 0, 0] if x.shape[2] == 1 else x[:, 0], r)  # [M(, F), b]

    def launches(by_group):  # [M, LAUNCH_GROUPS, b or 1] -> [M, b]
        return grouped_launch_seconds(scalars, by_group, scalars.gemm_fixed_seconds)

    # The all-BF16 baseline's sums, every row of a class in BF16 (a class's entries are its
    # rows scaled to one slot, the roofline positively homogeneous in them: rowclasses.
    # class_model, own_classes): computed per plan on the merged rows, they cost ~0.25 µs per
    # plan.
    def bf16_column(x):  # [M, C, F, 1 or b] -> [M, C, 1, 1 or b]
        return jax.lax.slice_in_dim(x, F.BF16, F.BF16 + 1, axis=2)

    def bf16(x):  # the BF16 column weighted by the class sizes
        return rows["class_rows"] * bf16_column(x)

    bf16_rows = {k: bf16_column(v) for k, v in rows.items() if k not in ("terms", "class_rows")}
    bf16_roof, _ = row_roofline(r, bf16_rows, bf16_column(r.seconds_per_flop),
                                bf16_column(r.gemm_fixed_seconds))  # [M, C, 1, b]
    bf16_groups = jnp.zeros((m, LAUNCH_GROUPS)).at[
        jnp.arange(m)[:, None], bf16_column(rows["launch_group"])[:, :, 0, 0]].add(
            bf16(rows["launch_weight"])[:, :, 0, 0])[..., None]  # [M, LAUNCH_GROUPS, 1]
    return dict(roofline=(roofline, launches(sums.by_group)),
                largest_layer=sums.peak,
                bf16=native.fence((class_total(rows["class_rows"] * bf16_roof),
                                   launches(bf16_groups))),
                **{name: tuple(totals[name, k] for k in range(t.shape[1]))
                   for name, t in terms.items()})


def _largest_present(counts, values):
    """``float32[M, b]``: the largest of ``values [M, E]`` (-1 marks an entry no row can be)
    over the entries a plan holds (``counts [M, E, b] > 0``), at least 0, 0 for none: the
    XLA form of ``native.weighted_sums``' peak. Each entry's value is ranked within its
    tenant first (plan-independent: once per call), so that the plans' maximum runs over
    one-byte ranks (64 to a vector instead of 16 floats), and the value is read back by
    rank."""
    m, e = values.shape
    # rank 1 + the number of smaller values (equal values share a rank), 0 for none
    rank = 1 + jnp.sum(values[:, None, :] < values[:, :, None], axis=-1)
    rank = jnp.where(values > 0.0, rank, 0)
    by_rank = jnp.zeros((m, e + 1), jnp.float32).at[jnp.arange(m)[:, None], rank].max(
        jnp.maximum(values, 0.0))  # [M, E + 1]
    dtype = jnp.uint8 if e < 256 else jnp.int32
    held = jnp.where(counts > 0, rank.astype(dtype)[..., None], 0)  # [M, E, b]
    top = class_total(held[:, :, None, :], jnp.maximum)  # [M, b]
    return jnp.take_along_axis(by_rank, top.astype(jnp.int32), axis=1)


def rows_layer_stability(scenario: Scenario, precision, plan_valid):
    """``layer_stability [..., M, L]`` of plans' row formats ``precision [..., M, L]`` given
    their tenants' verdict ``plan_valid [..., M]`` (:func:`evaluate_one`'s: the rows of an
    invalid tenant score as its sanitized formats, an absent tenant's 1). Elementwise over
    the rows: a batch computes it after its chunks (:func:`evaluate_batch`), on the CPU with
    the native kernel (``physics.native``)."""
    table = stability.row_stability_table(scenario.models, scenario.workloads.mode,
                                          scenario.present)  # [F, M, L], once per call
    keep = plan_valid & scenario.present
    if jnp.ndim(precision) == 3:
        return native.rows_stability(table, format_ids(precision), keep, F.BF16,
                                     stability.rows_stability)
    return stability.rows_stability(table, precision, keep)


def evaluate_entries(scenario: Scenario, plan: Plan, entries, row_totals) -> Metrics:
    """:func:`evaluate_one` of one plan whose row formats are given as its (class, format)
    pairs, ``entries`` a tuple of int32 ``[M, K]`` chunks of them
    (:func:`~libratio_jax.physics.rowclasses.compact_entries`, split along ``K``), with the
    sums of its plan-independent row terms ``row_totals`` float32 ``[M, T]`` (its pairs'
    row counts times :func:`_pair_row_terms`, summed on the host), on a full-resolution
    scenario: the physics of the class path on just the pairs the plan uses, so every
    buffer is a few hundred bytes (``lj.evaluate``'s path for one host plan: a chunk
    ``[4, 32]`` on the reference scenario). ``layer_stability`` is None (``lj.evaluate``
    takes a row's from the scenario's per-pair table, :func:`_pair_layer_stability`: it
    depends on the row's pair alone); ``plan.precision`` is not read."""
    codes = [x >> ENTRY_SHIFT for x in entries]
    counts = [(x & ((1 << ENTRY_SHIFT) - 1)).astype(jnp.float32) for x in entries]
    coarse = scenario.coarse_models
    rows = jnp.sum(jnp.where(coarse.valid, coarse.count, 0.0), axis=-1)
    counted = functools.reduce(jnp.add, [jnp.sum(c, axis=-1) for c in counts])
    fields, valid = sanitize_fields(scenario, plan, counted == rows)
    models = [entry_model(coarse, code // F.NUM_FORMATS, c)
              for code, c in zip(codes, counts, strict=True)]
    formats = [code % F.NUM_FORMATS for code in codes]
    sums = _entry_sums(scenario, models, formats, fields, row_totals)
    # (the models' per-tenant scalars from the first chunk; their rows are not read)
    out = _evaluate_tenants(scenario, models[0], formats[0], 0, fields, valid, sums=sums)
    return out.replace(layer_stability=None)


def _entry_sums(scenario: Scenario, models: list, formats: list, fields: dict,
                row_totals) -> dict:
    """The plan-dependent row sums :func:`_tenant_metrics` takes (``sums``, ``[M]`` each) of
    rows given in chunks (``models`` and their ``formats``, ``[M, K]`` each): the modules'
    plan-independent sums, the columns of ``row_totals`` (``[M, T]``, ``_ROW_TERMS`` in
    order),
    the roofline's sums and the largest layer, summed (the largest: maximized) chunk by
    chunk. Each chunk's are fenced (``native.fence``, one ``[M, 3]`` array a chunk): in an
    earlier form, without a fence, XLA fused every chunk's per-entry work into the kernel
    that added them up, and its cost model split that kernel over two threads (a handoff
    that cost a reference plan of 4 chunks ~20 µs a call on 2 cores); this form without
    them ran slower from the fifth chunk too (docs/performance.md)."""
    _, pools = _tenant_pools(scenario.cluster, fields["pool"])
    r = jax.vmap(_tenant_factors)(scenario.workloads, pools, models[0],
                                  *(fields[f] for f in _FACTOR_FIELDS))

    def chunk_sums(r, model, precision):  # one tenant's chunk: [3]
        return jnp.stack(roofline_row_sums(r, model, precision)
                         + [largest_layer_bytes_of(model, precision)])

    chunks = [native.fence(jax.vmap(chunk_sums)(r, model, precision))
              for model, precision in zip(models, formats, strict=True)]  # [M, 3] each
    roofline = functools.reduce(jnp.add, [x[:, :2] for x in chunks])
    sums = dict(roofline=(roofline[:, 0], roofline[:, 1]),
                largest_layer=functools.reduce(jnp.maximum, [x[:, 2] for x in chunks]))
    start = 0
    for name, n in _row_term_counts(scenario).items():
        sums[name] = tuple(row_totals[:, start + k] for k in range(n))
        start += n
    return sums


def _row_term_counts(scenario: Scenario) -> dict:
    """How many plan-independent row terms each module of ``_ROW_TERMS`` has (its
    ``row_totals``), in order, from their shapes alone."""
    def terms(sc):
        models = jax.vmap(class_model)(sc.coarse_models)
        return {name: jax.vmap(fn)(models, sc.workloads) for name, fn in _ROW_TERMS.items()}

    shapes = jax.eval_shape(terms, scenario)  # (a dict comes back in its keys' order)
    return {name: len(shapes[name]) for name in _ROW_TERMS}


@jax.jit
def _pair_row_terms(scenario: Scenario):
    """``float32[M, C x F, T]``: each (class, format) pair's plan-independent row terms for
    one row (the class path's, :func:`_class_rows`, every module's in ``_ROW_TERMS`` order),
    so that a host plan's row totals are its pairs' row counts times these
    (``native.compact_pairs``; :func:`evaluate_entries`). Once per scenario."""
    terms = _class_rows(scenario)["terms"]
    stacked = jnp.concatenate([terms[name] for name in _ROW_TERMS], axis=1)  # [M, T, C, F]
    m, t, c, f = stacked.shape
    return jnp.swapaxes(stacked.reshape(m, t, c * f), 1, 2)


# On CPU a large batch runs in chunks small enough for their intermediates to stay in cache:
# at most about this many per-plan entries (tenant slots x rows, plus tenant slots x classes
# x formats when summed by class) per chunk. Measured on the 2-core machine (one process,
# plans/s against the chunk size): 4 x 399 rows 134 k at 512 plans, 104 k at 1,024, 63 k at
# 4,096; class counts (4 x 16 x 12) 149 k at 256, 172 k at 512, 164 k at 1,024, 78 k at
# 4,096 (before the thirteenth round: see CLASS_CHUNK_ENTRIES); merged rows (4 x 16) 0.93 M at
# 256, 1.1 M at 2,048 and more.
CPU_CHUNK_ENTRIES = 1 << 20
CPU_CHUNK = 4096  # at most this many plans per chunk


# Counted by class, a chunk holds half as many entries: since the counts are batch-last
# (``rowclasses.format_counts``) and the plan-independent sums contractions (thirteenth
# round), the per-entry terms left are the roofline's and the largest layer's, and smaller
# chunks keep them in the 2 MB L2. Measured in one process (reference scenario, 16,384
# plans, no ``layer_stability``): 256 plans 260-264 k plans/s, 512 276-288 k, 1,024
# 253-254 k, 2,048 210-219 k.
CLASS_CHUNK_ENTRIES = CPU_CHUNK_ENTRIES // 2


def cpu_chunk(entries_per_plan: int, budget: int = CPU_CHUNK_ENTRIES) -> int:
    """Plans per chunk on CPU for plans of ``entries_per_plan`` entries: the power of two
    nearest below ``budget / entries_per_plan`` (default ``CPU_CHUNK_ENTRIES``), between 256
    and ``CPU_CHUNK`` (never more than ``CPU_CHUNK``). Reference scenario: 512 row by row at
    full resolution, 4,096 with merged rows row by row (without the native kernels, or off
    the CPU); :func:`class_chunk` by class."""
    n = max(budget // max(entries_per_plan, 1), 1)
    return min(max(1 << (n.bit_length() - 1), 256), CPU_CHUNK)


def class_chunk(scenario: Scenario) -> int:
    """Plans per chunk on CPU when a scenario's plans are counted by class (:func:`_classes`;
    ``tenant slots x classes x formats`` entries per plan within ``CLASS_CHUNK_ENTRIES``):
    512 on the reference scenario, full resolution or merged rows."""
    classes = jax.eval_shape(_classes, scenario)[1].shape[-2]  # (their shape only)
    return cpu_chunk(scenario.num_tenants * classes * F.NUM_FORMATS, CLASS_CHUNK_ENTRIES)


def evaluate_batch(scenario: Scenario, plan: Plan, *, layer_stability: bool = True) -> Metrics:
    """Pure, jittable evaluation of plans with one leading batch axis ``[B, ...]``: on a
    full-resolution scenario (``scenario.row_classes`` set) by format counts per row class
    (:func:`evaluate_counted`), with merged rows on the CPU the same way with each row a
    class of its own (:func:`_by_class`), its sums picked from the rows' formats with no
    counts (:func:`_picked_row_sums`), else :func:`evaluate_one` per plan; chunked on CPU
    (:func:`map_chunks`), the per-row ``layer_stability [B, M, L]`` after the chunks
    (:func:`rows_layer_stability`). On an NVIDIA GPU a full-resolution batch is counted and
    summed by one kernel, CUDA or Pallas (:func:`_gpu_class_row_sums`).
    ``layer_stability=False`` leaves that field None (the class path then reads each row
    once, to count it)."""
    m, l = scenario.num_tenants, scenario.num_layers
    if not _by_class(scenario):
        def chunk(p):
            return jax.vmap(lambda q: evaluate_one(scenario, q).replace(layer_stability=None))(p)
        args, size = plan, cpu_chunk(m * l)
    else:
        # the class tables once, outside the chunks' loop
        classes = _classes(scenario)
        rows, grid = _class_rows(scenario, classes), classes[1]
        size = class_chunk(scenario)
        # One-byte plans of a chunked batch are counted where they lie in the batch by the
        # native kernel (XLA copied each chunk's rows for it, ~0.15 µs per plan); others
        # (int32 plans: the copy converts them) are sliced into chunks first. Merged rows,
        # each class one row, are summed as picked from their formats, with no counts
        # (65,536 plans, no layer_stability, alternating processes: 1.12-1.27 -> 1.62-2.26 M
        # plans/s; docs/performance.md, twenty-sixth round).
        picked = scenario.row_classes is None
        plans_last = _plans_last()
        tables = _sum_tables(rows)  # (plan-independent: once, outside the chunks' loop)
        picks = _picks(scenario, rows) if picked else None
        in_place = (plan.precision.dtype == jnp.uint8 and _chunked(plan.precision.shape[0], size)
                    and (native.status().picks if picked else native.status().counts))

        def chunk(args):
            fields, fields_valid, rows_or_index = args
            if in_place:  # the plans' indices in the batch
                start, precision, opts = rows_or_index[0], plan.precision, dict(size=size)
            else:
                start, precision, opts = None, rows_or_index, {}
            if picked:
                sums, complete = _picked_row_sums(scenario, rows, tables, picks, grid, fields,
                                                  format_ids(precision), start, **opts)
                counts = None  # (read by no metric when the sums are given)
            elif start is None and gpu_kernels.available():  # (a GPU runs no chunks)
                sums, complete = _gpu_class_row_sums(scenario, rows, tables, grid, fields,
                                                     format_ids(precision))
                counts = None
            else:
                # [M, C, F, b] as the kernel writes them (uint8 where they fit), [M, b]
                counts, complete = format_counts(grid, precision, start=start,
                                                 with_complete=True, compact=True, **opts)
                sums = _class_row_sums(scenario, rows, tables, fields, counts)  # [M, b] each
            if plans_last:
                return _evaluate_counted_batch(scenario, classes[0], fields, fields_valid,
                                               counts, complete, sums)
            return jax.vmap(functools.partial(_evaluate_counted_fields, scenario,
                                              models=classes[0]),
                            in_axes=(0, 0, 3, 1, 1))(fields, fields_valid, counts, complete,
                                                     sums)
        # The integer fields sanitized once for the whole batch, before the chunks (inside
        # them, XLA copied the checks into every per-entry kernel: 264-277 -> 305-315 k
        # plans/s without layer_stability, alternating processes, 16,384 plans). The verdict
        # fenced: else XLA recomputed the ~60 checks in each of the 8 fields' kernels.
        args = (*jax.vmap(functools.partial(sanitize_fields, scenario,
                                            fence=native.fence))(plan),
                jnp.arange(plan.precision.shape[0], dtype=jnp.int32) if in_place
                else plan.precision)
    out = map_chunks(chunk, args, size)
    if not layer_stability:
        return out
    # The per-row scores after the chunks, one elementwise pass over the batch. Inside them
    # (before the twelfth round) each chunk's [b, M, L] scores were copied into lax.map's
    # stacked output, zero-filled first (at full resolution, a 4,096-plan trace: ~2.5 of the
    # ~3.2 µs of thread time per plan the scores cost), and full-resolution chunks were 4x
    # smaller to stay in cache. Alternating fresh processes, batches 4,096 and 65,536: full
    # resolution 108-119 -> 143-163 k plans/s; merged rows (14 scores per tenant) the same
    # to ~10% faster, 0.88-1.06 -> 0.88-1.13 M.
    return out.replace(layer_stability=rows_layer_stability(scenario, plan.precision,
                                                            out.plan_valid))


def map_plans(fn, plan: Plan):
    """``vmap`` of ``fn(one plan)`` over plans ``[B, ...]``, chunked on CPU
    (:func:`map_chunks`, by the plans' rows). The batching every per-plan physics function
    uses."""
    return map_chunks(jax.vmap(fn), plan, cpu_chunk(math.prod(np.shape(plan.precision)[1:])))


def _chunked(b: int, chunk_size: int) -> bool:
    """Whether :func:`map_chunks` splits a batch of ``b`` plans into chunks."""
    return jax.default_backend() == "cpu" and b > min(chunk_size, CPU_CHUNK)


def map_chunks(fn, plan, chunk_size: int = CPU_CHUNK):
    """``fn(plans [b, ...])`` over plans ``[B, ...]`` (a ``Plan``, or any pytree of arrays
    with that leading axis): on CPU, batches larger than ``chunk_size`` run as a ``lax.map``
    over chunks of that many plans (padded with copies of the first plan, then cut);
    elsewhere in one call."""
    b = jax.tree.leaves(plan)[0].shape[0]
    size = min(chunk_size, CPU_CHUNK)
    if not _chunked(b, chunk_size):
        return fn(plan)
    n = -(-b // size)
    pad = n * size - b

    def chunk(x):
        if pad:
            x = jnp.concatenate([x, jnp.broadcast_to(x[:1], (pad,) + x.shape[1:])])
        return x.reshape((n, size) + x.shape[1:])

    out = jax.lax.map(fn, jax.tree.map(chunk, plan))
    return jax.tree.map(lambda x: x.reshape((n * size,) + x.shape[2:])[:b], out)


def _run(batch_shape: tuple[int, ...], scenario, plan, layer_stability: bool = True) -> Metrics:
    """Evaluation of plans with leading axes ``batch_shape`` (flattened to one)."""
    if not batch_shape:  # one plan: evaluate_one without its fence (~10 kernels, no batch)
        out = evaluate_sanitized(scenario, *sanitize_plan(scenario, plan))
        return out if layer_stability else out.replace(layer_stability=None)
    k = len(batch_shape)
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[k:]), plan)
    out = evaluate_batch(scenario, flat, layer_stability=layer_stability)
    return jax.tree.map(lambda x: x.reshape(batch_shape + x.shape[1:]), out)


try:  # whether JAX is tracing (jit, scan, cond, make_jaxpr), arguments concrete or not
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # (a JAX without it: batch programs then keep XLA's compiler options)
    _trace_state_clean = None


def _tracing() -> bool:
    """Whether this call runs inside a JAX trace (False where JAX cannot tell)."""
    return _trace_state_clean is not None and not _trace_state_clean()


@functools.cache
def _program(batch_shape: tuple[int, ...], m: int, l: int, n_pools: int,
             scenario_layout: tuple | None, packed_plan: bool, layer_stability: bool = True,
             entry_capacity: int = 0, check_rules: bool = False,
             device: jax.Device | None = None):
    """The jitted evaluation of plans ``[*batch_shape, m, l]`` that :func:`evaluate` calls: the
    scenario as its packed arrays (``scenario_layout``: :func:`_scenario_args`) or as it is
    (``None``), the plan packed into one int32 vector (:func:`_pack_plan`) or as it is. Packed,
    a call sends about 15 buffers instead of 75, which is much of what a small call pays for
    its arguments. With inline CPU dispatch
    (:func:`~libratio_jax.physics.cpu_dispatch.inline_cpu_dispatch`), on ``device`` (below),
    and by its pairs with either dispatch, one host plan also comes back packed (a few
    arrays of at most ``SEQUENTIAL_BUFFER_BYTES`` instead of 29, about 1 µs each, joined
    into one byte buffer where they fit in that size: ``packing.join_bytes``) and is
    unpacked into NumPy views on the host: the outputs' shapes follow from ``(batch_shape,
    m, l, n_pools)``, so every trace of the program has the same packed layout.
    ``entry_capacity``: one plan as its
    ``[m, entry_capacity]`` (class, format) entries (:func:`evaluate_entries`: a tuple of
    their chunks, :func:`_entry_chunks`), its integer fields ``int32[8 * m]`` and its row
    totals ``float32[m, T]``, without ``layer_stability`` (``layer_stability`` False).
    ``check_rules``: one plan, returned with whether it breaks a rule of ``validate_plan``
    (``plan.breaks_rules``, ``bool[]``), for a caller that validated only its shapes.
    ``device``: one plan's program compiled for, and run on, that device's client
    (:func:`~libratio_jax.physics.cpu_dispatch.synchronous_cpu_device`; its arguments there
    or on the host), its outputs packed and read as NumPy arrays."""
    n = math.prod(batch_shape)
    # One host plan with inline CPU dispatch: outputs packed (with asynchronous dispatch each
    # np.asarray waits and copies: 176-188 -> 196-210 µs, measured alternately; inline
    # 108-110 -> 96-107 µs). Its pairs' program packs them with either dispatch, and so
    # does a program on the synchronous device: its caller reads them on the host.
    pack_outputs = (packed_plan and not batch_shape and jax.default_backend() == "cpu"
                    and (_inline_dispatch() or entry_capacity > 0 or device is not None))
    # the packed outputs' (layout, parts) (set when traced), then their two readers as one
    # pair (made before it is kept: threads making them at once each keep a whole pair)
    outputs: list = []

    def run(scenario, plan):
        if scenario_layout is not None:
            scenario = unpack(scenario_layout, scenario)
        if entry_capacity:  # (entries' chunks [m, width], int fields [8 * m], row totals)
            entries, ints, row_totals = plan
            ints = ints.reshape(len(INT_FIELDS), m)
            plan = Plan(precision=entries, **{f: ints[j] for j, f in enumerate(INT_FIELDS)})
        elif packed_plan:
            ints = plan[n * m * l:].reshape((len(INT_FIELDS),) + batch_shape + (m,))
            plan = Plan(precision=plan[:n * m * l].reshape(batch_shape + (m, l)),
                        **{f: ints[j] for j, f in enumerate(INT_FIELDS)})
        if entry_capacity:  # (layer_stability: the caller's, from the pairs)
            out = evaluate_entries(scenario, plan, plan.precision, row_totals)
        else:
            out = _run(batch_shape, scenario, plan, layer_stability)
        if check_rules:
            out = out, breaks_rules(scenario, plan)
        if not pack_outputs:
            return out
        layout, arrays = pack(out, max_bytes=SEQUENTIAL_BUFFER_BYTES, xp=jnp)
        parts, arrays = join_bytes(arrays, SEQUENTIAL_BUFFER_BYTES)  # (one buffer if small)
        if outputs and outputs[0] != (layout, parts):  # (m, l, n_pools) fix the shapes
            raise RuntimeError("evaluate: a retrace changed the packed outputs' layout")
        if not outputs:  # read back field by field in ``call``: Metrics, then ``broken``
            if len(layout[1]) != _METRICS_FIELDS - (not layer_stability) + check_rules:
                raise RuntimeError("evaluate: unexpected packed outputs")
            outputs.append((layout, parts))
        return arrays

    if device is None:
        # a batch's program on the CPU with this CPU's vector width (physics/cpu_options.py;
        # not a batch of one plan, where it was slower); only where evaluate can tell a trace
        options = (cpu_options.batch_compiler_options()
                   if n > 1 and jax.default_backend() == "cpu" and _trace_state_clean is not None
                   else None)
        program = jax.jit(run, compiler_options=options or None)
    else:  # (one sharding for every argument and output)
        on_device = jax.sharding.SingleDeviceSharding(device)
        program = jax.jit(run, in_shardings=on_device, out_shardings=on_device)
    if not pack_outputs:
        return program

    def call(scenario, plan):
        arrays = program(scenario, plan)
        if len(outputs) == 1:  # traced: its readers
            layout, parts = outputs[0]
            outputs.append((leaf_reader(layout), None if parts is None else split_bytes(parts)))
        read, split = outputs[1]
        leaves = read([np.asarray(a) for a in arrays] if split is None
                      else split(np.asarray(arrays[0])))
        # Metrics made directly (its fields in order): unflattening the tree costs ~3x more
        if not layer_stability:
            leaves.insert(_LAYER_STABILITY, None)
        out = _metrics_of(leaves)
        return (out, leaves[-1]) if check_rules else out

    call.lower = program.lower
    return call


# XLA's CPU runtime runs a program's kernels one after the other in the calling thread only
# while every buffer they use is at most this many bytes (ThunkExecutor's
# execute_sequential_buffer_threshold, openxla); concurrently on its thread pool otherwise,
# which costs a small program more than it saves on two cores (docs/performance.md). A packed
# scenario keeps to it.
SEQUENTIAL_BUFFER_BYTES = 512


class _Packed(NamedTuple):
    """What :func:`_scenario_args` keeps per scenario object from its second call on."""

    args: tuple  # (layout, device arrays): the scenario packed (``_packed_scenario``)
    pairs: RowPairs | None  # ``rowclasses.row_pairs`` of a full-resolution scenario
    entry_args: tuple | None  # (layout, arrays) of it without its per-row leaves
    kept: dict  # what one host plan needs, made when first needed: its programs
    # (``_host_program``), the pairs' ``layer_stability`` (``_pair_layer_stability``) and
    # row terms (``_pair_row_terms``), and ``args`` / ``entry_args`` put on the synchronous
    # device (``_args_on``)


_SCENARIO_ARGS: dict = {}  # id(scenario) -> (weak reference, None on first sight | _Packed)


def _scenario_args(scenario: Scenario) -> tuple[tuple | None, Any]:
    """``(layout, device arrays)`` of the scenario packed into arrays of at most
    ``SEQUENTIAL_BUFFER_BYTES`` (``physics.packing``) on the scenario's device, from its
    second call on and kept while the scenario object lives (a scenario made anew for every
    call is not packed each time); ``(None, scenario)``, passed as it is, on the first call
    and when a leaf is not a JAX array (NumPy arrays may change in place), is traced or lives
    on several devices."""
    key = id(scenario)
    kept = _SCENARIO_ARGS.get(key)
    if kept is not None and kept[0]() is scenario:
        if kept[1] is not None:
            return kept[1].args
        args = _packed_scenario(scenario)
        if args is not None:
            full = scenario.row_classes is not None
            _SCENARIO_ARGS[key] = (kept[0], _Packed(
                args, row_pairs(scenario.row_classes, scenario.num_layers,
                                scenario_entry_capacities(scenario)) if full else None,
                _packed_scenario(_without_rows(scenario)) if full else None, {}))
            return args
        return None, scenario
    try:  # first sight: remembered, packed on the next call
        # (the dict bound now: at interpreter exit the module's globals are None before
        # the last scenarios die)
        ref = weakref.ref(scenario, lambda _, key=key, kept=_SCENARIO_ARGS: kept.pop(key, None))
    except TypeError:
        return None, scenario
    _SCENARIO_ARGS[key] = (ref, None)
    return None, scenario


def _without_rows(scenario: Scenario) -> Scenario:
    """The scenario without the leaves of its rows (the models' ``ROW_FIELDS``, ``[M, L]``
    each, and ``row_classes``), which the program of one plan's (class, format) entries
    (:func:`evaluate_entries`) does not read: a call pays for every argument buffer, read or
    not (the reference scenario in 8 buffers instead of 22, ~5 µs of ~120 a call;
    docs/performance.md). They are None, so a read of one fails when traced rather than
    reading a placeholder."""
    return scenario.replace(models=scenario.models.replace(**dict.fromkeys(ROW_FIELDS)),
                            row_classes=None)


def _packed_scenario(scenario: Scenario) -> tuple[tuple, tuple] | None:
    """The scenario packed on its device, or ``None`` when it cannot be (see above)."""
    leaves = jax.tree.leaves(scenario)
    devices = set()
    for x in leaves:
        # Only JAX arrays are known not to change (a read-only NumPy view may have a
        # writable base).
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return None
        if x.committed:
            devices |= x.devices()
    if len(devices) > 1:
        return None
    layout, arrays = pack(scenario, max_bytes=SEQUENTIAL_BUFFER_BYTES)
    return layout, tuple(jax.device_put(arrays, devices.pop() if devices else None))


def _pack_plan(plan: Plan) -> np.ndarray | None:
    """The plan's host arrays as one int32 vector (the precision ``[..., M, L]``, then the
    integer fields ``[8, ..., M]``, each flattened), or ``None`` when a field is not a NumPy
    array (device arrays stay where they are)."""
    leaves = [plan.precision] + [getattr(plan, f) for f in INT_FIELDS]
    if not all(type(x) is np.ndarray for x in leaves):
        return None
    return _plan_vector(leaves[0], leaves[1:])


def _plan_vector(formats: np.ndarray, ints) -> np.ndarray:
    """The packed plan's one int32 vector (what :func:`_program` unpacks): ``formats``
    flattened, then :func:`_int_vector` of the integer fields."""
    return np.concatenate([formats.ravel(), _int_vector(ints)], dtype=np.int32,
                          casting="unsafe")


def _int_vector(ints) -> np.ndarray:
    """The integer fields (``INT_FIELDS`` order: a list of arrays ``[..., M]`` or one
    ``[8, ..., M]`` array) as one int32 vector, flattened field by field."""
    if isinstance(ints, np.ndarray):
        return ints.astype(np.int32).ravel()
    return np.concatenate(ints, dtype=np.int32, casting="unsafe").ravel()


_PAIR_LAYER_STABILITY = "pair_layer_stability"  # its key in ``_Packed.kept``
_PAIR_ROW_TERMS = "pair_row_terms"  # ``_pair_row_terms``' key in ``_Packed.kept``


@jax.jit
def _pair_layer_stability(scenario: Scenario):
    """``float32[(M * C + M) * F]``: the ``layer_stability`` of a row in each of the
    scenario's (class, format) pairs (``rowclasses.RowPairs``' numbers: every class of every
    tenant in every format, then the rows of no class, which score 1), as
    :func:`evaluate_one` gives it to a valid plan (1 for absent tenants). A row's score
    depends on its kind, its format and the tenant's mode alone, so one host plan's
    ``layer_stability`` is this table taken at its rows' pair numbers."""
    classes = jax.vmap(class_model)(scenario.coarse_models)  # [M, C, F] pseudo-rows
    per_pair = jax.vmap(stability.layer_stability, in_axes=(0, 0, None))(
        classes, scenario.workloads.mode, F.FORMAT_AXIS)
    per_pair = jnp.where(scenario.present[:, None, None], per_pair, 1.0)
    m = per_pair.shape[0]
    return jnp.concatenate([per_pair.ravel(), jnp.ones(m * F.NUM_FORMATS, jnp.float32)])


def evaluate(scenario: Scenario, plan: Plan, *, validate: bool = True,
             layer_stability: bool = True) -> Metrics:
    """Evaluate a plan or a batch of plans (any leading axes) on a scenario.

    Validates concrete inputs first (ValueError naming the field); inside a trace the
    validation of the values is skipped and the pure function is used directly. With
    ``validate=False`` an out-of-domain plan is not refused but evaluated as its sanitizer
    says (its tenants idle, ``plan_valid`` False), host integers beyond int32 included (they
    are not wrapped; one plan's integer field may be of a shape that broadcasts to ``[M]``).
    Shapes are checked either way, traced too (``plan.validate_shapes``: ValueError naming
    the field). A
    batch at full resolution (``scenario.row_classes`` set), and on the CPU one of merged
    rows, is summed by format counts per row class (``physics.rowclasses``; merged rows
    each a class of their own); ``layer_stability=False`` skips the one per-row
    output (``Metrics.layer_stability`` is then None), which is most of what such a batch
    costs beyond reading its rows. On the CPU one plan (NumPy or concrete JAX arrays;
    unvalidated too, when its shapes, dtypes and format ids are right) takes the host path
    from a scenario's second call on (its leaves JAX arrays): its rules checked in its
    program when it is validated, at full resolution its pairs evaluated when they fit, its
    program run in the calling thread (with inline CPU dispatch,
    :func:`~libratio_jax.physics.cpu_dispatch.inline_cpu_dispatch`,
    or else on a private synchronous CPU client,
    :func:`~libratio_jax.physics.cpu_dispatch.synchronous_cpu_device`), its metrics NumPy
    arrays, ready when the call returns (docs/performance.md). Without that client
    (``LIBRATIO_SYNC_CPU=0``) and with JAX's default asynchronous dispatch, only a
    full-resolution plan whose pairs fit (every tenant valid) takes it, and other plans'
    metrics are JAX arrays: read them with ``np.asarray`` or ``jax.block_until_ready``,
    which take both.
    """
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan, got {type(plan).__name__}")
    # One host plan on the CPU: its shapes and dtypes checked here, its rules in its program
    # (below). Run in the calling thread: inline, or on the synchronous device (JAX's
    # asynchronous handoff cost ~35-40 µs a call: docs/performance.md, thirty-third round).
    # Without either, at full resolution only, where its pairs' program (sequential, ~106 µs
    # a call) replaces the rows' (concurrent, ~190 µs; a coarse plan's program gained
    # nothing: twenty-ninth round). One plan in concrete JAX arrays (``Plan.from_choices``)
    # is read as NumPy: by the rows' program, concurrent at full resolution, it took ~3x
    # longer.
    on_cpu = (jax.default_backend() == "cpu"
              and not isinstance(scenario.present, jax.core.Tracer))
    # (the synchronous device is made by the host path, for one plan only)
    host = on_cpu and getattr(plan.precision, "ndim", None) == 2 and (
        _inline_dispatch() or scenario.row_classes is not None or cpu_dispatch.wanted())
    if host and isinstance(plan.precision, jax.Array):
        plan = _on_host(plan)
    one_host_plan = host and type(plan.precision) is np.ndarray
    if not one_host_plan:
        if validate:
            validate_plan(scenario, plan)
        else:  # shapes only (named), whatever the values: else JAX's broadcasting fails
            validate_shapes(scenario, plan, exact=False)
    else:  # its shapes and dtypes here, its format ids and rules on its path (below)
        try:
            validate_plan(scenario, plan, rules=False, ids=False)
        except ValueError:
            if validate:
                raise
            validate_shapes(scenario, plan, exact=False)  # (its shapes may broadcast)
            one_host_plan = False  # unvalidated: the host path only if they would pass
    shape = np.shape(plan.precision)
    if len(shape) < 2:
        raise ValueError(f"plan.precision must be [..., M, L], got shape {shape}")
    if (isinstance(plan.precision, jax.core.Tracer)
            or isinstance(scenario.present, jax.core.Tracer) or _tracing()):
        # Inside the caller's jit (scan, cond...), its arguments traced or closed over: the
        # pure function (the caller's program compiles it; a jit nested in a trace may not
        # carry compiler options, which a batch's program has on some CPUs).
        return _run(tuple(shape[:-2]), scenario, plan, bool(layer_stability))
    layout, scenario_args = _scenario_args(scenario)
    n_pools = scenario.cluster.gpu_count.shape[-1]
    if one_host_plan:
        out = (None if layout is None else
               _evaluate_host_plan(scenario, plan, n_pools, bool(layer_stability), validate))
        if out is not None:
            return out
        if validate:
            validate_plan(scenario, plan)  # the format ids and rules, on the host
    packed_plan = _pack_plan(plan) if validate else None  # validated integers (as int32 in jit)
    program = _program(tuple(shape[:-2]), *shape[-2:], n_pools, layout, packed_plan is not None,
                       bool(layer_stability))
    return program(scenario_args, jax_ready_plan(plan) if packed_plan is None else packed_plan)


def jax_ready_plan(plan: Plan) -> Plan:
    """The plan's host values as JAX takes them without changing their meaning, for a plan
    that was not validated: NumPy scalars and lists become arrays (ValueError naming the
    field for what is not numbers); integers of types wider than int32 (which JAX, without
    x64, would wrap: ``2**32 + 4`` read as 4) become int32, each value beyond ``INT_LIMIT``
    clipped to ``INT_LIMIT + 1`` with its sign, so a value out of its domain stays out of it
    (the sanitizer flags the tenant); float64 values that are not whole numbers, or beyond
    ``INT_LIMIT`` (infinities too), become NaN (float32 would round ``2 + 1e-9`` to 2, and
    ``2**24 + 1`` to ``2**24``, in the domain); non-native byte order (e.g. read from a
    big-endian file) is made native, which is all JAX takes. JAX's own number types held in
    NumPy arrays (``ml_dtypes``: bfloat16, float8, int4) are taken as they are."""
    bound = INT_LIMIT + 1
    fixes, wide = {}, []
    for name in ("precision",) + INT_FIELDS:
        x = getattr(plan, name)
        if isinstance(x, jax.Array):
            continue
        if not isinstance(x, np.ndarray):
            x = fixes[name] = np.asarray(x)
        if x.dtype.kind in "iu" and x.dtype not in _NO_WRAP:
            wide.append((name, x))
        elif x.dtype.kind == "f" and x.dtype.itemsize > 4:
            whole = (np.trunc(x) == x) & (np.abs(x) <= INT_LIMIT)  # (False for inf and NaN)
            fixes[name] = np.where(whole, x, np.nan).astype(np.float32)  # (exact: <= 2**24)
        elif x.dtype.kind == "c" or not (x.dtype.kind == "b"
                                         or jax.dtypes.issubdtype(x.dtype, np.number)):
            raise ValueError(f"plan.{name} must hold numbers, got dtype {x.dtype}")
        elif not x.dtype.isnative:
            fixes[name] = x.astype(x.dtype.newbyteorder("="))
    if wide:  # one bounds check for them all (int32 is what JAX would make of them anyway)
        # (an unsigned value beyond int64 reads as negative here: out of every domain too)
        v = np.concatenate([x.ravel() for _, x in wide], dtype=np.int64, casting="unsafe")
        clip = v.size and (v.max() > bound or v.min() < -bound)
        for name, x in wide:
            if clip:
                x = np.minimum(x, bound) if x.dtype.kind == "u" else np.clip(x, -bound, bound)
            fixes[name] = x.astype(np.int32)
    return plan.replace(**fixes) if fixes else plan


def entry_capacities(num_tenants: int, class_pairs: int = 0) -> tuple[int, ...]:
    """Entries per tenant of one host plan evaluated by its (class, format) pairs, one
    program per capacity, the smallest that holds the plan's pairs used: the most that keep
    its ``[M, capacity]`` entries, and every per-entry value of its program, within
    ``SEQUENTIAL_BUFFER_BYTES`` at 4 bytes each (:func:`entry_width`: 32 for 4 tenants, a
    format per layer kind with the first and last blocks in another format, 25 pairs for one
    reference tenant, fits), and three quarters of that (24): measured in one process on the
    reference scenario, a plan of 12-14 pairs per tenant took ~113-116 µs a call with 24
    entries per tenant against ~121-127 µs with 32 (and ~118-122 µs with 16). Then, for a
    scenario of ``class_pairs`` (class, format) pairs per tenant, the multiples of that
    width up to the one that holds them all, at most ``ENTRY_CHUNKS`` widths: such entries
    travel and are evaluated in chunks of that width (:func:`evaluate_entries`), so a plan
    with a format drawn per row (85-130 pairs a reference tenant) keeps a program of small
    buffers too. Empty (the rows' program) when the plan's integer fields alone, ``int32[8
    * M]``, exceed that size (17 tenants or more)."""
    if len(INT_FIELDS) * 4 * num_tenants > SEQUENTIAL_BUFFER_BYTES:
        return ()
    width = entry_width(num_tenants)
    chunks = min(-(-class_pairs // width), ENTRY_CHUNKS)
    return (tuple(sorted({width * 3 // 4, width} - {0}))
            + tuple(width * k for k in range(2, chunks + 1)))


def scenario_entry_capacities(scenario: Scenario) -> tuple[int, ...]:
    """:func:`entry_capacities` of a full-resolution scenario (its ``row_classes`` set): its
    tenant slots and (class, format) pairs per tenant."""
    return entry_capacities(scenario.num_tenants,
                            scenario.row_classes.shape[-2] * F.NUM_FORMATS)


def entry_width(num_tenants: int) -> int:
    """Entries per tenant of one chunk of a host plan's (class, format) entries: the most
    whose ``int32[M, width]`` is within ``SEQUENTIAL_BUFFER_BYTES`` (32 for 4 tenants)."""
    return SEQUENTIAL_BUFFER_BYTES // 4 // max(num_tenants, 1)


# The most chunks of one host plan's entries (:func:`entry_capacities`): 6 hold every pair of
# a reference tenant (16 classes x 12 formats).
ENTRY_CHUNKS = 8


def _entry_chunks(entries: np.ndarray) -> tuple:
    """One host plan's entries ``int32[M, capacity]`` as the program of its capacity takes
    them: chunks ``[M, entry_width(M)]`` (:func:`entry_capacities`), contiguous, or the
    array alone."""
    m, cap = entries.shape
    width = entry_width(m)
    if cap <= width:
        return (entries,)
    return tuple(np.ascontiguousarray(entries.reshape(m, cap // width, width).swapaxes(0, 1)))


def _on_host(plan: Plan) -> Plan:
    """``plan`` with its concrete JAX arrays as NumPy arrays (views on CPU), so that one plan
    takes :func:`evaluate`'s host path; unchanged if a field is traced."""
    values = [getattr(plan, f) for f in _PLAN_FIELDS]
    if any(isinstance(x, jax.core.Tracer) for x in values):
        return plan
    return _frozen(Plan, _PLAN_FIELDS,
                   [np.asarray(x) if isinstance(x, jax.Array) else x for x in values])


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def _evaluate_host_plan(scenario: Scenario, plan: Plan, n_pools: int, layer_stability: bool,
                        check_rules: bool = True) -> Metrics | None:
    """One host plan whose shapes and dtypes are validated, on a packed scenario, on the CPU:
    in a program that also checks the plan's rules (``plan.breaks_rules``; only a plan that
    breaks one pays for ``validate_plan``'s message, which it raises), at full
    resolution by its (class, format) entries (:func:`evaluate_entries`) on the scenario
    without its rows (:func:`_without_rows`). Those make a program of buffers of at most
    ``SEQUENTIAL_BUFFER_BYTES``, which XLA runs sequentially, like a coarse plan's, rather
    than the rows' program, which it runs concurrently (docs/performance.md; measured on 2
    cores, a plan with a format per layer kind, inline: ~110-130 against ~290-320 µs a call on
    the earlier machine; asynchronous: ~85-110 against ~190 µs on the twenty-ninth round's).
    The rows' program instead when the scenario is coarse, a
    tenant uses more pairs than the largest of :func:`entry_capacities` (8 chunks of
    :func:`entry_width`: every pair of a reference tenant fits, formats drawn per row
    included), or the sanitizer refuses a tenant (the rows say what its rows score). Run in
    the calling thread: with inline dispatch on JAX's own device, else on the synchronous
    device (``cpu_dispatch.synchronous_cpu_device``). Without either (asynchronous
    dispatch), by its pairs only: ``None`` where the rows' program would run (with packed
    outputs it gained nothing there). Its format ids are checked
    here: by ``native.compact_pairs``, which reads them to count the pairs, else by one
    reduction. ``None`` (the caller validates on the host, or evaluates an unvalidated plan
    by the general path) when a format id is out of range, or an integer field is not a
    NumPy array, or is of a type wider than int32 (which packing as int32 could wrap) and
    holds a value beyond ``INT_LIMIT``.
    ``check_rules=False`` (``evaluate(..., validate=False)``): a plan that breaks a rule is
    not refused but evaluated as its sanitizer says, as any unvalidated plan."""
    ints = [getattr(plan, f) for f in INT_FIELDS]
    if not all(type(x) is np.ndarray for x in ints):
        return None
    if not all(x.dtype in _NO_WRAP for x in ints):  # int64 & co. may wrap as int32
        ints = np.array(ints, np.int64)
        if ints.size and (ints.min() < -INT_LIMIT or ints.max() > INT_LIMIT):
            return None
    packed = _SCENARIO_ARGS[id(scenario)][1]
    device = None if _inline_dispatch() else cpu_dispatch.synchronous_cpu_device()
    m, l = plan.precision.shape
    pairs = packed.pairs
    by_pairs = pairs is not None and pairs.capacities
    terms = _kept(packed, _PAIR_ROW_TERMS, _pair_row_terms, scenario) if by_pairs else None
    compact = (native.compact_pairs(pairs.base, plan.precision, pairs.code.shape[1],
                                    pairs.capacities, terms) if by_pairs else NotImplemented)
    if compact is NotImplemented:  # its format ids not read yet
        if not format_ids_in_range(plan.precision):
            return None  # the caller validates (which raises) or sanitizes them
        compact = compact_entries(pairs, plan.precision, terms) if by_pairs else None
    if compact is not None:
        entries, pair, row_totals = compact
        layout, arrays = _args_on(packed, "entry_args", device)
        program = _host_program(packed.kept, m, l, n_pools, layout, False,
                                entries.shape[1], device)
        out, broken = program(arrays, (_entry_chunks(entries), _int_vector(ints), row_totals))
        if broken and check_rules:
            validate_plan(scenario, plan)  # raises, naming the field
        if out.plan_valid.all():
            if layer_stability:  # it depends on the rows' formats alone: the pairs' table
                table = _kept(packed, _PAIR_LAYER_STABILITY, _pair_layer_stability, scenario)
                # ``out`` (NumPy views, packed outputs) was made by this call: set in place
                # (``replace`` costs ~6 µs)
                object.__setattr__(out, "layer_stability", table.take(pair))
            return out
    if device is None and not _inline_dispatch():  # asynchronous: the general path
        return None
    layout, arrays = _args_on(packed, "args", device)
    program = _host_program(packed.kept, m, l, n_pools, layout, layer_stability, 0, device)
    out, broken = program(arrays, _plan_vector(plan.precision, ints))
    if broken and check_rules:
        validate_plan(scenario, plan)
    return out


def _keep(kept: dict, key, make, *args):
    """``kept[key]``, made as ``make(*args)`` at its first need (``_Packed.kept``: what one
    host plan needs of its scenario, made once per scenario object)."""
    value = kept.get(key)
    if value is None:
        value = kept[key] = make(*args)
    return value


def _kept(packed: _Packed, key: str, table_fn, scenario: Scenario) -> np.ndarray:
    """``table_fn(scenario)`` as a host array, made at its first need and kept with the
    scenario (``_Packed.kept[key]``)."""
    return _keep(packed.kept, key, lambda: np.asarray(table_fn(scenario)))


def _host_program(kept: dict, m: int, l: int, n_pools: int, layout, layer_stability: bool,
                  capacity: int, device: jax.Device | None):
    """:func:`_program` of one host plan with its rules, kept with the scenario
    (``_Packed.kept``: looking it up by its arguments would hash the scenario's layout, ~2 µs
    a call)."""
    return _keep(kept, (m, l, n_pools, layer_stability, capacity, device), _program, (), m, l,
                 n_pools, layout, True, layer_stability, capacity, True, device)


def _args_on(packed: _Packed, which: str, device: jax.Device | None) -> tuple:
    """The packed scenario ``packed.<which>`` (``args`` or ``entry_args``: ``(layout,
    arrays)``), its arrays on ``device`` (put there at the first need and kept with the
    scenario), or as they are for ``None``."""
    if device is None:
        return getattr(packed, which)
    layout, arrays = getattr(packed, which)
    return _keep(packed.kept, (which, device),
                 lambda: (layout, tuple(jax.device_put(arrays, device))))


# Integer dtypes whose every value packs into int32 unchanged (validated plans hold integers):
# for them the rules checked in the program see the plan's own values.
_NO_WRAP = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.uint8,
                                           np.uint16))
