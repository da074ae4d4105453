#!/usr/bin/env bash
# session 26 call 4: union/prefill GPU tests on b3e3b44; Pallas J0 breakdown (scratch)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g11
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_prefill_union.py tests/test_triton_prefill.py tests/test_pallas_prefill.py tests/test_conformance_triton.py tests/test_conformance_pallas.py > $OUT/g11/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g11/tests.log
t=$SECONDS
timeout -k 5 200 python3 .cand/pj0.py > $OUT/g11/pj0.log 2>&1; echo "pj0 rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g11/pj0.log | tail -n 30
cd $OUT && tar czf g11.tgz g11 && rm -rf g11
