#!/usr/bin/env bash
# session 27 call 5: paged decode plans with 8 warps and BLOCK_N 64 (BF16 and FP8 pools)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g17
t=$SECONDS
timeout -k 5 200 python3 .cand/pagedsweep3.py 10 1,4,16,64,128 TP1,TP2 > $OUT/g17/paged_w8.log 2>&1; echo "sweep rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g17/paged_w8.log | grep -E "  TP|FAIL" | head -120
cd $OUT && tar czf g17.tgz g17 && rm -rf g17
