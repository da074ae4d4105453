#!/usr/bin/env bash
# session 27 call 4: Pallas per-row prefill FP8 V in its load layout (HEAD) vs HEAD~1 (.cand/old); Pallas GPU tests
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g16
t=$SECONDS
timeout -k 5 300 python3 -m bench.prefill --mode union --providers pallas-union,ours-union --sections fp8 --jaccards 0.9,0.0 --rounds 6 --compare .cand/old --json $OUT/g16/pallas_fp8_compare.json > $OUT/g16/pallas_fp8_compare.log 2>&1; echo "compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g16/pallas_fp8_compare.log | tail -n 20
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_pallas_prefill.py tests/test_conformance_pallas.py tests/test_prefill_union.py > $OUT/g16/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g16/tests.log
cd $OUT && tar czf g16.tgz g16 && rm -rf g16
