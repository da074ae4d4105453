#!/usr/bin/env bash
# session 27 call 6: final validation on the final kernels: GPU suite + prefill qsa check shards (together), then memchecks
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g18
git rev-parse HEAD > $OUT/g18/tree.txt 2>&1
t=$SECONDS
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 5 330 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests > $OUT/g18/tests_gpu_suite.log 2>&1 &
P1=$!
for f in prefill/ordinary prefill/chunk prefill/paged; do
  timeout -k 5 330 python3 -m interop.validate.cli check --full --peer sglang --filter "$f/" --json $OUT/g18/check_${f//\//_}.json > $OUT/g18/check_${f//\//_}.log 2>&1 &
done
wait $P1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g18/tests_gpu_suite.log
wait; for f in $OUT/g18/check_*.log; do echo "$(basename $f): $(tail -n 1 $f)"; done; echo "check done $((SECONDS-t))s"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
t=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 150 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_prefill.py tests/test_prefill_union.py -k "fp8_paged_lying or junk_fp8" > $OUT/g18/memcheck_fp8_prefill.log 2>&1; echo "memcheck rc=$? $((SECONDS-t))s"
grep -E "ERROR SUMMARY|passed|failed" $OUT/g18/memcheck_fp8_prefill.log | tail -n 3
cd $OUT && tar czf g18.tgz g18 && rm -rf g18
