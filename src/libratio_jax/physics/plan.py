"""The action: a :class:`Plan` of per-tenant choices, as arrays, and its validation.

Shapes (add a leading batch axis ``[B]`` for batched plans):
    precision[M, L] int32 format ids per row; gpus[M], tp[M], pp[M], zero_stage[M],
    recompute[M] (0/1), kv_precision[M] (format id), micro_batch[M], pool[M] (cluster pool).

Build one from readable choices with :meth:`Plan.from_choices`; stack several with
:meth:`Plan.stack`. :func:`validate_plan` checks a concrete plan against a scenario before any
tracing; inside ``jit`` the physics stay finite for any integer inputs (``dp`` is floored at 1).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import architecture as A
from libratio_jax.physics import checks
from libratio_jax.physics import formats as F

# Readable layer groups -> row kinds.
LAYER_GROUPS: dict[str, tuple[int, ...]] = {
    "embedding": (A.EMBEDDING,),
    "attention": (A.ATTN_QKV, A.ATTN_OUT),
    "attn_qkv": (A.ATTN_QKV,),
    "attn_out": (A.ATTN_OUT,),
    "mlp": (A.MLP_IN, A.MLP_OUT, A.MOE_EXPERT_IN, A.MOE_EXPERT_OUT),
    "mlp_in": (A.MLP_IN, A.MOE_EXPERT_IN),
    "mlp_out": (A.MLP_OUT, A.MOE_EXPERT_OUT),
    "experts": (A.MOE_EXPERT_IN, A.MOE_EXPERT_OUT),
    "router": (A.MOE_ROUTER,),
    "moe_router": (A.MOE_ROUTER,),
    "norm": (A.NORM,),
    "lm_head": (A.LM_HEAD,),
}
# Groups applied first are overridden by more specific ones later.
_GROUP_ORDER = ("attention", "mlp", "attn_qkv", "attn_out", "mlp_in", "mlp_out", "experts",
                "embedding", "router", "moe_router", "norm", "lm_head")
# Group -> [NUM_KINDS] bool: which row kinds a group covers (a lookup, faster than np.isin).
_GROUP_KINDS = {g: np.isin(np.arange(A.NUM_KINDS), ks) for g, ks in LAYER_GROUPS.items()}
DEFAULT_PRECISION = {"default": "bf16"}

_INT_FIELDS = ("gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch",
               "pool")


@struct.dataclass
class Plan:
    """Per-tenant plan arrays (see module docstring for shapes)."""

    precision: jnp.ndarray
    gpus: jnp.ndarray
    tp: jnp.ndarray
    pp: jnp.ndarray
    zero_stage: jnp.ndarray
    recompute: jnp.ndarray
    kv_precision: jnp.ndarray
    micro_batch: jnp.ndarray
    pool: jnp.ndarray

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.gpus.shape[:-1])

    @classmethod
    def idle(cls, num_tenants: int, num_layers: int, xp=jnp) -> Plan:
        """The plan that places nobody: every row and the KV cache in BF16, zero GPUs, degrees
        and micro-batch 1, ZeRO 0, no recomputation, pool 0 (``xp=numpy`` for host arrays).
        These are also :meth:`from_choices`' defaults, except ``gpus`` (1 for a present
        tenant there)."""
        def full(value):  # a fresh array per field (host arrays are written in place)
            return xp.full(num_tenants, value, xp.int32)

        return cls(precision=xp.full((num_tenants, num_layers), F.BF16, xp.int32),
                   gpus=full(0), tp=full(1), pp=full(1), zero_stage=full(0), recompute=full(0),
                   kv_precision=full(F.BF16), micro_batch=full(1), pool=full(0))

    @classmethod
    def stack(cls, plans: Sequence[Plan]) -> Plan:
        """Stack plans along a new leading batch axis."""
        return jax.tree.map(lambda *a: jnp.stack(a), *plans)

    @classmethod
    def from_choices(cls, scenario, choices: Sequence[Mapping[str, Any]]) -> Plan:
        """A plan from one mapping per present tenant (missing tenants get zero GPUs).

        Keys (all optional): ``precision`` (``{"default": "bf16", "mlp": "fp8", ...}`` over
        :data:`LAYER_GROUPS`, plus ``"layers": {row: fmt}`` and
        ``"blocks": {block: {group: fmt}}`` overrides), ``gpus`` (1), ``tp`` (1), ``pp`` (1),
        ``zero_stage`` (0), ``recompute`` (False), ``kv_precision`` ("bf16"),
        ``micro_batch`` (1), ``pool`` (0).

        Example:
            >>> from libratio_jax.physics.scenario import reference_scenario
            >>> sc = reference_scenario()
            >>> p = Plan.from_choices(sc, [{"gpus": 2, "precision": {"mlp": "fp8"}}] * 4)
            >>> p.precision.shape
            (4, 399)
        """
        arrays = choices_to_arrays(np.asarray(scenario.models.kind),
                                   np.asarray(scenario.models.block),
                                   np.asarray(scenario.models.valid),
                                   int(np.sum(np.asarray(scenario.present))), choices)
        return cls(**{k: jnp.asarray(v) for k, v in arrays.items()})


def choices_to_arrays(kinds: np.ndarray, blocks: np.ndarray, valid: np.ndarray, n_present: int,
                      choices: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The NumPy core of :meth:`Plan.from_choices`: plan fields as host arrays.

    ``kinds``, ``blocks``, ``valid``: ``[M, L]`` row tables of the scenario's models. Padding
    rows (``valid`` False) always hold BF16 and absent tenants the idle defaults, so two plans
    that mean the same thing have identical arrays. Raises ValueError naming the field.
    """
    m, l = kinds.shape
    if len(choices) > m:
        raise ValueError(f"plan: {len(choices)} tenant choices for {m} tenant slots")
    idle = Plan.idle(m, l, np)
    prec = idle.precision
    ints = {k: getattr(idle, k) for k in _INT_FIELDS}
    for i, ch in enumerate(choices):
        if not isinstance(ch, Mapping):
            raise ValueError(f"plan: tenant {i} choices must be a mapping")
        unknown = set(ch) - {"precision", *_INT_FIELDS}
        if unknown:
            raise ValueError(f"plan: tenant {i}: unknown fields {sorted(unknown)}")
        rows = _expand_precision(ch.get("precision", DEFAULT_PRECISION), kinds[i], blocks[i],
                                 f"plan: tenant {i} precision")
        prec[i] = np.where(valid[i], rows, F.BF16)
        ints["gpus"][i] = _int(ch.get("gpus", 1 if i < n_present else 0), f"tenant {i} gpus")
        for k in ("tp", "pp", "micro_batch"):
            ints[k][i] = _int(ch.get(k, 1), f"tenant {i} {k}")
        ints["zero_stage"][i] = _int(ch.get("zero_stage", 0), f"tenant {i} zero_stage")
        ints["recompute"][i] = int(checks.strict_bool(ch.get("recompute", False),
                                                       f"plan: tenant {i} recompute"))
        ints["pool"][i] = _int(ch.get("pool", 0), f"tenant {i} pool")
        try:
            ints["kv_precision"][i] = F.format_id(ch.get("kv_precision", "bf16"))
        except ValueError as e:
            raise ValueError(f"plan: tenant {i} kv_precision: {e}") from None
    return {"precision": prec, **ints}


# Integers a plan field may hold (int32 arrays; larger values are input errors, not overflow).
_INT_LIMIT = 2**24


def _int(v: Any, field: str) -> int:
    return checks.integer(v, f"plan: {field}", -_INT_LIMIT, _INT_LIMIT)


def _expand_precision(spec: Mapping[str, Any] | str, kinds: np.ndarray, blocks: np.ndarray,
                      field: str) -> np.ndarray:
    """Expand readable group choices to one format id per row."""
    if isinstance(spec, str):
        spec = {"default": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{field} must be a mapping of layer groups to formats")

    def fid(v, where):
        try:
            return F.format_id(v)
        except ValueError as e:
            raise ValueError(f"{field}[{where!r}]: {e}") from None

    allowed = set(LAYER_GROUPS) | {"default", "layers", "blocks"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"{field}: unknown layer groups {sorted(unknown)}; "
                         f"valid: {', '.join(sorted(allowed))}")
    # Choices are resolved per row kind first (a lookup table of NUM_KINDS entries; -1: keep
    # the rows' current format), then spread over the rows with one indexing.
    def kind_table(groups: Mapping[str, Any], where: str, start: int) -> np.ndarray:
        bad = set(groups) - set(LAYER_GROUPS) - {"default"}
        if bad:
            raise ValueError(f"{field}: unknown layer groups {sorted(bad)} in {where}")
        table = np.full(A.NUM_KINDS, start, np.int32)
        if "default" in groups:
            table[:] = fid(groups["default"], where)
        for g in _GROUP_ORDER:
            if g in groups:
                table[_GROUP_KINDS[g]] = fid(groups[g], g)
        return table

    default = fid(spec.get("default", "bf16"), "default")
    out = kind_table({k: v for k, v in spec.items() if k in LAYER_GROUPS}, "", default)[kinds]
    for b, groups in _mapping(spec.get("blocks"), f"{field}['blocks']").items():
        b = checks.integer(b, f"{field}: block", -_INT_LIMIT, _INT_LIMIT)
        if not (0 <= b <= blocks.max()):
            raise ValueError(f"{field}: block {b!r} out of range")
        table = kind_table(groups if isinstance(groups, Mapping) else {"default": groups},
                           f"blocks[{b}]", -1)
        rows = np.flatnonzero(blocks == b)
        chosen = table[kinds[rows]]
        out[rows] = np.where(chosen >= 0, chosen, out[rows])
    for r, v in _mapping(spec.get("layers"), f"{field}['layers']").items():
        r = checks.integer(r, f"{field}: layer row", -_INT_LIMIT, _INT_LIMIT)
        if not (0 <= r < len(kinds)):
            raise ValueError(f"{field}: layer row {r!r} out of range [0, {len(kinds)})")
        out[r] = fid(v, f"layers[{r}]")
    return out


def _mapping(x: Any, field: str) -> Mapping:
    if x is None:
        return {}
    if not isinstance(x, Mapping):
        raise ValueError(f"{field} must be a mapping")
    return x


def validate_plan(scenario, plan: Plan) -> None:
    """Check a concrete plan against a scenario; raise ValueError naming the field.

    Checks: shapes and integer dtypes; format ids in range; ``gpus >= 0``; per present tenant:
    ``zero_stage`` in 0..3, ``recompute`` 0 or 1, ``pool`` a cluster pool; per present tenant
    with GPUs: ``tp, pp, micro_batch >= 1``, ``pool`` a real pool with at least ``gpus`` GPUs,
    ``tp * pp`` divides ``gpus``, ``tp`` divides the attention and KV heads, ``pp <= n_blocks``.
    (Several tenants together may over-commit the cluster: that is a physical outcome, flagged
    in ``Metrics.overcommitted``, not an input error.) The rules are evaluated all at once;
    only a plan that breaks one pays for finding which (the common, valid case is a handful of
    NumPy operations, also for a single plan).
    """
    m, l = scenario.num_tenants, scenario.num_layers
    for name in ("precision",) + _INT_FIELDS:
        x = getattr(plan, name)
        if isinstance(x, jax.core.Tracer):
            return  # traced: validation happens at the boundary, not inside jit
    prec = np.asarray(plan.precision)
    batch = prec.shape[:-2]
    if prec.shape[-2:] != (m, l):
        raise ValueError(f"plan.precision has shape {prec.shape}; expected (..., {m}, {l})")
    if prec.dtype.kind not in "iu":
        raise ValueError(f"plan.precision must hold integer format ids, got {prec.dtype}")
    if prec.size and (prec.min() < 0 or prec.max() >= F.NUM_FORMATS):
        raise ValueError(f"plan.precision: format ids must lie in [0, {F.NUM_FORMATS})")
    fields = []
    for name in _INT_FIELDS:
        x = np.asarray(getattr(plan, name))
        if x.shape != batch + (m,):
            raise ValueError(f"plan.{name} has shape {x.shape}; expected {batch + (m,)}")
        if not (x.dtype.kind in "iu" or (name == "recompute" and x.dtype.kind == "b")):
            raise ValueError(f"plan.{name} must hold integers, got dtype {x.dtype}")
        fields.append(x.reshape(-1, m))
    vals = dict(zip(_INT_FIELDS, np.stack(fields).astype(np.int64), strict=True))  # [B, M] each
    present = np.asarray(scenario.present)
    models = scenario.models
    heads = np.asarray(models.n_heads).astype(np.int64)
    kv_heads = np.asarray(models.n_kv_heads).astype(np.int64)
    n_blocks = np.asarray(models.n_blocks).astype(np.int64)
    pool_count = np.asarray(scenario.cluster.gpu_count)
    pool_valid = np.asarray(scenario.cluster.valid)
    g, kv, pool_id = vals["gpus"], vals["kv_precision"], vals["pool"]
    pool = np.clip(pool_id, 0, len(pool_count) - 1)
    tp, pp = np.maximum(vals["tp"], 1), np.maximum(vals["pp"], 1)
    active = (g > 0) & present
    # (what is broken [B, M], message, which tenants it concerns) in the order they are reported
    rules = [
        ((kv < 0) | (kv >= F.NUM_FORMATS), None, None),
        (g < 0, None, None),
        *(((vals[f] < 1) & (g > 0), f, None) for f in ("tp", "pp", "micro_batch")),
        ((vals["zero_stage"] < 0) | (vals["zero_stage"] > 3), "zero_stage must be 0, 1, 2 or 3",
         present),
        ((vals["recompute"] < 0) | (vals["recompute"] > 1), "recompute must be 0 or 1", present),
        ((pool_id < 0) | (pool_id >= len(pool_count)), "pool is not a cluster pool", present),
        (~pool_valid[pool], ("pool is padding, not a real pool", "pool"), active),
        (g > pool_count[pool], ("asks for more GPUs than its pool has", "gpus"), active),
        (g % (tp * pp) != 0, ("tp * pp must divide gpus", "tp"), active),
        ((heads % tp != 0) | (kv_heads % tp != 0),
         ("tp must divide the attention and KV heads", "tp"), active),
        (pp > n_blocks, ("pp exceeds the model's blocks", "pp"), active),
    ]
    broken = [(bad if where is None else bad & where, msg) for bad, msg, where in rules]
    if not np.stack([bad for bad, _ in broken]).any():  # one reduction for the common case
        return
    for k, (bad, msg) in enumerate(broken):
        if not bad.any():
            continue
        b, i = np.argwhere(bad)[0]
        if k == 0:
            raise ValueError(f"plan.kv_precision: format ids must lie in [0, {F.NUM_FORMATS})")
        if k == 1:
            raise ValueError("plan.gpus must be >= 0")
        if isinstance(msg, str) and msg in ("tp", "pp", "micro_batch"):
            raise ValueError(f"plan.{msg}[{i}] must be >= 1 (plan {b})")
        if isinstance(msg, str):
            raise ValueError(f"plan tenant {i} (plan {b}): {msg}")
        text, field = msg
        raise ValueError(
            f"plan.{field}[{i}] (plan {b}): tenant {i} {text} "
            f"(gpus={g[b, i]}, tp={tp[b, i]}, pp={pp[b, i]}, pool={pool[b, i]}, "
            f"pool gpus={pool_count[pool[b, i]]}, heads={heads[i]}, kv_heads={kv_heads[i]})")


def sanitize_plan(scenario, plan: Plan) -> tuple[Plan, jnp.ndarray]:
    """``(safe plan, valid[M])`` for any plan arrays, inside ``jit`` (one plan, no batch axis).

    A present tenant's plan is valid when every field is a finite integer in its domain:
    formats of valid rows and the KV cache in ``[0, NUM_FORMATS)``; ``gpus >= 0``;
    ``zero_stage`` in 0..3; ``recompute`` 0 or 1; ``pool`` a real pool; and, when it has GPUs,
    ``tp, pp, micro_batch >= 1``, ``tp`` dividing the attention and KV heads, ``tp * pp``
    dividing ``gpus`` and ``pp`` at most the blocks: the rules :func:`validate_plan` raises on
    before tracing (except a pool's size: asking for more GPUs than a pool has is the
    ``overcommitted`` outcome here). Absent tenants are always valid. The safe plan holds the
    idle plan for every invalid or absent tenant (int32 throughout), so the physics downstream
    stay finite whatever the input; the caller floors the reward of an invalid plan (IRD rule
    ``invalid_plan``).
    """
    m, l = scenario.num_tenants, scenario.num_layers
    idle = Plan.idle(m, l)
    n_pools = scenario.cluster.gpu_count.shape[-1]

    def integral(x, lo, hi):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            ok = (x >= lo) & (x <= hi)  # in the input's own width (no wrap-around first)
            return jnp.where(ok, x, lo).astype(jnp.int32), ok
        xf = x.astype(jnp.float32)
        ok = jnp.isfinite(xf) & (xf == jnp.round(xf)) & (xf >= lo) & (xf <= hi)
        return jnp.where(ok, xf, lo).astype(jnp.int32), ok

    big = 2**24
    prec, ok_prec = integral(plan.precision, 0, F.NUM_FORMATS - 1)
    ok = jnp.all(ok_prec | ~scenario.models.valid, axis=-1)
    fields = {}
    for name, lo, hi in (("gpus", 0, big), ("zero_stage", 0, 3), ("recompute", 0, 1),
                         ("kv_precision", 0, F.NUM_FORMATS - 1), ("pool", 0, n_pools - 1)):
        fields[name], ok_f = integral(getattr(plan, name), lo, hi)
        ok = ok & ok_f
    has_gpus = fields["gpus"] > 0
    degrees_ok = jnp.bool_(True)
    for name in ("tp", "pp", "micro_batch"):  # only used (and checked) when it has GPUs
        value, ok_f = integral(getattr(plan, name), 1, big)
        fields[name] = jnp.maximum(value, 1)
        degrees_ok = degrees_ok & ok_f
    models = scenario.models
    tp, pp = fields["tp"], fields["pp"]
    structure = (degrees_ok & scenario.cluster.valid[fields["pool"]]
                 & (models.n_heads.astype(jnp.int32) % tp == 0)
                 & (models.n_kv_heads.astype(jnp.int32) % tp == 0)
                 & (fields["gpus"] % (tp * pp) == 0)
                 & (pp <= models.n_blocks.astype(jnp.int32)))
    valid = ~scenario.present | (ok & (structure | ~has_gpus))
    keep = valid & scenario.present
    safe = Plan(precision=jnp.where(keep[:, None], prec, idle.precision),
                **{k: jnp.where(keep, v, getattr(idle, k)) for k, v in fields.items()})
    return safe, valid


# Menus: the values a random plan and the factorized plan space (agents/plan_space.py) choose
# from, per field (index -> value). Degrees stay within an NVLink domain (8 GPUs) for tp;
# pools hold up to 32 GPUs per data-parallel group.
FORMAT_MENU: tuple[int, ...] = tuple(range(F.NUM_FORMATS))
TP_MENU: tuple[int, ...] = (1, 2, 4, 8)
PP_MENU: tuple[int, ...] = (1, 2, 4)
DP_MENU: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
ZERO_MENU: tuple[int, ...] = (0, 1, 2, 3)
RECOMPUTE_MENU: tuple[int, ...] = (0, 1)
KV_MENU: tuple[int, ...] = (F.BF16, F.FP8_E4M3, F.INT8)
MICRO_BATCH_MENU: tuple[int, ...] = (1, 2, 4)


def _choose(u, allowed):
    """Index of a uniformly chosen True entry of ``allowed [..., K]`` given iid uniforms
    ``u [..., K]`` (the largest uniform among the allowed; entry 0 if none is allowed)."""
    return jnp.argmax(jnp.where(allowed, u, -1.0), axis=-1)


def _pick(u, menu):
    """A uniform entry of ``menu`` per uniform in ``u``."""
    menu = jnp.asarray(menu, jnp.int32)
    return menu[jnp.minimum((u * menu.shape[0]).astype(jnp.int32), menu.shape[0] - 1)]


def random_valid_plan(key, scenario, *, per_layer: bool = False) -> Plan:
    """A random plan that passes :func:`validate_plan` for each tenant on its own (jittable;
    ``vmap`` it over keys or scenarios). Per present tenant, uniformly from the ``*_MENU``
    constants: a pool with GPUs, ``tp`` dividing the heads and KV heads, ``pp`` at most the
    blocks, ``tp * pp * dp`` within the pool, a ZeRO stage, recomputation, micro-batch, KV
    format and a format per layer kind (``per_layer``: per row). Absent tenants get the idle
    plan. Tenants are independent, so together they may over-commit the cluster. (One draw of
    uniforms feeds every choice: one PRNG call keeps the compiled sampler small.)

    Example:
        >>> from libratio_jax.physics.scenario import reference_scenario
        >>> sc = reference_scenario(block_groups=1)
        >>> validate_plan(sc, random_valid_plan(jax.random.PRNGKey(0), sc))  # no error
    """
    m, l = scenario.num_tenants, scenario.num_layers
    models = scenario.models
    counts = jnp.where(scenario.cluster.valid, scenario.cluster.gpu_count, 0)
    n_pools = counts.shape[0]
    widths = (n_pools, len(TP_MENU), len(PP_MENU), len(DP_MENU), 4,
              l if per_layer else A.NUM_KINDS)
    u = jax.random.uniform(key, (m, sum(widths)))
    u_pool, u_tp, u_pp, u_dp, u_misc, u_fmt = jnp.split(u, np.cumsum(widths)[:-1], axis=1)
    pool = _choose(u_pool, (counts > 0)[None, :])
    cap = counts[pool][:, None]
    tp_menu, pp_menu, dp_menu = (jnp.asarray(x, jnp.int32) for x in (TP_MENU, PP_MENU, DP_MENU))
    heads = models.n_heads.astype(jnp.int32)[:, None]
    kv = models.n_kv_heads.astype(jnp.int32)[:, None]
    tp = tp_menu[_choose(u_tp, (heads % tp_menu == 0) & (kv % tp_menu == 0) & (tp_menu <= cap))]
    pp = pp_menu[_choose(u_pp, (pp_menu <= models.n_blocks[:, None])
                         & (tp[:, None] * pp_menu <= cap))]
    dp = dp_menu[_choose(u_dp, (tp * pp)[:, None] * dp_menu <= cap)]
    formats = _pick(u_fmt, FORMAT_MENU)
    precision = formats if per_layer else jnp.take_along_axis(formats, models.kind, axis=1)
    plan = Plan(
        precision=precision.astype(jnp.int32), gpus=(tp * pp * dp).astype(jnp.int32),
        tp=tp.astype(jnp.int32), pp=pp.astype(jnp.int32),
        zero_stage=_pick(u_misc[:, 0], ZERO_MENU), recompute=_pick(u_misc[:, 1], RECOMPUTE_MENU),
        kv_precision=_pick(u_misc[:, 2], KV_MENU),
        micro_batch=_pick(u_misc[:, 3], MICRO_BATCH_MENU), pool=pool.astype(jnp.int32))
    keep = scenario.present
    idle = Plan.idle(m, l)
    return jax.tree.map(
        lambda a, b: jnp.where(keep.reshape((m,) + (1,) * (a.ndim - 1)), a, b), plan, idle)


@functools.partial(jax.jit, static_argnames=("n", "per_layer"))
def _sample_plans(scenario, key, n: int, per_layer: bool) -> Plan:
    return jax.vmap(lambda k: random_valid_plan(k, scenario, per_layer=per_layer))(
        jax.random.split(key, n))


def sample_plans(scenario, n: int, seed: int = 0, *, per_layer: bool = True) -> Plan:
    """``n`` random plans ``[n, ...]`` that pass :func:`validate_plan`: :func:`random_valid_plan`
    with keys from ``PRNGKey(seed)``, one jitted call (``per_layer``: a format per row rather
    than per layer kind). Batches are drawn in power-of-two sizes (at least 64) and cut to
    ``n``, so few sizes compile."""
    n = int(n)
    if n < 1:
        raise ValueError(f"sample_plans: n must be >= 1, got {n}")
    size = max(64, 1 << (n - 1).bit_length())
    plans = _sample_plans(scenario, jax.random.PRNGKey(int(seed)), size, bool(per_layer))
    return plans if size == n else jax.tree.map(lambda x: x[:n], plans)
