"""A plain-Python reference of the physics (loops over rows, Python floats, no JAX).

Written from the equations in docs/physics.md, independently of the JAX code: it shares only
the published constants (format table, GPU catalog, calibration constants). The tests compare
``lj.evaluate`` with it on random plans; the benchmarks use it as the per-plan baseline.
"""

from __future__ import annotations

import math

import numpy as np

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics import memory as MEM
from libratio_jax.physics import safety as SAF
from libratio_jax.physics import stability as STAB
from libratio_jax.physics import throughput as THR

FIELDS = ("kind", "params", "flops_per_token", "in_dim", "out_dim", "gemm_instances",
          "act_bytes_per_token", "block", "count", "valid")
SCALARS = ("n_blocks", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "n_experts",
           "experts_per_token", "block_act_bytes_per_token")
POOL = ("gpu_count", "hbm_bytes", "hbm_bytes_per_second", "nvlink_bytes_per_second",
        "network_bytes_per_second", "gpus_per_node", "tdp_watts", "idle_watts",
        "slowdown_celsius", "shutdown_celsius", "thermal_resistance_celsius_per_watt", "valid")


def scenario_to_python(sc) -> dict:
    """Host copies of a Scenario as nested Python lists/floats."""
    m = sc.num_tenants
    models = []
    for i in range(m):
        rows = [dict(zip(FIELDS, vals, strict=True)) for vals in zip(
            *[np.asarray(getattr(sc.models, f))[i].tolist() for f in FIELDS], strict=True)]
        sc_ = {k: float(np.asarray(getattr(sc.models, k))[i]) for k in SCALARS}
        models.append({"rows": rows, **sc_})
    w = sc.workloads
    works = [{k: float(np.asarray(getattr(w, k))[i]) for k in
              ("mode", "batch", "seq_len", "optimizer", "priority", "slo_tokens_per_second")}
             for i in range(m)]
    c = sc.cluster
    pools = [{k: float(np.asarray(getattr(c, k))[p]) for k in POOL}
             | {"peak_flops": np.asarray(c.peak_flops)[p].tolist()}
             for p in range(c.gpu_count.shape[-1])]
    return {"models": models, "workloads": works, "pools": pools,
            "present": np.asarray(sc.present).tolist(), "inlet": float(c.inlet_celsius),
            "power_cap": float(c.power_cap_watts)}


def plan_to_python(plan, b=None) -> list[dict]:
    get = (lambda x: np.asarray(x)) if b is None else (lambda x: np.asarray(x)[b])
    prec = get(plan.precision).tolist()
    out = []
    for i in range(len(prec)):
        out.append({"precision": prec[i]} | {
            k: int(get(getattr(plan, k))[i]) for k in
            ("gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision", "micro_batch",
             "pool")})
    return out


def _opt_bytes(fmt: int, optimizer: int) -> float:
    """Optimizer-state bytes per parameter (ids: adamw_mixed, adamw, sgd_momentum, sgd)."""
    storage = float(F.STORAGE_BYTES[fmt])
    own = max(storage, 2.0)  # moments in the parameters' dtype, at least 16 bits
    master = 0.0 if storage >= 4.0 else 4.0
    return {0: master + 8.0, 1: 2.0 * own, 2: own}.get(optimizer, 0.0)


def tenant_memory(model, work, t) -> dict:
    tp, pp = max(t["tp"], 1), max(t["pp"], 1)
    dp = max(t["gpus"] // (tp * pp), 1)
    mb = max(t["micro_batch"], 1)
    train = work["mode"] == 0
    w = g = o = gh = act_in = act_out = 0.0
    for r, fmt in zip(model["rows"], t["precision"], strict=True):
        if not r["valid"]:
            continue
        storage = float(F.STORAGE_BYTES[fmt])
        grad = max(storage, 2.0)
        w += r["params"] * storage
        g += r["params"] * grad
        o += r["params"] * _opt_bytes(fmt, int(work["optimizer"]))
        if r["kind"] == A.LM_HEAD:
            gh += r["params"] * grad
        act = float(F.ACTIVATION_BYTES[fmt])
        scale = (4.0 + act) / 6.0 if r["kind"] == A.NORM else act / 2.0
        a = r["act_bytes_per_token"] * scale
        if r["block"] >= 0:
            act_in += a
        else:
            act_out += a
    shard = tp * pp
    weights = w / shard / (dp if t["zero_stage"] >= 3 else 1)
    gathered = 0.0
    if t["zero_stage"] >= 3:  # one whole layer and its gradient gathered at a time
        gathered = max(r["params"] / max(r["count"], 1.0) * (
            float(F.STORAGE_BYTES[f]) + max(float(F.STORAGE_BYTES[f]), 2.0))
            for r, f in zip(model["rows"], t["precision"], strict=True) if r["valid"]) / tp
    grads = g / shard / (dp if t["zero_stage"] >= 2 else 1)
    gh = gh / shard / (dp if t["zero_stage"] >= 2 else 1)
    opt = o / shard / (dp if t["zero_stage"] >= 1 else 1)
    blocks_act = act_in + model["n_blocks"] * model["block_act_bytes_per_token"]
    m = max(work["batch"] / (dp * mb), 1.0)
    inflight = min(pp, m) / pp
    tokens_mb = mb * work["seq_len"]
    if t["recompute"]:
        per_token = (model["n_blocks"] * 2.0 * model["hidden"] * inflight
                     + blocks_act / max(model["n_blocks"], 1.0) + act_out)
    else:
        per_token = blocks_act * inflight + act_out
    replica = work["batch"] / dp
    if train:
        acts = tokens_mb * per_token / tp + gathered
        logits = tokens_mb * model["vocab"] * MEM.LOGITS_TRAIN_BYTES_PER_ELEMENT / tp
        kv = 0.0
        peak = weights + opt + max(grads, acts + logits + gh)
    else:
        grads = opt = 0.0
        acts = tokens_mb * blocks_act / max(model["n_blocks"], 1.0) / tp + gathered
        logits = replica * model["vocab"] * MEM.LOGITS_SERVE_BYTES_PER_ELEMENT / tp
        kv = (2.0 * model["n_blocks"] * model["n_kv_heads"] * model["head_dim"]
              * float(F.STORAGE_BYTES[t["kv_precision"]]) * replica * work["seq_len"] / shard)
        peak = weights + kv + acts + logits
    overhead = MEM.CUDA_CONTEXT_BYTES + MEM.FRAGMENTATION_FRACTION * peak
    return dict(weights=weights, gradients=grads, optimizer=opt, activations=acts,
                logits=logits, kv_cache=kv, overhead=overhead, total=peak + overhead)


def _allreduce(size, n, bw):
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * size / bw + THR.ALLREDUCE_LATENCY_SECONDS


def tenant_step(model, work, pool, t, precision=None, kv_precision=None) -> dict:
    precision = t["precision"] if precision is None else precision
    kv_fmt = t["kv_precision"] if kv_precision is None else kv_precision
    tp, pp = max(t["tp"], 1), max(t["pp"], 1)
    dp = max(t["gpus"] // (tp * pp), 1)
    mb = max(t["micro_batch"], 1)
    train = work["mode"] == 0
    peak = pool["peak_flops"]
    bw = pool["hbm_bytes_per_second"]
    bw_tp = pool["nvlink_bytes_per_second"] if tp <= pool["gpus_per_node"] else pool[
        "network_bytes_per_second"]
    bw_dp = pool["nvlink_bytes_per_second"] if tp * pp * dp <= pool["gpus_per_node"] else pool[
        "network_bytes_per_second"]

    def rate(fmt):
        cc = int(F.COMPUTE_CLASS[fmt])
        if peak[cc] <= 0:
            cc = F.CC_BF16
        return peak[cc] * float(THR.MFU[cc]), float(THR.GEMM_FIXED_SECONDS[cc])

    passes = 3.0 + (1.0 if t["recompute"] else 0.0)
    tokens_replica = work["batch"] * work["seq_len"] / dp
    m = max(work["batch"] / (dp * mb), 1.0)
    seqs = work["batch"] / dp
    k, e = model["experts_per_token"], max(model["n_experts"], 1.0)
    touched = 1.0 - min(max(1.0 - k / e, 0.0), 1.0) ** seqs
    roof_sum = launch_sum = grad_sum = 0.0
    for r, fmt in zip(model["rows"], precision, strict=True):
        if not r["valid"]:
            continue
        expert = r["kind"] in (A.MOE_EXPERT_IN, A.MOE_EXPERT_OUT)
        visits = (k if expert else 1.0) * r["count"]
        storage = float(F.STORAGE_BYTES[fmt])
        act = float(F.ACTIVATION_BYTES[fmt])
        cast = float(F.NEEDS_SCALING[fmt]) * F.CAST_BYTES_PER_ELEMENT
        io = visits * ((r["in_dim"] + r["out_dim"]) * act + cast * r["in_dim"])
        w_bytes = r["params"] * storage
        rt, t_gemm = rate(fmt)
        fixed = t_gemm if r["flops_per_token"] > 0 else THR.KERNEL_LAUNCH_SECONDS
        if train:
            flops = passes * tokens_replica * r["flops_per_token"]
            traffic = passes * m * w_bytes + passes * tokens_replica * io
            launches = passes * m * r["gemm_instances"]
        else:
            flops = seqs * r["flops_per_token"]
            traffic = (touched if expert else 1.0) * w_bytes + seqs * io
            launches = r["count"]
        roof_sum += max(flops / rt, traffic / bw)
        launch_sum += launches * fixed
        grad_sum += r["params"] * max(storage, 2.0)
    roof_sum /= tp
    bf16_rate = rate(F.BF16)[0]
    q_dim = model["n_heads"] * model["head_dim"]
    nb = model["n_blocks"]
    if train:
        attn = (passes * nb * 2.0 * q_dim * work["seq_len"] * tokens_replica
                / (bf16_rate * THR.ATTENTION_EFFICIENCY))
    else:
        kv_read = (2.0 * nb * model["n_kv_heads"] * model["head_dim"]
                   * float(F.STORAGE_BYTES[kv_fmt]) * seqs * work["seq_len"])
        attn = max(nb * 4.0 * q_dim * work["seq_len"] * seqs
                   / (bf16_rate * THR.ATTENTION_EFFICIENCY), kv_read / bw)
    attn /= tp
    core = (roof_sum + attn) / pp
    bubble = (m + pp - 1.0) / m if train else 1.0
    kernels = (roof_sum + launch_sum + attn) / pp * bubble
    if train:
        saved = sum(r["act_bytes_per_token"] for r in model["rows"]
                    if r["valid"] and r["block"] >= 0) / max(nb, 1.0) + model[
            "block_act_bytes_per_token"]
        elementwise = (tokens_replica * nb * saved * THR.ELEMENTWISE_BYTES_PER_SAVED_BYTE
                       * passes / 3.0)
        loss = tokens_replica * model["vocab"] * THR.LOSS_BYTES_PER_LOGIT
        w_total = sum(r["params"] * float(F.STORAGE_BYTES[f])
                      for r, f in zip(model["rows"], precision, strict=True) if r["valid"])
        opt_step = w_total * THR.OPTIMIZER_STEP_BYTES_PER_WEIGHT_BYTE / (
            dp if t["zero_stage"] >= 1 else 1)
        host = (nb / pp) * m * (3.0 + 2.0 * bool(t["recompute"])) * \
            THR.HOST_SECONDS_PER_BLOCK_PASS
        kernels = max(kernels + (elementwise + loss) / (tp * pp) / bw, host) + \
            opt_step / (tp * pp) / bw
    if train:
        mb_bytes = mb * work["seq_len"] * model["hidden"] * 2.0
        t_tp = (nb / pp) * m * 2.0 * (passes - 1.0) * _allreduce(mb_bytes, tp, bw_tp)
        t_dp = _allreduce(grad_sum / (tp * pp), dp, bw_dp) * (
            1.5 if t["zero_stage"] >= 3 else 1.0)
        t_pp = 2.0 * m * mb_bytes / tp / bw_tp if pp > 1 else 0.0
        comm = t_tp + (1.0 - THR.DP_OVERLAP) * t_dp + t_pp
        tokens = work["batch"] * work["seq_len"]
    else:
        comm = (nb / pp) * 2.0 * _allreduce(seqs * model["hidden"] * 2.0, tp, bw_tp)
        tokens = work["batch"]
    step = kernels + comm
    return dict(step=step, kernels=kernels, busy=min(max(core / step, 0.0), 1.0),
                tokens=tokens / step)


def tenant_stability(model, work, t):
    serve = work["mode"] != 0
    logs, weights = [], []
    for r, fmt in zip(model["rows"], t["precision"], strict=True):
        if not r["valid"]:
            continue
        tol = float(STAB.TOLERANCE[r["kind"]]) * (STAB.SERVE_TOLERANCE_FACTOR if serve else 1.0)
        lg = -float(F.EFFECTIVE_ROUNDOFF[fmt]) / tol
        if fmt == F.FP16 and not serve:
            lg += math.log(STAB.FP16_TRAIN_FACTOR)
        logs.append(lg)
        weights.append(r["count"])
    if serve:
        logs.append(-float(F.EFFECTIVE_ROUNDOFF[t["kv_precision"]])
                    / (STAB.SERVE_TOLERANCE_FACTOR * STAB.KV_CACHE_TOLERANCE))
        weights.append(1.0)
    score = math.exp(sum(lg * w for lg, w in zip(logs, weights, strict=True)) / sum(weights))
    return score, min(logs) < math.log(STAB.DIVERGENCE_THRESHOLD)


def evaluate(scp: dict, plan: list[dict]) -> dict:
    """Reference metrics for one plan: per-tenant lists plus cluster values."""
    out = {k: [] for k in ("memory_bytes", "fits", "step_seconds", "tokens_per_second",
                           "speedup_vs_bf16", "stability", "diverges", "power_watts",
                           "temperature_celsius", "memory_weights_bytes",
                           "memory_kv_cache_bytes", "memory_activations_bytes")}
    used = [0] * len(scp["pools"])
    power_total = 0.0
    for i, t in enumerate(plan):
        model, work = scp["models"][i], scp["workloads"][i]
        pool = scp["pools"][min(max(t["pool"], 0), len(scp["pools"]) - 1)]
        present = scp["present"][i]
        active = present and t["gpus"] > 0
        if present:
            used[min(max(t["pool"], 0), len(scp["pools"]) - 1)] += t["gpus"]
        mem = tenant_memory(model, work, t)
        st = tenant_step(model, work, pool, t)
        base = tenant_step(model, work, pool, t, [F.BF16] * len(t["precision"]), F.BF16)
        power = gpu_power(st["busy"], pool)
        temp = scp["inlet"] + pool["thermal_resistance_celsius_per_watt"] * power
        span = max(pool["shutdown_celsius"] - pool["slowdown_celsius"], 1e-3)
        over = min(max((temp - pool["slowdown_celsius"]) / span, 0.0), 1.0)
        clock = 1.0 - (1.0 - SAF.THROTTLE_FLOOR) * over
        step = st["step"] + st["kernels"] * (1.0 / clock - 1.0)
        score, div = tenant_stability(model, work, t)
        frac = mem["total"] / pool["hbm_bytes"]

        def on(x, _active=active):
            return x if _active else 0.0

        out["memory_bytes"].append(on(mem["total"]))
        out["memory_weights_bytes"].append(on(mem["weights"]))
        out["memory_kv_cache_bytes"].append(on(mem["kv_cache"]))
        out["memory_activations_bytes"].append(on(mem["activations"]))
        out["fits"].append((active and frac <= 1.0) if present else True)
        out["step_seconds"].append(on(step))
        out["tokens_per_second"].append(on(st["tokens"] * st["step"] / step))
        out["speedup_vs_bf16"].append(on(base["step"] / st["step"]))
        out["stability"].append(on(score))
        out["diverges"].append(active and div)
        out["power_watts"].append(on(power))
        out["temperature_celsius"].append(on(temp))
        if active:
            power_total += power * t["gpus"]
    for p, pool in enumerate(scp["pools"]):
        if pool["valid"]:
            power_total += max(pool["gpu_count"] - used[p], 0) * pool["idle_watts"]
    out["gpus_used"] = used
    out["overcommitted"] = any(u > (pool["gpu_count"] if pool["valid"] else 0)
                               for u, pool in zip(used, scp["pools"], strict=True))
    out["cluster_power_watts"] = power_total
    return out


def gpu_power(busy, pool):  # noqa: N802
    return pool["idle_watts"] + (pool["tdp_watts"] - pool["idle_watts"]) * min(max(busy, 0.0), 1.0)


def team_reward(scp: dict, plan: list[dict], weights=(0.5, 0.3, 0.2), floor=0.01) -> float:
    """The team reward ``G`` of one plan with the IRD floor, from the reference metrics
    (rewards/compose.py and rewards/ird.py, in plain Python)."""
    m = evaluate(scp, plan)
    wt, ws, we = weights
    num = den = 0.0
    fired = m["overcommitted"] or m["cluster_power_watts"] > scp["power_cap"]
    n_pools = len(scp["pools"])
    for i, t in enumerate(plan):
        if not scp["present"][i]:
            continue
        work = scp["workloads"][i]
        pool = scp["pools"][min(max(t["pool"], 0), n_pools - 1)]
        active = t["gpus"] > 0
        slo = work["slo_tokens_per_second"]
        thr = (min(1.0, m["tokens_per_second"][i] / slo) if slo > 0
               else min(1.0, m["speedup_vs_bf16"][i] / 2.0))
        eff = min(max(1.0 - t["gpus"] / max(pool["gpu_count"], 1.0), 0.0), 1.0)
        ok = active and m["fits"][i] and not m["diverges"][i]
        u = (wt * thr + ws * m["stability"][i] + we * eff) / (wt + ws + we) if ok else 0.0
        num += work["priority"] * u
        den += work["priority"]
        rows = scp["models"][i]["rows"]
        bits = [F.STORAGE_BITS[f] for f, r in zip(t["precision"], rows, strict=True)
                if r["valid"]]
        fired |= all(b <= 4.5 for b in bits)  # all_lowest_precision (4-bit formats)
        fired |= work["batch"] > 0 and not active  # starved
        fired |= active and not m["fits"][i]  # out_of_memory
        fired |= active and m["diverges"][i]  # diverges
    return floor if fired else num / max(den, 1e-9)
