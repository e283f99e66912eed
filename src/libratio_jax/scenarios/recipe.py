"""Host-side scenario descriptions: :class:`ScenarioRecipe`, plain values that rebuild a
:class:`~libratio_jax.physics.scenario.Scenario` exactly (the TRL dataset stores one per row)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np

from libratio_jax.physics.hardware import ClusterSpec
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity, Scenario, Tenant

_WORKLOAD_KEYS = ("mode", "batch", "seq_len", "priority", "slo_tokens_per_second")


@dataclasses.dataclass(frozen=True)
class ScenarioRecipe:
    """Everything needed to rebuild a scenario exactly, as plain values (JSON-able).

    ``pools``: ``((gpu_kind, count), ...)``; ``inlet_celsius``; ``tenants``: one dict per tenant
    slot in use (``model`` plus the :class:`~libratio_jax.Workload` fields ``mode``, ``batch``,
    ``seq_len``, ``priority``, ``slo_tokens_per_second``); the first ``n_present`` tenants are
    present, the rest are pending jobs. :meth:`build` gives the :class:`Scenario` at a
    :class:`Capacity`; :meth:`to_json` / :meth:`from_json` are a compact, exact encoding
    (floats round-trip through ``repr``), which the TRL dataset stores per row.

    Example:
        >>> from libratio_jax.scenarios import Generator
        >>> import jax
        >>> r = Generator("easy").recipe(jax.random.PRNGKey(3))
        >>> ScenarioRecipe.from_json(r.to_json()) == r
        True
    """

    pools: tuple[tuple[str, int], ...]
    inlet_celsius: float
    tenants: tuple[dict, ...]
    n_present: int

    def build(self, capacity: Capacity = DEFAULT_CAPACITY) -> Scenario:
        cluster = ClusterSpec.mixed(list(self.pools), pool_capacity=capacity.max_pools,
                                    inlet_celsius=self.inlet_celsius)
        tenants = [Tenant(t["model"], {k: t[k] for k in _WORKLOAD_KEYS if k in t})
                   for t in self.tenants]
        sc = Scenario.build(cluster, tenants, max_tenants=capacity.max_tenants,
                            max_layers=capacity.max_layers, block_groups=capacity.block_groups)
        slot = np.arange(capacity.max_tenants)
        return sc.replace(present=jnp.asarray(slot < self.n_present),
                          pending=jnp.asarray((slot >= self.n_present)
                                              & (slot < len(self.tenants))))

    def to_json(self) -> str:
        return json.dumps({"pools": [list(p) for p in self.pools],
                           "inlet_celsius": self.inlet_celsius,
                           "tenants": list(self.tenants), "n_present": self.n_present},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ScenarioRecipe:
        """Parse :meth:`to_json` output; raises ValueError on anything else."""
        try:
            d = json.loads(text)
            pools = tuple((str(k), int(n)) for k, n in d["pools"])
            tenants = tuple(dict(t) for t in d["tenants"])
            if not all(isinstance(t.get("model"), str) for t in tenants):
                raise ValueError("every tenant needs a model name")
            return cls(pools, float(d["inlet_celsius"]), tenants, int(d["n_present"]))
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise ValueError(f"not a scenario recipe: {e}") from None


