#!/usr/bin/env bash
# session 29 call 1: FP8 paged decode occupancy sweep (maxnreg 168 / 128 with splits sized for 3 / 4 programs an SM)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g26
t=$SECONDS
timeout -k 5 420 python3 .cand/regsweep.py 15 16,32,64,128 TP1,TP2 fp8,bf16 > $OUT/g26/regsweep.log 2>&1; echo "sweep rc=$? $((SECONDS-t))s"
grep -E "^  |FAIL" $OUT/g26/regsweep.log
cd $OUT && tar czf g26.tgz g26 && rm -rf g26
