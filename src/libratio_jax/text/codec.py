"""Plans as JSON text: the schema, readable renderings, and a tolerant parser that never raises.

An LLM answers a planning prompt with a JSON plan (:data:`PLAN_JSON_SCHEMA`)::

    {"tenants": [
      {"id": 0, "pool": 0, "gpus": 4, "tp": 2, "pp": 1, "zero_stage": 3, "recompute": true,
       "micro_batch": 1, "kv_precision": "bf16",
       "precision": {"default": "bf16", "mlp": "fp8", "lm_head": "bf16",
                     "blocks": {"0": {"mlp": "bf16"}}, "layers": {"5": "fp32"}}},
      {"id": 1, "gpus": 2, "kv_precision": "fp8", "precision": "bf16"}]}

Every field but ``id`` is optional, with :meth:`~libratio_jax.Plan.from_choices`'s defaults
(``gpus`` 1, ``tp``/``pp``/``micro_batch`` 1, ``zero_stage`` 0, ``recompute`` false, formats
BF16, ``pool`` 0); a present tenant left out of the plan gets no GPUs (the physics then fire
the ``starved`` rule). ``precision`` is one format for every layer or a mapping over the
layer groups of :data:`~libratio_jax.physics.plan.LAYER_GROUPS` with a ``default``, optional
``blocks`` overrides (``{block: {group: format}}``) and ``layers`` overrides
(``{row: format}``), applied in that order.

:func:`parse_plan` is tolerant about presentation and strict about meaning. It accepts
``<think>`` blocks (text up to the last ``</think>`` is ignored), code fences, prose around the
JSON, trailing commas, Python literals (``True``/``None``), any case and ``-``/space
separators in keys and names, common aliases (``num_gpus``, ``tensor_parallel``, ``fp8``,
``BF16``, ``attn``, ``ffn`` ...), numbers written as strings, a bare list of tenants or a
``{"tenants": {"0": {...}}}`` mapping. It takes the *last* plan-shaped JSON value in the
text (an answer follows its reasoning), looking in the code fences first: the last plan in a
fenced block wins over one outside any fence. Unknown fields, unknown formats, tenants not in the
scenario, duplicates and plans that break the scenario's rules (``tp`` must divide the heads,
``tp * pp`` the GPUs, a pool's size, ... see :func:`~libratio_jax.validate_plan`) make the
plan invalid, with a reason. It never raises, whatever the input.

Parse stages (:class:`ParsedPlan.stage`): ``NO_JSON`` (0) no JSON value found, ``NOT_A_PLAN``
(1) JSON that is not a plan of this scenario, ``INVALID`` (2) a plan that breaks the
scenario's rules, ``VALID`` (3).

Example:
    >>> from libratio_jax.scenarios import preset
    >>> sc = preset("small_fleet")
    >>> text = 'Let me think.\\n```json\\n{"Tenants": [{"id": 0, "GPUs": 2, "precision": "BF16"},'\\
    ...        ' {"id": 1, "gpus": 2, "precision": {"MLP": "fp8"}}]}\\n```'
    >>> r = parse_plan(text, sc)
    >>> r.valid, r.plan.gpus.tolist()[:2]
    (True, [2, 2])
    >>> parse_plan("no plan here", sc).reason
    'no JSON value found'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import jax
import msgspec
import numpy as np
import orjson

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.hardware import GPU_NAMES
from libratio_jax.physics.optimizer import OPTIMIZERS
from libratio_jax.physics.plan import (
    GROUP_ORDER,
    INT_FIELDS,
    INT_LIMIT,
    LAYER_GROUPS,
    LISTED_GPUS,
    Plan,
    PlanParts,
    RuleTables,
    choices_to_arrays,
    expand_parts,
    invalid_plans,
    kind_formats,
    plan_at,
    plan_parts,
    rule_tables,
    validate_plan,
)
from libratio_jax.physics.scenario import MODES

NO_JSON, NOT_A_PLAN, INVALID, VALID = 0, 1, 2, 3
STAGE_NAMES = ("no_json", "not_a_plan", "invalid", "valid")

# The parser's budget per completion: the longest text searched (the tail is kept: answers
# come last), the most JSON candidates decoded, and the longest text a number or a name may
# have, and the brackets scanned for JSON spans (MAX_BRACKETS per completion, the last ones of
# each text first: the span scan is a Python step per bracket, bounded so). Every step is
# linear in the text (no backtracking regular expression, no rescans), so a completion costs
# at most O(MAX_TEXT_CHARS) work whatever it holds.
MAX_TEXT_CHARS = 32_768
MAX_DECODE_ATTEMPTS = 64
MAX_BRACKETS = 2_048  # brackets scanned for JSON spans per completion (the last ones first)
MAX_FENCES = 64  # fenced blocks searched one by one (then the whole text)
MAX_VALUE_CHARS = 64
_FALLBACK_OPENERS = 16  # openers tried back from the last closing bracket (see _plan_values)
MAX_REASON_CHARS = 240

_TENANT_FIELDS = ("gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch",
                  "pool", "precision")
PLAN_JSON_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "libratio_jax plan",
    "type": "object",
    "required": ["tenants"],
    "properties": {"tenants": {"type": "array", "items": {
        "type": "object",
        "required": ["id"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "integer", "minimum": 0, "description": "tenant number"},
            "model": {"type": "string", "description": "optional label, ignored"},
            "pool": {"type": "integer", "minimum": 0, "default": 0},
            "gpus": {"type": "integer", "minimum": 0, "default": 1},
            "tp": {"type": "integer", "minimum": 1, "default": 1},
            "pp": {"type": "integer", "minimum": 1, "default": 1},
            "zero_stage": {"type": "integer", "enum": [0, 1, 2, 3], "default": 0},
            "recompute": {"type": "boolean", "default": False},
            "micro_batch": {"type": "integer", "minimum": 1, "default": 1},
            "kv_precision": {"enum": list(F.FORMAT_NAMES), "default": "bf16"},
            "precision": {"oneOf": [
                {"enum": list(F.FORMAT_NAMES)},
                {"type": "object", "properties": {
                    "default": {"enum": list(F.FORMAT_NAMES)},
                    **{g: {"enum": list(F.FORMAT_NAMES)} for g in LAYER_GROUPS},
                    "blocks": {"type": "object", "additionalProperties": {"type": "object"}},
                    "layers": {"type": "object",
                               "additionalProperties": {"enum": list(F.FORMAT_NAMES)}}},
                 "additionalProperties": False}]},
        }}}},
}

# Aliases (after lower-casing and turning spaces and '-' into '_').
_FIELD_ALIASES = {
    "gpus": "gpus", "num_gpus": "gpus", "n_gpus": "gpus", "gpu_count": "gpus", "gpu": "gpus",
    "tp": "tp", "tensor_parallel": "tp", "tensor_parallel_size": "tp", "tp_size": "tp",
    "pp": "pp", "pipeline_parallel": "pp", "pipeline_parallel_size": "pp", "pp_size": "pp",
    "zero_stage": "zero_stage", "zero": "zero_stage", "zero_optimization": "zero_stage",
    "recompute": "recompute", "activation_recompute": "recompute",
    "activation_checkpointing": "recompute", "gradient_checkpointing": "recompute",
    "recomputation": "recompute",
    "kv_precision": "kv_precision", "kv_cache": "kv_precision",
    "kv_cache_precision": "kv_precision", "kv_dtype": "kv_precision",
    "kv_format": "kv_precision", "kv_cache_dtype": "kv_precision",
    "micro_batch": "micro_batch", "micro_batch_size": "micro_batch", "microbatch": "micro_batch",
    "pool": "pool", "gpu_pool": "pool", "pool_id": "pool",
    "precision": "precision", "precisions": "precision", "formats": "precision",
    "dtype": "precision", "dtypes": "precision", "layer_precision": "precision",
}
_ID_KEYS = ("id", "tenant", "tenant_id", "index")
_LABEL_KEYS = ("model", "name", "model_name", "note", "notes", "comment")
_GROUP_ALIASES = {
    **{g: g for g in LAYER_GROUPS}, "default": "default",
    "attn": "attention", "self_attn": "attention", "qkv": "attn_qkv", "o_proj": "attn_out",
    "ffn": "mlp", "feed_forward": "mlp", "ff": "mlp", "gate": "router", "moe_gate": "router",
    "embed": "embedding", "embeddings": "embedding", "embed_tokens": "embedding",
    "head": "lm_head", "output": "lm_head", "output_head": "lm_head",
    "norms": "norm", "layernorm": "norm", "layer_norm": "norm", "rmsnorm": "norm",
    "blocks": "blocks", "per_block": "blocks", "layers": "layers", "rows": "layers",
}
_TRUE = {"true", "yes", "on", "1", "full", "enabled"}
_FALSE = {"false", "no", "off", "0", "none", "disabled"}

# Linear-time patterns only: no nested or adjacent overlapping repetitions.
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
_PY_LITERAL = re.compile(r"\b(True|False|None)\b")
_PY_JSON = {"True": "true", "False": "false", "None": "null"}
_INT_TEXT = re.compile(r"[+-]?\d+(?:\.0*)?")
_THINK_START = re.compile(re.escape("<think>"), re.I)
_THINK_END = re.compile(re.escape("</think>"), re.I)
_OPENER = re.compile(r"[{\[]")
_BRACKET = re.compile(r"[{}\[\]]")
# A top-level span with no bracket inside it (``{"a": 1}``, ``[1, 2]``): what the token loop
# of _json_spans would find, in one anchored match. Its alternatives start with different
# characters and it stops at the first bracket outside a string, so a failed match costs at
# most the text the token loop reads next (linear).
_STRING = r'"(?:[^"\\]|\\.)*'  # a JSON string, up to its closing quote (not included)
_PLAIN = r'[^{}\[\]"]'  # a character that neither opens a string nor is a bracket
_FLAT_SPAN = re.compile(rf'\{{(?:{_STRING}"|{_PLAIN})*\}}|\[(?:{_STRING}"|{_PLAIN})*\]', re.S)
# Inside brackets: skip strings (whole, escapes included) and other text up to the next
# bracket, which group 1 captures ('' at the end). Deterministic: linear.
_INSIDE_BRACKETS = re.compile(rf'(?:{_STRING}"?|{_PLAIN})*([{{}}\[\]]|$)', re.S)
_SEPARATORS = " \t\r\n_-#"


class _PlanError(ValueError):
    """A completion's JSON is not a plan of the scenario (stage ``NOT_A_PLAN``)."""


@dataclasses.dataclass(frozen=True)
class ParsedPlan:
    """What :func:`parse_plan` made of one completion.

    ``plan``: a :class:`~libratio_jax.Plan` of NumPy arrays (no batch axis), ``None`` below
    stage ``INVALID``; ``stage``: one of ``NO_JSON, NOT_A_PLAN, INVALID, VALID``; ``reason``:
    why it is not valid ("" when it is).
    """

    plan: Plan | None
    stage: int
    reason: str

    @property
    def valid(self) -> bool:
        return self.stage == VALID


@dataclasses.dataclass(frozen=True)
class ScenarioTables:
    """Host copies of the scenario fields the parser and renderers read (NumPy, unbatched).

    Build once per scenario with :meth:`of` and reuse: parsing then needs no device transfer.
    """

    scenario: Any  # the scenario with NumPy leaves (validate_plan reads it on the host)
    kinds: np.ndarray
    blocks: np.ndarray
    valid: np.ndarray
    present: np.ndarray
    rules: RuleTables  # what validate_plan's rules read (plans are checked in batches)

    @classmethod
    def of(cls, scenario) -> ScenarioTables:
        if isinstance(scenario, ScenarioTables):
            return scenario
        host = jax.tree.map(np.asarray, scenario)
        if host.present.ndim != 1:
            raise ValueError("parse/render: expected one scenario (no batch axis), got "
                             f"present with shape {host.present.shape}")
        return cls(host, host.models.kind, host.models.block, host.models.valid,
                   host.present.astype(bool), rule_tables(host))


# ---------------------------------------------------------------------------------------------
# Rendering


def render_scenario(scenario, *, names: Sequence[str] | None = None) -> str:
    """The scenario as readable text for a prompt: the GPU pools and every present tenant's
    model (size, shape), workload and throughput target.

    ``names``: model names per tenant slot (default: catalog names from ``model_id``).
    """
    from libratio_jax.physics.architecture import catalog_models

    t = ScenarioTables.of(scenario)
    sc = t.scenario
    c = sc.cluster
    catalog = catalog_models()
    lines = [f"Cluster (inlet air {float(c.inlet_celsius):.1f} °C"
             + (f", power cap {float(c.power_cap_watts) / 1e3:,.0f} kW"
                if np.isfinite(c.power_cap_watts) else "") + "):"]
    for p in np.flatnonzero(c.valid):
        kind = GPU_NAMES[int(c.gpu_kind[p])]
        low = [n for n, cc in (("FP8", F.CC_FP8), ("FP4", F.CC_FP4)) if c.peak_flops[p, cc] > 0]
        lines.append(
            f"  pool {p}: {int(c.gpu_count[p])} x {kind}, {c.hbm_bytes[p] / 2**30:.0f} GiB HBM "
            f"per GPU, {c.peak_flops[p, F.CC_BF16] / 1e12:,.0f} BF16 TFLOP/s dense, "
            f"{'fast ' + '/'.join(low) + ' tensor cores' if low else 'no FP8 tensor cores'}, "
            f"{int(c.gpus_per_node[p])} GPUs per node")
    lines.append("Tenants:")
    m = sc.models
    w = sc.workloads
    for i in np.flatnonzero(t.present):
        mid = int(sc.model_id[i])
        name = (names[i] if names is not None else
                catalog[mid] if 0 <= mid < len(catalog) else "custom model")
        params = float(np.sum(np.where(m.valid[i], m.params[i].astype(np.float64), 0.0)))
        moe = (f", MoE with {int(m.n_experts[i])} experts ({int(m.experts_per_token[i])} per "
               f"token)" if m.n_experts[i] > 0 else "")
        mode = MODES[int(w.mode[i])]
        what = (f"trains with {OPTIMIZERS[int(w.optimizer[i])]}: {int(w.batch[i])} sequences "
                f"of {int(w.seq_len[i])} tokens per step" if mode == "train" else
                f"serves {int(w.batch[i])} concurrent sequences of {int(w.seq_len[i])} tokens "
                f"of context")
        slo = float(w.slo_tokens_per_second[i])
        lines.append(
            f"  tenant {i}: {name}, {params / 1e9:.2f} B parameters, {int(m.n_blocks[i])} "
            f"blocks, {int(m.n_heads[i])} attention heads, {int(m.n_kv_heads[i])} KV heads"
            f"{moe}; {what}; priority {float(w.priority[i]):g}"
            + (f"; target {slo:,.0f} tokens/s" if slo > 0 else ""))
    return "\n".join(lines)


# Disjoint groups the plan renderer uses (each row kind in exactly one group).
_RENDER_GROUPS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("embedding", (A.EMBEDDING,)), ("attn_qkv", (A.ATTN_QKV,)), ("attn_out", (A.ATTN_OUT,)),
    ("mlp_in", (A.MLP_IN, A.MOE_EXPERT_IN)), ("mlp_out", (A.MLP_OUT, A.MOE_EXPERT_OUT)),
    ("router", (A.MOE_ROUTER,)), ("norm", (A.NORM,)), ("lm_head", (A.LM_HEAD,)),
)
_MERGED = (("attention", "attn_qkv", "attn_out"), ("mlp", "mlp_in", "mlp_out"))


def _mode(x: np.ndarray) -> int:
    vals, counts = np.unique(x, return_counts=True)
    return int(vals[np.argmax(counts)])


def _precision_choice(prec: np.ndarray, kinds: np.ndarray, blocks: np.ndarray,
                      valid: np.ndarray) -> dict | str:
    """The shortest readable ``precision`` value that expands back to exactly ``prec`` on the
    valid rows: a default, group formats, then ``blocks`` and ``layers`` overrides."""
    name = F.format_name
    default = _mode(prec[valid])
    assigned = np.full(prec.shape, default)
    groups: dict[str, int] = {}
    for g, ks in _RENDER_GROUPS:
        rows = valid & np.isin(kinds, ks)
        if rows.any():
            f = _mode(prec[rows])
            groups[g] = f
            assigned[rows] = f
    out: dict[str, Any] = {"default": name(default)}
    for merged, a, b in _MERGED:  # one "attention"/"mlp" key where both halves agree
        if a in groups and b in groups and groups[a] == groups[b]:
            groups[merged] = groups.pop(a)
            groups.pop(b)
    out.update({g: name(f) for g, f in groups.items() if f != default})
    block_over: dict[str, dict[str, str]] = {}
    for b in np.unique(blocks[valid & (blocks >= 0)]):
        for g, ks in _RENDER_GROUPS:
            rows = valid & (blocks == b) & np.isin(kinds, ks)
            vals = np.unique(prec[rows])
            if len(vals) == 1 and vals[0] != assigned[rows][0] and rows.sum() > 1:
                block_over.setdefault(str(int(b)), {})[g] = name(vals[0])
                assigned[rows] = vals[0]
    if block_over:
        out["blocks"] = block_over
    rest = np.flatnonzero(valid & (prec != assigned))
    if len(rest):
        out["layers"] = {str(int(r)): name(prec[r]) for r in rest}
    return out["default"] if len(out) == 1 else out


def plan_to_json(scenario, plan, *, tenants: Sequence[int] | None = None) -> dict:
    """One plan (no batch axis) as a JSON-able dict in the :data:`PLAN_JSON_SCHEMA` form,
    listing every present tenant (or ``tenants``) with every field."""
    t = ScenarioTables.of(scenario)
    p = jax.tree.map(np.asarray, plan)
    if p.precision.shape != t.kinds.shape:
        raise ValueError(f"plan.precision has shape {p.precision.shape}; expected "
                         f"{t.kinds.shape} (one plan, no batch axis)")
    ids = np.flatnonzero(t.present) if tenants is None else [int(i) for i in tenants]
    out = []
    for i in ids:
        out.append({
            "id": int(i), "pool": int(p.pool[i]), "gpus": int(p.gpus[i]), "tp": int(p.tp[i]),
            "pp": int(p.pp[i]), "zero_stage": int(p.zero_stage[i]),
            "recompute": bool(p.recompute[i]), "micro_batch": int(p.micro_batch[i]),
            "kv_precision": F.format_name(p.kv_precision[i]),
            "precision": _precision_choice(p.precision[i], t.kinds[i], t.blocks[i],
                                           t.valid[i]),
        })
    return {"tenants": out}


def render_plan(scenario, plan, *, indent: int | None = None,
                tenants: Sequence[int] | None = None) -> str:
    """One plan as JSON text that :func:`parse_plan` reads back to identical arrays
    (:func:`canonical_plan` of the input)."""
    return json.dumps(plan_to_json(scenario, plan, tenants=tenants), indent=indent)


def canonical_plan(scenario, plan) -> Plan:
    """The plan with padding rows at BF16 and absent tenants at the idle defaults (NumPy;
    any leading batch axes). The physics ignore both, so the metrics are unchanged; it is the
    form :func:`parse_plan` returns, so ``parse(render(p)).plan == canonical_plan(p)``."""
    t = ScenarioTables.of(scenario)
    p = jax.tree.map(np.asarray, plan)
    idle = idle_plan(t)
    keep = t.present
    return Plan(
        precision=np.where(keep[:, None] & t.valid, p.precision, F.BF16).astype(np.int32),
        **{f: np.where(keep, getattr(p, f), getattr(idle, f)).astype(np.int32)
           for f in _TENANT_FIELDS if f != "precision"})


def idle_plan(scenario) -> Plan:
    """The plan that places nobody (NumPy arrays): :meth:`Plan.idle`."""
    t = ScenarioTables.of(scenario)
    return Plan.idle(*t.kinds.shape, xp=np)


# ---------------------------------------------------------------------------------------------
# Parsing


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string (standard) or a list of messages
    (conversational: the assistant messages' contents, joined). Anything else gives ""."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        parts = []
        for msg in completion:
            if not isinstance(msg, Mapping) or msg.get("role", "assistant") != "assistant":
                continue
            content = msg.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, (list, tuple)):  # content parts: [{"type": "text", ...}]
                parts.extend(c.get("text", "") for c in content
                             if isinstance(c, Mapping) and isinstance(c.get("text"), str))
        return "\n".join(parts)
    return ""


def _strip_thinking(text: str) -> str:
    """Drop reasoning: everything up to the last ``</think>``, then an unfinished ``<think>``
    block to the end (case-insensitive; linear)."""
    last = None
    for last in _THINK_END.finditer(text):  # noqa: B007 - the last match is wanted (linear)
        continue
    if last is not None:
        text = text[last.end():]
    start = _THINK_START.search(text)
    return text[:start.start()] if start else text


def _fenced_blocks(text: str) -> list[str]:
    """The contents of the first ``MAX_FENCES`` Markdown code fences (an opening
    ```` ```lang ```` line, up to the next fence or the end), in order; one pass. (Past them,
    the whole text is still searched: a plan in a later fence is a span of it.)"""
    out = []
    pos = text.find("```")
    line_end = -1
    while pos >= 0:
        if line_end < pos:  # the end of the line this fence is on (found once per line)
            line_end = text.find("\n", pos + 3)
            if line_end < 0:
                break
        if text.find("`", pos + 3, line_end) >= 0:  # not an opening fence line: move on
            pos = text.find("```", pos + 3)
            continue
        close = text.find("```", line_end + 1)
        out.append(text[line_end + 1:] if close < 0 else text[line_end + 1:close])
        if close < 0 or len(out) == MAX_FENCES:
            break
        pos = text.find("```", close + 3)
    return out


class _Budget:
    """What one completion may still spend: JSON decodes and brackets scanned for spans
    (shared by its fenced blocks and its whole text), and whether brackets were left."""

    __slots__ = ("decodes", "brackets", "cut")

    def __init__(self) -> None:
        self.decodes, self.brackets, self.cut = MAX_DECODE_ATTEMPTS, MAX_BRACKETS, False


@functools.lru_cache(maxsize=64)
def _last_brackets(n: int) -> re.Pattern:
    """Matches, from the start of a reversed text, up to and including its ``n``-th bracket
    (anchored, no overlapping repetitions: linear)."""
    return re.compile(rf"(?:[^{{}}\[\]]*[{{}}\[\]]){{{n}}}")


def _bracket_tail(text: str, budget: _Budget) -> int:
    """Where the scan for spans starts: 0, or the last bracket of the ``budget.brackets`` a
    text may still have scanned (its tail: the answer's); the brackets scanned are spent.
    C-speed counts and one anchored match: linear."""
    count = sum(map(text.count, "{}[]"))
    if count <= budget.brackets:
        budget.brackets -= count
        return 0
    budget.cut = True
    n, budget.brackets = budget.brackets, 0
    return len(text) if n == 0 else len(text) - _last_brackets(n).match(text[::-1]).end()


def _json_spans(text: str, pos: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` of every top-level balanced ``{...}`` / ``[...]`` of ``text``, in order,
    in one pass: regular-expression searches skip prose to the next opener and, inside
    brackets, take each JSON string as one token (so a stray quote in prose cannot hide the
    JSON, and brackets inside strings do not count). Openers left unclosed, or dropped by a
    mismatched closer, do not hide what they enclose: spans directly inside them count as top
    level. The scan starts at ``pos``; from a ``pos`` inside the text (a budget's cut), a
    closer with nothing open may close what opened before the cut, so only the spans after the
    last such closer count (a span of a larger structure is never taken for the answer)."""
    if "}" not in text and "]" not in text:
        return []  # nothing closes: no span (a C-speed scan spares the token loop)
    spans = []  # (start, end, depth, position of the innermost enclosing opener)
    stack: list[tuple[str, int]] = []
    dropped: set[int] = set()
    n, cut, stray = len(text), pos > 0, -1
    while pos < n:
        if not stack:
            m = (_BRACKET if cut else _OPENER).search(text, pos)
            if m is None:
                break
            if m.group() in "}]":  # (cut only) a closer of something opened before the cut
                stray, pos = m.start(), m.end()
                continue
            flat = _FLAT_SPAN.match(text, m.start())
            if flat is not None:  # a span with no bracket inside: one match, not tokens
                spans.append((m.start(), flat.end(), 0, -1))
                pos = flat.end()
                continue
            stack.append((m.group(), m.start()))
            pos = m.end()
            continue
        t = _INSIDE_BRACKETS.match(text, pos)
        tok, pos = t.group(1), t.end()
        if not tok:
            break
        if tok in "{[":
            stack.append((tok, pos - 1))
        elif (stack[-1][0] == "{") == (tok == "}"):
            start = stack.pop()[1]
            spans.append((start, pos, len(stack), stack[-1][1] if stack else -1))
        else:  # a mismatched closer: drop the open brackets
            dropped.update(p for _, p in stack)
            stack.clear()
            if cut:
                stray = pos - 1
    dropped.update(p for _, p in stack)
    return [(s, e) for s, e, depth, inner in spans
            if (depth == 0 or inner in dropped) and s > stray]


def _decode_json(text: str) -> tuple[bool, Any]:
    """Strict JSON (orjson, C speed): ``(decoded, value)``."""
    try:
        return True, orjson.loads(text)
    except (orjson.JSONDecodeError, RecursionError):
        return False, None


def _lenient(text: str, decode) -> tuple[bool, Any, str | None]:
    """``decode`` the text strictly, then with the lenient repairs: ``(decoded, value, the
    repaired text or None when it was not needed)``."""
    ok, obj = decode(text)
    if ok:
        return ok, obj, None
    repaired = _repair(text)
    return (*(decode(repaired) if repaired != text else (False, None)), repaired)


def _plan_values(chunk: str, budget: _Budget, shaped: Callable[[Any], bool] | None = None,
                 decode: Callable[[str], tuple[bool, Any]] = _decode_json) -> tuple[Any, bool]:
    """``(the last plan-shaped JSON value of chunk or None, whether any JSON decoded)``:
    the whole chunk first (the common case: a fence holding only the plan), then its top-level
    bracketed spans from the last one back (the answer comes last), each decode costing one
    of ``budget.decodes``, the scan for spans reading at most ``budget.brackets``. Spans
    without a quote cannot hold a plan's keys and cost nothing.
    ``shaped``: what counts as a plan (default :func:`_plan_shaped`); ``decode``: the strict
    decoder of a candidate (:func:`_decode_json`; the lenient repairs are applied around it)."""
    shaped = shaped or _plan_shaped
    stripped = chunk.strip()
    found = False
    repaired = None  # the whole chunk repaired, once
    if budget.decodes <= 0:
        return None, found
    if stripped[:1] in ("{", "["):
        budget.decodes -= 1
        ok, obj, repaired = _lenient(stripped, decode)
        if ok:
            if shaped(obj):
                return obj, True
            found = True
    if '"' not in chunk and "'" not in chunk:
        return None, found  # no keys anywhere: no plan (and nothing to scan)
    for start, end in reversed(_json_spans(chunk, _bracket_tail(chunk, budget))):
        span = chunk[start:end]
        if '"' not in span and "'" not in span:
            continue
        if budget.decodes <= 0:
            break
        budget.decodes -= 1
        ok, obj, _ = _lenient(span, decode)
        if ok:
            found = True
            if shaped(obj):
                return obj, True
    # Prose whose quotes or brackets confused the scan (an unclosed string before the JSON):
    # the answer usually ends at the last closing bracket, so try the text from each of the
    # last few openers up to there (a bounded number of linear attempts).
    if budget.decodes <= 0 or ("{" not in stripped and "[" not in stripped):
        return None, found
    text = repaired if repaired is not None else _repair(stripped)  # strict decodes of slices
    last = max(text.rfind("}"), text.rfind("]")) + 1
    pos = last
    for _ in range(_FALLBACK_OPENERS):
        pos = max(text.rfind("{", 0, pos), text.rfind("[", 0, pos))
        if pos < 0 or budget.decodes <= 0:
            break
        budget.decodes -= 1
        try:
            obj = orjson.loads(text[pos:last])
        except (orjson.JSONDecodeError, RecursionError):
            continue
        found = True
        if shaped(obj):
            return obj, True
    return None, found


def _repair(text: str) -> str:
    """Lenient fixes: trailing commas, Python literals, single quotes (if no double ones).
    None of them changes valid JSON outside its strings."""
    text = _TRAILING_COMMA.sub(r"\1", text)
    if "True" in text or "False" in text or "None" in text:  # the regex is slow to scan
        text = _PY_LITERAL.sub(lambda m: _PY_JSON[m[1]], text)
    if '"' not in text:
        text = text.replace("'", '"')
    return text


def _norm_key(k: Any) -> str:
    """A key lower-cased with ``-``/spaces as ``_`` (short keys cached; long ones are model
    junk and are not kept)."""
    return _norm_key_cached(k) if isinstance(k, str) and len(k) <= MAX_VALUE_CHARS else (
        "_".join(str(k).strip().lower().replace("-", " ").split()))


@functools.lru_cache(maxsize=4096)
def _norm_key_cached(k: str) -> str:
    return "_".join(k.strip().lower().replace("-", " ").split())


def _plan_shaped(obj: Any) -> bool:
    if type(obj) is _CanonicalPlan:
        return True
    if isinstance(obj, list):
        return bool(obj) and all(isinstance(x, Mapping) for x in obj)
    if isinstance(obj, Mapping):
        keys = {_norm_key(k) for k in obj}
        return bool(keys & {"tenants", "plan", "allocations"}) or bool(
            keys & set(_FIELD_ALIASES))
    return False


_EXPECTED_PLAN = '{"tenants": [...]}'


def extract_json(text: Any, shaped: Callable[[Any], bool] | None = None,
                 expected: str = _EXPECTED_PLAN) -> tuple[Any, int, str]:
    """``(value, stage, reason)``: the last plan-shaped JSON value of a completion's text, the
    last one in a code fence if a fence holds one (``stage`` ``VALID`` when found, else
    ``NO_JSON`` or ``NOT_A_PLAN`` with a reason).
    Linear in the text and bounded (``MAX_TEXT_CHARS``, ``MAX_DECODE_ATTEMPTS``).
    ``shaped``/``expected``: another task's notion of an answer (a predicate on the decoded
    value) and its form, for the reason."""
    return _extract(text, shaped, expected, _decode_json)


def exact_text(value: Any) -> str | None:
    """``value``'s exact text (a ``str`` subclass read as its characters, none of its
    methods called), or None when it is not text."""
    if type(value) is str:
        return value
    return str.__str__(value) if isinstance(value, str) else None


def _extract(text: Any, shaped, expected: str, decode) -> tuple[Any, int, str]:
    """:func:`extract_json` with the strict decoder of candidates (``decode``)."""
    text = exact_text(text)
    if text is None:
        return None, NO_JSON, "completion is not text"
    cut = len(text) > MAX_TEXT_CHARS
    text = _strip_thinking(text[-MAX_TEXT_CHARS:])
    if not text.strip():
        return None, NO_JSON, "empty completion"
    budget = _Budget()
    found_json = False
    # Fenced blocks first (the last plan in a fence wins), then the whole text.
    for chunks in (_fenced_blocks(text), [text]):
        for chunk in reversed(chunks):
            obj, found = _plan_values(chunk, budget, shaped, decode)
            found_json |= found
            if obj is not None:
                return obj, VALID, ""
    note = ""
    if budget.decodes <= 0:
        note = f" (stopped after {MAX_DECODE_ATTEMPTS} JSON candidates)"
    elif cut:
        note = f" (only the last {MAX_TEXT_CHARS} characters are read)"
    elif budget.cut:
        note = f" (only {MAX_BRACKETS} brackets are scanned for JSON, the last ones first)"
    if found_json:
        return None, NOT_A_PLAN, f"JSON found, but not a plan (expected {expected})" + note
    return None, NO_JSON, "no JSON value found" + note


def _digits(v: str, field: str, prefixes: tuple[str, ...] = ()) -> str:
    """The number in a string such as ``"3"``, ``"tenant 2"`` or ``"ZeRO-3"`` (after any of
    ``prefixes`` and separators), in linear time; _PlanError otherwise."""
    s = v.strip().lower()
    if len(s) > MAX_VALUE_CHARS:
        raise _PlanError(f"{field}: a value of {len(v)} characters is not a number")
    for p in prefixes:
        if s.startswith(p):
            s = s[len(p):].lstrip(_SEPARATORS)
    m = _INT_TEXT.fullmatch(s.strip())
    if not m:
        raise _PlanError(f"{field} must be an integer, got {shorten(repr(v))}")
    return m.group()


_TENANT_PREFIXES = ("tenant", "t")
_ZERO_PREFIXES = ("zero", "stage")


def _as_int(v: Any, field: str, prefixes: tuple[str, ...] = ()) -> int:
    if isinstance(v, str):
        v = float(_digits(v, field, prefixes))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (
            float("inf"), float("-inf")) or int(v) != v:
        raise _PlanError(f"{field} must be an integer, got {v!r}")
    if abs(v) > INT_LIMIT:
        raise _PlanError(f"{field} = {v!r} is out of range")
    return int(v)


def _as_bool(v: Any, field: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise _PlanError(f"{field} must be true or false, got {v!r}")


def _format_or_none(v: str | int) -> int | None:
    if isinstance(v, str) and len(v) > MAX_VALUE_CHARS:
        return None  # no format name is that long (and junk is not cached)
    return _format_cached(v)


@functools.lru_cache(maxsize=1024)
def _format_cached(v: str | int) -> int | None:
    try:
        return F.format_id(v)
    except ValueError:
        return None


def _as_format(v: Any, field: str) -> int:
    fid = None if isinstance(v, bool) or not isinstance(v, (str, int)) else _format_or_none(v)
    if fid is None:
        raise _PlanError(f"{field}: unknown format {v!r}; valid: {', '.join(F.FORMAT_NAMES)}")
    return fid


def _norm_precision(v: Any, field: str, n_rows: int) -> dict:
    """A ``precision`` value in :func:`~libratio_jax.physics.plan.choices_to_arrays` form.
    ``blocks`` and ``layers`` may not have more entries than the model has rows (``n_rows``):
    more must repeat or miss a row, and each costs a conversion."""
    if not isinstance(v, Mapping):
        return {"default": _as_format(v, field)}
    out: dict[str, Any] = {}
    for k, x in v.items():
        g = _GROUP_ALIASES.get(_norm_key(k))
        if g is None:
            raise _PlanError(f"{field}: unknown layer group {k!r}; valid: "
                             f"default, {', '.join(LAYER_GROUPS)}, blocks, layers")
        if g in out:
            raise _PlanError(f"{field}: layer group {g!r} given twice")
        if g in ("blocks", "layers") and isinstance(x, Mapping) and len(x) > n_rows:
            raise _PlanError(f"{field}.{g}: {len(x)} overrides for a model of {n_rows} rows")
        if g == "blocks":
            if not isinstance(x, Mapping):
                raise _PlanError(f"{field}.blocks must map block numbers to group formats")
            out[g] = {_as_int(b, f"{field}.blocks key"): _norm_precision(
                gs, f"{field}.blocks", n_rows) for b, gs in x.items()}
            if any(set(gs) & {"blocks", "layers"} for gs in out[g].values()):
                raise _PlanError(f"{field}.blocks: overrides cannot nest")
        elif g == "layers":
            if not isinstance(x, Mapping):
                raise _PlanError(f"{field}.layers must map row numbers to formats")
            out[g] = {_as_int(r, f"{field}.layers key"): _as_format(f, f"{field}.layers")
                      for r, f in x.items()}
        else:
            out[g] = _as_format(x, f"{field}.{g}")
    return out


def _tenant_entries(obj: Any) -> list[tuple[Any, Any]]:
    """``[(id or None, entry)]`` from the accepted top-level forms."""
    if isinstance(obj, Mapping):
        keys = {_norm_key(k): k for k in obj}
        for name in ("plan", "tenants", "allocations"):
            if name in keys:
                inner = obj[keys[name]]
                if name == "plan" and isinstance(inner, (Mapping, list)):
                    return _tenant_entries(inner)
                if isinstance(inner, list):
                    return [(None, e) for e in inner]
                if isinstance(inner, Mapping):
                    return list(inner.items())
                raise _PlanError(f"'{keys[name]}' must be a list of tenant plans")
        return [(None, obj)]  # a single tenant's plan
    if isinstance(obj, list):
        return [(None, e) for e in obj]
    raise _PlanError("expected {\"tenants\": [...]}")


# The canonical form (what render_plan writes and PLAN_JSON_SCHEMA describes): {"tenants":
# [...]} with exact keys, JSON integers within INT_LIMIT, booleans and format names. msgspec
# decodes and checks a candidate against it in one C pass (about 1.5 µs for a 4-tenant plan,
# against 2.1 µs for orjson's untyped decode alone, measured on the reward benchmark's
# completions); _canonical_parts then spreads it over the parts without the alias and text
# handling. Anything else (a candidate msgspec rejects) is decoded by orjson and read by the
# general path; both give the same plan for a canonical text (tested).
_Int = Annotated[int, msgspec.Meta(ge=-INT_LIMIT, le=INT_LIMIT)]
_Format = Literal[tuple(F.FORMAT_IDS)]
_UNSET = msgspec.UNSET
_CanonicalPrecision = msgspec.defstruct(
    "_CanonicalPrecision",
    [(g, _Format | msgspec.UnsetType, _UNSET) for g in ("default", *GROUP_ORDER)],
    forbid_unknown_fields=True)


class _CanonicalEntry(msgspec.Struct, forbid_unknown_fields=True):
    id: _Int | msgspec.UnsetType = _UNSET
    gpus: _Int | msgspec.UnsetType = _UNSET
    tp: _Int | msgspec.UnsetType = _UNSET
    pp: _Int | msgspec.UnsetType = _UNSET
    zero_stage: _Int | msgspec.UnsetType = _UNSET
    recompute: bool | msgspec.UnsetType = _UNSET
    kv_precision: _Format | msgspec.UnsetType = _UNSET
    micro_batch: _Int | msgspec.UnsetType = _UNSET
    pool: _Int | msgspec.UnsetType = _UNSET
    precision: _Format | _CanonicalPrecision | msgspec.UnsetType = _UNSET


# The entry's fields after ``id`` are INT_FIELDS in order (then precision).
assert _CanonicalEntry.__struct_fields__[1:-1] == INT_FIELDS


class _CanonicalPlan(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[_CanonicalEntry]


_CANONICAL = msgspec.json.Decoder(_CanonicalPlan)


def _decode_plan(text: str) -> tuple[bool, Any]:
    """A candidate as a :class:`_CanonicalPlan` when it is one, else :func:`_decode_json`
    (msgspec refuses text it cannot encode as UTF-8, a lone surrogate say: orjson decides)."""
    try:
        return True, _CANONICAL.decode(text)
    except (msgspec.DecodeError, RecursionError, UnicodeError):
        return _decode_json(text)


_KV, _GPUS = INT_FIELDS.index("kv_precision"), INT_FIELDS.index("gpus")


def _canonical_parts(plan: _CanonicalPlan, n_slots: int, present) -> PlanParts | None:
    """The :class:`PlanParts` of a canonical plan, or ``None`` when an entry names a tenant
    out of the scenario or twice (the general path then says which)."""
    parts = PlanParts.idle(n_slots)
    tables, ints = parts.kind_formats, parts.ints
    formats, astuple = F.FORMAT_IDS, msgspec.structs.astuple
    placed = set()
    for pos, e in enumerate(plan.tenants):
        tid, *values, prec = astuple(e)
        if tid is _UNSET:
            tid = pos
        if not 0 <= tid < n_slots or not present[tid] or tid in placed:
            return None
        placed.add(tid)
        if values[_KV] is not _UNSET:
            values[_KV] = formats[values[_KV]]
        if values[_GPUS] is _UNSET:
            values[_GPUS] = LISTED_GPUS
        for column, v in zip(ints, values, strict=True):  # ints, and recompute as a bool
            if v is not _UNSET:
                column[tid] = v
        if type(prec) is str:
            tables[tid] = [formats[prec]] * A.NUM_KINDS + [F.BF16]
        elif prec is not _UNSET:
            default, *groups = astuple(prec)  # formats.get(UNSET) is None: not chosen
            tables[tid] = kind_formats(formats.get(default, F.BF16),
                                       [formats.get(f) for f in groups]) + [F.BF16]
    return parts


def _tenant_choices(entries, n_slots: int, present: np.ndarray, agent: int | None,
                    n_rows: int) -> dict[int, dict]:
    """Per tenant id, its choices in :func:`choices_to_arrays` form (``n_rows``: rows per
    model, the most overrides a precision may list)."""
    out: dict[int, dict] = {}
    for pos, (key, e) in enumerate(entries):
        where = f"tenant entry {pos}"
        if not isinstance(e, Mapping):
            raise _PlanError(f"{where} is not an object")
        ch: dict[str, Any] = {}
        tid = None if key is None else _as_int(key, f"{where} key", _TENANT_PREFIXES)
        for k, v in e.items():
            nk = _norm_key(k)
            if nk in _ID_KEYS:
                i = _as_int(v, f"{where} id", _TENANT_PREFIXES)
                if tid is not None and tid != i:
                    raise _PlanError(f"{where}: id {i} differs from its key {tid}")
                tid = i
                continue
            if nk in _LABEL_KEYS:
                continue
            f = _FIELD_ALIASES.get(nk)
            if f is None:
                raise _PlanError(f"{where}: unknown field {k!r}; valid: id, "
                                 f"{', '.join(_TENANT_FIELDS)}")
            if f in ch:
                raise _PlanError(f"{where}: field {f!r} given twice")
            if f == "precision":
                ch[f] = _norm_precision(v, f"{where}.precision", n_rows)
            elif f == "kv_precision":
                ch[f] = _as_format(v, f"{where}.kv_precision")
            elif f == "recompute":
                ch[f] = _as_bool(v, f"{where}.recompute")
            elif f == "zero_stage":
                ch[f] = _as_int(v, f"{where}.zero_stage", _ZERO_PREFIXES)
            else:
                ch[f] = _as_int(v, f"{where}.{f}")
        _place(out, tid, ch, where, pos, len(entries), n_slots, present, agent)
    return out


def _place(out: dict[int, dict], tid: int | None, ch: dict, where: str, pos: int,
           n_entries: int, n_slots: int, present: np.ndarray, agent: int | None) -> None:
    """Record entry ``pos``'s choices under its tenant id (default: the agent's, for a lone
    entry of an agent row, else its position)."""
    if tid is None:
        tid = agent if agent is not None and n_entries == 1 else pos
    if not (0 <= tid < n_slots) or not present[tid]:
        raise _PlanError(f"{where}: tenant {tid} is not in this scenario (tenants: "
                         f"{', '.join(str(int(i)) for i in np.flatnonzero(present))})")
    if tid in out:
        raise _PlanError(f"tenant {tid} is given twice")
    out[tid] = ch


def shorten(msg: str) -> str:
    """One line of at most ``MAX_REASON_CHARS`` characters."""
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= MAX_REASON_CHARS else msg[:MAX_REASON_CHARS - 3] + "..."


def parse_plan(text: Any, scenario, *, agent: int | None = None,
               base_plan: Plan | None = None) -> ParsedPlan:
    """Parse one completion into a plan of ``scenario`` (see the module docstring). Never
    raises.

    ``agent`` / ``base_plan``: the completion plans tenant ``agent`` only; its entry (the one
    with that id, or the only entry) replaces that tenant's fields in ``base_plan`` (the other
    tenants' fixed plans); entries for other tenants are not used, but must be readable (an
    entry that cannot be read makes the completion ``NOT_A_PLAN``).
    """
    return parse_plans([text], [scenario], agents=[agent], base_plans=[base_plan])[0]


def parse_plans(texts: Sequence[Any], scenarios: Sequence[Any], *,
                agents: Sequence[int | None] | None = None,
                base_plans: Sequence[Plan | None] | None = None) -> list[ParsedPlan]:
    """:func:`parse_plan` of each completion with its scenario (and agent and base plan), the
    reward path's form: each text is read on its own, then the plans are spread over their
    rows and checked together (one vectorized pass per scenario shape). Never raises; each
    completion's result is what :func:`parse_plan` gives it alone."""
    out, groups = _parse_grouped(texts, scenarios, agents, base_plans)
    for items, prec, fields, broken in groups:
        for k, (b, t) in enumerate(items):
            plan = plan_at(prec, fields, k)
            out[b] = validated(t, plan) if broken[k] else ParsedPlan(plan, VALID, "")
    return out


def parse_plans_stacked(texts: Sequence[Any], scenarios: Sequence[Any], *,
                        agents: Sequence[int | None] | None = None,
                        base_plans: Sequence[Plan | None] | None = None,
                        check_rules: bool = True,
                        ) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
    """:func:`parse_plans` with the plans stacked rather than one :class:`Plan` each (the
    reward engine's form: no per-completion objects): ``(stage[B], reason[B],
    precision[B, M, L], fields[B, 8, M])`` (int32; ``fields`` in ``INT_FIELDS`` order; rows
    below stage ``INVALID`` hold zeros). Every scenario must have the same ``[M, L]`` rows
    (one capacity); the results are :func:`parse_plans`'. Never raises, except a ValueError
    for an empty batch or plans of several shapes (the caller's setup, not the text).
    ``check_rules=False``: plans are not checked against the scenario's rules here (they are
    ``VALID`` if they parse): for a caller that checks them in its own program
    (:func:`~libratio_jax.physics.plan.breaks_rules`) and asks :func:`validated` for the
    reason of a flagged one; agents' plans are checked all the same."""
    n = len(texts)
    if n == 0:
        raise ValueError("parse_plans_stacked: empty batch")
    out, groups = _parse_grouped(texts, scenarios, agents, base_plans, check_rules)
    shapes = {g[1].shape[1:] for g in groups} | {
        p.plan.precision.shape for p in out if p is not None and p.plan is not None}
    if len(shapes) > 1:
        raise ValueError(f"parse_plans_stacked: scenarios of several row shapes {shapes}")
    shape = shapes.pop() if shapes else (0, 0)
    stage = np.zeros(n, np.int32)
    reasons = [""] * n
    prec = np.zeros((n, *shape), np.int32)
    fields = np.zeros((n, len(INT_FIELDS), shape[0]), np.int32)
    for b, p in enumerate(out):
        if p is not None:
            stage[b], reasons[b] = p.stage, p.reason
            if p.plan is not None:
                prec[b] = p.plan.precision
                fields[b] = [getattr(p.plan, f) for f in INT_FIELDS]
    for items, g_prec, g_fields, broken in groups:
        rows = [b for b, _ in items]
        prec[rows], fields[rows], stage[rows] = g_prec, g_fields, VALID
        for k in np.flatnonzero(broken):  # the message of a broken one
            b, t = items[k]
            p = validated(t, plan_at(g_prec, g_fields, k))
            stage[b], reasons[b] = p.stage, p.reason
    return stage, reasons, prec, fields


def _parse_grouped(texts, scenarios, agents, base_plans, check_rules: bool = True):
    """``(out, groups)``: ``out[b]`` the :class:`ParsedPlan` of each completion decided alone
    (not a plan, an agent's plan) and ``None`` for the rest, which ``groups`` holds expanded
    and checked together per scenario shape: ``(items [(b, tables)], precision [K, M, L],
    fields [K, 8, M], broken [K])`` (``broken``: breaks a rule of ``validate_plan``)."""
    n = len(texts)
    out: list[ParsedPlan | None] = [None] * n
    batched: dict[tuple, list] = {}
    for b in range(n):
        try:
            agent = None if agents is None else agents[b]
            t = ScenarioTables.of(scenarios[b])
        except Exception as e:  # not a scenario: a caller's bug, reported rather than raised
            out[b] = ParsedPlan(None, NO_JSON, shorten(f"bad scenario: {e}"))
            continue
        try:
            obj, stage, reason = _extract(texts[b], None, _EXPECTED_PLAN, _decode_plan)
            if stage != VALID:
                out[b] = ParsedPlan(None, stage, reason)
                continue
            n_slots = len(t.present)
            canonical = type(obj) is _CanonicalPlan
            parts = (_canonical_parts(obj, n_slots, t.present)
                     if canonical and agent is None else None)
            if parts is None:
                if canonical:
                    obj = msgspec.to_builtins(obj)  # the general path reads plain JSON values
                choices = _tenant_choices(_tenant_entries(obj), n_slots, t.present, agent,
                                          t.kinds.shape[1])
                if agent is not None:
                    out[b] = validated(t, _agent_plan(
                        t, choices, agent, None if base_plans is None else base_plans[b]))
                    continue
                parts = plan_parts(t.kinds, t.blocks, t.valid, n_slots,
                                   [choices.get(i, {"gpus": 0}) for i in range(n_slots)])
            shape = (t.kinds.shape, t.scenario.cluster.gpu_count.shape)
            batched.setdefault(shape, []).append((b, t, parts))
        except (_PlanError, ValueError) as e:  # ValueError: a field that does not fit the model
            out[b] = ParsedPlan(None, NOT_A_PLAN, shorten(e))
        except Exception as e:  # noqa: BLE001 - by design the parser never raises
            out[b] = ParsedPlan(None, NOT_A_PLAN, shorten(f"internal parser error: {e!r}"))
    groups = []
    for items in batched.values():
        try:
            prec, fields = expand_parts([p for _, _, p in items],
                                        [(t.kinds, t.valid) for _, t, _ in items])
            broken = (np.zeros(len(items), bool) if not check_rules
                      else invalid_plans(fields, [t.rules for _, t, _ in items])
                      if len(items) > 1 else [True])  # one plan: validate_plan's scalar path
        except Exception as e:  # noqa: BLE001 - never raises (not expected: inputs are checked)
            for b, _, _ in items:
                out[b] = ParsedPlan(None, NOT_A_PLAN, shorten(f"internal parser error: {e!r}"))
            continue
        groups.append(([(b, t) for b, t, _ in items], prec, fields, np.asarray(broken)))
    return out, groups


def _agent_plan(t: ScenarioTables, choices: dict, agent: int, base_plan: Plan | None) -> Plan:
    """The base plan with tenant ``agent``'s fields replaced by its entry's."""
    if agent not in choices:
        raise _PlanError(f"no plan for tenant {agent}")
    n_slots = len(t.present)
    arrays = choices_to_arrays(t.kinds, t.blocks, t.valid, n_slots,
                               [choices[agent] if i == agent else {"gpus": 0}
                                for i in range(agent + 1)])
    base = jax.tree.map(np.asarray, base_plan if base_plan is not None else idle_plan(t))
    arrays = {f: np.where((np.arange(n_slots) == agent).reshape(
        (-1,) + (1,) * (getattr(base, f).ndim - 1)), a, getattr(base, f))
        for f, a in arrays.items()}
    return Plan(**{k: np.asarray(v, np.int32) for k, v in arrays.items()})


def validated(t: ScenarioTables, plan: Plan) -> ParsedPlan:
    """The plan (host arrays, one plan of ``t``'s scenario) with :func:`validate_plan`'s
    verdict: stage ``VALID``, or ``INVALID`` and its message. Never raises."""
    try:
        validate_plan(t.scenario, plan)
    except ValueError as e:
        return ParsedPlan(plan, INVALID, shorten(e))
    except Exception as e:  # noqa: BLE001
        return ParsedPlan(plan, INVALID, shorten(f"internal validation error: {e!r}"))
    return ParsedPlan(plan, VALID, "")
