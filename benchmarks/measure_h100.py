"""Measure real training runs on a GPU to validate the memory and throughput physics.

    python benchmarks/measure_h100.py --out tests/data/measured_h100_extra.jsonl

Needs a CUDA GPU with PyTorch and transformers (run it through the device tool; CI never runs
it). It complements ``shared/vectors/measured_h100_pytorch.jsonl`` (Llama-shaped models) with
architectures that file lacks: Qwen2-shaped models (q/k/v biases, a 152k vocabulary, a wide
MLP) and Qwen3-shaped models (q/k norms, head_dim 128 != hidden / heads), trained the same way:
model from config (random init, sdpa attention), BF16 weights, fused ``torch.optim.AdamW``,
with and without gradient checkpointing; and FP8 (``torch._scaled_mm``, E4M3, per-tensor
scales) vs BF16 GEMM rates at transformer-shaped sizes. One JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import time

CONFIGS = {
    "qwen2-s": {"model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 4864,
                "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
                "vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3-s": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
    "qwen2-1b": {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 8960,
                 "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 2,
                 "vocab_size": 151936, "tie_word_embeddings": False},
}
SHAPES = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096),
          (16384, 8192, 8192)]


def train_run(name, cfg, batch, seq, ckpt, steps=4):
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    d = dict(cfg)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):  # initialize on the GPU: CPU init of 1 B params is minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device="cuda")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    del model, opt, loss
    return {"model": name, "mode": "train_bf16", "grad_ckpt": ckpt, "batch": batch, "seq": seq,
            "params": params, "weights_bytes": weights_bytes, "steady_bytes": steady,
            "peak_bytes": peak, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
            "config": cfg}


def gemm_rates(m, n, k, iters=20):
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    t16 = timed(lambda: a @ b.t())
    t8 = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16))
    flops = 2.0 * m * n * k
    return {"kind": "matmul", "m": m, "n": n, "k": k, "bf16_tflops": flops / t16 / 1e12,
            "fp8_tflops": flops / t8 / 1e12}


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gemm-only", action="store_true")
    args = ap.parse_args(argv)
    device = torch.cuda.get_device_name()
    runs = []
    for name, cfg in ({} if args.gemm_only else CONFIGS).items():
        for batch, seq in ((1, 512), (4, 2048), (8, 1024)):
            for ckpt in (False, True):
                runs.append(train_run(name, cfg, batch, seq, ckpt))
                print(json.dumps(runs[-1]), flush=True)
    for shape in SHAPES:
        runs.append(gemm_rates(*shape))
        print(json.dumps(runs[-1]), flush=True)
    with open(args.out, "w") as f:
        for r in runs:
            f.write(json.dumps({**r, "device": f"{device}, PyTorch {torch.__version__}"}) + "\n")


if __name__ == "__main__":
    main()
