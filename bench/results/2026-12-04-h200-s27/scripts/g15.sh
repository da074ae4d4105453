#!/usr/bin/env bash
# session 27 call 3: Triton per-row prefill, FP8 V converted in its load layout (working tree) vs main (.cand/old)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g15
t=$SECONDS
timeout -k 5 240 python3 -m bench.prefill --mode union --providers ours-union,ours-rows --sections fp8 --jaccards 0.9,0.0 --rounds 8 --compare .cand/old --json $OUT/g15/fp8_compare.json > $OUT/g15/fp8_compare.log 2>&1; echo "fp8 compare rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g15/fp8_compare.log | tail -n 20
t=$SECONDS
t=$SECONDS
OMP_NUM_THREADS=1 timeout -k 5 150 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_triton_prefill.py tests/test_prefill_union.py tests/test_conformance_triton.py > $OUT/g15/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 2 $OUT/g15/tests.log
cd $OUT && tar czf g15.tgz g15 && rm -rf g15
