#!/usr/bin/env bash
# The QSA indexer on the H200 (issue 18), one command for the lead:
#   OUT=/path/to/results bash bench/gpu_indexer.sh
# 1. GPU tests (tests/test_indexer.py -m gpu): 7 decode shapes from B 1..128 x 8k..256k compiled,
#    integer-valued inputs, token rows equal to the FP64 reference on sampled rows, Pallas equal
#    to Triton, topk + standalone expansion equal to the fused path; FP8 keys and the adversarial
#    batch; CUDA-graph replay with changed context lengths; prefill 8192 rows at 32k/128k.
#                                                     -> $OUT/indexer_gpu_tests.{xml,log}
# 2. compute-sanitizer memcheck of the small all-kernel test (junk page tables, straddling
#    prefill tiles, rows past the keys, every expansion kernel path).
#                                                     -> $OUT/indexer_memcheck.log
# 3. bench/indexer.py in two halves (each < 10 min): decode 8k/32k + prefill, decode 128k/256k.
#                                                     -> $OUT/indexer_{a,b}.{json,log}
# Exit status non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
export PYTHONUNBUFFERED=1
rc=0

timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py \
    --junitxml="$OUT/indexer_gpu_tests.xml" 2>&1 | tee "$OUT/indexer_gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU tests FAILED"; rc=1; }

SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -n "$SAN" ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 480 "$SAN" --tool memcheck --error-exitcode 9 \
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k sanitizer_small \
      2>&1 | tee "$OUT/indexer_memcheck.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "memcheck FAILED"; rc=1; }
else
  echo "compute-sanitizer not found: memcheck skipped" | tee "$OUT/indexer_memcheck.log"
fi

timeout 590 python3 -m bench.indexer --out "$OUT/indexer_a.json" --contexts 8192,32768 \
    2>&1 | tee "$OUT/indexer_a.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench (a) FAILED"; rc=1; }
timeout 590 python3 -m bench.indexer --out "$OUT/indexer_b.json" --contexts 131072,262144 \
    --prefill-contexts "" 2>&1 | tee "$OUT/indexer_b.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench (b) FAILED"; rc=1; }
echo "gpu_indexer.sh exit $rc"
exit $rc
