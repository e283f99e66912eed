"""``estimate_memory`` and ``estimate_throughput``: the kernel's physics for one model and one
configuration, with the knobs of real frameworks (the second face of the same implementation:
both call :func:`memory.tenant_memory` / :func:`throughput.tenant_step_time`).

    >>> from libratio_jax import estimate_memory
    >>> est = estimate_memory("Llama-3.1-8B", mode="train", batch=1, seq_len=4096)
    >>> round(est.weights / 1e9, 2), round(est.optimizer / 1e9, 2)   # bf16 weights, bf16 AdamW
    (16.06, 32.12)

Framework behaviours modelled (PyTorch semantics):
- ``optimizer="adamw"`` is ``torch.optim.AdamW``: two moments in ``optimizer_state`` (default:
  the parameters' dtype), no master copy. ``"adamw_mixed"`` keeps FP32 master weights and two
  FP32 moments (DeepSpeed / Megatron; 12 bytes/param, ZeRO's K). ``"sgd_momentum"``: one
  momentum buffer; ``"sgd"``: none.
- ``autocast="bf16"`` with FP32 ``weights`` is AMP: GEMMs compute and save activations in
  BF16, the residual stream (norm inputs) stays FP32, and autocast's cast cache keeps a BF16
  copy of every weight until its backward.
- Gradients are in the parameters' dtype and are all alive at the optimizer step; the logits
  are upcast to FP32 for the loss; recomputation keeps block inputs only; serving keeps the
  KV cache and only the last position's logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from libratio_jax.physics import checks
from libratio_jax.physics import formats as F
from libratio_jax.physics.architecture import ModelSpec
from libratio_jax.physics.hardware import gpu_spec
from libratio_jax.physics.memory import tenant_memory
from libratio_jax.physics.optimizer import optimizer_id, optimizer_state_bytes
from libratio_jax.physics.scenario import TRAIN, Workload
from libratio_jax.physics.throughput import tenant_step_time

OFFLOAD = ("none", "optimizer", "optimizer+params")
# The defaults of estimate_memory / estimate_throughput, shared with the CLI.
DEFAULT_BATCH = 1
DEFAULT_SEQ_LEN = 4096
DEFAULT_GPU = "H100-SXM"
_FIELDS = ("weights", "gradients", "optimizer", "activations", "logits", "kv_cache",
           "overhead", "peak", "total")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU. ``peak`` is what the caching allocator peaks at (comparable with
    ``torch.cuda.max_memory_allocated``); ``total = peak + overhead`` (CUDA context and
    fragmentation) is what must fit in HBM. ``activations`` includes the autocast cast cache.
    ``peak`` is not the sum of the parts: in training the gradients peak at the optimizer step,
    the activations and logits at the start of backward."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    kv_cache: float
    overhead: float
    peak: float
    total: float

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _FIELDS}

    def table(self) -> str:
        rows = [f"{k:<12s}{getattr(self, k) / 2**30:>12.3f} GiB" for k in _FIELDS]
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class ThroughputEstimate:
    """Seconds per optimizer step (training) or per decode iteration (serving), tokens/s of
    the whole job, and the model FLOPs utilization against the GPU's dense BF16 peak.

    ``prefill_seconds``: one forward pass over the batch's prompts (``batch`` sequences of
    ``seq_len`` tokens, every position's logits computed, as a transformers forward does),
    and ``prefill_tokens_per_second`` its prompt tokens per second: serving's compute-bound
    phase, where decode (``step_seconds`` when serving) is bandwidth-bound. Both are 0 for
    training."""

    step_seconds: float
    tokens_per_second: float
    mfu: float
    prefill_seconds: float
    prefill_tokens_per_second: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        return (f"{'step':<12s}{self.step_seconds:>12.4f} s\n"
                f"{'tokens/s':<12s}{self.tokens_per_second:>12,.0f}\n"
                f"{'MFU (bf16)':<12s}{100 * self.mfu:>11.1f} %\n"
                f"{'prefill':<12s}{self.prefill_seconds:>12.4f} s\n"
                f"{'prefill tok/s':<14s}{self.prefill_tokens_per_second:>10,.0f}")


def _setup(model, mode, batch, seq_len, weights, optimizer, optimizer_state, autocast,
           gpus, tp, pp, zero_stage, kv_precision, micro_batch):
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_hf_config(model)
    opt_id = optimizer_id(optimizer)
    if mode not in ("train", "serve"):
        raise ValueError(f"mode must be 'train' or 'serve', got {mode!r}")
    batch = checks.positive_int(batch, "batch", checks.MAX_BATCH)
    seq_len = checks.positive_int(seq_len, "seq_len", checks.MAX_SEQ_LEN)
    gpus = checks.positive_int(gpus, "gpus", checks.MAX_GPUS)
    tp = checks.positive_int(tp, "tp", checks.MAX_GPUS)
    pp = checks.positive_int(pp, "pp", int(spec.n_blocks))
    zero_stage = checks.integer(zero_stage, "zero_stage", 0, 3)
    if micro_batch is not None:
        micro_batch = checks.positive_int(micro_batch, "micro_batch", checks.MAX_BATCH)
    if gpus % (tp * pp):
        raise ValueError(f"tp * pp = {tp * pp} must divide gpus = {gpus}")
    if int(spec.n_heads) % tp or int(spec.n_kv_heads) % tp:
        raise ValueError(f"tp = {tp} must divide the attention heads ({int(spec.n_heads)}) "
                         f"and KV heads ({int(spec.n_kv_heads)})")
    w_fmt = F.format_id(weights)
    c_fmt = w_fmt if autocast is None else F.format_id(autocast)
    state_fmt = w_fmt if optimizer_state is None else F.format_id(optimizer_state)
    state = float(F.STORAGE_BYTES[state_fmt])
    storage = float(F.STORAGE_BYTES[w_fmt])
    opt_bytes = float(optimizer_state_bytes(opt_id, storage,
                                            None if optimizer_state is None else state))
    cache = float(F.STORAGE_BYTES[c_fmt]) if F.STORAGE_BYTES[c_fmt] < storage else 0.0
    kv = c_fmt if kv_precision is None else F.format_id(kv_precision)
    dp = gpus // (tp * pp)
    mb = max(1, batch // dp) if micro_batch is None else int(micro_batch)
    work = Workload.make(mode=mode, batch=batch, seq_len=seq_len)
    prec = np.full(spec.capacity, w_fmt, np.int32)
    return spec, work, prec, w_fmt, c_fmt, kv, dp, mb, opt_bytes, cache


def estimate_memory(model: Any, *, mode: str = "train", batch: int = DEFAULT_BATCH,
                    seq_len: int = DEFAULT_SEQ_LEN,
                    weights: str = "bf16", optimizer: str = "adamw",
                    optimizer_state: str | None = None, autocast: str | None = None,
                    recompute: bool = False, gpus: int = 1, tp: int = 1, pp: int = 1,
                    zero_stage: int = 0, kv_precision: str | None = None,
                    micro_batch: int | None = None, offload: str = "none",
                    gradient_dtype: str | None = None) -> MemoryEstimate:
    """Bytes per GPU of training or serving ``model`` (catalog name, config path, dict,
    ``PretrainedConfig`` or ``ModelSpec``). ``batch`` is the global batch (sequences per step,
    or concurrent sequences when serving); the micro-batch defaults to ``batch // dp``.
    ``offload`` moves the optimizer state (and gradient partitions), or also the parameters,
    to CPU memory (DeepSpeed ZeRO-Offload / -Infinity); ``gradient_dtype`` sets the gradient
    partitions' dtype (DeepSpeed keeps them in FP32; default: the weights' dtype)."""
    if offload not in OFFLOAD:
        raise ValueError(f"offload {offload!r} not in {OFFLOAD}")
    rc = int(checks.strict_bool(recompute, "recompute"))
    spec, work, prec, _, c_fmt, kv, dp, mb, opt_bytes, cache = _setup(
        model, mode, batch, seq_len, weights, optimizer, optimizer_state, autocast, gpus, tp,
        pp, zero_stage, kv_precision, micro_batch)
    mem = tenant_memory(spec, work, prec, kv, tp, pp, dp, zero_stage, rc,
                        float(mb), act_precision=None if autocast is None else c_fmt,
                        optimizer_bytes=opt_bytes, weight_cache_bytes=cache,
                        gradient_bytes=None if gradient_dtype is None else float(
                            F.STORAGE_BYTES[F.format_id(gradient_dtype)]),
                        offload_optimizer=offload != "none",
                        offload_params=offload == "optimizer+params")
    return MemoryEstimate(**{k: float(getattr(mem, k)) for k in _FIELDS})


def estimate_throughput(model: Any, *, gpu: str = DEFAULT_GPU, mode: str = "train",
                        batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN,
                        weights: str = "bf16", optimizer: str = "adamw",
                        optimizer_state: str | None = None, autocast: str | None = None,
                        recompute: bool = False, gpus: int = 1, tp: int = 1, pp: int = 1,
                        zero_stage: int = 0, kv_precision: str | None = None,
                        micro_batch: int | None = None) -> ThroughputEstimate:
    """Step time and tokens/s on ``gpus`` GPUs of kind ``gpu`` (same arguments as
    :func:`estimate_memory`). GEMMs run in ``autocast`` (else the weights' format)."""
    rc = int(checks.strict_bool(recompute, "recompute"))
    spec, work, _, _, c_fmt, kv, dp, mb, _, _ = _setup(
        model, mode, batch, seq_len, weights, optimizer, optimizer_state, autocast, gpus, tp,
        pp, zero_stage, kv_precision, micro_batch)
    g = gpu_spec(gpu)
    pool = g.pool_scalars()
    prec = np.full(spec.capacity, c_fmt, np.int32)
    w_fmt = F.format_id(weights)
    storage = float(F.STORAGE_BYTES[w_fmt]) if w_fmt != c_fmt else None
    st = tenant_step_time(spec, work, pool, prec, kv, tp, pp, dp, zero_stage, rc,
                          float(mb), weight_storage_bytes=storage)
    step = float(st.step_seconds)
    tokens = float(st.tokens_per_second)
    train = mode == "train"
    flops_per_token = (6.0 if train else 2.0) * float(spec.active_params)
    mfu = tokens * flops_per_token / (gpus * g.peak_flops[F.CC_BF16])
    prefill_s = prefill_tokens = 0.0
    if not train:  # one forward pass over the prompts
        prompts = work.replace(mode=np.int32(TRAIN))
        prefill = tenant_step_time(spec, prompts, pool, prec, kv, tp, pp, dp, 0, 0,
                                   max(float(work.batch) / dp, 1.0), forward_only=True)
        prefill_s, prefill_tokens = float(prefill.step_seconds), float(prefill.tokens_per_second)
    return ThroughputEstimate(step_seconds=step, tokens_per_second=tokens, mfu=mfu,
                              prefill_seconds=prefill_s, prefill_tokens_per_second=prefill_tokens)
