#!/usr/bin/env bash
# session 27 call 2: FP8 paged decode, BLOCK_N 64 with V converted in its load layout
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g14
t=$SECONDS
timeout -k 5 200 python3 .cand/fp8sweep.py 12 1,4,16,64,128 TP1,TP2 > $OUT/g14/fp8sweep2.log 2>&1; echo "fp8sweep rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g14/fp8sweep2.log | grep -E "  TP|FAIL" | head -60
cd $OUT && tar czf g14.tgz g14 && rm -rf g14
