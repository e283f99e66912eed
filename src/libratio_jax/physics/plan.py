"""The action: a :class:`Plan` of per-tenant choices, as arrays, and its validation.

Shapes (add a leading batch axis ``[B]`` for batched plans):
    precision[M, L] integer format ids per row (int32 from the builders, uint8 from
    :func:`sample_plans`; any integer dtype is accepted); gpus[M], tp[M], pp[M], zero_stage[M],
    recompute[M] (0/1), kv_precision[M] (format id), micro_batch[M], pool[M] (cluster pool).

Build one from readable choices with :meth:`Plan.from_choices`; stack several with
:meth:`Plan.stack`. :func:`validate_plan` checks a concrete plan against a scenario before any
tracing; inside ``jit`` the physics stay finite for any integer inputs (``dp`` is floored at 1).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
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
GROUP_ORDER = _GROUP_ORDER  # the order kind_formats applies the layer groups in

_INT_FIELDS = ("gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch",
               "pool")
INT_FIELDS = _INT_FIELDS  # the integer fields of a Plan, in PlanParts.ints order


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
    parts = plan_parts(kinds, blocks, valid, n_present, choices)
    prec, fields = expand_parts([parts], [(kinds, valid)])
    return {"precision": prec[0], **dict(zip(_INT_FIELDS, fields[0], strict=True))}


@dataclasses.dataclass(frozen=True)
class PlanParts:
    """A plan's choices before they are spread over the rows (host lists; the reward path
    reads many completions, then expands and validates them together):
    ``kind_formats[M][NUM_KINDS + 1]`` the format of each row kind per tenant (the last entry
    for padding rows), ``ints[8][M]`` the integer fields in ``_INT_FIELDS`` order,
    ``overrides`` ``(tenant, formats[L])`` for tenants with ``blocks`` / ``layers`` precision
    overrides (their rows spelled out)."""

    kind_formats: list
    ints: list
    overrides: list

    @classmethod
    def idle(cls, m: int) -> PlanParts:
        """The parts of :meth:`Plan.idle` for ``m`` tenant slots, as fresh lists to write."""
        return cls([list(_IDLE_TABLE) for _ in range(m)],
                   [[_IDLE_INTS[k]] * m for k in _INT_FIELDS], [])


def plan_parts(kinds: np.ndarray, blocks: np.ndarray, valid: np.ndarray, n_present: int,
               choices: Sequence[Mapping[str, Any]]) -> PlanParts:
    """:class:`PlanParts` of readable choices (see :meth:`Plan.from_choices`) for a scenario's
    ``[M, L]`` row tables; ValueError naming the field."""
    m = kinds.shape[0]
    if len(choices) > m:
        raise ValueError(f"plan: {len(choices)} tenant choices for {m} tenant slots")
    parts = PlanParts.idle(m)
    tables, overrides = parts.kind_formats, parts.overrides
    ints = dict(zip(_INT_FIELDS, parts.ints, strict=True))  # the same lists, by field
    for i, ch in enumerate(choices):
        if not isinstance(ch, Mapping):
            raise ValueError(f"plan: tenant {i} choices must be a mapping")
        if not _CHOICE_FIELDS.issuperset(ch):
            raise ValueError(f"plan: tenant {i}: unknown fields "
                             f"{sorted(set(ch) - _CHOICE_FIELDS)}")
        if "precision" in ch:  # else BF16 everywhere, as the idle table
            field = f"plan: tenant {i} precision"
            spec = _precision_spec(ch["precision"], field)
            tables[i] = _kind_table(spec, field) + [F.BF16]
            if "blocks" in spec or "layers" in spec:
                rows = np.asarray(tables[i], np.int32)[np.where(valid[i], kinds[i],
                                                                A.NUM_KINDS)]
                overrides.append((i, np.where(valid[i], _apply_overrides(
                    rows, spec, kinds[i], blocks[i], field), F.BF16)))
        ints["gpus"][i] = _int(ch.get("gpus", LISTED_GPUS if i < n_present else 0), i, "gpus")
        for k in ("tp", "pp", "micro_batch", "zero_stage"):
            if k in ch:
                ints[k][i] = _int(ch[k], i, k)
        rec = ch.get("recompute", False)
        ints["recompute"][i] = int(rec if type(rec) is bool else checks.strict_bool(
            rec, f"plan: tenant {i} recompute"))
        if "pool" in ch:
            ints["pool"][i] = _int(ch["pool"], i, "pool")
        if "kv_precision" in ch:
            try:
                ints["kv_precision"][i] = _format(ch["kv_precision"], "", "")
            except ValueError as e:
                raise ValueError(f"plan: tenant {i} kv_precision: {e}") from None
    return parts


def expand_parts(parts: Sequence[PlanParts], rows: Sequence[tuple]) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """``(precision [B, M, L], int fields [B, 8, M])`` (int32) of plans given as
    :class:`PlanParts`, each with its scenario's ``(kinds, valid)`` row tables (all of one
    shape ``[M, L]``): one indexing spreads every plan's kind formats over its rows."""
    n = len(parts)
    tables = np.array([p.kind_formats for p in parts], np.int32).reshape(n, -1)
    index = np.stack([_row_index(k, v) for k, v in rows]) if n > 1 else (
        _row_index(*rows[0])[None])
    prec = np.take_along_axis(tables, index.reshape(n, -1), axis=1).reshape(index.shape)
    for b, p in enumerate(parts):
        for i, formats in p.overrides:
            prec[b, i] = formats
    return prec, np.array([p.ints for p in parts], np.int32)


def plan_at(precision: np.ndarray, fields: np.ndarray, k: int) -> Plan:
    """Plan ``k`` of :func:`expand_parts`' arrays."""
    return Plan(precision=precision[k], **dict(zip(_INT_FIELDS, fields[k], strict=True)))


# Integers a plan field may hold (int32 arrays; larger values are input errors, not overflow).
INT_LIMIT = 2**24
_INT64_MAX = np.iinfo(np.int64).max
LISTED_GPUS = 1  # the GPUs of a present tenant whose choices name none (Plan.from_choices)
_CHOICE_FIELDS = frozenset(("precision", *_INT_FIELDS))
_IDLE_INTS = {"gpus": 0, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": 0,
              "kv_precision": F.BF16, "micro_batch": 1, "pool": 0}  # Plan.idle's fields


_IDLE_TABLE = [F.BF16] * (A.NUM_KINDS + 1)


def _per_object(cache: dict, obj: Any, build: Callable[[Any], Any]) -> Any:
    """``build(obj)``, computed once per live object (host scenarios and their row tables:
    the parser builds and validates many plans of each). Entries leave with their object."""
    key = id(obj)
    hit = cache.get(key)
    if hit is not None and hit[0]() is obj:
        return hit[1]
    value = build(obj)
    try:
        ref = weakref.ref(obj, lambda _, key=key: cache.pop(key, None))
    except TypeError:  # not weak-referenceable: not kept
        return value
    cache[key] = (ref, value)
    return value


_ROW_INDEX: dict[int, tuple[weakref.ref, tuple[np.ndarray, np.ndarray]]] = {}


def _row_index(kinds: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[M, L]`` index of each row's entry in the flattened ``[M, NUM_KINDS + 1]`` tables
    (padding rows, where ``valid`` is False: the last entry)."""
    def build(_):
        m = kinds.shape[0]
        return valid, (np.where(valid, kinds, A.NUM_KINDS)
                       + (A.NUM_KINDS + 1) * np.arange(m)[:, None])

    if kinds.flags.writeable or valid.flags.writeable:  # may change in place: not kept
        return build(None)[1]
    kept_valid, index = _per_object(_ROW_INDEX, kinds, build)
    return index if kept_valid is valid else build(None)[1]


def _int(v: Any, i: int, field: str) -> int:
    if type(v) is int and -INT_LIMIT <= v <= INT_LIMIT:
        return v
    return checks.integer(v, f"plan: tenant {i} {field}", -INT_LIMIT, INT_LIMIT)


_FORMAT_IDS = {**{i: i for i in range(F.NUM_FORMATS)}, **F.FORMAT_IDS}


def _format(v: Any, field: str, where: Any) -> int:
    """A format id from an id or a name (``field[where]: ...`` in the error; bare without a
    field)."""
    fid = _FORMAT_IDS.get(v) if type(v) in (int, str) else None
    if fid is not None:
        return fid
    try:
        return F.format_id(v)
    except ValueError as e:
        raise ValueError(f"{field}[{where!r}]: {e}" if field else str(e)) from None


_ALLOWED_GROUPS = frozenset(LAYER_GROUPS) | {"default", "layers", "blocks"}
_GROUP_KINDS = tuple(LAYER_GROUPS[g] for g in _GROUP_ORDER)


def _precision_spec(spec: Mapping[str, Any] | str, field: str) -> Mapping[str, Any]:
    if isinstance(spec, str):
        return {"default": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{field} must be a mapping of layer groups to formats")
    if not _ALLOWED_GROUPS.issuperset(spec):
        raise ValueError(f"{field}: unknown layer groups {sorted(set(spec) - _ALLOWED_GROUPS)}; "
                         f"valid: {', '.join(sorted(_ALLOWED_GROUPS))}")
    return spec


def _kind_table(groups: Mapping[str, Any], field: str, where: str = "",
                start: int | None = None) -> list[int]:
    """Format per row kind (``NUM_KINDS`` entries; ``start`` where no group applies: -1 keeps
    the rows' current format) from group choices; groups later in ``_GROUP_ORDER`` win."""
    if start is None:  # the top level: "default" (BF16) under every group
        start = _format(groups.get("default", "bf16"), field, "default")
    elif "default" in groups:
        start = _format(groups["default"], field, where)
    return kind_formats(start, [_format(groups[g], field, g) if g in groups else None
                                for g in _GROUP_ORDER])


def kind_formats(start: int, group_formats: Sequence[int | None]) -> list[int]:
    """Format id per row kind (``NUM_KINDS`` entries) from one format id (or ``None``: not
    chosen) per layer group in ``GROUP_ORDER``: ``start`` where no chosen group applies;
    groups later in the order win. The one statement of the groups' precedence."""
    table = [start] * A.NUM_KINDS
    for f, kinds in zip(group_formats, _GROUP_KINDS, strict=True):
        if f is not None:
            for k in kinds:
                table[k] = f
    return table


def _apply_overrides(out: np.ndarray, spec: Mapping[str, Any], kinds: np.ndarray,
                     blocks: np.ndarray, field: str) -> np.ndarray:
    """``out`` (formats per row) with the spec's ``blocks`` and ``layers`` overrides."""
    out = out.copy()
    for b, groups in _mapping(spec.get("blocks"), f"{field}['blocks']").items():
        b = checks.integer(b, f"{field}: block", -INT_LIMIT, INT_LIMIT)
        if not (0 <= b <= blocks.max()):
            raise ValueError(f"{field}: block {b!r} out of range")
        groups = groups if isinstance(groups, Mapping) else {"default": groups}
        bad = set(groups) - set(LAYER_GROUPS) - {"default"}
        if bad:
            raise ValueError(f"{field}: unknown layer groups {sorted(bad)} in blocks[{b}]")
        table = np.array(_kind_table(groups, field, f"blocks[{b}]", -1), np.int32)
        rows = np.flatnonzero(blocks == b)
        chosen = table[kinds[rows]]
        out[rows] = np.where(chosen >= 0, chosen, out[rows])
    for r, v in _mapping(spec.get("layers"), f"{field}['layers']").items():
        r = checks.integer(r, f"{field}: layer row", -INT_LIMIT, INT_LIMIT)
        if not (0 <= r < len(kinds)):
            raise ValueError(f"{field}: layer row {r!r} out of range [0, {len(kinds)})")
        out[r] = _format(v, field, f"layers[{r}]")
    return out


def _mapping(x: Any, field: str) -> Mapping:
    if x is None:
        return {}
    if not isinstance(x, Mapping):
        raise ValueError(f"{field} must be a mapping")
    return x


def validate_plan(scenario, plan: Plan, *, rules: bool = True, ids: bool = True) -> None:
    """Check a concrete plan against a scenario; raise ValueError naming the field.

    Checks: shapes and integer dtypes; format ids in range; ``gpus >= 0``; per present tenant:
    ``zero_stage`` in 0..3, ``recompute`` 0 or 1, ``pool`` a cluster pool; per present tenant
    with GPUs: ``tp, pp, micro_batch >= 1``, ``micro_batch <= INT_LIMIT``, ``pool`` a real
    pool with at least ``gpus`` GPUs, ``tp * pp`` divides ``gpus``, ``tp`` divides the
    attention and KV heads, ``pp <= n_blocks``.
    (Several tenants together may over-commit the cluster: that is a physical outcome, flagged
    in ``Metrics.overcommitted``, not an input error.) The rules are evaluated all at once;
    only a plan that breaks one pays for finding which (the common, valid case is a handful of
    NumPy operations, also for a single plan). ``rules=False`` checks only the shapes, dtypes
    and format ids, for a caller that checks the rules in its own program
    (:func:`breaks_rules`) and calls this again for the message of a plan that breaks one;
    ``ids=False`` leaves out the format ids' range too, for a caller that checks them itself
    (``lj.evaluate``'s one host plan: ``native.compact_pairs`` reads every id anyway).
    """
    m, l = scenario.num_tenants, scenario.num_layers
    prec, xs = plan.precision, [getattr(plan, name) for name in _INT_FIELDS]
    plain = _plain_host_plan(prec, xs, m, l)
    if plain:
        batch = ()
    else:
        tracer = jax.core.Tracer
        if isinstance(prec, tracer) or any(isinstance(x, tracer) for x in xs):
            validate_shapes(scenario, plan, exact=False)  # (static)
            return  # traced: the values' validation happens at the boundary, not inside jit
        batch = validate_shapes(scenario, plan)
        prec = np.asarray(prec)
        if prec.dtype.kind not in "iu":
            raise ValueError(f"plan.precision must hold integer format ids, got {prec.dtype}")
    if ids and not format_ids_in_range(prec):
        raise ValueError(f"plan.precision: format ids must lie in [0, {F.NUM_FORMATS})")
    if not plain:
        xs = [x if type(x) is np.ndarray else np.asarray(x) for x in xs]
        for name, x in zip(_INT_FIELDS, xs, strict=True):
            if not (x.dtype.kind in "iu" or (name == "recompute" and x.dtype.kind == "b")):
                raise ValueError(f"plan.{name} must hold integers, got dtype {x.dtype}")
    if not rules:
        return
    tables = rule_tables(scenario)
    if not batch:  # one plan: the rules on Python scalars, tenant by tenant
        per_tenant = zip(*(x.tolist() for x in xs), *tables.lists[:4], strict=True)
        if not any(bad for row in per_tenant
                   for bad, _ in _broken_rules(*row, *tables.lists[4:], max, _clip, _at)):
            return
    # [fields, B, M] (uint64 values beyond int64 kept at its largest: a cast would make them
    # negative, and the messages below name the wrong rule)
    stacked = np.array([np.minimum(x, _INT64_MAX) if x.dtype == np.uint64 else x for x in xs],
                       np.int64).reshape(len(xs), -1, m)
    tables = tables.arrays
    broken = _broken_rules(*stacked, *tables, np.maximum, np.clip, _at)
    if not np.stack([bad for bad, _ in broken]).any():  # one reduction for the common case
        return
    g, tp, pp, pool = (stacked[0], np.maximum(stacked[1], 1), np.maximum(stacked[2], 1),
                       np.clip(stacked[7], 0, len(tables[4]) - 1))
    heads, kv_heads, pool_count = tables[1], tables[2], tables[4]
    for k, (bad, msg) in enumerate(broken):
        if not np.any(bad):
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


def format_ids_in_range(precision: np.ndarray) -> bool:
    """Whether every id of ``precision`` (a host integer array) lies in ``[0, F)``: one
    reduction for both bounds, a negative id read as unsigned (same width and byte order)
    is beyond every format."""
    return not precision.size or precision.view(
        _unsigned(precision.dtype)).max() < F.NUM_FORMATS


def validate_shapes(scenario, plan: Plan, *, exact: bool = True) -> tuple[int, ...]:
    """The batch shape of ``plan`` on ``scenario``, or ValueError naming the field whose shape
    does not fit: ``precision [..., M, L]`` and every integer field ``[..., M]`` with the same
    leading axes (``exact=False`` and one plan, no leading axes: or a shape that broadcasts
    to ``[M]``, e.g. one scalar for every tenant; a batch maps every field over its leading
    axes). Any dtype; traced arrays too (shapes are static). What
    :func:`validate_plan` checks first; ``lj.evaluate(..., validate=False)`` and a traced
    plan check it with ``exact=False`` (a plan of other shapes would otherwise fail inside
    JAX's broadcasting)."""
    m, l = scenario.num_tenants, scenario.num_layers
    shape = tuple(_shape(plan.precision, "precision"))
    if shape[-2:] != (m, l):
        raise ValueError(f"plan.precision has shape {shape}; expected (..., {m}, {l})")
    want = shape[:-2] + (m,)
    for name in _INT_FIELDS:
        got = tuple(_shape(getattr(plan, name), name))
        if got == want:
            continue
        if not exact and len(want) == 1:
            try:
                if np.broadcast_shapes(got, want) == want:
                    continue
            except ValueError:
                pass
        raise ValueError(f"plan.{name} has shape {got}; expected {want}"
                         + ("" if exact or len(want) > 1 else " (or one that broadcasts to it)"))
    return shape[:-2]


def _shape(x, name: str) -> tuple:
    """``x``'s shape without converting an array (JAX arrays and tracers have one);
    ValueError naming the field ``plan.<name>`` for nested sequences of unequal lengths."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return shape
    try:
        return np.shape(x)
    except ValueError:  # NumPy's "inhomogeneous shape"
        raise ValueError(f"plan.{name} must be an array of one shape (got nested sequences "
                         "of unequal lengths)") from None


def _plain_host_plan(prec, xs, m: int, l: int) -> bool:
    """Whether ``prec`` and the integer fields ``xs`` are one plan of NumPy arrays of their
    shapes (``[M, L]``, ``[M]``) and native integer types: the common case (a server step, one
    reward), for which :func:`validate_plan`'s shape and dtype checks would pass and are
    skipped (~3 µs); only the format ids' range is left to check."""
    return (type(prec) is np.ndarray and prec.shape == (m, l) and prec.dtype in _PLAIN_INTS
            and all(type(x) is np.ndarray and x.shape == (m,) and x.dtype in _PLAIN_INTS
                    for x in xs))


# Integer types (native byte order) that validate_plan's fast path takes as they are.
_PLAIN_INTS = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                              np.uint16, np.uint32, np.uint64))


@functools.cache
def _unsigned(dtype: np.dtype) -> np.dtype:
    """The unsigned integer type of ``dtype``'s width and byte order."""
    return np.dtype(dtype.str.replace("i", "u"))


class RuleTables:
    """The scenario fields :func:`validate_plan`'s rules read: present, heads, KV heads and
    blocks per tenant, GPUs and validity per pool; as arrays, as lists (the scalar path) and
    as one int64 vector (``flat``: many scenarios' tables stack in one call). Get them with
    :func:`rule_tables`."""

    def __init__(self, scenario):
        models, cluster = scenario.models, scenario.cluster
        self.arrays = (np.asarray(scenario.present), np.asarray(models.n_heads).astype(np.int64),
                       np.asarray(models.n_kv_heads).astype(np.int64),
                       np.asarray(models.n_blocks).astype(np.int64),
                       np.asarray(cluster.gpu_count), np.asarray(cluster.valid))
        self.lists = tuple(a.tolist() for a in self.arrays)
        self.flat = np.concatenate([a.astype(np.int64) for a in self.arrays])


_RULE_TABLES: dict[int, tuple[weakref.ref, RuleTables]] = {}


def rule_tables(scenario) -> RuleTables:
    """The scenario's :class:`RuleTables`, kept per scenario object when its arrays cannot
    change (JAX arrays, read-only NumPy views of them); host arrays that may be written in
    place are read afresh."""
    leaves = (scenario.present, scenario.models.n_heads, scenario.models.n_kv_heads,
              scenario.models.n_blocks, scenario.cluster.gpu_count, scenario.cluster.valid)
    if any(isinstance(x, np.ndarray) and x.flags.writeable for x in leaves):
        return RuleTables(scenario)
    return _per_object(_RULE_TABLES, scenario, RuleTables)


def _clip(x: int, lo: int, hi: int) -> int:
    return min(max(x, lo), hi)


def _at(table, index):
    return table[index]


def _at_rows(table, index):
    return np.take_along_axis(table, index, axis=-1)


def invalid_plans(fields: np.ndarray, tables: Sequence[RuleTables]) -> np.ndarray:
    """``bool[B]``: which plans break a rule of :func:`validate_plan`, for host plans of
    different scenarios of one shape (``fields[B, 8, M]``: the integer fields in
    ``_INT_FIELDS`` order; ``tables``: each plan's scenario's :func:`rule_tables`;
    precisions are not checked: for plans built by :func:`expand_parts`, whose formats are
    valid ids). One vectorized pass for a batch; :func:`validate_plan` then says what is
    wrong with a flagged one."""
    m = fields.shape[-1]
    flat = np.array([t.flat for t in tables])  # [B, 4 M + 2 P]
    n_pools = (flat.shape[1] - 4 * m) // 2
    cuts = np.cumsum([m, m, m, m, n_pools])
    present, heads, kv_heads, n_blocks, pool_count, pool_valid = np.split(flat, cuts, axis=1)
    broken = _broken_rules(*np.moveaxis(fields.astype(np.int64), 1, 0), present.astype(bool),
                           heads, kv_heads, n_blocks, pool_count, pool_valid, np.maximum,
                           np.clip, _at_rows)
    return np.stack([bad for bad, _ in broken]).any(axis=(0, 2))


def breaks_rules(scenario, plan: Plan) -> jnp.ndarray:
    """Whether one plan (no batch axis, integer arrays) breaks a rule of
    :func:`validate_plan` (format ids of the rows not included): the same rules, as a
    jittable ``bool[]`` (``vmap`` it for batches). For callers that check many plans inside
    their own program and ask :func:`validate_plan` for the message of a flagged one."""
    models, cluster = scenario.models, scenario.cluster
    fields = [getattr(plan, f).astype(jnp.int32) for f in _INT_FIELDS]
    broken = _broken_rules(*fields, scenario.present,
                           models.n_heads.astype(jnp.int32), models.n_kv_heads.astype(jnp.int32),
                           models.n_blocks.astype(jnp.int32), cluster.gpu_count,
                           cluster.valid.astype(jnp.int32), jnp.maximum, jnp.clip, _at)
    # OR-ed per tenant, then one reduction (XLA's CPU compiler made a kernel per rule of
    # ``any(stack(rules))``: 14 kernels, ~4 µs of a single call)
    return jnp.any(functools.reduce(jnp.logical_or, [bad for bad, _ in broken]))


def _broken_rules(g, tp_raw, pp_raw, zero, rec, kv, mb, pool_id, present, heads, kv_heads,
                  n_blocks, pool_count, pool_valid, maximum, clip, at):
    """``[(broken, message)]`` of :func:`validate_plan`'s rules, in the order they are
    reported, for NumPy arrays (``[B, M]`` plan fields, ``[M]`` and ``[P]`` tables) or for one
    tenant's Python scalars (``maximum=max``; ``at(table, index)`` looks a pool up): the one
    statement of the rules, so the fast paths and the reporting path cannot disagree.
    ``message`` is a field (the ``>= 1`` rules), a sentence, or ``(sentence, field)``; the
    first two rules have fixed messages."""
    n_pools = pool_count.shape[-1] if hasattr(pool_count, "shape") else len(pool_count)
    pool = clip(pool_id, 0, n_pools - 1)
    tp, pp = maximum(tp_raw, 1), maximum(pp_raw, 1)
    has_gpus = g > 0
    active = has_gpus & present
    return [
        ((kv < 0) | (kv >= F.NUM_FORMATS), None),
        (g < 0, None),
        ((tp_raw < 1) & has_gpus, "tp"),
        ((pp_raw < 1) & has_gpus, "pp"),
        ((mb < 1) & has_gpus, "micro_batch"),
        # (the sanitizer's bound on every integer; the other fields meet theirs through the
        # rules below: a pool's GPUs, tp * pp dividing them, pp within the blocks)
        ((mb > INT_LIMIT) & has_gpus, (f"micro_batch exceeds {INT_LIMIT}", "micro_batch")),
        (((zero < 0) | (zero > 3)) & present, "zero_stage must be 0, 1, 2 or 3"),
        (((rec < 0) | (rec > 1)) & present, "recompute must be 0 or 1"),
        (((pool_id < 0) | (pool_id >= n_pools)) & present, "pool is not a cluster pool"),
        ((at(pool_valid, pool) == 0) & active, ("pool is padding, not a real pool", "pool")),
        ((g > at(pool_count, pool)) & active, ("asks for more GPUs than its pool has", "gpus")),
        ((g % (tp * pp) != 0) & active, ("tp * pp must divide gpus", "tp")),
        (((heads % tp != 0) | (kv_heads % tp != 0)) & active,
         ("tp must divide the attention and KV heads", "tp")),
        ((pp > n_blocks) & active, ("pp exceeds the model's blocks", "pp")),
    ]


def sanitize_plan(scenario, plan: Plan, *, fence=None) -> tuple[Plan, jnp.ndarray]:
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
    ``invalid_plan``). ``fence``: as :func:`sanitize_fields`'.
    """
    prec, ok_prec = _integral(plan.precision, 0, F.NUM_FORMATS - 1)
    ok = jnp.all(ok_prec | ~scenario.models.valid, axis=-1)
    fields, valid = sanitize_fields(scenario, plan, ok, fence=fence)
    keep = valid & scenario.present
    safe = Plan(precision=jnp.where(keep[:, None], prec, F.BF16), **fields)
    return safe, valid


def sanitize_precision(precision, keep) -> jnp.ndarray:
    """The row formats of :func:`sanitize_plan`'s safe plan (``int32[M, L]``, BF16 rows for
    every tenant not in ``keep[M]``), for a caller that has the tenants' verdict already."""
    return jnp.where(keep[:, None], _integral(precision, 0, F.NUM_FORMATS - 1)[0], F.BF16)


def safe_plan(scenario, plan: Plan, plan_valid) -> Plan:
    """:func:`sanitize_plan`'s safe plan of one plan given its verdict ``plan_valid[M]``
    (e.g. the plan's ``Metrics.plan_valid``), without checking the row formats again: for a
    caller that has the metrics of a batch and needs the plans the rules read
    (``rewards.difference.team_rewards``)."""
    fields, _ = sanitize_fields(scenario, plan)
    keep = plan_valid & scenario.present
    return Plan(precision=sanitize_precision(plan.precision, keep),
                **_idle_unless(scenario, fields, keep))


def _integral(x, lo, hi):
    """``(int32 values, in-domain mask)``: finite integers in ``[lo, hi]`` kept, others
    ``lo``."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        if x.dtype.itemsize < 4:  # exact in int32, where the bounds fit (in uint8 they wrap)
            x = x.astype(jnp.int32)
        ok = (x >= lo) & (x <= hi)  # in the input's own width (no wrap-around first)
        return jnp.where(ok, x, lo).astype(jnp.int32), ok
    xf = x.astype(jnp.float32)
    ok = jnp.isfinite(xf) & (xf == jnp.round(xf)) & (xf >= lo) & (xf <= hi)
    return jnp.where(ok, xf, lo).astype(jnp.int32), ok


def _divides(d, n):
    """Whether ``d`` divides ``n`` (int32; ``0 <= n <= INT_LIMIT``, any ``d``), as ``n %
    d == 0`` says (C remainders, ``d = 0`` dividing only 0). Through a float32 quotient:
    XLA's CPU code divides integers one element at a time, floats 16 at a time. Exact: ``n``
    and ``d`` (up to 2^24) are float32 numbers, so where ``d`` divides ``n`` the quotient is
    exact and its product with ``d`` is ``n``; where it does not, no integer times ``d`` is
    ``n``. The rounded quotient is at most ``n / |d| + 1``, so the product stays far from
    int32's limits; a larger ``|d|`` gives a quotient of 0 (``n < |d| / 2``)."""
    q = jnp.round(n.astype(jnp.float32) / d.astype(jnp.float32))
    return jnp.where(d == 0, n == 0, jnp.where(jnp.isfinite(q), q, 0).astype(jnp.int32) * d == n)


def sanitize_fields(scenario, plan: Plan, precision_ok=True, *,
                    fence=None) -> tuple[dict, jnp.ndarray]:
    """:func:`sanitize_plan` of the integer fields ``[M]`` given whether each tenant's row
    formats are in their domain (``precision_ok[M]``): ``(safe fields by name, valid[M])``,
    the idle plan's values for every invalid or absent tenant. ``plan.precision`` is not
    read (the class-count path checks the formats while counting them, and a batch
    sanitizes its fields before that: :func:`gate_fields`). ``fence``: a function applied
    to the verdict before the fields are gated on it (an identity for values; a batch passes
    ``physics.native.fence``, so that the checks run once, not once per field)."""
    n_pools = scenario.cluster.gpu_count.shape[-1]
    ok = precision_ok
    big = INT_LIMIT
    fields = {}
    for name, lo, hi in (("gpus", 0, big), ("zero_stage", 0, 3), ("recompute", 0, 1),
                         ("kv_precision", 0, F.NUM_FORMATS - 1), ("pool", 0, n_pools - 1)):
        fields[name], ok_f = _integral(getattr(plan, name), lo, hi)
        ok = ok & ok_f
    has_gpus = fields["gpus"] > 0
    degrees_ok = jnp.bool_(True)
    for name in ("tp", "pp", "micro_batch"):  # only used (and checked) when it has GPUs
        value, ok_f = _integral(getattr(plan, name), 1, big)
        fields[name] = jnp.maximum(value, 1)
        degrees_ok = degrees_ok & ok_f
    models = scenario.models
    tp, pp = fields["tp"], fields["pp"]
    structure = (degrees_ok & scenario.cluster.valid[fields["pool"]]
                 & _divides(tp, models.n_heads.astype(jnp.int32))
                 & _divides(tp, models.n_kv_heads.astype(jnp.int32))
                 & _divides(tp * pp, fields["gpus"])
                 & (pp <= models.n_blocks.astype(jnp.int32)))
    valid = ~scenario.present | (ok & (structure | ~has_gpus))
    if fence is not None:
        valid = fence(valid)
    return _idle_unless(scenario, fields, valid & scenario.present), valid


def gate_fields(scenario, fields: dict, fields_valid, precision_ok) -> tuple[dict, jnp.ndarray]:
    """``sanitize_fields(scenario, plan, precision_ok)`` from ``(fields, fields_valid) =
    sanitize_fields(scenario, plan)`` (every tenant's formats taken as in their domain) and
    the formats' verdict ``precision_ok[M]`` (equal: ``tests/test_plan.py``). A batch
    sanitizes its fields once, before its chunks count the formats
    (``physics.kernel.evaluate_batch``): inside a chunk XLA's CPU compiler copied the ~60
    checks into every per-entry kernel of the class physics."""
    return (_idle_unless(scenario, fields, precision_ok),
            fields_valid & (precision_ok | ~scenario.present))


def _idle_unless(scenario, fields: dict, keep) -> dict:
    """The fields, the idle plan's values where ``keep[M]`` is False."""
    idle = Plan.idle(scenario.num_tenants, 1)
    return {k: jnp.where(keep, v, getattr(idle, k)) for k, v in fields.items()}


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
    plans = jax.vmap(lambda k: random_valid_plan(k, scenario, per_layer=per_layer))(
        jax.random.split(key, n))
    return plans.replace(precision=plans.precision.astype(jnp.uint8))  # ids < NUM_FORMATS


def sample_plans(scenario, n: int, seed: int = 0, *, per_layer: bool = True) -> Plan:
    """``n`` random plans ``[n, ...]`` that pass :func:`validate_plan`: :func:`random_valid_plan`
    with keys from ``checks.seed_key(seed)``, one jitted call (``per_layer``: a format per
    row rather than per layer kind). Batches are drawn in power-of-two sizes (at least 64)
    and cut to ``n``, so few sizes compile. The formats are stored as one byte per row
    (``precision`` uint8 ``[n, M, L]``; the other fields int32): a quarter of the memory of
    int32 ids, and the dtype the full-resolution counting narrows ids to anyway (any integer
    dtype is accepted)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"sample_plans: n must be >= 1, got {n}")
    size = max(64, 1 << (n - 1).bit_length())
    plans = _sample_plans(scenario, checks.seed_key(seed), size, bool(per_layer))
    return plans if size == n else jax.tree.map(lambda x: x[:n], plans)
