#!/usr/bin/env bash
# session 28 call 1: the pending GPU-only FP8 NaN test; paged decode pipeline-depth sweep (BF16 10 stages, FP8 10/13 stages)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g20
git rev-parse HEAD > $OUT/g20/tree.txt 2>&1
t=$SECONDS
timeout -k 5 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_prefill.py tests/test_pallas_prefill.py -k "attended_nan" > $OUT/g20/tests_nan.log 2>&1; echo "tests rc=$? $((SECONDS-t))s"; tail -n 3 $OUT/g20/tests_nan.log
t=$SECONDS
timeout -k 5 330 python3 .cand/stsweep.py 12 16,32,64,128 TP1 > $OUT/g20/stsweep_tp1.log 2>&1; echo "sweep1 rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL|Error" $OUT/g20/stsweep_tp1.log | head -60
t=$SECONDS
timeout -k 5 150 python3 .cand/stsweep.py 12 64,128 TP2 > $OUT/g20/stsweep_tp2.log 2>&1; echo "sweep2 rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL|Error" $OUT/g20/stsweep_tp2.log | head -40
cd $OUT && tar czf g20.tgz g20 && rm -rf g20
