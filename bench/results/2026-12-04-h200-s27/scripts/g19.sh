#!/usr/bin/env bash
# session 27 call 7: Pallas paged decode, FP8 V converted in its load layout (select on/off, one process)
export PYTHONPATH=$PWD QSA_SGLANG_PATH=$PWD/.peer/sglang PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
mkdir -p $OUT/g19
t=$SECONDS
timeout -k 5 170 python3 .cand/pallas_paged_fp8.py 8 16,128 TP1,TP2 > $OUT/g19/pallas_paged_fp8.log 2>&1; echo "sweep rc=$? $((SECONDS-t))s"
grep -v -i warn $OUT/g19/pallas_paged_fp8.log | grep -E "TP|Error|error" | head -60
cd $OUT && tar czf g19.tgz g19 && rm -rf g19
