"""Model architectures as padded per-sub-layer tables, built from Hugging Face configs.

:class:`ModelSpec` has one row per parameter-holding sub-layer (embedding; per block the norms,
q/k/v/o projections, q/k norms, gate/up/down or router + expert in/out; final norm; lm_head),
padded to a static capacity ``L`` with ``valid``. Parameter counts are exact: they equal
``sum(p.numel() for p in model.parameters())`` of the transformers model built from the same
config (tests/test_architecture.py checks every shipped config).

Supported ``model_type``: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.physics import checks
from libratio_jax.physics import formats as F

# Row kinds . Order defines ids; append only.
KIND_NAMES: tuple[str, ...] = (
    "embedding",
    "attn_qkv",
    "attn_out",
    "mlp_in",
    "mlp_out",
    "moe_router",
    "moe_expert_in",
    "moe_expert_out",
    "norm",
    "lm_head",
)
NUM_KINDS = len(KIND_NAMES)
(
    EMBEDDING,
    ATTN_QKV,
    ATTN_OUT,
    MLP_IN,
    MLP_OUT,
    MOE_ROUTER,
    MOE_EXPERT_IN,
    MOE_EXPERT_OUT,
    NORM,
    LM_HEAD,
) = range(NUM_KINDS)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")

# Bytes that one RMSNorm saves for backward per input element in the transformers
# implementation: it upcasts its input to FP32 (kept for pow and mul: 4 bytes) and keeps the
# normalized 16-bit value for the weight multiply (2 bytes)
# (transformers LlamaRMSNorm.forward; PyTorch autograd saves mul/pow operands).
NORM_SAVED_BYTES_PER_ELEMENT = 6.0
ACT16 = F.ACT16_BYTES  # bytes of a 16-bit activation element


def _catalog_dir():
    return resources.files("libratio_jax.physics").joinpath("configs")


def catalog_models() -> list[str]:
    """Names of the shipped model configs (``physics/configs/*.json``)."""
    return sorted(p.name[:-5] for p in _catalog_dir().iterdir() if p.name.endswith(".json"))


def _read_json_config(path: str) -> dict:
    """A config.json as a dict; ValueError naming the file when it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a model config must be a JSON object, got "
                         f"{type(d).__name__}")
    return d


def _model_dir_config(path: str) -> dict:
    """The config of a model directory (a downloaded or saved model): through
    ``transformers.AutoConfig`` (local files only, no download) when transformers is
    installed, else its ``config.json`` read directly."""
    try:
        from transformers import AutoConfig
    except ImportError:
        AutoConfig = None  # noqa: N806
    if AutoConfig is None:
        return _read_json_config(os.path.join(path, "config.json"))
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a model directory transformers can read ({e})") from None


def load_config_dict(source: Any) -> dict:
    """A config as a plain dict from a catalog name, a path to a config.json, a model
    directory (read with ``transformers.AutoConfig``, offline), a dict, or a
    ``transformers.PretrainedConfig``."""
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):
        d = source.to_dict()
        # transformers v5 may nest text configs; PretrainedConfig.to_dict is flat for these.
        return d
    if isinstance(source, (str, os.PathLike)):
        s = str(source)
        names = catalog_models()
        lower = {n.lower(): n for n in names}
        if s.lower() in lower:
            text = _catalog_dir().joinpath(lower[s.lower()] + ".json").read_text()
            return json.loads(text)
        if os.path.isdir(s):
            return _model_dir_config(s)
        if os.path.isfile(s):
            return _read_json_config(s)
        raise ValueError(
            f"model {s!r} is neither a catalog model ({', '.join(names)}) nor a config.json path"
        )
    raise ValueError(f"cannot build a ModelSpec from {type(source).__name__}")


@struct.dataclass
class ModelSpec:
    """One model as a padded table of sub-layer rows. Arrays have shape ``[L]``; scalars ``[]``.

    Row fields:
        kind: int32, index into :data:`KIND_NAMES`.
        params: float32, parameters stored in this row (0 for an lm_head tied to the embedding).
        flops_per_token: float32, forward matmul FLOPs per token (2 per multiply-add; MoE expert
            rows count only the ``experts_per_token`` experts a token visits).
        in_dim, out_dim: float32, GEMM input/output features of one instance of the row.
        gemm_instances: float32, separate GEMMs the row launches (``n_experts`` for expert rows).
        act_bytes_per_token: float32, bytes this row saves for backward per token at 16-bit
            activations (scaled by the activation bytes of the row's format).
        block: int32, transformer block index (-1 outside blocks); for a merged row, the first.
        count: float32, identical sub-layers the row stands for (1, or the blocks merged by
            ``block_groups``); ``params``, ``flops_per_token``, ``gemm_instances`` and
            ``act_bytes_per_token`` are totals over them.
        valid: bool, False on padding rows.
    Scalars: n_blocks, hidden, n_heads, n_kv_heads, head_dim, vocab, n_experts,
        experts_per_token, block_act_bytes_per_token (16-bit bytes
        per token per block saved by ops that are not rows: attention core, SwiGLU elementwise),
        block_rows (rows per block), n_rows.

    Example:
        >>> spec = ModelSpec.from_hf_config("tiny-llama")
        >>> int(spec.total_params) == int(np.sum(np.asarray(spec.params, np.float64)))
        True
    """

    kind: jnp.ndarray
    params: jnp.ndarray
    flops_per_token: jnp.ndarray
    in_dim: jnp.ndarray
    out_dim: jnp.ndarray
    gemm_instances: jnp.ndarray
    act_bytes_per_token: jnp.ndarray
    block: jnp.ndarray
    count: jnp.ndarray
    valid: jnp.ndarray
    n_blocks: jnp.ndarray
    hidden: jnp.ndarray
    n_heads: jnp.ndarray
    n_kv_heads: jnp.ndarray
    head_dim: jnp.ndarray
    vocab: jnp.ndarray
    n_experts: jnp.ndarray
    experts_per_token: jnp.ndarray
    block_act_bytes_per_token: jnp.ndarray
    n_rows: jnp.ndarray

    @property
    def capacity(self) -> int:
        return int(self.kind.shape[-1])

    @property
    def total_params(self):
        """Exact parameter count (an int; an int64 array for stacked specs). Host-side only:
        row counts are exact in float32, their sum is taken in float64."""
        p = np.where(np.asarray(self.valid), np.asarray(self.params, np.float64), 0.0)
        return _as_int(p.sum(-1))

    @property
    def active_params(self):
        """Parameters a token uses (MoE: only ``experts_per_token`` of ``n_experts``)."""
        p = np.where(np.asarray(self.valid), np.asarray(self.params, np.float64), 0.0)
        kind = np.asarray(self.kind)
        expert = (kind == MOE_EXPERT_IN) | (kind == MOE_EXPERT_OUT)
        e = np.asarray(self.n_experts, np.float64)[..., None]
        k = np.asarray(self.experts_per_token, np.float64)[..., None]
        frac = np.where(expert & (e > 0), k / np.maximum(e, 1.0), 1.0)
        return _as_int(np.round((p * frac).sum(-1)))

    @classmethod
    def from_hf_config(cls, source: Any, *, capacity: int | None = None,
                       block_groups: int | None = None) -> ModelSpec:
        """Build from a catalog name, a config.json path, a dict or a ``PretrainedConfig``.

        Args:
            source: the config.
            capacity: pad the rows to this many (default: exactly the model's rows).
            block_groups: merge the blocks into this many contiguous segments, one row per
                sub-layer per segment (default: one row per sub-layer per block). The physics
                are identical for plans that give merged rows one format; evaluation is faster.
        Raises:
            ValueError: unsupported ``model_type`` or capacity smaller than the model's rows.
        """
        rows, scalars = config_rows(source, block_groups)
        n = len(rows)
        cap = n if capacity is None else int(capacity)
        if cap < n:
            raise ValueError(f"model has {n} sub-layer rows, more than capacity={cap}")
        return pack_rows(rows, scalars, cap)

    def row_names(self) -> list[str]:
        """Readable name per valid row, e.g. ``block3.mlp_in``."""
        kinds = np.asarray(self.kind)
        blocks = np.asarray(self.block)
        out = []
        for i in range(int(self.n_rows)):
            k = KIND_NAMES[int(kinds[i])]
            out.append(k if blocks[i] < 0 else f"block{int(blocks[i])}.{k}")
        return out


# The fields of ``ModelSpec`` that hold one value per row (``[..., L]``); the others are per
# model.
ROW_FIELDS = ("kind", "params", "flops_per_token", "in_dim", "out_dim", "gemm_instances",
              "act_bytes_per_token", "block", "count", "valid")


def _get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


# Limits on config sizes (well above every published model: Llama-3.1-405B has 126 blocks,
# hidden 16,384, 128 heads; vocabularies stay under 300 k): a config beyond them is an input
# error, not something to allocate for.
MAX_BLOCKS = 1024
MAX_WIDTH = 1 << 20
MAX_HEADS = 4096
MAX_VOCAB = 1 << 22
MAX_EXPERTS = 4096


def _int_field(cfg: dict, name: str, lo: int, hi: int, default: Any = None) -> int:
    """``cfg[name]`` as an int in ``[lo, hi]``; ValueError naming the field otherwise."""
    v = cfg.get(name)
    if v is None:
        if default is None:
            raise ValueError(f"config: {name} is missing")
        v = default
    return checks.integer(v, f"config: {name}", lo, hi)


def _bool_field(cfg: dict, name: str, default: bool = False) -> bool:
    v = cfg.get(name)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"config: {name} must be true or false, got {v!r}")
    return bool(v)


def _build_rows(cfg: dict):
    """Rows as tuples (kind, params, flops_per_token, in, out, instances, act_bytes, block,
    count). Raises ValueError naming the config field that is missing, of the wrong type or
    out of its range (see the ``MAX_*`` limits)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"a model config must be a mapping, got {type(cfg).__name__}")
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {mtype!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    h = _int_field(cfg, "hidden_size", 1, MAX_WIDTH)
    n_blocks = _int_field(cfg, "num_hidden_layers", 1, MAX_BLOCKS)
    n_heads = _int_field(cfg, "num_attention_heads", 1, MAX_HEADS)
    n_kv = _int_field(cfg, "num_key_value_heads", 1, n_heads, default=n_heads)
    if n_heads % n_kv:
        raise ValueError(f"config: num_key_value_heads = {n_kv} must divide "
                         f"num_attention_heads = {n_heads}")
    if cfg.get("head_dim") is None and h % n_heads:
        raise ValueError(f"config: num_attention_heads = {n_heads} must divide hidden_size = "
                         f"{h} (or give head_dim)")
    head_dim = _int_field(cfg, "head_dim", 1, MAX_WIDTH, default=h // n_heads)
    vocab = _int_field(cfg, "vocab_size", 1, MAX_VOCAB)
    inter = _int_field(cfg, "intermediate_size", 1, MAX_WIDTH)
    tied = _bool_field(cfg, "tie_word_embeddings")
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim

    # Biases: qwen2 has q/k/v biases and no o bias (transformers Qwen2Attention);
    # llama/qwen3 follow `attention_bias` for all four; `mlp_bias` for llama's MLP.
    if mtype == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = _bool_field(cfg, "attention_bias")
    mlp_bias = _bool_field(cfg, "mlp_bias") if mtype == "llama" else False
    qk_norm = mtype in ("qwen3", "qwen3_moe")

    experts_key = "num_local_experts" if cfg.get("num_experts") is None else "num_experts"
    n_experts = _int_field(cfg, experts_key, 0, MAX_EXPERTS, default=0)
    k_experts = _int_field(cfg, "num_experts_per_tok", 0, max(n_experts, 0), default=0)
    if mtype in ("mixtral", "qwen3_moe") and not (n_experts >= 1 and k_experts >= 1):
        raise ValueError(f"config: a {mtype} model needs num_experts >= 1 and "
                         "num_experts_per_tok >= 1")
    moe_inter = _int_field(cfg, "moe_intermediate_size", 1, MAX_WIDTH, default=inter)
    sparse_step = _int_field(cfg, "decoder_sparse_step", 1, MAX_BLOCKS, default=1)
    mlp_only_raw = _get(cfg, "mlp_only_layers", default=[]) or []
    if not isinstance(mlp_only_raw, (list, tuple)):
        raise ValueError(f"config: mlp_only_layers must be a list, got {mlp_only_raw!r}")
    mlp_only = set(mlp_only_raw)

    def is_moe(b: int) -> bool:
        if mtype == "mixtral":
            return True
        if mtype == "qwen3_moe":
            return n_experts > 0 and b not in mlp_only and (b + 1) % sparse_step == 0
        return False

    rows = []
    # Embedding: a gather, no FLOPs; saves only indices for backward.
    rows.append((EMBEDDING, vocab * h, 0.0, 1, h, 1, 0.0, -1))
    norm_act = NORM_SAVED_BYTES_PER_ELEMENT
    block_extra = 0.0
    for b in range(n_blocks):
        rows.append((NORM, h, 0.0, h, h, 1, norm_act * h, b))
        # q/k/v share one saved input (the norm output), attributed to q.
        rows.append((ATTN_QKV, h * q_dim + q_dim * qkv_bias, 2.0 * h * q_dim, h, q_dim, 1,
                     ACT16 * h, b))
        rows.append((ATTN_QKV, h * kv_dim + kv_dim * qkv_bias, 2.0 * h * kv_dim, h, kv_dim, 1,
                     0.0, b))
        rows.append((ATTN_QKV, h * kv_dim + kv_dim * qkv_bias, 2.0 * h * kv_dim, h, kv_dim, 1,
                     0.0, b))
        if qk_norm:
            rows.append((NORM, head_dim, 0.0, head_dim, head_dim, 1, norm_act * q_dim, b))
            rows.append((NORM, head_dim, 0.0, head_dim, head_dim, 1, norm_act * kv_dim, b))
        rows.append((ATTN_OUT, q_dim * h + h * o_bias, 2.0 * q_dim * h, q_dim, h, 1,
                     ACT16 * q_dim, b))
        rows.append((NORM, h, 0.0, h, h, 1, norm_act * h, b))
        # Attention core (sdpa / flash): keeps q and k after RoPE, v, its output and the FP32
        # logsumexp per head (Dao 2023, FlashAttention-2 §3.1); transformers then makes the
        # output contiguous (transpose(1, 2).contiguous()), a second copy that o_proj keeps.
        attn_core = ACT16 * (2 * q_dim + 2 * kv_dim) + 4.0 * n_heads
        if is_moe(b):
            e, k, i = n_experts, k_experts, moe_inter
            # Router: linear h -> E without bias; keeps FP32 routing probabilities.
            rows.append((MOE_ROUTER, h * e, 2.0 * h * e, h, e, 1, ACT16 * h + 4.0 * e, b))
            # Experts: gate and up (h -> i), down (i -> h); each token visits k experts, whose
            # inputs are dispatched copies (k * h saved), down keeps its k * i inputs.
            rows.append((MOE_EXPERT_IN, e * h * i, 2.0 * k * h * i, h, i, e, ACT16 * k * h, b))
            rows.append((MOE_EXPERT_IN, e * h * i, 2.0 * k * h * i, h, i, e, 0.0, b))
            rows.append((MOE_EXPERT_OUT, e * i * h, 2.0 * k * i * h, i, h, e,
                         ACT16 * k * i, b))
            # SwiGLU elementwise per visited expert (silu input, silu output, up output) and the
            # routing-weight multiply of each expert output.
            elementwise = ACT16 * (3 * k * i + k * h)
        else:
            rows.append((MLP_IN, h * inter + inter * mlp_bias, 2.0 * h * inter, h, inter, 1,
                         ACT16 * h, b))
            rows.append((MLP_IN, h * inter + inter * mlp_bias, 2.0 * h * inter, h, inter, 1,
                         0.0, b))
            rows.append((MLP_OUT, inter * h + h * mlp_bias, 2.0 * inter * h, inter, h, 1,
                         ACT16 * inter, b))
            # SwiGLU: silu saves the gate output, the product saves silu(gate) and up.
            elementwise = ACT16 * 3 * inter
        block_extra = attn_core + elementwise  # identical for every block of one kind
    rows.append((NORM, h, 0.0, h, h, 1, norm_act * h, -1))
    rows.append((LM_HEAD, 0 if tied else vocab * h, 2.0 * h * vocab, h, vocab, 1, ACT16 * h, -1))

    rows = [r + (1,) for r in rows]
    total = sum(r[1] for r in rows)
    if n_experts and k_experts:
        expert_params = sum(r[1] for r in rows if r[0] in (MOE_EXPERT_IN, MOE_EXPERT_OUT))
        active = total - expert_params + expert_params * k_experts // n_experts
    else:
        active = total
    scalars = dict(
        n_blocks=n_blocks, hidden=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab=vocab, n_experts=n_experts, experts_per_token=k_experts, total_params=total,
        active_params=active, block_act_bytes_per_token=block_extra, n_rows=len(rows),
    )
    return rows, scalars


def config_rows(source: Any, block_groups: int | None = None):
    """:func:`build_rows` of any config source, with a ValueError that names the source (the
    file, for a path) and the field."""
    cfg = load_config_dict(source)
    try:
        return build_rows(cfg, block_groups)
    except ValueError as e:
        if isinstance(source, (str, os.PathLike)) and str(source) not in catalog_models():
            raise ValueError(f"{source}: {e}") from None
        raise


def build_rows(cfg: dict, block_groups: int | None = None):
    """Rows and scalars of a config, with blocks optionally merged into ``block_groups``
    contiguous segments (consecutive blocks with the same row layout are merged)."""
    rows, scalars = _build_rows(cfg)
    n_blocks = scalars["n_blocks"]
    if block_groups is not None and (isinstance(block_groups, bool) or not isinstance(
            block_groups, (int, np.integer)) or block_groups < 1):
        raise ValueError(f"block_groups must be a positive integer, got {block_groups!r}")
    if block_groups is None or int(block_groups) >= n_blocks:
        return rows, scalars
    segment = np.zeros(n_blocks, np.int64)
    for i, seg in enumerate(np.array_split(np.arange(n_blocks), int(block_groups))):
        segment[seg] = i
    by_block: dict[int, list] = {}
    for r in rows:
        by_block.setdefault(int(r[7]), []).append(r)
    layout = {b: tuple((r[0], r[3], r[4], r[5]) for r in rs) for b, rs in by_block.items()}
    merged = list(by_block.get(-1, [])[:1])  # embedding first
    run: list[int] = []

    def flush():
        if not run:
            return
        for parts in zip(*(by_block[b] for b in run), strict=True):
            k, _, _, i, o, inst, _, _, _ = parts[0]
            merged.append((k, sum(p[1] for p in parts), sum(p[2] for p in parts), i, o,
                           sum(p[5] for p in parts), sum(p[6] for p in parts), run[0],
                           sum(p[8] for p in parts)))
        run.clear()

    for b in range(n_blocks):
        if run and (segment[b] != segment[run[0]] or layout[b] != layout[run[0]]):
            flush()
        run.append(b)
    flush()
    merged += by_block.get(-1, [])[1:]  # final norm, lm_head
    return merged, {**scalars, "n_rows": len(merged)}


def pack_rows(rows, scalars, cap: int) -> ModelSpec:
    """A :class:`ModelSpec` of ``rows`` padded to ``cap`` (device arrays)."""
    return jax.device_put(pack_rows_host(rows, scalars, cap))


def pack_rows_host(rows, scalars, cap: int) -> ModelSpec:
    """:func:`pack_rows` with NumPy leaves (for building many scenarios on the host)."""
    n = len(rows)
    a = np.zeros((cap, 9), np.float64)
    a[:n] = np.array(rows, np.float64)
    block = np.full(cap, -1, np.int32)
    block[:n] = a[:n, 7].astype(np.int32)
    kind = np.full(cap, NORM, np.int32)
    kind[:n] = a[:n, 0].astype(np.int32)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return ModelSpec(
        kind=kind,
        params=f32(a[:, 1]),
        flops_per_token=f32(a[:, 2]),
        in_dim=f32(np.where(np.arange(cap) < n, a[:, 3], 1.0)),
        out_dim=f32(np.where(np.arange(cap) < n, a[:, 4], 1.0)),
        gemm_instances=f32(a[:, 5]),
        act_bytes_per_token=f32(a[:, 6]),
        block=block,
        count=f32(a[:, 8]),
        valid=np.arange(cap) < n,
        n_blocks=f32(scalars["n_blocks"]),
        hidden=f32(scalars["hidden"]),
        n_heads=f32(scalars["n_heads"]),
        n_kv_heads=f32(scalars["n_kv_heads"]),
        head_dim=f32(scalars["head_dim"]),
        vocab=f32(scalars["vocab"]),
        n_experts=f32(scalars["n_experts"]),
        experts_per_token=f32(scalars["experts_per_token"]),
        block_act_bytes_per_token=f32(scalars["block_act_bytes_per_token"]),
        n_rows=np.asarray(np.int32(n)),
    )


def _as_int(x):
    x = np.asarray(np.round(x), np.int64)
    return int(x) if x.ndim == 0 else x


def exact_param_counts(source: Any) -> tuple[int, int]:
    """``(total, active)`` parameter counts as exact Python ints (no float rounding)."""
    _, scalars = _build_rows(load_config_dict(source))
    return int(scalars["total_params"]), int(scalars["active_params"])
