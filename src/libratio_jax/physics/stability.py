"""Numerical stability per layer (the "Scoring Module"): a score in (0, 1] per row, a tenant
score and a divergence flag.

Model: a row of kind ``k`` in format ``f`` scores ``exp(-u_f / tol_k)`` where ``u_f`` is the
format's unit roundoff (formats.UNIT_ROUNDOFF; for integer and code-book formats the effective
relative error of a scaled tensor, see ``EFFECTIVE_ROUNDOFF``) and ``tol_k`` the relative
error the layer kind tolerates. Tolerances follow practice:
- embeddings, the output head, normalization and MoE routers stay in BF16/FP32 (NVIDIA
  Transformer Engine keeps them out of FP8; DeepSeek-V3 technical report §3.3.1 keeps the
  embedding, output head, MoE gating, normalization and attention operators in BF16/FP32);
- FFN and projection GEMMs tolerate FP8 with per-tensor or block scaling (Micikevicius et al.
  2022; DeepSeek-V3 §3.3), the attention output projection and MLP down-projection a little
  less (their inputs have outliers: Dettmers et al. 2022, LLM.int8()).
In training, FP16 needs loss scaling to avoid gradient underflow and overflow (Micikevicius et
al. 2018, "Mixed Precision Training", §3.2): a 0.9 factor. Serving tolerates 3x more error (no
gradients accumulate it). The KV cache counts as one more row when serving.

A tenant diverges when any valid row scores below ``DIVERGENCE_THRESHOLD`` (0.25): e.g. an
FP8 embedding or output head in training (exp(-0.0625/0.02) = 0.04). The tenant score is the
geometric mean over valid rows.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.rowclasses import CONTRACTION_PRECISION, row_sums
from libratio_jax.physics.scenario import TRAIN

# Relative error tolerated per kind (training), in KIND_NAMES order.
TOLERANCE = np.array([
    0.02,  # embedding
    0.5,   # attn_qkv
    0.35,  # attn_out
    0.6,   # mlp_in
    0.45,  # mlp_out
    0.01,  # moe_router
    0.6,   # moe_expert_in
    0.45,  # moe_expert_out
    0.02,  # norm
    0.02,  # lm_head
])
KV_CACHE_TOLERANCE = 0.25
SERVE_TOLERANCE_FACTOR = 3.0
FP16_TRAIN_FACTOR = 0.9
DIVERGENCE_THRESHOLD = 0.25

EFFECTIVE_ROUNDOFF = F.EFFECTIVE_ROUNDOFF  # per format (formats.py has its sources)


def _log_score(neg_roundoff, tolerance, serving, fp16, where):
    """The model's log score, ``-u / tol`` (``tol`` 3x larger when serving) plus ``log 0.9``
    for FP16 in training: the one home of the formula, for NumPy tables (``where=np.where``)
    and traced rows (``jnp.where``) alike; arguments broadcast together."""
    inv_tol = 1.0 / (tolerance * where(serving, SERVE_TOLERANCE_FACTOR, 1.0))
    return neg_roundoff * inv_tol + where(fp16 & ~serving, math.log(FP16_TRAIN_FACTOR), 0.0)


# [2 modes (train, serve), NUM_KINDS, NUM_FORMATS] float64 row scores.
STABILITY_TABLE = np.exp(_log_score(
    -EFFECTIVE_ROUNDOFF, TOLERANCE[:, None], np.array([False, True])[:, None, None],
    np.arange(F.NUM_FORMATS) == F.FP16, np.where))
KV_STABILITY = np.exp(_log_score(-EFFECTIVE_ROUNDOFF, KV_CACHE_TOLERANCE, True, False, np.where))
# Its logarithm per format, as the plans' physics reads it (a table: a log per plan was a
# kernel of its own, ~10 ns per full-resolution plan).
_KV_LOG_STABILITY = np.log(KV_STABILITY).astype(np.float32)


def layer_log_stability(model: A.ModelSpec, mode, precision):
    """Log score per row ``[L]`` (``-u_eff / tol``, + log 0.9 for FP16 in training);
    padding rows 0."""
    (neg_u,) = F.select_columns(precision, -np.asarray(EFFECTIVE_ROUNDOFF, np.float32)[:, None])
    logs = _log_score(neg_u, jnp.asarray(TOLERANCE, jnp.float32)[model.kind], mode != TRAIN,
                      precision == F.FP16, jnp.where)
    return jnp.where(model.valid, logs, 0.0)


def layer_stability(model: A.ModelSpec, mode, precision):
    """Score per row ``[L]`` in (0, 1]; padding rows score 1."""
    return jnp.exp(layer_log_stability(model, mode, precision))


def row_stability_table(models: A.ModelSpec, mode, present):
    """``float32[F, M, L]``: :func:`layer_stability` of every row of ``M`` tenants
    (``models [M, L]``, ``mode [M]``) in each of the ``F`` formats; 1 for padding rows and
    for tenants not ``present [M]``. Plan-independent: computed once per call, then
    :func:`rows_stability` picks each row's entry.

    It is written as a product of each row's one-hot (mode, kind) with ``STABILITY_TABLE``
    (exact: one nonzero term per sum) so that XLA computes it as one small kernel; as a
    gather of the table by kind, XLA fused that gather into the consumer and repeated it
    for every row of every plan (fifteenth round, docs/performance.md).

    Example:
        >>> import libratio_jax as lj
        >>> sc = lj.reference_scenario()
        >>> row_stability_table(sc.models, sc.workloads.mode, sc.present).shape
        (12, 4, 399)
    """
    n_kinds = STABILITY_TABLE.shape[1]
    table = np.concatenate([STABILITY_TABLE.reshape(2 * n_kinds, F.NUM_FORMATS),
                            np.ones((1, F.NUM_FORMATS))]).astype(np.float32)
    serving = (jnp.asarray(mode) != TRAIN)[:, None]
    keep = models.valid & jnp.asarray(present)[:, None]
    index = jnp.where(keep, models.kind + jnp.where(serving, n_kinds, 0), 2 * n_kinds)
    onehot = (index[..., None] == jnp.arange(2 * n_kinds + 1)).astype(jnp.float32)
    return jnp.einsum("mlk,kf->fml", onehot, table, precision=CONTRACTION_PRECISION)


def rows_stability(table, precision, keep):
    """``float32[..., M, L]``: each row's entry of ``table [F, M, L]``
    (:func:`row_stability_table`) for its format ``precision [..., M, L]`` (any dtype; a value
    that is not an id in ``[0, F)`` reads format 0, as ``plan.sanitize_precision`` makes
    it), BF16's for the tenants not in ``keep [..., M]``. A chain of selects, vectorized by XLA
    on CPU (formats.select_columns has why)."""
    score = table[0]
    for f in range(1, F.NUM_FORMATS):
        score = jnp.where(precision == f, table[f], score)
    return jnp.where(keep[..., None], score, table[F.BF16])


_BELOW = np.float32(np.log(DIVERGENCE_THRESHOLD))  # log of the divergence threshold


def stability_row_terms(model: A.ModelSpec, mode, precision) -> list:
    """The plan-independent per-row terms :func:`tenant_stability` sums over the rows (shaped
    like ``precision``): log-stability times the row's weight, the weight, and whether the
    row scores below the divergence threshold."""
    logs = layer_log_stability(model, mode, precision)
    weight = jnp.where(model.valid, model.count, 0.0)
    return [logs * weight, weight, jnp.where(model.valid & (logs < _BELOW), 1.0, 0.0)]


def tenant_stability(model: A.ModelSpec, mode, precision, kv_precision, row_weight=None,
                     row_totals=None):
    """``(layer_scores[L], score, diverges)`` for one tenant.

    The score is the geometric mean over valid rows weighted by ``count`` (the sub-layers
    a merged row stands for, times ``row_weight`` if given: ``physics.rowclasses.row_sum``),
    with the KV cache as one more row when serving. ``row_totals``: the sums of
    :func:`stability_row_terms` weighted by ``row_weight``, if the caller has them.
    """
    logs = layer_log_stability(model, mode, precision)
    serving = mode != TRAIN
    kv_log = jnp.where(serving, jnp.asarray(_KV_LOG_STABILITY)[kv_precision], 0.0)
    # Diverges when a row in the plan scores below the threshold: counted rather than a
    # minimum over the rows present, so that with format counts (``row_weight``) it is one
    # more contraction of the counts with a plan-independent term, not a per-plan extremum.
    log_sum, count, rows_below = (
        row_sums(stability_row_terms(model, mode, precision), row_weight)
        if row_totals is None else row_totals)
    log_sum = log_sum + kv_log
    count = count + serving
    score = jnp.exp(log_sum / jnp.maximum(count, 1.0))
    return jnp.exp(logs), score, (rows_below > 0.0) | (kv_log < _BELOW)
