#!/usr/bin/env bash
# session 26 call 3 (tree b3e3b44): union GPU tests + memcheck on the wait-one change, then the full union step
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g10
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 150 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_prefill_union.py tests/test_prefill.py > $OUT/g10/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g10/tests.log
t=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 100 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_union.py -k "lying_metadata_junk_fp8" > $OUT/g10/memcheck_junk.log 2>&1; echo "memcheck junk rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g10/memcheck_junk.log
t=$SECONDS
timeout -k 5 100 "$SAN" --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_prefill_union.py -k "rows_beside_it" > $OUT/g10/memcheck_graph.log 2>&1; echo "memcheck graph rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g10/memcheck_graph.log
mkdir -p $OUT/g10/union
OUT=$OUT/g10/union timeout -k 5 330 bash bench/run_gpu.sh union | tail -n 3
grep -v warn $OUT/g10/union/union.log | grep -i "must\|PASS\|FAIL\|geomean" | head -30
cd $OUT && tar czf g10.tgz g10 && rm -rf g10
