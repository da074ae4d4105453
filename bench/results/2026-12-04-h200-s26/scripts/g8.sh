#!/usr/bin/env bash
# session 26 call 1: GPU tests (whole suite), qsa check prefill shards, memcheck of the union path
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g8
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
t=$SECONDS
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 5 400 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests > $OUT/g8/tests.log 2>&1 &
for f in prefill/ordinary prefill/chunk prefill/paged; do
  timeout -k 5 400 python3 -m interop.validate.cli check --full --peer sglang --filter "$f/" --json "$OUT/g8/check_${f//\//_}.json" > "$OUT/g8/check_${f//\//_}.log" 2>&1 &
done
wait
echo "tests+check $((SECONDS-t))s"
t=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 150 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_union.py -k "lying_metadata_junk_fp8 or rows_beside_it" > $OUT/g8/memcheck_union.log 2>&1; echo "memcheck rc=$? $((SECONDS-t))s"
tail -n 5 $OUT/g8/tests.log; grep -h -i "passed\|failed\|error" $OUT/g8/check_*.log | tail -n 6; tail -n 4 $OUT/g8/memcheck_union.log
cd $OUT && tar czf g8.tgz g8 && rm -rf g8
