"""Rollout (generation) on the serving instances of an agentic RL run: what one instance of
tensor parallelism ``tp`` can hold and how fast it prefills and decodes, on our serving physics
(:func:`~libratio_jax.physics.throughput.tenant_step_time`), and the makespan of a batch of
trajectories spread over instances by a scheduler.

The shape of the model is Libra's global planner (NetX-lab/Libra, the code of "Libra:
Efficient Resource Management for Agentic RL Post-Training"; facts in docs/rl_cluster.md):

- KV token capacity of an instance: ``N_max = 0.96 (tp (HBM - context) - weights - 1 GB) /
  s_kv`` with ``s_kv`` the KV bytes per token of the whole model (keys and values of every
  block, :func:`~libratio_jax.physics.memory.kv_cache_bytes`);
- the steady batch of a continuously batched instance: ``clamp(N_max / (mean prompt + mean
  generated / 2), 1, 256)`` sequences;
- prefill is one forward pass over the steady batch's prompts (compute-bound, with the
  quadratic attention term; validated on the measured H100 prefill runs, docs/physics.md), here
  as seconds per prompt token at the mean prompt length; decode is one serving iteration at
  the mean context (bandwidth-bound, reading the weights and the KV cache), computed at one
  sequence and at the steady batch and linear in between (weights read once per step plus
  each sequence's KV: Pope et al. 2022, §2).

An instance running ``c`` trajectories decodes at ``b = min(c, steady batch)`` sequences per
step. A trajectory's latency there is its prefill (prompt and tool outputs), its generated
tokens at ``step(b)`` each, and its tool calls and sandbox start off the GPU; the instance's
busy time is its prefills plus its generated tokens at ``step(b) / b``. It finishes after
``max(busy, longest latency)``: throughput-bound when loaded, latency-bound on the long tail
(one trajectory at a time keeps a GPU under 1% busy while its tools run; the infrastructure
notes).

    >>> from libratio_jax.physics.architecture import ModelSpec
    >>> from libratio_jax.physics.hardware import gpu_spec
    >>> spec = ModelSpec.from_hf_config("Qwen3-8B", block_groups=1)
    >>> hbm = gpu_spec("H100-SXM").hbm_bytes
    >>> [round(float(token_capacity(spec, hbm, tp)) / 1e3) for tp in (1, 8)]  # k tokens
    [440, 4313]
    >>> costs = instance_costs(spec, gpu_spec("H100-SXM").pool_scalars(), [1, 8],
    ...                        1000.0, 8000.0)  # prefill, decode per kind  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.memory import CUDA_CONTEXT_BYTES, kv_cache_bytes
from libratio_jax.physics.scenario import SERVE, TRAIN, Workload
from libratio_jax.physics.throughput import tenant_step_time

TP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)  # Libra: rollout instances of tp in {1, 2, 4, 8}
# Libra's planner: KV token capacity N_max = (tp * HBM - weight bytes - 1 GB) / s_kv * 0.96.
KV_RESERVE_BYTES = 1e9
KV_UTILIZATION = 0.96
# Libra's planner: steady batch clamp(N_max / (mean prompt + mean generated / 2), 1, 256).
MAX_STEADY_BATCH = 256.0
# Schedulers (:func:`assign`): fewest assigned trajectories (FIFO / least-connections), or the
# earliest estimated finish (longest-first when the trajectories come longest first).
LEAST_CONNECTIONS, EARLIEST_FINISH = 0, 1
# A migrating trajectory's KV cache is recomputed below this context, transferred above
# (Libra's C-MLFQ: "below a few thousand tokens, recompute"; 4,096 is our reading).
RECOMPUTE_BELOW_TOKENS = 4096.0


@struct.dataclass
class InstanceCosts:
    """One serving instance kind per entry (shape ``[T]``, one per ``tp`` asked).

    ``usable``: ``tp`` divides the attention and KV heads and the weights fit with room for
    KV. ``token_capacity``: KV tokens it holds. ``batch``: steady concurrent sequences.
    ``prefill_seconds_per_token``: seconds per prompt (or tool-output) token prefilled.
    ``decode_single_seconds`` / ``decode_batch_seconds``: one decode iteration with one
    sequence / with the steady batch (see :func:`decode_step_seconds`)."""

    tp: jnp.ndarray
    usable: jnp.ndarray
    token_capacity: jnp.ndarray
    batch: jnp.ndarray
    prefill_seconds_per_token: jnp.ndarray
    decode_single_seconds: jnp.ndarray
    decode_batch_seconds: jnp.ndarray


def weight_bytes(model: A.ModelSpec, weight_format: int = F.BF16):
    """Bytes of all the model's weights in ``weight_format``."""
    return jnp.sum(jnp.where(model.valid, model.params, 0.0)) * F.STORAGE_BYTES[weight_format]


def token_capacity(model: A.ModelSpec, hbm_bytes, tp, *, weight_format: int = F.BF16,
                   kv_format: int = F.BF16):
    """KV tokens an instance of ``tp`` GPUs with ``hbm_bytes`` each holds (Libra's ``N_max``,
    with our CUDA context per GPU); 0 when the weights do not fit."""
    free = (jnp.asarray(tp, jnp.float32) * (jnp.asarray(hbm_bytes, jnp.float32)
                                            - CUDA_CONTEXT_BYTES)
            - weight_bytes(model, weight_format) - KV_RESERVE_BYTES)
    per_token = kv_cache_bytes(model, kv_format, 1.0, 1.0)
    return jnp.maximum(free, 0.0) * KV_UTILIZATION / per_token


def instance_costs(model: A.ModelSpec, pool, tp, mean_prompt_tokens, mean_generated_tokens,
                   *, weight_format: int = F.BF16, kv_format: int = F.BF16) -> InstanceCosts:
    """Costs of serving instances of tensor parallelism ``tp`` (int array ``[T]``) for
    requests of the given mean prompt and generated lengths (tokens; the prompt includes tool
    outputs). ``pool``: :meth:`GpuSpec.pool_scalars` (with ``hbm_bytes``). Jittable."""
    tp = jnp.asarray(tp, jnp.int32)
    prec = jnp.full(model.capacity, weight_format, jnp.int32)
    prompt = jnp.maximum(jnp.asarray(mean_prompt_tokens, jnp.float32), 1.0)
    context = prompt + 0.5 * jnp.maximum(jnp.asarray(mean_generated_tokens, jnp.float32), 0.0)

    def decode(t, batch):
        return tenant_step_time(model, Workload.arrays(SERVE, batch, context), pool, prec,
                                kv_format, t, 1, 1, 0, 0, batch).step_seconds

    def one(t):
        cap = token_capacity(model, pool["hbm_bytes"], t, weight_format=weight_format,
                             kv_format=kv_format)
        batch = jnp.clip(cap / context, 1.0, MAX_STEADY_BATCH)
        prefill = tenant_step_time(model, Workload.arrays(TRAIN, batch, prompt), pool, prec,
                                   kv_format, t, 1, 1, 0, 0, batch,
                                   forward_only=True).step_seconds
        divides = ((model.n_heads.astype(jnp.int32) % t) == 0) & (
            (model.n_kv_heads.astype(jnp.int32) % t) == 0)
        return InstanceCosts(tp=t, usable=divides & (cap >= 1.0), token_capacity=cap,
                             batch=batch, prefill_seconds_per_token=prefill / (batch * prompt),
                             decode_single_seconds=decode(t, 1.0),
                             decode_batch_seconds=decode(t, batch))

    return jax.vmap(one)(tp)


def decode_step_seconds(costs: InstanceCosts, running):
    """Seconds of one decode iteration with ``running`` sequences (broadcasts with the costs'
    arrays): linear between one sequence and the steady batch, where it saturates."""
    b = jnp.clip(running, 1.0, costs.batch)
    slope = (costs.decode_batch_seconds - costs.decode_single_seconds) / jnp.maximum(
        costs.batch - 1.0, 1e-6)
    return costs.decode_single_seconds + slope * (b - 1.0)


def fits(costs: InstanceCosts, prompt_tokens, generated_tokens):
    """``[N, T]``: the trajectory's tokens fit the instance kind's KV capacity."""
    total = jnp.asarray(prompt_tokens, jnp.float32) + jnp.asarray(generated_tokens, jnp.float32)
    return costs.usable & (total[:, None] <= costs.token_capacity)


def _instance_time(costs, count, prefill_sum, generated_sum, longest_fixed, longest_generated):
    """``max(busy, longest latency)`` of instances from their sums (any matching shapes)."""
    b = jnp.clip(count, 1.0, costs.batch)
    step = decode_step_seconds(costs, count)
    busy = prefill_sum + generated_sum * step / b
    return jnp.maximum(busy, longest_fixed + longest_generated * step)


def assign(costs: InstanceCosts, prompt_tokens, est_generated_tokens, est_wait_seconds,
           fit, order, kind, active, rule):
    """Place trajectories one by one, in ``order`` (``[N]`` indices), on instances ``[I]`` of
    kind ``kind`` (index into the ``[T]`` costs) where ``active`` and ``fit [N, T]``; returns
    the instance of each trajectory, ``[N]`` (-1: it fits no active instance).

    ``rule`` :data:`LEAST_CONNECTIONS`: the fitting instance with the fewest trajectories
    (lowest index first); :data:`EARLIEST_FINISH`: the fitting instance that would finish
    earliest with it, by the scheduler's estimates (``est_*``; the instance's time as in
    :func:`instance_seconds`, its longest latency bounded by the largest prefill-and-wait plus
    the largest generation). With the trajectories longest first this is LPT list scheduling
    (Graham 1969) on instances that slow down as they fill. Jittable; O(N I)."""
    n_inst = kind.shape[0]
    idx = jnp.arange(n_inst)
    per = jax.tree.map(lambda c: c[kind], costs)  # [I]
    prefill = jnp.asarray(prompt_tokens, jnp.float32)[:, None] * costs.prefill_seconds_per_token
    fixed = prefill + jnp.asarray(est_wait_seconds, jnp.float32)[:, None]  # [N, T]
    gen = jnp.asarray(est_generated_tokens, jnp.float32)

    def body(carry, n):
        count, pre, gsum, lfix, lgen = carry
        ok = active & fit[n, kind]
        finish = _instance_time(per, count + 1.0, pre + prefill[n, kind], gsum + gen[n],
                                jnp.maximum(lfix, fixed[n, kind]), jnp.maximum(lgen, gen[n]))
        score = jnp.where(rule == LEAST_CONNECTIONS, count + idx / (n_inst + 1.0), finish)
        s = jnp.argmin(jnp.where(ok, score, jnp.inf))
        placed = jnp.any(ok)
        hit = (idx == s) & placed
        carry = (count + hit, pre + jnp.where(hit, prefill[n, kind], 0.0),
                 gsum + jnp.where(hit, gen[n], 0.0),
                 jnp.where(hit, jnp.maximum(lfix, fixed[n, kind]), lfix),
                 jnp.where(hit, jnp.maximum(lgen, gen[n]), lgen))
        return carry, jnp.where(placed, s, -1).astype(jnp.int32)

    zeros = jnp.zeros(n_inst, jnp.float32)
    _, slot = jax.lax.scan(body, (zeros,) * 5, order)
    return jnp.zeros(order.shape[0], jnp.int32).at[order].set(slot)


def instance_seconds(costs: InstanceCosts, slot, prompt_tokens, generated_tokens,
                     wait_seconds, kind, spread_steps=1.0):
    """Seconds each instance ``[I]`` (of kind ``kind`` into the ``[T]`` costs) takes for the
    trajectories placed on it (``slot [N]`` from :func:`assign`; unplaced ones are dropped):
    ``max(busy, longest latency / spread_steps)`` at its own concurrency, 0 when empty.
    ``spread_steps`` >= 1 lets a trajectory's latency span that many training steps (a
    staleness bound above 1 with partial rollouts).

    The per-trajectory arrays may carry a leading segment axis ``[S, N]``: a trajectory that
    migrates (C-MLFQ, LA-MLFQ) runs segment 0 on one instance, then segment 1 on another...;
    each segment counts in its instance's concurrency and busy time, and its latency includes
    the earlier segments' (a trajectory finishes where its last segment runs). A segment with
    ``slot`` -1 is not run."""
    slot = jnp.asarray(slot)
    if slot.ndim == 1:
        return instance_seconds(costs, slot[None], jnp.asarray(prompt_tokens)[None],
                                jnp.asarray(generated_tokens)[None],
                                jnp.asarray(wait_seconds)[None], kind, spread_steps)
    n_inst = kind.shape[0]
    seg = jnp.where(slot >= 0, slot, n_inst).reshape(-1)  # the unplaced: a dropped segment
    count = jax.ops.segment_sum(jnp.ones_like(seg, jnp.float32), seg, n_inst + 1)[:n_inst]
    per = jax.tree.map(lambda c: c[kind], costs)  # [I]
    step = decode_step_seconds(per, count)
    b = jnp.clip(count, 1.0, per.batch)
    mine = jnp.maximum(slot, 0)  # [S, N]
    prefill = (jnp.asarray(prompt_tokens, jnp.float32)
               * costs.prefill_seconds_per_token[kind[mine]])
    gen = jnp.asarray(generated_tokens, jnp.float32)
    work = jnp.where(slot >= 0, prefill + gen * (step / b)[mine], 0.0)
    latency = jnp.where(slot >= 0, prefill + gen * step[mine]
                        + jnp.asarray(wait_seconds, jnp.float32), 0.0)
    latency = jnp.cumsum(latency, axis=0)  # each segment after the earlier ones
    busy = jax.ops.segment_sum(work.reshape(-1), seg, n_inst + 1)[:n_inst]
    longest = jnp.maximum(jax.ops.segment_max(latency.reshape(-1), seg, n_inst + 1)[:n_inst],
                          0.0)
    return jnp.maximum(busy, longest / jnp.maximum(spread_steps, 1.0))


def migration_seconds(model: A.ModelSpec, pool, context_tokens, kv_format: int = F.BF16):
    """``(recompute [N] bool, transfer_seconds [N])`` for trajectories moving to another
    instance with ``context_tokens`` in their KV cache: below
    :data:`RECOMPUTE_BELOW_TOKENS` the new instance recomputes it (a prefill of the context,
    charged there as prompt tokens), else the cache is sent over the network (its bytes at the
    pool's network bandwidth). Libra's C-MLFQ: "below a few thousand tokens, recompute"."""
    context = jnp.asarray(context_tokens, jnp.float32)
    recompute = context < RECOMPUTE_BELOW_TOKENS
    transfer = kv_cache_bytes(model, kv_format, 1.0, context) / pool["network_bytes_per_second"]
    return recompute, jnp.where(recompute, 0.0, transfer)
