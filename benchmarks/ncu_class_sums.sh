#!/usr/bin/env bash
# Nsight Compute's counters of one call of the CUDA class-sums kernel
# (physics/cuda_kernels.py) on a lent NVIDIA GPU: throughput against the chip's peaks,
# occupancy, where warps stall, memory traffic, and the SASS with its stall samples.
#
#   OUT=/some/folder bash benchmarks/ncu_class_sums.sh      # from the repository's root
#
# BATCH (default 262144) plans of the reference scenario.
# Writes $OUT/ncu_details.txt and $OUT/ncu_sass.csv.
set -uo pipefail
OUT=${OUT:-runs/ncu}
BATCH=${BATCH:-262144}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu here"; exit 1; }
"$NCU" --target-processes all -k regex:ClassSums -c 1 -f -o "$OUT/class_sums" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section InstructionStats --section SourceCounters \
  python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import jax, class_kernels as K
from libratio_jax.physics import cuda_kernels as CK
assert CK.status().used, CK.status()
grid, ids, args = K._inputs($BATCH)
f = jax.jit(lambda i, *a: CK.class_sums(grid, i, *a))
jax.block_until_ready(f(ids, *args))
" > "$OUT/ncu_run.txt" 2>&1
tail -5 "$OUT/ncu_run.txt"
"$NCU" -i "$OUT/class_sums.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
"$NCU" -i "$OUT/class_sums.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu_sass.csv" 2>&1
rm -f "$OUT/class_sums.ncu-rep"
wc -l "$OUT/ncu_details.txt" "$OUT/ncu_sass.csv"
