#!/usr/bin/env bash
# The one command the lead runs on the H200 for the Triton sparse prefill (issue 4):
#   OUT=/path/to/results bash bench/gpu_prefill.sh
# 0. Parallel warm-up compile of every kernel the next steps launch (bench/prefill_warm.py)
#                                                   -> $OUT/prefill_warm.log
# 1. GPU tests (tests/test_triton_prefill.py -m gpu): 8192-row ordinary/chunk at KV 8k/32k/128k,
#    (6,1) (12,1) (24,2), within rtol=atol=2e-2 and rel L2 <= 5e-3 of a float32 reference,
#    finite, second run bitwise equal; paged FP8 on a side stream; CUDA-graph replay with changed
#    lengths; the pair and quad kernels.            -> $OUT/prefill_gpu_tests.{xml,log}
#    Then the small CPU-suite cases compiled for the GPU (junk indices, FP8, paged, pairs, quads)
#                                                   -> $OUT/prefill_small_tests_on_gpu.log
# 2. Benchmark (bench/prefill.py): ours vs upstream (its own geometry) vs gather+SDPA, 8192 rows x
#    3 head pairs x 3 KV lengths (+ the experimental pair/quad kernels, torch.sort and tl.sort
#    pre-sorts, and their union pre-passes alone), query-count sweep 32..8192 (12/1 and 6/1),
#    paged pre-pass vs inline. Summary keys: geomean_speedup_vs_upstream_8192 (default kernel),
#    pairs_/quads_geomean_speedup_vs_upstream_8192, slower_than_upstream_at_ge_512_rows.
#                                                   -> $OUT/prefill_bench.json, prefill_bench.log
# 3. SM90 geometry sweep (BLOCK_N 16/32/64 x warps 1/2/4/8 x 2 stages, + 3 stages for BLOCK_N <= 32
#    with 2/4 warps, at total_q 32..8192, G 12;
#    a 'recommended_sm90_table' is computed from it).
#                                                   -> $OUT/prefill_geometry_sweep.json, .log
# 4. compute-sanitizer memcheck of paged/ordinary/chunk calls with junk indices and junk slots,
#    per-row kernel (pre-pass and inline slots, bf16 and FP8) and the pair/quad kernels.
#                                                   -> $OUT/prefill_memcheck.log
# Triton vs Pallas on the same buffers (not in this script, JAX compiles take long):
#   python3 -m bench.prefill --matrix-only --pallas
# Budget: expected ~6 minutes (not measured: written without GPU access); the per-step timeouts add up to 480 s. JSON is rewritten after
# every case, so a step cut by its timeout still leaves its partial data.
# Exit status non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export OUT
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
# compiled kernels kept in the (git-ignored) build/ folder: a second run on a warm machine skips
# most compiles
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/build/triton-cache}"
# if jax gets imported (optional Pallas provider), it must not grab 75% of the GPU up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
rc=0

python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())" \
    2>&1 | tee "$OUT/prefill_env.log"

# 0. compile everything the later steps launch, in parallel processes (shared TRITON_CACHE_DIR)
timeout 80 python3 -m bench.prefill_warm 2>&1 | tee "$OUT/prefill_warm.log"

timeout 100 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_triton_prefill.py \
    --junitxml="$OUT/prefill_gpu_tests.xml" 2>&1 | tee "$OUT/prefill_gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU tests FAILED"; rc=1; }
# the small (CPU-suite) cases too, compiled for the GPU: real out-of-bounds reads would fault here
timeout 40 python3 -m pytest -q -m "not gpu" -p no:cacheprovider tests/test_triton_prefill.py \
    tests/test_geometry.py 2>&1 | tee "$OUT/prefill_small_tests_on_gpu.log"
st=${PIPESTATUS[0]}
[ "$st" -eq 0 ] || [ "$st" -eq 124 ] || { echo "small tests on the GPU FAILED"; rc=1; }
[ "$st" -ne 124 ] || echo "small tests on the GPU: timed out (see log; not counted as a failure)"

timeout 120 python3 -m bench.prefill 2>&1 | tee "$OUT/prefill_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark FAILED (tolerance or crash)"; rc=1; }

timeout 60 python3 -m bench.prefill --sweep-geometry 2>&1 | tee "$OUT/prefill_geometry_sweep.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "geometry sweep FAILED"; rc=1; }

SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
# warm the Triton cache outside the sanitizer (compiles are slow under it)
timeout 30 python3 -m bench.prefill_memcheck > "$OUT/prefill_memcheck_warm.log" 2>&1 \
    || { echo "memcheck script FAILED outside the sanitizer"; rc=1; }
if [ -n "$SAN" ]; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 50 "$SAN" --tool memcheck --error-exitcode 99 \
        python3 -m bench.prefill_memcheck 2>&1 | tee "$OUT/prefill_memcheck.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "compute-sanitizer memcheck FAILED"; rc=1; }
else
    echo "compute-sanitizer not found: memcheck step skipped" | tee "$OUT/prefill_memcheck.log"
fi
echo "gpu_prefill.sh exit $rc"
exit $rc
