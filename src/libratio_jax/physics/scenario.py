"""Workloads, tenants and scenarios: the static-shape inputs of :func:`evaluate`.

A :class:`Scenario` is a cluster plus ``M`` tenant slots (model + workload), padded with
``present``. Two scenarios with the same capacities (``M`` tenants, ``L`` rows per model, ``P``
pools) have the same pytree structure and shapes, so one compiled function serves both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import checks
from libratio_jax.physics.architecture import (
    ModelSpec,
    catalog_models,
    config_rows,
    pack_rows_host,
)
from libratio_jax.physics.hardware import ClusterSpec
from libratio_jax.physics.optimizer import OPTIMIZERS
from libratio_jax.physics.rowclasses import class_grid, row_class_indices

# Rows of a model with all blocks merged (embedding, one block's sub-layers, final norm, lm_head):
# at most 15 for the supported architectures; a fixed capacity keeps shapes static.
COARSE_CAPACITY = 16
MODES = ("train", "serve")
TRAIN, SERVE = 0, 1


def _choice(value: Any, names: Sequence[str], field: str) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if 0 <= int(value) < len(names):
            return int(value)
    elif isinstance(value, str) and value.strip().lower() in names:
        return names.index(value.strip().lower())
    raise ValueError(f"{field}: {value!r} is not one of {', '.join(names)}")


@struct.dataclass
class Workload:
    """What a tenant runs. Fields are arrays (scalars per tenant, ``[M]`` when stacked).

    mode: 0 train, 1 serve. batch: sequences per optimizer step (train) or concurrent
    sequences (serve). seq_len: tokens per sequence (serve: context length). optimizer: id in
    :data:`OPTIMIZERS`. priority: weight >= 0. slo_tokens_per_second: throughput target.
    """

    mode: jnp.ndarray
    batch: jnp.ndarray
    seq_len: jnp.ndarray
    optimizer: jnp.ndarray
    priority: jnp.ndarray
    slo_tokens_per_second: jnp.ndarray

    @classmethod
    def make(
        cls,
        mode: str | int = "train",
        batch: int = 8,
        seq_len: int = 4096,
        optimizer: str | int = "adamw_mixed",
        priority: float = 1.0,
        slo_tokens_per_second: float = 0.0,
    ) -> Workload:
        """A validated workload from readable values."""
        m = _choice(mode, MODES, "workload.mode")
        o = _choice(optimizer, OPTIMIZERS, "workload.optimizer")
        batch = checks.positive_int(batch, "workload.batch", checks.MAX_BATCH)
        seq_len = checks.positive_int(seq_len, "workload.seq_len", checks.MAX_SEQ_LEN)
        priority = checks.number(priority, "workload.priority", 0.0, checks.MAX_PRIORITY)
        slo_tokens_per_second = checks.number(slo_tokens_per_second,
                                              "workload.slo_tokens_per_second", 0.0,
                                              checks.MAX_TOKENS_PER_SECOND)
        return cls(
            mode=jnp.int32(m), batch=jnp.float32(batch), seq_len=jnp.float32(seq_len),
            optimizer=jnp.int32(o), priority=jnp.float32(priority),
            slo_tokens_per_second=jnp.float32(slo_tokens_per_second),
        )

    @classmethod
    def arrays(cls, mode: int, batch, seq_len, optimizer: int = 0) -> Workload:
        """A workload of (possibly traced) arrays, unvalidated: for code under ``jit`` that
        derives batch and length from other arrays (e.g. a rollout's mean length)."""
        f = jnp.float32
        return cls(mode=jnp.int32(mode), batch=jnp.asarray(batch, f),
                   seq_len=jnp.asarray(seq_len, f), optimizer=jnp.int32(optimizer),
                   priority=f(1.0), slo_tokens_per_second=f(0.0))


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A model and its workload, as readable values (host-side; not a pytree).

    ``model`` is a catalog name, a config.json path, a dict or a ``PretrainedConfig``.
    """

    model: Any
    workload: Workload | dict = dataclasses.field(default_factory=dict)
    name: str | None = None

    def workload_pytree(self) -> Workload:
        w = self.workload
        if isinstance(w, Workload):
            return w
        if not isinstance(w, dict):
            raise ValueError(f"tenant workload must be a dict or a Workload, got "
                             f"{type(w).__name__}")
        unknown = set(w) - set(Workload.__dataclass_fields__)
        if unknown:
            raise ValueError(f"tenant workload: unknown fields {sorted(unknown)}; valid: "
                             f"{', '.join(Workload.__dataclass_fields__)}")
        return Workload.make(**w)


@struct.dataclass
class Scenario:
    """A cluster and ``M`` tenant slots. ``models`` and ``workloads`` have a leading ``[M]``
    axis; ``present[M]`` marks real tenants; ``model_id[M]`` indexes :func:`catalog_models`
    (-1 for a model not in the catalog). ``coarse_models`` holds the same models with all blocks
    merged (``block_groups=1``, about 14 rows): the physics of an all-BF16 plan are identical on
    them, so the speed-up baseline is computed there. ``pending[M]`` marks slots holding jobs
    that have not arrived yet (the environment may make them present).

    Example:
        >>> sc = Scenario.build(ClusterSpec.uniform("H100-SXM", 8),
        ...                     [Tenant("tiny-llama", {"batch": 4, "seq_len": 512})])
        >>> sc.num_tenants, sc.num_layers
        (1, 39)
    """

    cluster: ClusterSpec
    models: ModelSpec
    workloads: Workload
    present: jnp.ndarray
    model_id: jnp.ndarray
    coarse_models: ModelSpec
    pending: jnp.ndarray
    # Full resolution only: int32 [M, classes, slots] indices of the rows of each row class
    # (one merged row; padding = L), with which ``evaluate`` sums a batch of plans by format
    # counts per class (physics/rowclasses.py). None for merged blocks (block_groups).
    row_classes: jnp.ndarray | None = None

    @property
    def num_tenants(self) -> int:
        return int(self.present.shape[-1])

    @property
    def num_layers(self) -> int:
        return int(self.models.kind.shape[-1])

    @classmethod
    def build(
        cls,
        cluster: ClusterSpec,
        tenants: Sequence[Tenant],
        *,
        max_tenants: int | None = None,
        max_layers: int | None = None,
        block_groups: int | None = None,
    ) -> Scenario:
        """Pad ``tenants`` to ``max_tenants`` slots of ``max_layers`` rows (defaults: tight).

        ``block_groups`` merges each model's blocks into that many segments
        (see :meth:`ModelSpec.from_hf_config`); default: one row per sub-layer per block.
        """
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"scenario: cluster must be a ClusterSpec, got "
                             f"{type(cluster).__name__}")
        if isinstance(tenants, (str, bytes)) or not isinstance(tenants, Sequence) or not tenants:
            raise ValueError("scenario: tenants must be a non-empty list of Tenant")
        built = []
        names = catalog_models()
        for i, t in enumerate(tenants):
            if not isinstance(t, Tenant):
                raise ValueError(f"tenants[{i}] must be a Tenant, got {type(t).__name__}")
            catalog = isinstance(t.model, str) and t.model in names
            rows, scalars, coarse = (_catalog_rows(t.model, block_groups) if catalog
                                     else _rows(t.model, block_groups))
            mid = names.index(t.model) if catalog else -1
            built.append((rows, scalars, t.workload_pytree(), mid, coarse))
        n_rows = max(len(b[0]) for b in built)
        cap_l = n_rows if max_layers is None else checks.positive_int(
            max_layers, "scenario: max_layers", 1 << 16)
        if cap_l < n_rows:
            raise ValueError(f"scenario: a model has {n_rows} rows, more than max_layers={cap_l}")
        cap_m = len(built) if max_tenants is None else checks.positive_int(
            max_tenants, "scenario: max_tenants", 1024)
        if cap_m < len(built):
            raise ValueError(f"scenario: {len(built)} tenants exceed max_tenants={cap_m}")
        specs = [pack_rows_host(b[0], b[1], cap_l) for b in built]
        cap_c = max([COARSE_CAPACITY] + [len(b[4][0]) for b in built])
        coarse = [pack_rows_host(*b[4], cap_c) for b in built]
        works = [b[2] for b in built]
        ids = [b[3] for b in built]
        pad = cap_m - len(built)
        specs += [specs[0]] * pad
        coarse += [coarse[0]] * pad
        works += [works[0]] * pad
        ids += [-1] * pad
        # Stack on the host, then one transfer per leaf (much faster than stacking
        # device arrays: building scenarios is on the TRL reward path).
        stack = lambda xs: jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]),  # noqa: E731
                                        *xs)
        host = dict(models=stack(specs), workloads=stack(works),
                    present=np.arange(cap_m) < len(built), model_id=np.array(ids, np.int32),
                    coarse_models=stack(coarse), pending=np.zeros(cap_m, bool))
        if block_groups is None and cap_l > cap_c:
            host["row_classes"] = class_grid(
                [row_class_indices(b[0], b[4][0]) for b in built], cap_m, cap_c, cap_l)
        return cls(cluster=cluster, **jax.device_put(host))


def _rows(source, block_groups: int | None):
    """(rows, scalars, coarse rows and scalars) of a config source."""
    rows, scalars = config_rows(source, block_groups)
    return rows, scalars, config_rows(source, 1)


@functools.lru_cache(maxsize=256)
def _catalog_rows(name: str, block_groups: int | None):
    return _rows(name, block_groups)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static shapes of a class of scenarios, i.e. the padding arguments of
    :meth:`Scenario.build`: tenant slots (``max_tenants``), rows per model (``max_layers``),
    GPU pools (``ClusterSpec.mixed``'s ``pool_capacity``) and the block merging
    (``block_groups``). Scenarios of one capacity share one compiled function.

    Example:
        >>> Capacity().max_tenants, Capacity(max_tenants=6).max_layers
        (4, 16)
    """

    max_tenants: int = 4
    max_layers: int = 16
    max_pools: int = 2
    block_groups: int | None = 1  # merged blocks: ~14 rows per model (see ModelSpec)


DEFAULT_CAPACITY = Capacity()


def reference_scenario(max_tenants: int | None = None, max_layers: int | None = None,
                       block_groups: int | None = None) -> Scenario:
    """The default scenario of the demo and the benchmark: 4 tenants of real catalog models on
    one node of 8 x H100-SXM (two fine-tuning jobs, two serving jobs)."""
    tenants = [
        Tenant("Llama-3.1-8B", dict(mode="train", batch=16, seq_len=4096, priority=2.0,
                                    slo_tokens_per_second=20_000.0)),
        Tenant("Qwen2.5-7B", dict(mode="serve", batch=64, seq_len=8192, priority=1.0,
                                  slo_tokens_per_second=2_000.0)),
        Tenant("Qwen3-8B", dict(mode="train", batch=8, seq_len=4096, priority=1.0,
                                slo_tokens_per_second=10_000.0)),
        Tenant("Llama-3.2-1B", dict(mode="serve", batch=32, seq_len=4096, priority=0.5,
                                    slo_tokens_per_second=5_000.0)),
    ]
    return Scenario.build(ClusterSpec.uniform("H100-SXM", 8), tenants,
                          max_tenants=max_tenants, max_layers=max_layers,
                          block_groups=block_groups)
