"""Bytes per GPU of one tenant's plan: weights, gradients, optimizer state, activations, logits,
KV cache and overhead. Pure functions of arrays (one tenant; ``vmap`` for more).

Equations and sources (docs/physics.md has the derivations):
- Weights ``sum_l params_l * bytes(fmt_l) / (tp * pp)``, and ``/ dp`` under ZeRO-3
  (Rajbhandari et al. 2020, "ZeRO", §5; Shoeybi et al. 2019, Megatron-LM, for tp).
- Gradients in at least 16 bits (``formats.GRADIENT_BYTES``), ``/ dp`` from ZeRO-2.
- Optimizer: mixed-precision AdamW keeps FP32 master weights and two FP32 moments, 12 bytes per
  parameter (ZeRO §3, "K = 12"); no master copy when the weights are FP32 already.
  PyTorch AdamW on low-precision parameters keeps its moments in the parameter dtype.
  ``/ dp`` from ZeRO-1.
- Activations: what each op saves for backward, per token (architecture.py derives it per
  sub-layer for SwiGLU/GQA/MoE blocks with flash attention, after Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", §4, whose GPT block saves
  ``34 s b h`` bytes); divided by ``tp`` (sequence parallelism, §4.2.2); under 1F1B the first
  pipeline stage holds ``min(pp, m)`` micro-batches of ``n_blocks / pp`` blocks (§4.2.3).
  Full recomputation keeps only each block's 16-bit input plus one block's working set (§5).
- Logits: 16-bit logits, their FP32 upcast for the loss and the FP32 log-softmax saved for
  backward (transformers ``ForCausalLMLoss``; PyTorch ``cross_entropy``), vocab-parallel under tp.
- KV cache: ``2 * n_blocks * n_kv_heads * head_dim * bytes(kv_fmt) * batch * seq_len``
  (keys and values per block), split over ``tp`` (heads) and ``pp`` (blocks).
- Peak during training, PyTorch semantics (gradients set to None between steps): weights and
  optimizer state are always resident; the activations (with the logits and the output-head
  gradient, computed first) peak at the start of backward, the full gradients at the optimizer
  step, so ``peak = W + O + max(G, A + logits + G_head)``.
- Overhead: the CUDA context outside the caching allocator and the allocator's fragmentation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.optimizer import optimizer_state_bytes
from libratio_jax.physics.rowclasses import row_present, row_sums
from libratio_jax.physics.scenario import TRAIN

# Bytes per logit element at the training peak. At the end of the forward pass the 16-bit logits
# (2), their FP32 upcast (4, transformers ForCausalLMLoss) and the FP32 log-softmax output saved
# for backward (4) are alive; the loss backward briefly adds FP32 gradients. Fitted once to the
# measured H100 peaks (tests/data/measured_h100_pytorch.jsonl, recomputation runs, where
# the logits dominate): 11 bytes, between 10 and the 14 of the worst transient.
LOGITS_TRAIN_BYTES_PER_ELEMENT = 11.0
# Serving keeps one position's logits per sequence: bf16 (2) + fp32 upcast in sampling (4).
LOGITS_SERVE_BYTES_PER_ELEMENT = 6.0
# CUDA context + cuBLAS/NCCL workspaces outside PyTorch's caching allocator: ~0.5 GiB on H100
# (commonly measured with nvidia-smi minus torch.cuda.memory_reserved()).
CUDA_CONTEXT_BYTES = 512 * 2**20
# Caching-allocator fragmentation: reserved / max-allocated on the measured H100 records
# (tests/data/measured_h100_pytorch.jsonl) is 1.03-1.33, median about 1.07.
FRAGMENTATION_FRACTION = 0.07


@struct.dataclass
class MemoryBreakdown:
    """Bytes per GPU (float32 scalars, or arrays under vmap). ``total`` = peak + overhead."""

    weights: jnp.ndarray
    gradients: jnp.ndarray
    optimizer: jnp.ndarray
    activations: jnp.ndarray
    logits: jnp.ndarray
    kv_cache: jnp.ndarray
    overhead: jnp.ndarray
    peak: jnp.ndarray
    total: jnp.ndarray


def _table(x) -> jnp.ndarray:
    return jnp.asarray(x, jnp.float32)


def num_micro_batches(batch, dp, micro_batch):
    """Micro-batches per optimizer step of one data-parallel replica (at least 1)."""
    return jnp.maximum(batch / (dp * jnp.maximum(micro_batch, 1)), 1.0)


def kv_cache_bytes(model: A.ModelSpec, kv_format, batch, seq_len):
    """Whole-model KV cache bytes for ``batch`` sequences of ``seq_len`` tokens."""
    per_token = 2.0 * model.n_blocks * model.n_kv_heads * model.head_dim
    return per_token * _table(F.STORAGE_BYTES)[kv_format] * batch * seq_len


def format_bytes_columns(optimizer):
    """``[F, 4]`` per-format bytes for one tenant's optimizer: storage, gradient, optimizer
    state, activation scale (activation bytes / 2)."""
    storage = _table(F.STORAGE_BYTES)
    return jnp.stack([storage, F.gradient_bytes(storage),
                      optimizer_state_bytes(optimizer, storage),
                      _table(F.ACTIVATION_BYTES) / F.ACT16_BYTES], axis=-1)


def layer_gather_bytes(model: A.ModelSpec, storage):
    """Bytes ZeRO-3 gathers for one layer of each row (one sub-layer of a merged row) in
    formats of ``storage`` bytes per element: its weights and their gradient
    (``formats.gradient_bytes``). Read only where the row is present: its ``params`` may be
    padding otherwise."""
    return model.params / jnp.maximum(model.count, 1.0) * (storage + F.gradient_bytes(storage))


def largest_layer_bytes_of(model: A.ModelSpec, precision, row_weight=None):
    """The largest :func:`layer_gather_bytes` of the rows present (``row_weight`` as
    :func:`tenant_memory`'s), in their formats ``precision``; 0 for none: what ZeRO-3
    gathers at once."""
    storage, = F.select_columns(precision, _STORAGE_ACTIVATION[:, :1])
    return jnp.max(jnp.where(row_present(model.valid, row_weight),
                             layer_gather_bytes(model, storage), 0.0))


# Storage and activation bytes per format, the two columns every row looks up.
_STORAGE_ACTIVATION = np.stack([F.STORAGE_BYTES, F.ACTIVATION_BYTES], axis=-1).astype(np.float32)


def memory_row_terms(model: A.ModelSpec, workload, precision, *, act_precision=None,
                     optimizer_bytes=None, gradient_bytes=None) -> list:
    """The per-row terms :func:`tenant_memory` sums over the rows (shaped like
    ``precision``): weight, gradient and optimizer bytes, the LM head's gradient bytes, the
    activation bytes per token saved inside and outside the blocks, parameters. None depends
    on the plan's scalars (knobs as :func:`tenant_memory`'s)."""
    params = jnp.where(model.valid, model.params, 0.0)
    # Two looked-up columns; gradient and optimizer bytes follow from the storage bytes.
    storage, act_bytes = F.select_columns(precision, _STORAGE_ACTIVATION)
    grad_bytes = F.gradient_bytes(storage)
    if gradient_bytes is not None:
        grad_bytes = jnp.full_like(storage, gradient_bytes)
    opt_bytes = (optimizer_state_bytes(workload.optimizer, storage)
                 if optimizer_bytes is None else optimizer_bytes)
    gemm_act = act_bytes if act_precision is None else _table(F.ACTIVATION_BYTES)[act_precision]
    # A norm keeps its FP32 upcast input (4 bytes) and its normalized output in the residual
    # stream's dtype (the row's format): 4 + 2 = NORM_SAVED_BYTES_PER_ELEMENT at 16 bits.
    is_norm = model.kind == A.NORM
    act_scale = jnp.where(is_norm, (4.0 + act_bytes) / A.NORM_SAVED_BYTES_PER_ELEMENT,
                          gemm_act / F.ACT16_BYTES)
    head = model.valid & (model.kind == A.LM_HEAD)
    in_block = model.block >= 0
    row_act = jnp.where(model.valid, model.act_bytes_per_token, 0.0) * act_scale
    return [params * storage, params * grad_bytes, params * opt_bytes,
            jnp.where(head, params * grad_bytes, 0.0), jnp.where(in_block, row_act, 0.0),
            jnp.where(in_block, 0.0, row_act), params]


def tenant_memory(model: A.ModelSpec, workload, precision, kv_precision, tp, pp, dp,
                  zero_stage, recompute, micro_batch, *, act_precision=None,
                  optimizer_bytes=None, weight_cache_bytes=0.0, gradient_bytes=None,
                  offload_optimizer=False, offload_params=False,
                  row_weight=None, largest_layer_bytes=None,
                  row_totals=None) -> MemoryBreakdown:
    """Per-GPU memory of one tenant. ``precision`` is ``[L]``; the rest are scalars.

    ``dp`` is the data-parallel degree ``gpus / (tp * pp)`` (>= 1). Framework knobs (used by
    :func:`libratio_jax.estimate_memory`; ``evaluate`` leaves the defaults):
    ``act_precision`` the format GEMMs compute and save activations in (autocast; default each
    row's own format; norms keep the residual stream, i.e. the weights' format),
    ``optimizer_bytes`` optimizer-state bytes per parameter (default: the workload's
    optimizer rule), ``weight_cache_bytes`` bytes per parameter of low-precision weight copies
    kept for backward (PyTorch autocast's cast cache), ``gradient_bytes`` bytes per parameter
    of the gradient partitions (DeepSpeed keeps FP32 partitions: 4), ``offload_optimizer`` /
    ``offload_params`` (ZeRO-Offload / ZeRO-Infinity: optimizer state, master weights and
    gradient partitions, respectively the parameters, live in CPU memory).

    Under ZeRO-3 one layer at a time is gathered whole, with its gradient, before the
    reduce-scatter: ``largest layer params x (weight + gradient bytes)`` of working memory
    during forward and backward, counted with the activations (DeepSpeed's
    ``estimate_zero3_model_states_mem_needs`` adds ``4 x largest_layer_params``; the ZeRO
    paper's Fig. 1 counts the partitioned model states only).

    ``row_weight`` (shaped like the rows): how many times each row counts in the sums
    (``physics.rowclasses.row_sum``; the full-resolution class path's format counts),
    None for once. ``largest_layer_bytes``: the largest :func:`layer_gather_bytes` of the
    rows present, if the caller has it (the class path takes it batch-last). ``row_totals``:
    the sums of :func:`memory_row_terms` (same knobs) weighted by ``row_weight``, if the
    caller has them (the class path contracts every module's terms with the counts at once).
    """
    tp = jnp.maximum(tp, 1).astype(jnp.float32)
    pp = jnp.maximum(pp, 1).astype(jnp.float32)
    dp = jnp.maximum(dp, 1).astype(jnp.float32)
    is_train = workload.mode == TRAIN
    model_shard = tp * pp
    weights_total, grads_total, opt_total, grads_head, rows_act, outside_act, params_total = (
        row_sums(memory_row_terms(model, workload, precision, act_precision=act_precision,
                                  optimizer_bytes=optimizer_bytes,
                                  gradient_bytes=gradient_bytes), row_weight)
        if row_totals is None else row_totals)

    # ZeRO-3 gathers one whole layer (and its gradient) at a time.
    if largest_layer_bytes is None:
        largest_layer_bytes = largest_layer_bytes_of(model, precision, row_weight)
    gathered = jnp.where(zero_stage >= 3, largest_layer_bytes / tp, 0.0)
    weights = weights_total / model_shard / jnp.where(zero_stage >= 3, dp, 1.0)
    if offload_params:
        weights = 0.0 * weights
    grads = grads_total / model_shard / jnp.where(zero_stage >= 2, dp, 1.0)
    grads_head = grads_head / model_shard / jnp.where(zero_stage >= 2, dp, 1.0)
    opt = opt_total / model_shard / jnp.where(zero_stage >= 1, dp, 1.0)
    if offload_optimizer:
        opt, grads, grads_head = 0.0 * opt, 0.0 * grads, 0.0 * grads_head
    cache = params_total * weight_cache_bytes / model_shard

    # Activations saved per token: rows (scaled by the format's activation bytes) + block extras.
    blocks_act = rows_act + model.n_blocks * model.block_act_bytes_per_token
    n_blocks = jnp.maximum(model.n_blocks, 1.0)
    m = num_micro_batches(workload.batch, dp, micro_batch)
    inflight = jnp.minimum(pp, m) / pp  # 1F1B: stage 0 holds min(pp, m) micro-batches
    tokens_mb = micro_batch * workload.seq_len
    full = blocks_act * inflight + outside_act
    recomputed = (model.n_blocks * F.ACT16_BYTES * model.hidden * inflight
                  + blocks_act / n_blocks + outside_act)
    act_train = tokens_mb * jnp.where(recompute > 0, recomputed, full) / tp
    act_serve = tokens_mb * (blocks_act / n_blocks) / tp  # one block's transient working set

    batch_replica = workload.batch / dp
    logits_train = tokens_mb * model.vocab * LOGITS_TRAIN_BYTES_PER_ELEMENT / tp
    logits_serve = batch_replica * model.vocab * LOGITS_SERVE_BYTES_PER_ELEMENT / tp
    kv = kv_cache_bytes(model, kv_precision, batch_replica, workload.seq_len) / model_shard

    zero = jnp.float32(0.0)
    grads = jnp.where(is_train, grads, zero)
    opt = jnp.where(is_train, opt, zero)
    activations = jnp.where(is_train, act_train, act_serve)
    logits = jnp.where(is_train, logits_train, logits_serve)
    kv = jnp.where(is_train, zero, kv)
    # The autocast cast cache lives from the forward pass to the backward of each layer.
    activations = activations + jnp.where(is_train, cache, zero) + gathered
    peak_train = weights + opt + jnp.maximum(grads, activations + logits + grads_head)
    peak_serve = weights + kv + activations + logits
    peak = jnp.where(is_train, peak_train, peak_serve)
    overhead = CUDA_CONTEXT_BYTES + FRAGMENTATION_FRACTION * peak
    return MemoryBreakdown(
        weights=weights, gradients=grads, optimizer=opt, activations=activations,
        logits=logits, kv_cache=kv, overhead=overhead, peak=peak, total=peak + overhead,
    )
