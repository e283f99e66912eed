#!/usr/bin/env bash
# One lent GPU's checks and measurements in one call (docs/performance.md, "On one H100",
# the thirtieth and thirty-fifth rounds): the CUDA kernel's tests and the class path's
# parity tests against the plain-Python reference on the device, the class path's forms
# alone (class_kernels.py: the CUDA kernel, the Pallas ones, lj.evaluate's parity with and
# without the kernel), the throughput (evaluate_throughput.py), one call's kernels
# (profile_evaluate.py) and the Fleet environment (env_throughput.py).
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh      # from the repository's root
#
# BATCHES (default "1 65536 1048576"), PROFILE_BATCH (1048576) and ENVS (65536) set the
# sizes; CLASS_KERNELS_ARGS (e.g. --no-pallas) and THROUGHPUT_ARGS (e.g. "--block-groups 0")
# pass more options. The CUDA kernel runs where physics/_cuda_kernels.so was built (carry
# it: `LIBRATIO_BUILD_CUDA=1 python setup.py build_ext --inplace` here, nvcc needed).
# Needs JAX with a GPU backend, flax, optax, chex, pytest and hypothesis where it runs; the
# project's other dependencies (orjson, msgspec) as wheels in .whl/ if they are missing
# there (installed into /tmp/site). Everything printed also goes to $OUT/log.txt; results
# are written under $OUT (at most 8 files come back from the device tool: the profiles and
# their traces are packed into profiles.tgz). Its steps' limits add up to 525 s (the device
# tool allows 600 s a command). LIBRATIO_GPU_KERNELS=0 in the environment runs every step
# with XLA's class path, LIBRATIO_CUDA_KERNELS=0 with the Pallas kernel.
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
  python3 -c "from libratio_jax.physics import cuda_kernels as c; print('cuda kernel', c.status())"
  step "the CUDA kernel's tests, the class path's parity with the Python reference"
  if ! timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py \
      tests/test_kernel.py -k "cuda or parity_with_python_reference" --tb=short 2>&1 \
      | tail -60; then
    echo "!!! a test failed or ran out of time"
  fi
  step "the class path's forms alone (CUDA, Pallas), lj.evaluate with the kernel and without"
  timeout 120 python3 benchmarks/class_kernels.py --batch "$PROFILE_BATCH" ${CLASS_KERNELS_ARGS:-} \
    --evaluate-parity 4096 --out "$OUT/class_kernels_gpu.json" 2>&1 | quiet
  step "throughput"
  timeout 150 python3 benchmarks/evaluate_throughput.py --batches $BATCHES --reference-plans 20 \
    ${THROUGHPUT_ARGS:-} \
    --single-call-trials 0 --out "$OUT/evaluate_throughput_gpu.json" 2>&1 | quiet
  step "kernels of one call"
  timeout 55 python3 benchmarks/profile_evaluate.py --batch "$PROFILE_BATCH" \
    --out "$OUT/profiles/profile_evaluate_gpu.json" 2>&1 | quiet
  step "Fleet-v0"
  timeout 50 python3 benchmarks/env_throughput.py --envs "$ENVS" \
    --out "$OUT/env_throughput_gpu.json" 2>&1 | quiet
  step done
} 2>&1 | tee "$OUT/log.txt"
tar -C "$OUT" -czf "$OUT/profiles.tgz" profiles && rm -rf "$OUT/profiles"
