"""The layouts an RL cluster can take: how many GPUs train and with which (tp, pp, dp), and how
the rest are cut into rollout instances. Enumerated once per cluster and model (host-side), so
the action is one index into a fixed table (static shapes: ``[K]`` layouts, ``[K, I]``
instance slots).

Training GPU counts step by ``total_gpus // 8`` (whole data-parallel replicas move between
training and rollout, as Libra's elastic pool moves them); training uses ``tp`` in
{1, 2, 4, 8} and ``pp`` in {1, 2, 4} (Libra's planner: powers of two up to 8). The remaining
GPUs become rollout instances of one ``tp`` (homogeneous), or two tiers of half the GPUs each,
the smaller ``tp`` for short trajectories and the larger for long ones (C-MLFQ's buckets served
by instances of growing ``tp``). A ``tp`` is kept only where it divides the model's heads.

    >>> lay = enumerate_layouts(8, n_blocks=16, n_heads=32, n_kv_heads=8)
    >>> lay.describe(0)
    'train 1 GPU (tp1 pp1 dp1) | rollout 7 x tp1'
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics.rollout import TP_CHOICES

TRAIN_PP_CHOICES: tuple[int, ...] = (1, 2, 4)
MAX_TOTAL_GPUS = 1024  # the layout table is [K, I] with I up to total_gpus instance slots


@struct.dataclass
class Layouts:
    """``K`` layouts; instance slots ``I`` padded with kind -1.

    ``train_gpus, train_tp, train_pp, train_dp``: int32 ``[K]``. ``rollout_kind``: int32
    ``[K, I]``, index into :data:`~libratio_jax.physics.rollout.TP_CHOICES` per rollout
    instance (-1: no instance). ``total_gpus``: int32 scalar."""

    train_gpus: jnp.ndarray
    train_tp: jnp.ndarray
    train_pp: jnp.ndarray
    train_dp: jnp.ndarray
    rollout_kind: jnp.ndarray
    total_gpus: jnp.ndarray

    @property
    def count(self) -> int:
        return int(self.train_gpus.shape[-1])

    def describe(self, k: int) -> str:
        """A readable line for layout ``k``."""
        k = int(k)
        t = int(np.asarray(self.train_gpus)[k])
        tp, pp, dp = (int(np.asarray(a)[k]) for a in (self.train_tp, self.train_pp,
                                                      self.train_dp))
        kinds = np.asarray(self.rollout_kind)[k]
        tiers = [f"{int(np.sum(kinds == i))} x tp{tp_}" for i, tp_ in enumerate(TP_CHOICES)
                 if np.any(kinds == i)]
        gpus = "GPU" if t == 1 else "GPUs"
        return f"train {t} {gpus} (tp{tp} pp{pp} dp{dp}) | rollout {' + '.join(tiers)}"


def _rollout_partitions(gpus: int, tps: list[int]) -> list[list[int]]:
    """Instance tp lists covering exactly ``gpus`` GPUs: one tp, or two tiers of half each."""
    out = [[t] * (gpus // t) for t in tps if gpus % t == 0]
    half = gpus // 2
    if gpus % 2 == 0 and half > 0:
        for i, a in enumerate(tps):
            for b in tps[i + 1:]:
                if half % a == 0 and half % b == 0:
                    out.append([a] * (half // a) + [b] * (half // b))
    return out


def enumerate_layouts(total_gpus: int, *, n_blocks: int, n_heads: int,
                      n_kv_heads: int) -> Layouts:
    """Every layout of ``total_gpus`` GPUs for a model with these block and head counts.
    Raises ValueError naming ``total_gpus`` outside [2, :data:`MAX_TOTAL_GPUS`]."""
    if isinstance(total_gpus, bool) or not isinstance(total_gpus, (int, np.integer)) or not (
            2 <= total_gpus <= MAX_TOTAL_GPUS):
        raise ValueError(f"total_gpus must be an integer in [2, {MAX_TOTAL_GPUS}] (one GPU "
                         f"cannot both train and roll out), got {total_gpus!r}")
    total_gpus = int(total_gpus)
    tps = [t for t in TP_CHOICES if n_heads % t == 0 and n_kv_heads % t == 0]
    step = max(1, total_gpus // 8)
    rows, kinds = [], []
    for train in range(step, total_gpus, step):
        partitions = _rollout_partitions(total_gpus - train, tps)
        for tp in tps:
            for pp in TRAIN_PP_CHOICES:
                if train % (tp * pp) or pp > n_blocks:
                    continue
                for part in partitions:
                    rows.append((train, tp, pp, train // (tp * pp)))
                    kinds.append([TP_CHOICES.index(t) for t in part])
    if not rows:
        raise ValueError(f"no layout of {total_gpus} GPUs suits this model")
    slots = max(len(k) for k in kinds)
    kind = np.full((len(kinds), slots), -1, np.int32)
    for i, k in enumerate(kinds):
        kind[i, :len(k)] = k
    cols = np.asarray(rows, np.int32)
    return Layouts(train_gpus=cols[:, 0], train_tp=cols[:, 1], train_pp=cols[:, 2],
                   train_dp=cols[:, 3], rollout_kind=kind, total_gpus=np.int32(total_gpus))


def layout_index(layouts: Layouts, *, train_gpus: int, train_tp: int, train_pp: int = 1,
                 rollout_tps: tuple[int, ...] | None = None) -> int:
    """The index of the layout with these training figures and, if given, exactly these
    rollout instance tps (any order). Raises ValueError when there is none."""
    kinds = np.asarray(layouts.rollout_kind)
    match = ((np.asarray(layouts.train_gpus) == train_gpus)
             & (np.asarray(layouts.train_tp) == train_tp)
             & (np.asarray(layouts.train_pp) == train_pp))
    if rollout_tps is not None:
        want = [sum(1 for t in rollout_tps if t == tp) for tp in TP_CHOICES]
        if sum(want) == len(rollout_tps):  # (a tp outside TP_CHOICES matches no layout)
            match &= np.all(np.stack([(kinds == i).sum(-1) for i in range(len(TP_CHOICES))],
                                     -1) == want, axis=-1)
        else:
            match[:] = False
    hits = np.flatnonzero(match)
    if hits.size:
        return int(hits[0])
    raise ValueError(f"no layout with train_gpus={train_gpus}, train_tp={train_tp}, "
                     f"train_pp={train_pp}, rollout_tps={rollout_tps}")


__all__ = ["MAX_TOTAL_GPUS", "TRAIN_PP_CHOICES", "Layouts", "enumerate_layouts", "layout_index"]
