"""estimate_memory / estimate_throughput against the measured H100 records, published numbers,
and evaluate (one implementation, two faces); the CLI."""

import json

import numpy as np
import pytest
from test_physics import _llama_cfg, _measured, _one_row_model

import libratio_jax as lj
from conftest import data_path
from libratio_jax.cli import main
from libratio_jax.physics import formats as F
from libratio_jax.physics.hardware import gpu_spec
from libratio_jax.physics.throughput import gemm_seconds


def _kw(r):
    kw = dict(batch=r["batch"], seq_len=r["seq"], recompute=r["grad_ckpt"])
    if r["mode"] == "train_amp":
        kw.update(weights="fp32", autocast="bf16")
    elif r["mode"] == "infer_bf16":
        kw.update(mode="serve")
    return kw


def test_training_peak_memory_targets():
    errors = []
    for r in _measured():
        if r["mode"].startswith("train"):
            est = lj.estimate_memory(_llama_cfg(r["config"]), **_kw(r))
            errors.append(abs(est.peak / r["peak_bytes"] - 1))
    assert len(errors) == 60
    assert np.median(errors) <= 0.05 and max(errors) <= 0.15, (np.median(errors), max(errors))


def test_amp_states_and_cache():
    r = next(x for x in _measured() if x["mode"] == "train_amp")
    est = lj.estimate_memory(_llama_cfg(r["config"]), **_kw(r))
    p = r["params"]
    assert est.weights == 4 * p and est.optimizer == 8 * p and est.gradients == 4 * p
    bf16 = lj.estimate_memory(_llama_cfg(r["config"]), batch=r["batch"], seq_len=r["seq"])
    assert bf16.optimizer == 4 * p  # PyTorch AdamW: moments in the parameters' dtype
    mixed = lj.estimate_memory(_llama_cfg(r["config"]), batch=1, seq_len=16,
                               optimizer="adamw_mixed")
    assert mixed.optimizer == 12 * p


def test_weights_and_kv_within_one_percent():
    for r in _measured():
        cfg = _llama_cfg(r["config"])
        if r["mode"] == "infer_bf16":
            est = lj.estimate_memory(cfg, **_kw(r))
            kv = r["after_prefill_bytes"] - r["weights_bytes"] - r["batch"] * r["config"][
                "vocab"] * 2
            assert est.kv_cache == pytest.approx(kv, rel=0.01)
        if r["params"] >= 8e8:
            est = lj.estimate_memory(cfg, **_kw(r))
            assert est.weights == pytest.approx(r["weights_bytes"], rel=0.01)


def test_training_tokens_per_second_target():
    errors = []
    for r in _measured():
        if r["mode"].startswith("train") and r["params"] >= 8e8:
            est = lj.estimate_throughput(_llama_cfg(r["config"]), gpu="H100-SXM", **_kw(r))
            errors.append(abs(est.tokens_per_second / r["tokens_per_s"] - 1))
    assert len(errors) == 40
    assert np.median(errors) <= 0.25, np.median(errors)


def test_prefill_seconds_target():
    """Serving's prefill (one forward pass over the prompts) against the 15 measured H100
    inference runs (tests/data: transformers forward, batch 1-8, 512-2048 tokens): the small
    batches are bound by eager PyTorch's host time, the large ones by the GEMMs."""
    errors = []
    for r in _measured():
        if r["mode"] == "infer_bf16":
            est = lj.estimate_throughput(_llama_cfg(r["config"]), gpu="H100-SXM", **_kw(r))
            errors.append(abs(est.prefill_seconds / r["prefill_s"] - 1))
            assert est.prefill_tokens_per_second == pytest.approx(
                r["batch"] * r["seq"] / est.prefill_seconds, rel=1e-5)
    assert len(errors) == 15
    assert np.median(errors) <= 0.15 and max(errors) <= 0.35, (np.median(errors), max(errors))


def test_fp8_gemm_speedup_within_ten_percent():
    with open(data_path("measured_h100_pytorch.jsonl")) as f:
        gemms = [json.loads(x) for x in f if '"matmul"' in x]
    peak = gpu_spec("H100-SXM").peak_flops
    checked = 0
    for g in gemms:
        if g["n"] in (4096, 8192):
            n = g["n"]
            predicted = gemm_seconds(n, n, n, F.BF16, peak) / gemm_seconds(n, n, n, F.FP8_E4M3,
                                                                             peak)
            measured = g["fp8_tflops"] / g["bf16_tflops"]
            assert predicted == pytest.approx(measured, rel=0.10), (n, predicted, measured)
            checked += 1
        else:  # small GEMMs: FP8 pays little
            assert gemm_seconds(2048, 2048, 2048, F.BF16, peak) / gemm_seconds(
                2048, 2048, 2048, F.FP8_E4M3, peak) < 1.6
    assert checked == 2


@pytest.mark.parametrize("zero_stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6),
                                                    (3, 1.9)])
def test_zero_figure_1_through_estimate_memory(zero_stage, expected_gb):
    est = lj.estimate_memory(_one_row_model(7.5e9), batch=64, seq_len=1, gpus=64,
                             optimizer="adamw_mixed", zero_stage=zero_stage)
    assert (est.weights + est.gradients + est.optimizer) / 1e9 == pytest.approx(expected_gb,
                                                                                abs=0.05)


def test_estimate_equals_evaluate():
    """One implementation, two faces: the same configuration through both APIs."""
    sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8), [lj.Tenant(
        "Qwen3-8B", dict(mode="train", batch=16, seq_len=2048, optimizer="adamw"))])
    m = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 8, "tp": 2, "zero_stage": 2,
                                                   "recompute": True, "micro_batch": 4}]))
    est = lj.estimate_memory("Qwen3-8B", batch=16, seq_len=2048, gpus=8, tp=2, zero_stage=2,
                             recompute=True, micro_batch=4)
    assert est.total == pytest.approx(float(m.memory_bytes[0]), rel=1e-5)
    thr = lj.estimate_throughput("Qwen3-8B", batch=16, seq_len=2048, gpus=8, tp=2,
                                 zero_stage=2, recompute=True, micro_batch=4)
    assert thr.step_seconds == pytest.approx(float(m.step_seconds[0]), rel=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divide gpus"):
        lj.estimate_memory("Llama-3.1-8B", batch=1, seq_len=8, gpus=3, tp=2)
    with pytest.raises(ValueError, match="optimizer"):
        lj.estimate_memory("Llama-3.1-8B", batch=1, seq_len=8, optimizer="lion")
    with pytest.raises(ValueError, match="unknown numeric format"):
        lj.estimate_memory("Llama-3.1-8B", batch=1, seq_len=8, weights="fp7")


def test_cli_json_and_table(capsys):
    assert main(["estimate-memory", "Llama-3.1-8B", "--batch", "2", "--seq-len", "1024",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    est = lj.estimate_memory("Llama-3.1-8B", batch=2, seq_len=1024)
    # inputs and outputs under separate keys: the settings survive in the output
    assert out["inputs"]["weights"] == "bf16" and out["inputs"]["optimizer"] == "adamw"
    assert out["inputs"]["batch"] == 2
    assert out["memory_bytes_per_gpu"]["peak"] == pytest.approx(est.peak)
    assert out["memory_bytes_per_gpu"]["weights"] == pytest.approx(est.weights)
    assert main(["estimate-throughput", "Qwen2.5-7B", "--gpu", "H200", "--mode", "serve",
                 "--batch", "32", "--kv-precision", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "H200" in text
    with pytest.raises(SystemExit) as e:
        main(["estimate-memory", "no-such-model"])
    assert e.value.code == 2
    err = capsys.readouterr().err  # a bad value: one line, no usage block
    assert err.count("\n") == 1 and err.startswith("libratio: error: ") and "no-such-model" in err


def test_cli_fits_a_gpu_and_names_the_number_to_trust(capsys):
    est = lj.estimate_memory("Llama-3.1-8B", batch=1, seq_len=4096)
    hbm = gpu_spec("H200").hbm_bytes
    assert main(["estimate-memory", "Llama-3.1-8B", "--gpu", "H200", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    assert fit["fits"] == (est.total <= hbm)
    assert fit["headroom_bytes"] == pytest.approx(hbm - est.total)
    assert main(["estimate-memory", "Llama-3.1-8B", "--gpu", "A100-40GB"]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "short" in text and "total is the number to trust" in text


def test_cli_ambiguous_gpu_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate-memory", "Qwen3-0.6B", "--gpu", "A100"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "A100-80GB" in err and "A100-40GB" in err


def test_cli_listings_version_and_help(capsys):
    for what, expected in (("models", "Llama-3.1-8B"), ("gpus", "H100-SXM"),
                           ("formats", "nvfp4")):
        assert main([what]) == 0
        assert expected in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and lj.__version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["estimate-memory", "--help"])
    help_text = capsys.readouterr().out
    for option in ("--batch", "--seq-len", "--gpu", "--optimizer", "--recompute"):
        assert option in help_text
    assert "(default: 4096)" in help_text  # defaults are shown
    for command, default in (("serve", "(default: 8000)"), ("eval", "(default: 0.0)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert default in capsys.readouterr().out


def test_python_and_cli_defaults_agree():
    a = lj.estimate_throughput("Llama-3.2-1B")  # batch and seq_len default as in the CLI
    b = lj.estimate_throughput("Llama-3.2-1B", gpu="H100-SXM", batch=1, seq_len=4096)
    assert a == b


def _t5_3b_like():
    """2,851.6 M parameters whose largest layer is t5-3b's shared 32,128 x 1,024 embedding
    (32.9 M); the other rows are smaller. Only totals matter to the model-state estimate."""
    from libratio_jax.physics import architecture as A

    emb = 32128 * 1024
    total = 2_851_598_336
    rest = total - emb
    n = 100
    rows = [(A.EMBEDDING, emb, 0.0, 1, 1024, 1, 0.0, -1, 1)]
    rows += [(A.MLP_IN, rest // n + (1 if i < rest % n else 0), 1.0, 1, 1, 1, 0.0, i, 1)
             for i in range(n)]
    # vocab=1 and no saved activations: the activations are the gathered layer alone.
    scalars = dict(n_blocks=n, hidden=1024, n_heads=32, n_kv_heads=32, head_dim=32,
                   vocab=1, n_experts=0, experts_per_token=0,
                   block_act_bytes_per_token=0.0, n_rows=len(rows))
    spec = A.pack_rows(rows, scalars, len(rows))
    assert abs(spec.total_params - total) < 1000  # float32 rows
    return spec


@pytest.mark.parametrize("offload,expected_gib", [("optimizer+params", 0.12),
                                                  ("optimizer", 0.79), ("none", 6.10)])
def test_deepspeed_zero3_model_states_t5_3b(offload, expected_gib):
    """DeepSpeed's documented estimate_zero3_model_states_mem_needs for t5-3b on 1 node x 8
    GPUs (per GPU, GiB to two decimals): mixed-precision AdamW with FP32 gradient partitions
    (2 + 4 + 12 = 18 bytes/param) plus one gathered layer (4 bytes/param of the largest)."""
    est = lj.estimate_memory(_t5_3b_like(), batch=8, seq_len=1, gpus=8, zero_stage=3,
                             optimizer="adamw_mixed", gradient_dtype="fp32", offload=offload)
    states = (est.weights + est.gradients + est.optimizer + est.activations) / 2**30
    assert round(states, 2) == expected_gib


def _extra():
    path = __file__.replace("test_estimate.py", "data/measured_h100_extra.jsonl")
    with open(path) as f:
        return [json.loads(x) for x in f]


def test_extra_h100_measurements_qwen_shapes():
    """Measured here (benchmarks/measure_h100.py on the lent H100): Qwen2/Qwen3-shaped models
    the shared file lacks (biases, q/k norms, head_dim != hidden/heads, 152k vocabulary)."""
    train = [r for r in _extra() if r.get("mode") == "train_bf16"]
    assert len(train) == 15
    mem_err, tok_err = [], []
    for r in train:
        assert lj.ModelSpec.from_hf_config(r["config"]).total_params == r["params"]
        kw = dict(batch=r["batch"], seq_len=r["seq"], recompute=r["grad_ckpt"])
        mem_err.append(abs(lj.estimate_memory(r["config"], **kw).peak / r["peak_bytes"] - 1))
        if r["params"] >= 8e8:
            t = lj.estimate_throughput(r["config"], **kw).tokens_per_second
            tok_err.append(abs(t / r["tokens_per_s"] - 1))
    assert np.median(mem_err) <= 0.05 and max(mem_err) <= 0.15, (np.median(mem_err),
                                                                  max(mem_err))
    assert np.median(tok_err) <= 0.25, tok_err


def test_extra_fp8_gemm_shapes():
    peak = gpu_spec("H100-SXM").peak_flops
    gemms = [r for r in _extra() if r.get("kind") == "matmul" and min(r["m"], r["n"],
                                                                         r["k"]) >= 4096]
    assert len(gemms) == 4
    for g in gemms:
        m, n, k = g["m"], g["n"], g["k"]
        pred = gemm_seconds(m, n, k, F.BF16, peak) / gemm_seconds(m, n, k, F.FP8_E4M3, peak)
        assert pred == pytest.approx(g["fp8_tflops"] / g["bf16_tflops"], rel=0.10)
