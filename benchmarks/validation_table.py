"""Print the validation tables of docs/physics.md: predicted vs measured, error per row.

    python benchmarks/validation_table.py > /tmp/validation.md

Sources: tests/data/measured_h100_pytorch.jsonl (Llama-shaped models) and
tests/data/measured_h100_extra.jsonl (Qwen2/Qwen3-shaped models and GEMM shapes measured with
benchmarks/measure_h100.py).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import libratio_jax as lj
from libratio_jax.physics import formats as F
from libratio_jax.physics.hardware import gpu_spec
from libratio_jax.physics.throughput import gemm_seconds

HERE = os.path.dirname(__file__)
GIVEN = os.path.join(HERE, "..", "tests", "data", "measured_h100_pytorch.jsonl")
EXTRA = os.path.join(HERE, "..", "tests", "data", "measured_h100_extra.jsonl")


def _cfg(r):
    c = r["config"]
    if "hidden" in c:
        return {"model_type": "llama", "hidden_size": c["hidden"], "intermediate_size": c["ffn"],
                "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
                "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
                "tie_word_embeddings": False}
    return c


def _load(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__,  # (no options: --help says what it prints)
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    recs = [(r, "given") for r in _load(GIVEN)] + [(r, "extra") for r in _load(EXTRA)]
    print("| source | model | mode | ckpt | batch x seq | peak GB meas | pred | err | "
          "tokens/s meas | pred | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mem, tok = [], []
    for r, src in recs:
        if "model" not in r or not r["mode"].startswith("train"):
            continue
        kw = dict(batch=r["batch"], seq_len=r["seq"], recompute=r["grad_ckpt"])
        if r["mode"] == "train_amp":
            kw.update(weights="fp32", autocast="bf16")
        m = lj.estimate_memory(_cfg(r), **kw)
        t = lj.estimate_throughput(_cfg(r), **kw)
        em = m.peak / r["peak_bytes"] - 1
        et = t.tokens_per_second / r["tokens_per_s"] - 1
        mem.append(abs(em))
        if r["params"] >= 8e8:
            tok.append(abs(et))
        print(f"| {src} | {r['model']} | {r['mode']} | {int(r['grad_ckpt'])} | "
              f"{r['batch']} x {r['seq']} | {r['peak_bytes'] / 1e9:.2f} | {m.peak / 1e9:.2f} | "
              f"{100 * em:+.1f}% | {r['tokens_per_s']:,.0f} | {t.tokens_per_second:,.0f} | "
              f"{100 * et:+.1f}% |")
    print(f"\nTraining peak memory: median |error| {100 * np.median(mem):.1f}%, "
          f"max {100 * max(mem):.1f}% ({len(mem)} runs). Training tokens/s on models >= 0.8 B: "
          f"median |error| {100 * np.median(tok):.1f}%, max {100 * max(tok):.1f}% "
          f"({len(tok)} runs).\n")
    print("| source | GEMM m x n x k | FP8/BF16 measured | predicted | err |")
    print("|---|---|---|---|---|")
    peak = gpu_spec("H100-SXM").peak_flops
    for r, src in recs:
        if r.get("kind") != "matmul":
            continue
        m, n, k = (r["n"],) * 3 if "m" not in r else (r["m"], r["n"], r["k"])
        meas = r["fp8_tflops"] / r["bf16_tflops"]
        pred = gemm_seconds(m, n, k, F.BF16, peak) / gemm_seconds(m, n, k, F.FP8_E4M3, peak)
        print(f"| {src} | {m} x {n} x {k} | {meas:.2f} | {pred:.2f} | "
              f"{100 * (pred / meas - 1):+.1f}% |")


if __name__ == "__main__":
    main()
