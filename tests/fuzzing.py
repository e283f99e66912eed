"""Fuzz cases for the plan parser and the TRL reward functions, and a longer fuzzing run.

The suite (tests/test_text.py, tests/test_hf.py) draws ~12,000 cases from these generators;
this script runs as many as you ask for:

    python tests/fuzzing.py --cases 200000 [--seed 1]

It prints one JSON line: cases, how many parsed as valid plans, stage counts, seconds, and any
case that raised or reached an internal-error path (there must be none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from libratio_jax.physics import formats as F  # noqa: E402

_FIELDS = ["id", "gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch",
           "pool", "precision", "model", "GPUs", "Tensor-Parallel", "num_gpus", "kv cache",
           "unknown", "blocks", "layers"]
_GROUPS = ["default", "mlp", "attention", "lm_head", "embedding", "norm", "router", "experts",
           "MLP", "ffn", "attn", "blocks", "layers", "bogus"]
_ATOMS = [0, 1, 2, 3, 4, 8, -1, 7, 1e9, 2**40, 0.5, 2.0, float("nan"), float("inf"), True,
          False, None, "", "4", "fp8", "BF16", "int4", "zero-3", "t1", "yes", "nf4", "fp7",
          "0", "12", [], {}, [1, 2], {"a": 1}]
_WRAPPERS = ["{}", "```json\n{}\n```", "<think>hmm {{</think>{}", "Here is the plan: {} Done.",
             "```\n{}", "<think>{}</think>", "{} {}", "<THINK>x</THINK>```JSON\n{}\n```\ntail"]


def random_bytes_text(rng: np.random.Generator) -> str:
    """Random bytes decoded as UTF-8 (with replacement) or Latin-1."""
    n = int(rng.integers(0, 400))
    raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return raw.decode("utf-8", "replace") if rng.random() < 0.5 else raw.decode("latin-1")


def json_soup(rng: np.random.Generator) -> str:
    """Random characters from JSON's alphabet and plan words."""
    alphabet = list('{}[]:,"\' \n0123456789.-eE') + ["tenants", "gpus", "true", "null", "id",
                                                        "precision", "bf16", "```", "<think>",
                                                        "</think>", "\\", "\\u00"]
    return "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 120))))


def _value(rng: np.random.Generator, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.15:
        return {str(rng.choice(_GROUPS + _FIELDS)): _value(rng, depth + 1)
                for _ in range(int(rng.integers(0, 4)))}
    if depth < 3 and r < 0.25:
        return [_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    if r < 0.35:
        return str(rng.choice(F.FORMAT_NAMES))
    return _ATOMS[int(rng.integers(0, len(_ATOMS)))]


def plan_like(rng: np.random.Generator, n_tenants: int = 4) -> str:
    """A plan-shaped JSON value with random fields and values, wrapped in prose/fences."""
    tenants = []
    for _ in range(int(rng.integers(0, n_tenants + 2))):
        entry = {str(rng.choice(_FIELDS)): _value(rng) for _ in range(int(rng.integers(0, 6)))}
        if rng.random() < 0.5:
            entry["precision"] = {str(rng.choice(_GROUPS)): _value(rng)
                                  for _ in range(int(rng.integers(0, 4)))}
        tenants.append(entry)
    top = rng.choice(["tenants", "Tenants", "plan", "allocations", "list", "dict"])
    if top == "list":
        obj = tenants
    elif top == "dict":
        obj = {"tenants": {str(i): t for i, t in enumerate(tenants)}}
    else:
        obj = {str(top): tenants}
    text = json.dumps(obj, allow_nan=True)
    if rng.random() < 0.2:  # trailing commas / Python literals
        text = text.replace("}", ",}").replace("true", "True")
    return str(rng.choice(_WRAPPERS)).replace("{}", text, 1)


def mutate(text: str, rng: np.random.Generator) -> str:
    """Delete, duplicate or replace a few random characters of ``text``."""
    chars = list(text)
    for _ in range(int(rng.integers(1, 6))):
        if not chars:
            break
        i = int(rng.integers(0, len(chars)))
        op = rng.random()
        if op < 0.4:
            del chars[i]
        elif op < 0.7:
            chars.insert(i, chars[i])
        else:
            chars[i] = str(rng.choice(list('{}[]",:0123456789abc ')))
    return "".join(chars)


def cases(n: int, seed: int, valid_texts: list[str]):
    """``n`` fuzz texts: random bytes, JSON soup, random plan-like JSON, mutated valid plans,
    and non-string completions (conversational shapes, None, numbers)."""
    rng = np.random.default_rng(seed)
    odd = [None, 3, 2.5, [], {}, [{"role": "assistant"}], [{"role": "assistant", "content": 7}],
           [{"role": "assistant", "content": [{"type": "text", "text": "{\"tenants\": []}"}]}],
           [{"role": "user", "content": "x"}], b"bytes", {"content": "{}"}]
    for k in range(n):
        r = k % 10
        if r < 3:
            yield random_bytes_text(rng)
        elif r < 5:
            yield json_soup(rng)
        elif r < 8:
            yield plan_like(rng)
        elif r < 9 and valid_texts:
            yield mutate(valid_texts[int(rng.integers(0, len(valid_texts)))], rng)
        else:
            yield odd[int(rng.integers(0, len(odd)))]


def main(argv=None) -> dict:
    import jax

    from libratio_jax.agents.policies import random_valid_plan
    from libratio_jax.scenarios import Generator
    from libratio_jax.text import codec as T

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    sc = Generator("hard")(jax.random.PRNGKey(args.seed))
    tables = T.ScenarioTables.of(sc)
    valid = [T.render_plan(tables, random_valid_plan(jax.random.PRNGKey(i), sc))
             for i in range(32)]
    stages = [0, 0, 0, 0]
    bad = []
    t0 = time.perf_counter()
    for text in cases(args.cases, args.seed, valid):
        try:
            r = T.parse_plan(T.completion_text(text), tables)
        except Exception as e:  # noqa: BLE001 - the point of fuzzing
            bad.append({"text": repr(text)[:200], "error": repr(e)})
            continue
        stages[r.stage] += 1
        if "internal" in r.reason:
            bad.append({"text": repr(text)[:200], "reason": r.reason})
    out = {"fuzz": "parse_plan", "cases": args.cases, "seconds": round(time.perf_counter() - t0,
                                                                        2),
           "stages": dict(zip(T.STAGE_NAMES, stages, strict=True)), "failures": bad[:20],
           "n_failures": len(bad)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
