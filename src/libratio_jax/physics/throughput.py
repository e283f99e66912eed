"""Step time and tokens/s of one tenant's plan: a per-row roofline plus communication.

Per row (one sub-layer of the model), per GPU:
``t = max(flops / (tp * peak(fmt) * mfu(fmt)), bytes / (tp * hbm_bandwidth)) / clock
+ launches * t_fixed(fmt)``, summed and divided by ``pp``; the attention core (QK^T and PV,
always BF16 here) is added the same way. Then:
- training: ``passes = 3`` (forward, input and weight gradients; Narayanan et al. 2021, eq. 3:
  ``72 B s l h^2`` = 3 x forward), ``+1`` with full recomputation; pipeline bubble
  ``(pp - 1) / m`` extra (Narayanan et al. 2021 §2.2, 1F1B); tensor-parallel all-reduces, two per
  block per pass (Shoeybi et al. 2019 §3); data-parallel gradient all-reduce of
  ``2 (dp - 1) / dp`` times the gradient bytes (ring all-reduce, Patarasuk & Yuan 2009), 1.5x under
  ZeRO-3 (Rajbhandari et al. 2020 §7.2.2), partly overlapped with backward.
- serving: one decode iteration reads every weight once and the whole KV cache (bandwidth
  bound; Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2), MoE experts touched
  with probability ``1 - (1 - k/E)^tokens``.
- FLOPs: 2 per multiply-add; attention ``4 s h`` per token per block forward for full
  attention (PaLM, Chowdhery et al. 2022, App. B), halved for causal training (flash attention
  skips masked tiles).

Efficiencies are the sustained fractions measured on one H100 SXM at its 700 W cap
(docs/measurements.md): BF16 GEMMs hold 68% of the 989 TFLOP/s datasheet figure, FP8 62% of 1979.
The fixed time per GEMM is fitted to the measured GEMM sizes (BF16 614-649 TFLOP/s at 2048^3 vs
770-830 from 4096^3 up; FP8 542-876 at 2048^3 vs 1314-1468 from 4096^3 up), which makes FP8 pay
only on large GEMMs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.memory import kv_cache_bytes, num_micro_batches
from libratio_jax.physics.rowclasses import row_sums
from libratio_jax.physics.scenario import TRAIN

# Sustained fraction of dense peak per compute class (fp32, tf32, bf16, fp16, fp8, int8, fp4).
# bf16/fp16 0.68 and fp8 0.62 measured (docs/measurements.md); others assumed equal to their nearest
# measured class (tf32 and fp32 like bf16; int8 and fp4 like fp8).
MFU = np.array([0.68, 0.68, 0.68, 0.68, 0.62, 0.62, 0.62])
# Fixed seconds per GEMM launch per compute class, fitted so that t = flops/rate + t0 matches
# the measured H100 GEMM rates at 2048^3..8192^3 (docs/measurements.md and tests/data/
# measured_h100_extra.jsonl: FP8/BF16 0.88-1.35 at 2048^3, 1.69-1.78 from 4096^3 up);
# FP8 pays for its scaling and layout overheads.
GEMM_FIXED_SECONDS = np.array([4e-6, 4e-6, 4e-6, 4e-6, 14e-6, 14e-6, 14e-6])
# Launch + sync cost of a non-GEMM kernel (norm, embedding gather): typical CUDA launch latency.
KERNEL_LAUNCH_SECONDS = 4e-6
# FlashAttention-2 reaches about 50-73% of peak on A100/H100 forward+backward (Dao 2023, §4.1);
# we take it relative to the BF16 MFU above.
ATTENTION_EFFICIENCY = 0.8
# Latency of one NCCL all-reduce of a small message across NVLink (order of 10 µs; NCCL tests).
ALLREDUCE_LATENCY_SECONDS = 10e-6
# Fraction of the data-parallel gradient all-reduce hidden behind backward (bucketed DDP
# overlap; assumption, PyTorch DDP paper, Li et al. 2020, reports partial overlap).
DP_OVERLAP = 0.5
# Training costs outside the GEMM roofline, calibrated once on the measured H100 records
# (tests/data/measured_h100_pytorch.jsonl: PyTorch 2.11 eager + transformers 5.17):
# - memory-bound elementwise kernels (norms with their FP32 upcasts, RoPE, SwiGLU, residual
#   adds, casts, copies) move about this many bytes per byte their block saves for backward,
#   over forward + backward;
ELEMENTWISE_BYTES_PER_SAVED_BYTE = 10.0
# - the loss: 16-bit logits written and read, their FP32 upcast, log-softmax and its gradient
#   (about 30 bytes per logit over forward + backward);
LOSS_BYTES_PER_LOGIT = 30.0
# - the optimizer step reads the weights, gradients and two moments and writes the weights and
#   the moments: ~7 x the weights' bytes for AdamW (14 B/param in BF16, 28 in FP32);
OPTIMIZER_STEP_BYTES_PER_WEIGHT_BYTE = 7.0
# - host time: eager PyTorch issues ~100 kernels per block per pass; tiny batches are bound by
#   the CPU (measured: ~4.3 ms per block per step at 512 tokens, whatever the width). The GPU
#   runs asynchronously, so a step takes the longer of the host and the device time.
HOST_SECONDS_PER_BLOCK_PASS = 1.45e-3


@struct.dataclass
class StepTime:
    """Seconds per training step (or per decode iteration when serving) and tokens/s."""

    step_seconds: jnp.ndarray
    tokens_per_second: jnp.ndarray
    compute_seconds: jnp.ndarray  # roofline time of kernels, bubble and throttling excluded
    kernel_seconds: jnp.ndarray  # kernel time in the step (bubble included): scales with clock
    busy_fraction: jnp.ndarray  # compute_seconds / step_seconds (drives power)


def _t(x):
    return jnp.asarray(x, jnp.float32)


def effective_compute_class(peak_flops):
    """``[F]`` compute class per format on a GPU with ``peak_flops[C]``, falling back to BF16
    where the GPU has no path for the format's class (0 FLOP/s)."""
    cc = jnp.asarray(F.COMPUTE_CLASS)
    return jnp.where(peak_flops[cc] > 0, cc, F.CC_BF16)


def format_speed_columns(peak_flops, clock=1.0):
    """``[F, 2]`` per-format columns on one GPU kind: seconds per FLOP at the sustained rate,
    fixed seconds per GEMM (the columns that depend on the GPU; :func:`format_traffic_columns`
    has the rest)."""
    cc = effective_compute_class(peak_flops)
    rate = peak_flops[cc] * _t(MFU)[cc] * clock
    return jnp.stack([1.0 / rate, _t(GEMM_FIXED_SECONDS)[cc]], axis=-1)


def format_traffic_columns():
    """``[F, 3]`` per-format columns that do not depend on the GPU: activation bytes, cast
    bytes per GEMM input element, storage bytes. (Apart from :func:`format_speed_columns`:
    under ``vmap`` over plans, whose pools differ, only the speed columns are batched, so
    the plan-independent row sums stay contractions.)"""
    return np.stack([F.ACTIVATION_BYTES, F.CAST_BYTES, F.STORAGE_BYTES], axis=-1).astype(np.float32)


def allreduce_seconds(size_bytes, n, bandwidth):
    """Ring all-reduce of ``size_bytes`` over ``n`` ranks: ``2 (n-1)/n * size / bw + latency``
    (Patarasuk & Yuan 2009); zero when ``n == 1``."""
    n = jnp.maximum(n, 1.0)
    t = 2.0 * (n - 1.0) / n * size_bytes / bandwidth + ALLREDUCE_LATENCY_SECONDS
    return jnp.where(n > 1.0, t, 0.0)


class Roofline(NamedTuple):
    """One tenant's plan factors of the per-row roofline (:func:`roofline_factors`): scalars,
    ``[F]`` per format for the last two. :func:`row_roofline` turns them and a row's
    plan-independent terms (:func:`roofline_rows`) into the row's seconds; every operation
    broadcasts, so the factors may also carry trailing axes (a batch of plans, the
    full-resolution class path's batch-last sums)."""

    is_train: jnp.ndarray  # bool
    passes: jnp.ndarray  # training: forward, input and weight gradients (+1 recomputing)
    micro_batches: jnp.ndarray  # per optimizer step of one replica (each reads every weight)
    tokens_replica: jnp.ndarray  # training: tokens per step of one data-parallel replica
    sequences: jnp.ndarray  # serving: concurrent sequences of one replica
    touched: jnp.ndarray  # serving: probability a token touches an expert row's weights
    work: jnp.ndarray  # training: passes x tokens per replica; serving: sequences per replica
    hbm_bytes_per_second: jnp.ndarray
    seconds_per_flop: jnp.ndarray  # [F] at the format's sustained rate on the pool's GPU
    gemm_fixed_seconds: jnp.ndarray  # [F] fixed seconds per GEMM launch


def touched_fraction(k_over_e, sequences):
    """``1 - (1 - k/E) ** sequences``, the chance that an expert serves at least one of
    ``sequences`` sequences when each picks ``k`` of ``E`` experts (``k_over_e`` in
    ``[0, 1]``, ``sequences >= 0``), as ``-expm1(sequences * log1p(-k/E))``: exact where
    the power is close to 1 (``1 - p`` of a rounded ``p`` loses the digits a small fraction
    has), and vectorized, where XLA's CPU code calls a scalar ``pow`` per element (~16 µs
    for 2,048 elements on the 2-core machine, ~4.8 µs this way)."""
    x = jnp.clip(k_over_e, 0.0, 1.0)
    some = x < 1.0
    fraction = -jnp.expm1(sequences * jnp.log1p(-jnp.where(some, x, 0.0)))
    return jnp.where(some, fraction, jnp.where(sequences > 0.0, 1.0, 0.0))


def roofline_factors(workload, pool, dp, recompute, micro_batch, clock=1.0, *,
                     forward_only: bool = False, experts_per_token=0.0,
                     n_experts=0.0) -> Roofline:
    """The plan's factors of one tenant's per-row roofline (see :func:`tenant_step_time`):
    training runs every row ``passes`` times over the replica's tokens and reads its weights
    once per micro-batch per pass; serving (one decode iteration) runs every row once over
    the replica's sequences and reads its weights once (an expert's with probability
    ``1 - (1 - k/E)^sequences``). ``pool`` may hold ``format_speed``, the pool's
    :func:`format_speed_columns` at full clock computed once per pool (a batch's plans
    otherwise recompute them per plan: ~0.3 µs per full-resolution plan on a cluster of two
    pools), used when ``clock`` is the default 1.0."""
    passes = jnp.float32(1.0) if forward_only else 3.0 + (recompute > 0)
    tokens_replica = workload.batch * workload.seq_len / dp
    seqs = workload.batch / dp
    k_over_e = experts_per_token / jnp.maximum(n_experts, 1.0)
    full_clock = isinstance(clock, float) and clock == 1.0
    cols = (pool["format_speed"] if full_clock and "format_speed" in pool
            else format_speed_columns(pool["peak_flops"], clock))
    is_train = workload.mode == TRAIN
    return Roofline(
        is_train=is_train, passes=passes,
        micro_batches=num_micro_batches(workload.batch, dp, micro_batch),
        tokens_replica=tokens_replica, sequences=seqs,
        touched=touched_fraction(k_over_e, seqs),
        work=jnp.where(is_train, passes * tokens_replica, seqs),
        hbm_bytes_per_second=pool["hbm_bytes_per_second"],
        seconds_per_flop=cols[:, 0], gemm_fixed_seconds=cols[:, 1])


def roofline_rows(model: A.ModelSpec, precision) -> dict:
    """The plan-independent per-row terms of the roofline (shaped like ``precision``, or
    ``[C, F]`` for ``formats.FORMAT_AXIS``): FLOPs, weight bytes and activation traffic per
    token, the formats' storage bytes, GEMM launches, kind flags."""
    act_bytes, cast, storage = F.select_columns(precision, format_traffic_columns())
    is_expert = (model.kind == A.MOE_EXPERT_IN) | (model.kind == A.MOE_EXPERT_OUT)
    visits = jnp.where(is_expert, model.experts_per_token, 1.0) * model.count  # inputs/token
    return dict(
        valid=model.valid, is_gemm=model.flops_per_token > 0, is_expert=is_expert,
        flops_per_token=model.flops_per_token,
        storage_bytes=storage, weight_bytes=jnp.where(model.valid, model.params, 0.0) * storage,
        io_bytes_per_token=visits * ((model.in_dim + model.out_dim) * act_bytes
                                     + cast * model.in_dim),
        gemm_instances=model.gemm_instances, count=model.count)


def row_roofline(r: Roofline, rows: dict, seconds_per_flop, gemm_fixed_seconds):
    """``(roofline seconds, launch seconds)`` per row of the plan factors ``r`` and the rows'
    terms ``rows`` (:func:`roofline_rows`), ``seconds_per_flop`` and ``gemm_fixed_seconds``
    each row's entries of ``r``'s per-format columns. Before tensor and pipeline
    parallelism: ``max(flops / rate, bytes / bandwidth)`` and ``launches x t_fixed``."""
    train_reads = r.passes * r.micro_batches
    weight_reads = jnp.where(r.is_train, train_reads, jnp.where(rows["is_expert"], r.touched, 1.0))
    launch_count = jnp.where(r.is_train, train_reads * rows["gemm_instances"], rows["count"])
    traffic = weight_reads * rows["weight_bytes"] + r.work * rows["io_bytes_per_token"]
    roof = jnp.maximum(r.work * rows["flops_per_token"] * seconds_per_flop,
                       traffic / r.hbm_bytes_per_second)
    fixed = jnp.where(rows["is_gemm"], gemm_fixed_seconds, KERNEL_LAUNCH_SECONDS)
    return (jnp.where(rows["valid"], roof, 0.0),
            jnp.where(rows["valid"], launch_count * fixed, 0.0))


def roofline_row_sums(r: Roofline, model: A.ModelSpec, precision, row_weight=None) -> list:
    """``[roofline seconds, launch seconds]`` of :func:`row_roofline` summed over ``model``'s
    rows in the formats ``precision``, each row counted ``row_weight`` times (None: once),
    before tensor and pipeline parallelism: what :func:`tenant_step_time` sums."""
    roof, launches = row_roofline(r, roofline_rows(model, precision), *F.select_columns(
        precision, jnp.stack([r.seconds_per_flop, r.gemm_fixed_seconds], axis=-1)))
    return row_sums([roof, launches], row_weight)


# The launches' sum of row_roofline grouped by launch cost: a GEMM row launches at its
# format's fixed cost (group = its format), any other row at KERNEL_LAUNCH_SECONDS (group
# NUM_FORMATS). A caller that sums weights per group (the class path, native.weighted_sums)
# gets the same sum as row_roofline's, regrouped (tests/test_kernel.py).
LAUNCH_GROUPS = F.NUM_FORMATS + 1


def launch_groups(rows: dict, precision, is_train):
    """Per row (shaped like ``precision``; ``rows`` its :func:`roofline_rows`), its weight in
    the launches' sum, GEMM instances when training (``is_train``) and the row's count when
    serving (0 for an invalid row), and its group: its format for a GEMM row, ``NUM_FORMATS``
    for the others."""
    weight = jnp.where(rows["valid"], jnp.where(is_train, rows["gemm_instances"], rows["count"]),
                       0.0)
    group = jnp.where(rows["is_gemm"], jnp.asarray(precision, jnp.int32), F.NUM_FORMATS)
    return weight, group


def grouped_launch_seconds(r: Roofline, by_group, gemm_fixed_seconds):
    """The launches' seconds of :func:`row_roofline` summed over the rows, from the weights of
    :func:`launch_groups` summed per group (``by_group [..., LAUNCH_GROUPS, n]``) and each
    format's fixed GEMM seconds (``gemm_fixed_seconds [..., F, n]``); ``r``'s scalars
    ``[..., n]``: ``reads x sum_g by_group[g] x fixed[g]``, ``reads`` the passes times the
    micro-batches when training, else 1."""
    # Summed group by group (elementwise: XLA's CPU code runs a reduction over a middle axis
    # as a library call, ~0.1 µs per plan for these 13 products)
    seconds = by_group[..., F.NUM_FORMATS, :] * KERNEL_LAUNCH_SECONDS
    for f in range(F.NUM_FORMATS):
        seconds = seconds + by_group[..., f, :] * gemm_fixed_seconds[..., f, :]
    return jnp.where(r.is_train, r.passes * r.micro_batches, 1.0) * seconds


def step_row_terms(model: A.ModelSpec, precision, *, autocast: bool = False) -> list:
    """The plan-independent per-row terms :func:`tenant_step_time` sums over the rows
    (shaped like ``precision``): gradient bytes, activation bytes per token saved inside the
    blocks, weight bytes, and with ``autocast`` the parameters."""
    valid = model.valid
    storage, = F.select_columns(precision, format_traffic_columns()[:, 2:])
    params = jnp.where(valid, model.params, 0.0)
    return [params * F.gradient_bytes(storage),
            jnp.where(valid & (model.block >= 0), model.act_bytes_per_token, 0.0),
            params * storage] + ([params] if autocast else [])


def tenant_step_time(model: A.ModelSpec, workload, pool, precision, kv_precision, tp, pp, dp,
                     zero_stage, recompute, micro_batch, clock=1.0, *,
                     weight_storage_bytes=None, forward_only: bool = False,
                     row_weight=None, roofline_sums=None, row_totals=None) -> StepTime:
    """Step time of one tenant on one pool of GPUs.

    ``pool`` is a dict of the pool's scalars: ``peak_flops[C]``, ``hbm_bytes_per_second``,
    ``nvlink_bytes_per_second``, ``network_bytes_per_second``, ``gpus_per_node``.
    ``clock`` (0, 1] scales compute rates (thermal throttling). ``weight_storage_bytes``
    (autocast: the master weights' bytes per parameter, e.g. 4 for AMP) makes the optimizer
    step touch those bytes and adds a cast of every weight per micro-batch.
    ``forward_only`` (with a training workload): one forward pass over the batch and no
    optimizer step, i.e. a serving prefill of ``batch`` prompts of ``seq_len`` tokens (see
    :func:`prefill_step_time`). ``row_weight`` (shaped like the rows): how many times each
    row counts in the sums (``physics.rowclasses.row_sum``), None for once. ``roofline_sums``:
    ``(roofline, launch)`` seconds summed over the rows (:func:`row_roofline`, weighted),
    if the caller has them (the full-resolution class path sums them batch-last).
    ``row_totals``: the sums of :func:`step_row_terms` weighted by ``row_weight``, if the
    caller has them (the class path contracts every module's terms with the counts at once).
    """
    tp = jnp.maximum(tp, 1).astype(jnp.float32)
    pp = jnp.maximum(pp, 1).astype(jnp.float32)
    dp = jnp.maximum(dp, 1).astype(jnp.float32)
    gpus = tp * pp * dp
    is_train = workload.mode == TRAIN
    bw = pool["hbm_bytes_per_second"]
    per_node = pool["gpus_per_node"].astype(jnp.float32)
    bw_tp = jnp.where(tp <= per_node, pool["nvlink_bytes_per_second"],
                      pool["network_bytes_per_second"])
    bw_dp = jnp.where(gpus <= per_node, pool["nvlink_bytes_per_second"],
                      pool["network_bytes_per_second"])

    r = roofline_factors(workload, pool, dp, recompute, micro_batch, clock,
                         forward_only=forward_only, experts_per_token=model.experts_per_token,
                         n_experts=model.n_experts)
    bf16_seconds_per_flop = r.seconds_per_flop[F.BF16]
    n_blocks = model.n_blocks
    q_dim = model.n_heads * model.head_dim

    # Per-row roofline with the mode's coefficients (roofline_factors, row_roofline).
    passes, tokens_replica, m, seqs = r.passes, r.tokens_replica, r.micro_batches, r.sequences
    if roofline_sums is None:
        roofline_sums = roofline_row_sums(r, model, precision, row_weight)
    roof_sum, launch_sum = roofline_sums[0] / tp, roofline_sums[1]
    # The plan-independent sums of the rows, as one contraction (rowclasses.row_sums).
    autocast = weight_storage_bytes is not None
    grad_sum, saved_rows, w_rows, *params_total = (
        row_sums(step_row_terms(model, precision, autocast=autocast), row_weight)
        if row_totals is None else row_totals)

    # Attention core: causal training FLOPs 2 s q_dim per token per block per pass; decode
    # reads the whole KV cache and does 4 s q_dim FLOPs per token per block.
    attn_train = (passes * n_blocks * 2.0 * q_dim * workload.seq_len * tokens_replica
                  * bf16_seconds_per_flop / ATTENTION_EFFICIENCY)
    kv_read = kv_cache_bytes(model, kv_precision, seqs, workload.seq_len)
    attn_serve = jnp.maximum(
        n_blocks * 4.0 * q_dim * workload.seq_len * seqs * bf16_seconds_per_flop
        / ATTENTION_EFFICIENCY, kv_read / bw)
    attn = jnp.where(is_train, attn_train, attn_serve) / tp
    core = (roof_sum + attn) / pp
    kernels_once = (roof_sum + launch_sum + attn) / pp
    bubble = jnp.where(is_train, (m + pp - 1.0) / m, 1.0)  # 1F1B (Narayanan et al. 2021 §2.2)
    # Training extras (constants above): elementwise traffic, the loss, the optimizer step.
    saved_per_block = (saved_rows / jnp.maximum(n_blocks, 1.0)
                       + model.block_act_bytes_per_token)
    elementwise = (tokens_replica * n_blocks * saved_per_block
                   * ELEMENTWISE_BYTES_PER_SAVED_BYTE * (passes / 3.0))
    # The loss (training); a forward pass only writes its 16-bit logits.
    loss = tokens_replica * model.vocab * (F.ACT16_BYTES if forward_only
                                           else LOSS_BYTES_PER_LOGIT)
    w_total = w_rows
    cast = 0.0
    if autocast:  # master weights cast every micro-batch
        w_total = params_total[0] * weight_storage_bytes
        cast = m * (w_total + w_rows)
    optimizer_step = 0.0 if forward_only else w_total * OPTIMIZER_STEP_BYTES_PER_WEIGHT_BYTE / (
        jnp.where(zero_stage >= 1, dp, 1.0))  # ZeRO-1+ shards the step over data-parallel ranks
    extras = jnp.where(is_train, (elementwise + loss + cast) / (tp * pp), 0.0)
    # The host issues forward, backward and recomputation (which costs two passes of host
    # time: the checkpoint wrapper re-runs the forward under autograd); the device runs
    # asynchronously, so the larger of the two counts; the optimizer step follows.
    host_passes = 1.0 if forward_only else 3.0 + 2.0 * (recompute > 0)
    host = jnp.where(is_train, (n_blocks / pp) * m * host_passes * HOST_SECONDS_PER_BLOCK_PASS,
                     0.0)
    kernels = jnp.maximum(kernels_once * bubble + extras / bw, host) + jnp.where(
        is_train, optimizer_step / (tp * pp) / bw, 0.0)

    # Communication. Training: per block per micro-batch two all-reduces per pass except the
    # weight-gradient pass (Megatron: 2 forward, 2 backward, 2 more with recomputation);
    # data-parallel gradient all-reduce, partly overlapped; pipeline point-to-point sends.
    mb_act_bytes = micro_batch * workload.seq_len * model.hidden * F.ACT16_BYTES
    n_tp_allreduce = (n_blocks / pp) * m * 2.0 * (1.0 if forward_only else passes - 1.0)
    t_tp_train = n_tp_allreduce * allreduce_seconds(mb_act_bytes, tp, bw_tp)
    t_dp = 0.0 if forward_only else allreduce_seconds(grad_sum / (tp * pp), dp, bw_dp) * (
        jnp.where(zero_stage >= 3, 1.5, 1.0))
    t_pp = jnp.where(pp > 1.0, 2.0 * m * mb_act_bytes / tp / bw_tp, 0.0)
    comm_train = t_tp_train + (1.0 - DP_OVERLAP) * t_dp + t_pp
    # Serving: two small all-reduces per block per decode iteration.
    comm_serve = (n_blocks / pp) * 2.0 * allreduce_seconds(
        seqs * model.hidden * F.ACT16_BYTES, tp, bw_tp)
    step = kernels + jnp.where(is_train, comm_train, comm_serve)
    tokens = jnp.where(is_train, workload.batch * workload.seq_len, workload.batch)
    return StepTime(
        step_seconds=step,
        tokens_per_second=tokens / step,
        compute_seconds=core,
        kernel_seconds=kernels,
        busy_fraction=jnp.clip(core / step, 0.0, 1.0),
    )


def gemm_seconds(m: float, n: float, k: float, fmt: int, peak_flops) -> float:
    """Time of one ``[m, k] x [k, n]`` GEMM in format ``fmt`` on a GPU with ``peak_flops[C]``:
    ``2 m n k / (peak * MFU) + t0`` (the model every row uses)."""
    peak = np.asarray(peak_flops, np.float64)
    cc = int(F.COMPUTE_CLASS[fmt])
    if peak[cc] <= 0:
        cc = F.CC_BF16
    return 2.0 * m * n * k / (peak[cc] * MFU[cc]) + GEMM_FIXED_SECONDS[cc]
