#!/usr/bin/env bash
# One lent GPU's checks and measurements in one call (docs/performance.md, "On one H100"):
# the class path's parity tests on the device, one call's kernels (profile_evaluate.py), the
# same with the fences as lax.optimization_barrier (--barrier: the first thing to measure, the
# twenty-seventh round's ~20 ms per-entry fusion), then the throughput (evaluate_throughput.py)
# and the Fleet environment (env_throughput.py).
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh      # from the repository's root
#
# BATCHES (default "1 65536 1048576"), PROFILE_BATCH (1048576) and ENVS (65536) set
# the sizes.
# Needs JAX with a GPU backend, flax, optax, chex, pytest and hypothesis where it runs; the
# project's other dependencies (orjson, msgspec) as wheels in .whl/ if they are missing
# there (installed into /tmp/site). Everything it prints also goes to $OUT/log.txt; the
# results are written under $OUT (copy them into benchmarks/results/ to commit them). Its
# steps' limits add up to 585 s (the device tool allows 600 s a command): the throughput
# step writes its JSON only at its end, and its records are in the log if it is cut short.
set -uo pipefail
OUT=${OUT:-runs/gpu}
BATCHES=${BATCHES:-1 65536 1048576}
PROFILE_BATCH=${PROFILE_BATCH:-1048576}
ENVS=${ENVS:-65536}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
start=$(date +%s)
step() { echo "=== $1 at $(( $(date +%s) - start )) s"; }
quiet() { grep -v "bfc_allocator\|^W[0-9]\{4\} \|compiling, then"; }
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  step "parity on the device"
  timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_kernel.py -k \
    "parity_with_python_reference or vmap_equals_loop or class_counts_equal or merged_batch_equals or format_counts_equal or largest_held or launches_regrouped" \
    2>&1 | tail -15
  step "kernels of one call"
  timeout 90 python3 benchmarks/profile_evaluate.py --batch "$PROFILE_BATCH" \
    --out "$OUT/profile_evaluate_gpu.json" 2>&1 | quiet
  step "kernels of one call, fenced by lax.optimization_barrier"
  timeout 80 python3 benchmarks/profile_evaluate.py --batch "$PROFILE_BATCH" --barrier \
    --out "$OUT/profile_evaluate_barrier_gpu.json" 2>&1 | quiet
  step "throughput"
  timeout 230 python3 benchmarks/evaluate_throughput.py --batches $BATCHES \
    --single-call-trials 1 --out "$OUT/evaluate_throughput_gpu.json" 2>&1 | quiet
  step "Fleet-v0"
  timeout 75 python3 benchmarks/env_throughput.py --envs "$ENVS" \
    --out "$OUT/env_throughput_gpu.json" 2>&1 | quiet
  step done
} 2>&1 | tee "$OUT/log.txt"
