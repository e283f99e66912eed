"""Physics against published numbers, measured H100 records and invariants."""

import json

import numpy as np
import pytest

import libratio_jax as lj
from conftest import data_path
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics import memory
from libratio_jax.physics.plan import sample_plans


def _one_row_model(params: float) -> lj.ModelSpec:
    rows = [(A.MLP_IN, params, 2 * params, 1, 1, 1, 0.0, 0, 1)]
    scalars = dict(n_blocks=1, hidden=1, n_heads=1, n_kv_heads=1, head_dim=1, vocab=1,
                   n_experts=0, experts_per_token=0, block_act_bytes_per_token=0.0, n_rows=1)
    return A.pack_rows(rows, scalars, 1)


@pytest.mark.parametrize("zero_stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6),
                                                    (3, 1.9)])
def test_zero_paper_figure_1(zero_stage, expected_gb):
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5 B, N_d = 64, K = 12 (mixed-precision Adam).
    model = _one_row_model(7.5e9)
    w = lj.Workload.make(mode="train", batch=64, seq_len=1, optimizer="adamw_mixed")
    mem = memory.tenant_memory(model, w, np.array([F.BF16]), F.BF16, 1, 1, 64, zero_stage, 0,
                               1.0)
    states = float(mem.weights + mem.gradients + mem.optimizer) / 1e9
    assert states == pytest.approx(expected_gb, abs=0.05)


def test_kv_cache_formula():
    spec = lj.ModelSpec.from_hf_config("Llama-3.1-8B")
    # 2 (K and V) * 32 blocks * 8 KV heads * 128 head_dim * 2 bytes = 131072 bytes per token.
    per_token = float(memory.kv_cache_bytes(spec, F.BF16, 1.0, 1.0))
    assert per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert float(memory.kv_cache_bytes(spec, F.FP8_E4M3, 4.0, 1000.0)) == 131072 / 2 * 4000


def _measured():
    with open(data_path("measured_h100_pytorch.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if "model" in r]


def _llama_cfg(c):
    return {"model_type": "llama", "hidden_size": c["hidden"], "intermediate_size": c["ffn"],
            "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
            "tie_word_embeddings": False}


def _predict(r, fmt=F.BF16, optimizer="adamw"):
    spec = lj.ModelSpec.from_hf_config(_llama_cfg(r["config"]))
    mode = "serve" if r["mode"].startswith("infer") else "train"
    w = lj.Workload.make(mode=mode, batch=r["batch"], seq_len=r["seq"], optimizer=optimizer)
    prec = np.full(spec.capacity, fmt, np.int32)
    return spec, memory.tenant_memory(spec, w, prec, F.BF16, 1, 1, 1, 0, int(r["grad_ckpt"]),
                                      float(r["batch"]))


def test_measured_param_counts_and_weights():
    # The first run of a process also holds a cuBLAS workspace (llama-s, +5 MiB): compare with
    # the smallest figure measured for each model.
    smallest = {}
    for r in _measured():
        key = (r["model"], r["mode"] == "train_amp")
        smallest[key] = min(smallest.get(key, np.inf), r["weights_bytes"])
    for r in _measured():
        spec, mem = _predict(r, F.FP32 if r["mode"] == "train_amp" else F.BF16)
        assert spec.total_params == r["params"]
        measured = smallest[(r["model"], r["mode"] == "train_amp")]
        err = abs(float(mem.weights) - measured) / measured
        # allocator rounding adds a few MiB; below 1% for the >= 0.8 B models
        assert err < (0.01 if r["params"] > 8e8 else 0.025), (r["model"], err)


def test_measured_adamw_state_bytes():
    for r in _measured():
        if r["mode"] == "train_bf16":  # bf16 weights, AdamW moments in bf16: 4 B/param
            states = r["steady_bytes"] - r["weights_bytes"]
            _, mem = _predict(r)
            assert float(mem.optimizer) == 4 * r["params"]
            # small models carry a few tens of MB of other buffers (workspaces, the last loss)
            assert states == pytest.approx(4 * r["params"], rel=0.03 if r["params"] > 8e8
                                           else 0.12)
        if r["mode"] == "train_amp":  # fp32 weights (4 B) + fp32 moments (8 B)
            _, mem = _predict(r, F.FP32, "adamw")
            assert float(mem.weights) == 4 * r["params"]
            assert float(mem.optimizer) == 8 * r["params"]
            assert r["steady_bytes"] == pytest.approx(12 * r["params"], rel=0.03 if r[
                "params"] > 8e8 else 0.05)


def test_measured_kv_cache():
    for r in _measured():
        if r["mode"] != "infer_bf16":
            continue
        _, mem = _predict(r)
        last_logits = r["batch"] * r["config"]["vocab"] * 2  # bf16 logits of the last position
        kv_measured = r["after_prefill_bytes"] - r["weights_bytes"] - last_logits
        assert float(mem.kv_cache) == pytest.approx(kv_measured, rel=0.01), r


def test_measured_training_peaks_and_recompute_cut():
    by_key = {}
    for r in _measured():
        if r["mode"] != "train_bf16":
            continue
        _, mem = _predict(r)
        rel = float(mem.peak) / r["peak_bytes"] - 1.0
        assert abs(rel) < 0.10, (r["model"], r["batch"], r["seq"], r["grad_ckpt"], rel)
        by_key[(r["model"], r["batch"], r["seq"], r["grad_ckpt"])] = (float(mem.peak),
                                                                       r["peak_bytes"])
    for (model, b, s, ckpt), (pred, meas) in by_key.items():
        if ckpt or (model, b, s, True) not in by_key:
            continue
        pred_c, meas_c = by_key[(model, b, s, True)]
        assert pred_c <= pred and meas_c <= meas
        # activation growth with batch x sequence: same tokens, same peak
        if (model, 4, 512, False) in by_key and (model, 1, 2048, False) in by_key:
            assert by_key[(model, 4, 512, False)][0] == pytest.approx(
                by_key[(model, 1, 2048, False)][0], rel=1e-6)


def test_memory_monotone_in_bytes_per_element():
    """Swapping a format for one with no more bytes per element in every column (storage,
    gradient, optimizer state, saved activation) never increases memory. (FP32 -> BF16 is not
    such a swap under mixed-precision AdamW: BF16 adds the FP32 master copy.)"""
    sc = lj.reference_scenario(block_groups=2)
    plans = sample_plans(sc, 16, seed=11)
    base = lj.evaluate(sc, plans)
    cols = np.asarray(memory.format_bytes_columns(0))  # the reference scenario: adamw_mixed
    pairs = [(a, b) for a in range(F.NUM_FORMATS) for b in range(F.NUM_FORMATS)
             if a != b and np.all(cols[b] <= cols[a])]
    assert (F.BF16, F.FP8_E4M3) in pairs and (F.FP16, F.FP8_E5M2) in pairs
    for src, dst in pairs:
        prec = np.asarray(plans.precision).copy()
        prec[prec == src] = dst
        lower = lj.evaluate(sc, plans.replace(precision=np.asarray(prec)))
        assert np.all(np.asarray(lower.memory_bytes) <= np.asarray(base.memory_bytes) * (
            1 + 1e-6)), (F.format_name(src), F.format_name(dst))
    kv = plans.replace(kv_precision=np.full_like(np.asarray(plans.kv_precision), F.INT4))
    assert np.all(np.asarray(lj.evaluate(sc, kv).memory_kv_cache_bytes)
                  <= np.asarray(base.memory_kv_cache_bytes) * (1 + 1e-6))


def test_zero3_more_gpus_never_more_memory():
    for name in ("Llama-3.1-8B", "Qwen3-30B-A3B"):
        sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 64),
                               [lj.Tenant(name, dict(batch=64, seq_len=2048))])
        prev = np.inf
        for g in (1, 2, 4, 8, 16, 32, 64):
            m = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": g, "zero_stage": 3}]))
            cur = float(m.memory_bytes[0])
            assert cur <= prev
            prev = cur


def test_does_not_fit_is_flagged():
    # Full fine-tuning with mixed-precision AdamW needs 16 B/param: 128 GB for 8 B params.
    sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8),
                           [lj.Tenant("Llama-3.1-8B", dict(batch=8, seq_len=4096))])
    one = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 1}]))
    assert not bool(one.fits[0]) and float(one.memory_fraction[0]) > 1
    sharded = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 4, "zero_stage": 3,
                                                         "recompute": True}]))
    assert bool(sharded.fits[0])


def test_fp8_speeds_up_large_gemms_but_not_embedding():
    sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8),
                           [lj.Tenant("Llama-3.1-8B", dict(batch=32, seq_len=4096))])
    mk = lambda p: lj.Plan.from_choices(sc, [{"gpus": 8, "precision": p,  # noqa: E731
                                              "zero_stage": 1}])
    fp8 = lj.evaluate(sc, mk({"default": "bf16", "mlp": "fp8", "attention": "fp8"}))
    bf16 = lj.evaluate(sc, mk("bf16"))
    s = float(fp8.speedup_vs_bf16[0])
    assert 1.2 < s < 2.0  # FP8 doubles peak, not end-to-end speed
    assert float(bf16.speedup_vs_bf16[0]) == pytest.approx(1.0)
    emb = lj.evaluate(sc, mk({"default": "bf16", "embedding": "fp8", "lm_head": "fp8"}))
    assert bool(emb.diverges[0]) and not bool(fp8.diverges[0])


def test_block_groups_same_physics_for_uniform_groups():
    full = lj.reference_scenario()
    merged = lj.reference_scenario(block_groups=1)
    choices = [{"gpus": 2, "precision": {"default": "bf16", "mlp": "fp8", "attn_qkv": "fp8"},
                "zero_stage": 2, "recompute": True, "kv_precision": "fp8"}] * 4
    a = lj.evaluate(full, lj.Plan.from_choices(full, choices))
    b = lj.evaluate(merged, lj.Plan.from_choices(merged, choices))
    for k in ("memory_bytes", "step_seconds", "speedup_vs_bf16", "stability", "power_watts"):
        np.testing.assert_allclose(np.asarray(getattr(a, k)), np.asarray(getattr(b, k)),
                                   rtol=2e-5, err_msg=k)


def test_hot_inlet_throttles():
    sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8, inlet_celsius=60.0),
                           [lj.Tenant("Llama-3.1-8B", dict(batch=64, seq_len=4096))])
    cool = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8),
                             [lj.Tenant("Llama-3.1-8B", dict(batch=64, seq_len=4096))])
    ch = [{"gpus": 8, "zero_stage": 3}]
    hot_m = lj.evaluate(sc, lj.Plan.from_choices(sc, ch))
    cool_m = lj.evaluate(cool, lj.Plan.from_choices(cool, ch))
    assert bool(hot_m.throttled[0]) and not bool(cool_m.throttled[0])
    assert float(hot_m.step_seconds[0]) > float(cool_m.step_seconds[0])
    assert float(cool_m.power_watts[0]) <= 700.0


def test_overcommit_flagged():
    sc = lj.reference_scenario()
    m = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 4}] * 4))
    assert bool(m.overcommitted) and int(m.gpus_used[0]) == 16
    ok = lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))
    assert not bool(ok.overcommitted)


def test_touched_fraction_matches_float64_including_tiny_fractions():
    """The chance an expert is touched, ``1 - (1 - k/E) ** sequences`` (serving's weight
    reads), equals the float64 formula to 1e-6 relative on a grid of expert fractions and
    sequence counts, where the rounded power's complement loses its digits (small k/E over
    less than one sequence) included, and at the edges (k = E, k = 0, no sequences)."""
    import jax

    from libratio_jax.physics.throughput import touched_fraction

    x = np.concatenate([np.linspace(0.0, 1.0, 65), [1 / 64, 1 / 128, 1e-6, 1.0, 0.0]])
    s = np.concatenate([np.geomspace(1e-3, 1e5, 65), [0.0, 0.5, 3.0, 1e6, 2.0]])
    xx, ss = (a.astype(np.float32) for a in np.meshgrid(x, s))
    got = np.asarray(jax.jit(touched_fraction)(xx, ss), np.float64)
    want = 1.0 - (1.0 - xx.astype(np.float64)) ** ss.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert got[ss == 0].max() == 0.0 and got[(xx == 1) & (ss > 0)].min() == 1.0


def test_evaluate_without_each_equals_evaluating_each_counterfactual():
    """``evaluate_without_each`` (the difference rewards' counterfactuals from the plan's own
    metrics) equals ``evaluate_one`` of each ``null_plan``, every field: valid plans, plans
    out of their domain, an empty tenant slot, over-committed pools; at full resolution
    (merged rows: the env's difference rewards against brute force, tests/test_env.py)."""
    import chex
    import jax
    import jax.numpy as jnp

    from libratio_jax.physics.kernel import evaluate_one, evaluate_sanitized, evaluate_without_each
    from libratio_jax.physics.plan import sanitize_plan
    from libratio_jax.rewards.difference import null_plan

    sc = lj.Scenario.build(
        lj.ClusterSpec.mixed({"A100-80GB": 8, "L40S": 4}),
        [lj.Tenant("Qwen2.5-0.5B", dict(mode="train", batch=64, seq_len=1024)),
         lj.Tenant("Llama-3.2-1B", dict(mode="serve", batch=8, seq_len=2048)),
         lj.Tenant("Qwen2.5-0.5B", dict(mode="serve", batch=16, seq_len=512))],
        max_tenants=4)
    plans = sample_plans(sc, 12, seed=6)
    tp = np.asarray(plans.tp).copy()
    tp[::3, 1] = 3  # divides no head count: out of the domain
    gpus = np.asarray(plans.gpus).copy()
    gpus[1::4, :3] = 8  # more GPUs than a pool has
    plans = plans.replace(tp=jnp.asarray(tp), gpus=jnp.asarray(gpus))

    @jax.jit
    def fast(p):
        safe, valid = sanitize_plan(sc, p)
        return evaluate_without_each(sc, safe, evaluate_sanitized(sc, safe, valid))

    @jax.jit
    def each(p):
        return jax.vmap(lambda i: evaluate_one(*null_plan(sc, p, i)))(jnp.arange(4))

    seen = {"invalid": False, "overcommitted": False}
    for b in range(12):
        p = jax.tree.map(lambda x, b=b: x[b], plans)
        got, want = fast(p), each(p)
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
        seen["invalid"] |= not bool(np.all(np.asarray(want.plan_valid)))
        seen["invalid"] |= not bool(np.all(np.asarray(got.plan_valid)))
        seen["overcommitted"] |= bool(np.any(np.asarray(want.overcommitted)))
    assert all(seen.values()), seen
