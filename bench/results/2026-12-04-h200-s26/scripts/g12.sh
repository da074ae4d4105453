#!/usr/bin/env bash
# session 26 call 5: deferred row sum in both Pallas prefill kernels (working tree) vs HEAD (.cand/old)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
t=$SECONDS
timeout -k 5 200 python3 -m bench.prefill --providers pallas --sections matrix --rounds 8 --compare .cand/old --json $OUT/rows_compare.json > $OUT/rows_compare.log 2>&1; echo "rows compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/rows_compare.log | tail -n 12
t=$SECONDS
timeout -k 5 260 python3 -m bench.prefill --mode union --providers pallas-union --sections matrix --jaccards 0.9,0.0 --rounds 5 --compare .cand/old --json $OUT/union_compare.json > $OUT/union_compare.log 2>&1; echo "union compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/union_compare.log | tail -n 21
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 100 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_pallas_prefill.py tests/test_prefill_union.py tests/test_conformance_pallas.py > $OUT/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/tests.log
