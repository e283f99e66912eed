#!/usr/bin/env bash
# One lent GPU's checks and measurements in one call (docs/performance.md, "On one H100" and
# the thirtieth round): the Pallas kernels' tests and the class path's parity tests on the
# device, the class path's per-row forms alone (class_kernels.py), one call's kernels
# (profile_evaluate.py) as the library runs now and as it ran before the thirtieth round
# (--xla-class-path --no-barrier) on the same card, then the throughput
# (evaluate_throughput.py) and the Fleet environment (env_throughput.py).
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh      # from the repository's root
#
# BATCHES (default "1 65536 1048576"), PROFILE_BATCH (1048576) and ENVS (65536) set the sizes.
# Needs JAX with a GPU backend, flax, optax, chex, pytest and hypothesis where it runs; the
# project's other dependencies (orjson, msgspec) as wheels in .whl/ if they are missing
# there (installed into /tmp/site). Everything printed also goes to $OUT/log.txt; results
# are written under $OUT (at most 8 files come back from the device tool: the profiles and
# their traces are packed into profiles.tgz). Its steps' limits add up to 590 s (the device
# tool allows 600 s a command). LIBRATIO_GPU_KERNELS=0 in the environment runs every step
# with XLA's class path.
set -uo pipefail
OUT=${OUT:-runs/gpu}
BATCHES=${BATCHES:-1 65536 1048576}
PROFILE_BATCH=${PROFILE_BATCH:-1048576}
ENVS=${ENVS:-65536}
mkdir -p "$OUT" "$OUT/profiles"
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
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  step "the Pallas kernels' tests and the class path's parity tests on the device"
  # (a GPU compiles each test's programs: the thirtieth round's 80 s ran 9 of the 11 tests)
  if ! timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
      tests/test_kernel.py -k "gpu_kernels or compiled or parity_with_python_reference or class_counts_equal or merged_batch_equals or barrier_as_fence" \
      2>&1 | tail -25; then
    echo "!!! a test failed or ran out of time: the later steps' records say which class path ran"
  fi
  step "the class path's per-row forms alone, and lj.evaluate with and without the kernel"
  timeout 110 python3 benchmarks/class_kernels.py --batch "$PROFILE_BATCH" --variants \
    --evaluate-parity 4096 --out "$OUT/class_kernels_gpu.json" 2>&1 | quiet
  step "kernels of one call"
  timeout 55 python3 benchmarks/profile_evaluate.py --batch "$PROFILE_BATCH" \
    --out "$OUT/profiles/profile_evaluate_gpu.json" 2>&1 | quiet
  step "kernels of one call as before the thirtieth round (XLA's class path, no fences)"
  timeout 55 python3 benchmarks/profile_evaluate.py --batch "$PROFILE_BATCH" --xla-class-path \
    --no-barrier --out "$OUT/profiles/profile_evaluate_before_gpu.json" 2>&1 | quiet
  step "throughput"
  timeout 150 python3 benchmarks/evaluate_throughput.py --batches $BATCHES --reference-plans 20 \
    --single-call-trials 0 --out "$OUT/evaluate_throughput_gpu.json" 2>&1 | quiet
  step "Fleet-v0"
  timeout 50 python3 benchmarks/env_throughput.py --envs "$ENVS" \
    --out "$OUT/env_throughput_gpu.json" 2>&1 | quiet
  step done
} 2>&1 | tee "$OUT/log.txt"
tar -C "$OUT" -czf "$OUT/profiles.tgz" profiles && rm -rf "$OUT/profiles"
